"""Issue 11 on a real GPU: a vmm_fd daemon restarts without reloading its weights.

As in tests/unit/daemon/test_readopt.py (memfd), the proof that nothing was
read from disk: the successor read (``rchar``) at least 90 % of the checkpoint
less than its predecessor, which loaded it, and a new engine's logits equal a
cold load. (Zeroing the checkpoint in place
no longer proves it: bytes whose files changed since they were read are never
re-adopted, see daemon/provenance.py.)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from tests.gpu.conftest import DaemonProcess, start_daemon
from weightcache.client import attach, daemon_status, load_into, meta_parameters
from weightcache.daemon.manifest import (
    LINEAR,
    allocation_digests,
    linear_digest,
    manifest_path,
    read_manifest,
)
from weightcache.daemon.readopt import engine_sockets

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

CUDA = torch.device("cuda", 0)

ENGINE = textwrap.dedent(
    """
    import sys
    from weightcache.client import attach
    attached = attach(sys.argv[1], transports=["vmm_fd"], watchdog=False)
    print(attached.fingerprint, flush=True)
    sys.stdin.read()  # hold the weights until the test closes our stdin
    """
)

# A different VMM allocation of the same size, holding the real bytes with one
# bit flipped, offered under the right fingerprint: only the checksum can tell.
FORGER = textwrap.dedent(
    """
    import sys, torch
    from weightcache.client import attach
    from weightcache.handback import HandbackServer
    from weightcache.transport.vmm_fd import VmmMemory
    real = attach(sys.argv[1], transports=["vmm_fd"], watchdog=False, handback=False)
    sizes = [b.numel() for b in real._memory.buffers]
    forged = VmmMemory(sizes, torch.device("cuda", 0))
    for mine, theirs in zip(forged.buffers, real._memory.buffers):
        mine.copy_(theirs)
    forged.buffers[0][:1].bitwise_xor_(1)  # the first byte of the first tensor
    torch.cuda.synchronize()
    server = HandbackServer(sys.argv[1], real.fingerprint, sizes, forged.fds)
    real.close()
    print(real.fingerprint, flush=True)
    sys.stdin.read()
    """
)


@pytest.fixture
def run_dir():
    # Short: engine socket paths must fit a Unix socket address.
    path = Path(tempfile.mkdtemp(prefix="wcg-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def processes():
    started: list[subprocess.Popen | DaemonProcess] = []
    yield started
    for p in reversed(started):
        if isinstance(p, DaemonProcess):
            p.stop()
        elif p.poll() is None:
            p.kill()
            p.wait()


@pytest.fixture
def model(llama_dir, run_dir) -> Path:
    """A private copy of the Llama checkpoint that the test may damage."""
    path = run_dir / "model"
    shutil.copytree(llama_dir, path)
    return path


def daemon(run_dir: Path, model: Path, processes: list) -> DaemonProcess:
    """A vmm_fd daemon on run_dir/daemon/gpu.sock (the same socket on every call)."""
    started = start_daemon(run_dir, model, "--transport", "vmm_fd", name="daemon")
    processes.append(started)
    return started


def kill(d: DaemonProcess) -> None:
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()


def engine(socket_path: str, processes: list, script: str = ENGINE) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", script, socket_path],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    processes.append(proc)
    line = proc.stdout.readline().strip()
    if len(line) != 64:
        proc.kill()
        pytest.fail(f"engine failed to attach: {line!r} {proc.stderr.read()}")
    return proc


def read_chars(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def logits_through_daemon(socket_path: str, model: Path) -> torch.Tensor:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.gpu.test_cuda_transports import llama_logits

    config = LlamaConfig.from_pretrained(model)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(CUDA), meta_parameters():
            module = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    attached = attach(socket_path, transports=["vmm_fd"], watchdog=False)
    try:
        load_into(module, attached)
        return llama_logits(module.eval())
    finally:
        attached.close()


def cold_logits(checkpoint: Path) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    from tests.gpu.test_cuda_transports import llama_logits

    cold = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to(CUDA)
    return llama_logits(cold.eval())


@pytest.mark.smoke
def test_gpu_digest_equals_the_cpu_computation() -> None:
    # Several 8 MiB chunks and a partial one: the same integers on either device.
    buffer = torch.randint(0, 256, (20 * (1 << 20) + 256,), dtype=torch.uint8)
    key = os.urandom(32)
    assert linear_digest(buffer.to(CUDA), key) == linear_digest(buffer, key)


@pytest.mark.smoke
def test_restart_readopts_from_a_live_engine_and_logits_equal_a_cold_load(
    llama_dir, model, run_dir, processes
) -> None:
    first_daemon = daemon(run_dir, model, processes)
    first = daemon_status(first_daemon.socket_path)
    assert first.load_source == "disk" and "no manifest" in first.load_reason
    manifest = read_manifest(manifest_path(first_daemon.socket_path))
    assert manifest.checksum == LINEAR
    assert manifest.layout.allocation_sizes and sum(manifest.layout.allocation_sizes) == (
        first.preloaded_weights_bytes
    )
    holder = engine(first_daemon.socket_path, processes)

    loaded = read_chars(first_daemon.proc.pid)
    kill(first_daemon)
    second = daemon(run_dir, model, processes)
    status = daemon_status(second.socket_path)
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    assert loaded - read_chars(second.proc.pid) >= 0.9 * size

    assert status.readopted and status.load_source == "readopted", status.load_reason
    assert f"engine pid {holder.pid}" in status.load_reason
    assert status.preloaded_weights_bytes == first.preloaded_weights_bytes
    assert status.fingerprint == first.fingerprint
    assert torch.equal(logits_through_daemon(second.socket_path, model), cold_logits(llama_dir))

    # The same digests from another process's read-only mapping of the memory.
    attached = attach(second.socket_path, transports=["vmm_fd"], watchdog=False)
    try:
        key = bytes.fromhex(manifest.checksum_key)
        assert allocation_digests(attached._memory.buffers, LINEAR, key) == manifest.digests
    finally:
        attached.close()

    # The re-adopted daemon serves the fds it received: the next restart re-adopts too.
    kill(second)
    third = daemon(run_dir, model, processes)
    assert daemon_status(third.socket_path).readopted
    assert torch.equal(logits_through_daemon(third.socket_path, model), cold_logits(llama_dir))


def test_a_forged_allocation_fails_the_checksum_and_the_daemon_reloads(
    llama_dir, model, run_dir, processes
) -> None:
    first = daemon(run_dir, model, processes)
    forger = engine(first.socket_path, processes, FORGER)
    kill(first)
    second = daemon(run_dir, model, processes)
    status = daemon_status(second.socket_path)
    assert status.load_source == "disk" and not status.readopted
    assert "checksum of allocation(s) [0] does not match the manifest" in status.load_reason
    assert f"engine pid {forger.pid}" in status.load_reason
    assert torch.equal(logits_through_daemon(second.socket_path, model), cold_logits(llama_dir))


def test_with_no_engine_alive_the_daemon_reloads_from_disk(model, run_dir, processes) -> None:
    first = daemon(run_dir, model, processes)
    holder = engine(first.socket_path, processes)
    holder.kill()
    holder.wait()
    kill(first)
    second = daemon(run_dir, model, processes)
    status = daemon_status(second.socket_path)
    assert status.load_source == "disk" and not status.readopted
    assert status.load_reason.startswith(
        "no live engine to re-adopt from (1 dead engine socket(s) removed); read from disk: "
    )
    assert engine_sockets(second.socket_path) == []
