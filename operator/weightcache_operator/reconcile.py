"""The operator's reconcile passes: decisions from the pure modules, writes through `Kube`.

Each pass is level-based and idempotent: it recomputes the desired state from
the watch indices (`State`) and writes only what differs. Per-object locks
make the last pass for an object the one that reads the freshest index. The
`Reconciler` keeps what the operator itself wrote (statuses, node labels,
gates; written.py): the indices lag our own writes by a watch round trip, so
a lagging index neither repeats a write nor an event.

What a change costs does not grow with the fleet: a daemon pod's report
changes its node only, so `daemon_pod` decides that node's label and the
gates of the engine pods on it, and asks for the cache's status, which is
written at most once per `status_interval` however many reports arrive
(the first at once, the rest coalesced into one trailing write, coalesce.py).
A gate that opens or closes, or changes its reason, is written at once; a
gate whose message alone changes (a node's GPUs reporting one by one) is
coalesced the same way. Node verdicts are memoised until one of the node's
daemon pods changes, so the status, which covers every node, re-judges only
the nodes that changed.
Whole-cache passes (`cache`) run on a spec change, a DaemonSet appearing or
going, and the periodic resync.

handlers.py calls these from kopf's handlers; tests/unit/operator/test_reconcile.py
calls them with a recording `Kube` and plain-dict indices.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import kopf
from kubernetes.client.exceptions import ApiException

from weightcache.report import rfc3339_now

from . import aggregate, gate, metrics, names, nodes, podlimits, render, rollout, views
from .coalesce import Coalescer
from .kube import api_message
from .locks import KeyedLocks
from .policy import Policy
from .shape import shape_digest
from .spec import SpecError, WeightCacheSpec, parse_spec, spec_hash
from .state import State
from .written import Written

log = logging.getLogger(__name__)

# A gate whose decision could not be computed stays closed, with this reason.
EVALUATION_FAILED = "EvaluationFailed"
# An engine pod that left the operator's watch without being deleted (its
# `weightcache.dev/gated` label removed): nothing it does is seen any more.
NOT_WATCHED = "NotWatched"
# Memoised parses and renders kept, per (uid, generation), before starting afresh.
MEMO_LIMIT = 4096
# Node verdicts kept (per cache, node and generation wanted) before starting afresh.
VERDICT_MEMO_LIMIT = 1 << 17
RETRY_SECONDS = 5
# A cache's status, and a gate's message, are written at most this often while
# reports keep changing them.
STATUS_INTERVAL = 2.0
# A node-by-node rollout asks a refused eviction (a PodDisruptionBudget) again this often
# while nothing else changes; an accepted one is not asked again for EVICTED_SECONDS (the
# watch shows the pod terminating well before).
EVICTION_RETRY_SECONDS = 10.0
EVICTED_SECONDS = 60.0


class Kube(Protocol):
    """The operator's writes (kube.Kube talks to the apiserver)."""

    async def apply_daemonset(self, manifest: Mapping[str, Any]) -> None: ...

    async def restore_daemonset_template(self, namespace: str, name: str, uid: str,
                                         template: Mapping[str, Any]) -> None: ...

    async def delete_daemonset(self, namespace: str, name: str, uid: str | None) -> None: ...

    async def replace_cache_status(self, namespace: str, name: str,
                                   status: Mapping[str, Any]) -> None: ...

    async def set_pod_condition(self, namespace: str, name: str,
                                condition: Mapping[str, Any], uid: str | None = None
                                ) -> None: ...

    async def patch_node_labels(self, node: str, labels: Mapping[str, str | None]) -> None: ...

    async def evict_pod(self, namespace: str, name: str, uid: str) -> None: ...

    def post_event(self, obj: Mapping[str, Any], type: str, reason: str, message: str
                   ) -> None: ...


T = TypeVar("T")
Parsed = tuple[WeightCacheSpec, str]
Rendered = dict[str, Any]


@dataclass(frozen=True)
class _Judged:
    """A node's verdict and the daemon pod views it was judged from."""

    generation: int
    pods: tuple[views.DaemonPodView, ...]
    verdict: gate.Verdict

    def holds_for(self, generation: int, pods: list[views.DaemonPodView], now: float) -> bool:
        # The index replaces a pod's view on every event for that pod, so the
        # same view objects mean that nothing the verdict depends on changed
        # (but time: a flap's grace ends).
        return (generation == self.generation and len(pods) == len(self.pods)
                and all(a is b for a, b in zip(pods, self.pods, strict=True))
                and (self.verdict.until is None or now < self.verdict.until))


@dataclass
class Reconciler:
    kube: Kube
    policy: Policy
    operator_uid: int
    locks: KeyedLocks = field(default_factory=KeyedLocks)
    status_interval: float = STATUS_INTERVAL
    # A NotReady daemon pod whose reports still hold keeps its gates this long (gate.py).
    flap_seconds: float = gate.FLAP_SECONDS
    # A replaced daemon pod's verdict is carried until its successor decides, this long at
    # most (gate.carried).
    carry_seconds: float = gate.CARRY_SECONDS
    clock: Callable[[], float] = time.time
    # Per (uid, generation): the parsed spec and hash, and the rendered DaemonSet.
    _parsed: dict[tuple[str, int], Parsed | SpecError] = field(default_factory=dict)
    _rendered: dict[tuple[str, int], Rendered | render.RenderError] = field(default_factory=dict)
    # Per (cache uid, node, generation wanted): the node's last verdict.
    _judged: dict[tuple[str, str, str], _Judged] = field(default_factory=dict)
    # Per (cache uid, node, generation wanted): the node's last verdict that held, and since
    # when it no longer does (gate.LastGood): a replaced daemon pod's verdict, carried. In
    # memory only: a restarted operator carries nothing it did not see hold itself.
    _good: dict[tuple[str, str, str], gate.LastGood] = field(default_factory=dict)
    # Per daemon pod uid: its reports as seen by restart count (gate.fresh_reports).
    _reports_seen: dict[str, gate.ReportHistory] = field(default_factory=dict)
    # Per daemon pod uid: its restart count when last seen Ready (a flap needs the same).
    _ready_restarts: dict[str, int] = field(default_factory=dict)
    # Per (cache uid, node, generation): the pass due when a flap's grace ends.
    _rechecks: dict[tuple[str, str, str], asyncio.TimerHandle] = field(default_factory=dict)
    # What this operator last wrote: status per cache uid, Ready label per (node, label),
    # gate condition per engine pod uid.
    statuses: Written[Mapping[str, Any]] = field(default_factory=Written)
    labels: Written[bool] = field(default_factory=Written)
    gates: Written[views.Condition | None] = field(default_factory=Written)
    # Per cache uid: what each node was when its events were last posted.
    announced: dict[str, dict[str, aggregate.NodeState]] = field(default_factory=dict)
    # Node-by-node rollouts: when each pod (uid) was evicted, the refusal last announced
    # per pod uid, and per cache uid the pass due to ask refused evictions again.
    _evicted: dict[str, float] = field(default_factory=dict)
    _refusals: dict[str, str] = field(default_factory=dict)
    _eviction_retries: dict[str, asyncio.TimerHandle] = field(default_factory=dict)
    # Per cache uid (Auto): per node waiting for room with nothing to evict, since when.
    _room_waits: dict[str, dict[str, float]] = field(default_factory=dict)
    # Per cache uid: the controllers the operator evicted from (rollout.recreated).
    _evicted_from: dict[str, dict[rollout.ControllerKey, rollout.EvictedFrom]] = field(
        default_factory=dict)
    _room_rechecks: dict[str, asyncio.TimerHandle] = field(default_factory=dict)
    # Coalesced writes: cache statuses, and gate messages (filled in __post_init__).
    _statuses: Coalescer = field(init=False)
    _messages: Coalescer = field(init=False)

    def __post_init__(self) -> None:
        self._statuses = Coalescer(self.status_interval, RETRY_SECONDS)
        self._messages = Coalescer(self.status_interval, RETRY_SECONDS)

    # ------------------------------------------------------------------ memoised decisions

    def parsed(self, cache: views.CacheView) -> Parsed | SpecError:
        return _memo(self._parsed, cache, lambda: _parse(cache))

    def rendered(self, cache: views.CacheView) -> Rendered | render.RenderError | SpecError:
        """The cache's DaemonSet, rendered once per (uid, generation) (policy and uid are fixed)."""
        parsed = self.parsed(cache)
        if isinstance(parsed, SpecError):
            return parsed
        spec, digest = parsed

        def build() -> Rendered | render.RenderError:
            ref = render.CacheRef(cache.namespace, cache.name, cache.uid, cache.generation)
            try:
                return render.render_daemonset(ref, spec, digest, self.policy, self.operator_uid)
            except render.RenderError as exc:
                return exc

        return _memo(self._rendered, cache, build)

    def verdict(self, state: State, cache: views.CacheView, node: str,
                generation: str | None = None) -> gate.Verdict:
        """The cache's verdict on one node, judged again only when its daemon pods changed.

        `generation`: the spec hash wanted, when an engine pod is bound to another one than
        the cache's current spec (gate.bound_generation).
        """
        parsed = self.parsed(cache)
        if isinstance(parsed, SpecError):
            return gate.Verdict(False, aggregate.INVALID_SPEC, str(parsed))
        spec, current = parsed
        digest = generation or current
        pods = state.daemon_pods_on(cache, node)
        now = self.clock()
        if len(self._ready_restarts) >= VERDICT_MEMO_LIMIT:
            self._ready_restarts.clear()
        for pod in pods:
            if pod.ready and pod.uid:
                self._ready_restarts[pod.uid] = pod.restarts
        key = (cache.uid, node, digest)
        judged = self._judged.get(key)
        if judged is not None and judged.holds_for(cache.generation, pods, now):
            return judged.verdict
        if len(self._reports_seen) >= VERDICT_MEMO_LIMIT:
            self._reports_seen.clear()
        fresh = []
        for pod in pods:
            view, self._reports_seen[pod.uid] = gate.fresh_reports(
                pod, self._reports_seen.get(pod.uid))
            fresh.append(view)
        verdict = self._carry(key, gate.evaluate_node(
            spec, digest, fresh, now,
            lambda p: p.uid in self._ready_restarts and self._ready_restarts[p.uid] == p.restarts,
            self.flap_seconds, bound=digest != current,
        ), pods, now)
        if len(self._judged) >= VERDICT_MEMO_LIMIT:
            self._judged.clear()
        self._judged[key] = _Judged(cache.generation, tuple(pods), verdict)
        if verdict.until is not None:
            self._recheck_at(state, cache, node, digest, verdict.until - now)
        return verdict

    def _carry(self, key: tuple[str, str, str], verdict: gate.Verdict,
               pods: list[views.DaemonPodView], now: float) -> gate.Verdict:
        """The node's verdict, or the verdict of the daemon pod that was just replaced there,
        carried until its successor decides (gate.carried); remembers what holds."""
        if verdict.ok:
            good = gate.last_good(verdict, pods)
            if len(self._good) >= VERDICT_MEMO_LIMIT:
                self._good.clear()
            if good is None:
                self._good.pop(key, None)
            else:
                self._good[key] = good
            return verdict
        last = self._good.get(key)
        if last is None:
            return verdict
        if last.since is None:
            last = self._good[key] = dataclasses.replace(last, since=now)
        held = gate.carried(verdict, key[2], pods, last, now, self.carry_seconds)
        if held is None:
            del self._good[key]  # decided, or too long: judged on its own from now on
            return verdict
        return held

    def note_verdicts(self, state: State, cache: views.CacheView) -> None:
        """Judge every node of the cache, for its generation and every one its engine pods
        are bound to, so that what holds now is remembered (and carried) before a change of
        ours replaces daemon pods (a new operator's first apply)."""
        parsed = self.parsed(cache)
        if isinstance(parsed, SpecError):
            return
        spec, current = parsed
        wanted: dict[str, set[str]] = {}
        for pod, generation in _running_generations(state, cache, spec, current):
            if pod.node:
                wanted.setdefault(pod.node, set()).add(generation)
        for node in sorted({p.node for p in state.daemon_pods(cache) if p.node}):
            for generation in sorted(wanted.get(node, set()) | {current}):
                self.verdict(state, cache, node, None if generation == current else generation)

    def _recheck_at(self, state: State, cache: views.CacheView, node: str, generation: str,
                    delay: float) -> None:
        """Judge the node again once a flap's grace ends (no event may come by then); one
        timer per generation judged, each verdict's grace its own."""
        key = (cache.uid, node, generation)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # judged outside a pass (tests of the pure parts)
            return
        if key in self._rechecks:
            return

        async def recheck() -> None:
            try:
                await self.daemon_pod(state, cache.namespace, cache.name, node)
            except Exception:
                log.exception("re-judging node %s after a readiness flap failed", node)

        def fire() -> None:
            self._rechecks.pop(key, None)
            loop.create_task(recheck())

        self._rechecks[key] = loop.call_later(max(0.0, delay) + 0.1, fire)

    # ------------------------------------------------------------------ passes

    async def apply_daemonset(self, state: State, cache: views.CacheView) -> None:
        """Server-side apply the rendered DaemonSet unless it is already current.

        An unrenderable spec is reported in status by `cache`, not raised:
        retrying cannot fix it, only a spec change can. Before the first apply,
        what stands in the way goes: a DaemonSet of the older layout (in the
        cache's namespace), whose daemons must exit before the new ones can take
        the devices' locks (they then re-adopt the weights from the running
        engines), and one left in the daemon namespace by an earlier cache of the
        same name (a re-created cache starts from its own DaemonSet).
        """
        manifest = self.rendered(cache)
        if isinstance(manifest, Exception) or cache.deleting:
            return
        legacy = state.legacy_daemonset(cache)
        if legacy is not None:
            await self._delete_daemonset(cache, legacy, "migrating to the daemon namespace")
            return
        if state.legacy_pods(cache):
            return  # their exit (a pod event) applies the new DaemonSet
        stale = state.stale_daemonset(cache)
        if stale is not None:
            await self._delete_daemonset(cache, stale, "left by an earlier cache of this name")
            return  # its DELETED event applies the new one
        current = state.daemonset(cache)
        template = manifest["spec"]["template"]
        shape = shape_digest(template["spec"])
        shapes = _shape_history(shape, current)
        wanted = manifest["metadata"]["annotations"][names.RENDER_HASH_ANNOTATION]
        if (current and current.render_hash == wanted and current.shapes == shapes
                and current.template_shape == shape
                and current.applied_generation == cache.generation):
            return
        # A new template replaces daemon pods: what holds now must be known first, to be
        # carried through the replacement (an operator that just started judged nothing).
        self.note_verdicts(state, cache)
        if current is not None and current.template_shape not in {*current.shapes, shape}:
            await self._restore_template(cache, current, template)
        manifest = {**manifest, "metadata": {**manifest["metadata"], "annotations": {
            **manifest["metadata"]["annotations"],
            names.POD_SHAPES_ANNOTATION: ",".join(shapes)}}}
        try:
            await self.kube.apply_daemonset(manifest)
        except ApiException as exc:
            metrics.ERRORS.labels("daemonset").inc()
            message = f"applying DaemonSet: {exc.status} {exc.reason}: {api_message(exc)}"
            raise kopf.TemporaryError(message, delay=RETRY_SECONDS) from exc
        log.info("applied DaemonSet %s/%s for generation %d",
                 manifest["metadata"]["namespace"], manifest["metadata"]["name"],
                 cache.generation)

    async def _restore_template(self, cache: views.CacheView, ds: views.DaemonSetView,
                                template: Mapping[str, Any]) -> None:
        """Someone edited the DaemonSet's pod template (its shape is none the operator
        rendered): put the rendered one back whole, then apply as usual."""
        try:
            await self.kube.restore_daemonset_template(ds.namespace, ds.name, ds.uid, template)
        except ApiException as exc:
            metrics.ERRORS.labels("daemonset").inc()
            message = (f"restoring the pod template of DaemonSet {ds.namespace}/{ds.name}: "
                       f"{exc.status} {exc.reason}: {api_message(exc)}")
            raise kopf.TemporaryError(message, delay=RETRY_SECONDS) from exc
        log.warning("DaemonSet %s/%s: its pod template was edited; restored the rendered one",
                    ds.namespace, ds.name)
        self.kube.post_event(_cache_ref(cache), "Warning", "DaemonSetRestored",
                             f"the pod template of DaemonSet {ds.namespace}/{ds.name} was "
                             "edited; the operator restored the rendered one")

    async def _delete_daemonset(self, cache: views.CacheView, ds: views.DaemonSetView,
                                why: str) -> None:
        try:
            await self.kube.delete_daemonset(ds.namespace, ds.name, ds.uid or None)
        except ApiException as exc:
            if exc.status in (404, 409):  # gone already, or replaced since the index saw it
                return
            metrics.ERRORS.labels("daemonset").inc()
            message = (f"deleting DaemonSet {ds.namespace}/{ds.name} ({why}): "
                       f"{exc.status} {exc.reason}: {api_message(exc)}")
            self.kube.post_event(_cache_ref(cache), "Warning", "DaemonSetNotDeleted", message)
            raise kopf.TemporaryError(message, delay=RETRY_SECONDS) from exc
        log.info("deleted DaemonSet %s/%s of cache %s/%s: %s", ds.namespace, ds.name,
                 cache.namespace, cache.name, why)

    async def cache(self, state: State, namespace: str, name: str) -> None:
        """Status, node labels and engine gates that follow from one cache's daemons.

        The whole-cache pass (a spec change, the DaemonSet appearing or going,
        the resync). Labels and gates are decided before the status is written
        and whether or not that write succeeds: a status the apiserver refuses
        must never leave a gate open that the daemons no longer justify.
        """
        status_error: kopf.TemporaryError | None = None
        async with self.locks.get(("cache", namespace, name)):
            cache = state.cache(namespace, name)
            if cache is None or cache.deleting:
                return
            metrics.RECONCILES.labels("cache").inc()
            progress = await self._roll_nodes(state, cache)
            result = self._aggregate(state, cache, progress)
            try:
                await self._write_status(cache, result)
            except kopf.TemporaryError as exc:
                status_error = exc
        label = names.node_label_name(namespace, name)
        for node in sorted(set(result.verdicts) | set(state.nodes_labelled(label))):
            await self.node_label(state, node, namespace, name)
        # Every namespace: one the cache stopped listing holds pods whose gates now close.
        for pod in state.engine_pods_of(namespace, name):
            await self.engine_pod(state, pod.namespace, pod.name, pod.node)
        if status_error is not None:
            raise status_error

    async def daemon_pod(
        self, state: State, namespace: str, cache_name: str, node: str | None
    ) -> None:
        """A daemon pod changed: its node's label and engine gates now, the status soon."""
        if node:
            await self.node_label(state, node, namespace, cache_name)
            cache = state.cache(namespace, cache_name)
            others = self._others(cache) if cache is not None else ()
            for pod in state.engine_pods_of(namespace, cache_name, others, node):
                await self.engine_pod(state, pod.namespace, pod.name, node)
        self.request_status(state, namespace, cache_name)

    def request_status(self, state: State, namespace: str, name: str) -> None:
        """Have the cache's status written: now if none was lately, else once the interval ends.

        However many reports change within an interval, one write carries them
        all; `state` wraps the live indices, so that write reads the newest.
        """
        self._statuses.request((namespace, name), lambda: self.status(state, namespace, name))

    async def flush(self) -> None:
        """Wait until every coalesced write asked for is made (tests, shutdown)."""
        while self._statuses.pending_any() or self._messages.pending_any():
            await self._statuses.flush()
            await self._messages.flush()

    async def status(self, state: State, namespace: str, name: str) -> None:
        """Write the cache's status if it differs from what stands."""
        async with self.locks.get(("cache", namespace, name)):
            cache = state.cache(namespace, name)
            if cache is None or cache.deleting:
                return
            metrics.RECONCILES.labels("status").inc()
            progress = await self._roll_nodes(state, cache)
            await self._write_status(cache, self._aggregate(state, cache, progress))

    async def engine_pod(
        self, state: State, namespace: str, name: str, node: str | None,
        exclude: str | None = None, now: bool = False,
    ) -> None:
        """Write the pod's gate condition if the decision differs from what it says.

        A change of the message alone is coalesced per pod unless `now`.
        """
        async with self.locks.get(("pod", namespace, name)):
            pod = state.engine_pod(namespace, name, node)
            if pod is None or pod.terminating:
                return
            metrics.RECONCILES.labels("engine_pod").inc()
            current = self.gates.current(pod.uid, pod.gate, pod.resource_version)
            try:
                decision = (
                    views.Condition("False", podlimits.OVER_LIMITS, pod.over_limits)
                    if pod.over_limits else
                    gate.gate_condition(pod.node, gate.for_gate(
                        self._engine_verdicts(state, pod, exclude),
                        current is not None and current.status == "True")))
            except Exception as exc:  # fail closed: an undecidable gate is a closed gate
                log.exception("deciding the gate of pod %s/%s failed", namespace, name)
                metrics.ERRORS.labels("engine_pod").inc()
                decision = views.Condition(
                    "False", EVALUATION_FAILED, f"{type(exc).__name__}: {exc}"
                )
            if current == decision:
                return
            if (not now and current is not None
                    and (current.status, current.reason) == (decision.status, decision.reason)):
                self._messages.request(
                    (namespace, name),
                    lambda: self.engine_pod(state, namespace, name, node, exclude, now=True),
                )
                return
            cond: dict[str, Any] = {
                "type": names.GATE_CONDITION,
                "status": decision.status,
                "reason": decision.reason,
                "message": decision.message,
            }
            if current is None or current.status != decision.status:
                cond["lastTransitionTime"] = rfc3339_now()
            try:
                await self.kube.set_pod_condition(namespace, name, cond)
            except ApiException as exc:
                if exc.status == 404:
                    return
                metrics.ERRORS.labels("engine_pod").inc()
                raise
            self.gates.record(pod.uid, decision, pod.resource_version)
            metrics.GATE_DECISIONS.labels(decision.status, decision.reason).inc()
            if current is None or (current.status, current.reason) != (
                decision.status, decision.reason
            ):
                self.kube.post_event(
                    _pod_ref(pod), "Normal" if decision.status == "True" else "Warning",
                    decision.reason, decision.message,
                )

    def engine_pods_changed(self, state: State, pod: views.EnginePodView) -> None:
        """An engine pod came, went or changed: the statuses that count it (their
        `generations`) are written soon, coalesced with everything else."""
        caches = {(c.namespace, c.name) for c in state.live_caches(pod.namespace)}
        if pod.cache:
            caches.add((pod.cache_namespace, pod.cache))
        for namespace, name in sorted(caches):
            self.request_status(state, namespace, name)

    def forget_daemon_pod(self, uid: str) -> None:
        """A daemon pod is gone: what was seen of its reports and readiness goes with it."""
        self._reports_seen.pop(uid, None)
        self._ready_restarts.pop(uid, None)

    def forget_pod(self, uid: str) -> None:
        """An engine pod is gone: nothing of it is kept."""
        self.gates.forget(uid)
        self._refusals.pop(uid, None)

    async def close_unwatched_gate(self, pod: views.EnginePodView) -> None:
        """A pod left the watch while not terminating: deleted at once, or its
        `weightcache.dev/gated` label removed. If its gate was open, close it (that pod
        only, by uid; a deleted one answers 404): the operator no longer sees what it runs.

        Under the pod's lock, so a judgement in flight lands first; and open if the pod
        showed it open or our last write opened it, at whatever version: a write decided
        before the label went lands after the event that removed it."""
        async with self.locks.get(("pod", pod.namespace, pod.name)):
            shown, wrote = pod.gate, self.gates.last(pod.uid)
            if not any(c is not None and c.status == "True" for c in (shown, wrote)):
                return
            cond = {
                "type": names.GATE_CONDITION, "status": "False", "reason": NOT_WATCHED,
                "message": f"the pod lost its label {names.GATED_LABEL}={names.GATED_VALUE}: "
                           "the operator no longer watches it",
                "lastTransitionTime": rfc3339_now(),
            }
            try:
                await self.kube.set_pod_condition(pod.namespace, pod.name, cond, uid=pod.uid)
            except ApiException as exc:
                # 404: deleted; 409 or 422: a newer pod of that name (another uid).
                if exc.status not in (404, 409, 422):
                    metrics.ERRORS.labels("engine_pod").inc()
                    raise
                return
            log.info("closed the gate of %s/%s: no longer watched", pod.namespace, pod.name)

    async def node_label(
        self, state: State, node: str, namespace: str, name: str, exclude: str | None = None
    ) -> None:
        """Label `weightcache.dev/<namespace>.<name>=Ready` iff that cache is verified on `node`."""
        label = names.node_label_name(namespace, name)
        async with self.locks.get(("node", node)):
            view = state.node(node)
            if view is None:
                return
            metrics.RECONCILES.labels("node").inc()
            cache = state.cache(namespace, name)
            try:
                ready = (
                    cache is not None
                    and not cache.deleting
                    and cache.uid != exclude
                    and self.verdict(state, cache, node).ok
                )
            except Exception:  # fail closed: no label without a verdict
                log.exception("deciding the label of %s on node %s failed", label, node)
                metrics.ERRORS.labels("node").inc()
                ready = False
            current = self.labels.current((node, label), label in view.ready_labels,
                                          view.resource_version)
            patch = nodes.label_change(label, ready, current)
            if patch:
                await self._patch_labels(node, patch)
                self.labels.record((node, label), ready, view.resource_version)

    async def cleanup(self, state: State, namespace: str, name: str, uid: str) -> None:
        """Before a cache goes: delete its DaemonSet, drop its node labels and close the
        gates it held open.

        The DaemonSet lives in the daemon namespace, where no owner reference to the
        cache can reach, so the finalizer deletes it (a DaemonSet of the older layout,
        in the cache's namespace, still goes by its owner reference).
        """
        cache = state.cache(namespace, name)
        current = state.daemonset(cache) if cache is not None else None
        if cache is not None and current is not None and not current.legacy:
            await self._delete_daemonset(cache, current, "its cache is deleted")
        elif self.policy.daemon_namespace:
            # Not (yet) in the index: by name, which no other live cache can hold.
            ref = views.CacheView(namespace, name, uid, 0, {}, {}, True)
            gone = views.DaemonSetView(self.policy.daemon_namespace,
                                       names.daemonset_name(namespace, name), "", uid, name,
                                       0, 0, 0, 0, None, None, namespace, uid)
            await self._delete_daemonset(ref, gone, "its cache is deleted")
        for node in state.nodes_labelled(names.node_label_name(namespace, name)):
            await self.node_label(state, node, namespace, name, exclude=uid)
        for pod in state.engine_pods_of(namespace, name):
            await self.engine_pod(state, pod.namespace, pod.name, pod.node, exclude=uid)
        metrics.forget_cache(namespace, name)
        self.statuses.forget(uid)
        self.announced.pop(uid, None)
        self._room_waits.pop(uid, None)
        self._evicted_from.pop(uid, None)
        for key in [k for k in self._judged if k[0] == uid]:
            del self._judged[key]
        for key in [k for k in self._good if k[0] == uid]:
            del self._good[key]

    async def orphan_labels(self, state: State) -> None:
        """Labels of caches that no longer exist anywhere (e.g. a finalizer removed by hand)."""
        existing = {names.node_label_name(c.namespace, c.name) for c in state.live_caches()}
        for view in state.all_nodes():
            stale = nodes.orphans(view.ready_labels, existing)
            if stale:
                async with self.locks.get(("node", view.name)):
                    await self._patch_labels(view.name, nodes.label_patch(stale, frozenset()))
                    for label in stale:
                        self.labels.record((view.name, label), False, view.resource_version)

    # ------------------------------------------------------------------ helpers

    def _others(self, cache: views.CacheView) -> tuple[str, ...]:
        """The namespaces besides its own whose one-label pods the cache gates."""
        parsed = self.parsed(cache)
        return () if isinstance(parsed, SpecError) else parsed[0].engine.namespaces

    def _aggregate(self, state: State, cache: views.CacheView,
                   progress: rollout.Progress | None = None) -> aggregate.Aggregate:
        now = rfc3339_now()
        old = self.statuses.current(cache.uid, cache.status, cache.resource_version)
        parsed, rendered = self.parsed(cache), self.rendered(cache)
        if isinstance(parsed, SpecError):
            return aggregate.error_status(
                cache.generation, old, aggregate.INVALID_SPEC, str(parsed), now
            )
        if isinstance(rendered, render.RenderError):
            reason = (aggregate.POLICY_VIOLATION if isinstance(rendered, render.PolicyViolation)
                      else aggregate.RENDER_FAILED)
            return aggregate.error_status(cache.generation, old, reason, str(rendered), now)
        spec, digest = parsed
        scheduled = {p.node for p in state.daemon_pods(cache) if p.node}
        # A node between a replaced daemon pod and its successor has none: its carried
        # verdict still counts.
        scheduled |= {k[1] for k, good in self._good.items()
                      if k[0] == cache.uid and k[2] == digest and good.since is not None}
        verdicts = {node: self.verdict(state, cache, node) for node in sorted(scheduled)}
        previous = self.announced.get(cache.uid)
        if previous is None:
            # First status since start: what the stored status lists was
            # announced. A capped list leaves nodes out; of those nothing is
            # known, so they are taken as they are and no event repeats.
            previous = aggregate.listed_nodes(old)
            if old.get("nodesOmitted"):
                previous = {**{n: (v.ok, v.reason) for n, v in verdicts.items()}, **previous}
        return aggregate.build_status(
            spec=spec,
            spec_hash=digest,
            generation=cache.generation,
            old_status=old,
            daemonset=state.daemonset(cache),
            verdicts=verdicts,
            previous=previous,
            bound=self._bound_counts(state, cache, spec, digest),
            rollout=progress,
            node_label=names.node_label_key(cache.namespace, cache.name),
            now=now,
        )

    def _bound_counts(self, state: State, cache: views.CacheView, spec: WeightCacheSpec,
                      current: str) -> dict[str, int]:
        """How many of the cache's engine pods run each generation: every pod it gates but
        those terminating or finished (Succeeded, Failed: an evicted pod stays until it is
        collected), scheduled or not."""
        counts: dict[str, int] = {}
        for pod, generation in _running_generations(state, cache, spec, current):
            if not pod.terminating:
                counts[generation] = counts.get(generation, 0) + 1
        return counts

    async def _roll_nodes(self, state: State, cache: views.CacheView
                          ) -> rollout.Progress | None:
        """The evictions of a NodeByNode or Auto cache for this pass (rollout.py decides
        which); None for a Surge cache, where the DaemonSet controller replaces the daemons
        and nothing is evicted."""
        parsed = self.parsed(cache)
        if isinstance(parsed, SpecError) or cache.deleting:
            return None
        spec, current = parsed
        strategy = spec.rollout.strategy
        if strategy == "Surge":
            self._room_waits.pop(cache.uid, None)
            self._evicted_from.pop(cache.uid, None)
            return None
        daemons = state.daemon_pods(cache)
        nodes: list[str | None] = [None]  # NodeByNode: every node's engine pods
        if strategy == "Auto":
            # Only a loading daemon of the current generation can wait for room: in a
            # settled fleet nothing is decoded and no engine pod is read.
            daemons = [p for p in daemons if p.node and p.spec_hash == current
                       and not p.ready and not p.terminating]
            if not daemons:
                self._room_waits.pop(cache.uid, None)
                self._evicted_from.pop(cache.uid, None)
                return None
            nodes = sorted({p.node for p in daemons})
        retiring: dict[str, list[views.EnginePodView]] = {}
        runs: dict[str, str] = {}
        for node in nodes:
            for pod, generation in _running_generations(state, cache, spec, current, node):
                if generation != current and pod.node:
                    retiring.setdefault(pod.node, []).append(pod)
                    runs[pod.uid] = generation
        held: tuple[str, ...] = ()
        if strategy == "Auto":
            plan = rollout.make_room(current, daemons, retiring)
            held, self._room_waits[cache.uid] = rollout.room_held(
                plan.rolling, retiring, self._room_waits.get(cache.uid, {}), self.clock())
            if len(self._room_waits[cache.uid]) > len(held):
                self._recheck_room(state, cache)
            why_evicted = (f"its node's daemon waits for room to load {current[:12]} beside "
                           "the weights it keeps for older engines (rollout.strategy Auto)")
        else:
            plan = rollout.plan(current, spec.rollout.max_unavailable, daemons, retiring)
            why_evicted = (f"evicted so that the node's daemon loads {current[:12]} alone "
                           "(rollout.strategy NodeByNode)")
        now = self.clock()
        known = self._evicted_from.get(cache.uid, {})
        present: dict[rollout.ControllerKey, frozenset[str]] = {}
        if plan.evict_engines or known:  # else nothing to tell apart: no pod is read
            # Every pod on an older generation, on any node or none: a pod not yet
            # scheduled at an eviction is no copy made since.
            present = rollout.by_controller(
                (pod, generation) for pod, generation in
                _running_generations(state, cache, spec, current) if generation != current)
        undone, evicted_from = rollout.recreated(present, known, now)
        blocked: list[str] = []
        undone_by: dict[str, None] = {}
        for pod in plan.evict_engines:
            generation = runs[pod.uid]
            what = (f"engine pod {pod.namespace}/{pod.name} on node {pod.node} runs generation "
                    f"{generation[:12]}")
            if pod.uid in undone:
                undone_by[f"{pod.owner} on node {pod.node} re-creates its pods bound to "
                          f"{generation[:12]}"] = None
                self._announce_undone(cache, pod, f"{what}: not evicted: {pod.owner} made it "
                                      "after the operator evicted one of its pods "
                                      "bound to the same generation (its pod template "
                                      f"carries the binding); roll {pod.owner} to "
                                      f"{current[:12]} with a strategy that replaces pods "
                                      "in place (Recreate, or maxSurge 0)")
                continue
            why = await self._evict(cache, pod.namespace, pod.name, pod.uid,
                                    f"{what}: {why_evicted}")
            if why:
                blocked.append(f"{pod.namespace}/{pod.name}: {why}")
            elif (key := rollout.controller_key(pod, generation)) is not None:
                evicted_from.setdefault(key, rollout.EvictedFrom(
                    present.get(key, frozenset({pod.uid})), now))
        if evicted_from:
            self._evicted_from[cache.uid] = evicted_from
        else:
            self._evicted_from.pop(cache.uid, None)
        for daemon in plan.evict_daemons:
            why = await self._evict(
                cache, daemon.namespace, daemon.name, daemon.uid,
                f"daemon pod {daemon.namespace}/{daemon.name} on node {daemon.node}: no engine "
                f"pod there runs an older generation any more; its successor loads "
                f"{current[:12]}")
            if why:
                blocked.append(f"{daemon.namespace}/{daemon.name}: {why}")
        if blocked:
            self._retry_evictions(state, cache)
        return rollout.Progress(plan.rolling, plan.waiting, tuple(blocked), strategy, held,
                                tuple(undone_by))

    def _announce_undone(self, cache: views.CacheView, pod: views.EnginePodView,
                         message: str) -> None:
        """A Warning Event on the cache, once per re-created pod."""
        if self._refusals.get(pod.uid) != rollout.EVICTIONS_UNDONE:
            self._refusals[pod.uid] = rollout.EVICTIONS_UNDONE
            self.kube.post_event(_cache_ref(cache), "Warning", rollout.EVICTIONS_UNDONE,
                                 message)
            log.warning("%s", message)

    async def _evict(self, cache: views.CacheView, namespace: str, name: str, uid: str,
                     message: str) -> str | None:
        """Evict one pod; why not, when the apiserver refused (a Warning Event on the cache,
        once per pod and reason). A pod evicted lately is not asked again."""
        now = self.clock()
        if now - self._evicted.get(uid, -EVICTED_SECONDS) < EVICTED_SECONDS:
            return None
        if len(self._evicted) >= VERDICT_MEMO_LIMIT:
            self._evicted.clear()
            self._refusals.clear()
        try:
            await self.kube.evict_pod(namespace, name, uid)
        except ApiException as exc:
            if exc.status in (404, 409):  # gone already, or a newer pod of that name
                return None
            why = api_message(exc) or f"{exc.status} {exc.reason}"
            if exc.status != 429:  # 429: a PodDisruptionBudget forbids it for now
                metrics.ERRORS.labels("eviction").inc()
                log.warning("evicting pod %s/%s: %s %s: %s", namespace, name, exc.status,
                            exc.reason, why)
            if self._refusals.get(uid) != why:
                self._refusals[uid] = why
                self.kube.post_event(_cache_ref(cache), "Warning", rollout.EVICTION_BLOCKED,
                                     f"{message}; refused: {why}")
            return why
        self._evicted[uid] = now
        self._refusals.pop(uid, None)
        self.kube.post_event(_cache_ref(cache), "Normal", rollout.EVICTED, message)
        log.info("%s", message)
        return None

    def _recheck_room(self, state: State, cache: views.CacheView) -> None:
        """A node waits for room with nothing to evict: judge again once it may count as
        held (no report of the waiting daemon need come by then)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if cache.uid not in self._room_rechecks:
            def fire() -> None:
                self._room_rechecks.pop(cache.uid, None)
                self.request_status(state, cache.namespace, cache.name)

            self._room_rechecks[cache.uid] = loop.call_later(rollout.ROOM_HELD_SECONDS, fire)

    def _retry_evictions(self, state: State, cache: views.CacheView) -> None:
        """Ask refused evictions again after EVICTION_RETRY_SECONDS (a PodDisruptionBudget
        may allow them by then with no event of ours to say so)."""
        if cache.uid in self._eviction_retries:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return

        def fire() -> None:
            self._eviction_retries.pop(cache.uid, None)
            self.request_status(state, cache.namespace, cache.name)

        self._eviction_retries[cache.uid] = loop.call_later(EVICTION_RETRY_SECONDS, fire)

    async def _write_status(self, cache: views.CacheView, result: aggregate.Aggregate) -> None:
        current = self.statuses.current(cache.uid, cache.status, cache.resource_version)
        if result.status != current:
            try:
                await self.kube.replace_cache_status(cache.namespace, cache.name, result.status)
            except ApiException as exc:
                metrics.ERRORS.labels("cache").inc()
                if exc.status == 404:
                    return
                # Retried like the DaemonSet apply, not after kopf's default minute.
                message = f"writing status: {exc.status} {exc.reason}: {api_message(exc)}"
                raise kopf.TemporaryError(message, delay=RETRY_SECONDS) from exc
            self.statuses.record(cache.uid, result.status, cache.resource_version)
            self.announced[cache.uid] = {n: (v.ok, v.reason) for n, v in result.verdicts.items()}
            for event in result.events:
                self.kube.post_event(_cache_ref(cache), event.type, event.reason, event.message)
        metrics.set_cache(
            cache.namespace,
            cache.name,
            ready=result.status.get("readyNodes", 0),
            desired=result.status.get("desiredNodes", 0),
            resident=result.status.get("residentBytes", 0),
        )

    def _engine_verdicts(
        self, state: State, pod: views.EnginePodView, exclude: str | None
    ) -> dict[str, gate.Verdict]:
        verdicts: dict[str, gate.Verdict] = {}
        candidates = state.live_caches(pod.namespace, exclude=exclude)
        named = state.cache(pod.cache_namespace, pod.cache) if pod.cache else None
        if named is not None and named not in candidates and not named.deleting \
                and named.uid != exclude:
            candidates.append(named)
        for cache in candidates:
            parsed = self.parsed(cache)
            if isinstance(parsed, SpecError) or not _selects(cache, parsed[0], pod):
                continue
            key = cache.name if cache.namespace == pod.namespace else (
                f"{cache.namespace}/{cache.name}")
            verdicts[key] = self._bound_verdict(state, cache, parsed[1], pod)
        return verdicts

    def _bound_verdict(self, state: State, cache: views.CacheView, current: str,
                       pod: views.EnginePodView) -> gate.Verdict:
        """The verdict on the pod's node for the generation the pod is bound to."""
        try:
            generation = _pod_generation(cache, current, pod)
        except gate.InvalidBinding as exc:
            annotation = names.binding_key(cache.namespace, cache.name)
            return gate.Verdict(False, gate.BINDING_INVALID, f"annotation {annotation}: {exc}")
        if not pod.node:
            return gate.Verdict(False, gate.POD_NOT_SCHEDULED, "")
        return self.verdict(state, cache, pod.node,
                            None if generation == current else generation)

    async def _patch_labels(self, node: str, patch: Mapping[str, str | None]) -> None:
        if not patch:
            return
        try:
            await self.kube.patch_node_labels(node, patch)
        except ApiException as exc:
            if exc.status == 404:
                return
            metrics.ERRORS.labels("node").inc()
            raise
        log.info("node %s labels: %s", node, dict(patch))


def _selects(cache: views.CacheView, spec: WeightCacheSpec, pod: views.EnginePodView) -> bool:
    """A cache gates a pod its `spec.engine.selector` matches in its own namespace, and a
    one-label pod naming it (`weightcache.dev/cache`) from its own namespace or one it
    lists in `spec.engine.namespaces`."""
    if pod.namespace == cache.namespace:
        selector = spec.engine.selector
        if selector is not None and selector.matches(pod.labels):
            return True
    return (pod.cache == cache.name and pod.cache_namespace == cache.namespace
            and (pod.namespace == cache.namespace or pod.namespace in spec.engine.namespaces))


def _running_generations(
    state: State, cache: views.CacheView, spec: WeightCacheSpec, current: str,
    node: str | None = None,
) -> list[tuple[views.EnginePodView, str]]:
    """The cache's engine pods (on `node`, if given) that run something (not finished: an
    evicted pod stays until it is collected), terminating ones included, each with the
    generation it is bound to; a pod whose binding names none is left out (its gate says
    so; what it runs is unknown)."""
    out = []
    for pod in state.engine_pods_of(cache.namespace, cache.name, spec.engine.namespaces, node):
        if pod.finished or not _selects(cache, spec, pod):
            continue
        try:
            out.append((pod, _pod_generation(cache, current, pod)))
        except gate.InvalidBinding:
            continue
    return out


def _pod_generation(cache: views.CacheView, current: str, pod: views.EnginePodView) -> str:
    """The generation (spec hash) `pod` runs of `cache`: its binding, else `current`;
    `gate.InvalidBinding` for a binding that names none."""
    return gate.bound_generation(pod.bindings.get(names.binding_key(cache.namespace, cache.name)),
                                 current)


# Shapes kept on a DaemonSet: enough for several renders in flight while old pods roll.
MAX_SHAPES = 8


def _shape_history(shape: str, current: views.DaemonSetView | None) -> tuple[str, ...]:
    """The shapes a DaemonSet's pods may have: the rendered one first, then the earlier
    ones. A DaemonSet from an operator that kept none brings its live template's shape, so
    its pods keep counting while they roll."""
    earlier: tuple[str, ...] = ()
    if current is not None:
        earlier = current.shapes or (current.template_shape,)
    return tuple(dict.fromkeys((shape, *earlier)))[:MAX_SHAPES]


def _parse(cache: views.CacheView) -> Parsed | SpecError:
    try:
        spec = parse_spec(cache.spec)
    except SpecError as exc:
        return exc
    return spec, spec_hash(spec)


def _memo(table: dict[tuple[str, int], T], cache: views.CacheView, build: Callable[[], T]) -> T:
    key = (cache.uid, cache.generation)
    if key not in table:
        if len(table) >= MEMO_LIMIT:
            table.clear()
        table[key] = build()
    return table[key]


def _cache_ref(cache: views.CacheView) -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": cache.name, "namespace": cache.namespace, "uid": cache.uid},
    }


def _pod_ref(pod: views.EnginePodView) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": pod.name, "namespace": pod.namespace, "uid": pod.uid},
    }
