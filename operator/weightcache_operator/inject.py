"""One-label engine pods: what the mutating webhook adds to a pod (pure).

A pod labelled `weightcache.dev/cache: <name>` asks for the cache `<name>` of
its own namespace (or of the namespace its annotation
`weightcache.dev/cache-namespace` names, if that cache lists the pod's
namespace in `spec.engine.namespaces`). The webhook (webhook.py) adds, only
what is missing, so a second admission changes nothing:

- the readiness gate `weightcache.dev/weights-resident` (the operator opens it);
- an inline CSI volume of driver `weightcache.dev` naming the cache, mounted
  in every container at `/run/wc/<namespace>.<name>` (a short root: a Unix
  socket path must fit in 107 bytes, the same root the daemon uses);
- the environment the engine's loader reads: `WEIGHTCACHE_SOCKET_DIR=/run/wc`,
  `WEIGHTCACHE_CACHE=<namespace>.<name>`, and `WEIGHTCACHE_DAEMON_UIDS`, the
  daemon uid the engine must see on the socket (`SO_PEERCRED`);
- the daemon's group in the pod's `supplementalGroups`: the socket directory
  is 0750 and the socket 0660 in that group, and the daemon admits a peer by
  that group (`SO_PEERGROUPS`) whatever the pod's own uid and gid;
- the binding `weights.weightcache.dev/<namespace>.<name>: <spec hash>`: the
  generation of the cache at admission, the weights the pod will run. Its gate
  then opens only where a daemon holds that generation, whatever the spec says
  later (a model change does not close the gates of pods still served). A pod
  that brings the annotation keeps its value, which must be a spec hash.

A label naming a cache that does not exist, or one the pod's namespace may
not use, is refused (`Refused`), never passed through ungated.

Every pod the webhook admits gated (one-label, or listing the gate itself: a
selector-gated pod) also gets the label `weightcache.dev/gated=true`, which
the operator's watch selects at the apiserver; and every such pod past the
limits of what the operator keeps (podlimits.py) is refused, naming the limit.
`admit` decides it all for one AdmissionReview request; `json_patch` writes it.
"""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import names, podlimits
from .gate import InvalidBinding, bound_generation
from .render import CONTAINER_SOCKET_ROOT
from .spec import DNS_LABEL_RE, DNS_SUBDOMAIN_RE, SpecError, parse_spec, spec_hash
from .views import CacheView, has_gate

VOLUME = "weightcache-sockets"
SOCKET_DIR_ENV = "WEIGHTCACHE_SOCKET_DIR"
CACHE_ENV = "WEIGHTCACHE_CACHE"
DAEMON_UIDS_ENV = "WEIGHTCACHE_DAEMON_UIDS"


class Refused(Exception):
    """The pod may not have what its label asks for; `code` is the HTTP status to answer."""

    def __init__(self, message: str, code: int = 403) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Wanted:
    """The cache a pod's label names."""

    namespace: str
    name: str


@dataclass(frozen=True)
class Injection:
    namespace: str
    name: str
    daemon_uid: int
    daemon_gid: int
    # The cache's generation at admission: what the pod is bound to.
    spec_hash: str

    @property
    def binding_key(self) -> str:
        return names.binding_key(self.namespace, self.name)

    @property
    def directory(self) -> str:
        return f"{self.namespace}.{self.name}"

    @property
    def mount_path(self) -> str:
        return f"{CONTAINER_SOCKET_ROOT}/{self.directory}"


def is_daemon(labels: Mapping[str, str]) -> bool:
    """Whether a pod carries the daemon labels (`managed-by` the operator, component
    `daemon`): the chart's daemon-pod guard admits such a pod only from the DaemonSet
    controller, in the daemon namespace."""
    return (labels.get(names.MANAGED_BY_LABEL) == names.MANAGER
            and labels.get(names.COMPONENT_LABEL) == names.DAEMON_COMPONENT)


def asks(labels: Mapping[str, str]) -> bool:
    """Whether a pod asks for a cache: the chart's objectSelectors, which send the webhook
    every pod labelled `weightcache.dev/cache` but those with both daemon labels. One of
    them alone exempts nothing (once, `managed-by: weightcache-operator` alone was admitted
    bare: no gate, volume or group)."""
    return names.CACHE_LABEL in labels and not is_daemon(labels)


def wanted(pod_namespace: str, labels: Mapping[str, str], annotations: Mapping[str, str]
           ) -> Wanted:
    """The cache the pod names; `Refused` (400) for a value that names none."""
    name = labels.get(names.CACHE_LABEL, "")
    namespace = annotations.get(names.CACHE_NAMESPACE_LABEL) or pod_namespace
    if not (name and len(name) <= 253 and DNS_SUBDOMAIN_RE.match(name)):
        raise Refused(f"label {names.CACHE_LABEL}: {name!r} is not a WeightCache name", 400)
    if not (len(namespace) <= 63 and DNS_LABEL_RE.match(namespace)):
        raise Refused(f"annotation {names.CACHE_NAMESPACE_LABEL}: {namespace!r} is not a "
                      "namespace", 400)
    return Wanted(namespace, name)


def decide(pod_namespace: str, want: Wanted, cache: CacheView | None) -> Injection:
    """What to inject for a pod of `pod_namespace`; `Refused` says why there is nothing."""
    ref = f"{want.namespace}/{want.name}"
    if cache is None:
        raise Refused(f"WeightCache {ref} does not exist (label {names.CACHE_LABEL})")
    if cache.deleting:
        raise Refused(f"WeightCache {ref} is being deleted")
    try:
        spec = parse_spec(cache.spec)
    except SpecError as exc:
        raise Refused(f"WeightCache {ref} is invalid: {exc}") from None
    if pod_namespace != cache.namespace and pod_namespace not in spec.engine.namespaces:
        raise Refused(f"namespace {pod_namespace} may not use WeightCache {ref} (it is not "
                      "the cache's namespace, nor listed in its spec.engine.namespaces)")
    return Injection(cache.namespace, cache.name, spec.sidecar.run_as_user,
                     spec.sidecar.run_as_group, spec_hash(spec))


def added_annotations(annotations: Mapping[str, str], injection: Injection) -> dict[str, str]:
    """The binding to add: the cache's generation now, unless the pod brings one.

    A value brought that names no generation is refused (400), so a typo never
    leaves a pod that no daemon can ever open.
    """
    brought = annotations.get(injection.binding_key)
    if brought is None:
        return {injection.binding_key: injection.spec_hash}
    try:
        bound_generation(brought, injection.spec_hash)  # the gate's own rule
    except InvalidBinding as exc:
        raise Refused(f"annotation {injection.binding_key}: {exc}, as the cache's "
                      "status.fingerprint", 400) from None
    return {}


def mutated_spec(pod_spec: Mapping[str, Any], injection: Injection) -> dict[str, Any]:
    """The pod spec with what is missing added; equal to the input when nothing is."""
    spec = copy.deepcopy(dict(pod_spec))
    gates = spec.setdefault("readinessGates", [])
    if not any(g.get("conditionType") == names.GATE_CONDITION for g in gates):
        gates.append({"conditionType": names.GATE_CONDITION})
    volumes = spec.setdefault("volumes", [])
    if not any(v.get("name") == VOLUME for v in volumes):
        volumes.append({"name": VOLUME, "csi": {
            "driver": names.CSI_DRIVER,
            "volumeAttributes": {names.CSI_CACHE_ATTRIBUTE: f"{injection.namespace}/"
                                                           f"{injection.name}"}}})
    env = {SOCKET_DIR_ENV: CONTAINER_SOCKET_ROOT, CACHE_ENV: injection.directory,
           DAEMON_UIDS_ENV: str(injection.daemon_uid)}
    for container in spec.get("containers") or []:
        mounts = container.setdefault("volumeMounts", [])
        if not any(m.get("name") == VOLUME for m in mounts):
            mounts.append({"name": VOLUME, "mountPath": injection.mount_path})
        variables = container.setdefault("env", [])
        present = {v.get("name") for v in variables}
        variables.extend({"name": k, "value": v} for k, v in env.items() if k not in present)
    security = spec.setdefault("securityContext", {})
    groups = security.setdefault("supplementalGroups", [])
    if injection.daemon_gid not in groups:
        groups.append(injection.daemon_gid)
    return spec


def gated(labels: Mapping[str, str], spec: Mapping[str, Any]) -> bool:
    """Whether the pod is one the operator gates: it lists the gate, asks for a cache by the
    label, or carries the label the operator's watch selects. The chart's third webhook
    entry sends the first and last kinds (matchConditions), the other two the second."""
    return (has_gate({"spec": spec}) or asks(labels)
            or labels.get(names.GATED_LABEL) is not None)


def check_limits(labels: Mapping[str, str], annotations: Mapping[str, str]) -> None:
    """`Refused` (400) naming the limit a gated pod passes (podlimits.py)."""
    problem = podlimits.violation(labels, annotations)
    if problem is not None:
        raise Refused(f"refused: {problem}", 400)


ReadCache = Callable[[str, str], Awaitable["CacheView | None"]]


async def admit(request: Mapping[str, Any], read_cache: ReadCache) -> list[dict[str, Any]]:
    """The JSON patch for one AdmissionReview request, or `Refused`.

    A pod the operator does not gate, a daemon pod (labelled with the cache and both daemon
    labels, never sent), or anything but a pod CREATE passes unchanged. A gated pod past
    the limits is refused before anything is read.
    """
    kind = (request.get("kind") or {}).get("kind")
    if kind != "Pod" or request.get("operation") != "CREATE":
        return []
    pod = request.get("object") or {}
    meta = pod.get("metadata") or {}
    labels = dict(meta.get("labels") or {})
    annotations = dict(meta.get("annotations") or {})
    spec = dict(pod.get("spec") or {})
    namespace = str(request.get("namespace") or meta.get("namespace") or "")
    if not gated(labels, spec) or (names.CACHE_LABEL in labels and not asks(labels)):
        return []  # not a gated pod, or a daemon pod (never sent: the DaemonSet's own)
    marked = {**labels, names.GATED_LABEL: names.GATED_VALUE}
    check_limits(marked, annotations)
    added_labels = ({} if labels.get(names.GATED_LABEL) == names.GATED_VALUE
                    else {names.GATED_LABEL: names.GATED_VALUE})
    if not asks(labels):
        return json_patch(meta, spec, added_labels, {}, spec)
    want = wanted(namespace, labels, annotations)
    cache = await read_cache(want.namespace, want.name)
    injection = decide(namespace, want, cache)
    bindings = added_annotations(annotations, injection)
    check_limits(marked, {**annotations, **bindings})
    return json_patch(meta, spec, added_labels, bindings, mutated_spec(spec, injection))


def _pointer(key: str) -> str:
    """One JSON-pointer segment (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


def json_patch(meta: Mapping[str, Any], spec: Mapping[str, Any], labels: Mapping[str, str],
               annotations: Mapping[str, str], new_spec: Mapping[str, Any]
               ) -> list[dict[str, Any]]:
    """JSON patch operations adding `labels` and `annotations` to the pod's metadata and
    setting each top-level field of `new_spec` that differs from `spec`."""
    ops: list[dict[str, Any]] = []
    for part, added in (("labels", labels), ("annotations", annotations)):
        if not added:
            continue
        if not meta.get(part):
            ops.append({"op": "add", "path": f"/metadata/{part}", "value": dict(added)})
            continue
        ops.extend({"op": "add", "path": f"/metadata/{part}/{_pointer(k)}", "value": v}
                   for k, v in added.items())
    ops.extend({"op": "add", "path": f"/spec/{_pointer(k)}", "value": v}
               for k, v in new_spec.items() if spec.get(k) != v)
    return ops
