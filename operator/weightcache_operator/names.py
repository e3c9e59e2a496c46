"""Kubernetes names the operator, the daemon and the engines agree on."""

import hashlib

GROUP = "weightcache.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "WeightCache"
PLURAL = "weightcaches"

# Engine pods list this readiness gate; the operator owns the condition.
GATE_CONDITION = f"{GROUP}/weights-resident"
# Node label `weightcache.dev/<namespace>.<name>=Ready` marks verified-resident weights.
NODE_LABEL_PREFIX = f"{GROUP}/"
NODE_LABEL_READY = "Ready"

CACHE_LABEL = f"{GROUP}/cache"
# Every engine pod the operator gates carries this label: its watch of engine pods selects
# on it at the apiserver, so pods without it never reach the operator (nor count for its
# memory). The webhook adds it to each pod it admits; a selector-gated pod admitted without
# the webhook must carry it in its template.
GATED_LABEL = f"{GROUP}/gated"
GATED_VALUE = "true"
# An engine pod's binding to the weights it runs, per cache: the spec hash of the cache's
# generation (binding_key). The webhook writes it at admission where the pod has none.
BINDING_PREFIX = f"weights.{GROUP}/"
# Daemon DaemonSets and pods live in the daemon (system) namespace, not the cache's:
# this label names the cache's namespace, the annotation its uid (owner references
# cannot cross namespaces).
CACHE_NAMESPACE_LABEL = f"{GROUP}/cache-namespace"
CACHE_UID_ANNOTATION = f"{GROUP}/cache-uid"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
DAEMON_COMPONENT = "daemon"
MANAGER = "weightcache-operator"

# Stamped on the DaemonSet so a resync can tell whether it is current
# without a server round trip.
RENDER_HASH_ANNOTATION = f"{GROUP}/render-hash"
GENERATION_ANNOTATION = f"{GROUP}/generation"
SPEC_HASH_ANNOTATION = f"{GROUP}/spec-hash"

FINALIZER = f"{GROUP}/cleanup"
# On the DaemonSet: the pod shapes (shape.py digests, comma-separated, newest first) the
# operator rendered for it; its pods count only with one of them.
POD_SHAPES_ANNOTATION = f"{GROUP}/pod-shapes"

# The CSI driver that mounts a cache's socket directory into engine pods; its
# inline volumes name the cache in this volume attribute (`<namespace>/<name>` or `<name>`).
CSI_DRIVER = GROUP
CSI_CACHE_ATTRIBUTE = "cache"


# A label key's name part is at most 63 characters.
MAX_LABEL_NAME = 63


# Joins a long name's head to its hash: `_` is allowed in a label key but in no namespace or
# cache name (DNS names), so no cache's plain `<namespace>.<name>` can equal a hashed one.
HASH_SEPARATOR = "_"


def node_label_name(namespace: str, name: str) -> str:
    """`<namespace>.<name>`, unique per cache (namespaces have no dots); hashed when too long."""
    full = f"{namespace}.{name}"
    if len(full) <= MAX_LABEL_NAME:
        return full
    digest = hashlib.sha256(f"{namespace}/{name}".encode()).hexdigest()[:16]
    head = full[: MAX_LABEL_NAME - len(digest) - 1].rstrip("-_.")
    return f"{head}{HASH_SEPARATOR}{digest}"


def node_label_key(namespace: str, name: str) -> str:
    return NODE_LABEL_PREFIX + node_label_name(namespace, name)


def binding_key(namespace: str, name: str) -> str:
    """The engine pod annotation that binds it to the weights it runs:
    `weights.weightcache.dev/<namespace>.<name>: <spec hash>` (one per cache)."""
    return BINDING_PREFIX + node_label_name(namespace, name)


def daemonset_name(namespace: str, name: str) -> str:
    """`weightcache-<namespace>.<name>` in the daemon namespace (unique: namespaces have no
    dots)."""
    return f"weightcache-{namespace}.{name}"


def legacy_daemonset_name(cache_name: str) -> str:
    """Before daemons moved to the daemon namespace: `weightcache-<name>` in the cache's."""
    return f"weightcache-{cache_name}"
