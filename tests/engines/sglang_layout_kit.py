"""SGLang's own layouts, loaded both ways, in a rank process of SGLang's own groups.

``python -m tests.engines.sglang_layout_kit RANK WORLD PORT OUT JOB...`` (JOB:
``KIND=MODEL_DIR=DTYPE=SOCKET_DIR``) is one tensor-parallel rank, set up as
SGLang's scheduler sets up its process (``publish`` of its server arguments,
``init_parallel_runtime``: SGLang's own process groups, gloo on CPU). Per job
it loads the model through our loader (from this rank's daemon at
``<SOCKET_DIR>/tests.tiny/cpu.sock``) and through SGLang's own
``DefaultModelLoader``, and writes to OUT what the tests assert: the
parameters that differ, those outside the daemon's memory (read from their
own storages), and what the loader reported. A process of its own because
SGLang's parallel runtime is built once per process.
"""

from __future__ import annotations

import json
import sys
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
                   model_loader_extra_config={"weightcache": extra})
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

    from tests.engines.enginekit import in_daemon_memory

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
        "outside": sorted(n for n, p in ours.items() if not in_daemon(p)),
        "mapped_bytes": sum(p.numel() * p.element_size() for p in ours.values() if in_daemon(p)),
        "total_bytes": sum(p.numel() * p.element_size() for p in ours.values()),
        "reported": loader.layout_load.copied,
        "reported_mapped_bytes": loader.layout_load.mapped_bytes,
        "reported_copied_bytes": loader.layout_load.copied_bytes,
    }


def run_rank(rank: int, world: int, port: int, out: Path, jobs: list[str]) -> None:
    rotary_kernel_stand_in()
    parsed = [job.split("=", 3) for job in jobs]
    publish_rank(parsed[0][1], world, rank, port, parsed[0][2])
    results = []
    for kind, model_dir, dtype, socket_dir in parsed:
        from weightcache.integrations import layouts, loading

        loading.forget_attachments()
        layouts.forget_layouts()
        extra = {"socket_dir": socket_dir, "cache": CACHE}
        results.append(outcome(kind, *load_ours_and_cold(model_dir, dtype, rank, extra)))
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    rank, world, port, out, *jobs = sys.argv[1:]
    run_rank(int(rank), int(world), int(port), Path(out), jobs)
