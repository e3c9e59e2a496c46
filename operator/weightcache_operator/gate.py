"""The rollout gate: are a cache's weights verified resident on a node?

`evaluate_node` judges one node from its daemon pods and their reports;
`gate_condition` turns the verdicts of every cache selecting an engine pod into
the pod's `weightcache.dev/weights-resident` condition. Both are pure.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from weightcache.report import (
    PHASE_READOPTING,
    DeviceReport,
    ReportError,
    RetainedReport,
    decode_pod_reports,
)

from .spec import WeightCacheSpec
from .views import Condition, DaemonPodView, DaemonSetView

WEIGHTS_RESIDENT = "WeightsResident"
NO_DAEMON_ON_NODE = "NoDaemonOnNode"
DAEMON_NOT_READY = "DaemonNotReady"
REPORT_MALFORMED = "ReportMalformed"
FINGERPRINT_MISMATCH = "FingerprintMismatch"
BYTES_BELOW_EXPECTED = "BytesBelowExpected"
POD_NOT_SCHEDULED = "PodNotScheduled"
NO_WEIGHTCACHE = "NoWeightCache"
BINDING_INVALID = "BindingInvalid"

# A daemon pod that was Ready and goes NotReady while its containers keep running (no
# restart) and its own reports still say the weights are resident keeps its node's gates
# open this long, counted from the Ready condition's transition: the kubelet marks a pod
# NotReady after two failed probes (10 s), so one flap of the probe closes no engine's gate,
# while a daemon that stays NotReady closes them 30 s later. A restart, a report that is no
# longer Ready, or a pod that never was Ready gets no grace.
FLAP_SECONDS = 30.0

# A daemon pod replaced (deleted, evicted, rolled by its DaemonSet, its process killed and
# restarted) leaves its node's engines mapping the weights it served: with an fd transport
# the memory lives while any engine maps it, and the engines keep answering. Until the
# successor says whether it took those weights back, its node keeps the replaced pod's
# verdict, for at most this long (a node that died, or a successor that never reports, is
# judged on its own after it).
CARRY_SECONDS = 120.0
# Transports whose memory outlives the daemon (torch_ipc's dies with it: engines fail-stop).
CARRIED_TRANSPORTS = frozenset({"vmm_fd", "memfd"})

# A generation is named by its spec hash (spec.spec_hash), as daemons report it.
SPEC_HASH_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str
    message: str
    pod: str | None = None
    # The pod's reports by device, when they could be read.
    reports: Mapping[str, DeviceReport] | None = None
    # A verdict that holds only until then (seconds since the epoch): a debounced flap.
    until: float | None = None
    # A carried verdict (`carried`): the node's own failed one, which stands for a gate that
    # is not open. A carry keeps open gates open; it never opens one.
    instead: Verdict | None = None


def expected_bytes(spec: WeightCacheSpec, reported: int) -> int:
    """A pinned `spec.engine.expectedBytes` wins over what the daemon read from the headers."""
    pinned = spec.engine.expected_bytes
    return reported if pinned is None else pinned


def controlled_pods(
    pods: Iterable[DaemonPodView], daemonset: DaemonSetView | None
) -> list[DaemonPodView]:
    """The pods the cache's own DaemonSet made, shaped as the operator rendered them.

    Anyone who may create pods in the namespace can copy a daemon pod's labels
    and write a report; only the DaemonSet controller can create a pod whose
    controller owner reference names the DaemonSet's uid, in the DaemonSet's own
    namespace (an owner reference never crosses namespaces). But the controller
    also adopts an orphan pod that matches its selector, so the pod's shape
    (image, command, identity, security contexts, volumes: shape.py) must be one
    the operator rendered for the DaemonSet (`DaemonSetView.shapes`), or, on a
    DaemonSet from an operator that recorded none, its live template's.
    """
    if daemonset is None:
        return []
    shapes = set(daemonset.shapes) or {daemonset.template_shape}
    return [p for p in pods
            if p.controller_uid == daemonset.uid and p.namespace == daemonset.namespace
            and p.shape in shapes]


def evaluate_pod(
    spec: WeightCacheSpec, spec_hash: str, pod: DaemonPodView, now: float | None = None,
    was_ready: bool = False, flap_seconds: float = FLAP_SECONDS, bound: bool = False,
) -> Verdict:
    """Verdict for one daemon pod; the checks run in the order a reader would debug them.

    `spec_hash` is the generation wanted: the cache's current one, or (`bound`) another
    one an engine pod is bound to: the pod runs those weights, whatever the spec says
    now. Such a generation is judged by its own shape, not the current spec's: its
    GPUs are the pod's daemon containers (rendered for it), its expected bytes the
    daemons' own (a pinned `expectedBytes` is the current model's); the byte tolerance
    is the spec's. `was_ready`: the pod was seen Ready with the restart count it has now;
    with `now` (seconds since the epoch) it may be held open through a flap
    (`FLAP_SECONDS`).
    """

    def fail(
        reason: str, message: str, reports: Mapping[str, DeviceReport] | None = None
    ) -> Verdict:
        return Verdict(False, reason, f"daemon pod {pod.name}: {message}", pod.name, reports)

    if pod.terminating:
        return fail(DAEMON_NOT_READY, "terminating")
    if pod.report_error is not None:
        return fail(REPORT_MALFORMED, pod.report_error)
    if not pod.reports:
        return fail(DAEMON_NOT_READY, "no report yet")
    try:
        reports = decode_pod_reports(pod.reports)
    except ReportError as exc:
        return fail(REPORT_MALFORMED, str(exc))
    for device, entry in sorted(reports.items()):
        if entry.node != pod.node:
            return fail(
                REPORT_MALFORMED,
                f"{device} reports node {entry.node!r}, but the pod runs on {pod.node!r}",
            )
    # Each device holds the generation as its current weights, or kept beside them
    # (`retained`: taken back from the engines that map them, daemon/generations.py).
    kept: dict[str, RetainedReport] = {}
    for device, entry in sorted(reports.items()):
        if entry.spec_hash == spec_hash:
            continue
        held = entry.holding(spec_hash)
        if held is None:
            return fail(
                FINGERPRINT_MISMATCH,
                f"holds weights for spec {entry.spec_hash[:12] or '<none>'}, "
                + (f"the engine pod is bound to {spec_hash[:12]}" if bound else
                   f"the WeightCache wants {spec_hash[:12]}"),
                reports,
            )
        kept[device] = held
    slots = (pod.slots or spec.slots) if bound else spec.slots
    if len(reports) < slots:
        return fail(DAEMON_NOT_READY, f"{len(reports)} of {slots} GPUs reported", reports)
    for device, entry in sorted(reports.items()):
        if device not in kept and entry.state != "Ready":
            detail = f": {entry.message}" if entry.message else ""
            return fail(DAEMON_NOT_READY, f"{device} is {entry.state}{detail}", reports)
    tolerance = spec.engine.byte_tolerance
    for device, entry in sorted(reports.items()):
        held_bytes, reported = entry.preloaded_weights_bytes, entry.expected_bytes
        if device in kept:
            held_bytes, reported = kept[device].preloaded_weights_bytes, kept[device].expected_bytes
        want = reported if bound else expected_bytes(spec, reported)
        if held_bytes < want * (1 - tolerance):
            return fail(
                BYTES_BELOW_EXPECTED,
                f"{device} holds {held_bytes} bytes, expected {want} "
                f"(tolerance {tolerance:g})",
                reports,
            )
    if kept and len(kept) == len(reports):
        # Kept weights are served whatever the pod's readiness says (that is the current
        # generation's load, which may wait for room): its processes must run.
        if pod.phase != "Running" or not pod.containers_running:
            return fail(DAEMON_NOT_READY, f"pod is not running (phase {pod.phase})", reports)
        total = sum(k.preloaded_weights_bytes for k in kept.values())
        return Verdict(
            True, WEIGHTS_RESIDENT,
            f"daemon pod {pod.name}: {len(kept)} device(s) keep {total} bytes of "
            f"{spec_hash[:12]} beside {next(iter(reports.values())).spec_hash[:12]}",
            pod.name, reports,
        )
    if pod.phase != "Running" or not pod.ready:
        since = pod.not_ready_since
        if (was_ready and now is not None and since is not None and pod.phase == "Running"
                and pod.containers_running and now - since < flap_seconds):
            return Verdict(
                True, WEIGHTS_RESIDENT,
                f"daemon pod {pod.name}: NotReady for {max(0.0, now - since):.0f} s, but its "
                f"processes run and report the weights resident; held open for up to "
                f"{flap_seconds:g} s", pod.name, reports, until=since + flap_seconds,
            )
        return fail(DAEMON_NOT_READY, f"pod is not Ready (phase {pod.phase})", reports)
    total = sum(e.preloaded_weights_bytes for e in reports.values())
    transports = ",".join(sorted({e.transport for e in reports.values()}))
    return Verdict(
        True, WEIGHTS_RESIDENT,
        f"daemon pod {pod.name}: {len(reports)} device(s) hold {total} bytes via {transports}",
        pod.name, reports,
    )


def evaluate_node(
    spec: WeightCacheSpec, spec_hash: str, pods: Iterable[DaemonPodView],
    now: float | None = None, was_ready: Callable[[DaemonPodView], bool] = lambda _: False,
    flap_seconds: float = FLAP_SECONDS, bound: bool = False,
) -> Verdict:
    """Verdict for a node from all of the cache's daemon pods on it, for the generation
    `spec_hash` (see `evaluate_pod`).

    During a DaemonSet rollout a node briefly has an old and a new pod; either
    one holding the right weights is enough. Otherwise the pod that should win
    (of the wanted generation, alive, newest) explains why the node is not ready.
    """
    ordered = sorted(pods, key=lambda p: (p.created, p.name), reverse=True)
    ordered.sort(key=lambda p: (p.terminating, p.spec_hash != spec_hash))
    if not ordered:
        return Verdict(False, NO_DAEMON_ON_NODE, "no daemon pod of this cache on the node")
    verdicts = [evaluate_pod(spec, spec_hash, p, now, was_ready(p), flap_seconds, bound)
                for p in ordered]
    return next((v for v in verdicts if v.ok), verdicts[0])


@dataclass(frozen=True)
class ReportHistory:
    """What the operator saw of one daemon pod's report annotations: its restart count, the
    values seen at that count, and those seen before its last restart (a dead process's,
    which stay on the pod until its successor overwrites them)."""

    restarts: int
    seen: frozenset[bytes]
    stale: frozenset[bytes] = frozenset()


# Report values remembered per pod and restart count before only the current ones are kept;
# remembered by a 16-byte digest each (a report is up to 4 KiB).
MAX_SEEN_REPORTS = 256


def _report_digest(value: str) -> bytes:
    return hashlib.blake2b(value.encode(), digest_size=16).digest()


def fresh_reports(
    pod: DaemonPodView, history: ReportHistory | None
) -> tuple[DaemonPodView, ReportHistory]:
    """The pod as it counts, without reports its containers' restart made stale, and the
    history to keep. After a daemon process dies and kubelet restarts it in the same pod,
    the dead process's report stays until its successor writes: kept weights (which count
    without the pod being Ready) must not be judged by it. A pod first seen after the
    restart cannot be told apart (None: every report counts)."""
    digests = {k: _report_digest(v) for k, v in pod.reports.items()}
    values = frozenset(digests.values())
    if history is None:
        return pod, ReportHistory(pod.restarts, values)
    if pod.restarts > history.restarts:
        history = ReportHistory(pod.restarts, frozenset(), history.stale | history.seen)
    seen = history.seen | (values - history.stale)
    if len(seen) > MAX_SEEN_REPORTS:
        seen = values - history.stale
    history = ReportHistory(history.restarts, seen, history.stale)
    if not history.stale & values:
        return pod, history
    return replace(pod, reports={k: v for k, v in pod.reports.items()
                                 if digests[k] not in history.stale}), history


@dataclass(frozen=True)
class LastGood:
    """A node's last verdict that held, for one generation: the pod that gave it, as it was
    then (its uid and restart count name the process), and since when it no longer holds
    (None while it does): what the carry carries."""

    pod_uid: str
    pod_name: str
    restarts: int
    message: str
    reports: Mapping[str, DeviceReport]
    since: float | None = None


def last_good(verdict: Verdict, pods: Iterable[DaemonPodView]) -> LastGood | None:
    """What to remember of a verdict that holds (None: nothing that can be carried)."""
    if not verdict.ok or verdict.pod is None or not verdict.reports:
        return None
    pod = next((p for p in pods if p.name == verdict.pod), None)
    if pod is None or not pod.uid:
        return None
    return LastGood(pod.uid, pod.name, pod.restarts, verdict.message, verdict.reports)


def carried(
    failed: Verdict, spec_hash: str, pods: Iterable[DaemonPodView], last: LastGood,
    now: float, carry_seconds: float = CARRY_SECONDS,
) -> Verdict | None:
    """The replaced pod's verdict, carried while its successor has not decided (None: the
    node is judged on its own: `failed` stands).

    Carried only when every condition holds:
    - the weights outlive the daemon (an fd transport, `CARRIED_TRANSPORTS`);
    - the pod that gave `last` is replaced: gone, terminating, its process restarted, or
      not running (killed, not restarted yet), not merely NotReady (the flap's case);
    - no successor decided against the generation: each daemon pod on the node that is not
      terminating has no report yet, or reports per device that it re-adopts still
      (`loadPhase` re-adopting), that it took the weights back (re-adopted, Loading or
      Ready, for this generation), or keeps them (`retained`). A successor that loads
      them otherwise (from disk, a neighbour), keeps no such weights, errs, or whose report
      is unreadable ends the carry: it did not take back what the engines map;
    - less than `carry_seconds` since the verdict stopped holding (`last.since`).
    """
    since = now if last.since is None else last.since
    if now - since >= carry_seconds:
        return None
    if not {r.transport for r in last.reports.values()} <= CARRIED_TRANSPORTS:
        return None
    pods = list(pods)
    old = next((p for p in pods if p.uid == last.pod_uid), None)
    if old is None:
        how = "gone"
    elif old.terminating:
        how = "terminating"
    elif old.restarts > last.restarts or not old.containers_running:
        how = "its daemon process restarted"
    else:
        return None  # the same process, failing on its own: nothing was replaced
    # The replaced process's own reports stay on its pod until its successor writes.
    stale = {r.instance for r in last.reports.values() if r.instance}
    for pod in pods:
        if pod.terminating:
            continue
        if not _undecided(pod, spec_hash, stale):
            return None
    return Verdict(
        True, WEIGHTS_RESIDENT,
        f"daemon pod {last.pod_name} replaced ({how}); the engines still map the weights it "
        f"served, so its verdict holds until its successor says whether it took them back "
        f"(at most {carry_seconds:g} s): {last.message}",
        last.pod_name, last.reports, until=since + carry_seconds, instead=failed,
    )


def _undecided(pod: DaemonPodView, spec_hash: str, stale: set[str]) -> bool:
    """Whether a successor daemon pod has not decided against generation `spec_hash`
    (`stale`: the replaced processes' report instances, which say nothing of it)."""
    if pod.report_error is not None:
        return False
    if not pod.reports:
        return True
    try:
        reports = decode_pod_reports(pod.reports)
    except ReportError:
        return False
    for entry in reports.values():
        if entry.instance in stale:
            continue
        if entry.node != pod.node or entry.state == "Error":
            return False
        if entry.holding(spec_hash) is not None:
            continue  # taken back and kept beside its own generation
        if entry.state == "Loading" and entry.load_phase == PHASE_READOPTING:
            continue
        if entry.spec_hash == spec_hash and entry.readopted:
            continue  # taken back: its pod turns Ready soon (its own verdict then holds)
        return False
    return True


def bound_generation(binding: str | None, current: str) -> str:
    """The generation an engine pod's gate is judged for: the spec hash its binding
    annotation names, else (an unbound pod: no webhook admitted it) the cache's current
    one. `InvalidBinding` for a value that is no spec hash."""
    if binding is None:
        return current
    if not SPEC_HASH_RE.fullmatch(binding):
        raise InvalidBinding(f"{binding[:80]!r} is not a spec hash (64 lowercase hex digits)")
    return binding


class InvalidBinding(ValueError):
    """An engine pod's binding annotation names no generation."""


def for_gate(verdicts: Mapping[str, Verdict], is_open: bool) -> dict[str, Verdict]:
    """The verdicts that decide one engine pod's gate: a carried verdict only keeps an open
    gate open; for a gate not open (closed, or never judged) the node's own verdict stands,
    so a carry re-recorded from a lagging view cannot open a gate it had closed."""
    return {cache: v if is_open or v.instead is None else v.instead
            for cache, v in verdicts.items()}


def gate_condition(node: str | None, verdicts: Mapping[str, Verdict]) -> Condition:
    """The engine pod's gate from the verdicts of every cache that selects it, by cache name."""
    if not verdicts:
        return Condition("False", NO_WEIGHTCACHE, "no WeightCache in the namespace selects it")
    if node is None:
        return Condition("False", POD_NOT_SCHEDULED, "the pod has no node yet")
    for cache, verdict in sorted(verdicts.items()):
        if not verdict.ok:
            message = f"WeightCache {cache} on {node}: {verdict.message}"
            return Condition("False", verdict.reason, message)
    detail = "; ".join(f"WeightCache {c}: {v.message}" for c, v in sorted(verdicts.items()))
    return Condition("True", WEIGHTS_RESIDENT, f"on {node}: {detail}")
