"""The chart grants exactly the rules the operator and the daemon declare they need.

weightcache_operator.rbac is the single source of the rules; the k8s tests
prove each one is used. Here: the rendered ClusterRole and daemon Roles say
the same, and nothing is a wildcard.
"""

from __future__ import annotations

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


def test_cluster_wide_install_grants_exactly_the_operator_rules(render: Renderer) -> None:
    docs = render()
    (cluster_role,) = roles(docs, "ClusterRole")
    assert canonical(cluster_role["rules"]) == canonical(rbac.OPERATOR_RULES)
    # The operator's own rules live in the ClusterRole only (it watches every namespace).
    assert roles(docs, "Role") == []
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": cluster_role["metadata"]["name"]}
    sa = one(docs, "ServiceAccount", "-weightcache-operator")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": "wc-system"}]


@pytest.mark.parametrize("daemon_namespaces", [[], ["team-a", "team-b"]])
def test_daemon_gets_patch_pods_in_its_namespaces_only(
    render: Renderer, daemon_namespaces: list[str]
) -> None:
    docs = render(set_values=[f"daemon.namespaces={{{','.join(daemon_namespaces)}}}"]
                  if daemon_namespaces else [])
    expected = daemon_namespaces or ["wc-system"]
    daemon_roles = roles(docs, "Role", "daemon")
    assert sorted(r["metadata"]["namespace"] for r in daemon_roles) == expected
    assert roles(docs, "ClusterRole", "daemon") == []
    for role in daemon_roles:
        assert canonical(role["rules"]) == canonical(rbac.DAEMON_RULES)
    for ns in expected:
        binding = next(d for d in roles(docs, "RoleBinding", "daemon")
                       if d["metadata"]["namespace"] == ns)
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "weightcache-daemon", "namespace": ns}]
        account = next(d for d in roles(docs, "ServiceAccount", "daemon")
                       if d["metadata"]["namespace"] == ns)
        assert account["metadata"]["name"] == "weightcache-daemon"


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
