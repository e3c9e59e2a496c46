"""Fold daemon pods and their reports into a WeightCache status (pure)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import gate
from .conditions import condition, merge_conditions
from .spec import WeightCacheSpec
from .views import DaemonPodView, DaemonSetView

# etcd objects are capped at ~1.5 MiB; a 1000-node cache must still fit.
MAX_STATUS_NODES = 200

PHASE_PENDING = "Pending"
PHASE_LOADING = "Loading"
PHASE_READY = "Ready"
PHASE_DEGRADED = "Degraded"
PHASE_ERROR = "Error"

INVALID_SPEC = "InvalidSpec"
RENDER_FAILED = "RenderFailed"
DAEMON_ERROR = "DaemonError"


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Aggregate:
    status: dict[str, Any]
    verdicts: dict[str, gate.Verdict] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    raise AssertionError("unreachable")


def node_verdicts(
    spec: WeightCacheSpec, spec_hash: str, pods: Iterable[DaemonPodView]
) -> dict[str, gate.Verdict]:
    by_node: dict[str, list[DaemonPodView]] = defaultdict(list)
    for pod in pods:
        if pod.node:
            by_node[pod.node].append(pod)
    return {node: gate.evaluate_node(spec, spec_hash, ps) for node, ps in by_node.items()}


def error_status(
    generation: int, old_status: Mapping[str, Any], reason: str, message: str, now: str
) -> Aggregate:
    """Status for a spec the operator cannot act on; daemons already running are left alone."""
    conds = [
        condition("Ready", False, reason, message),
        condition("Degraded", True, reason, message),
        condition("Progressing", False, reason, message),
    ]
    status = {
        **{k: v for k, v in old_status.items() if k not in ("conditions", "phase")},
        "observedGeneration": generation,
        "phase": PHASE_ERROR,
        "conditions": merge_conditions(old_status.get("conditions") or [], conds, now),
    }
    events = []
    if old_status.get("phase") != PHASE_ERROR or _cond_message(old_status, "Degraded") != message:
        events.append(Event("Warning", reason, message))
    return Aggregate(status, {}, events)


def build_status(
    *,
    spec: WeightCacheSpec,
    spec_hash: str,
    generation: int,
    old_status: Mapping[str, Any],
    daemonset: DaemonSetView | None,
    pods: Iterable[DaemonPodView],
    now: str,
) -> Aggregate:
    pods = list(pods)
    verdicts = node_verdicts(spec, spec_hash, pods)
    desired = max(daemonset.desired if daemonset else 0, len(verdicts))
    ready = sum(v.ok for v in verdicts.values())

    nodes = [_node_entry(spec, node, v) for node, v in sorted(verdicts.items())]
    current = [e for n in nodes for e in n["gpus"] if n["reason"] != gate.FINGERPRINT_MISMATCH]
    transports = {g["transport"] for g in current if g["transport"]}
    expected = [g["expectedBytes"] for g in current]
    resident = sum(
        g["preloadedWeightsBytes"] for n in nodes if n["ready"] for g in n["gpus"]
    )

    observed = (
        daemonset.applied_generation
        if daemonset and daemonset.applied_generation is not None
        else old_status.get("observedGeneration")
    )
    resident_cond = _resident_condition(verdicts, ready, desired)
    degraded = _degraded_condition(verdicts, current)
    progressing = _progressing_condition(
        observed, generation, daemonset, ready, desired, degraded["status"] == "True"
    )
    ready_cond = _ready_condition(resident_cond, degraded, progressing, observed == generation)
    if desired == 0:
        phase = PHASE_PENDING
    elif ready_cond["status"] == "True":
        phase = PHASE_READY
    elif degraded["status"] == "True":
        phase = PHASE_DEGRADED
    else:
        phase = PHASE_LOADING

    shown, omitted = _cap_nodes(nodes)
    status: dict[str, Any] = {
        "observedGeneration": observed,
        "phase": phase,
        "fingerprint": spec_hash,
        "expectedBytes": spec.engine.expected_bytes or (max(expected) if expected else None),
        "transport": _transport_summary(transports, spec.transport),
        "desiredNodes": desired,
        "readyNodes": ready,
        "ready": f"{ready}/{desired}",
        "residentBytes": resident,
        "resident": human_bytes(resident),
        "nodes": shown,
        "nodesOmitted": omitted,
        "conditions": merge_conditions(
            old_status.get("conditions") or [],
            [ready_cond, resident_cond, progressing, degraded],
            now,
        ),
    }
    status = {k: v for k, v in status.items() if v is not None}
    return Aggregate(status, verdicts, _events(old_status, status, verdicts))


def _resident_condition(
    verdicts: Mapping[str, gate.Verdict], ready: int, desired: int
) -> dict[str, Any]:
    verified = f"{ready}/{desired} nodes verified"
    failing = [(n, v) for n, v in sorted(verdicts.items()) if not v.ok]
    if desired == 0:
        return condition(
            "WeightsResident", False, gate.NO_DAEMON_ON_NODE,
            "no daemon pod is scheduled: check spec.placement against the nodes",
        )
    if failing:
        node, v = failing[0]
        return condition("WeightsResident", False, v.reason, f"{verified}; {node}: {v.message}")
    if ready < desired:
        return condition(
            "WeightsResident", False, gate.NO_DAEMON_ON_NODE,
            f"{verified}; {desired - ready} scheduled daemon pod(s) not created yet",
        )
    return condition("WeightsResident", True, gate.WEIGHTS_RESIDENT, verified)


def _degraded_condition(
    verdicts: Mapping[str, gate.Verdict], gpus: list[dict[str, Any]]
) -> dict[str, Any]:
    errored = [g for g in gpus if g["state"] == "Error"]
    if errored:
        first = errored[0]["message"] or "no message"
        return condition(
            "Degraded", True, DAEMON_ERROR, f"{len(errored)} GPU(s) report an error: {first}"
        )
    for reason, what in ((gate.REPORT_MALFORMED, "unreadable report"),
                         (gate.BYTES_BELOW_EXPECTED, "resident bytes below expected")):
        hit = [n for n, v in sorted(verdicts.items()) if v.reason == reason]
        if hit:
            return condition("Degraded", True, reason, f"{what} on {', '.join(hit)}")
    return condition("Degraded", False, "AsExpected", "")


def _progressing_condition(
    observed: int | None, generation: int, daemonset: DaemonSetView | None,
    ready: int, desired: int, degraded: bool,
) -> dict[str, Any]:
    if observed != generation:
        return condition("Progressing", True, "Applying", f"applying generation {generation}")
    if daemonset is not None and (
        daemonset.observed_generation < daemonset.generation
        or daemonset.updated < daemonset.desired
    ):
        return condition(
            "Progressing", True, "RollingOut",
            f"{daemonset.updated}/{daemonset.desired} daemon pods updated",
        )
    if ready < desired and not degraded:
        return condition("Progressing", True, "Loading", f"{ready}/{desired} nodes verified")
    return condition("Progressing", False, "Complete" if ready == desired else "Stalled", "")


def _ready_condition(
    resident: dict[str, Any], degraded: dict[str, Any], progressing: dict[str, Any],
    current: bool,
) -> dict[str, Any]:
    if resident["status"] != "True":
        return condition("Ready", False, resident["reason"], resident["message"])
    if degraded["status"] == "True":
        return condition("Ready", False, degraded["reason"], degraded["message"])
    if not current:
        return condition("Ready", False, progressing["reason"], progressing["message"])
    return condition("Ready", True, "Ready", resident["message"])


def _node_entry(spec: WeightCacheSpec, node: str, verdict: gate.Verdict) -> dict[str, Any]:
    gpus = []
    if verdict.report is not None:
        for gpu_id, g in sorted(verdict.report.gpus.items()):
            entry = {
                "id": gpu_id,
                "state": g.state,
                "preloadedWeightsBytes": g.preloaded_weights_bytes,
                "expectedBytes": gate.expected_bytes(spec, g.expected_bytes),
                "transport": g.transport,
                "fingerprint": g.fingerprint,
                "readopted": g.readopted,
                "message": g.message,
            }
            if g.load_seconds is not None:
                entry["loadSeconds"] = g.load_seconds
            gpus.append(entry)
    entry: dict[str, Any] = {
        "name": node,
        "ready": verdict.ok,
        "reason": verdict.reason,
        "message": verdict.message,
        "gpus": gpus,
    }
    if verdict.pod:
        entry["pod"] = verdict.pod
    return entry


def _cap_nodes(nodes: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    if len(nodes) <= MAX_STATUS_NODES:
        return nodes, 0
    # Not-ready nodes are what an operator needs to see; ready ones are counted.
    keep = sorted(nodes, key=lambda n: n["ready"])[:MAX_STATUS_NODES]
    return sorted(keep, key=lambda n: n["name"]), len(nodes) - MAX_STATUS_NODES


def _transport_summary(reported: set[str], wanted: str) -> str:
    if len(reported) == 1:
        return next(iter(reported))
    return "mixed" if reported else wanted


def _cond_message(status: Mapping[str, Any], type_: str) -> str | None:
    for cond in status.get("conditions") or []:
        if cond.get("type") == type_:
            return cond.get("message")
    return None


def _events(
    old: Mapping[str, Any], new: Mapping[str, Any], verdicts: Mapping[str, gate.Verdict]
) -> list[Event]:
    before = {n["name"]: n for n in old.get("nodes") or []}
    events = []
    for node, verdict in sorted(verdicts.items()):
        prev = before.get(node)
        if verdict.ok and not (prev and prev.get("ready")):
            events.append(Event("Normal", "NodeReady", f"{node}: {verdict.message}"))
        elif not verdict.ok and (prev is None or prev.get("reason") != verdict.reason):
            if verdict.reason in (gate.REPORT_MALFORMED, gate.FINGERPRINT_MISMATCH,
                                  gate.BYTES_BELOW_EXPECTED) or (prev and prev.get("ready")):
                events.append(Event("Warning", verdict.reason, f"{node}: {verdict.message}"))
    if old.get("phase") != new["phase"]:
        change = f"phase {old.get('phase') or 'None'} -> {new['phase']} ({new['ready']} ready)"
        events.append(Event("Normal", "PhaseChanged", change))
    return events
