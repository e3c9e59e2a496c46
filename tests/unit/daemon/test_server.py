"""The daemon's socket server, through a real daemon process and raw or real clients."""

from __future__ import annotations

import os
import resource
import signal
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch

from tests.unit.wc_harness import (
    DAEMON_GID,
    DAEMON_UID,
    cross_uid_workdir,
    exchange,
    frame,
    python_for,
    wait_until,
)
from weightcache.client import (
    ConfigMismatch,
    DaemonError,
    DaemonNotReady,
    attach,
    daemon_status,
    ping,
)
from weightcache.daemon.lock import lock_path
from weightcache.daemon.server import ServerLimits, SocketServer
from weightcache.protocol import (
    MAX_REQUEST_FRAME,
    CacheConfig,
    ErrorReply,
    FetchStateReply,
    FetchStateRequest,
    FileIdentity,
    PingReply,
    PingRequest,
    StatusReply,
    StatusRequest,
    decode_reply,
)
from weightcache.sockets import PeerPolicy, listen_unix, prepare_socket_dir

FETCH = FetchStateRequest(v=1, config=None, transports=["memfd", "torch_ipc"])


def same_weights(attached, reference: dict) -> bool:
    return set(attached.tensors) == set(reference) and all(
        torch.equal(attached.tensors[name], tensor) for name, tensor in reference.items()
    )


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("daemon_fixture", ["memfd_daemon", "torch_ipc_daemon"])
def test_round_trip_through_each_transport(request, daemon_fixture, minilm_reference) -> None:
    daemon = request.getfixturevalue(daemon_fixture)
    transport = daemon_fixture.removesuffix("_daemon")
    attached = attach(daemon.socket, transports=[transport])
    try:
        assert attached.transport == transport
        assert same_weights(attached, minilm_reference)
        status = daemon.status()
        assert status.state == "ready" and status.transport_backend == transport
        assert attached.preloaded_weights_bytes == status.preloaded_weights_bytes
        assert (
            status.preloaded_weights_bytes
            >= status.expected_bytes
            == sum(t.numel() * t.element_size() for t in minilm_reference.values())
        )
    finally:
        attached.close()


def test_ping_status_and_fetch_state_on_one_connection(memfd_daemon) -> None:
    data = frame(PingRequest(v=1)) + frame(StatusRequest(v=1)) + frame(FETCH)
    result = exchange(memfd_daemon.socket, data)
    assert len(result.replies) == 4
    ping_reply, status_reply, fetch_reply = map(decode_reply, result.replies[:3])
    fds_frame = msgspec.msgpack.decode(result.replies[3])
    assert ping_reply == PingReply(v=1, pid=memfd_daemon.pid)
    assert isinstance(status_reply, StatusReply) and status_reply.status.state == "ready"
    assert isinstance(fetch_reply, FetchStateReply) and fetch_reply.status == "ok"
    assert fetch_reply.fingerprint == status_reply.status.fingerprint
    assert fds_frame == {"op": "fds", "v": 1, "count": 1}
    assert result.closed and result.trailing == b""


# ----------------------------------------------------------------------------- config


def _with(config: CacheConfig, path: str, value) -> CacheConfig:
    """``config`` with the field at dotted ``path`` set to ``value``."""
    data = msgspec.to_builtins(config)
    *parents, leaf = path.replace("[", ".").replace("]", "").split(".")
    node = data
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    node[int(leaf) if leaf.isdigit() else leaf] = value
    return msgspec.convert(data, CacheConfig)


MISMATCHES = [
    ("model.path", "/models/elsewhere"),
    ("model.revision", "main"),
    ("model.files[0].name", "pytorch_model.safetensors"),
    ("model.files[0].size", 1),
    ("model.files[0].header_sha256", "0" * 64),
    ("dtype", "bfloat16"),
    ("shard.tp_size", 2),
    ("shard.tp_rank", 1),
    ("shard.plan", "rowwise"),
    ("device_capability", "sm_90"),
    ("layout_version", 2),
]


@pytest.fixture(scope="module")
def daemon_config(memfd_daemon) -> CacheConfig:
    attached = attach(memfd_daemon.socket)
    attached.close()
    return attached.config


@pytest.mark.parametrize(("path", "value"), MISMATCHES, ids=[p for p, _ in MISMATCHES])
def test_each_config_field_mismatch_is_refused_naming_the_field(
    memfd_daemon, daemon_config, path, value
) -> None:
    expected = _with(daemon_config, path, value)
    with pytest.raises(ConfigMismatch) as info:
        attach(memfd_daemon.socket, expected)
    assert info.value.fields == [path]
    assert path in str(info.value)


def test_a_config_with_an_extra_file_is_refused(memfd_daemon, daemon_config) -> None:
    extra = FileIdentity("model-2.safetensors", 10, "1" * 64)
    expected = msgspec.structs.replace(
        daemon_config,
        model=msgspec.structs.replace(
            daemon_config.model, files=[*daemon_config.model.files, extra]
        ),
    )
    with pytest.raises(ConfigMismatch) as info:
        attach(memfd_daemon.socket, expected)
    assert info.value.fields == ["model.files (length 2 != 1)"]


def test_the_matching_config_attaches(memfd_daemon, daemon_config, minilm_reference) -> None:
    attached = attach(memfd_daemon.socket, daemon_config)
    assert same_weights(attached, minilm_reference)
    attached.close()


# ----------------------------------------------------------------------------- bad frames


def raw_frame(fields: dict) -> bytes:
    """A frame holding any map at all, as a misbehaving peer could send it."""
    body = msgspec.msgpack.encode(fields)
    return len(body).to_bytes(4, "big") + body


# Each bad frame and what the daemon's error reply must say about it.
BAD_FRAMES = {
    "truncated header": (b"\x00\x00", "truncated frame header (2 of 4 bytes)"),
    "truncated body": (frame(PingRequest(v=1))[:-2], "truncated frame body"),
    "oversized": (
        (MAX_REQUEST_FRAME + 1).to_bytes(4, "big") + b"x" * 64,
        f"exceeds the {MAX_REQUEST_FRAME}-byte cap",
    ),
    "not msgpack": (b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1", "bad request"),
    "not a map": (b"\x00\x00\x00\x01\x07", "bad request: Expected `object`"),
    "unknown op": (raw_frame({"op": "shutdown", "v": 1}), "'shutdown'"),
    "wrong version": (raw_frame({"op": "ping", "v": 2}), "$.v"),
    "wrong field type": (
        raw_frame({"op": "fetch_state", "v": 1, "config": None, "transports": "memfd"}),
        "$.transports",
    ),
}


@pytest.mark.parametrize("kind", list(BAD_FRAMES))
def test_a_bad_frame_gets_an_error_and_a_closed_connection(memfd_daemon, kind) -> None:
    data, message = BAD_FRAMES[kind]
    result = exchange(memfd_daemon.socket, data)
    assert result.closed
    assert len(result.replies) == 1 and result.trailing == b""
    reply = decode_reply(result.replies[0])
    assert isinstance(reply, ErrorReply)
    assert message in reply.error


def test_fds_sent_to_the_daemon_are_refused_and_not_kept(memfd_daemon) -> None:
    before = memfd_daemon.fd_count()
    sent = [os.memfd_create("unwanted") for _ in range(4)]
    try:
        for count in (1, 4):
            result = exchange(memfd_daemon.socket, frame(PingRequest(v=1)), tuple(sent[:count]))
            assert result.closed
            reply = decode_reply(result.replies[0])
            assert isinstance(reply, ErrorReply) and "file descriptors" in reply.error
    finally:
        for fd in sent:
            os.close(fd)
    memfd_daemon.wait_idle()
    assert memfd_daemon.fd_count() == before


def test_a_half_sent_frame_does_not_hold_up_other_clients(memfd_daemon, minilm_reference) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stalled:
        stalled.settimeout(30)
        stalled.connect(memfd_daemon.socket)
        stalled.sendall(frame(FETCH)[:7])
        # While that client sits mid-frame, others are served in full.
        attached = attach(memfd_daemon.socket)
        assert same_weights(attached, minilm_reference)
        attached.close()
        assert ping(memfd_daemon.socket) == memfd_daemon.pid
        stalled.shutdown(socket.SHUT_WR)
        reply = decode_reply(stalled.recv(65536)[4:])
        assert isinstance(reply, ErrorReply) and "truncated frame body" in reply.error


def test_bad_frames_while_well_formed_clients_attach(memfd_daemon, minilm_reference) -> None:
    stop = threading.Event()
    outcomes: list[object] = []

    def good_client() -> None:
        while not stop.is_set():
            try:
                attached = attach(memfd_daemon.socket)
                outcomes.append(same_weights(attached, minilm_reference))
                attached.close()
            except Exception as exc:  # recorded, then asserted below
                outcomes.append(exc)

    worker = threading.Thread(target=good_client)
    worker.start()
    try:
        for _ in range(20):
            for kind in BAD_FRAMES:
                data, message = BAD_FRAMES[kind]
                reply = decode_reply(exchange(memfd_daemon.socket, data).replies[0])
                assert message in reply.error
        wait_until(lambda: len(outcomes) >= 3, "well-formed clients to attach")
    finally:
        stop.set()
        worker.join(60)
    assert outcomes and all(o is True for o in outcomes), outcomes[:3]


# ----------------------------------------------------------------------------- permissions


def test_socket_dir_is_0750_socket_0660_private_dir_0700_lock_0600(memfd_daemon) -> None:
    path = Path(memfd_daemon.socket)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o750
    assert stat.S_ISSOCK(path.stat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o660
    assert stat.S_IMODE((path.parent / ".daemon").stat().st_mode) == 0o700
    lock = Path(lock_path(memfd_daemon.socket))
    assert lock.parent == path.parent / ".daemon"
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600
    assert lock.read_text().strip() == str(memfd_daemon.pid)


NOBODY = 65534
ALLOWED_GID = 4242


@pytest.fixture(scope="module")
def allowlist_daemon(module_daemons, minilm_dir):
    daemon = module_daemons(minilm_dir, "--allow-uid", "0", "--allow-gid", str(ALLOWED_GID))
    # Open the filesystem path to everyone, so the daemon's own SO_PEERCRED
    # check is the only thing between another uid and the weights.
    os.chmod(daemon.workdir, 0o711)
    os.chmod(Path(daemon.socket).parent, 0o751)
    os.chmod(daemon.socket, 0o666)
    return daemon


def test_a_peer_outside_the_allowlist_is_refused(allowlist_daemon, peers) -> None:
    refused = peers.run(allowlist_daemon.socket, frame(PingRequest(v=1)), NOBODY, NOBODY)
    assert refused.returncode == 0, refused.stderr
    reply = decode_reply(bytes.fromhex(refused.stdout.strip()))
    assert reply == ErrorReply(v=1, error=f"peer uid {NOBODY} / gid {NOBODY} is not allowed")
    fetch = peers.run(allowlist_daemon.socket, frame(FETCH), NOBODY, NOBODY)
    assert "is not allowed" in decode_reply(bytes.fromhex(fetch.stdout.strip())).error
    assert 'weightcache_refused_connections_total{reason="peer_credentials"}' in (
        allowlist_daemon.http("/metrics")[2].decode()
    )


def test_the_same_uid_is_served_when_its_group_is_allowed(allowlist_daemon, peers) -> None:
    """The control for the refusal above: the same path, uid and frame, an allowed gid."""
    served = peers.run(allowlist_daemon.socket, frame(PingRequest(v=1)), NOBODY, ALLOWED_GID)
    assert served.returncode == 0, served.stderr
    assert decode_reply(bytes.fromhex(served.stdout.strip())) == PingReply(
        v=1, pid=allowlist_daemon.pid
    )
    assert ping(allowlist_daemon.socket) == allowlist_daemon.pid  # our own uid, listed


def test_peer_policy() -> None:
    policy = PeerPolicy(frozenset({1000}), frozenset({50}))
    assert policy.allows(1000, 1) and policy.allows(7, 50)
    assert not policy.allows(7, 8) and not PeerPolicy(frozenset()).allows(0, 0)


# ----------------------------------------------------------------------------- killed clients


def test_fifty_clients_killed_mid_transfer_leave_the_daemon_serving_without_fd_growth(
    many_tensor_daemon, peers
) -> None:
    daemon, tensors = many_tensor_daemon
    attached = attach(daemon.socket)  # warm up every code path once
    attached.close()
    daemon.wait_idle()
    baseline = daemon.fd_count()

    request = frame(FetchStateRequest(v=1, config=None, transports=["memfd"]))
    held = [peers.hold(daemon.socket, i % 6, request) for i in range(50)]
    # Clients stopped at steps 2 and 3 have left the daemon in sendall of the reply.
    assert daemon.metric("weightcache_active_connections") >= 1
    for proc in held:
        proc.send_signal(signal.SIGKILL)
    for proc in held:
        assert proc.wait(30) == -signal.SIGKILL
    print(f"\nclients killed mid-handshake/transfer: {len(held)}")

    daemon.wait_idle()
    assert daemon.proc.poll() is None
    assert daemon.fd_count() == baseline
    attached = attach(daemon.socket)
    try:
        assert len(attached.tensors) == len(tensors)
        for name in list(tensors)[::997]:
            assert torch.equal(attached.tensors[name], tensors[name])
    finally:
        attached.close()


# ----------------------------------------------------------------------------- in-process server


def _status():
    from weightcache.protocol import DaemonStatus

    return DaemonStatus(
        state="loading",
        pid=os.getpid(),
        device="cpu",
        gpu="cpu",
        transport_backend="memfd",
        preloaded_weights_bytes=0,
        expected_bytes=0,
        fingerprint=None,
        load_seconds=None,
        load_source=None,
        readopted=False,
        socket="",
        clients_served=0,
        error=None,
    )


@pytest.fixture
def loading_server(tmp_path):
    """An in-process server whose weights are still loading; ``(socket, server)`` per limit."""
    started = []

    def start(max_connections: int) -> tuple[str, SocketServer]:
        path = str(tmp_path / f"s{len(started)}" / "cpu.sock")
        prepare_socket_dir(path)
        server = SocketServer(
            listen_unix(path, backlog=128),
            PeerPolicy(frozenset({os.getuid()})),
            ServerLimits(max_connections=max_connections, timeout_seconds=30),
            lambda: None,
            _status,
        )
        thread = threading.Thread(target=server.serve_forever)
        thread.start()
        started.append((server, thread))
        return path, server

    yield start
    for server, thread in started:
        server.stop(5)
        thread.join(10)


def test_fetch_while_loading_is_a_clear_retryable_error(loading_server) -> None:
    path, _ = loading_server(max_connections=8)
    with pytest.raises(DaemonNotReady, match="daemon is still loading"):
        attach(path)
    assert daemon_status(path).state == "loading"


def test_a_stop_right_after_an_accept_waits_for_that_connection(
    loading_server, monkeypatch
) -> None:
    """SIGTERM can land between an accept and the start of the connection's thread: the
    drain must wait for that thread, not fail joining one that has not started."""
    path, server = loading_server(max_connections=8)
    real_start = threading.Thread.start
    starting = threading.Event()

    def slow_start(thread: threading.Thread) -> None:
        if getattr(thread, "_target", None) == server._serve_connection:
            starting.set()
            time.sleep(0.5)  # stop() runs meanwhile
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", slow_start)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(path)
        assert starting.wait(10)
        assert server.stop(5) is True
        assert client.recv(1) == b""  # closed by its thread, which saw the stop


def test_connections_past_the_limit_are_told_busy(loading_server) -> None:
    path, server = loading_server(max_connections=1)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as holder:
        holder.connect(path)
        holder.sendall(frame(PingRequest(v=1)))
        assert decode_reply(holder.recv(4096)[4:]) == PingReply(v=1, pid=os.getpid())
        # The holder keeps the only slot; the next client is answered, not queued.
        with pytest.raises(DaemonNotReady, match="busy: 1 connections in progress"):
            ping(path)
        assert server.counters.refused == {"busy": 1}
    wait_until(lambda: _pings(path), "the slot to be free again")


def _pings(path: str, pid: int | None = None) -> bool:
    try:
        return ping(path) == (pid or os.getpid())
    except DaemonError:
        return False


def test_a_stale_socket_file_is_replaced(tmp_path) -> None:
    path = str(tmp_path / "stale.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()  # the file stays, nobody listens: what a SIGKILLed daemon leaves
    with pytest.raises(ConnectionRefusedError):
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect(path)
    listener = listen_unix(path, backlog=128)
    with listener, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660


# ----------------------------------------------------------------------------- out of threads


# Run as the daemon's uid with the same RLIMIT_NPROC: starts threads until the uid's
# tasks reach the limit, then holds them, so nothing under that limit can start one.
THREAD_HOG = """
import sys, threading
threading.stack_size(64 * 1024)
hold = threading.Event()
started = 0
try:
    while True:
        threading.Thread(target=hold.wait, daemon=True).start()
        started += 1
except RuntimeError:
    pass
print(started, flush=True)
sys.stdin.read()
"""
TASK_LIMIT = 512  # well above what the daemon starts with, on any machine


def test_a_thread_that_cannot_start_costs_one_connection_not_the_accept_loop(
    daemons, minilm_dir, minilm_reference
) -> None:
    # The daemon's uid is its own, so the hog below exhausts its tasks and nobody else's.
    workdir = daemons.workdir()
    cross_uid_workdir(workdir)
    daemon = daemons(
        minilm_dir,
        *("--transport", "memfd", "--allow-uid", "0"),
        workdir=workdir,
        user=DAEMON_UID,
        group=DAEMON_GID,
        nproc_limit=TASK_LIMIT,
    )
    hog = subprocess.Popen(
        [python_for(DAEMON_UID), "-c", THREAD_HOG],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        user=DAEMON_UID,
        group=DAEMON_GID,
        extra_groups=[],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NPROC, (TASK_LIMIT, TASK_LIMIT)),
    )
    try:
        assert int(hog.stdout.readline()) > 0  # the uid is out of tasks now
        with pytest.raises(DaemonNotReady, match="busy: cannot start a thread for this connection"):
            ping(daemon.socket)
        # The HTTP side's handlers were all started up front: probes still answer.
        assert daemon.http("/readyz") == (200, "text/plain", b"ready\n")
        metrics = daemon.http("/metrics")[2].decode()
        assert 'weightcache_refused_connections_total{reason="thread_start"} 1.0' in metrics
    finally:
        hog.kill()
        hog.wait()
        hog.stdin.close()
        hog.stdout.close()
    # The accept loop lived on: once the uid's tasks are released, clients are served.
    wait_until(lambda: _pings(daemon.socket, daemon.pid), "the daemon to serve again")
    attached = attach(daemon.socket)
    try:
        assert same_weights(attached, minilm_reference)
    finally:
        attached.close()
