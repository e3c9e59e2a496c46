"""SGLang's own layouts, loaded both ways, in a rank process of SGLang's own groups.

``python -m tests.engines.sglang_layout_kit RANK WORLD PORT OUT JOB...`` (JOB:
``KIND=MODEL_DIR=DTYPE=SOCKET_DIR``) is one tensor-parallel rank, set up as
SGLang's scheduler sets up its process (``publish`` of its server arguments,
``init_parallel_runtime``: SGLang's own process groups, gloo on CPU). Per job
it loads the model through our loader (from this rank's daemon at
``<SOCKET_DIR>/tests.tiny/cpu.sock``) and through SGLang's own
``DefaultModelLoader``, and writes to OUT what the tests assert: the
parameters that differ, those outside the daemon's memory (read from their
own storages), what the loader reported and the adapter's WARNINGs. A
process of its own because SGLang's parallel runtime is built once per
process.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def rotary_kernel_stand_in() -> None:
    """SGLang builds a rotary embedding (Llama, Qwen2, Mixtral, Qwen2-MoE) with vLLM's
    kernel where the platform is neither CUDA nor SGLang's CPU engine (which needs a CPU
    build of sgl-kernel that PyPI does not carry): it imports
    ``vllm._custom_ops.rotary_embedding`` in the layer's constructor and calls it only in
    forward. These loads never run forward; a stand-in that refuses to run lets SGLang
    build the model (a mock of a kernel that cannot exist here, never called)."""
    import types

    def rotary_embedding(*args, **kwargs):
        raise RuntimeError("vLLM's rotary kernel is not installed; loading does not run it")

    stand_in = types.ModuleType("vllm._custom_ops")
    stand_in.rotary_embedding = rotary_embedding
    sys.modules.setdefault("vllm._custom_ops", stand_in)  # not `vllm`: find_spec stays None


DECODERS = ("llama", "qwen2", "mixtral", "qwen2_moe")  # tiny_models: models with a KV cache
CONFIG = "weightcache"  # the adapter's key in SGLang's --model-loader-extra-config
CACHE = "tests.tiny"  # the WeightCache a rank's daemon serves: <socket_dir>/tests.tiny/cpu.sock


def publish_rank(
    model_dir: str, world: int, rank: int, port: int, dtype: str, *args: str, resolve=None
):
    """SGLang's process-wide config and groups for this rank, as its scheduler does, and
    its server arguments. ``args``: more of SGLang's server arguments; ``resolve``: what
    SGLang's launch runs on them before publishing (e.g. its LoRA checks)."""
    import os

    from sglang.srt.distributed import bootstrap
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(
        ["--model-path", model_dir, "--device", "cpu", "--tp-size", str(world),
         "--dtype", dtype, "--skip-tokenizer-init", *args]
    )  # fmt: skip
    # SGLang binds each CPU rank's threads to cores: one NUMA node per rank by default, or
    # the cores this names (one core per rank here).
    cores = os.cpu_count() or 1
    os.environ.setdefault(
        "SGLANG_CPU_OMP_THREADS_BIND", "|".join(str(r % cores) for r in range(world))
    )
    # The venv's CUDA wheels carry NCCL, so SGLang's groups would open a NCCL communicator on
    # a machine without a GPU; SGLang's own variable naming no library gives the non-GPU
    # environment SGLang provides for (pynccl disabled: gloo alone).
    os.environ.setdefault("SGLANG_NCCL_SO_PATH", "/nonexistent/libnccl.so.2")
    if resolve is not None:
        resolve(server_args)
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=rank))
    bootstrap.init_parallel_runtime(server_args=server_args, device="cpu", dist_port=port)
    return server_args


def load_ours(model_dir: str, dtype: str, rank: int, extra: dict):
    """(loader, model, ModelConfig): the model through our loader, by SGLang's lookup for
    the launcher's route."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import get_model_loader

    from weightcache.integrations.sglang.loader import WeightcacheModelLoader

    model_config = ModelConfig(model_path=model_dir, dtype=dtype)
    loader = get_model_loader(
        LoadConfig(load_format=WeightcacheModelLoader, tp_rank=rank,
                   model_loader_extra_config={CONFIG: extra})
    )  # fmt: skip
    model = loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))
    return loader, model, model_config


def load_ours_and_cold(model_dir: str, dtype: str, rank: int, extra: dict):
    """The model through our loader and through SGLang's own DefaultModelLoader."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import get_model_loader

    loader, model, model_config = load_ours(model_dir, dtype, rank, extra)
    cold = get_model_loader(LoadConfig(tp_rank=rank)).load_model(
        model_config=model_config, device_config=DeviceConfig("cpu")
    )
    return loader, model, cold


def outcome(kind: str, loader, model, cold) -> dict:
    import torch

    from tests.engines.enginekit import engine_memory, in_daemon_memory

    layout = loader._layout
    ours, theirs = dict(model.named_parameters()), dict(cold.named_parameters())
    result = {
        "kind": kind,
        "names": sorted(ours),
        "cold_names": sorted(theirs),
        "shapes": {n: list(p.shape) for n, p in ours.items()},
        "differ": sorted(n for n in ours if n in theirs and not torch.equal(ours[n], theirs[n])),
        "preloaded": loader.preloaded_weights_bytes,
        "layout": None,
        "reason": None if layout is None else layout.reason,
    }
    if layout is None or layout.attached is None:
        return result
    in_daemon = in_daemon_memory(layout.attached)
    return {
        **result,
        "layout": layout.attached.config.plan,
        "layout_bytes": layout.layout_bytes,
        "daemon_bytes_change": layout.daemon_bytes_change,
        "outside": sorted(n for n, p in ours.items() if not in_daemon(p)),
        "mapped_bytes": sum(p.numel() * p.element_size() for p in ours.values() if in_daemon(p)),
        **engine_memory(ours, in_daemon, layout.attached.tensors),
        "total_bytes": sum(p.numel() * p.element_size() for p in ours.values()),
        "reported": loader.layout_load.copied,
        "reported_mapped_bytes": loader.layout_load.mapped_bytes,
        "reported_copied_bytes": loader.layout_load.copied_bytes,
    }


def kv_size(loader, model, model_config, server_args, gpu, *, held_at_sample: int,
            held_after_load: int, engine_weights: int) -> dict:  # fmt: skip
    """SGLang's own KV pool sizing of ``model`` (loaded by ``loader``) on the synthetic ``gpu``
    (tests/engines/kv_kit.py), in the order of its scheduler: the pre-load sample while the
    daemon holds ``held_at_sample`` bytes, the load (the daemon then holding
    ``held_after_load``, the engine having allocated ``engine_weights``), the scheduler's
    ``account_preloaded_weights`` of the loader's bytes, the pool configurator. With the
    plugins loaded, our hooks on the sample and the accounting run as in a server."""
    from sglang.srt.distributed import bootstrap
    from sglang.srt.model_executor import model_runner as runners

    runner = object.__new__(runners.ModelRunner)  # its constructor starts the whole engine
    with gpu.installed():
        gpu.others = held_at_sample
        # ModelRunner.init_torch_distributed
        runner.pre_model_load_memory = bootstrap.measure_pre_model_load_memory(
            device="cuda", is_draft_worker=False
        )
        gpu.others = held_after_load
        gpu.allocate(engine_weights)  # ModelRunner.load_model
        runner.loader, runner.model, runner.model_config = loader, model, model_config
        runner.account_preloaded_weights(runner.preloaded_weights_bytes)  # the scheduler
        # What the constructor and initialize() set before the pool is sized.
        runner.device, runner.gpu_id, runner.server_args = "cuda", 0, server_args
        runner.is_draft_worker, runner.draft_model_idx, runner.draft_attention_backend = (
            False, None, None,
        )  # fmt: skip
        runner.spec_algorithm = runners.SpeculativeAlgorithm.from_string(
            runners.get_spec().speculative_algorithm
        )
        runner.page_size = runners.get_schedule().page_size
        runner.req_to_token_pool = runner.token_to_kv_pool_allocator = None
        runner.memory_pool_config = runner.forward_stream = None
        runner.is_hybrid_swa = model_config.is_hybrid_swa
        runner.is_hybrid_swa_compress = model_config.is_hybrid_swa_compress
        runner.use_mla_backend = model_config.attention_arch == runners.AttentionArch.MLA
        runner.pp_group = runners.get_parallel().pp_group
        runner.dtype = model_config.dtype
        runner.sliding_window_size = runners.resolve_sliding_window_size(model, model_config)
        runner.init_spec_aux_hidden_state()
        runner.layer_info = runners.resolve_layer_indices(
            model=model, model_config=model_config, is_draft_worker=False, draft_model_idx=None
        )
        runner.configure_kv_cache_dtype()
        runner.init_kv_cache_configurator()
        configurator = runner.kv_cache_configurator
        available = configurator._profile_available_bytes(runner.pre_model_load_memory)
        pool = configurator._resolve_memory_pool_config(runner.pre_model_load_memory)
    return {
        "pre_model_load_gib": runner.pre_model_load_memory,
        "available_bytes": available,
        "max_total_num_tokens": pool.max_total_num_tokens,
    }


def kv_outcome(model_dir: str, dtype: str, extra: dict, server_args, loader, model, cold) -> dict:
    """SGLang's KV pool with weightcache and on a cold start (``kv_size``), for what a TP 1
    test asserts: on the layout's first start (``loader``'s load: the daemon built the
    layout and dropped its checkpoint layout after SGLang's sample), on a restart (a second
    engine start on the same daemon, which holds the layout), and had the loader reported
    the checkpoint layout's bytes or nothing."""
    from unittest import mock

    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import get_model_loader

    from tests.engines.enginekit import in_daemon_memory
    from tests.engines.kv_kit import (
        SyntheticGpu,
        cold_weight_bytes,
        distinct_parameters,
        layout_bytes,
        rounding_difference,
    )
    from weightcache.integrations import layouts, loading
    from weightcache.integrations.sglang.loader import WeightcacheModelLoader

    model_config = ModelConfig(model_path=model_dir, dtype=dtype)
    first = loader._layout
    cold_params = distinct_parameters(cold)

    def own_bytes(engine_model, layout) -> int:  # what the engine allocated itself
        in_daemon = in_daemon_memory(layout.attached)
        return cold_weight_bytes(p for p in distinct_parameters(engine_model) if not in_daemon(p))

    def sized(engine_loader, engine_model, at_sample: int, after_load: int, own: int) -> dict:
        return kv_size(
            engine_loader, engine_model, model_config, server_args, SyntheticGpu(),
            held_at_sample=at_sample, held_after_load=after_load, engine_weights=own,
        )  # fmt: skip

    own_first = own_bytes(model, first)  # before the restart closes this start's mappings
    loading.forget_attachments()
    layouts.forget_layouts()
    again = get_model_loader(
        LoadConfig(load_format=WeightcacheModelLoader, model_loader_extra_config={CONFIG: extra})
    )
    restarted = again.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))
    second = again._layout
    held = second.daemon_bytes_after
    result = {
        "planned": sorted((p.name, p.dtype, list(p.shape)) for p in first.report.plan.params),
        "cold_params": sorted(
            (n, str(p.dtype).removeprefix("torch."), list(p.shape))
            for n, p in cold.named_parameters(remove_duplicate=True)
        ),
        "parameters": len(cold_params),
        "layout_bytes": first.layout_bytes,
        "layout_bytes_of_cold": layout_bytes(cold_params),
        "rounding_difference": rounding_difference(cold_params),
        "daemon_before_first": first.daemon_bytes_before,
        "daemon_after_first": first.daemon_bytes_after,
        "daemon_before_restart": second.daemon_bytes_before,
        "preloaded_first": loader.preloaded_weights_bytes,
        "preloaded_restart": again.preloaded_weights_bytes,
        "engine_own": own_first + own_bytes(restarted, second),
        "cold": sized(get_model_loader(LoadConfig()), cold, 0, 0, cold_weight_bytes(cold_params)),
        "first_start": sized(
            loader, model, first.daemon_bytes_before, first.daemon_bytes_after, own_first
        ),
        "restart": sized(again, restarted, held, held, own_bytes(restarted, second)),
    }
    for name, wrong in (("checkpoint_layout", first.daemon_bytes_before), ("nothing", 0)):
        with mock.patch.object(WeightcacheModelLoader, "preloaded_weights_bytes", wrong):
            result[f"reporting_{name}"] = sized(again, restarted, held, held, 0)
    return result


@contextmanager
def adapter_warnings() -> Iterator[list[str]]:
    """The WARNINGs the adapter (``weightcache.*`` loggers) logs meanwhile, in order."""
    import logging

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    messages: list[str] = []
    handler, logger = Collect(logging.WARNING), logging.getLogger("weightcache")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def run_rank(rank: int, world: int, port: int, out: Path, jobs: list[str]) -> None:
    from sglang.srt.plugins import load_plugins

    rotary_kernel_stand_in()
    parsed = [job.split("=", 3) for job in jobs]
    server_args = publish_rank(parsed[0][1], world, rank, port, parsed[0][2])
    load_plugins()  # what every SGLang process does: our hooks on its KV sizing included
    results = []
    for kind, model_dir, dtype, socket_dir in parsed:
        from weightcache.integrations import layouts, loading

        loading.forget_attachments()
        layouts.forget_layouts()
        extra = {"socket_dir": socket_dir, "cache": CACHE}
        with adapter_warnings() as warnings:
            loader, model, cold = load_ours_and_cold(model_dir, dtype, rank, extra)
        result = {**outcome(kind, loader, model, cold), "warnings": warnings}
        if world == 1 and kind in DECODERS and result["layout"] is not None:
            started = time.monotonic()
            result["kv"] = kv_outcome(model_dir, dtype, extra, server_args, loader, model, cold)
            result["kv"]["seconds"] = time.monotonic() - started  # what the KV test adds
        results.append(result)
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    rank, world, port, out, *jobs = sys.argv[1:]
    run_rank(int(rank), int(world), int(port), Path(out), jobs)
