"""The chart grants exactly the rules the operator and the daemon declare they need.

weightcache_operator.rbac is the single source of the rules; the k8s tests
prove each one is used. Here: the rendered ClusterRole and daemon Roles say
the same, and nothing is a wildcard.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.unit.chart.chartkit import VALUE_SETS, Renderer, files, one, values_id
from weightcache_operator import rbac


def canonical(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) triples: the grant a rule list adds up to."""
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule.get("apiGroups", [])
        for resource in rule.get("resources", [])
        for verb in rule.get("verbs", [])
    }


def roles(docs: list[dict[str, Any]], kind: str, component: str | None = None
          ) -> list[dict[str, Any]]:
    return [
        d for d in docs if d["kind"] == kind
        and d["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]


def test_the_operator_writes_daemonsets_only_in_the_namespaces_the_chart_names(
    render: Renderer
) -> None:
    docs = render(set_values=["daemon.namespace=daemons",
                              "daemon.migrateFromNamespaces={team-a,team-b}"])
    (cluster_role,) = roles(docs, "ClusterRole")
    assert canonical(cluster_role["rules"]) == canonical(rbac.OPERATOR_RULES)
    # The ClusterRole reads DaemonSets (list, watch); nothing cluster-wide writes one.
    assert not {v for _, r, v in canonical(cluster_role["rules"]) if r == "daemonsets"} - {
        "list", "watch"}
    binding = one(docs, "ClusterRoleBinding", "-weightcache-operator")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": cluster_role["metadata"]["name"]}
    sa = one(docs, "ServiceAccount", "-weightcache-operator")
    subject = {"kind": "ServiceAccount", "name": sa["metadata"]["name"],
               "namespace": "wc-system"}
    assert binding["subjects"] == [subject]
    operator_roles = {r["metadata"]["namespace"]: r for r in roles(docs, "Role", "operator")}
    assert set(operator_roles) == {"daemons", "team-a", "team-b"}
    assert canonical(operator_roles["daemons"]["rules"]) == canonical(
        rbac.OPERATOR_DAEMON_NAMESPACE_RULES)
    for ns in ("team-a", "team-b"):
        assert canonical(operator_roles[ns]["rules"]) == canonical(rbac.OPERATOR_MIGRATION_RULES)
    for role_binding in roles(docs, "RoleBinding", "operator"):
        assert role_binding["subjects"] == [subject]
        assert role_binding["roleRef"]["name"] == operator_roles[
            role_binding["metadata"]["namespace"]]["metadata"]["name"]


@pytest.mark.parametrize("daemon_namespace", ["", "daemons"])
def test_daemon_gets_patch_pods_in_the_daemon_namespace_only(
    render: Renderer, daemon_namespace: str
) -> None:
    docs = render(set_values=[f"daemon.namespace={daemon_namespace}"] if daemon_namespace
                  else [])
    expected = daemon_namespace or "wc-system"
    (role,) = roles(docs, "Role", "daemon")
    assert role["metadata"]["namespace"] == expected
    assert roles(docs, "ClusterRole", "daemon") == []
    assert canonical(role["rules"]) == canonical(rbac.DAEMON_RULES)
    (binding,) = roles(docs, "RoleBinding", "daemon")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "weightcache-daemon", "namespace": expected}]
    (account,) = roles(docs, "ServiceAccount", "daemon")
    assert account["metadata"]["name"] == "weightcache-daemon"
    assert account["metadata"]["namespace"] == expected
    operator = one(docs, "Deployment", "-operator")["spec"]["template"]["spec"]
    policy = json.loads(operator["containers"][0]["env"][0]["value"])
    assert policy["daemonNamespace"] == expected


@pytest.mark.parametrize("values", VALUE_SETS, ids=values_id)
def test_no_rule_is_a_wildcard(render: Renderer, values) -> None:
    docs = render(*files(values))
    for doc in docs:
        for rule in doc.get("rules", []) if doc["kind"] in ("Role", "ClusterRole") else []:
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key], f"{doc['kind']} {doc['metadata']['name']}: {rule}"
            assert "resourceNames" not in rule or rule["resourceNames"]


def test_rbac_can_be_left_to_the_cluster_admin(render: Renderer) -> None:
    docs = render(set_values=["rbac.create=false"])
    assert roles(docs, "ClusterRole") == [] and roles(docs, "Role") == []
    assert [d for d in docs if d["kind"] == "ClusterRoleBinding"] == []


def test_the_csi_plugin_may_only_read_weightcaches(render: Renderer) -> None:
    docs = render(set_values=["daemon.namespace=daemons"])
    (role,) = roles(docs, "ClusterRole", "csi")
    assert canonical(role["rules"]) == canonical(rbac.CSI_PLUGIN_RULES)
    (binding,) = roles(docs, "ClusterRoleBinding", "csi")
    (account,) = roles(docs, "ServiceAccount", "csi")
    assert account["metadata"]["namespace"] == "daemons"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": "daemons"}]
    plugin = one(docs, "DaemonSet", "-csi")
    assert plugin["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]
