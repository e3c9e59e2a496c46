"""Prometheus metrics of the operator."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, start_http_server

RECONCILES = Counter(
    "weightcache_operator_reconciles_total",
    "Reconcile passes, by what was reconciled.",
    ["kind"],
)
ERRORS = Counter(
    "weightcache_operator_errors_total",
    "Failed reconcile passes and API writes, by what was reconciled.",
    ["kind"],
)
GATE_DECISIONS = Counter(
    "weightcache_operator_gate_decisions_total",
    "Gate conditions written to engine pods, by status and reason.",
    ["status", "reason"],
)
READY_NODES = Gauge(
    "weightcache_operator_ready_nodes",
    "Nodes with verified resident weights, per WeightCache.",
    ["namespace", "cache"],
)
DESIRED_NODES = Gauge(
    "weightcache_operator_desired_nodes",
    "Nodes the WeightCache's DaemonSet is scheduled on.",
    ["namespace", "cache"],
)
RESIDENT_BYTES = Gauge(
    "weightcache_operator_resident_bytes",
    "Verified resident weight bytes across all nodes, per WeightCache.",
    ["namespace", "cache"],
)
ENGINE_PODS = Gauge(
    "weightcache_operator_engine_pods",
    "Engine pods the operator watches (labelled weightcache.dev/gated=true and gated).",
)
_PER_CACHE = (READY_NODES, DESIRED_NODES, RESIDENT_BYTES)


def set_cache(namespace: str, cache: str, *, ready: int, desired: int, resident: int) -> None:
    READY_NODES.labels(namespace, cache).set(ready)
    DESIRED_NODES.labels(namespace, cache).set(desired)
    RESIDENT_BYTES.labels(namespace, cache).set(resident)


def forget_cache(namespace: str, cache: str) -> None:
    for gauge in _PER_CACHE:
        try:
            gauge.remove(namespace, cache)
        except KeyError:
            pass


def serve(port: int, addr: str = "0.0.0.0") -> None:
    start_http_server(port, addr)
