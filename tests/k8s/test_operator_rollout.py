"""A model rollout node by node (`spec.rollout.strategy: NodeByNode`, issue 36 item 3) on the
real control plane: the apiserver's Eviction API, the kube-controller-manager's DaemonSet and
disruption controllers, the operator as a process, two kwok nodes.

Engine pods bound to the old generation are evicted one node at a time, a PodDisruptionBudget
that forbids it holds the rollout (an Event, the Progressing reason), and a node's daemon pod
is replaced only once no engine pod there runs the old generation. Waits poll with generous
bounds; nothing asserts on time.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from kubernetes import client as k8s

from tests.k8s.operator_flow import (
    Api,
    OperatorProcess,
    apply,
    eventually,
    install_daemon_account,
    template_spec_hash,
    weightcache,
)
from tools.testenv.cluster import Cluster
from weightcache_operator import names

pytestmark = pytest.mark.k8s


def engine_pod(namespace: str, cache: str, node: str, generation: str) -> dict[str, Any]:
    """An engine pod on `node`, gated by the cache and bound to `generation` (as the
    webhook binds it at admission)."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"engine-{node}", "namespace": namespace,
                     "labels": {"app": f"{cache}-engine",
                                names.GATED_LABEL: names.GATED_VALUE},
                     "annotations": {names.binding_key(namespace, cache): generation}},
        "spec": {"nodeName": node, "readinessGates": [{"conditionType": names.GATE_CONDITION}],
                 "containers": [{"name": "engine", "image": "engine:v1"}]},
    }


def progressing(api: Api, namespace: str, name: str) -> tuple[str, str] | None:
    status = api.status(namespace, name)
    c = next((c for c in status.get("conditions", []) if c["type"] == "Progressing"), None)
    return None if c is None else (c["reason"], c.get("message", ""))


def test_a_model_rolls_node_by_node_evicting_old_engines_within_their_budget(
    cluster: Cluster, api: Api, namespace: str, operator: OperatorProcess
) -> None:
    name, nodes = f"nbn-{namespace[2:8]}", sorted(cluster.node_names[:2])
    install_daemon_account(cluster, operator.daemon_namespace)  # the daemon pods run as it
    apply(cluster, weightcache(namespace, name, nodes[0],
                               placement={"nodeSelector": {"type": "kwok"}},
                               rollout={"strategy": "NodeByNode", "maxUnavailable": 1}))

    def daemons() -> dict[str, list[tuple[str, bool]]]:
        """Per node, its daemon pods' (spec hash, Ready) that are not terminating."""
        out: dict[str, list[tuple[str, bool]]] = {}
        for p in api.daemon_pods(namespace, name):
            if p.metadata.deletion_timestamp is None and p.spec.node_name:
                ready = any(c.type == "Ready" and c.status == "True"
                            for c in p.status.conditions or [])
                out.setdefault(p.spec.node_name, []).append(
                    (p.metadata.annotations[names.SPEC_HASH_ANNOTATION], ready))
        return out

    ds = eventually("the DaemonSet", lambda: api.daemonset(namespace, name))
    assert ds.spec.update_strategy.type == "OnDelete"
    old = template_spec_hash(ds)
    eventually("a Ready daemon pod on each node", lambda: all(
        daemons().get(n) == [(old, True)] for n in nodes) or None)
    for node in nodes:
        apply(cluster, engine_pod(namespace, name, node, old))
    eventually("both engine pods run", lambda: len(
        [p for p in api.engine_pods(namespace, name) if p.status.phase == "Running"]) == 2
        or None)
    # The engines are not Ready (no daemon reports here): a budget of 2 forbids evicting them.
    apply(cluster, {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                    "metadata": {"name": "engines", "namespace": namespace},
                    "spec": {"minAvailable": 2,
                             "selector": {"matchLabels": {"app": f"{name}-engine"}}}})
    budgets = k8s.PolicyV1Api(api.core.api_client)
    eventually("the disruption controller counts the budget", lambda: (
        budgets.read_namespaced_pod_disruption_budget("engines", namespace).status.expected_pods
        == 2) or None)

    cluster.kubectl("patch", "wc", "-n", namespace, name, "--type=merge",
                    "-p", '{"spec":{"model":{"revision":"r2"}}}')
    reason = eventually("the rollout held by the budget", lambda: (
        (p := progressing(api, namespace, name)) and p[0] == "EvictionBlocked" and p) or None)
    assert f"{namespace}/engine-{nodes[0]}" in reason[1]
    api.wait_events(namespace, name, "EvictionBlocked")
    assert {p.metadata.name for p in api.engine_pods(namespace, name)} == {
        f"engine-{n}" for n in nodes}
    assert all(daemons()[n] == [(old, True)] for n in nodes)

    # The budget lifted: node by node, each daemon replaced only after its engines left.
    cluster.kubectl("delete", "pdb", "-n", namespace, "engines")
    new = ""
    in_flight_max = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        engines = {p.spec.node_name for p in api.engine_pods(namespace, name)}  # read first
        now = daemons()
        new = template_spec_hash(api.daemonset(namespace, name))
        for node in nodes:
            fresh = [h for h, _ in now.get(node, []) if h != old]
            assert not (fresh and node in engines), (
                f"node {node} got a daemon of the new generation while its old engine ran")
        in_flight = [n for n in nodes if n not in engines and now.get(n) != [(new, True)]]
        in_flight_max = max(in_flight_max, len(in_flight))
        if not engines and all(now.get(n) == [(new, True)] for n in nodes):
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"the rollout did not finish: daemons {daemons()}, "
                             f"progressing {progressing(api, namespace, name)}\n"
                             f"{operator.log_tail()}")
    assert new != old
    assert in_flight_max == 1, "maxUnavailable 1: one node at a time"
    eventually("an Event for each eviction", lambda: len(
        {e.message for e in api.events(namespace, name, "Evicted")}) == 4 or None, bound=30)
    eventually("the rollout is over", lambda: (
        (p := progressing(api, namespace, name)) and p[0] not in (
            "EvictionBlocked", "RollingNodeByNode") and p) or None)
    cluster.kubectl("delete", "wc", "-n", namespace, name, "--wait=false")
