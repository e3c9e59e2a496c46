"""Issue 6 acceptance on the real control plane: the operator, the real daemon, gated rollouts.

Waits poll for a state with a generous bound; nothing asserts on time.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client as k8s

from tests.k8s.operator_flow import (
    Api,
    DaemonProcess,
    OperatorProcess,
    apply,
    engine_deployment,
    eventually,
    gate_of,
    install_crd,
    install_daemon_account,
    install_operator_account,
    is_ready,
    minilm_tensor_bytes,
    report_of,
    rollout_complete,
    template_spec_hash,
    weightcache,
)
from tools.testenv.cluster import Cluster
from weightcache_operator import names

pytestmark = pytest.mark.k8s


@pytest.fixture(scope="module")
def operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:
    install_crd(cluster)
    home = f"wc-operator-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", home)
    kubeconfig = install_operator_account(cluster, home, "weightcache-operator")
    op = OperatorProcess(kubeconfig, tmp_path_factory.mktemp("operator") / "operator.log")
    op.start()
    yield op
    op.stop()


@pytest.fixture
def api(k8s_api: k8s.ApiClient) -> Api:
    return Api(k8s_api)


class Scene:
    """One WeightCache on one kwok node, its daemon account, and the daemons started."""

    def __init__(self, cluster: Cluster, api: Api, namespace: str, operator: OperatorProcess,
                 logs: Path) -> None:
        self.cluster, self.api, self.namespace, self.operator = cluster, api, namespace, operator
        self.name = f"mini-{namespace[2:8]}"
        self.node = cluster.node_names[0]
        self.logs = logs
        self.daemon_kubeconfig = install_daemon_account(cluster, namespace)
        self.daemons: list[DaemonProcess] = []

    def apply_cache(self, **spec: object) -> None:
        apply(self.cluster, weightcache(self.namespace, self.name, self.node, **spec))

    def daemon_pod(self) -> k8s.V1Pod:
        def running() -> k8s.V1Pod | None:
            pods = [p for p in self.api.daemon_pods(self.namespace, self.name)
                    if p.spec.node_name == self.node and p.status.phase == "Running"
                    and p.metadata.deletion_timestamp is None]
            return pods[0] if pods else None

        return eventually("the daemon pod runs on the kwok node", running)

    def spec_hash(self) -> str:
        ds = eventually("the DaemonSet exists", lambda: self.api.daemonset(self.namespace,
                                                                           self.name))
        return template_spec_hash(ds)

    def start_daemon(self, spec_hash: str | None = None) -> DaemonProcess:
        daemon = DaemonProcess(
            self.daemon_kubeconfig, self.namespace, self.name, self.daemon_pod().metadata.name,
            spec_hash or self.spec_hash(), self.logs / f"daemon-{len(self.daemons)}.log",
        )
        daemon.start()
        self.daemons.append(daemon)
        return daemon

    def deploy_engine(self, version: str, gated: bool) -> None:
        apply(self.cluster, engine_deployment(self.namespace, self.name, self.node, version,
                                              gated))

    def engine(self, version: str, gate: tuple[str, str]) -> k8s.V1Pod:
        return eventually(
            f"engine {version} pod gate is {gate}",
            lambda: next((p for p in self.api.engine_pods(self.namespace, self.name, version)
                          if gate_of(p) == gate), None),
        )

    def rolled_out(self) -> None:
        eventually("the engine rollout completes",
                   lambda: rollout_complete(self.api, self.namespace, f"{self.name}-engine"))

    def status_where(self, what: str, check: Callable[[dict], bool]) -> dict:
        def probe() -> dict | None:
            status = self.api.status(self.namespace, self.name)
            return status if check(status) else None

        return eventually(what, probe)

    def label(self) -> str | None:
        return self.api.node_labels(self.node).get(names.node_label_key(self.name))

    def wc_table(self) -> list[list[str]]:
        out = self.cluster.kubectl("get", "wc", self.name, "-n", self.namespace).stdout
        return [line.split() for line in out.splitlines()]

    def close(self) -> None:
        for daemon in self.daemons:
            daemon.stop()
        # Delete while the operator runs, so its finalizer cleans node labels.
        self.cluster.kubectl("delete", "wc", self.name, "-n", self.namespace,
                             "--ignore-not-found", "--timeout=60s", check=False)


@pytest.fixture
def scene(cluster: Cluster, api: Api, namespace: str, operator: OperatorProcess,
          tmp_path: Path) -> Iterator[Scene]:
    s = Scene(cluster, api, namespace, operator, tmp_path)
    yield s
    s.close()
    for daemon in s.daemons:
        print(f"--- {daemon.log_path}\n{daemon.log_tail()}")
    print(f"--- operator log\n{operator.log_tail()}")


def reconciles(operator: OperatorProcess, kind: str) -> float:
    prefix = f'weightcache_operator_reconciles_total{{kind="{kind}"}} '
    lines = [line for line in operator.metrics().splitlines() if line.startswith(prefix)]
    return float(lines[0].split()[-1]) if lines else 0.0


def node_entry(status: dict) -> dict:
    (node,) = status.get("nodes") or [{}]
    return node


def condition(status: dict, kind: str) -> tuple[str, str]:
    c = next(c for c in status["conditions"] if c["type"] == kind)
    return c["status"], c["reason"]


def test_rollout_waits_for_verified_weights(scene: Scene, api: Api,
                                            operator: OperatorProcess) -> None:
    ns, name = scene.namespace, scene.name
    scene.apply_cache()

    # The DaemonSet is rendered, owned by the cache, and carries the spec hash.
    ds = eventually("the DaemonSet exists", lambda: api.daemonset(ns, name))
    (owner,) = ds.metadata.owner_references
    assert (owner.kind, owner.name, owner.controller) == ("WeightCache", name, True)
    spec_hash = template_spec_hash(ds)
    daemon_pod = scene.daemon_pod()
    status = scene.status_where(
        "status lists the daemon pod, not yet reporting",
        lambda s: node_entry(s).get("pod") == daemon_pod.metadata.name,
    )
    assert status["fingerprint"] == spec_hash
    assert node_entry(status)["reason"] == "DaemonNotReady"
    assert (status["phase"], status["ready"]) == ("Loading", "0/1")
    header, row = scene.wc_table()
    assert header == ["NAME", "READY", "PHASE", "RESIDENT", "TRANSPORT", "AGE"]
    assert row[:5] == [name, "0/1", "Loading", "0B", "memfd"]

    # Engines serve before the cache exists; the new version adds the gate.
    scene.deploy_engine("v1", gated=False)
    scene.rolled_out()
    (old,) = api.engine_pods(ns, name, "v1")
    scene.deploy_engine("v2", gated=True)
    new = scene.engine("v2", ("False", "DaemonNotReady"))
    assert not is_ready(new)
    assert is_ready(api.core.read_namespaced_pod(old.metadata.name, ns))
    rollout = api.apps.read_namespaced_deployment(f"{name}-engine", ns).status
    assert (rollout.replicas, rollout.updated_replicas, rollout.available_replicas) == (2, 1, 1)

    # The real daemon loads MiniLM and reports into its pod: the gate opens.
    scene.start_daemon()
    expected = minilm_tensor_bytes()
    status = scene.status_where("the node is verified", lambda s: s.get("readyNodes") == 1)
    (gpu,) = node_entry(status)["gpus"]
    assert gpu["id"] == "cpu" and gpu["state"] == "Ready"
    assert gpu["preloadedWeightsBytes"] == expected == gpu["expectedBytes"]
    assert gpu["transport"] == "memfd" and len(gpu["fingerprint"]) == 64
    assert gpu["readopted"] is False and "loadSeconds" in gpu
    assert status["phase"] == "Ready" and status["residentBytes"] == expected
    assert condition(status, "Ready") == ("True", "Ready")
    assert condition(status, "WeightsResident") == ("True", "WeightsResident")
    scene.rolled_out()
    assert api.engine_pods(ns, name, "v1") == []
    (v2,) = api.engine_pods(ns, name, "v2")
    assert gate_of(v2) == ("True", "WeightsResident") and is_ready(v2)
    assert eventually("the node is labelled", scene.label) == "Ready"
    assert scene.wc_table()[1][:5] == [name, "1/1", "Ready", "86.6MiB", "memfd"]
    assert api.events(ns, name, "NodeReady")
    assert 'weightcache_operator_gate_decisions_total{reason="WeightsResident",status="True"}' in (
        operator.metrics()
    )

    # A daemon holding weights for another spec closes the gate and holds a new rollout.
    scene.daemons[-1].stop()
    scene.start_daemon(spec_hash="0" * 64)
    scene.engine("v2", ("False", "FingerprintMismatch"))
    scene.status_where("status shows the mismatch",
                       lambda s: node_entry(s).get("reason") == "FingerprintMismatch")
    eventually("the node label is removed", lambda: scene.label() is None)
    scene.deploy_engine("v3", gated=True)
    v3 = scene.engine("v3", ("False", "FingerprintMismatch"))
    assert not is_ready(v3)
    assert api.engine_pods(ns, name, "v2")  # the old pod is not taken down

    # The right weights again: the held rollout completes.
    scene.daemons[-1].stop()
    scene.start_daemon()
    scene.rolled_out()
    (v3,) = api.engine_pods(ns, name, "v3")
    assert gate_of(v3) == ("True", "WeightsResident")

    # Too few bytes against a pinned expectation (the weights themselves are unchanged).
    scene.cluster.kubectl("patch", "wc", name, "-n", ns, "--type=merge", "-p",
                          json.dumps({"spec": {"engine": {"expectedBytes": 2 * expected}}}))
    scene.engine("v3", ("False", "BytesBelowExpected"))
    status = scene.status_where("status shows the shortfall",
                                lambda s: s.get("phase") == "Degraded")
    assert condition(status, "Degraded") == ("True", "BytesBelowExpected")
    assert template_spec_hash(api.daemonset(ns, name)) == spec_hash


def test_operator_killed_mid_rollout_converges(scene: Scene, api: Api,
                                               operator: OperatorProcess) -> None:
    ns, name = scene.namespace, scene.name
    scene.apply_cache()
    scene.deploy_engine("v1", gated=False)
    scene.rolled_out()
    scene.deploy_engine("v2", gated=True)
    scene.engine("v2", ("False", "DaemonNotReady"))

    operator.kill()
    try:
        daemon = scene.start_daemon()
        eventually(
            "the daemon reports without the operator",
            lambda: (report_of(api.core.read_namespaced_pod(daemon.pod, ns)) or {})
            .get("gpus", {}).get("cpu", {}).get("state") == "Ready",
        )
        # Nobody else opens the gate.
        (v2,) = api.engine_pods(ns, name, "v2")
        assert gate_of(v2) == ("False", "DaemonNotReady") and not is_ready(v2)
    finally:
        operator.start()

    scene.rolled_out()
    (v2,) = api.engine_pods(ns, name, "v2")
    assert gate_of(v2) == ("True", "WeightsResident")
    status = scene.status_where("the cache is Ready", lambda s: s.get("phase") == "Ready")
    assert eventually("the node is labelled", scene.label) == "Ready"
    assert len(api.events(ns, name, "NodeReady")) == 1

    # A converged state survives another restart untouched: no write, no event.
    before = api.core.read_namespaced_pod(v2.metadata.name, ns)
    events = len(api.core.list_namespaced_event(ns).items)
    operator.stop()
    operator.start()
    eventually("the restarted operator re-judged the engine pod",
               lambda: reconciles(operator, "engine_pod") >= 1)
    after = api.core.read_namespaced_pod(v2.metadata.name, ns)
    assert after.metadata.resource_version == before.metadata.resource_version
    assert api.status(ns, name) == status
    assert len(api.core.list_namespaced_event(ns).items) == events


def test_deleting_the_cache_cleans_up(scene: Scene, api: Api) -> None:
    ns, name = scene.namespace, scene.name
    scene.apply_cache()
    scene.start_daemon()
    scene.deploy_engine("v1", gated=True)
    scene.engine("v1", ("True", "WeightsResident"))
    assert eventually("the node is labelled", scene.label) == "Ready"

    scene.cluster.kubectl("delete", "wc", name, "-n", ns, "--timeout=60s")
    assert api.cache(ns, name) is None
    eventually("the DaemonSet is garbage-collected", lambda: api.daemonset(ns, name) is None)
    eventually("the node label is removed", lambda: scene.label() is None)
    (engine,) = api.engine_pods(ns, name, "v1")
    assert gate_of(engine) == ("False", "NoWeightCache")
    assert not is_ready(engine)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model": None}, "spec.model: Required value"),
        ({"transport": "nccl"}, 'spec.transport: Unsupported value: "nccl"'),
        ({"gpus": {"perNode": -1}}, "spec.gpus.perNode"),
        ({"sidecar": {"resources": {"requests": {"memory": "1GB"}}}},
         "spec.sidecar.resources.requests.memory"),
        ({"model": {"path": "models/relative"}}, "spec.model.path"),
        ({"socketDir": "/run/../etc"}, "spec.socketDir"),
    ],
)
def test_invalid_caches_are_rejected_naming_the_field(
    cluster: Cluster, namespace: str, change: dict, field: str
) -> None:
    install_crd(cluster)
    doc = weightcache(namespace, "invalid", cluster.node_names[0])
    for key, value in change.items():
        if value is None:
            doc["spec"].pop(key)
        else:
            doc["spec"][key] = value
    with pytest.raises(subprocess.CalledProcessError) as err:
        cluster.kubectl("create", "-f", "-", input=json.dumps(doc))
    assert "is invalid" in err.value.stderr
    assert field in err.value.stderr


@pytest.mark.parametrize(
    ("raw", "detail"),
    [
        ("{not json", "not JSON"),
        (json.dumps({"v": 1, "specHash": "x", "gpus": {"cpu": {
            "state": "Ready", "preloadedWeightsBytes": -1, "expectedBytes": 1}}}),
         "preloadedWeightsBytes"),
        (json.dumps({"v": 1, "specHash": "x", "gpus": {}, "pad": "x" * (100 * 1024)}),
         "over the 65536 cap"),
    ],
    ids=["not-json", "negative-bytes", "oversized"],
)
def test_malformed_report_is_ignored_with_an_event(
    scene: Scene, api: Api, operator: OperatorProcess, raw: str, detail: str
) -> None:
    ns, name = scene.namespace, scene.name
    scene.apply_cache()
    pod = scene.daemon_pod()
    api.core.patch_namespaced_pod(pod.metadata.name, ns, {"metadata": {"annotations": {
        names.REPORT_ANNOTATION: raw}}})
    status = scene.status_where("status flags the report",
                                lambda s: node_entry(s).get("reason") == "ReportMalformed")
    assert detail in node_entry(status)["message"]
    assert condition(status, "Degraded") == ("True", "ReportMalformed")
    (event,) = eventually("a ReportMalformed event",
                          lambda: api.events(ns, name, "ReportMalformed"))
    assert event.type == "Warning" and pod.spec.node_name in event.message
    operator.check_running()

    # The real daemon's next report replaces the bad one.
    scene.start_daemon()
    scene.status_where("the node is verified", lambda s: s.get("readyNodes") == 1)


def test_unrenderable_spec_is_reported_not_crashed(scene: Scene, api: Api,
                                                   operator: OperatorProcess) -> None:
    ns, name = scene.namespace, scene.name
    doc = weightcache(ns, name, scene.node)
    del doc["spec"]["sidecar"]["image"]  # and the operator runs without a default image
    apply(scene.cluster, doc)
    status = scene.status_where("the cache reports the render error",
                                lambda s: s.get("phase") == "Error")
    assert condition(status, "Degraded") == ("True", "RenderFailed")
    assert "spec.sidecar.image" in next(
        c["message"] for c in status["conditions"] if c["type"] == "Degraded")
    assert api.daemonset(ns, name) is None
    assert eventually("a RenderFailed event", lambda: api.events(ns, name, "RenderFailed"))
    operator.check_running()

    scene.apply_cache()
    eventually("the DaemonSet appears once the spec is fixed",
               lambda: api.daemonset(ns, name))
    scene.status_where("the error clears", lambda s: s.get("phase") in ("Loading", "Pending"))
