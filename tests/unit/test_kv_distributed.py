"""The MIN across ranks must come after each rank's correction: 4 real gloo ranks on CPU.

Each rank is a separate process with its own simulated device: how much was
free before anything was loaded, what its daemon holds (target + draft), and
what the engine allocates itself. Free-memory readings come from the injected
sampler; the all-reduce is a real torch.distributed collective over loopback TCP.
"""

from __future__ import annotations

import json
import math
import socket
from datetime import timedelta
from fractions import Fraction
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from weightcache.kv import KVBaseline, kv_budget_bytes, min_across_ranks, total_preloaded_bytes

GiB = 1 << 30
F = 0.85
WORLD = 4

# Per rank: free bytes on an empty device, daemon-held target and draft bytes, and
# what the engine then allocates itself (its own weights if nothing is preloaded).
RANKS = [
    {"free_empty": 139 * GiB, "target": 40 * GiB, "draft": 0, "engine_own": GiB},
    {"free_empty": 139 * GiB, "target": 40 * GiB, "draft": 4 * GiB, "engine_own": GiB},
    {"free_empty": 137 * GiB, "target": 30 * GiB, "draft": 0, "engine_own": 2 * GiB},
    {"free_empty": 139 * GiB, "target": 0, "draft": 0, "engine_own": 35 * GiB},
]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    try:
        spec = RANKS[rank]
        preloaded = total_preloaded_bytes(spec["target"], spec["draft"])
        raw = spec["free_empty"] - preloaded
        post = raw - spec["engine_own"]

        baseline = KVBaseline.sample("cpu", sampler=lambda _device: raw)
        baseline.account_preloaded_weights(preloaded)
        right_pre = baseline.min_across_ranks()
        right = kv_budget_bytes(post, right_pre, F)

        # The bug: MIN over the uncorrected samples, then this rank's own bytes.
        wrong = kv_budget_bytes(post, min_across_ranks(raw) + preloaded, F)

        # A cold start: nothing preloaded, the engine loads everything itself.
        cold_pre = min_across_ranks(spec["free_empty"], device="cpu")
        cold = kv_budget_bytes(spec["free_empty"] - preloaded - spec["engine_own"], cold_pre, F)

        try:
            baseline.account_preloaded_weights(preloaded)
            late = "accepted"
        except RuntimeError as exc:
            late = str(exc)

        result = {"right_pre": right_pre, "right": right, "wrong": wrong, "cold": cold,
                  "late_correction": late, "resize_pre": baseline.min_across_ranks()}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_correct_before_min_gives_each_rank_a_cold_start_budget(tmp_path: Path) -> None:
    # fork, not spawn: spawned children re-import torch and take 15 s on two cores
    # where forked ones take 2 s. Safe here because the ranks touch only CPU
    # tensors and gloo, never CUDA.
    mp.start_processes(
        _rank_main, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True,
        start_method="fork",
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]

    cold_min = min(spec["free_empty"] for spec in RANKS)
    headroom = math.ceil(cold_min * (1 - Fraction(str(F))))
    for spec, result in zip(RANKS, results, strict=True):
        post = spec["free_empty"] - spec["target"] - spec["draft"] - spec["engine_own"]
        assert result["right_pre"] == result["resize_pre"] == cold_min
        assert result["right"] == result["cold"] == post - headroom
        assert "after min_across_ranks" in result["late_correction"]

    # Correcting after the MIN gives every rank here a different budget, and
    # over-allocates (OOM at graph capture) wherever the rank's own preloaded
    # bytes fall short of what the MIN over raw samples took away.
    for result in results:
        assert result["wrong"] != result["right"]
    over = [r for r, result in enumerate(results) if result["wrong"] > result["right"]]
    assert over == [0, 2, 3]
