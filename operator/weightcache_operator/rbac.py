"""The RBAC rules the operator and the daemon's reporter need: the single source.

`make manifests` writes them into the chart (charts/weightcache-operator/files/,
included by its ClusterRole and Roles) and the tests build their roles from
them, so what is tested is what ships. Every verb here is used: the chart's
end-to-end test removes each in turn and the operator fails on exactly it.
"""

from __future__ import annotations

from typing import Any

from . import names

OPERATOR_RULES: list[dict[str, Any]] = [
    # Watch caches; kopf patches its finalizer and progress annotations on them.
    {"apiGroups": [names.GROUP], "resources": [names.PLURAL],
     "verbs": ["list", "watch", "patch"]},
    {"apiGroups": [names.GROUP], "resources": [f"{names.PLURAL}/status"], "verbs": ["patch"]},
    # The daemons' DaemonSets: read wherever they are (a cache's own namespace before
    # the move to the daemon namespace); written only where OPERATOR_DAEMON_NAMESPACE_RULES
    # grant it.
    {"apiGroups": ["apps"], "resources": ["daemonsets"], "verbs": ["list", "watch"]},
    # Daemon pods (reports) and engine pods (readiness gates), each watch selecting its pods
    # by label at the apiserver.
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
    # A NodeByNode model rollout evicts a node's engine pods bound to an older generation,
    # then that node's daemon pod (the Eviction API: PodDisruptionBudgets decide; rollout.py).
    {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]},
    # weightcache.dev/<name>=Ready node labels.
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch", "patch"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
]

# In the daemon namespace only (a Role): server-side apply of each cache's DaemonSet
# (create on first apply), and its deletion by the cache's finalizer.
OPERATOR_DAEMON_NAMESPACE_RULES: list[dict[str, Any]] = [
    {"apiGroups": ["apps"], "resources": ["daemonsets"], "verbs": ["create", "patch", "delete"]},
]

# In each namespace whose caches still have a DaemonSet of the older layout (a Role the
# chart adds only while `daemon.migrateFromNamespaces` lists it): the operator deletes
# that DaemonSet once, so the cache's daemons move to the daemon namespace.
OPERATOR_MIGRATION_RULES: list[dict[str, Any]] = [
    {"apiGroups": ["apps"], "resources": ["daemonsets"], "verbs": ["delete"]},
]

# The daemon patches its own report annotation (a merge patch needing no read,
# so it cannot read other pods' specs or env). RBAC cannot name "its own" pod
# or one annotation: the chart's report guard (ValidatingAdmissionPolicy) does.
DAEMON_RULES: list[dict[str, Any]] = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]},
]


# The webhook (its own Deployment and ServiceAccount, webhook.py) reads the WeightCache a
# pod's label names at each admission: a list by name, a quorum read. Nothing else.
WEBHOOK_RULES: list[dict[str, Any]] = [
    {"apiGroups": [names.GROUP], "resources": [names.PLURAL], "verbs": ["list"]},
]


# The CSI node plugin reads the WeightCache a volume names, to check the pod's namespace
# may use it and find its socket directory (csi/weightcache_csi).
CSI_PLUGIN_RULES: list[dict[str, Any]] = [
    {"apiGroups": [names.GROUP], "resources": [names.PLURAL], "verbs": ["get"]},
]


def cluster_role(name: str, rules: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": rules,
    }


def role(name: str, namespace: str, rules: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": name, "namespace": namespace},
        "rules": rules,
    }


def binding(kind: str, name: str, role_kind: str, role_name: str, sa_name: str,
            sa_namespace: str, namespace: str | None = None) -> dict[str, Any]:
    """A RoleBinding (namespace given) or ClusterRoleBinding to one ServiceAccount."""
    meta: dict[str, Any] = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": kind,
        "metadata": meta,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind,
                    "name": role_name},
        "subjects": [{"kind": "ServiceAccount", "name": sa_name, "namespace": sa_namespace}],
    }
