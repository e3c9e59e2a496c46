"""The scale harness's meters: FlowSchemas per verb and resource, and /metrics parsing."""

from __future__ import annotations

from benchmarks import apimetrics
from weightcache_operator import rbac


def request(verb: str, resource: str, subresource: str, code: str, value: int) -> str:
    labels = (f'code="{code}",component="apiserver",dry_run="",group="",resource="{resource}",'
              f'scope="resource",subresource="{subresource}",verb="{verb}",version="v1"')
    return f"apiserver_request_total{{{labels}}} {value}"


def dispatched(schema: str, value: int) -> str:
    labels = f'flow_schema="{schema}",priority_level="workload-low"'
    return f"apiserver_flowcontrol_dispatched_requests_total{{{labels}}} {value}"


SCRAPE = "\n".join([
    "# HELP apiserver_request_total [STABLE] Counter of apiserver requests.",
    request("PATCH", "pods", "status", "200", 7),
    request("PATCH", "pods", "status", "409", 2),
    request("LIST", "nodes", "", "200", 1),
    dispatched("wcscale-op-patch-pods-status", 5),
    dispatched("wcscale-op-list-nodes", 1),
    dispatched("wcscale-op-other", 3),
    dispatched("service-accounts", 40),
])


def test_one_flow_schema_per_verb_and_resource_the_rules_grant() -> None:
    docs = apimetrics.flow_schemas("op", "wc-system", "weightcache-operator",
                                   rbac.OPERATOR_RULES)
    granted = sum(len(r["resources"]) * len(r["verbs"]) for r in rbac.OPERATOR_RULES)
    assert len(docs) == granted + 1  # and one for anything else the account asks
    names = [d["metadata"]["name"] for d in docs]
    assert len(set(names)) == len(names)
    status = next(d for d in docs if d["metadata"]["name"] == "wcscale-op-patch-pods-status")
    (rule,) = status["spec"]["rules"]
    assert rule["subjects"] == [{"kind": "ServiceAccount", "serviceAccount": {
        "name": "weightcache-operator", "namespace": "wc-system"}}]
    assert rule["resourceRules"][0]["resources"] == ["pods/status"]
    assert rule["resourceRules"][0]["verbs"] == ["patch"]
    other = next(d for d in docs if d["metadata"]["name"] == "wcscale-op-other")
    assert other["spec"]["matchingPrecedence"] > status["spec"]["matchingPrecedence"]
    # Served as every ServiceAccount is without a schema of its own.
    assert {d["spec"]["priorityLevelConfiguration"]["name"] for d in docs} == {"workload-low"}


def test_counts_and_deltas() -> None:
    before = apimetrics.counts("")
    after = apimetrics.counts(SCRAPE)
    assert after.all_clients[("patch", "pods/status")] == 9
    op = apimetrics.flow_delta(before, after, "op")
    assert op == {"list nodes": 1, "other": 3, "patch pods/status": 5}
    assert apimetrics.writes(op) == 5
    assert apimetrics.all_clients_delta(before, after) == {"patch pods/status": 9, "list nodes": 1}
