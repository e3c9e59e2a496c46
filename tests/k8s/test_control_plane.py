"""Acceptance smoke test of the local control plane: each piece is the real one.

Waits poll for a state with a generous bound; nothing asserts on time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from tests.k8s.operator_flow import eventually
from tools.testenv.assets import K8S_VERSION
from tools.testenv.cluster import Cluster
from tools.testenv.procs import group_alive, port_is_listening

pytestmark = pytest.mark.k8s

GATE = "weightcache.dev/weights-resident"
REPO_ROOT = Path(__file__).resolve().parents[2]


def condition(pod: k8s.V1Pod, kind: str) -> k8s.V1PodCondition | None:
    return next((c for c in pod.status.conditions or [] if c.type == kind), None)


def test_kubectl_and_helm_talk_to_the_pinned_apiserver(cluster: Cluster) -> None:
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == K8S_VERSION
    assert json.loads(cluster.helm("list", "--all-namespaces", "-o", "json").stdout) == []


def test_crd_structural_schema_rejects_invalid_object(
    cluster: Cluster, k8s_api: k8s.ApiClient, namespace: str
) -> None:
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.testenv.weightcache.dev"},
        "spec": {
            "group": "testenv.weightcache.dev",
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "required": ["replicas"],
                                    "properties": {"replicas": {"type": "integer", "minimum": 1}},
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(crd))
    cluster.kubectl("wait", "--for=condition=Established", "crd/widgets.testenv.weightcache.dev")
    objects = k8s.CustomObjectsApi(k8s_api)

    def create(spec: dict[str, Any]) -> Any:
        body = {
            "apiVersion": "testenv.weightcache.dev/v1",
            "kind": "Widget",
            "metadata": {"generateName": "w-"},
            "spec": spec,
        }
        return objects.create_namespaced_custom_object(
            "testenv.weightcache.dev", "v1", namespace, "widgets", body
        )

    def served() -> bool:
        try:
            create({"replicas": 1})
        except ApiException as e:
            if e.status == 404:  # established, but the REST handler is not installed yet
                return False
            raise
        return True

    eventually("the Widget resource accepts a valid object", served)
    with pytest.raises(ApiException) as rejected:
        create({"replicas": 0})
    assert rejected.value.status == 422
    message = json.loads(rejected.value.body)["message"]
    expected = "spec.replicas in body should be greater than or equal to 1"
    assert f"spec.replicas: Invalid value: 0: {expected}" in message
    with pytest.raises(ApiException) as missing:
        create({})
    assert "spec.replicas: Required value" in json.loads(missing.value.body)["message"]


def test_deployment_rolls_onto_kwok_gpu_nodes_and_is_garbage_collected(
    cluster: Cluster, k8s_api: k8s.ApiClient, namespace: str
) -> None:
    apps, core = k8s.AppsV1Api(k8s_api), k8s.CoreV1Api(k8s_api)
    labels = {"app": "engine"}
    deployment = k8s.V1Deployment(
        metadata=k8s.V1ObjectMeta(name="engine"),
        spec=k8s.V1DeploymentSpec(
            replicas=2,
            selector=k8s.V1LabelSelector(match_labels=labels),
            template=k8s.V1PodTemplateSpec(
                metadata=k8s.V1ObjectMeta(labels=labels),
                spec=k8s.V1PodSpec(
                    node_selector={"nvidia.com/gpu.present": "true"},
                    containers=[
                        k8s.V1Container(
                            name="engine",
                            image="registry.invalid/engine:1",
                            resources=k8s.V1ResourceRequirements(limits={"nvidia.com/gpu": "8"}),
                        )
                    ],
                ),
            ),
        ),
    )
    apps.create_namespaced_deployment(namespace, deployment)
    eventually(
        "Deployment engine has 2 ready replicas",
        lambda: (
            (apps.read_namespaced_deployment_status("engine", namespace).status.ready_replicas or 0)
            == 2
        ),
    )
    (replica_set,) = apps.list_namespaced_replica_set(namespace, label_selector="app=engine").items
    assert replica_set.metadata.owner_references[0].kind == "Deployment"
    pods = core.list_namespaced_pod(namespace, label_selector="app=engine").items
    assert len(pods) == 2
    for pod in pods:
        assert pod.metadata.owner_references[0].name == replica_set.metadata.name
        assert pod.status.phase == "Running"
        assert condition(pod, "Ready").status == "True"
    # Each pod asks for all 8 GPUs of a node, so the scheduler must use two nodes.
    assert sorted(p.spec.node_name for p in pods) == sorted(cluster.node_names[:2])

    apps.delete_namespaced_deployment("engine", namespace)
    eventually(
        "the garbage collector removed the ReplicaSet and its pods",
        lambda: (
            not apps.list_namespaced_replica_set(namespace).items
            and not core.list_namespaced_pod(namespace).items
        ),
    )


def test_readiness_gate_holds_pod_until_pods_status_is_patched(
    k8s_api: k8s.ApiClient, namespace: str
) -> None:
    core = k8s.CoreV1Api(k8s_api)
    pod = k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name="gated"),
        spec=k8s.V1PodSpec(
            readiness_gates=[k8s.V1PodReadinessGate(condition_type=GATE)],
            containers=[k8s.V1Container(name="engine", image="registry.invalid/engine:1")],
        ),
    )
    core.create_namespaced_pod(namespace, pod)

    def read() -> k8s.V1Pod:
        return core.read_namespaced_pod_status("gated", namespace)

    def set_gate(status: str) -> None:
        body = {
            "status": {
                "conditions": [
                    {
                        "type": GATE,
                        "status": status,
                        "reason": "Test",
                        "lastTransitionTime": k8s_now(),
                    }
                ]
            }
        }
        core.patch_namespaced_pod_status(
            "gated", namespace, body, _content_type="application/strategic-merge-patch+json"
        )

    running = eventually(
        "kwok ran the gated pod and marked it not Ready",
        lambda: (p := read()).status.phase == "Running" and condition(p, "Ready") and p,
    )
    assert condition(running, "ContainersReady").status == "True"
    ready = condition(running, "Ready")
    assert (ready.status, ready.reason) == ("False", "ReadinessGatesNotReady")
    assert condition(running, GATE) is None  # kwok must not invent the gate's condition

    def ready_is(status: str) -> k8s.V1Pod | None:
        pod = read()
        return pod if condition(pod, "Ready").status == status else None

    set_gate("True")
    became_ready = eventually("Ready after the gate was patched True", lambda: ready_is("True"))
    # kwok recomputed Ready without clobbering the condition another client owns.
    assert condition(became_ready, GATE).status == "True"
    assert condition(became_ready, GATE).reason == "Test"

    set_gate("False")
    eventually("not Ready after the gate was patched back to False", lambda: ready_is("False"))


def test_a_status_patch_naming_another_uid_is_refused(
    k8s_api: k8s.ApiClient, namespace: str
) -> None:
    """The operator closes an unwatched pod's gate by name and uid (kube.set_pod_condition):
    a newer pod of that name (a StatefulSet's) must refuse the patch, since a uid cannot
    change."""
    core = k8s.CoreV1Api(k8s_api)
    spec = {"containers": [{"name": "engine", "image": "registry.invalid/engine:1"}]}
    old = core.create_namespaced_pod(namespace, {"metadata": {"name": "reused"}, "spec": spec})
    core.delete_namespaced_pod("reused", namespace, grace_period_seconds=0)
    eventually("the first pod is gone", lambda: not [
        p for p in core.list_namespaced_pod(namespace).items if p.metadata.name == "reused"])
    core.create_namespaced_pod(namespace, {"metadata": {"name": "reused"}, "spec": spec})
    patch = {"metadata": {"uid": old.metadata.uid}, "status": {"conditions": [
        {"type": GATE, "status": "False", "reason": "Test", "lastTransitionTime": k8s_now()}]}}
    with pytest.raises(ApiException) as refused:
        core.patch_namespaced_pod_status(
            "reused", namespace, patch,
            _content_type="application/strategic-merge-patch+json")
    assert refused.value.status in (409, 422), refused.value.body
    assert condition(core.read_namespaced_pod_status("reused", namespace), GATE) is None
    # The pod's own uid: applied.
    patch["metadata"]["uid"] = core.read_namespaced_pod("reused", namespace).metadata.uid
    core.patch_namespaced_pod_status("reused", namespace, patch,
                                     _content_type="application/strategic-merge-patch+json")
    assert condition(core.read_namespaced_pod_status("reused", namespace), GATE).reason == "Test"


def k8s_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def test_service_account_without_role_binding_is_forbidden(
    cluster: Cluster, namespace: str
) -> None:
    cluster.kubectl("create", "serviceaccount", "reader", "-n", namespace)
    config = cluster.service_account_kubeconfig(namespace, "reader")
    whoami = json.loads(
        cluster.kubectl("auth", "whoami", "-o", "json", kubeconfig_path=config).stdout
    )
    assert whoami["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:reader"

    denied = cluster.kubectl("get", "pods", "-n", namespace, kubeconfig_path=config, check=False)
    assert denied.returncode != 0
    assert (
        f'User "system:serviceaccount:{namespace}:reader" cannot list resource "pods"'
        in denied.stderr
    ), denied.stderr
    assert "Forbidden" in denied.stderr

    # The same token is allowed once RBAC says so: the denial above was RBAC's.
    cluster.kubectl(
        "create", "role", "pod-reader", "--verb=list", "--resource=pods", "-n", namespace
    )
    cluster.kubectl(
        "create",
        "rolebinding",
        "reader",
        "--role=pod-reader",
        f"--serviceaccount={namespace}:reader",
        "-n",
        namespace,
    )
    eventually(
        "the RoleBinding lets the ServiceAccount list pods",
        lambda: (
            cluster.kubectl(
                "get", "pods", "-n", namespace, kubeconfig_path=config, check=False
            ).returncode
            == 0
        ),
    )


_OWNER = """
import json, sys, time
from pathlib import Path
from tools.testenv import assets
from tools.testenv.cluster import Cluster
c = Cluster(Path(sys.argv[1]), assets.ensure_binaries(), node_count=1)
c.start()
print(json.dumps({"pgid": c.group.pgid, "ports": list(c.endpoint().ports.values())}), flush=True)
time.sleep(3600)
"""


def test_sigkilled_owner_leaves_no_process_and_no_listening_port(
    cluster: Cluster, tmp_path: Path
) -> None:
    # Needs `cluster` only so the binaries exist; this starts a second, independent plane.
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(tmp_path / "plane")],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        started = json.loads(owner.stdout.readline())
        assert group_alive(started["pgid"])
        assert all(port_is_listening(p) for p in started["ports"])
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    eventually(
        "the orphaned components died with their owner", lambda: not group_alive(started["pgid"])
    )
    left = [p for p in started["ports"] if port_is_listening(p)]
    assert not left, subprocess.run(
        ["ss", "-tanp"], capture_output=True, text=True
    ).stdout + json.dumps(started)


def test_cli_up_env_down_leaves_nothing_behind(cluster: Cluster) -> None:
    # Needs `cluster` only so the binaries exist; `up` starts its own plane.
    name = f"test-{os.getpid()}"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tools.testenv", *args, "--name", name],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )

    try:
        up = cli("up", "--nodes", "1")
        assert up.returncode == 0, up.stderr
        exports = dict(
            line.removeprefix("export ").split("=", 1) for line in up.stdout.splitlines()
        )
        kubeconfig = Path(exports["KUBECONFIG"])
        assert cli("env").stdout == up.stdout
        state = json.loads((kubeconfig.parent.parent / "state.json").read_text())
        nodes = cluster.kubectl("get", "nodes", "-o", "name", kubeconfig_path=kubeconfig)
        assert nodes.stdout.split() == ["node/kwok-gpu-0"]
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stderr
    assert not group_alive(state["pgid"])
    assert not [p for p in state["ports"].values() if port_is_listening(p)]
    assert cli("env").returncode != 0
