"""Two generations resident on one GPU, and the wait for room (issue 42 items 1 and 4).

The memfd twin is tests/unit/daemon/test_generations.py (CI); this runs the CUDA paths
that CPU runs cannot: vmm_fd hand-backs of an earlier generation checked by the GPU's
keyed linear digests (at the take-back and at every later check), cudaMemGetInfo
(devicememory.cuda_memory), and --rollout auto's wait on a GPU too full for the new
generation beside the kept one. NOT RUN YET: written without a GPU; the issue's 8B
figures (two 8B generations beside an engine each) need a lent GPU and the checkpoint.

A generation here is another --revision (and spec hash) of the same Llama-shaped
checkpoint: equal shapes, the fine-tune case.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.gpu.conftest import DaemonProcess
from weightcache.client import daemon_status
from weightcache.daemon.manifest import retained_fingerprints
from weightcache.protocol import DaemonStatus
from weightcache.report import SPEC_HASH_ENV

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

H1, H2 = "1" * 64, "2" * 64
GRACE = ("--retained-grace-seconds", "2", "--retained-check-seconds", "0.5")

# An engine of revision argv[3]: attaches over vmm_fd asking for exactly that config,
# prints its fingerprint and the sum of its weights, holds them until stdin closes.
ENGINE = textwrap.dedent(
    """
    import sys, torch
    from weightcache.checkpoint import cache_config, read_checkpoint
    from weightcache.client import attach
    config = cache_config(read_checkpoint(sys.argv[2]), torch.device("cuda", 0), None, None,
                          sys.argv[3])
    attached = attach(sys.argv[1], config=config, transports=["vmm_fd"], watchdog=False)
    total = sum(float(t.double().sum()) for t in attached.tensors.values())
    print(attached.fingerprint, total, flush=True)
    sys.stdin.read()
    """
)


def start(tmp: Path, model: Path, revision: str, spec_hash: str, *args: str) -> DaemonProcess:
    socket_path = str(tmp / "d" / "gpu.sock")
    log = tmp / f"daemon-{revision}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightcache.daemon.cli", "serve", "--model", str(model),
         "--socket", socket_path, "--http-address", "none", "--device", "cuda:0",
         "--transport", "vmm_fd", "--revision", revision, *GRACE, *args],
        stdout=log.open("w"), stderr=subprocess.STDOUT,
        env={**os.environ, SPEC_HASH_ENV: spec_hash})
    return DaemonProcess(socket_path, proc, log)


def engine(socket_path: str, model: Path, revision: str) -> tuple[subprocess.Popen, str, float]:
    proc = subprocess.Popen([sys.executable, "-c", ENGINE, socket_path, str(model), revision],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    fingerprint, total = proc.stdout.readline().split()
    return proc, fingerprint, float(total)


def kill(daemon: DaemonProcess) -> None:
    daemon.proc.kill()
    daemon.proc.wait()


def wait_for(predicate, what: str, within: float = 120.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_two_generations_on_one_gpu_kept_served_and_dropped(tmp_path: Path,
                                                             llama_dir: Path) -> None:
    first = start(tmp_path, llama_dir, "r1", H1)
    first.wait_ready()
    old, fp1, sum1 = engine(first.socket_path, llama_dir, "r1")
    kill(first)
    second = start(tmp_path, llama_dir, "r2", H2)
    try:
        second.wait_ready()
        status = daemon_status(second.socket_path)
        assert [(r.spec_hash, r.fingerprint) for r in status.retained] == [(H1, fp1)]
        assert status.memory_total_bytes == torch.cuda.mem_get_info(0)[1]
        # An old engine restarting gets exactly the kept weights; a new one the new.
        again, fp_again, sum_again = engine(second.socket_path, llama_dir, "r1")
        new, fp2, sum2 = engine(second.socket_path, llama_dir, "r2")
        assert (fp_again, sum_again) == (fp1, sum1) and fp2 != fp1 and sum2 == sum1
        for proc in (old, again):
            proc.stdin.close()
            proc.wait()
        wait_for(lambda: not daemon_status(second.socket_path).retained, "the drop")
        assert retained_fingerprints(second.socket_path) == []
        new.stdin.close()
        new.wait()
    finally:
        second.stop()


def test_a_gpu_too_full_for_both_waits_for_room(tmp_path: Path, llama_dir: Path) -> None:
    first = start(tmp_path, llama_dir, "r1", H1)
    first.wait_ready()
    old, _, _ = engine(first.socket_path, llama_dir, "r1")
    kill(first)
    need = sum(f.stat().st_size for f in llama_dir.glob("*.safetensors"))
    free, _ = torch.cuda.mem_get_info(0)
    # Leave less than the new generation plus the 256 MiB margin free.
    filler = torch.empty(max(0, free - need - (128 << 20)), dtype=torch.uint8, device="cuda:0")
    second = start(tmp_path, llama_dir, "r2", H2)
    try:
        status: DaemonStatus = wait_for(
            lambda: (s := _status(second)) is not None and s.waiting_for_room and s,
            "the daemon waiting for room")
        assert status.state == "loading" and status.phase == "waiting-for-room"
        assert [r.spec_hash for r in status.retained] == [H1]
        del filler
        torch.cuda.empty_cache()
        second.wait_ready()
        assert not daemon_status(second.socket_path).waiting_for_room
    finally:
        old.stdin.close()
        old.wait()
        second.stop()


def _status(daemon: DaemonProcess) -> DaemonStatus | None:
    try:
        return daemon_status(daemon.socket_path)
    except OSError:
        return None
