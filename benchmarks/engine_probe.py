"""One engine process, measured from the inside; prints a JSON line.

Run by benchmarks.run in a fresh process per measurement, so that first-use
costs (CUDA context, imports) are counted where an engine would pay them.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

T_PROCESS = time.time()

import torch  # noqa: E402

from weightcache.client import attach  # noqa: E402
from weightcache.kv import KVBaseline, kv_budget_bytes, kv_tokens  # noqa: E402

DEVICE = torch.device("cuda", 0)


def free_bytes() -> int:
    torch.cuda.synchronize(DEVICE)
    return torch.cuda.mem_get_info(DEVICE)[0]


def cold_load(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from weightcache.checkpoint import checkpoint_files

    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(__import__("pathlib").Path(model_dir)):
        tensors.update(load_file(path, device="cuda:0"))
    torch.cuda.synchronize(DEVICE)
    return tensors


def probe_attach(args) -> dict:
    torch.cuda.init()
    torch.empty(1, device=DEVICE)
    before = free_bytes()
    started = time.perf_counter()
    attached = attach(args.socket, transports=[args.transport], watchdog=False)
    first = time.perf_counter() - started
    extra = before - free_bytes()
    count = len(attached.tensors)
    attached.close()
    del attached
    repeats = []
    for _ in range(args.repeat):
        gc.collect()
        started = time.perf_counter()
        attached = attach(args.socket, transports=[args.transport], watchdog=False)
        repeats.append(time.perf_counter() - started)
        attached.close()
        del attached
    return {
        "first_attach_s": first,
        "attach_s": repeats,
        "extra_device_bytes": extra,
        "tensors": count,
    }


def probe_restart(args) -> dict:
    t_import = time.time() - args.t0
    torch.cuda.init()
    torch.empty(1, device=DEVICE)
    t_cuda = time.time() - args.t0
    started = time.perf_counter()
    if args.socket:
        weights = attach(args.socket, transports=["vmm_fd", "torch_ipc"], watchdog=False).tensors
    else:
        weights = cold_load(args.model)
    weights_s = time.perf_counter() - started
    started = time.perf_counter()
    kv = torch.empty(args.kv_bytes, dtype=torch.uint8, device=DEVICE)
    kv.zero_()
    torch.cuda.synchronize(DEVICE)
    kv_s = time.perf_counter() - started
    return {
        "import_torch_s": t_import,
        "import_and_cuda_init_s": t_cuda,
        "weights_s": weights_s,
        "kv_alloc_s": kv_s,
        "time_to_ready_s": time.time() - args.t0,
        "tensors": len(weights),
    }


def probe_kv(args) -> dict:
    torch.cuda.init()
    torch.empty(1, device=DEVICE)
    baseline = KVBaseline.sample(DEVICE)
    if args.socket:
        weights = attach(args.socket, transports=["vmm_fd", "torch_ipc"], watchdog=False)
        preloaded = weights.preloaded_weights_bytes
    else:
        weights = cold_load(args.model)
        preloaded = 0
    post = free_bytes()  # the weights stay referenced until the function returns
    raw = baseline.raw_bytes
    uncorrected = kv_budget_bytes(post, raw, args.f)
    baseline.account_preloaded_weights(preloaded)
    corrected = kv_budget_bytes(post, baseline.corrected_bytes, args.f)
    return {
        "preloaded_weights_bytes": preloaded,
        "pre_load_free": raw,
        "post_load_free": post,
        "budget_uncorrected": uncorrected,
        "budget_corrected": corrected,
        "tokens_uncorrected": kv_tokens(uncorrected, args.bytes_per_token, args.page),
        "tokens_corrected": kv_tokens(corrected, args.bytes_per_token, args.page),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["attach", "restart", "kv"])
    parser.add_argument("--socket")
    parser.add_argument("--model")
    parser.add_argument("--transport", default="vmm_fd")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--t0", type=float, default=T_PROCESS)
    parser.add_argument("--kv-bytes", type=int, default=8 * 2**30)
    parser.add_argument("--f", type=float, default=0.85)
    parser.add_argument("--bytes-per-token", type=int, default=131072)
    parser.add_argument("--page", type=int, default=16)
    args = parser.parse_args()
    probe = {"attach": probe_attach, "restart": probe_restart, "kv": probe_kv}[args.mode]
    print(json.dumps(probe(args)))


if __name__ == "__main__":
    main()
