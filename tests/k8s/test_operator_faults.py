"""Issue 9 part 4: operator faults on the real control plane.

Each test breaks one thing the operator depends on (its own process, a daemon
pod, a node, the spec under a rolling DaemonSet) and checks what the gates,
node labels and status say during the fault and after it heals. The caches
run on kwok nodes made for the test, selected by a pool label, so a test can
delete a node without touching the session's shared nodes.
Waits poll for a state with a generous bound; nothing asserts on time.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from tests.k8s.conftest import OPERATOR_SA
from tests.k8s.operator_flow import (
    Api,
    DaemonProcess,
    OperatorProcess,
    apply,
    eventually,
    gate_of,
    install_daemon_account,
    operator_rules,
    settled,
    template_spec_hash,
    weightcache,
)
from tools.testenv import nodes as kwok_nodes
from tools.testenv.cluster import Cluster
from weightcache_operator import gate, names, rbac

pytestmark = pytest.mark.k8s

POOL_LABEL = "weightcache.dev/test-pool"
# Holds a daemon pod in Terminating, as a kubelet does while the old daemon drains.
HOLD = "weightcache.dev/test-hold"
# A pod's terminationGracePeriodSeconds when its spec says none (the operator's does not).
DEFAULT_GRACE_SECONDS = 30




def create_kwok_node(cluster: Cluster, api: Api, name: str, pool: str) -> None:
    body = kwok_nodes.gpu_node(name)
    body["metadata"]["labels"][POOL_LABEL] = pool
    cluster.api.post("/api/v1/nodes", body)
    eventually(
        f"kwok marks node {name} Ready",
        lambda: any(
            c.type == "Ready" and c.status == "True"
            for c in api.core.read_node(name).status.conditions or []
        ),
    )


def delete_node(api: Api, name: str) -> None:
    try:
        api.core.delete_node(name)
    except ApiException as exc:
        if exc.status != 404:
            raise


def engine_pod(namespace: str, cache: str, node: str) -> dict[str, Any]:
    """A bare engine pod on `node` that waits for the cache's gate."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{cache}-engine-{node}",
            "namespace": namespace,
            "labels": {"app": f"{cache}-engine", names.GATED_LABEL: names.GATED_VALUE},
        },
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "readinessGates": [{"conditionType": names.GATE_CONDITION}],
            "containers": [{"name": "engine", "image": "engine:v1"}],
        },
    }


class PoolScene:
    """One WeightCache over fresh kwok nodes, engine pods on each, real daemons per node."""

    def __init__(
        self,
        cluster: Cluster,
        api: Api,
        namespace: str,
        operator: OperatorProcess,
        logs: Path,
        node_count: int,
    ) -> None:
        self.cluster, self.api, self.namespace, self.operator = cluster, api, namespace, operator
        self.name = f"mini-{namespace[2:8]}"
        self.logs = logs
        self.nodes = [f"kwok-fault-{namespace[2:8]}-{i}" for i in range(node_count)]
        for node in self.nodes:
            create_kwok_node(cluster, api, node, namespace)
        # The daemons run in the operator's daemon namespace, never the cache's.
        self.daemon_namespace = operator.daemon_namespace
        self.daemon_kubeconfig = install_daemon_account(cluster, self.daemon_namespace)
        self.daemons: dict[str, DaemonProcess] = {}
        self.held: set[str] = set()

    def apply_cache(self, **spec: object) -> None:
        spec.setdefault("placement", {"nodeSelector": {POOL_LABEL: self.namespace}})
        apply(self.cluster, weightcache(self.namespace, self.name, self.nodes[0], **spec))

    def deploy_engines(self) -> None:
        apply(self.cluster, *(engine_pod(self.namespace, self.name, n) for n in self.nodes))

    def daemon_pods(self, node: str) -> list[k8s.V1Pod]:
        return [
            p for p in self.api.daemon_pods(self.namespace, self.name) if p.spec.node_name == node
        ]

    def daemon_pod(self, node: str, not_named: str | None = None) -> k8s.V1Pod:
        """The live daemon pod on `node` (other than `not_named`), once it runs."""

        def running() -> k8s.V1Pod | None:
            return next(
                (
                    p
                    for p in self.daemon_pods(node)
                    if p.status.phase == "Running"
                    and p.metadata.deletion_timestamp is None
                    and p.metadata.name != not_named
                ),
                None,
            )

        return eventually(f"a daemon pod runs on {node}", running)

    def spec_hash(self) -> str:
        ds = eventually(
            "the DaemonSet exists", lambda: self.api.daemonset(self.namespace, self.name)
        )
        return template_spec_hash(ds)

    def start_daemon(self, node: str, spec_hash: str | None = None) -> DaemonProcess:
        """The real daemon for the node's current daemon pod (the previous one is stopped)."""
        self.stop_daemon(node)
        daemon = DaemonProcess(
            self.daemon_kubeconfig,
            self.namespace,
            self.name,
            self.daemon_pod(node).metadata.name,
            spec_hash or self.spec_hash(),
            self.logs / f"daemon-{node}-{len(list(self.logs.glob('daemon-*')))}.log",
            node,
            self.daemon_namespace,
        )
        daemon.start()
        self.daemons[node] = daemon
        return daemon

    def stop_daemon(self, node: str) -> None:
        if node in self.daemons:
            self.daemons.pop(node).stop()

    def gate(self, node: str) -> tuple[str, str] | None:
        pod = self.api.core.read_namespaced_pod(f"{self.name}-engine-{node}", self.namespace)
        return gate_of(pod)

    def gate_message(self, node: str) -> str:
        pod = self.api.core.read_namespaced_pod(f"{self.name}-engine-{node}", self.namespace)
        return next(
            c.message for c in pod.status.conditions or [] if c.type == names.GATE_CONDITION
        )

    def wait_gate(
        self, node: str, accept: Callable[[tuple[str, str] | None], bool], what: str
    ) -> tuple[str, str]:
        def probe() -> tuple[str, str] | None:
            g = self.gate(node)
            return g if accept(g) else None

        return eventually(f"engine gate on {node} {what}", probe)

    def label(self, node: str) -> str | None:
        return self.api.node_labels(node).get(names.node_label_key(self.namespace, self.name))

    def status_where(self, what: str, check: Callable[[dict], bool]) -> dict:
        def probe() -> dict | None:
            status = self.api.status(self.namespace, self.name)
            return status if check(status) else None

        return eventually(what, probe)

    def all_verified(self) -> dict:
        for node in self.nodes:
            self.wait_gate(node, lambda g: g == ("True", gate.WEIGHTS_RESIDENT), "opens")
            eventually(f"{node} is labelled", lambda n=node: self.label(n) == "Ready")
        want = len(self.nodes)
        return self.status_where(
            f"{want} nodes verified",
            lambda s: (
                s.get("readyNodes") == want == s.get("desiredNodes") and s.get("phase") == "Ready"
            ),
        )

    def hold(self, pod: str) -> None:
        """A finalizer on a daemon pod (in the daemon namespace)."""
        self.api.core.patch_namespaced_pod(
            pod, self.daemon_namespace, {"metadata": {"finalizers": [HOLD]}}
        )
        self.held.add(pod)

    def release(self, pod: str) -> None:
        try:
            self.api.core.patch_namespaced_pod(
                pod, self.daemon_namespace, {"metadata": {"finalizers": None}}
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
        self.held.discard(pod)

    def close(self) -> None:
        for pod in list(self.held):
            self.release(pod)
        for node in list(self.daemons):
            self.stop_daemon(node)
        # Delete while the operator runs, so its finalizer cleans node labels.
        self.cluster.kubectl(
            "delete",
            "wc",
            self.name,
            "-n",
            self.namespace,
            "--ignore-not-found",
            "--timeout=60s",
            check=False,
        )
        for node in self.nodes:
            delete_node(self.api, node)


def node_entries(status: dict) -> dict[str, dict]:
    return {n["name"]: n for n in status.get("nodes") or []}


@pytest.fixture
def pool(
    cluster: Cluster, api: Api, namespace: str, operator: OperatorProcess, tmp_path: Path
) -> Iterator[PoolScene]:
    s = PoolScene(cluster, api, namespace, operator, tmp_path, node_count=2)
    yield s
    s.close()
    for log in sorted(tmp_path.glob("daemon-*.log")):
        print(f"--- {log}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-20:]))
    print(f"--- operator log\n{operator.log_tail()}")


def owned_daemonsets(api: Api, namespace: str, cache: str) -> list[k8s.V1DaemonSet]:
    """Every DaemonSet made for the cache, in any namespace."""
    return api.apps.list_daemon_set_for_all_namespaces(
        label_selector=f"{names.CACHE_LABEL}={cache},{names.CACHE_NAMESPACE_LABEL}={namespace}"
    ).items


@pytest.mark.parametrize("kill_at", ["cache-stored", "daemonset-applied"])
def test_operator_killed_during_reconcile_converges(
    pool: PoolScene, api: Api, operator: OperatorProcess, operator_home: str, kill_at: str
) -> None:
    ns, name = pool.namespace, pool.name
    pool.deploy_engines()
    try:
        if kill_at == "daemonset-applied":
            # A refused status write pins the operator between its two writes.
            status_rule = f"{names.PLURAL}/status"
            operator_rules(
                pool.cluster,
                operator_home,
                OPERATOR_SA,
                [r for r in rbac.OPERATOR_RULES if status_rule not in r["resources"]],
            )
        pool.apply_cache()
        if kill_at == "daemonset-applied":
            eventually("the DaemonSet is applied", lambda: api.daemonset(ns, name))
        operator.kill()
        killed_with = api.status(ns, name)
        ds_before = api.daemonset(ns, name)
        if kill_at == "daemonset-applied":
            assert killed_with == {} and ds_before is not None
        assert all(pool.gate(n) is None or pool.gate(n)[0] == "False" for n in pool.nodes)
    finally:
        operator_rules(pool.cluster, operator_home, OPERATOR_SA, rbac.OPERATOR_RULES)
        operator.start()

    for node in pool.nodes:
        pool.start_daemon(node)
    status = pool.all_verified()

    # Exactly one DaemonSet, applied once (a re-render would bump its generation),
    # one live daemon pod per node, the finalizer once, no half-done kopf progress.
    (ds,) = owned_daemonsets(api, ns, name)
    if ds_before is not None:
        assert ds.metadata.uid == ds_before.metadata.uid
    assert ds.metadata.generation == 1
    assert template_spec_hash(ds) == status["fingerprint"]
    for node in pool.nodes:
        assert (
            len([p for p in pool.daemon_pods(node) if p.metadata.deletion_timestamp is None]) == 1
        )
    cache = api.cache(ns, name)
    assert cache["metadata"]["finalizers"].count(names.FINALIZER) == 1
    if kill_at == "daemonset-applied":
        assert "writing status: 403 Forbidden" in operator.log_path.read_text()
    eventually(
        "kopf finished the interrupted handler",
        lambda: (
            not [
                k
                for k in api.cache(ns, name)["metadata"].get("annotations") or {}
                if k.startswith(f"{names.GROUP}/apply_cache")
            ]
        ),
    )
    assert status["observedGeneration"] == cache["metadata"]["generation"]
    assert {n: e["ready"] for n, e in node_entries(status).items()} == dict.fromkeys(
        pool.nodes, True
    )
    api.wait_events(ns, name, "NodeReady", count=len(pool.nodes))

    # Converged means a further restart rewrites nothing.
    status = api.status(ns, name)
    operator.stop()
    operator.start()
    eventually(
        "the restarted operator re-judged the cache",
        lambda: 'weightcache_operator_reconciles_total{kind="cache"}' in operator.metrics(),
    )
    (again,) = owned_daemonsets(api, ns, name)
    assert (again.metadata.uid, again.metadata.generation) == (ds.metadata.uid, 1)
    assert settled(api.status(ns, name)) == settled(status)
    assert len(api.events(ns, name, "NodeReady")) == len(pool.nodes)
    operator.check_running()


def test_daemon_pod_deleted_closes_its_nodes_gate_until_it_reports_again(
    pool: PoolScene, api: Api, operator: OperatorProcess
) -> None:
    ns, name = pool.namespace, pool.name
    hit, other = pool.nodes
    pool.apply_cache()
    pool.deploy_engines()
    for node in pool.nodes:
        pool.start_daemon(node)
    pool.all_verified()

    # A quota on the daemon namespace, already full, keeps the DaemonSet from recreating
    # the pod, so the node is seen with no daemon at all.
    daemons = pool.daemon_namespace
    used = len(api.core.list_namespaced_pod(daemons).items)
    apply(
        pool.cluster,
        {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {"name": "full", "namespace": daemons},
            "spec": {"hard": {"pods": str(used - 1)}},
        },
    )
    eventually(
        "the quota counts the pods",
        lambda: api.core.read_namespaced_resource_quota("full", daemons).status.used,
    )
    old = pool.daemon_pod(hit).metadata.name
    api.core.delete_namespaced_pod(old, daemons)
    pool.stop_daemon(hit)  # the kubelet stops the container of a deleted pod
    pool.wait_gate(hit, lambda g: g == ("False", gate.NO_DAEMON_ON_NODE), "closes")
    eventually("the node label is removed", lambda: pool.label(hit) is None)
    entries = node_entries(
        pool.status_where("status drops to 1/2", lambda s: s.get("readyNodes") == 1)
    )
    assert hit not in entries or not entries[hit]["ready"]
    # The fault stays on its node.
    assert pool.gate(other) == ("True", gate.WEIGHTS_RESIDENT)
    assert pool.label(other) == "Ready"

    # Quota lifted: the DaemonSet recreates the pod, which has not reported yet.
    api.core.delete_namespaced_resource_quota("full", daemons)
    api.apps.patch_namespaced_daemon_set(  # wake the controller out of its backoff
        names.daemonset_name(ns, name),
        daemons,
        {"metadata": {"annotations": {"test.weightcache.dev/nudge": "1"}}},
    )
    new = pool.daemon_pod(hit, not_named=old).metadata.name
    pool.wait_gate(hit, lambda g: g == ("False", gate.DAEMON_NOT_READY), "waits for a report")
    eventually("the gate names the new pod", lambda: new in pool.gate_message(hit))
    assert "no report yet" in pool.gate_message(hit)
    assert pool.label(hit) is None

    pool.start_daemon(hit)
    status = pool.all_verified()
    assert node_entries(status)[hit]["pod"] == new
    operator.check_running()


def test_node_removed_is_dropped_from_status(
    pool: PoolScene, api: Api, operator: OperatorProcess
) -> None:
    ns, name = pool.namespace, pool.name
    kept, gone = pool.nodes
    pool.apply_cache()
    pool.deploy_engines()
    for node in pool.nodes:
        pool.start_daemon(node)
    pool.all_verified()

    delete_node(api, gone)
    pool.stop_daemon(gone)
    # The pod garbage collector removes pods bound to a node that no longer exists.
    eventually(
        "the engine pod on the removed node goes",
        lambda: not [p for p in api.engine_pods(ns, name) if p.spec.node_name == gone],
        bound=150,
    )
    eventually(
        "the daemon pod on the removed node goes", lambda: not pool.daemon_pods(gone), bound=150
    )
    status = pool.status_where(
        "status lists only the remaining node",
        lambda s: list(node_entries(s)) == [kept] and s.get("desiredNodes") == 1,
    )
    assert (status["readyNodes"], status["ready"], status["phase"]) == (1, "1/1", "Ready")
    assert pool.gate(kept) == ("True", gate.WEIGHTS_RESIDENT)
    assert pool.label(kept) == "Ready"
    assert api.daemonset(ns, name).status.desired_number_scheduled == 1
    operator.check_running()

    # A node joining the pool is picked up by the same operator.
    pool.nodes.append(f"{gone}-new")
    create_kwok_node(pool.cluster, api, pool.nodes[-1], ns)
    apply(pool.cluster, engine_pod(ns, name, pool.nodes[-1]))
    pool.start_daemon(pool.nodes[-1])
    pool.nodes.remove(gone)
    pool.all_verified()


def test_spec_change_mid_rollout_holds_gates_until_new_spec_reported(
    pool: PoolScene, api: Api, operator: OperatorProcess
) -> None:
    ns, name = pool.namespace, pool.name
    pool.apply_cache()
    pool.deploy_engines()
    for node in pool.nodes:
        pool.start_daemon(node)
    before = pool.all_verified()
    old_hash = before["fingerprint"]
    for node in pool.nodes:
        pool.hold(pool.daemon_pod(node).metadata.name)

    pool.apply_cache(
        model={**weightcache(ns, name, pool.nodes[0])["spec"]["model"], "revision": "0" * 40}
    )
    new_hash = eventually(
        "the DaemonSet carries a new spec hash", lambda: (h := pool.spec_hash()) != old_hash and h
    )
    # maxUnavailable 1: the DaemonSet replaces one node's daemon while the other
    # keeps serving the old weights until that one is back.
    first = eventually(
        "one old daemon pod is terminating",
        lambda: next(
            (
                n
                for n in pool.nodes
                for p in pool.daemon_pods(n)
                if p.metadata.deletion_timestamp is not None
            ),
            None,
        ),
    )
    (second,) = [n for n in pool.nodes if n != first]
    pool.wait_gate(
        second,
        lambda g: g == ("False", gate.FINGERPRINT_MISMATCH),
        "closes: its daemon holds the old spec",
    )
    assert old_hash[:12] in pool.gate_message(second)
    assert new_hash[:12] in pool.gate_message(second)
    pool.wait_gate(
        first, lambda g: g == ("False", gate.DAEMON_NOT_READY), "closes: its daemon is terminating"
    )
    status = pool.status_where(
        "status wants the new spec",
        lambda s: s.get("fingerprint") == new_hash and s.get("readyNodes") == 0,
    )
    assert node_entries(status)[second]["reason"] == gate.FINGERPRINT_MISMATCH
    assert status["phase"] != "Ready"
    for node in pool.nodes:
        eventually(f"{node} label is removed", lambda n=node: pool.label(n) is None)
    # The second node's old pod is not touched while the first is replaced.
    (held,) = pool.daemon_pods(second)
    assert held.metadata.deletion_timestamp is None

    # The first node's old daemon drains and goes; its new pod reports the new spec.
    for node in (first, second):
        (old,) = [p.metadata.name for p in pool.daemon_pods(node)]
        pool.stop_daemon(node)
        pool.wait_gate(node, lambda g: g is not None and g[0] == "False", "stays closed")
        eventually(
            f"the DaemonSet deletes the old pod on {node}",
            lambda n=node: all(
                p.metadata.deletion_timestamp is not None for p in pool.daemon_pods(n)
            ),
        )
        pool.release(old)
        pool.daemon_pod(node, not_named=old)
        pool.wait_gate(node, lambda g: g == ("False", gate.DAEMON_NOT_READY), "waits")
        pool.start_daemon(node, spec_hash=new_hash)
        pool.wait_gate(node, lambda g: g == ("True", gate.WEIGHTS_RESIDENT), "reopens")

    status = pool.all_verified()
    assert status["fingerprint"] == new_hash
    assert {e["pod"] for e in node_entries(status).values()} == {
        pool.daemon_pod(n).metadata.name for n in pool.nodes
    }
    pool.api.wait_events(ns, name, gate.FINGERPRINT_MISMATCH)
    operator.check_running()


def test_sigterm_ends_the_operator_after_its_cleanup(operator: OperatorProcess) -> None:
    """An operator pod being replaced (an upgrade, a drain) gets SIGTERM, and SIGKILL a
    grace period later: the operator exits by itself before it, its cleanup (the coalesced
    writes still due) done. Its engine pod watch, blocked in a read on a quiet cluster,
    held the exit until the kill, and the cleanup never finished."""
    assert operator.proc is not None
    try:
        operator.proc.send_signal(signal.SIGTERM)
        code = operator.proc.wait(timeout=DEFAULT_GRACE_SECONDS)
        assert code == 0, operator.log_tail()
        assert "Activity 'flush_writes' succeeded" in operator.log_tail(), operator.log_tail()
    finally:
        operator.stop()
        operator.start()
