"""An engine-like process for the engine-free replay (tests/gpu/test_engine_free_replay.py).

``python -m tests.gpu.replay_engine FIXTURE MODEL_DIR SOCKET OUT`` stands in for
a real engine (whose wheels cannot reach the GPU machine): it asks the daemon
for the layout of a plan the pinned engine recorded (``tools.plan_fixtures``),
maps every parameter by name over ``vmm_fd``, and reads the device's free
memory before and after. Then it builds a reference in its own memory by
executing the same plan with plain torch ops from the checkpoint read with
safetensors, and compares every mapped parameter with it bit for bit. It
writes what it saw to OUT (JSON); the test judges.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from tools.plan_fixtures import read_fixture
from weightcache.checkpoint import cache_config, dtype_from_name, read_checkpoint
from weightcache.client import attach_layout
from weightcache.plan import LoadPlan

INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def per_process() -> str:
    """The driver's per-process device memory (MiB), where nvidia-smi can tell."""
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def execute(plan: LoadPlan, checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plan with plain torch ops: each parameter a zeroed storage of its own, each copy
    a strided view of the checkpoint tensor cast and copied into a strided view of it."""
    out = {}
    storages = {}
    for p in plan.params:
        storage = torch.zeros(max(1, _numel(p.shape)), dtype=dtype_from_name(p.dtype),
                              device="cuda")  # fmt: skip
        storages[p.name] = storage
        out[p.name] = storage.as_strided(p.shape, p.stride)
    for c in plan.copies:
        flat = checkpoint[c.source].reshape(-1)
        src = flat.as_strided(c.src.shape, c.src.stride, flat.storage_offset() + c.src.offset)
        for dtype in c.casts:
            src = src.to(dtype_from_name(dtype))
        storages[c.param].as_strided(c.dst.shape, c.dst.stride, c.dst.offset).copy_(src)
    for f in plan.fills:
        storages[f.param].as_strided(f.dst.shape, f.dst.stride, f.dst.offset).fill_(f.value)
    return out


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (random bytes hold NaN patterns, which ``==`` would call unequal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    kind = INT_OF_SIZE[a.element_size()]
    return torch.equal(a.view(kind), b.view(kind))


def main(fixture_path: str, model_dir: str, socket: str, out: str) -> int:
    fixture = read_fixture(Path(fixture_path))
    plan = fixture.plan
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the context, before the first reading
    config = cache_config(read_checkpoint(model_dir), torch.device("cuda", 0))
    processes_before = per_process()
    before, reserved_before = free_bytes(), torch.cuda.memory_reserved()
    started = time.perf_counter()
    attached = attach_layout(socket, config, plan, ["vmm_fd"], wait_ready=600)
    attach_s = time.perf_counter() - started
    after, reserved_after = free_bytes(), torch.cuda.memory_reserved()
    time.sleep(1)
    after_1s, processes_after = free_bytes(), per_process()
    # The same layout mapped a second time in this process: what one more mapping costs.
    second = attach_layout(socket, config, plan, ["vmm_fd"], wait_ready=600)
    after_second = free_bytes()
    second.close()
    del second
    gc.collect()
    after_second_closed = free_bytes()
    views = attached.tensors
    spans = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in attached.allocations()]
    # Where each parameter's bytes are, read from the tensors the engine would use.
    in_daemon_memory = [
        p.name for p in plan.params
        if any(lo <= views[p.name].data_ptr()
               and views[p.name].data_ptr() + views[p.name].numel() * views[p.name].element_size()
               <= hi for lo, hi in spans)
    ]  # fmt: skip
    mapped_bytes = sum(views[n].numel() * views[n].element_size() for n in in_daemon_memory)

    checkpoint: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        checkpoint.update(load_file(str(f), device="cuda"))
    reference = execute(plan, checkpoint)
    torch.cuda.synchronize()
    differ = [p.name for p in plan.params if not same_bits(views[p.name], reference[p.name])]
    # The HBM floor for the same copies, for the benchmark: plain torch into fresh memory.
    del reference
    execute_s = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        again = execute(plan, checkpoint)
        torch.cuda.synchronize()
        execute_s.append(time.perf_counter() - t0)
        del again
    result = {
        "daemon_pid": attached.daemon_pid,
        "transport": attached.transport,
        "plan_hash": attached.config.plan,
        "preloaded_weights_bytes": attached.preloaded_weights_bytes,
        "params": len(plan.params),
        "names_mapped": len(views),
        "params_in_daemon_memory": len(in_daemon_memory),
        "mapped_bytes": mapped_bytes,
        "free_before": before,
        "free_after": after,
        "free_after_1s": after_1s,
        "free_after_second_mapping": after_second,
        "free_after_second_mapping_closed": after_second_closed,
        "processes_before": processes_before,
        "processes_after": processes_after,
        "torch_reserved_before": reserved_before,
        "torch_reserved_after": reserved_after,
        "attach_seconds": attach_s,
        "differ": differ,
        "reference_execute_seconds": execute_s,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    del views, checkpoint
    attached.close()
    del attached
    gc.collect()
    torch.cuda.empty_cache()
    # With the mapping gone (and this process's own allocations returned): what attaching
    # itself held, if anything, is back.
    result["free_after_close"] = free_bytes()
    result["torch_reserved_after_close"] = torch.cuda.memory_reserved()
    Path(out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
