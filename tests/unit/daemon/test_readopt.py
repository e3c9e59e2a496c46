"""Daemon restart without reload (memfd): real daemon and engine processes, kill -9.

The proof that a re-adopted daemon read no tensor bytes: after the first load
every tensor byte of the checkpoint is zeroed in place (same size, same
header, so the same fingerprint). A new engine then sees the ORIGINAL values,
which only the live engine's memory still holds.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.unit.wc_harness import DaemonProcess
from weightcache.client import attach
from weightcache.daemon.manifest import manifest_path, read_manifest
from weightcache.handback import engine_sockets, engines_dir
from weightcache.protocol import DaemonStatus

ENGINE = textwrap.dedent(
    """
    import sys
    from weightcache.client import attach
    attached = attach(sys.argv[1], transports=["memfd"])
    print(attached.fingerprint, flush=True)
    sys.stdin.read()  # hold the weights until the test closes our stdin
    """
)

# Offers a sealed memfd of the right size and fingerprint whose bytes differ
# from the real allocation in one bit: only the checksum can tell.
FORGER = textwrap.dedent(
    """
    import fcntl, os, sys
    from weightcache.client import attach
    from weightcache.handback import HandbackServer
    from weightcache.transport.memfd import REQUIRED_SEALS
    real = attach(sys.argv[1], transports=["memfd"], handback=False)
    [size] = [b.numel() for b in real._memory.buffers]
    data = bytearray(os.pread(real._memory.fds[0], size, 0))
    data[0] ^= 1  # the first byte of the first tensor
    fd = os.memfd_create("forged", os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
    server = HandbackServer(sys.argv[1], real.fingerprint, [size], [fd])
    real.close()
    print(real.fingerprint, flush=True)
    sys.stdin.read()
    """
)


class Engines:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, socket_path: str, script: str = ENGINE) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", script, socket_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        line = proc.stdout.readline().strip()
        if len(line) != 64:
            proc.kill()
            raise AssertionError(f"engine failed to attach: {line!r} {proc.stderr.read()}")
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                stream.close()


@pytest.fixture
def engines():
    e = Engines()
    yield e
    e.close()


@pytest.fixture
def model(minilm_dir, tmp_path) -> Path:
    """A private copy of MiniLM's weights that the test may damage."""
    path = tmp_path / "model"
    path.mkdir()
    shutil.copy(minilm_dir / "model.safetensors", path / "model.safetensors")
    return path


def zero_tensor_bytes(path: Path) -> None:
    """Overwrite every tensor byte with zeros, keeping the size and the header."""
    with open(path, "r+b") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        data_start = 8 + header_len
        size = os.fstat(f.fileno()).st_size
        f.seek(data_start)
        f.write(bytes(size - data_start))


def restart(daemon: DaemonProcess) -> DaemonStatus:
    """kill -9 the daemon, start its successor on the same socket, return its ready status."""
    daemon.kill()
    return daemon.start().status()


def test_restart_readopts_from_a_live_engine_without_reading_the_checkpoint(
    daemons, engines, model, minilm_reference
) -> None:
    daemon = daemons(model, "--transport", "memfd")
    first = daemon.status()
    assert first.load_source == "disk" and not first.readopted
    assert "no manifest" in first.load_reason
    manifest = read_manifest(manifest_path(daemon.socket))
    assert stat.S_IMODE(os.stat(manifest_path(daemon.socket)).st_mode) == 0o600
    assert manifest.fingerprint == first.fingerprint
    assert manifest.layout.allocation_sizes == [first.preloaded_weights_bytes]
    # Created by the daemon, so engine pods may mount just this directory writable.
    assert stat.S_IMODE(os.stat(engines_dir(daemon.socket)).st_mode) == 0o750
    engine = engines.start(daemon.socket)

    daemon.kill()
    zero_tensor_bytes(model / "model.safetensors")
    assert all(not t.any() for t in load_file(model / "model.safetensors").values())
    status = daemon.start().status()  # the successor, on the same socket

    assert status.state == "ready"
    assert status.readopted and status.load_source == "readopted"
    assert f"engine pid {engine.pid}" in status.load_reason
    assert status.preloaded_weights_bytes == first.preloaded_weights_bytes
    assert status.expected_bytes == first.expected_bytes
    assert status.fingerprint == first.fingerprint
    code, _, body = daemon.http("/status")
    assert code == 200
    assert json.loads(body)["load_reason"] == status.load_reason
    assert json.loads(body)["readopted"] is True
    attached = attach(daemon.socket, transports=["memfd"])
    try:
        for name, tensor in minilm_reference.items():
            assert torch.equal(attached.tensors[name], tensor), name
    finally:
        attached.close()

    # A re-adopted daemon serves the fds it received, so engines can hand
    # them back again at the next restart.
    again = restart(daemon)
    assert again.readopted and f"engine pid {engine.pid}" in again.load_reason
    attached = attach(daemon.socket, transports=["memfd"])
    try:
        name = "embeddings.word_embeddings.weight"
        assert torch.equal(attached.tensors[name], minilm_reference[name])
    finally:
        attached.close()


def test_a_forged_allocation_fails_the_checksum_and_the_daemon_reloads(
    daemons, engines, model, minilm_reference
) -> None:
    daemon = daemons(model, "--transport", "memfd")
    forger = engines.start(daemon.socket, FORGER)
    status = restart(daemon)
    assert status.load_source == "disk" and not status.readopted
    assert "checksum of allocation(s) [0] does not match the manifest" in status.load_reason
    assert f"engine pid {forger.pid}" in status.load_reason
    attached = attach(daemon.socket, transports=["memfd"])
    try:
        for name, tensor in minilm_reference.items():
            assert torch.equal(attached.tensors[name], tensor), name
    finally:
        attached.close()


def test_with_no_engine_alive_the_daemon_reloads_and_clears_dead_sockets(
    daemons, engines, model
) -> None:
    daemon = daemons(model, "--transport", "memfd")
    engine = engines.start(daemon.socket)
    engine.kill()
    engine.wait()
    attach(daemon.socket, transports=["memfd"]).close()  # a clean detach leaves no socket
    assert len(engine_sockets(daemon.socket)) == 1  # the killed engine's leftover

    status = restart(daemon)
    assert status.load_source == "disk" and not status.readopted
    assert status.load_reason == "no live engine to re-adopt from (1 dead engine socket(s) removed)"
    assert engine_sockets(daemon.socket) == []


def test_without_a_manifest_the_daemon_reloads_and_writes_one(daemons, engines, model) -> None:
    daemon = daemons(model, "--transport", "memfd")
    engines.start(daemon.socket)
    os.unlink(manifest_path(daemon.socket))
    status = restart(daemon)
    assert status.load_source == "disk"
    assert "no manifest at" in status.load_reason
    assert read_manifest(manifest_path(daemon.socket)).fingerprint == status.fingerprint


def test_a_stale_manifest_makes_the_daemon_reload_the_changed_checkpoint(
    daemons, engines, model, minilm_reference
) -> None:
    daemon = daemons(model, "--transport", "memfd")
    engines.start(daemon.socket)
    name = "embeddings.word_embeddings.weight"
    changed = dict(minilm_reference)
    changed[name] = minilm_reference[name] + 1
    save_file(changed, model / "model.safetensors", metadata={"format": "pt", "rev": "2"})

    status = restart(daemon)
    assert status.load_source == "disk"
    assert "manifest is stale" in status.load_reason
    assert "model.files[0].header_sha256" in status.load_reason
    attached = attach(daemon.socket, transports=["memfd"])
    try:
        assert torch.equal(attached.tensors[name], changed[name])
    finally:
        attached.close()


def test_torch_ipc_says_it_cannot_readopt_and_writes_no_manifest(torch_ipc_daemon) -> None:
    status = torch_ipc_daemon.status()
    assert status.load_source == "disk"
    assert "torch_ipc cannot re-adopt" in status.load_reason
    assert not os.path.exists(manifest_path(torch_ipc_daemon.socket))
