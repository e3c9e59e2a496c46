"""Issue 9, part 3: the daemon dies, is stopped, or finds its checkpoint changed.

Real daemon processes on real sockets. A SIGKILLed daemon leaves its socket
file and lock file behind; its successor must take both over. SIGTERM must
finish the transfers already under way. A checkpoint rewritten on disk must
give the next daemon a different fingerprint, so engines expecting the old
weights are refused by name.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.unit.wc_harness import frame, print_counts, wait_until
from weightcache.checkpoint import cache_config, read_checkpoint
from weightcache.client import ConfigMismatch, attach
from weightcache.daemon.lock import lock_path
from weightcache.layout import build_views
from weightcache.protocol import FetchStateReply, FetchStateRequest, decode_reply
from weightcache.transport import get_client_transport_backend
from weightcache.wire import recv_frame

COUNTS: dict[str, int] = {}
RESTARTS = 3
DRAINED = 4


def count(kind: str, n: int = 1) -> None:
    COUNTS[kind] = COUNTS.get(kind, 0) + n


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    yield
    print_counts("daemon faults run", COUNTS)


def same_tensors(tensors: dict, reference: dict) -> bool:
    return set(tensors) == set(reference) and all(
        torch.equal(tensors[name], tensor) for name, tensor in reference.items()
    )


def connection_ended(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:  # the daemon died with our unread bytes in its queue
        return True


def refused(socket_path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(socket_path)
        except (ConnectionRefusedError, FileNotFoundError):
            return True
    return False


# ----------------------------------------------------------------------------- SIGKILL


def test_sigkill_then_restart_takes_over_the_stale_socket_and_lock(
    daemons, minilm_dir, minilm_reference
) -> None:
    daemon = daemons(minilm_dir, "--transport", "memfd")
    fingerprint = daemon.status().fingerprint
    # An engine that stays up across every daemon restart.
    engine = attach(daemon.socket)
    try:
        for _ in range(RESTARTS):
            dead_pid = daemon.pid
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mid_request:
                mid_request.settimeout(30)
                mid_request.connect(daemon.socket)
                mid_request.sendall(
                    frame(FetchStateRequest(v=1, config=None, transports=["x"]))[:9]
                )
                daemon.kill()
                # A client caught mid-request sees the connection end, not a hang.
                assert connection_ended(mid_request)
            count("daemon SIGKILLs")

            # What a killed daemon leaves behind.
            assert os.path.exists(daemon.socket)
            lock = lock_path(daemon.socket)
            assert open(lock).read().strip() == str(dead_pid)
            # The gap: a clear error that names the socket.
            with pytest.raises(
                ConnectionRefusedError,
                match=rf"no weightcache daemon answering .*{re.escape(daemon.socket)}",
            ):
                attach(daemon.socket)
            # memfd: the engine keeps its weights with the daemon gone, and says it is degraded.
            assert engine.degraded()
            assert same_tensors(engine.tensors, minilm_reference)

            daemon.start()  # same socket path, same lock file
            count("daemon restarts onto a stale socket and lock")
            assert daemon.pid != dead_pid
            assert open(lock).read().strip() == str(daemon.pid)
            assert daemon.status().fingerprint == fingerprint
            fresh = attach(daemon.socket)
            assert fresh.daemon_pid == daemon.pid and fresh.fingerprint == fingerprint
            assert same_tensors(fresh.tensors, minilm_reference)
            fresh.close()
    finally:
        engine.close()


# ----------------------------------------------------------------------------- SIGTERM


def finish_fetch(sock: socket.socket, rest: bytes, layout_reference: dict) -> None:
    """Send the rest of a fetch_state request; map what comes back; compare."""
    sock.sendall(rest)
    body, _ = recv_frame(sock)
    reply = decode_reply(body)
    assert isinstance(reply, FetchStateReply) and reply.status == "ok", reply
    backend = get_client_transport_backend(reply.transport_backend)
    memory = backend.import_tensors(backend.recv_fetch_state_response(sock, reply))
    try:
        assert same_tensors(build_views(memory.buffers, reply.layout), layout_reference)
    finally:
        memory.close()


def test_sigterm_drains_transfers_in_flight(daemons, minilm_dir, minilm_reference) -> None:
    daemon = daemons(minilm_dir, "--transport", "memfd")
    request = frame(FetchStateRequest(v=1, config=None, transports=["memfd"]))
    half = len(request) // 2
    in_flight = []
    for _ in range(DRAINED):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(daemon.socket)
        s.sendall(request[:half])
        in_flight.append(s)
    wait_until(
        lambda: daemon.metric("weightcache_active_connections") == DRAINED,
        "the daemon to admit every in-flight client",
    )
    daemon.proc.send_signal(signal.SIGTERM)
    # Draining: nobody new gets in...
    wait_until(lambda: refused(daemon.socket), "the daemon to stop accepting")
    assert daemon.proc.poll() is None
    # ...while every transfer already under way completes in full.
    for s in in_flight:
        with s:
            finish_fetch(s, request[half:], minilm_reference)
    count("in-flight transfers drained on SIGTERM", DRAINED)
    assert daemon.proc.wait(60) == 0
    assert not os.path.exists(daemon.socket)


# ----------------------------------------------------------------------------- checkpoint


def test_a_checkpoint_changed_on_disk_gives_the_next_daemon_a_new_fingerprint(
    daemons, minilm_dir, tmp_path
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(minilm_dir / "model.safetensors", model / "model.safetensors")
    daemon = daemons(model, "--transport", "memfd")
    engine_config = cache_config(read_checkpoint(model), torch.device("cpu"))
    first = attach(daemon.socket, engine_config)
    first.close()

    # Retrained and re-saved in place: new values and metadata, same shapes and dtypes.
    retrained = {
        name: tensor + 1 if tensor.is_floating_point() else tensor
        for name, tensor in load_file(model / "model.safetensors").items()
    }
    old_size = (model / "model.safetensors").stat().st_size
    assert daemon.terminate() == 0
    save_file(retrained, model / "model.safetensors", metadata={"revision": "retrained"})
    daemon.start()
    count("daemon restarts onto a changed checkpoint")
    assert daemon.status().fingerprint != first.fingerprint
    # An engine still expecting the old weights is refused, with the fields named.
    with pytest.raises(ConfigMismatch) as info:
        attach(daemon.socket, engine_config)
    resized = (model / "model.safetensors").stat().st_size != old_size
    assert info.value.fields == ["model.files[0].header_sha256"] + (
        ["model.files[0].size"] if resized else []
    )
    # An engine that reads the new checkpoint gets exactly its tensors.
    engine_config = cache_config(read_checkpoint(model), torch.device("cpu"))
    fresh = attach(daemon.socket, engine_config)
    assert fresh.fingerprint == daemon.status().fingerprint
    assert same_tensors(fresh.tensors, retrained)
    fresh.close()
