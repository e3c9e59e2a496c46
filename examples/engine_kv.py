"""Engine-shaped example: size the KV cache beside a weightcache daemon.

The integration is the four numbered steps in ``main``; everything else is the
engine around them. One process per GPU, each passing its own GPU's socket::

    python examples/engine_kv.py /run/weightcache/ns.name/gpu-<UUID>.sock \\
        --bytes-per-token 262144 --mem-fraction-static 0.9
    torchrun --nproc-per-node 2 examples/engine_kv.py 'sockets/gpu-{local_rank}.sock'

With ``--device cpu`` it runs beside a CPU (memfd) daemon, using the host's
MemAvailable as the free-memory reading.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import weightcache.client
from weightcache.kv import (
    KVBaseline,
    cuda_free_bytes,
    kv_budget_bytes,
    kv_tokens,
    total_preloaded_bytes,
)


def host_available_bytes(_device: torch.device) -> int:
    """MemAvailable: a memfd daemon's sealed pages are shmem, so they are not in it."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("socket", help="daemon socket; {local_rank} is filled in")
    parser.add_argument("--draft-socket", help="a draft model's daemon socket, if any")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--mem-fraction-static", type=float, default=0.9)
    parser.add_argument("--bytes-per-token", type=int, default=262144)
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args(argv)

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device, free_bytes = torch.device("cuda", local_rank), cuda_free_bytes
    else:
        device, free_bytes = torch.device("cpu"), host_available_bytes

    # 1. Before any weights load: the rank-local baseline (no MIN yet).
    baseline = KVBaseline.sample(device, sampler=free_bytes)
    # 2. Load the model by attaching to the daemon's resident weights (zero-copy);
    #    a real engine then calls weightcache.client.load_into(model, target).
    sockets = [args.socket] + ([args.draft_socket] if args.draft_socket else [])
    runners = []
    try:
        for path in sockets:
            runners.append(weightcache.client.attach(path.format(local_rank=local_rank)))
        target = runners[0]
        # 3. Add the daemon-held bytes back on this rank, then take the MIN over ranks.
        baseline.account_preloaded_weights(
            total_preloaded_bytes(*(r.preloaded_weights_bytes for r in runners))
        )
        pre_load_free = baseline.min_across_ranks()
        # 4. Size the pool exactly as the engine always did, from that baseline.
        post_load_free = free_bytes(device)
        budget = kv_budget_bytes(post_load_free, pre_load_free, args.mem_fraction_static)
        print(
            json.dumps(
                {
                    "rank": dist.get_rank() if dist.is_initialized() else 0,
                    "transport": target.transport,
                    "daemon_pid": target.daemon_pid,
                    "fingerprint": target.fingerprint,
                    "baseline": repr(baseline),
                    "post_load_free": post_load_free,
                    "kv_budget_bytes": budget,
                    "kv_tokens": kv_tokens(budget, args.bytes_per_token, args.page_size),
                }
            )
        )
    finally:
        for runner in runners:
            runner.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
