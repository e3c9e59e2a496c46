"""Kubernetes names the operator, the daemon and the engines agree on."""

GROUP = "weightcache.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "WeightCache"
PLURAL = "weightcaches"

# Report the daemon writes on its own pod; the operator only reads it.
REPORT_ANNOTATION = f"{GROUP}/report"
# Engine pods list this readiness gate; the operator owns the condition.
GATE_CONDITION = f"{GROUP}/weights-resident"
# Node label `weightcache.dev/<cache name>=Ready` marks verified-resident weights.
NODE_LABEL_PREFIX = f"{GROUP}/"
NODE_LABEL_READY = "Ready"

CACHE_LABEL = f"{GROUP}/cache"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
DAEMON_COMPONENT = "daemon"
MANAGER = "weightcache-operator"

# Stamped on the DaemonSet so a resync can tell whether it is current
# without a server round trip.
RENDER_HASH_ANNOTATION = f"{GROUP}/render-hash"
GENERATION_ANNOTATION = f"{GROUP}/generation"
SPEC_HASH_ANNOTATION = f"{GROUP}/spec-hash"
SPEC_HASH_ENV = "WEIGHTCACHE_SPEC_HASH"

FINALIZER = f"{GROUP}/cleanup"


def node_label_key(cache_name: str) -> str:
    return NODE_LABEL_PREFIX + cache_name


def daemonset_name(cache_name: str) -> str:
    return f"weightcache-{cache_name}"
