"""The daemon's HTTP side under abuse: idle and slow clients hold no worker, one address
cannot take every connection, and each connection has one deadline; a real daemon process
and raw TCP clients from several loopback addresses."""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest

from tests.unit.wc_harness import free_port, proc_status_kib, wait_until
from weightcache.daemon.http import HttpLimits

IDLE_CONNECTIONS = 300
PER_SOURCE = HttpLimits().per_source
ATTACKER, SCRAPER = "127.0.0.1", "127.0.0.2"


@pytest.fixture(scope="module")
def http_daemon(module_daemons, minilm_dir):
    metrics_port = free_port()
    daemon = module_daemons(
        minilm_dir, "--transport", "memfd", "--metrics-address", f"127.0.0.1:{metrics_port}"
    )
    daemon.metrics_port = metrics_port
    return daemon


def threads(pid: int) -> int:
    return proc_status_kib(pid, "Threads")  # a plain count, despite the helper's name


def connect(port: int, source: str) -> socket.socket:
    conn = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    conn.bind((source, 0))
    conn.connect(("127.0.0.1", port))
    return conn


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def get(port: int, path: str, source: str) -> tuple[int, bytes]:
    """One GET from ``source``; (status, body)."""
    with connect(port, source) as conn:
        conn.settimeout(10)
        conn.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def test_idle_connections_hold_no_worker_and_other_clients_are_answered(http_daemon) -> None:
    """Issue 25 item 1: eight idle clients once failed every probe (four handler threads
    blocked on reading a request). Now idle connections from one address are capped and the
    rest closed at once, and every complete request from elsewhere is answered meanwhile."""
    port = http_daemon.http_port
    baseline = threads(http_daemon.pid)
    dropped_before = http_daemon.metric("weightcache_http_dropped_connections_total")
    conns = [connect(port, ATTACKER) for _ in range(IDLE_CONNECTIONS)]
    try:
        open_ = list(conns)

        def capped() -> bool:
            open_[:] = [c for c in open_ if not closed_by_peer(c)]
            return len(open_) <= PER_SOURCE

        wait_until(capped, "the daemon to close what one address may not hold")
        assert threads(http_daemon.pid) <= baseline
        # While the attacker's connections sit idle, scrapes and probes from another
        # address are each answered.
        for _ in range(20):
            code, body = get(port, "/metrics", SCRAPER)
            assert code == 200 and b"weightcache_ready" in body
            assert get(port, "/readyz", SCRAPER) == (200, b"ready\n")
        code, body = get(http_daemon.metrics_port, "/metrics", SCRAPER)
        assert code == 200 and b"weightcache_ready" in body
    finally:
        for conn in conns:
            conn.close()
    dropped = http_daemon.metric("weightcache_http_dropped_connections_total") - dropped_before
    assert dropped >= IDLE_CONNECTIONS - PER_SOURCE


def test_the_metrics_port_serves_metrics_alone(http_daemon) -> None:
    for path in ("/healthz", "/readyz", "/status"):
        assert get(http_daemon.metrics_port, path, SCRAPER)[0] == 404
    assert get(http_daemon.metrics_port, "/metrics", SCRAPER)[0] == 200


def test_a_client_trickling_its_request_is_cut_off(http_daemon) -> None:
    request = b"GET /healthz HTTP/1.0\r\n" + b"X-Pad: " + b"x" * 4096
    with connect(http_daemon.http_port, ATTACKER) as conn:
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


def test_an_oversized_request_head_is_closed_unanswered(http_daemon) -> None:
    with connect(http_daemon.http_port, ATTACKER) as conn:
        conn.settimeout(10)
        try:
            conn.sendall(b"GET /metrics HTTP/1.0\r\nX-Pad: " + b"x" * 65536 + b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            assert conn.recv(65536) == b""
        except ConnectionResetError:
            pass
    assert http_daemon.http("/healthz") == (200, "text/plain", b"ok\n")


def test_only_get_is_answered(http_daemon) -> None:
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_daemon.http_port}/metrics", data=b"x", method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 405
