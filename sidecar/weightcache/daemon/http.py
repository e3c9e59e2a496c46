"""The daemon's HTTP side: Prometheus metrics, and (on loopback) probes and status JSON.

Nothing here decides whether the daemon is alive or ready in Kubernetes: the
kubelet asks over the peer-checked Unix socket (``weightcache-sidecar
probe``), so no port anyone can reach takes a daemon out of service. In a pod
the only listener is ``--metrics-address`` (``/metrics`` alone); outside one,
``--http-address`` serves all four paths on loopback by default.

The server is an asyncio loop on a thread of its own, and it answers only
complete requests: a connection costs a few KiB and no thread until its
request head has arrived, so idle or trickling clients hold nothing anyone
else needs. Each connection has ``request_seconds`` for its whole exchange and
``request_bytes`` for its request head; at most ``per_source`` connections
are open from one address and ``connections`` from all; past those a
connection is closed at once (``weightcache_http_dropped_connections_total``).
One request per connection (HTTP/1.0), as probes and scrapers send.

``/status`` is a public summary: socket paths, error text and the
re-adoption reason stay on the peer-checked Unix socket
(``weightcache-sidecar status``) and in the logs.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
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
ALL_PATHS = frozenset({"/healthz", "/readyz", "/status", "/metrics"})
METRICS_PATHS = frozenset({"/metrics"})


@dataclass(frozen=True)
class HttpLimits:
    connections: int = 512
    per_source: int = 16
    request_seconds: float = 5.0
    request_bytes: int = 8192


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
            "HTTP connections closed unanswered: too many open, from one address or in all",
        )
        dropped.add_metric([], self._http_dropped())
        yield dropped


class HttpServer:
    """Serves ``paths`` on ``host:port`` from a thread of its own until :meth:`close`."""

    def __init__(
        self,
        host: str,
        port: int,
        daemon: DaemonView,
        paths: frozenset[str] = ALL_PATHS,
        limits: HttpLimits | None = None,
    ) -> None:
        self.limits = limits or HttpLimits()
        self.dropped = 0
        self._daemon = daemon
        self._paths = paths
        self._open: Counter[str] = Counter()
        self._registry = CollectorRegistry()
        self._registry.register(DaemonCollector(daemon, lambda: self.dropped))
        # Bound here, so a port in use fails the daemon's start, not a thread.
        self._listener = socket.create_server((host, port), backlog=1024)
        self.port = self._listener.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._stopped: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="http")
        self._thread.start()

    def close(self) -> None:
        """Stop serving; connections in progress are cut."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop)
            self._thread.join(10)

    def _stop(self) -> None:
        if self._stopped is not None:
            self._stopped.set()

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._main())
        except Exception:
            log.exception("the HTTP server stopped")
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._stopped = asyncio.Event()
        server = await asyncio.start_server(
            self._serve, sock=self._listener, limit=self.limits.request_bytes
        )
        async with server:
            await self._stopped.wait()
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if isinstance(peer, tuple) else "?"
        if (sum(self._open.values()) >= self.limits.connections
                or self._open[source] >= self.limits.per_source):
            self.dropped += 1
            writer.transport.abort()
            return
        self._open[source] += 1
        try:
            await asyncio.wait_for(self._exchange(reader, writer), self.limits.request_seconds)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError):
            pass  # an idle, slow, oversized or vanished client: nothing more to say
        finally:
            self._open[source] -= 1
            if not self._open[source]:
                del self._open[source]
            writer.transport.abort()  # a no-op once the answer went out and the socket closed

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                        ) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        writer.write(self._answer(head))
        writer.close()  # after the answer is flushed
        await writer.wait_closed()

    def _answer(self, head: bytes) -> bytes:
        method, _, rest = head.partition(b" ")
        path = rest.split(b" ", 1)[0].split(b"?", 1)[0].decode("latin-1")
        if method != b"GET":
            return _response(405, b"only GET\n", "text/plain")
        if path not in self._paths:
            return _response(404, b"not found\n", "text/plain")
        if path == "/healthz":
            return _probe(self._daemon.liveness())
        if path == "/readyz":
            return _probe(self._daemon.readiness())
        if path == "/status":
            body = msgspec.json.encode(public_status(self._daemon.status()))
            return _response(200, body, "application/json")
        return _response(200, generate_latest(self._registry), CONTENT_TYPE_LATEST)


_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed",
            503: "Service Unavailable"}


def _probe(probe: Probe) -> bytes:
    return _response(probe.code, probe.body.encode(), "text/plain")


def _response(code: int, body: bytes, content_type: str) -> bytes:
    head = (f"HTTP/1.0 {code} {_REASONS.get(code, '')}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n")
    return head.encode("latin-1") + body
