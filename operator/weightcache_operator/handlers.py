"""kopf wiring: watches in, patches out. Every decision lives in a pure module.

The indices hold small views of everything the decisions need; kopf fills
them completely before any handler runs, so a restarted operator judges from
the full picture and rewrites nothing that is already right. Reconciles are
level-based and idempotent: they recompute the desired state and patch only
the difference. Per-object locks make the last pass for an object the one
that reads the freshest index.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from . import aggregate, gate, metrics, names, nodes, render, views
from .kube import Kube, api_client
from .locks import KeyedLocks
from .spec import SpecError, WeightCacheSpec, parse_spec, spec_hash


def api_message(exc: ApiException) -> str:
    """The apiserver's own explanation (e.g. which RBAC verb was missing), if it sent one."""
    try:
        return str(json.loads(exc.body)["message"])
    except (TypeError, ValueError, KeyError):
        return exc.body or ""


log = logging.getLogger(__name__)

CACHES = (names.GROUP, names.VERSION, names.PLURAL)
DAEMON_LABELS = {
    names.MANAGED_BY_LABEL: names.MANAGER,
    names.COMPONENT_LABEL: names.DAEMON_COMPONENT,
}
RESYNC_SECONDS = 30.0
INVALID_SPEC = "InvalidSpec"


@dataclass(frozen=True)
class State:
    """The kopf indices, as one value handed to the reconcile functions."""

    caches: kopf.Index[str, views.CacheView]
    daemonsets: kopf.Index[tuple[str, str], views.DaemonSetView]
    daemon_pods: kopf.Index[tuple[str, str], views.DaemonPodView]
    engine_pods: kopf.Index[str, views.EnginePodView]
    nodes: kopf.Index[str, views.NodeView]

    @classmethod
    def of(cls, kwargs: dict[str, Any]) -> State:
        return cls(
            kwargs["wc_caches"],
            kwargs["wc_daemonsets"],
            kwargs["wc_daemon_pods"],
            kwargs["wc_engine_pods"],
            kwargs["wc_nodes"],
        )

    def cache(self, namespace: str, name: str) -> views.CacheView | None:
        return next((c for c in self.caches.get(namespace, []) if c.name == name), None)

    def live_caches(
        self, namespace: str | None = None, exclude: str | None = None
    ) -> list[views.CacheView]:
        spaces = [namespace] if namespace is not None else list(self.caches)
        return sorted(
            (
                c
                for ns in spaces
                for c in self.caches.get(ns, [])
                if not c.deleting and c.uid != exclude
            ),
            key=lambda c: (c.namespace, c.name),
        )

    def daemonset(self, namespace: str, cache: str) -> views.DaemonSetView | None:
        return next(iter(self.daemonsets.get((namespace, cache), [])), None)

    def engine_pod(self, namespace: str, name: str) -> views.EnginePodView | None:
        return next((p for p in self.engine_pods.get(namespace, []) if p.name == name), None)

    def node(self, name: str) -> views.NodeView | None:
        return next(iter(self.nodes.get(name, [])), None)


# --------------------------------------------------------------------------- indices


@kopf.index(*CACHES)
def wc_caches(body: kopf.Body, namespace: str, **_: Any) -> dict[str, views.CacheView]:
    return {namespace: views.cache_view(body)}


@kopf.index("apps", "v1", "daemonsets", labels=DAEMON_LABELS)
def wc_daemonsets(
    body: kopf.Body, namespace: str, **_: Any
) -> dict[tuple[str, str], views.DaemonSetView]:
    view = views.daemonset_view(body)
    return {(namespace, view.cache): view}


@kopf.index("v1", "pods", labels=DAEMON_LABELS)
def wc_daemon_pods(
    body: kopf.Body, namespace: str, **_: Any
) -> dict[tuple[str, str], views.DaemonPodView]:
    view = views.daemon_pod_view(body)
    return {(namespace, view.cache): view}


@kopf.index("v1", "pods", when=lambda body, **_: views.has_gate(body))
def wc_engine_pods(body: kopf.Body, namespace: str, **_: Any) -> dict[str, views.EnginePodView]:
    return {namespace: views.engine_pod_view(body)}


@kopf.index("v1", "nodes")
def wc_nodes(body: kopf.Body, name: str, **_: Any) -> dict[str, views.NodeView]:
    return {name: views.node_view(body)}


# --------------------------------------------------------------------------- lifecycle


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.peering.standalone = True
    # Resources are resolved once at start: no CRD watch, so no RBAC for it.
    settings.scanning.disabled = True
    settings.persistence.finalizer = names.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=names.GROUP, key="last-handled-configuration"
    )
    settings.posting.reporting_component = names.MANAGER
    # Handler chatter stays in the log; Events are the state changes we post.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    if "kube" not in memo:
        memo.kube = Kube(api_client())
    memo.locks = KeyedLocks()
    memo.setdefault("sidecar_image", os.environ.get("WEIGHTCACHE_SIDECAR_IMAGE") or None)
    memo.parsed = {}
    # The status this operator last wrote, per cache uid. The index lags our
    # own writes by a watch round trip; events and transition times are
    # derived from what we wrote, so a lagging index cannot repeat them.
    memo.statuses = {}
    # Likewise the node labels this operator last wrote, per node.
    memo.node_labels = {}


# --------------------------------------------------------------------------- handlers


@kopf.on.resume(*CACHES)
@kopf.on.create(*CACHES)
@kopf.on.update(*CACHES)
async def apply_cache(
    body: kopf.Body, namespace: str, name: str, memo: kopf.Memo, **kwargs: Any
) -> None:
    state = State.of(kwargs)
    await apply_daemonset(state, memo, views.cache_view(body))
    await reconcile_cache(state, memo, namespace, name)


@kopf.timer(*CACHES, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
async def resync_cache(
    body: kopf.Body, namespace: str, name: str, memo: kopf.Memo, **kwargs: Any
) -> None:
    state = State.of(kwargs)
    await apply_daemonset(state, memo, views.cache_view(body))
    await reconcile_cache(state, memo, namespace, name)
    await remove_orphan_labels(state, memo)


@kopf.on.delete(*CACHES)
async def cleanup_cache(
    namespace: str, name: str, uid: str, memo: kopf.Memo, **kwargs: Any
) -> None:
    """Finalizer: drop node labels and close gates before the cache goes.

    The DaemonSet is left to the garbage collector through its owner reference.
    """
    state = State.of(kwargs)
    for node in sorted(
        n.name for ns in state.nodes for n in state.nodes[ns] if name in n.ready_caches
    ):
        await reconcile_node_label(state, memo, node, name, exclude=uid)
    for pod in list(state.engine_pods.get(namespace, [])):
        await reconcile_engine_pod(state, memo, namespace, pod.name, exclude=uid)
    metrics.forget_cache(namespace, name)
    memo.statuses.pop(uid, None)


@kopf.on.event("apps", "v1", "daemonsets", labels=DAEMON_LABELS)
async def daemonset_event(
    event: kopf.RawEvent, namespace: str, labels: kopf.Labels, memo: kopf.Memo, **kwargs: Any
) -> None:
    state = State.of(kwargs)
    cache_name = labels.get(names.CACHE_LABEL, "")
    cache = state.cache(namespace, cache_name)
    if event["type"] == "DELETED" and cache is not None and not cache.deleting:
        await apply_daemonset(state, memo, cache)
    await reconcile_cache(state, memo, namespace, cache_name)


@kopf.on.event("v1", "pods", labels=DAEMON_LABELS)
async def daemon_pod_event(
    namespace: str, labels: kopf.Labels, memo: kopf.Memo, **kwargs: Any
) -> None:
    await reconcile_cache(State.of(kwargs), memo, namespace, labels.get(names.CACHE_LABEL, ""))


@kopf.on.event("v1", "pods", when=lambda body, **_: views.has_gate(body))
async def engine_pod_event(
    event: kopf.RawEvent, namespace: str, name: str, memo: kopf.Memo, **kwargs: Any
) -> None:
    if event["type"] != "DELETED":
        await reconcile_engine_pod(State.of(kwargs), memo, namespace, name)


# --------------------------------------------------------------------------- reconcile


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse(memo: kopf.Memo, cache: views.CacheView) -> tuple[WeightCacheSpec, str] | SpecError:
    """Parsed spec and its hash, memoised per (uid, generation)."""
    key = (cache.uid, cache.generation)
    if key not in memo.parsed:
        if len(memo.parsed) > 4096:
            memo.parsed.clear()
        try:
            spec = parse_spec(cache.spec)
            memo.parsed[key] = (spec, spec_hash(spec))
        except SpecError as exc:
            memo.parsed[key] = exc
    return memo.parsed[key]


def _ref(cache: views.CacheView) -> render.CacheRef:
    return render.CacheRef(cache.namespace, cache.name, cache.uid, cache.generation)


def _cache_body(cache: views.CacheView) -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": cache.name, "namespace": cache.namespace, "uid": cache.uid},
    }


def _pod_body(pod: views.EnginePodView) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": pod.name, "namespace": pod.namespace, "uid": pod.uid},
    }


def _verdict(memo: kopf.Memo, state: State, cache: views.CacheView, node: str) -> gate.Verdict:
    parsed = _parse(memo, cache)
    if isinstance(parsed, SpecError):
        return gate.Verdict(False, INVALID_SPEC, str(parsed))
    spec, digest = parsed
    pods = [p for p in state.daemon_pods.get((cache.namespace, cache.name), []) if p.node == node]
    return gate.evaluate_node(spec, digest, pods)


async def apply_daemonset(state: State, memo: kopf.Memo, cache: views.CacheView) -> None:
    """Server-side apply the rendered DaemonSet unless it is already current.

    An unrenderable spec is reported in status by `reconcile_cache`, not raised:
    retrying cannot fix it, only a spec change can.
    """
    parsed = _parse(memo, cache)
    if isinstance(parsed, SpecError) or cache.deleting:
        return
    spec, digest = parsed
    try:
        manifest = render.render_daemonset(_ref(cache), spec, digest, memo.sidecar_image)
    except render.RenderError:
        return
    current = state.daemonset(cache.namespace, cache.name)
    wanted = manifest["metadata"]["annotations"][names.RENDER_HASH_ANNOTATION]
    if current and current.render_hash == wanted and current.applied_generation == cache.generation:
        return
    try:
        await memo.kube.apply_daemonset(manifest)
    except ApiException as exc:
        metrics.ERRORS.labels("daemonset").inc()
        message = f"applying DaemonSet: {exc.status} {exc.reason}: {api_message(exc)}"
        raise kopf.TemporaryError(message, delay=5) from exc
    log.info(
        "applied DaemonSet %s/%s for generation %d",
        cache.namespace,
        manifest["metadata"]["name"],
        cache.generation,
    )


async def reconcile_cache(state: State, memo: kopf.Memo, namespace: str, name: str) -> None:
    """Status, node labels and engine gates that follow from one cache's daemons."""
    async with memo.locks.get(("cache", namespace, name)):
        cache = state.cache(namespace, name)
        if cache is None or cache.deleting:
            return
        metrics.RECONCILES.labels("cache").inc()
        now = _now()
        old = memo.statuses.get(cache.uid, cache.status)
        parsed = _parse(memo, cache)
        if isinstance(parsed, SpecError):
            result = aggregate.error_status(cache.generation, old, INVALID_SPEC, str(parsed), now)
        else:
            spec, digest = parsed
            try:
                render.render_daemonset(_ref(cache), spec, digest, memo.sidecar_image)
            except render.RenderError as exc:
                result = aggregate.error_status(
                    cache.generation, old, aggregate.RENDER_FAILED, str(exc), now
                )
            else:
                result = aggregate.build_status(
                    spec=spec,
                    spec_hash=digest,
                    generation=cache.generation,
                    old_status=old,
                    daemonset=state.daemonset(namespace, name),
                    pods=state.daemon_pods.get((namespace, name), []),
                    now=now,
                )
        # Write when either what we wrote or what is stored differs: the
        # first catches lag in the index, the second edits by others.
        if result.status != old or result.status != cache.status:
            try:
                await memo.kube.replace_cache_status(namespace, name, result.status)
            except ApiException as exc:
                metrics.ERRORS.labels("cache").inc()
                if exc.status == 404:
                    return
                # Retried like the DaemonSet apply, not after kopf's default minute.
                message = f"writing status: {exc.status} {exc.reason}: {api_message(exc)}"
                raise kopf.TemporaryError(message, delay=5) from exc
            memo.statuses[cache.uid] = result.status
            for event in result.events:
                kopf.event(
                    _cache_body(cache), type=event.type, reason=event.reason, message=event.message
                )
        metrics.set_cache(
            namespace,
            name,
            ready=result.status.get("readyNodes", 0),
            desired=result.status.get("desiredNodes", 0),
            resident=result.status.get("residentBytes", 0),
        )
    touched = set(result.verdicts) | {
        n.name for key in state.nodes for n in state.nodes[key] if name in n.ready_caches
    }
    for node in sorted(touched):
        await reconcile_node_label(state, memo, node, name)
    for pod in list(state.engine_pods.get(namespace, [])):
        await reconcile_engine_pod(state, memo, namespace, pod.name)


async def reconcile_engine_pod(
    state: State, memo: kopf.Memo, namespace: str, name: str, exclude: str | None = None
) -> None:
    """Write the pod's gate condition if the decision differs from what it says."""
    async with memo.locks.get(("pod", namespace, name)):
        pod = state.engine_pod(namespace, name)
        if pod is None or pod.terminating:
            return
        metrics.RECONCILES.labels("engine_pod").inc()
        verdicts: dict[str, gate.Verdict] = {}
        for cache in state.live_caches(namespace, exclude=exclude):
            parsed = _parse(memo, cache)
            selector = None if isinstance(parsed, SpecError) else parsed[0].engine.selector
            if selector is None or not selector.matches(pod.labels):
                continue
            verdicts[cache.name] = (
                _verdict(memo, state, cache, pod.node)
                if pod.node
                else gate.Verdict(False, gate.POD_NOT_SCHEDULED, "")
            )
        decision = gate.gate_condition(pod.node, verdicts)
        if pod.gate == decision:
            return
        cond: dict[str, Any] = {
            "type": names.GATE_CONDITION,
            "status": decision.status,
            "reason": decision.reason,
            "message": decision.message,
        }
        if pod.gate is None or pod.gate.status != decision.status:
            cond["lastTransitionTime"] = _now()
        try:
            await memo.kube.set_pod_condition(namespace, name, cond)
        except ApiException as exc:
            if exc.status == 404:
                return
            metrics.ERRORS.labels("engine_pod").inc()
            raise
        metrics.GATE_DECISIONS.labels(decision.status, decision.reason).inc()
        if pod.gate is None or (pod.gate.status, pod.gate.reason) != (
            decision.status,
            decision.reason,
        ):
            kopf.event(
                _pod_body(pod),
                type="Normal" if decision.status == "True" else "Warning",
                reason=decision.reason,
                message=decision.message,
            )


async def reconcile_node_label(
    state: State, memo: kopf.Memo, node: str, cache_name: str, exclude: str | None = None
) -> None:
    """Label `weightcache.dev/<cache_name>=Ready` iff a cache of that name is verified on `node`."""
    if not nodes.labelable(cache_name):
        return
    async with memo.locks.get(("node", node)):
        view = state.node(node)
        if view is None:
            return
        metrics.RECONCILES.labels("node").inc()
        ready = any(
            _verdict(memo, state, cache, node).ok
            for cache in state.live_caches(exclude=exclude)
            if cache.name == cache_name
        )
        written = memo.node_labels.get(node, view.ready_caches)
        patch = nodes.label_change(cache_name, ready, [view.ready_caches, written])
        await _patch_labels(memo, node, patch)
        if patch:
            memo.node_labels[node] = written | {cache_name} if ready else written - {cache_name}


async def remove_orphan_labels(state: State, memo: kopf.Memo) -> None:
    """Labels of caches that no longer exist anywhere (e.g. a finalizer removed by hand)."""
    existing = {c.name for c in state.live_caches()}
    for key in list(state.nodes):
        for view in list(state.nodes[key]):
            stale = nodes.orphans(view.ready_caches, existing)
            if stale:
                async with memo.locks.get(("node", view.name)):
                    await _patch_labels(memo, view.name, nodes.label_patch(stale, frozenset()))
                    memo.node_labels.pop(view.name, None)


async def _patch_labels(memo: kopf.Memo, node: str, patch: Mapping[str, str | None]) -> None:
    if not patch:
        return
    try:
        await memo.kube.patch_node_labels(node, patch)
    except ApiException as exc:
        if exc.status == 404:
            return
        metrics.ERRORS.labels("node").inc()
        raise
    log.info("node %s labels: %s", node, dict(patch))
