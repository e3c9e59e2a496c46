"""Small immutable snapshots of the objects the operator watches.

The kopf indices hold these instead of whole bodies: they keep memory flat in
large clusters and give the pure decision modules plain typed input.
"""

from __future__ import annotations

import copy
import datetime
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from weightcache.report import ANNOTATION_PREFIX, MAX_ANNOTATION_BYTES, MAX_DEVICES

from . import names, podlimits
from .shape import shape_digest


@dataclass(frozen=True)
class Condition:
    status: str
    reason: str
    message: str


@dataclass(frozen=True)
class CacheView:
    namespace: str
    name: str
    uid: str
    generation: int
    spec: Mapping[str, Any]
    status: Mapping[str, Any]
    deleting: bool
    resource_version: str = ""


@dataclass(frozen=True)
class DaemonPodView:
    namespace: str
    name: str
    cache: str
    node: str | None
    phase: str
    ready: bool
    terminating: bool
    # The raw `weightcache.dev/report.<device>` annotations, by key.
    reports: Mapping[str, str]
    spec_hash: str | None
    created: str
    # uid of the owner reference marked controller (the DaemonSet that made the pod).
    controller_uid: str | None = None
    # The cache's namespace (its label); the pod lives in the daemon namespace.
    cache_namespace: str = ""
    uid: str = ""
    # When the pod's Ready condition last turned False (seconds since the epoch), while it is.
    not_ready_since: float | None = None
    # Every container runs, and how often they restarted: a flap of the same processes only.
    containers_running: bool = False
    restarts: int = 0
    # shape.shape_digest of its spec: what it runs, as whom, and what it can reach.
    shape: str = ""
    # Why its report annotations were not kept (too many, too large); they count as malformed.
    report_error: str | None = None
    # Its daemon containers: the GPU slots of the generation it was rendered for.
    slots: int = 0


@dataclass(frozen=True, slots=True)
class EnginePodView:
    """What the operator keeps of a gated pod: what its gate decision reads, bounded
    (podlimits.py). One is kept per engine pod the operator watches."""

    namespace: str
    name: str
    uid: str
    labels: Mapping[str, str]
    node: str | None
    gate: Condition | None
    terminating: bool
    resource_version: str = ""
    # The cache a one-label pod names (`weightcache.dev/cache`), and that cache's
    # namespace (its annotation `weightcache.dev/cache-namespace`, else the pod's).
    cache: str = ""
    cache_namespace: str = ""
    # The weights the pod runs, per cache: its `weights.weightcache.dev/<ns>.<name>`
    # annotations (names.binding_key), as written (gate.bound_generation reads them).
    bindings: Mapping[str, str] = field(default_factory=dict)
    phase: str = "Pending"
    # Why the pod is past the limits of podlimits.py; then nothing of its labels and
    # annotations is kept (no cache gates it) and its gate is closed saying this.
    over_limits: str = ""
    # Its controller (ownerReference with controller: true), "Kind/name" and uid: who
    # makes a new pod when the operator evicts this one (rollout.recreated).
    owner: str = ""
    owner_uid: str = ""

    @property
    def finished(self) -> bool:
        """Succeeded or Failed (evicted pods too): it runs nothing any more."""
        return self.phase in ("Succeeded", "Failed")


@dataclass(frozen=True)
class DaemonSetView:
    namespace: str
    name: str
    uid: str
    # uid of the WeightCache that controls it (its owner reference).
    controller_uid: str | None
    cache: str
    desired: int
    updated: int
    generation: int
    observed_generation: int
    applied_generation: int | None
    render_hash: str | None
    # The cache's namespace and uid (label, annotation); empty on a DaemonSet of the
    # layout before daemons moved to the daemon namespace (in the cache's own, owned by it).
    cache_namespace: str = ""
    cache_uid: str | None = None
    # shape.shape_digest of the live pod template, and the shapes the operator rendered for
    # it (its POD_SHAPES_ANNOTATION, newest first; empty from an operator before it).
    template_shape: str = ""
    shapes: tuple[str, ...] = ()

    @property
    def legacy(self) -> bool:
        return not self.cache_namespace


@dataclass(frozen=True)
class NodeView:
    name: str
    # Name parts of the `weightcache.dev/<namespace>.<name>=Ready` labels it carries.
    ready_labels: frozenset[str]
    resource_version: str = ""


def _meta(body: Mapping[str, Any]) -> Mapping[str, Any]:
    return body.get("metadata") or {}


def _controller_uid(meta: Mapping[str, Any]) -> str | None:
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


def _cache_namespace(meta: Mapping[str, Any]) -> str:
    """The cache's namespace: its label, else (the older layout) the object's own."""
    return (meta.get("labels") or {}).get(names.CACHE_NAMESPACE_LABEL) or meta.get(
        "namespace", "")


def _conditions(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list((body.get("status") or {}).get("conditions") or [])


def cache_view(body: Mapping[str, Any]) -> CacheView:
    meta = _meta(body)
    return CacheView(
        namespace=meta.get("namespace", ""),
        name=meta["name"],
        uid=meta.get("uid", ""),
        generation=int(meta.get("generation") or 0),
        spec=copy.deepcopy(dict(body.get("spec") or {})),
        status=copy.deepcopy(dict(body.get("status") or {})),
        deleting=meta.get("deletionTimestamp") is not None,
        resource_version=str(meta.get("resourceVersion") or ""),
    )


def _epoch(timestamp: Any) -> float | None:
    try:
        when = datetime.datetime.strptime(str(timestamp), "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        return None
    return when.replace(tzinfo=datetime.timezone.utc).timestamp()


def daemon_pod_view(body: Mapping[str, Any]) -> DaemonPodView:
    meta = _meta(body)
    status = body.get("status") or {}
    annotations = meta.get("annotations") or {}
    condition = next((c for c in _conditions(body) if c.get("type") == "Ready"), {})
    ready = condition.get("status") == "True"
    containers = list(status.get("containerStatuses") or [])
    reports, report_error = _bounded_reports(meta, annotations, body.get("spec") or {})
    return DaemonPodView(
        namespace=meta.get("namespace", ""),
        name=meta["name"],
        cache=(meta.get("labels") or {}).get(names.CACHE_LABEL, ""),
        node=(body.get("spec") or {}).get("nodeName"),
        phase=status.get("phase") or "Pending",
        ready=ready,
        terminating=meta.get("deletionTimestamp") is not None,
        reports=reports,
        spec_hash=annotations.get(names.SPEC_HASH_ANNOTATION),
        created=str(meta.get("creationTimestamp") or ""),
        controller_uid=_controller_uid(meta),
        cache_namespace=_cache_namespace(meta),
        uid=str(meta.get("uid") or ""),
        not_ready_since=None if ready else _epoch(condition.get("lastTransitionTime")),
        containers_running=bool(containers) and all(
            "running" in (c.get("state") or {}) for c in containers),
        restarts=sum(int(c.get("restartCount") or 0) for c in containers),
        shape=shape_digest(body.get("spec") or {}),
        report_error=report_error,
        slots=len((body.get("spec") or {}).get("containers") or []),
    )


def _bounded_reports(
    meta: Mapping[str, Any], annotations: Mapping[str, Any], spec: Mapping[str, Any]
) -> tuple[dict[str, str], str | None]:
    """The pod's report annotations worth keeping in the index, or why none are.

    Anyone who may label a pod can make the operator read it, so what the
    index keeps is bounded before it is kept: only a pod a DaemonSet controls
    (the only pods that can count) keeps reports at all, at most one per
    container and MAX_DEVICES in all, each at most MAX_ANNOTATION_BYTES.
    """
    if not any(ref.get("controller") and ref.get("kind") == "DaemonSet"
               for ref in meta.get("ownerReferences") or []):
        return {}, None
    keys = sorted(k for k in annotations if k.startswith(ANNOTATION_PREFIX))
    cap = min(MAX_DEVICES, len(spec.get("containers") or []))
    if len(keys) > cap:
        return {}, f"{len(keys)} report annotations for at most {cap} (one per daemon container)"
    reports: dict[str, str] = {}
    for key in keys:
        value = str(annotations[key])
        size = len(value.encode())
        if size > MAX_ANNOTATION_BYTES:
            return {}, f"{key}: {size} bytes, over the {MAX_ANNOTATION_BYTES}-byte cap"
        reports[key] = value
    return reports, None


def has_gate(body: Mapping[str, Any]) -> bool:
    gates = (body.get("spec") or {}).get("readinessGates") or []
    return any(g.get("conditionType") == names.GATE_CONDITION for g in gates)


def engine_pod_view(body: Mapping[str, Any]) -> EnginePodView:
    """The bounded view of a gated pod: only what a decision reads, within
    podlimits.LIMITS; a pod past them keeps its identity and why, nothing else."""
    meta = _meta(body)
    gate = None
    for cond in _conditions(body):
        if cond.get("type") == names.GATE_CONDITION:
            gate = Condition(
                str(cond.get("status", "")), str(cond.get("reason") or ""),
                str(cond.get("message") or "")[:podlimits.MAX_MESSAGE_CHARS],
            )
    namespace = _interned(meta.get("namespace", ""))
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    over = podlimits.violation(labels, annotations)
    node = (body.get("spec") or {}).get("nodeName")
    kept: dict[str, str] = {}
    bindings: dict[str, str] = {}
    cache, cache_namespace = "", namespace
    if over is None:
        # Interned: the same keys and values recur on every pod of a Deployment.
        kept = {_interned(k): _interned(v) for k, v in labels.items()}
        bindings = {_interned(k): _interned(podlimits.cut(annotations[k]))
                    for k in podlimits.bindings_of(annotations)}
        cache = kept.get(names.CACHE_LABEL, "")
        named = annotations.get(names.CACHE_NAMESPACE_LABEL)
        cache_namespace = _interned(podlimits.cut(named)) if named else namespace
    return EnginePodView(
        namespace=namespace,
        name=str(meta["name"]),
        uid=str(meta.get("uid", "")),
        labels=kept,
        node=_interned(node) if node else None,
        gate=gate,
        terminating=meta.get("deletionTimestamp") is not None,
        resource_version=str(meta.get("resourceVersion") or ""),
        cache=cache,
        cache_namespace=cache_namespace,
        bindings=bindings,
        phase=_interned(str((body.get("status") or {}).get("phase") or "Pending")),
        over_limits=over or "",
        **_controller(meta),
    )


def _controller(meta: Mapping[str, Any]) -> dict[str, str]:
    """The pod's controller as `owner` ("Kind/name", cut to the pod limits) and
    `owner_uid`; nothing for a pod without one."""
    for ref in meta.get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller"):
            owner = f"{ref.get('kind')}/{ref.get('name')}"
            return {"owner": _interned(podlimits.cut(owner, podlimits.MAX_OWNER_CHARS)),
                    "owner_uid": _interned(podlimits.cut(ref.get("uid") or ""))}
    return {}


def _interned(value: Any) -> str:
    return sys.intern(str(value))


def daemonset_view(body: Mapping[str, Any]) -> DaemonSetView:
    meta = _meta(body)
    status = body.get("status") or {}
    annotations = meta.get("annotations") or {}
    applied = annotations.get(names.GENERATION_ANNOTATION)
    return DaemonSetView(
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        controller_uid=_controller_uid(meta),
        cache=(meta.get("labels") or {}).get(names.CACHE_LABEL, ""),
        desired=int(status.get("desiredNumberScheduled") or 0),
        updated=int(status.get("updatedNumberScheduled") or 0),
        generation=int(meta.get("generation") or 0),
        observed_generation=int(status.get("observedGeneration") or 0),
        applied_generation=int(applied) if applied and applied.isdigit() else None,
        render_hash=annotations.get(names.RENDER_HASH_ANNOTATION),
        cache_namespace=(meta.get("labels") or {}).get(names.CACHE_NAMESPACE_LABEL, ""),
        cache_uid=annotations.get(names.CACHE_UID_ANNOTATION),
        template_shape=shape_digest(
            ((body.get("spec") or {}).get("template") or {}).get("spec") or {}),
        shapes=tuple(s for s in annotations.get(names.POD_SHAPES_ANNOTATION, "").split(",") if s),
    )


def node_view(body: Mapping[str, Any]) -> NodeView:
    meta = _meta(body)
    labels = meta.get("labels") or {}
    ready = frozenset(
        key[len(names.NODE_LABEL_PREFIX):]
        for key, value in labels.items()
        if key.startswith(names.NODE_LABEL_PREFIX) and value == names.NODE_LABEL_READY
    )
    return NodeView(name=meta["name"], ready_labels=ready,
                    resource_version=str(meta.get("resourceVersion") or ""))
