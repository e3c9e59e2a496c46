"""kopf wiring: watch indices in, one `Reconciler` call per handler.

The indices hold small views of everything the decisions need; kopf fills
them completely before any handler runs, so a restarted operator judges from
the full picture and rewrites nothing that is already right. The passes
themselves live in reconcile.py, the decisions in the pure modules.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import kopf

from weightcache.kubeclient import api_client

from . import gate, names, views
from .kube import Kube
from .policy import policy_from_env
from .reconcile import Reconciler
from .state import State

CACHES = (names.GROUP, names.VERSION, names.PLURAL)
DAEMON_LABELS = {
    names.MANAGED_BY_LABEL: names.MANAGER,
    names.COMPONENT_LABEL: names.DAEMON_COMPONENT,
}
RESYNC_SECONDS = 30.0
SHUTDOWN_FLUSH_SECONDS = 5.0


def state_of(memo: kopf.Memo, kwargs: dict[str, Any]) -> State:
    """The indices kopf passes every handler, by their function names below."""
    return State(
        kwargs["wc_caches"],
        kwargs["wc_daemonsets"],
        kwargs["wc_daemon_pods"],
        kwargs["wc_engine_pods"],
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


@kopf.index("v1", "pods", when=lambda body, **_: views.has_gate(body))
def wc_engine_pods(
    body: kopf.Body, namespace: str, **_: Any
) -> dict[tuple[str, str | None], views.EnginePodView]:
    view = views.engine_pod_view(body)
    return {(namespace, view.node): view}


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
    if "webhook" in memo:
        # The chart owns the MutatingWebhookConfiguration: kopf only serves (webhook.py).
        settings.admission.server = memo.webhook.server()
        settings.admission.managed = None
    if "reconciler" not in memo:
        policy = memo.policy if "policy" in memo else policy_from_env()
        carry = memo.carry_seconds if "carry_seconds" in memo else gate.CARRY_SECONDS
        memo.reconciler = Reconciler(Kube(api_client()), policy, os.getuid(),
                                     carry_seconds=carry)


@kopf.on.cleanup()
async def flush_writes(memo: kopf.Memo, **_: Any) -> None:
    """On shutdown, make the coalesced writes still due (bounded: the apiserver may be gone)."""
    if "reconciler" in memo:
        try:
            await asyncio.wait_for(memo.reconciler.flush(), timeout=SHUTDOWN_FLUSH_SECONDS)
        except asyncio.TimeoutError:
            logging.getLogger(__name__).warning("coalesced writes still due at shutdown")


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
    cache = state.cache(cache_ns, cache_name)
    if event["type"] == "DELETED" and cache is not None and namespace != state.daemon_namespace:
        # A daemon of the older layout exited: its cache's DaemonSet may now move.
        await memo.reconciler.apply_daemonset(state, cache)


@kopf.on.event("v1", "pods", when=lambda body, **_: views.has_gate(body))
async def engine_pod_event(
    event: kopf.RawEvent, namespace: str, name: str, uid: str, spec: kopf.Spec,
    memo: kopf.Memo, **kwargs: Any,
) -> None:
    state = state_of(memo, kwargs)
    if event["type"] == "DELETED":
        memo.reconciler.forget_pod(uid)
    else:
        await memo.reconciler.engine_pod(state, namespace, name, spec.get("nodeName"))
    # The caches' statuses count engine pods per generation (coalesced, like reports).
    memo.reconciler.engine_pods_changed(state, views.engine_pod_view(event["object"]))
