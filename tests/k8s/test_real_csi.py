"""Engine pods in a `restricted` namespace on the real node: one label, the webhook, the CSI driver.

The chart installs everything by default: the operator (serving the webhook
over the chart's Service, reached by the API server at the pod's address, as
kube-proxy would route it), the `weightcache.dev` CSIDriver and its plugin
DaemonSet (privileged, in the chart's namespace, the only one labelled
`privileged`). The registrar beside the plugin is `python -m weightcache_csi
register`: the upstream node-driver-registrar's Go module is not served by the
Go module proxy here (tools/testenv/README.md). The engine namespace enforces
Pod Security `restricted`; the engine Deployment carries the label
`weightcache.dev/cache: minilm`, its image and command, and what `restricted`
demands of any pod. The tests of this module run in order on one installation.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s

from tests.k8s.operator_flow import (
    Api,
    default_service_account,
    eventually,
    gate_of,
    is_ready,
    minilm_dir,
)
from tests.k8s.realstack import CACHE, ENGINE, Stack, split_ref, weightcache
from tools import engine_pod
from tools.testenv import images
from tools.testenv.cluster import Cluster
from weightcache_operator import inject, names

RELEASE = "wc"
SYSTEM_NS = "weightcache-system"
ROLLS = 1
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted"}


def namespace(cluster: Cluster, name: str, labels: dict[str, str]) -> None:
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}))


def engine(stack: Stack, version: str, replicas: int = 1) -> dict[str, Any]:
    return engine_pod.labelled_engine_deployment(
        namespace=stack.namespace, name=ENGINE, cache=CACHE, image=stack.refs["minilm-engine"],
        node=stack.node, version=version, replicas=replicas)


def restricted_pod(namespace: str, name: str, image: str, node: str,
                   **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace,
                                                            **meta},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                     "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                                         "seccompProfile": {"type": "RuntimeDefault"}},
                     "containers": [{"name": "engine", "image": image,
                                     "imagePullPolicy": "Never",
                                     "securityContext": {
                                         "allowPrivilegeEscalation": False,
                                         "capabilities": {"drop": ["ALL"]}}}]}}


def plugin_pod(stack: Stack) -> k8s.V1Pod | None:
    pods = [p for p in stack.api.core.list_namespaced_pod(
        SYSTEM_NS, label_selector="app.kubernetes.io/component=csi").items
        if p.metadata.deletion_timestamp is None and is_ready(p)]
    return pods[0] if len(pods) == 1 else None


def registered(cluster: Cluster, node: str) -> bool:
    csinode = json.loads(cluster.kubectl("get", "csinode", node, "-o", "json",
                                         check=False).stdout or "{}")
    return any(d["name"] == "weightcache.dev" for d in csinode.get("spec", {}).get(
        "drivers") or [])


@pytest.fixture(scope="module")
def stack(real_cluster: Cluster, real_api: k8s.ApiClient, node_images: images.ImageSet,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    assert real_cluster.node is not None and real_cluster.node.layout is not None
    ns = f"restricted-{uuid.uuid4().hex[:6]}"
    namespace(real_cluster, ns, RESTRICTED)
    namespace(real_cluster, SYSTEM_NS, {"pod-security.kubernetes.io/enforce": "privileged"})
    socket_root = Path(tempfile.mkdtemp(prefix="wc-sockets-", dir="/tmp"))
    stack = Stack(real_cluster, Api(real_api), ns, socket_root, node_images.refs)
    operator_repo, operator_tag = split_ref(node_images.refs["operator"])
    sidecar_repo, sidecar_tag = split_ref(node_images.refs["sidecar"])
    node = {"kubernetes.io/hostname": real_cluster.real_node_name}
    values = tmp_path_factory.mktemp("chart") / "values.yaml"
    values.write_text(yaml.safe_dump({
        "image": {"repository": operator_repo, "tag": operator_tag, "pullPolicy": "Never"},
        "sidecarImage": {"repository": sidecar_repo, "tag": sidecar_tag},
        "nodeSelector": node,
        "csi": {"kubeletRootDir": str(real_cluster.node.layout.kubelet_root),
                "nodeSelector": node,
                "registrar": {"image": {"repository": operator_repo, "tag": operator_tag,
                                        "pullPolicy": "Never"},
                              "command": ["python", "-m", "weightcache_csi", "register"]}},
        "cachePolicy": {"allowedHostPaths": {"socketDirs": [str(socket_root)],
                                             "modelDirs": [str(minilm_dir())]}},
    }))
    chart = Path(__file__).resolve().parents[2] / "charts" / "weightcache-operator"
    try:
        real_cluster.helm("install", RELEASE, str(chart), "--namespace", SYSTEM_NS,
                          "--values", str(values))
        eventually("the operator's Deployment available", lambda: stack.api.apps
                   .read_namespaced_deployment(f"{RELEASE}-weightcache-operator", SYSTEM_NS)
                   .status.available_replicas, bound=300)
        eventually("the CSI plugin registered with kubelet",
                   lambda: plugin_pod(stack) and registered(real_cluster, stack.node), bound=300)
        stack.apply(weightcache(stack))
        stack.apply(engine(stack, "v1"))

        def done() -> bool:
            stack.samples.append((stack.daemon_reported_ready(),
                                  any(map(is_ready, stack.engine_pods()))))
            return stack.ready_engine("v1") is not None

        try:
            eventually("the one-label engine rolls out once the daemon reports", done, bound=600)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{stack.diagnose()}") from None
        yield stack
    finally:
        # Engine pods first, while the CSI plugin is there to unmount their volumes: a pod
        # whose driver is gone cannot finish terminating.
        real_cluster.kubectl("delete", "deployment", "-n", ns, ENGINE, "--ignore-not-found",
                             "--wait=true", "--timeout=100s", check=False)
        try:
            eventually("the engine pods are gone", lambda: not stack.api.core
                       .list_namespaced_pod(ns).items, bound=180)
        finally:
            real_cluster.kubectl("delete", "wc", "-n", ns, CACHE, "--ignore-not-found",
                                 "--wait=true", "--timeout=100s", check=False)
            real_cluster.helm("uninstall", RELEASE, "--namespace", SYSTEM_NS, "--wait",
                              check=False)
            # Waited for: the next module installs the chart into the same system
            # namespace, which helm refuses while it is still terminating.
            real_cluster.kubectl("delete", "namespace", ns, SYSTEM_NS, "--wait=true",
                                 "--timeout=120s", "--ignore-not-found", check=False)
            shutil.rmtree(socket_root, ignore_errors=True)


def attached(stack: Stack, pod: k8s.V1Pod) -> dict[str, Any]:
    return next(e for e in stack.logs(pod.metadata.name, "engine") if e["event"] == "attached")


def test_a_one_label_deployment_in_a_restricted_namespace_is_gated_and_rolls_resident(
    stack: Stack,
) -> None:
    assert stack.samples and not any(e and not d for d, e in stack.samples), stack.samples
    daemon = stack.daemon_pod()
    assert daemon is not None and daemon.metadata.namespace == SYSTEM_NS
    pid = stack.host_pid(daemon, "daemon")
    (pod,) = stack.engine_pods()
    # Only the webhook gave it the gate, the CSI volume (no hostPath), the group.
    assert [g.condition_type for g in pod.spec.readiness_gates] == [names.GATE_CONDITION]
    assert all(v.host_path is None for v in pod.spec.volumes)
    (volume,) = [v for v in pod.spec.volumes if v.name == inject.VOLUME]
    assert volume.csi.driver == "weightcache.dev"
    assert gate_of(pod) == ("True", "WeightsResident")
    first = attached(stack, pod)
    assert first["bit_equal"] is True and first["transport"] == "memfd"
    assert first["uid"] == engine_pod.ENGINE_UID != first["daemon_uid"]
    for roll in range(1, ROLLS + 1):
        version = f"roll-{roll}"
        stack.apply(engine(stack, version))
        new = eventually(f"rollout {version}", lambda v=version: stack.ready_engine(v),
                         bound=300)
        assert attached(stack, new)["bit_equal"] is True
    after = stack.daemon_pod()
    assert after is not None and after.metadata.uid == daemon.metadata.uid
    assert stack.host_pid(after, "daemon") == pid
    loads = [line for line in stack.kubectl("logs", "-n", SYSTEM_NS, after.metadata.name,
                                             "-c", "daemon").splitlines()
             if "loading from disk" in line]
    assert len(loads) == 1, loads


def test_another_namespace_reaches_no_socket_through_the_webhook_nor_by_hand(
    stack: Stack,
) -> None:
    other = f"intruder-{uuid.uuid4().hex[:6]}"
    namespace(stack.cluster, other, RESTRICTED)
    image = stack.refs["minilm-engine"]
    try:
        default_service_account(stack.api, other)
        labelled = restricted_pod(other, "labelled", image, stack.node,
                                  labels={names.CACHE_LABEL: CACHE},
                                  annotations={names.CACHE_NAMESPACE_LABEL: stack.namespace})
        refused = stack.cluster.kubectl("create", "-f", "-", input=json.dumps(labelled),
                                        check=False)
        assert refused.returncode != 0
        assert (f"namespace {other} may not use WeightCache {stack.namespace}/{CACHE}"
                in refused.stderr), refused.stderr
        # The same volume written by hand, no label, no webhook: the plugin refuses it.
        by_hand = restricted_pod(other, "by-hand", image, stack.node)
        by_hand["spec"]["volumes"] = [{"name": "sockets", "csi": {
            "driver": "weightcache.dev",
            "volumeAttributes": {"cache": f"{stack.namespace}/{CACHE}"}}}]
        by_hand["spec"]["containers"][0]["volumeMounts"] = [
            {"name": "sockets", "mountPath": f"/run/wc/{stack.namespace}.{CACHE}"}]
        stack.cluster.kubectl("create", "-f", "-", input=json.dumps(by_hand))
        event = eventually("kubelet's FailedMount event names the refusal", lambda: [
            e for e in stack.api.core.list_namespaced_event(other).items
            if e.involved_object.name == "by-hand" and e.reason == "FailedMount"
            and "may not use WeightCache" in (e.message or "")])
        assert "PermissionDenied" in event[0].message, event[0].message
        pod = stack.api.core.read_namespaced_pod("by-hand", other)
        assert pod.status.phase == "Pending"
        assert not any(s.state.running for s in pod.status.container_statuses or [])
    finally:
        # The refused pod holds no mount: it goes at once.
        stack.cluster.kubectl("delete", "namespace", other, "--wait=false")


def test_with_the_webhook_down_labelled_pods_are_refused_and_unlabelled_admitted(
    stack: Stack,
) -> None:
    operator = f"{RELEASE}-weightcache-operator"
    image = stack.refs["minilm-engine"]
    stack.kubectl("scale", "deployment", "-n", SYSTEM_NS, operator, "--replicas=0")
    try:
        eventually("the operator pod is gone", lambda: not stack.api.core.list_namespaced_pod(
            SYSTEM_NS, label_selector="app.kubernetes.io/component=operator").items, bound=120)
        labelled = restricted_pod(stack.namespace, "while-down", image, stack.node,
                                  labels={names.CACHE_LABEL: CACHE})
        refused = stack.cluster.kubectl("create", "--dry-run=server", "-f", "-",
                                        input=json.dumps(labelled), check=False)
        assert refused.returncode != 0
        assert "failed calling webhook" in refused.stderr, refused.stderr
        plain = restricted_pod(stack.namespace, "plain", image, stack.node)
        stack.cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(plain))
    finally:
        stack.kubectl("scale", "deployment", "-n", SYSTEM_NS, operator, "--replicas=1")
        eventually("the operator is back", lambda: stack.api.apps.read_namespaced_deployment(
            operator, SYSTEM_NS).status.available_replicas, bound=300)


def test_a_plugin_restart_leaves_serving_engines_alone_and_new_pods_mount(
    stack: Stack,
) -> None:
    stack.steady()
    (serving,) = stack.engine_pods()
    pid = stack.host_pid(serving, "engine")
    before = len([e for e in stack.logs(serving.metadata.name, "engine")
                  if e["event"] == "served"])
    old = plugin_pod(stack)
    assert old is not None
    stack.kubectl("delete", "pod", "-n", SYSTEM_NS, old.metadata.name, "--wait=true")
    eventually("a new plugin pod", lambda: (lambda p: p and p.metadata.uid != old.metadata.uid)(
        plugin_pod(stack)), bound=300)
    served = [e for e in stack.logs(serving.metadata.name, "engine") if e["event"] == "served"]
    assert len(served) > before and all(e["bit_equal"] for e in served)
    assert stack.host_pid(stack.api.core.read_namespaced_pod(
        serving.metadata.name, stack.namespace), "engine") == pid
    stack.apply(engine(stack, "after-plugin-restart"))
    new = eventually("a new engine pod mounts and attaches",
                     lambda: stack.ready_engine("after-plugin-restart"), bound=300)
    assert attached(stack, new)["bit_equal"] is True


def test_deleting_the_cache_removes_its_daemonset_label_and_gates(stack: Stack) -> None:
    stack.steady()
    ds = stack.api.daemonset(stack.namespace, CACHE)
    assert ds is not None and ds.metadata.namespace == SYSTEM_NS
    label = names.node_label_key(stack.namespace, CACHE)
    assert stack.api.node_labels(stack.node).get(label) == "Ready"
    stack.kubectl("delete", "wc", "-n", stack.namespace, CACHE, "--wait=true", "--timeout=120s")
    eventually("the DaemonSet is gone", lambda: stack.api.daemonset(stack.namespace, CACHE)
               is None)
    eventually("the node label is gone", lambda: label not in stack.api.node_labels(stack.node))
    eventually("the gate closes", lambda: all(
        gate_of(p) == ("False", "NoWeightCache") for p in stack.engine_pods()))
