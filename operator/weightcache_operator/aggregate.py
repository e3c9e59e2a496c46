"""Fold daemon pods and their reports into a WeightCache status (pure)."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from weightcache.report import DeviceReport

from . import gate
from . import rollout as node_rollout
from .conditions import condition, merge_conditions
from .spec import WeightCacheSpec
from .views import DaemonPodView, DaemonSetView

# etcd objects are capped at ~1.5 MiB and the spec shares the object: the node
# list is bounded by count and by its encoded size, whatever the reports hold
# (each report field is bounded by weightcache.report).
MAX_STATUS_NODES = 200
MAX_STATUS_NODE_BYTES = 512 * 1024
# residentBytes is an int64 in the CRD.
MAX_INT64 = (1 << 63) - 1
# Node names a condition message lists before it only counts the rest.
MAX_NAMED_NODES = 10
# Generations the status lists (engine pods may bind themselves to any spec hash).
MAX_STATUS_GENERATIONS = 8

PHASE_PENDING = "Pending"
PHASE_LOADING = "Loading"
PHASE_READY = "Ready"
PHASE_DEGRADED = "Degraded"
PHASE_ERROR = "Error"

INVALID_SPEC = "InvalidSpec"
RENDER_FAILED = "RenderFailed"
POLICY_VIOLATION = "PolicyViolation"
DAEMON_ERROR = "DaemonError"
DAEMON_WARNING = "DaemonWarning"
ENGINES_ON_OLD_WEIGHTS = "EnginesOnOldWeights"


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


# What a node was when its events were last posted: (verified, reason).
NodeState = tuple[bool, str]


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
    pods: Iterable[DaemonPodView] = (),
    verdicts: Mapping[str, gate.Verdict] | None = None,
    previous: Mapping[str, NodeState] | None = None,
    bound: Mapping[str, int] | None = None,
    rollout: node_rollout.Progress | None = None,
    node_label: str,
    now: str,
) -> Aggregate:
    """The status of a cache from its nodes' verdicts.

    `verdicts` (by node) are judged from `pods`, the ones the cache's own
    DaemonSet made (`gate.controlled_pods`), unless the caller already has them.
    `previous` is what each node was when events were last posted; without it,
    the nodes the old status lists (a fleet's status lists only some).
    `bound`: how many of the cache's engine pods run each generation (spec hash).
    `rollout`: what a node-by-node rollout's pass did (None: the DaemonSet rolls).
    """
    if verdicts is None:
        verdicts = node_verdicts(spec, spec_hash, pods)
    desired = max(daemonset.desired if daemonset else 0, len(verdicts))
    ready = sum(v.ok for v in verdicts.values())

    # Figures of daemons holding other weights do not describe this cache.
    current = [
        r for _, v in sorted(verdicts.items()) if v.reason != gate.FINGERPRINT_MISMATCH
        for _, r in sorted((v.reports or {}).items())
    ]
    transports = {r.transport for r in current if r.transport}
    expected = [gate.expected_bytes(spec, r.expected_bytes) for r in current]
    resident = min(
        MAX_INT64,
        sum(r.preloaded_weights_bytes for v in verdicts.values() if v.ok
            for r in (v.reports or {}).values()),
    )

    observed = (
        daemonset.applied_generation
        if daemonset and daemonset.applied_generation is not None
        else old_status.get("observedGeneration")
    )
    resident_cond = _resident_condition(verdicts, ready, desired)
    degraded = _degraded_condition(verdicts, current)
    generations = generation_entries(spec_hash, verdicts, bound or {})
    progressing = _progressing_condition(
        observed, generation, daemonset, ready, desired, degraded["status"] == "True",
        generations, rollout,
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

    shown, omitted = _cap_nodes(spec, verdicts)
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
        "nodeLabel": node_label,
        "nodes": shown,
        "nodesOmitted": omitted,
        "generations": generations[:MAX_STATUS_GENERATIONS],
        "generationsOmitted": max(0, len(generations) - MAX_STATUS_GENERATIONS),
        "conditions": merge_conditions(
            old_status.get("conditions") or [],
            [ready_cond, resident_cond, progressing, degraded],
            now,
        ),
    }
    status = {k: v for k, v in status.items() if v is not None}
    if previous is None:
        previous = listed_nodes(old_status)
    events = (node_events(previous, verdicts) + warning_events(old_status, shown)
              + _phase_events(old_status, status))
    return Aggregate(status, dict(verdicts), events)


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
    verdicts: Mapping[str, gate.Verdict], reports: list[DeviceReport]
) -> dict[str, Any]:
    errored = [r for r in reports if r.state == "Error"]
    if errored:
        first = errored[0].message or "no message"
        return condition(
            "Degraded", True, DAEMON_ERROR, f"{len(errored)} GPU(s) report an error: {first}"
        )
    for reason, what in ((gate.REPORT_MALFORMED, "unreadable report"),
                         (gate.BYTES_BELOW_EXPECTED, "resident bytes below expected")):
        hit = [n for n, v in sorted(verdicts.items()) if v.reason == reason]
        if hit:
            return condition("Degraded", True, reason, f"{what} on {name_some(hit)}")
    return condition("Degraded", False, "AsExpected", "")


def name_some(nodes: list[str]) -> str:
    """The first few names and how many more: a message stays short in any fleet."""
    named = ", ".join(nodes[:MAX_NAMED_NODES])
    more = len(nodes) - MAX_NAMED_NODES
    return f"{named} and {more} more" if more > 0 else named


def held_generation(verdict: gate.Verdict) -> str | None:
    """The generation (spec hash) a node's deciding daemon pod holds: every GPU it reports
    Ready with the same hash (one still loading holds nothing yet)."""
    reports = list((verdict.reports or {}).values())
    hashes = {r.spec_hash for r in reports}
    if len(hashes) != 1 or not all(r.state == "Ready" for r in reports):
        return None
    return next(iter(hashes)) or None


def held_generations(verdict: gate.Verdict) -> set[str]:
    """Every generation a node's deciding daemon pod holds: its own (`held_generation`) and
    those every device of it keeps beside it (`retained`)."""
    reports = list((verdict.reports or {}).values())
    own = held_generation(verdict)
    kept = set.intersection(*({r.spec_hash for r in e.retained if r.spec_hash}
                              for e in reports)) if reports else set()
    return kept | ({own} if own else set())


def generation_entries(
    spec_hash: str, verdicts: Mapping[str, gate.Verdict], bound: Mapping[str, int]
) -> list[dict[str, Any]]:
    """Per generation: whether it is the spec's, on how many nodes a daemon holds it (as its
    own, or kept beside it), and
    how many engine pods are bound to it (why a retiring one is still wanted). The current
    one first, then those daemons hold (most nodes first), then by engine pods: every one,
    the status lists the first `MAX_STATUS_GENERATIONS`."""
    held: dict[str, int] = defaultdict(int)
    for verdict in verdicts.values():
        for g in held_generations(verdict):
            held[g] += 1
    hashes = {spec_hash, *held, *(g for g, n in bound.items() if n > 0)}
    ordered = sorted(hashes, key=lambda g: (g != spec_hash, -held.get(g, 0),
                                            -bound.get(g, 0), g))
    return [{"fingerprint": g, "current": g == spec_hash, "nodes": held.get(g, 0),
             "enginePods": bound.get(g, 0)} for g in ordered]


def _progressing_condition(
    observed: int | None, generation: int, daemonset: DaemonSetView | None,
    ready: int, desired: int, degraded: bool, generations: list[dict[str, Any]],
    rollout: node_rollout.Progress | None = None,
) -> dict[str, Any]:
    if observed != generation:
        return condition("Progressing", True, "Applying", f"applying generation {generation}")
    by = "making room" if rollout is not None and rollout.strategy == "Auto" else "node by node"
    if rollout is not None and rollout.blocked:
        more = f" (and {len(rollout.blocked) - 1} more)" if len(rollout.blocked) > 1 else ""
        return condition("Progressing", True, node_rollout.EVICTION_BLOCKED,
                         f"{by}: evicting {rollout.blocked[0]}{more}")
    if rollout is not None and rollout.undone:
        more = f" (and {len(rollout.undone) - 1} more)" if len(rollout.undone) > 1 else ""
        return condition(
            "Progressing", True, node_rollout.EVICTIONS_UNDONE,
            f"{by}: evicted engine pods come back bound to the generation they ran: "
            f"{rollout.undone[0]}{more}; their pod template carries the binding, so the node "
            "keeps that generation until they go. Roll them to the new generation with a "
            "strategy that replaces pods in place (Recreate, or maxSurge 0), or leave "
            "their binding to the webhook (the label weightcache.dev/cache)")
    if rollout is not None and rollout.held:
        shown = ", ".join(rollout.held[:5]) + (", …" if len(rollout.held) > 5 else "")
        return condition(
            "Progressing", True, node_rollout.ROOM_HELD,
            f"making room: the new generation has waited for room on {len(rollout.held)} "
            f"node(s) ({shown}) for {node_rollout.ROOM_HELD_SECONDS:g} s or more with no "
            "engine pod there that the operator can evict: the old weights are held by "
            "engines without this cache's binding, without the label weightcache.dev/gated, "
            "past the pod limits, or outside Kubernetes. Delete them, or set "
            "spec.rollout.strategy: Surge to load beside them")
    if rollout is not None and rollout.active and rollout.strategy == "Auto":
        shown = ", ".join(rollout.rolling[:5]) + (", …" if len(rollout.rolling) > 5 else "")
        return condition("Progressing", True, node_rollout.MAKING_ROOM,
                         f"making room: the new generation waits for room on "
                         f"{len(rollout.rolling)} node(s) ({shown}); engine pods there on "
                         "older generations are evicted")
    if rollout is not None and rollout.active:
        shown = ", ".join(rollout.rolling[:5]) + (", …" if len(rollout.rolling) > 5 else "")
        return condition("Progressing", True, node_rollout.ROLLING_NODE_BY_NODE,
                         f"node by node: {len(rollout.rolling)} node(s) rolling ({shown}), "
                         f"{rollout.waiting} waiting")
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
    retiring = [g for g in generations if not g["current"] and g["enginePods"]]
    if retiring:
        pods = sum(g["enginePods"] for g in retiring)
        detail = "; ".join(f"{g['enginePods']} on {g['fingerprint'][:12]} (held on "
                           f"{g['nodes']} node(s))" for g in retiring[:3])
        more = f"; {len(retiring) - 3} more generation(s)" if len(retiring) > 3 else ""
        return condition("Progressing", True, ENGINES_ON_OLD_WEIGHTS,
                         f"{pods} engine pod(s) bound to another generation than the "
                         f"spec's: {detail}{more}")
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
    if verdict.reports is not None:
        for gpu_id, g in sorted(verdict.reports.items()):
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
            if g.load_source:
                entry["loadSource"] = g.load_source
            if g.seeded_from:
                entry["seededFrom"] = g.seeded_from
            if g.memory_total_bytes is not None:
                entry["memoryTotalBytes"] = g.memory_total_bytes
            if g.memory_free_bytes is not None:
                entry["memoryFreeBytes"] = g.memory_free_bytes
            if g.waiting_for_room:
                entry["waitingForRoom"] = True
            if g.retained:
                entry["retained"] = [{"specHash": r.spec_hash, "fingerprint": r.fingerprint,
                                      "preloadedWeightsBytes": r.preloaded_weights_bytes}
                                     for r in g.retained]
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
    held = held_generation(verdict)
    if held is not None:
        entry["specHash"] = held
    return entry


def _cap_nodes(
    spec: WeightCacheSpec, verdicts: Mapping[str, gate.Verdict]
) -> tuple[list[dict[str, Any]], int]:
    """The nodes the status lists (by name) and how many it leaves out.

    Not-ready nodes are what an operator needs to see, so they come first;
    ready ones are counted in readyNodes either way. Only the nodes that can
    be listed are turned into entries: a fleet's status costs the same to
    build whatever its size beyond the cap.
    """
    order = sorted(verdicts, key=lambda n: (verdicts[n].ok, n))[:MAX_STATUS_NODES]
    shown: list[dict[str, Any]] = []
    used = 0
    for node in order:
        entry = _node_entry(spec, node, verdicts[node])
        size = len(json.dumps(entry, separators=(",", ":")))
        if used + size > MAX_STATUS_NODE_BYTES:
            break
        shown.append(entry)
        used += size
    return sorted(shown, key=lambda n: n["name"]), len(verdicts) - len(shown)


def _transport_summary(reported: set[str], wanted: str) -> str:
    if len(reported) == 1:
        return next(iter(reported))
    return "mixed" if reported else wanted


def _cond_message(status: Mapping[str, Any], type_: str) -> str | None:
    for cond in status.get("conditions") or []:
        if cond.get("type") == type_:
            return cond.get("message")
    return None


def listed_nodes(status: Mapping[str, Any]) -> dict[str, NodeState]:
    """What a status says of the nodes it lists."""
    return {
        n["name"]: (bool(n.get("ready")), str(n.get("reason") or ""))
        for n in status.get("nodes") or []
        if isinstance(n, Mapping) and "name" in n
    }


def node_events(
    previous: Mapping[str, NodeState], verdicts: Mapping[str, gate.Verdict]
) -> list[Event]:
    """Events for the nodes whose verdict changed since `previous` in a way worth telling.

    A node gets its own event; more than `MAX_NAMED_NODES` nodes changing
    alike since the last status (a fleet becoming ready, a spec change) get
    one event per reason that names a few of them, so a status write posts a
    bounded number of events whatever the fleet.
    """
    changed: dict[tuple[str, str], list[tuple[str, gate.Verdict]]] = {}
    for node, verdict in sorted(verdicts.items()):
        prev = previous.get(node)
        if verdict.ok and not (prev and prev[0]):
            changed.setdefault(("Normal", "NodeReady"), []).append((node, verdict))
        elif not verdict.ok and (prev is None or prev[1] != verdict.reason):
            if verdict.reason in (gate.REPORT_MALFORMED, gate.FINGERPRINT_MISMATCH,
                                  gate.BYTES_BELOW_EXPECTED) or (prev and prev[0]):
                changed.setdefault(("Warning", verdict.reason), []).append((node, verdict))
    events = []
    for (type_, reason), hits in changed.items():
        if len(hits) <= MAX_NAMED_NODES:
            events += [Event(type_, reason, f"{node}: {verdict.message}") for node, verdict in hits]
        else:
            names_ = name_some([node for node, _ in hits])
            events.append(Event(type_, reason, f"{len(hits)} nodes: {names_}"))
    return events


def _ready_gpu_messages(nodes: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], str]:
    return {
        (node["name"], gpu["id"]): gpu["message"]
        for node in nodes if isinstance(node, Mapping) and "name" in node
        for gpu in node.get("gpus") or [] if isinstance(gpu, Mapping)
        and gpu.get("state") == "Ready" and gpu.get("message")
    }


def warning_events(old: Mapping[str, Any], shown: list[dict[str, Any]]) -> list[Event]:
    """A Warning per GPU of a listed node whose daemon serves but reports a problem that
    costs its successor (e.g. its manifest not written), when that message is new.

    Only listed nodes count, so a message is compared with the one the previous
    status listed and never repeats; at most MAX_NAMED_NODES events per write.
    """
    before = _ready_gpu_messages(old.get("nodes") or [])
    events = []
    for (node, gpu), message in sorted(_ready_gpu_messages(shown).items()):
        if before.get((node, gpu)) != message:
            events.append(Event("Warning", DAEMON_WARNING, f"{node}: {gpu}: {message}"))
    return events[:MAX_NAMED_NODES]


def _phase_events(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Event]:
    if old.get("phase") == new["phase"]:
        return []
    change = f"phase {old.get('phase') or 'None'} -> {new['phase']} ({new['ready']} ready)"
    return [Event("Normal", "PhaseChanged", change)]
