"""kopf wiring: watch indices in, one `Reconciler` call per handler.

The indices hold small views of everything the decisions need; kopf fills
them completely before any handler runs, so a restarted operator judges from
the full picture and rewrites nothing that is already right. The passes
themselves live in reconcile.py, the decisions in the pure modules.

Every watch is filtered by the apiserver: kopf's pod watch selects the daemon
labels (`settings.watching.label_selectors`), and engine pods come through a
watch of their own (podwatch.py), selecting `weightcache.dev/gated=true`; no
other pod of the cluster reaches the operator. Its index is whole before
kopf starts (the start-up handler lists it), and its changes are judged only
once kopf's indices are filled (the first node event says so).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import kopf

from weightcache.kubeclient import api_client

from . import gate, metrics, names, podwatch, views
from .kube import Kube
from .policy import policy_from_env
from .reconcile import Reconciler
from .state import State

CACHES = (names.GROUP, names.VERSION, names.PLURAL)
DAEMON_LABELS = {
    names.MANAGED_BY_LABEL: names.MANAGER,
    names.COMPONENT_LABEL: names.DAEMON_COMPONENT,
}
# kopf's one watch of pods, at the apiserver: the daemon pods, nothing else.
DAEMON_POD_SELECTOR = ",".join(f"{k}={v}" for k, v in sorted(DAEMON_LABELS.items()))
KOPF_INDICES = ("wc_caches", "wc_daemonsets", "wc_daemon_pods", "wc_nodes")
RESYNC_SECONDS = 30.0
SHUTDOWN_FLUSH_SECONDS = 5.0
SWEEP_RETRY_SECONDS = 10.0

log = logging.getLogger(__name__)


def state_of(memo: kopf.Memo, kwargs: dict[str, Any]) -> State:
    """The indices kopf passes every handler, by their function names below, and the
    engine pods' (podwatch.py)."""
    return State(
        kwargs["wc_caches"],
        kwargs["wc_daemonsets"],
        kwargs["wc_daemon_pods"],
        memo.engine_pods.index,
        kwargs["wc_nodes"],
        memo.reconciler.policy.daemon_namespace or "",
    )


def cache_namespace(namespace: str, labels: kopf.Labels) -> str:
    """A daemon object's cache namespace: its label, else (older layout) its own namespace."""
    return labels.get(names.CACHE_NAMESPACE_LABEL) or namespace


# --------------------------------------------------------------------------- indices


@kopf.index(*CACHES)
def wc_caches(body: kopf.Body, namespace: str, **_: Any) -> dict[str, views.CacheView]:
    return {namespace: views.cache_view(body)}


@kopf.index("apps", "v1", "daemonsets", labels=DAEMON_LABELS)
def wc_daemonsets(
    body: kopf.Body, namespace: str, **_: Any
) -> dict[tuple[str, str], views.DaemonSetView]:
    view = views.daemonset_view(body)
    return {(view.cache_namespace or namespace, view.cache): view}


# Pods are indexed by node: a report changes one node, and its pass asks for that node's pods.


@kopf.index("v1", "pods", labels=DAEMON_LABELS)
def wc_daemon_pods(
    body: kopf.Body, namespace: str, **_: Any
) -> dict[tuple[str, str, str | None], views.DaemonPodView]:
    view = views.daemon_pod_view(body)
    return {(view.cache_namespace, view.cache, view.node): view}


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
    settings.watching.label_selectors["v1", "pods"] = DAEMON_POD_SELECTOR
    if "reconciler" not in memo:
        policy = memo.policy if "policy" in memo else policy_from_env()
        carry = memo.carry_seconds if "carry_seconds" in memo else gate.CARRY_SECONDS
        memo.reconciler = Reconciler(Kube(api_client()), policy, os.getuid(),
                                     carry_seconds=carry)


@kopf.on.startup()
async def watch_engine_pods(memo: kopf.Memo, **kwargs: Any) -> None:
    """List the engine pods before kopf starts its watches, so that no handler ever sees
    their index half filled; keep watching them from then on."""
    indices = {name: kwargs[name] for name in KOPF_INDICES}
    memo.indices = indices

    async def judge(change: podwatch.Change) -> None:
        await engine_pod_changed(memo, state_of(memo, indices), change)

    from kubernetes import client

    memo.engine_pods = podwatch.EnginePodWatch(client.CoreV1Api(api_client()), judge)
    await memo.engine_pods.start()
    metrics.ENGINE_PODS.set_function(lambda: memo.engine_pods.index.pods)


@kopf.on.cleanup()
async def flush_writes(memo: kopf.Memo, **_: Any) -> None:
    """On shutdown, make the coalesced writes still due (bounded: the apiserver may be gone)."""
    if "engine_pods" in memo:
        memo.engine_pods.stop()
    if "reconciler" in memo:
        try:
            await asyncio.wait_for(memo.reconciler.flush(), timeout=SHUTDOWN_FLUSH_SECONDS)
        except asyncio.TimeoutError:
            log.warning("coalesced writes still due at shutdown")


# --------------------------------------------------------------------------- handlers


@kopf.on.resume(*CACHES)
@kopf.on.create(*CACHES)
@kopf.on.update(*CACHES)
async def apply_cache(
    body: kopf.Body, namespace: str, name: str, memo: kopf.Memo, **kwargs: Any
) -> None:
    state = state_of(memo, kwargs)
    await memo.reconciler.apply_daemonset(state, views.cache_view(body))
    await memo.reconciler.cache(state, namespace, name)


@kopf.timer(*CACHES, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
async def resync_cache(
    body: kopf.Body, namespace: str, name: str, memo: kopf.Memo, **kwargs: Any
) -> None:
    state = state_of(memo, kwargs)
    await memo.reconciler.apply_daemonset(state, views.cache_view(body))
    await memo.reconciler.cache(state, namespace, name)
    await memo.reconciler.orphan_labels(state)


@kopf.on.delete(*CACHES)
async def cleanup_cache(
    namespace: str, name: str, uid: str, memo: kopf.Memo, **kwargs: Any
) -> None:
    """Finalizer: delete the DaemonSet, drop node labels and close gates before the cache goes."""
    await memo.reconciler.cleanup(state_of(memo, kwargs), namespace, name, uid)


@kopf.on.event("apps", "v1", "daemonsets", labels=DAEMON_LABELS)
async def daemonset_event(
    event: kopf.RawEvent, namespace: str, labels: kopf.Labels, memo: kopf.Memo, **kwargs: Any
) -> None:
    state = state_of(memo, kwargs)
    cache_name = labels.get(names.CACHE_LABEL, "")
    cache_ns = cache_namespace(namespace, labels)
    cache = state.cache(cache_ns, cache_name)
    if event["type"] == "DELETED" and cache is not None and not cache.deleting:
        await memo.reconciler.apply_daemonset(state, cache)
    if event["type"] == "MODIFIED":
        # Its counts and generations show in the status only; which pods count
        # (the DaemonSet's uid) changes only when one appears or goes. An edit of its
        # pod template by anyone but the operator is undone at once (a no-op otherwise).
        if cache is not None and not cache.deleting:
            await memo.reconciler.apply_daemonset(state, cache)
        memo.reconciler.request_status(state, cache_ns, cache_name)
    else:
        await memo.reconciler.cache(state, cache_ns, cache_name)


@kopf.on.event("v1", "pods", labels=DAEMON_LABELS)
async def daemon_pod_event(
    event: kopf.RawEvent, namespace: str, labels: kopf.Labels, spec: kopf.Spec,
    memo: kopf.Memo, **kwargs: Any,
) -> None:
    state = state_of(memo, kwargs)
    cache_ns, cache_name = cache_namespace(namespace, labels), labels.get(names.CACHE_LABEL, "")
    await memo.reconciler.daemon_pod(state, cache_ns, cache_name, spec.get("nodeName"))
    if event["type"] == "DELETED":
        memo.reconciler.forget_daemon_pod(event["object"]["metadata"].get("uid", ""))
    cache = state.cache(cache_ns, cache_name)
    if event["type"] == "DELETED" and cache is not None and namespace != state.daemon_namespace:
        # A daemon of the older layout exited: its cache's DaemonSet may now move.
        await memo.reconciler.apply_daemonset(state, cache)


@kopf.on.event("v1", "nodes", when=lambda memo, **_: not memo.engine_pods.judging)
async def indices_filled(memo: kopf.Memo, **_: Any) -> None:
    """kopf runs event handlers only once every index is filled: engine pods may now be
    judged. Once: the first node event; then the gated pods the watch cannot see (no
    label: admitted before it existed, or its label removed while the operator was down)
    have any open gate closed, in the background until a sweep completes."""
    if memo.engine_pods.judging:
        return
    memo.engine_pods.judge()
    memo.unwatched_sweep = asyncio.create_task(sweep_unwatched(memo))


async def sweep_unwatched(memo: kopf.Memo) -> None:
    """Close the open gates of gated pods outside the watch; a failed list (the apiserver
    busy or restarting) is tried again, so none is left reported resident for good."""
    while True:
        try:
            state = state_of(memo, memo.indices)
            queries = podwatch.unwatched_queries(
                (c.namespace, parsed[0].engine.selector) for c in state.live_caches()
                if not isinstance(parsed := memo.reconciler.parsed(c), Exception))
            for pod in await asyncio.to_thread(memo.engine_pods.unwatched_open, queries):
                await memo.reconciler.close_unwatched_gate(pod)
            return
        except Exception:  # logged, and tried again
            log.exception("closing the gates of unwatched pods failed; trying again in "
                          "%g s", SWEEP_RETRY_SECONDS)
            await asyncio.sleep(SWEEP_RETRY_SECONDS)


async def engine_pod_changed(memo: kopf.Memo, state: State, change: podwatch.Change) -> None:
    """One engine pod came, changed, or left the watch (podwatch.py)."""
    if change.view is None:
        gone = change.gone
        assert gone is not None
        if not gone.terminating:
            # Deleted at once, or its label removed: the operator no longer sees it, so it
            # must not stay reported resident (a no-op for a pod that is gone).
            await memo.reconciler.close_unwatched_gate(gone)
        memo.reconciler.forget_pod(change.uid)
        memo.reconciler.engine_pods_changed(state, gone)
        return
    view = change.view
    await memo.reconciler.engine_pod(state, view.namespace, view.name, view.node)
    # The caches' statuses count engine pods per generation (coalesced, like reports).
    memo.reconciler.engine_pods_changed(state, view)
