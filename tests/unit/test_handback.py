"""Engine hand-back: the engine's socket answers a daemon's readopt request with its fds."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.unit.wc_harness import exchange, frame
from weightcache.client import attach
from weightcache.daemon.readopt import (
    EngineGone,
    ask_for_handback,
    engine_sockets,
    prepare_engines_dir,
)
from weightcache.handback import HandbackServer, offer_handback
from weightcache.protocol import ReadoptRequest, decode_readopt_reply
from weightcache.sockets import PeerPolicy, engines_dir

FINGERPRINT = "f" * 64
OWN = PeerPolicy(frozenset({os.getuid()}))


@pytest.fixture
def socket_dir():
    path = Path(tempfile.mkdtemp(prefix="wc-hb-", dir="/tmp"))
    yield path
    shutil.rmtree(path)


@pytest.fixture
def memfds():
    fds = []
    for size in (4096, 8192):
        fd = os.memfd_create("hb-test")
        os.ftruncate(fd, size)
        fds.append(fd)
    yield fds
    for fd in fds:
        os.close(fd)


@pytest.fixture
def server(socket_dir, memfds):
    prepare_engines_dir(str(socket_dir / "gpu-A.sock"))  # the daemon's part
    s = HandbackServer(str(socket_dir / "gpu-A.sock"), FINGERPRINT, [4096, 8192], memfds)
    yield s
    s.close()


def ask(server_or_path, name: str = "gpu-A.sock", fingerprint: str = FINGERPRINT, policy=OWN):
    path = server_or_path if isinstance(server_or_path, str) else server_or_path.path
    return ask_for_handback(path, name, fingerprint, 4, policy)


def test_hands_back_the_same_files_and_keeps_serving(server, socket_dir, memfds) -> None:
    assert engine_sockets(str(socket_dir / "gpu-A.sock")) == [server.path]
    assert os.path.basename(server.path).startswith(f"{os.getpid()}-")
    assert stat.S_IMODE(os.stat(engines_dir(str(socket_dir / "x.sock"))).st_mode) == 0o3770
    assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o660
    for _ in range(2):  # another restart may come
        handed = ask(server)
        assert handed.pid == os.getpid()
        assert handed.allocation_sizes == [4096, 8192]
        inodes = [os.fstat(fd).st_ino for fd in handed.fds]
        assert inodes == [os.fstat(fd).st_ino for fd in memfds]
        for fd in handed.fds:
            os.close(fd)


def test_close_removes_the_socket(server, socket_dir) -> None:
    server.close()
    assert not os.path.exists(server.path)
    assert engine_sockets(str(socket_dir / "gpu-A.sock")) == []
    with pytest.raises(EngineGone):
        ask(server)
    server.close()  # idempotent


@pytest.mark.parametrize(
    ("name", "fingerprint", "message"),
    [
        ("gpu-B.sock", FINGERPRINT, "attached to gpu-A.sock, not gpu-B.sock"),
        ("gpu-A.sock", "0" * 64, f"holds fingerprint {FINGERPRINT}"),
    ],
)
def test_refuses_a_daemon_of_another_cache_and_keeps_serving(server, name, fingerprint, message):
    with pytest.raises(RuntimeError, match=message):
        ask(server, name, fingerprint)
    assert len(ask(server).fds) == 2


def test_a_bad_frame_is_refused_and_the_engine_keeps_serving(server) -> None:
    bad = frame(ReadoptRequest(v=1, socket_name="gpu-A.sock", fingerprint=FINGERPRINT))
    bad = bad.replace(b"readopt", b"fetch_x")
    got = exchange(server.path, bad)
    reply = decode_readopt_reply(got.replies[0])
    assert reply.status == "refused" and "bad readopt request" in reply.error
    assert got.closed
    assert len(ask(server).fds) == 2


def test_a_peer_outside_the_allowlist_gets_no_fds(server, socket_dir, peers) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to run a peer as another uid")
    # The peer may enter the directories as group 0, but its uid is not allowed.
    os.chmod(socket_dir, 0o750)
    request = frame(ReadoptRequest(v=1, socket_name="gpu-A.sock", fingerprint=FINGERPRINT))
    result = peers.run(server.path, request, user=65534, group=0)
    assert result.returncode == 0, result.stderr
    reply = decode_readopt_reply(bytes.fromhex(result.stdout.strip()))
    assert reply.status == "refused"
    assert "uid 65534" in reply.error
    assert reply.allocation_sizes == []


def test_the_daemon_refuses_an_engine_it_does_not_allow(server) -> None:
    with pytest.raises(PermissionError, match=f"uid {os.getuid()}"):
        ask(server, policy=PeerPolicy(frozenset({12345})))


def test_a_dead_engines_socket_is_recognised(socket_dir) -> None:
    directory = Path(engines_dir(str(socket_dir / "gpu-A.sock")))
    directory.mkdir()
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(directory / "1-deadbeef.sock"))
    dead.close()  # the file stays, nobody listens: a killed engine's leftover
    with pytest.raises(EngineGone):
        ask(str(directory / "1-deadbeef.sock"))


@pytest.mark.parametrize("kind", ["a file", "missing"])
def test_an_unusable_engines_dir_only_costs_the_handback(socket_dir, memfds, caplog, kind) -> None:
    if kind == "a file":
        (socket_dir / "engines").write_text("not a directory")
    with caplog.at_level(logging.WARNING):
        offered, why = offer_handback(str(socket_dir / "gpu-A.sock"), FINGERPRINT, [4096],
                                      memfds[:1])
    assert offered is None
    assert why is not None and why.startswith("cannot offer the weights back")
    assert why in caplog.text
    # An engine never creates the directory: only the daemon sets its owner and mode.
    engines = socket_dir / "engines"
    assert engines.is_file() if kind == "a file" else not engines.exists()


# --------------------------------------------------------------------------- attach


def test_attach_over_memfd_offers_the_weights_back_until_close(memfd_daemon) -> None:
    attached = attach(memfd_daemon.socket, transports=["memfd"])
    try:
        [path] = [
            p
            for p in engine_sockets(memfd_daemon.socket)
            if os.path.basename(p).startswith(f"{os.getpid()}-")
        ]
        name = os.path.basename(memfd_daemon.socket)
        handed = ask(path, name, attached.fingerprint)
        assert handed.allocation_sizes == [attached.preloaded_weights_bytes]
        for fd in handed.fds:
            os.close(fd)
    finally:
        attached.close()
    assert not os.path.exists(path)


def test_attach_without_handback_or_over_torch_ipc_offers_nothing(
    memfd_daemon, torch_ipc_daemon
) -> None:
    def own_sockets(daemon) -> list[str]:
        mine = f"{os.getpid()}-"
        return [p for p in engine_sockets(daemon.socket) if os.path.basename(p).startswith(mine)]

    declined = attach(memfd_daemon.socket, transports=["memfd"], handback=False)
    ipc = attach(torch_ipc_daemon.socket, transports=["torch_ipc"])
    try:
        assert own_sockets(memfd_daemon) == []
        assert own_sockets(torch_ipc_daemon) == []
    finally:
        declined.close()
        ipc.close()


# --------------------------------------------------------------------------- the directory


def test_the_daemon_makes_the_engines_dir_3770_in_its_group(socket_dir) -> None:
    directory = Path(engines_dir(str(socket_dir / "gpu-A.sock")))
    directory.mkdir(mode=0o750)  # as an older daemon left it
    os.chown(directory, -1, 4242)
    assert prepare_engines_dir(str(socket_dir / "gpu-A.sock")) == str(directory)
    info = directory.stat()
    # setgid: engines' sockets get the daemon's group; sticky: none removes another's.
    assert stat.S_IMODE(info.st_mode) == 0o3770
    assert info.st_gid == os.getegid()


def test_a_symlink_for_the_engines_dir_is_refused(socket_dir, tmp_path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    elsewhere.chmod(0o700)
    (socket_dir / "engines").symlink_to(elsewhere)
    with pytest.raises(OSError, match="a symlink there is refused"):
        prepare_engines_dir(str(socket_dir / "gpu-A.sock"))
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o700  # not followed, not changed


def test_only_socket_files_count_as_engines(server, socket_dir, tmp_path) -> None:
    directory = Path(engines_dir(str(socket_dir / "gpu-A.sock")))
    (directory / "0-file.sock").write_text("")
    (directory / "0-dir.sock").mkdir()
    (directory / "0-link.sock").symlink_to(server.path)
    assert engine_sockets(str(socket_dir / "gpu-A.sock")) == [server.path]


def test_engines_may_leave_only_sockets_and_a_start_reads_nothing_below(
    server, socket_dir, caplog
) -> None:
    """Issue 34: an engine of the daemon's group nested directories in engines/ that a
    start later walked. A starting daemon removes what is not a socket where it can, keeps
    a directory that is not empty (it may not enter another uid's) untouched, and logs."""
    daemon_socket = str(socket_dir / "gpu-A.sock")
    directory = Path(engines_dir(daemon_socket))
    (directory / "junk").write_text("x")
    (directory / "link").symlink_to("/etc")
    (directory / "empty").mkdir()
    (directory / "tree" / "a" / "b").mkdir(parents=True)
    (directory / "tree" / "a" / "b" / "leaf").write_text("x")
    with caplog.at_level(logging.WARNING, logger="weightcache.daemon.readopt"):
        prepare_engines_dir(daemon_socket)
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [os.path.basename(server.path), "tree"])
    assert (directory / "tree" / "a" / "b" / "leaf").read_text() == "x"
    assert "removed 3 entries that are not hand-back sockets" in caplog.text
    assert "kept 1 it cannot remove (e.g. 'tree')" in caplog.text
    assert engine_sockets(daemon_socket) == [server.path]


# --------------------------------------------------------------------------- deadlines

# Accepts, reads the request, then answers one byte every 0.2 s: every read returns well
# within a per-read timeout, so only a deadline for the whole exchange can end it.
TRICKLER = """
import socket, sys, time
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[1])
listener.listen(1)
print("ready", flush=True)
conn, _ = listener.accept()
conn.recv(4096)
conn.sendall((200).to_bytes(4, "big"))
for _ in range(200):
    time.sleep(0.2)
    conn.sendall(b"x")
time.sleep(3600)
"""


def test_a_trickling_engine_gets_a_timeout_for_the_whole_exchange(socket_dir) -> None:
    directory = Path(prepare_engines_dir(str(socket_dir / "gpu-A.sock")))
    path = str(directory / "1-trickle.sock")
    proc = subprocess.Popen(
        [sys.executable, "-c", TRICKLER, path], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        with pytest.raises(TimeoutError, match="did not complete the hand-back within 1 s"):
            ask_for_handback(path, "gpu-A.sock", FINGERPRINT, 4, OWN, timeout=1.0)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
