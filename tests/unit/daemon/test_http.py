"""The daemon's HTTP side under abuse: a fixed set of handler threads, one deadline per
connection, and the excess closed at once; a real daemon process and raw TCP clients."""

from __future__ import annotations

import socket
import time

import pytest

from tests.unit.wc_harness import proc_status_kib, wait_until
from weightcache.daemon.http import HttpLimits

IDLE_CONNECTIONS = 300
# Handlers plus the queue in front of them: at most this many connections wait; every
# other one is closed as soon as it is accepted.
HELD = HttpLimits().workers + HttpLimits().queued


@pytest.fixture(scope="module")
def http_daemon(module_daemons, minilm_dir):
    return module_daemons(minilm_dir, "--transport", "memfd")


def threads(pid: int) -> int:
    return proc_status_kib(pid, "Threads")  # a plain count, despite the helper's name


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_idle_connections_take_no_threads_and_the_excess_is_closed(http_daemon) -> None:
    baseline = threads(http_daemon.pid)
    dropped_before = http_daemon.metric("weightcache_http_dropped_connections_total")
    conns = [
        socket.create_connection(("127.0.0.1", http_daemon.http_port))
        for _ in range(IDLE_CONNECTIONS)
    ]
    try:
        open_ = list(conns)

        def most_closed() -> bool:
            open_[:] = [c for c in open_ if not closed_by_peer(c)]
            return len(open_) <= HELD

        wait_until(most_closed, "the daemon to close the connections it cannot take")
        assert threads(http_daemon.pid) <= baseline
    finally:
        for conn in conns:
            conn.close()
    wait_until(lambda: http_daemon.http("/healthz")[0] == 200, "probes to be answered again")
    dropped = http_daemon.metric("weightcache_http_dropped_connections_total") - dropped_before
    assert dropped >= IDLE_CONNECTIONS - HELD


def test_a_client_trickling_its_request_is_cut_off(http_daemon) -> None:
    request = b"GET /healthz HTTP/1.0\r\n" + b"X-Pad: " + b"x" * 4096
    with socket.create_connection(("127.0.0.1", http_daemon.http_port)) as conn:
        cut_off = False
        give_up = time.monotonic() + 60  # a hang guard, not a timing check
        for byte in request:
            try:
                conn.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                cut_off = True
                break
            if closed_by_peer(conn):
                cut_off = True
                break
            if time.monotonic() > give_up:
                break
            time.sleep(0.5)  # each byte well within any per-read timeout
    assert cut_off
    assert http_daemon.http("/healthz") == (200, "text/plain", b"ok\n")
