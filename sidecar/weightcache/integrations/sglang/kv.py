"""SGLang's KV baseline with the daemon's bytes added rank-local, then the MIN.

SGLang samples free memory before the model loads and takes the MIN over its
ranks (``bootstrap.measure_pre_model_load_memory``); after loading, the
scheduler passes the loaders' ``preloaded_weights_bytes`` (target plus draft)
to ``ModelRunner.account_preloaded_weights``, which adds them onto that MIN'd
baseline. That equals the right order (:mod:`weightcache.kv`: each rank adds
its own bytes to its own sample, *then* the MIN) only when every rank holds
the same bytes; with uneven shards (vocabulary or experts, a draft on one
rank) each rank would size its pool from another rank's sample plus its own
bytes, and the ranks would disagree.

Two SGLang plugin hooks (registered by :func:`weightcache.integrations.sglang.register`)
fix the order when the weightcache loader is in use: one keeps this rank's
own sample when SGLang measures, one replaces the addition by
:class:`weightcache.kv.KVBaseline`'s correct-then-MIN over the same group.
Runners of other loaders keep SGLang's own behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weightcache.kv import KVBaseline

GiB = 1 << 30
MEASURE = "sglang.srt.distributed.bootstrap.measure_pre_model_load_memory"
ACCOUNT = "sglang.srt.model_executor.model_runner.ModelRunner.account_preloaded_weights"


@dataclass
class LocalSample:
    """This rank's own pre-load sample (GiB, as SGLang measures) and the MIN's group."""

    free_gib: float
    group: Any = None  # SGLang's world cpu_group; None when it took no MIN


# One target runner per scheduler process (one process per rank).
_sample: LocalSample | None = None


def record_sample(sample: LocalSample | None) -> None:
    global _sample
    _sample = sample


def measure_keeping_local(original, *args: Any, **kwargs: Any) -> float:
    """AROUND ``measure_pre_model_load_memory``: SGLang's MIN'd value, plus this rank's own."""
    result = original(*args, **kwargs)
    if not kwargs.get("is_draft_worker", False):
        from sglang.srt.distributed import bootstrap

        world = bootstrap.get_world_group()
        local = bootstrap.get_available_gpu_memory(
            kwargs.get("device", args[0] if args else None), bootstrap.get_device().gpu_id
        )
        record_sample(LocalSample(local, world.cpu_group if world.world_size > 1 else None))
    return result


def corrected_baseline_gib(sample: LocalSample, preloaded_weights_bytes: int) -> float:
    """MIN over the ranks of (own sample + own preloaded bytes), in GiB (collective)."""
    baseline = KVBaseline(int(sample.free_gib * GiB))
    baseline.account_preloaded_weights(preloaded_weights_bytes)
    return baseline.min_across_ranks(group=sample.group) / GiB


def account_rank_local(original, runner: Any, preloaded_weights_bytes: int) -> None:
    """AROUND ``ModelRunner.account_preloaded_weights``: the correct order for our loader."""
    from weightcache.integrations.sglang.loader import WeightcacheModelLoader

    if not isinstance(getattr(runner, "loader", None), WeightcacheModelLoader) or _sample is None:
        return original(runner, preloaded_weights_bytes)
    runner.pre_model_load_memory = corrected_baseline_gib(_sample, preloaded_weights_bytes)
    return None
