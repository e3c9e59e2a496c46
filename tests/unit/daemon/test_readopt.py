"""Daemon restart without reload (memfd): real daemon and engine processes, kill -9.

The proof that a re-adopted daemon read no tensor bytes: it read (``rchar``)
less than the checkpoint holds, and at least 90 % of the checkpoint less than
its predecessor, which loaded from disk; a new engine then gets the exact
values. (Changing the files in place cannot prove it any more: bytes whose
files changed since they were read are never re-adopted, see provenance.py.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import struct
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.unit.wc_harness import (
    DAEMON_GID,
    DAEMON_UID,
    ENGINE_UID,
    DaemonProcess,
    cross_uid_workdir,
    read_chars,
    readable_model_copy,
)
from weightcache.client import attach
from weightcache.daemon.manifest import manifest_path, read_manifest
from weightcache.daemon.readopt import engine_sockets
from weightcache.protocol import DaemonStatus
from weightcache.sockets import engines_dir

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
    assert stat.S_IMODE(os.stat(engines_dir(daemon.socket)).st_mode) == 0o3770
    engine = engines.start(daemon.socket, ENGINE)

    loaded = read_chars(daemon.pid)
    daemon.kill()
    status = daemon.start().status()  # the successor, on the same socket
    size = (model / "model.safetensors").stat().st_size
    assert loaded - read_chars(daemon.pid) >= 0.9 * size and read_chars(daemon.pid) < size

    assert status.state == "ready"
    assert status.readopted and status.load_source == "readopted"
    assert f"engine pid {engine.pid}" in status.load_reason
    assert status.preloaded_weights_bytes == first.preloaded_weights_bytes
    assert status.expected_bytes == first.expected_bytes
    assert status.fingerprint == first.fingerprint
    code, _, body = daemon.http("/status")
    assert code == 200
    assert json.loads(body)["readopted"] is True
    assert "load_reason" not in json.loads(body)  # free text stays off the network
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
    engine = engines.start(daemon.socket, ENGINE)
    engine.kill()
    engine.wait()
    attach(daemon.socket, transports=["memfd"]).close()  # a clean detach leaves no socket
    assert len(engine_sockets(daemon.socket)) == 1  # the killed engine's leftover

    status = restart(daemon)
    assert status.load_source == "disk" and not status.readopted
    assert status.load_reason.startswith(
        "no live engine to re-adopt from (1 dead engine socket(s) removed); read from disk: "
    )
    assert engine_sockets(daemon.socket) == []


def test_without_a_manifest_the_daemon_reloads_and_writes_one(daemons, engines, model) -> None:
    daemon = daemons(model, "--transport", "memfd")
    engines.start(daemon.socket, ENGINE)
    os.unlink(manifest_path(daemon.socket))
    status = restart(daemon)
    assert status.load_source == "disk"
    assert "no manifest at" in status.load_reason
    assert read_manifest(manifest_path(daemon.socket)).fingerprint == status.fingerprint


def test_a_stale_manifest_makes_the_daemon_reload_the_changed_checkpoint(
    daemons, engines, model, minilm_reference
) -> None:
    daemon = daemons(model, "--transport", "memfd")
    engines.start(daemon.socket, ENGINE)
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


def test_bytes_whose_checkpoint_changed_since_are_never_readopted(
    daemons, engines, model, minilm_reference
) -> None:
    """Issue 25 item 9: the identity is the headers, so a file repaired in place (a poisoned
    checkpoint restored, same header) kept its fingerprint, and the bytes read before the
    repair lived on in the engines and came back at every restart. The manifest records the
    files' stamps before the read; once they changed, the successor reads the disk."""
    daemon = daemons(model, "--transport", "memfd")
    engines.start(daemon.socket, ENGINE)  # holds the bytes read before the repair
    zero_tensor_bytes(model / "model.safetensors")  # the repair: same header, new bytes

    status = restart(daemon)
    assert status.load_source == "disk", status.load_reason
    assert "the checkpoint changed since these bytes were read from disk " \
           "(model.safetensors was rewritten or replaced)" in status.load_reason
    attached = attach(daemon.socket, transports=["memfd"])
    try:
        assert all(not t.any() for t in attached.tensors.values())
    finally:
        attached.close()


def test_torch_ipc_says_it_cannot_readopt_and_writes_no_manifest(torch_ipc_daemon) -> None:
    status = torch_ipc_daemon.status()
    assert status.load_source == "disk"
    assert "torch_ipc cannot re-adopt" in status.load_reason
    assert not os.path.exists(manifest_path(torch_ipc_daemon.socket))


# --------------------------------------------------------------------------- across uids
# The Kubernetes defaults: the daemon runs as 65533:65533, engines under their own uid
# with the daemon's gid as primary group. Re-adoption must work across them, and an
# engine must not be able to poison what the next daemon serves.

# An engine of another uid in the daemon's group, attacking as the issue describes: it
# tries to read the checksum key, to rewrite or replace what the daemon reads at start,
# and offers a sealed memfd of its own (the real bytes, one tensor zeroed) under the
# right fingerprint and sizes, to the daemon's uid.
ATTACKER = textwrap.dedent(
    """
    import fcntl, json, os, sys
    from weightcache.client import attach
    from weightcache.daemon.manifest import manifest_path
    from weightcache.sockets import PeerPolicy
    from weightcache.handback import HandbackServer
    from weightcache.transport.memfd import REQUIRED_SEALS
    sock = sys.argv[1]
    real = attach(sock, transports=["memfd"], handback=False)
    private = os.path.dirname(manifest_path(sock))
    attempts = {
        "read the manifest": lambda: open(manifest_path(sock), "rb").read(),
        "list the private dir": lambda: os.listdir(private),
        "write a manifest beside the socket": lambda: open(sock + ".manifest", "wb"),
        "move the private dir away": lambda: os.rename(private, private + ".old"),
        "plant a private dir of its own": lambda: os.mkdir(private + "2"),
        "replace the daemon's socket": lambda: os.unlink(sock),
    }
    outcome = {}
    for what, attempt in attempts.items():
        try:
            attempt()
            outcome[what] = "done"
        except OSError as exc:
            outcome[what] = exc.strerror
    [size] = [b.numel() for b in real._memory.buffers]
    data = bytearray(os.pread(real._memory.fds[0], size, 0))
    data[:4096] = bytes(4096)
    fd = os.memfd_create("forged", os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
    # Offered to our primary group: the daemon's gid, so the daemon may take it.
    to_daemon = PeerPolicy(frozenset(), frozenset({os.getgid()}))
    offer = HandbackServer(sock, real.fingerprint, [size], [fd], to_daemon)
    real.close()
    print(json.dumps(outcome), flush=True)
    sys.stdin.read()
    """
)


def cross_uid_daemon(daemons, minilm_dir) -> DaemonProcess:
    """A memfd daemon as DAEMON_UID:DAEMON_GID admitting its group, on a private model copy.

    ``--allow-uid 0`` admits this test's own probes (root could read everything anyway).
    """
    workdir = daemons.workdir()
    cross_uid_workdir(workdir)
    model = readable_model_copy(minilm_dir, workdir)
    args = ("--transport", "memfd", "--allow-uid", "0", "--allow-gid", str(DAEMON_GID))
    return daemons(model, *args, workdir=workdir, user=DAEMON_UID, group=DAEMON_GID)


def test_readoption_works_across_uids(daemons, engines, minilm_dir, minilm_reference) -> None:
    daemon = cross_uid_daemon(daemons, minilm_dir)
    engines_path = engines_dir(daemon.socket)
    info = os.stat(engines_path)
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (
        DAEMON_UID,
        DAEMON_GID,
        0o3770,
    )
    engine = engines.start(daemon.socket, ENGINE, user=ENGINE_UID, group=DAEMON_GID)
    [offer] = engine_sockets(daemon.socket)
    info = os.stat(offer)
    # Setgid directory: the engine's socket carries the daemon's group, so it may connect.
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (
        ENGINE_UID,
        DAEMON_GID,
        0o660,
    )

    daemon.kill()
    status = daemon.start().status()
    assert status.readopted and status.load_source == "readopted", status.load_reason
    assert read_chars(daemon.pid) < (daemon.model_dir / "model.safetensors").stat().st_size
    assert f"engine pid {engine.pid}" in status.load_reason
    attached = attach(daemon.socket, transports=["memfd"])
    try:
        assert attached.daemon_uid == DAEMON_UID
        for name, tensor in minilm_reference.items():
            assert torch.equal(attached.tensors[name], tensor), name
    finally:
        attached.close()


def test_an_engine_of_another_uid_cannot_poison_readoption(
    daemons, engines, minilm_dir, minilm_reference
) -> None:
    daemon = cross_uid_daemon(daemons, minilm_dir)
    attacker = engines.start(
        daemon.socket,
        ATTACKER,
        user=ENGINE_UID,
        group=DAEMON_GID,
        check=lambda line: line.startswith("{"),
    )
    outcome = json.loads(attacker.line)
    assert outcome == dict.fromkeys(outcome, "Permission denied"), outcome
    assert len(outcome) == 6

    status = restart(daemon)
    assert status.load_source == "disk" and not status.readopted
    assert f"engine pid {attacker.pid}" in status.load_reason
    assert "checksum of allocation(s) [0] does not match the manifest" in status.load_reason
    attached = attach(daemon.socket, transports=["memfd"])
    try:
        for name, tensor in minilm_reference.items():
            assert torch.equal(attached.tensors[name], tensor), name
    finally:
        attached.close()


# --------------------------------------------------------------------------- bounded asking

# Listens in the engines' directory under a name that sorts first, takes the daemon's
# request and answers one byte every half second: each read returns well within any
# per-read timeout, so only a deadline for the whole exchange ends it.
TRICKLER = textwrap.dedent(
    """
    import os, socket, sys, time
    from weightcache.sockets import engines_dir
    path = os.path.join(engines_dir(sys.argv[1]), sys.argv[2])
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    print("trickling", flush=True)
    while True:
        conn, _ = listener.accept()
        conn.recv(4096)
        conn.sendall((60_000).to_bytes(4, "big"))  # under the 64 KiB cap
        try:
            while True:
                time.sleep(0.5)
                conn.sendall(b"x")
        except OSError:
            conn.close()
    """
)


def trickle(engines, daemon: DaemonProcess, name: str):
    script = TRICKLER.replace("sys.argv[2]", repr(name))
    return engines.start(daemon.socket, script, check=lambda line: line == "trickling")


def test_a_trickling_engine_cannot_hold_a_restart(daemons, engines, model, minilm_reference):
    daemon = daemons(model, "--transport", "memfd", "--timeout", "2")
    engine = engines.start(daemon.socket, ENGINE)
    trickle(engines, daemon, "0-trickler.sock")  # asked first

    status = restart(daemon)
    assert status.readopted, status.load_reason
    timed_out = "0-trickler.sock: the engine did not complete the hand-back within 2 s"
    assert timed_out in status.load_reason
    assert f"engine pid {engine.pid}" in status.load_reason


def test_readoption_as_a_whole_is_bounded(daemons, engines, model, minilm_reference) -> None:
    daemon = daemons(model, "--transport", "memfd", "--timeout", "5", "--readopt-seconds", "2")
    engines.start(daemon.socket, ENGINE)
    for i in range(3):
        trickle(engines, daemon, f"0-trickler-{i}.sock")

    status = restart(daemon)
    assert status.load_source == "disk" and not status.readopted
    # The engine's deadline is what is left of the 2 s budget when it is asked (a loaded
    # machine spends some of it first), never more than the budget.
    timed_out = re.search(
        r"0-trickler-0\.sock: the engine did not complete the hand-back within ([\d.]+) s",
        status.load_reason,
    )
    assert timed_out and float(timed_out.group(1)) <= 2, status.load_reason
    assert "re-adoption budget of 2 s spent; 3 engine socket(s) not asked" in status.load_reason
    attached = attach(daemon.socket, transports=["memfd"])
    try:
        for name, tensor in minilm_reference.items():
            assert torch.equal(attached.tensors[name], tensor), name
    finally:
        attached.close()


# An engine of its own layout (tests/unit/toyengine.py, vLLM-shaped): traces its load plan,
# maps that layout and keeps its fds to hand back.
LAYOUT_ENGINE = textwrap.dedent(
    """
    import os, sys, torch
    from tests.unit.toyengine import checkpoint, meta_model, sources
    from weightcache.checkpoint import cache_config, read_checkpoint
    from weightcache.client import attach_layout
    from weightcache.integrations.trace import trace_load
    model = meta_model()
    plan = trace_load(model, sources(checkpoint()), model.load_weights).plan
    config = cache_config(read_checkpoint(os.environ["WC_MODEL"]), torch.device("cpu"))
    attached = attach_layout(sys.argv[1], config, plan, ["memfd"], wait_ready=120)
    print(attached.fingerprint, flush=True)
    sys.stdin.read()
    """
)


def test_engine_layouts_are_readopted_without_reading_the_checkpoint(
    daemons, engines, tmp_path
) -> None:
    from tests.unit.plankit import same_bits
    from tests.unit.toyengine import (
        ToyEngine,
        checkpoint,
        meta_model,
        real_load,
        save_checkpoint,
        sources,
    )
    from weightcache.checkpoint import cache_config, read_checkpoint
    from weightcache.client import attach_layout
    from weightcache.integrations.trace import trace_load

    tensors = checkpoint()
    model = save_checkpoint(tmp_path / "toy", tensors)
    daemon = daemons(model, "--transport", "memfd")
    engine = engines.start(daemon.socket, LAYOUT_ENGINE, env={"WC_MODEL": str(model)})
    [layout] = daemon.status().layouts  # the checkpoint layout was dropped
    assert layout.fingerprint == engine.line and layout.plan is not None
    manifest = read_manifest(manifest_path(daemon.socket, layout.plan))
    assert manifest.fingerprint == layout.fingerprint and manifest.config.plan == layout.plan
    assert manifest.source  # built from the disk read's bytes: it keeps their provenance
    assert not os.path.exists(manifest_path(daemon.socket))  # gone with the dropped layout

    daemon.kill()
    # The toy checkpoint is too small for rchar to tell a read apart, and zeroing it would,
    # rightly, mean the disk (issue 25 item 9): the load source says where the bytes came from.
    status = daemon.start().status()
    assert status.readopted and status.load_source == "readopted"
    assert f"engine pid {engine.pid}" in status.load_reason
    assert [(s.plan, s.source) for s in status.layouts] == [(layout.plan, "readopted")]
    assert status.preloaded_weights_bytes == layout.bytes
    # Served by hash: a new engine of the same plan maps the bytes only the engine held.
    meta = meta_model()
    plan = trace_load(meta, sources(tensors), meta.load_weights).plan
    config = cache_config(read_checkpoint(model), torch.device("cpu"))
    second = attach_layout(daemon.socket, config, plan, ["memfd"])
    try:
        own = real_load(ToyEngine(), tensors)
        assert [n for n in own if not same_bits(second.tensors[n], own[n])] == []
    finally:
        second.close()

    engine.kill()
    engine.wait()
    status = restart(daemon)
    assert status.load_source == "disk" and not status.readopted
    assert [s.plan for s in status.layouts] == [None]
    assert not os.path.exists(manifest_path(daemon.socket, layout.plan))
