"""The RBAC rules the operator and the daemon's reporter need: the single source.

The Helm chart's ClusterRole/Role and the tests' roles are built from these
lists (`python -m weightcache_operator rbac` prints them as YAML), so what is
tested is what ships. Every verb here is used; the end-to-end test runs the
operator under exactly these rules.
"""

from __future__ import annotations

from typing import Any

from . import names

OPERATOR_RULES: list[dict[str, Any]] = [
    # Watch caches; kopf patches its finalizer and progress annotations on them.
    {"apiGroups": [names.GROUP], "resources": [names.PLURAL],
     "verbs": ["list", "watch", "patch"]},
    {"apiGroups": [names.GROUP], "resources": [f"{names.PLURAL}/status"], "verbs": ["patch"]},
    # Owner references with blockOwnerDeletion need update on the owner's finalizers.
    {"apiGroups": [names.GROUP], "resources": [f"{names.PLURAL}/finalizers"],
     "verbs": ["update"]},
    # Server-side apply of the daemon DaemonSet (create on first apply).
    {"apiGroups": ["apps"], "resources": ["daemonsets"],
     "verbs": ["list", "watch", "create", "patch"]},
    # Daemon pods (reports) and engine pods (readiness gates).
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
    # weightcache.dev/<name>=Ready node labels.
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch", "patch"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
]

# The daemon reads its own pod and patches its report annotation. RBAC cannot
# name "its own" pod; scope it to the cache's namespace with a RoleBinding.
DAEMON_RULES: list[dict[str, Any]] = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]},
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
