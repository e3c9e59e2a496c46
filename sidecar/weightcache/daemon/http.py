"""The daemon's HTTP side: probes, status JSON and Prometheus metrics."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from weightcache.daemon.server import ServerCounters
from weightcache.protocol import DaemonStatus


class DaemonCollector:
    """Reads the live status and counters at scrape time, so metrics never go stale."""

    def __init__(self, status: Callable[[], DaemonStatus], counters: Callable[[], ServerCounters]):
        self._status = status
        self._counters = counters

    def collect(self):
        status = self._status()
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
        counters = self._counters()
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


def start_http_server(
    host: str, port: int, status: Callable[[], DaemonStatus], counters: Callable[[], ServerCounters]
) -> ThreadingHTTPServer:
    registry = CollectorRegistry()
    registry.register(DaemonCollector(status, counters))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                self._send(200, b"ok\n", "text/plain")
            elif path == "/readyz":
                ready = status().state == "ready"
                self._send(
                    200 if ready else 503, b"ready\n" if ready else b"not ready\n", "text/plain"
                )
            elif path == "/status":
                self._send(200, msgspec.json.encode(status()), "application/json")
            elif path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            else:
                self._send(404, b"not found\n", "text/plain")

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # probes are noisy
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="http").start()
    return server
