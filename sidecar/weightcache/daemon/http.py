"""The daemon's HTTP side: probes, status JSON and Prometheus metrics.

The server is bounded: a fixed pool of handler threads started once, an
accepted connection waits for one in a short queue, and past that it is
closed at once (counted in ``weightcache_http_dropped_connections_total``).
Each connection has ``request_seconds`` to send its whole request: a client
trickling bytes or sitting idle loses its connection, never a thread for
long. One request per connection (HTTP/1.0), as probes and scrapers send.

``/status`` here is a public summary: the listen address is usually the pod
IP, reachable from other pods. Socket paths, error text and the re-adoption
reason stay on the peer-checked Unix socket (``weightcache-sidecar status``)
and in the logs.
"""

from __future__ import annotations

import io
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Protocol

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from weightcache.daemon.health import Probe
from weightcache.daemon.server import ServerCounters
from weightcache.protocol import DaemonStatus

log = logging.getLogger(__name__)

# Free text and paths: kept off the network-facing /status.
PRIVATE_STATUS_FIELDS = ("socket", "error", "load_reason", "warning")


@dataclass(frozen=True)
class HttpLimits:
    workers: int = 4
    queued: int = 16
    request_seconds: float = 5.0


class DaemonView(Protocol):
    """What the HTTP side reads from the daemon, live at each request."""

    def status(self) -> DaemonStatus: ...
    def counters(self) -> ServerCounters: ...
    def liveness(self) -> Probe: ...
    def readiness(self) -> Probe: ...


def public_status(status: DaemonStatus) -> dict:
    data = msgspec.to_builtins(status)
    for name in PRIVATE_STATUS_FIELDS:
        data.pop(name, None)
    return data


class DaemonCollector:
    """Reads the live status and counters at scrape time, so metrics never go stale."""

    def __init__(self, daemon: DaemonView, http_dropped: Callable[[], int]) -> None:
        self._daemon = daemon
        self._http_dropped = http_dropped

    def collect(self):
        status = self._daemon.status()
        labels = ["device", "transport"]
        values = [status.gpu, status.transport_backend or ""]
        ready = GaugeMetricFamily(
            "weightcache_ready", "1 when the weights are resident and served", labels=labels
        )
        ready.add_metric(values, 1.0 if status.state == "ready" else 0.0)
        yield ready
        held = GaugeMetricFamily(
            "weightcache_preloaded_weights_bytes",
            "Device bytes the resident weights occupy",
            labels=labels,
        )
        held.add_metric(values, status.preloaded_weights_bytes)
        yield held
        expected = GaugeMetricFamily(
            "weightcache_expected_weights_bytes",
            "Bytes the checkpoint's tensors need",
            labels=labels,
        )
        expected.add_metric(values, status.expected_bytes)
        yield expected
        load = GaugeMetricFamily(
            "weightcache_load_seconds", "Seconds the last load took", labels=labels
        )
        load.add_metric(values, status.load_seconds or 0.0)
        yield load
        counters = self._daemon.counters()
        with counters.lock:
            served = dict(counters.served)
            refused = dict(counters.refused)
            active = counters.active
        requests = CounterMetricFamily(
            "weightcache_requests", "Requests answered, by op", labels=["op"]
        )
        for op, n in sorted(served.items()):
            requests.add_metric([op], n)
        yield requests
        refusals = CounterMetricFamily(
            "weightcache_refused_connections", "Connections refused, by reason", labels=["reason"]
        )
        for reason, n in sorted(refused.items()):
            refusals.add_metric([reason], n)
        yield refusals
        conns = GaugeMetricFamily(
            "weightcache_active_connections", "Client connections being served"
        )
        conns.add_metric([], active)
        yield conns
        dropped = CounterMetricFamily(
            "weightcache_http_dropped_connections",
            "HTTP connections closed unanswered: every handler busy and the queue full",
        )
        dropped.add_metric([], self._http_dropped())
        yield dropped


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, all of them due by one deadline (a per-read timeout is not enough:
    a byte every few seconds would keep a handler forever)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the request did not arrive in time")
        self._sock.settimeout(remaining)
        return self._sock.recv_into(buffer)


class BoundedHTTPServer(HTTPServer):
    """``limits.workers`` handler threads, ``limits.queued`` waiting connections, no more."""

    request_queue_size = 64

    def __init__(self, address: tuple[str, int], handler, limits: HttpLimits) -> None:
        super().__init__(address, handler)
        self.limits = limits
        self.dropped = 0
        self._waiting: queue.Queue = queue.Queue(limits.queued)
        self._workers = [
            threading.Thread(target=self._work, daemon=True, name=f"http-{i}")
            for i in range(limits.workers)
        ]
        for worker in self._workers:
            worker.start()

    def process_request(self, request, client_address) -> None:
        try:
            self._waiting.put_nowait((request, client_address))
        except queue.Full:
            self.dropped += 1
            self.shutdown_request(request)

    def _work(self) -> None:
        while True:
            item = self._waiting.get()
            if item is None:
                return
            request, client_address = item
            try:
                self.finish_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        log.debug("HTTP request from %s failed", client_address, exc_info=True)

    def server_close(self) -> None:
        super().server_close()
        while True:
            try:
                item = self._waiting.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self.shutdown_request(item[0])
        for _ in self._workers:
            try:
                self._waiting.put_nowait(None)
            except queue.Full:
                break


def start_http_server(
    host: str, port: int, daemon: DaemonView, limits: HttpLimits | None = None
) -> BoundedHTTPServer:
    limits = limits or HttpLimits()

    class Handler(BaseHTTPRequestHandler):
        timeout = limits.request_seconds  # each write; reads share one deadline (setup)

        def setup(self) -> None:
            super().setup()
            self.rfile.close()
            deadline = time.monotonic() + limits.request_seconds
            self.rfile = io.BufferedReader(_DeadlineReader(self.connection, deadline))

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                self._probe(daemon.liveness())
            elif path == "/readyz":
                self._probe(daemon.readiness())
            elif path == "/status":
                body = msgspec.json.encode(public_status(daemon.status()))
                self._send(200, body, "application/json")
            elif path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            else:
                self._send(404, b"not found\n", "text/plain")

        def _probe(self, probe: Probe) -> None:
            self._send(probe.code, probe.body.encode(), "text/plain")

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # probes are noisy
            pass

    server = BoundedHTTPServer((host, port), Handler, limits)
    registry = CollectorRegistry()
    registry.register(DaemonCollector(daemon, lambda: server.dropped))
    threading.Thread(target=server.serve_forever, daemon=True, name="http").start()
    return server
