"""``python -m benchmarks.digest --gb 16 --out digest.json``: the GPU checksum, two ways.

The ``m31-linear-x2`` digests of one random GPU buffer under two keys (what a
seeded daemon computes: its neighbour's key and its own), by the NVRTC kernel
(:mod:`weightcache.daemon.digest_cuda`) and by torch ops; both must agree.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.machine import describe
from benchmarks.stats import summary
from weightcache.daemon import digest_cuda
from weightcache.daemon.manifest import linear_digests

RUNS = 3


def timed(buffer: torch.Tensor, keys: list[bytes]) -> tuple[list[str], list[float]]:
    seconds, digests = [], []
    for _ in range(RUNS):
        torch.cuda.synchronize()
        started = time.perf_counter()
        digests = linear_digests(buffer, keys)
        seconds.append(time.perf_counter() - started)
    return digests, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gb", type=float, default=16.0)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    size = int(args.gb * 1e9) // 256 * 256
    buffer = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    keys = [bytes(range(32)), bytes(range(32, 64))]
    started = time.perf_counter()
    linear_digests(buffer[: 1 << 20], keys)  # first use: NVRTC compile, load, self-check
    first_use = time.perf_counter() - started
    kernel_error = digest_cuda._broken
    fused, fused_s = timed(buffer, keys)
    digest_cuda._broken = "forced off for comparison"
    plain, plain_s = timed(buffer, keys)
    digest_cuda._broken = kernel_error
    result = {
        "machine": describe(),
        "bytes": size,
        "keys": len(keys),
        "kernel_error": kernel_error,
        "kernel_first_use_seconds": first_use,
        "kernel": summary(fused_s, "s"),
        "torch": summary(plain_s, "s"),
        "equal": fused == plain,
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
