"""Which cache directory a NodePublishVolume asks for, and whether the pod may have it (pure).

An inline ephemeral volume of driver `weightcache.dev` names a cache in
`volumeAttributes.cache`: `<namespace>/<name>`, or `<name>` for the pod's own
namespace. kubelet adds the pod's identity (`podInfoOnMount`), written over
any attribute of the same name the pod's author set, so the namespace here is
the pod's real one. A pod may mount the caches of its own namespace, and the
caches of another namespace that list its namespace in `spec.engine.namespaces`.
Nothing from the attributes is ever used as a path: the directory is
`<spec.socketDir>/<namespace>.<name>`, built from the cache object, under a
socket root the plugin serves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightcache_operator import names
from weightcache_operator.spec import DEFAULT_SOCKET_DIR, DNS_LABEL_RE, DNS_SUBDOMAIN_RE

POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"
POD_NAME = "csi.storage.k8s.io/pod.name"
EPHEMERAL = "csi.storage.k8s.io/ephemeral"
# kubelet's pod-info keys; anything else but `cache` is refused.
KUBELET_PREFIX = "csi.storage.k8s.io/"


class Refused(Exception):
    """The request is refused; `code` is the gRPC status name, the message says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Request:
    pod_namespace: str
    pod_name: str
    cache_namespace: str
    cache_name: str

    @property
    def cache(self) -> str:
        return f"{self.cache_namespace}/{self.cache_name}"


@dataclass(frozen=True)
class Target:
    """The cache's directory: `name` below the socket root `socket_dir` (host paths)."""

    socket_dir: str
    name: str


def parse_request(context: Mapping[str, str]) -> Request:
    """The pod and the cache a volume context names; `Refused` (INVALID_ARGUMENT) says why not."""
    unknown = sorted(k for k in context
                     if k != names.CSI_CACHE_ATTRIBUTE and not k.startswith(KUBELET_PREFIX))
    if unknown:
        raise Refused("INVALID_ARGUMENT", f"unknown volume attributes {unknown}: "
                      f"a {names.CSI_DRIVER} volume takes only '{names.CSI_CACHE_ATTRIBUTE}'")
    if context.get(EPHEMERAL) != "true":
        raise Refused("INVALID_ARGUMENT", f"{names.CSI_DRIVER} serves inline ephemeral volumes "
                      "only (no pod info from kubelet: is the CSIDriver's podInfoOnMount set?)")
    pod_namespace = context.get(POD_NAMESPACE, "")
    pod_name = context.get(POD_NAME, "")
    if not pod_namespace or not pod_name:
        raise Refused("INVALID_ARGUMENT", "kubelet passed no pod namespace and name")
    raw = context.get(names.CSI_CACHE_ATTRIBUTE, "")
    if not raw:
        raise Refused("INVALID_ARGUMENT", f"volumeAttributes.{names.CSI_CACHE_ATTRIBUTE} is "
                      "required: the cache's <name> or <namespace>/<name>")
    namespace, sep, name = raw.rpartition("/")
    if not sep:
        namespace = pod_namespace
    if not (len(namespace) <= 63 and DNS_LABEL_RE.match(namespace)
            and len(name) <= 253 and DNS_SUBDOMAIN_RE.match(name)):
        raise Refused("INVALID_ARGUMENT", f"volumeAttributes.{names.CSI_CACHE_ATTRIBUTE}: "
                      f"{raw!r} is not <name> or <namespace>/<name>")
    return Request(pod_namespace, pod_name, namespace, name)


def _norm(path: str) -> str:
    return path.rstrip("/") or "/"


def decide(request: Request, cache: Mapping[str, Any] | None, socket_dirs: frozenset[str]
           ) -> Target:
    """The directory to mount for `request`, given the cache object (None: it does not exist)."""
    where = f"pod {request.pod_namespace}/{request.pod_name}"
    if cache is None:
        raise Refused("NOT_FOUND", f"{where}: WeightCache {request.cache} does not exist")
    if (cache.get("metadata") or {}).get("deletionTimestamp"):
        raise Refused("FAILED_PRECONDITION", f"{where}: WeightCache {request.cache} is being "
                      "deleted")
    spec = cache.get("spec") or {}
    engine = spec.get("engine") or {}
    allowed = engine.get("namespaces") or []
    if request.pod_namespace != request.cache_namespace and request.pod_namespace not in allowed:
        raise Refused("PERMISSION_DENIED", f"{where}: namespace {request.pod_namespace} may not "
                      f"use WeightCache {request.cache} (it is not the cache's namespace, nor "
                      "listed in its spec.engine.namespaces)")
    socket_dir = _norm(str(spec.get("socketDir") or DEFAULT_SOCKET_DIR))
    if socket_dir not in socket_dirs:
        raise Refused("FAILED_PRECONDITION", f"{where}: WeightCache {request.cache} uses "
                      f"socketDir {socket_dir}, which this plugin does not serve "
                      f"({', '.join(sorted(socket_dirs)) or 'none'})")
    return Target(socket_dir, f"{request.cache_namespace}.{request.cache_name}")

