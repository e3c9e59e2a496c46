"""End to end on the real node, the hostPath fallback: every pod here is a real container.

The chart installs the operator as its Deployment (the operator image built
from operator/Dockerfile, under the chart's ServiceAccount); a CPU WeightCache
(memfd, the MiniLM checkpoint on a host path) makes the operator run a real
daemon pod from sidecar/Dockerfile's image; engine pods from
examples/minilm-engine.Dockerfile attach over the hostPath socket and compare
their embeddings with a plain load, bit for bit. The tests of this module run
in order on one installation (rollouts, then a daemon restart, then an operator
crash). Waits poll with bounds; nothing asserts on time.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s

from tests.k8s.operator_flow import CPU_EXAMPLE, Api, eventually, gate_of, is_ready, minilm_dir
from tools import engine_pod
from tools.testenv import images
from tools.testenv.cluster import Cluster
from weightcache.report import DeviceReport, decode_pod_reports, report_annotations
from weightcache_operator import names

CACHE = "minilm"
ENGINE = "minilm-engine"
RELEASE = "weightcache"
SYSTEM_NS = "weightcache-system"
ENGINE_UID = engine_pod.ENGINE_UID
DAEMON_PORT = 8470  # the CRD's default spec.sidecar.httpPort
ROLLS = 3


def reports_of(pod: k8s.V1Pod) -> dict[str, DeviceReport]:
    return decode_pod_reports(report_annotations(pod.metadata.annotations or {}))


def split_ref(ref: str) -> tuple[str, str]:
    repository, _, tag = ref.rpartition(":")
    return repository, tag


@dataclass
class Stack:
    cluster: Cluster
    api: Api
    namespace: str
    socket_root: Path
    refs: dict[str, str]
    # What the deployment saw: (daemon reported ready, engine pod ready) per poll.
    samples: list[tuple[bool, bool]] = field(default_factory=list)

    @property
    def node(self) -> str:
        return self.cluster.real_node_name

    def kubectl(self, *args: str, input: str | None = None) -> str:
        return self.cluster.kubectl(*args, input=input).stdout

    def apply(self, *docs: dict[str, Any]) -> None:
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                     input=yaml.safe_dump_all(docs))

    def daemon_pod(self) -> k8s.V1Pod | None:
        pods = [p for p in self.api.daemon_pods(self.namespace, CACHE)
                if p.metadata.deletion_timestamp is None]
        return pods[0] if len(pods) == 1 else None

    def daemon_status(self, pod: k8s.V1Pod) -> dict[str, Any]:
        """The daemon's /status through the API server's proxy to the pod."""
        path = (f"/api/v1/namespaces/{pod.metadata.namespace}/pods/{pod.metadata.name}:"
                f"{DAEMON_PORT}"
                "/proxy/status")
        return json.loads(self.kubectl("get", "--raw", path))

    def daemon_reported_ready(self) -> bool:
        pod = self.daemon_pod()
        return pod is not None and any(r.state == "Ready" for r in reports_of(pod).values())

    def logs(self, pod: str, container: str) -> list[dict[str, Any]]:
        """An engine pod's JSON log lines."""
        text = self.kubectl("logs", "-n", self.namespace, pod, "-c", container)
        events = []
        for line in text.splitlines():
            if line.startswith("{"):
                events.append(json.loads(line))
        return events

    def host_pid(self, pod: k8s.V1Pod, container: str) -> int:
        """The container's main process as this machine sees it (containerd's task list)."""
        status = next(s for s in pod.status.container_statuses if s.name == container)
        cid = status.container_id.removeprefix("containerd://")
        node = self.cluster.node
        assert node is not None
        for line in node.ctr("tasks", "list").stdout.decode().splitlines()[1:]:
            task, pid, _ = line.split()
            if task == cid:
                return int(pid)
        raise AssertionError(f"no task for {container} of {pod.metadata.name}")

    def engine_pods(self) -> list[k8s.V1Pod]:
        return self.api.engine_pods(self.namespace, CACHE)

    def rolled_out(self) -> bool:
        d = self.api.apps.read_namespaced_deployment(ENGINE, self.namespace)
        s = d.status
        return bool(s.observed_generation == d.metadata.generation and s.replicas == 1
                    and s.updated_replicas == 1 and s.available_replicas == 1
                    and not s.unavailable_replicas)

    def diagnose(self) -> str:
        """What the namespace's pods are waiting on, and their warnings (for failures)."""
        pods = self.kubectl("get", "pods", "-n", self.namespace, "-o", "wide")
        events = [f"{e.involved_object.name}: {e.reason}: {e.message}"
                  for e in self.api.core.list_namespaced_event(self.namespace).items
                  if e.type == "Warning"]
        return pods + "\n".join(events[-20:])

    def steady(self) -> None:
        """Wait until the daemon reports ready and the engine Deployment is fully available
        (the previous test may have left the gate closing or reopening)."""
        eventually("the daemon ready and the engine available", lambda: self.daemon_reported_ready()
                   and self.rolled_out() and all(map(is_ready, self.engine_pods())), bound=300)

    def ready_engine(self, version: str) -> k8s.V1Pod | None:
        pods = [p for p in self.engine_pods() if p.metadata.labels.get("version") == version]
        if len(pods) == 1 and is_ready(pods[0]) and self.rolled_out():
            return pods[0]
        return None


def weightcache(stack: Stack) -> dict[str, Any]:
    doc = yaml.safe_load(CPU_EXAMPLE.read_text())
    doc["metadata"] = {"name": CACHE, "namespace": stack.namespace}
    spec = doc["spec"]
    spec["model"]["path"] = str(minilm_dir())
    spec["socketDir"] = str(stack.socket_root)
    spec["placement"] = {"nodeSelector": {"kubernetes.io/hostname": stack.node}}
    spec["sidecar"].pop("image")  # the chart's sidecar image
    spec["sidecar"]["imagePullPolicy"] = "Never"
    spec["engine"]["selector"] = {"matchLabels": {"app": ENGINE}}
    return doc


def engine_deployment(stack: Stack, version: str, daemon_gid: int) -> dict[str, Any]:
    return engine_pod.engine_deployment(
        namespace=stack.namespace, name=ENGINE, cache=CACHE, image=stack.refs["minilm-engine"],
        node=stack.node, socket_root=stack.socket_root, model_dir=minilm_dir(), version=version,
        daemon_gid=daemon_gid)


@pytest.fixture(scope="module")
def stack(real_cluster: Cluster, real_api: k8s.ApiClient, node_images: images.ImageSet,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The chart installed, then the WeightCache and the gated engine applied together."""
    namespace = f"e2e-{uuid.uuid4().hex[:8]}"
    real_cluster.kubectl("create", "namespace", namespace)
    # Short: the daemon's socket path inside its pod is fixed, but hostPath names are ours.
    socket_root = Path(tempfile.mkdtemp(prefix="wc-sockets-", dir="/tmp"))
    stack = Stack(real_cluster, Api(real_api), namespace, socket_root, node_images.refs)
    operator_repo, operator_tag = split_ref(node_images.refs["operator"])
    sidecar_repo, sidecar_tag = split_ref(node_images.refs["sidecar"])
    values = tmp_path_factory.mktemp("chart") / "values.yaml"
    values.write_text(yaml.safe_dump({
        "image": {"repository": operator_repo, "tag": operator_tag, "pullPolicy": "Never"},
        "sidecarImage": {"repository": sidecar_repo, "tag": sidecar_tag},
        "nodeSelector": {"kubernetes.io/hostname": real_cluster.real_node_name},
        # The hostPath fallback, without the webhook and the CSI driver
        # (tests/k8s/test_real_csi.py runs those).
        "webhook": {"enabled": False},
        "csi": {"enabled": False},
        # The cache policy admits exactly this run's socket root and the checkpoint's directory.
        "cachePolicy": {"allowedHostPaths": {"socketDirs": [str(socket_root)],
                                             "modelDirs": [str(minilm_dir())]}},
    }))
    chart = Path(__file__).resolve().parents[2] / "charts" / "weightcache-operator"
    try:
        real_cluster.helm("install", RELEASE, str(chart), "--namespace", SYSTEM_NS,
                          "--create-namespace", "--values", str(values))
        eventually("the operator's Deployment available", lambda: stack.api.apps
                   .read_namespaced_deployment(f"{RELEASE}-weightcache-operator", SYSTEM_NS)
                   .status.available_replicas, bound=300)
        deploy(stack)
        yield stack
    finally:
        real_cluster.kubectl("delete", "wc", "-n", namespace, CACHE, "--ignore-not-found",
                             "--wait=true", "--timeout=120s")
        real_cluster.helm("uninstall", RELEASE, "--namespace", SYSTEM_NS, "--wait",
                          check=False)
        real_cluster.kubectl("delete", "namespace", namespace, SYSTEM_NS, "--wait=true",
                             "--timeout=120s", "--ignore-not-found")
        shutil.rmtree(socket_root, ignore_errors=True)


def deploy(stack: Stack) -> None:
    """Apply the WeightCache and the engine; record, until the rollout is done, whether the
    engine was ever ready before the daemon reported ready."""
    stack.apply(weightcache(stack))
    ds = eventually("the operator's DaemonSet", lambda: stack.api.daemonset(stack.namespace, CACHE))
    daemon_gid = ds.spec.template.spec.security_context.run_as_group
    stack.apply(engine_deployment(stack, "v1", daemon_gid))

    def done() -> bool:
        engines = stack.engine_pods()
        stack.samples.append((stack.daemon_reported_ready(), any(map(is_ready, engines))))
        return stack.ready_engine("v1") is not None

    try:
        eventually("the engine rolls out once the daemon reports", done, bound=600)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{stack.diagnose()}") from None


def test_the_operator_runs_as_the_charts_deployment_in_its_own_image(stack: Stack) -> None:
    (pod,) = stack.api.core.list_namespaced_pod(
        SYSTEM_NS, label_selector="app.kubernetes.io/component=operator").items
    assert pod.spec.node_name == stack.node
    assert is_ready(pod)
    (container,) = pod.status.container_statuses
    assert container.image == stack.refs["operator"]
    assert pod.spec.service_account_name == f"{RELEASE}-weightcache-operator"
    uid = stack.kubectl("exec", "-n", SYSTEM_NS, pod.metadata.name, "--",
                        "python", "-c", "import os; print(os.getuid())").strip()
    assert uid == str(pod.spec.security_context.run_as_user)
    # Not the torch image: the operator's has no torch at all.
    missing = stack.cluster.kubectl("exec", "-n", SYSTEM_NS, pod.metadata.name, "--", "python",
                                    "-c", "import torch", check=False)
    assert "No module named 'torch'" in missing.stderr


def test_the_engine_stayed_unready_until_the_daemon_reported_then_rolled_out(
    stack: Stack,
) -> None:
    assert stack.samples, "the deployment was never observed"
    assert not any(engine and not daemon for daemon, engine in stack.samples), stack.samples
    assert any(not daemon for daemon, _ in stack.samples), "the daemon was ready before we looked"
    daemon = stack.daemon_pod()
    assert daemon is not None and daemon.spec.node_name == stack.node
    (container,) = daemon.status.container_statuses
    assert container.image == stack.refs["sidecar"] and container.ready
    status = stack.daemon_status(daemon)
    assert status["state"] == "ready" and status["transport_backend"] == "memfd"
    assert status["load_source"] == "disk"
    wc = stack.api.cache(stack.namespace, CACHE)
    assert wc["status"]["phase"] == "Ready"
    (engine,) = stack.engine_pods()
    assert gate_of(engine)[0] == "True"
    attached = next(e for e in stack.logs(engine.metadata.name, "engine")
                    if e["event"] == "attached")
    assert attached["bit_equal"] is True
    assert attached["transport"] == "memfd"
    assert attached["preloaded_weights_bytes"] == status["preloaded_weights_bytes"]


def test_three_rollouts_attach_bit_equal_while_the_weights_stay_resident(stack: Stack) -> None:
    stack.steady()
    daemon = stack.daemon_pod()
    assert daemon is not None
    pid = stack.host_pid(daemon, "daemon")
    served_before = stack.daemon_status(daemon)["clients_served"]
    daemon_gid = daemon.spec.security_context.run_as_group
    seen = set()
    for roll in range(1, ROLLS + 1):
        version = f"roll-{roll}"
        stack.apply(engine_deployment(stack, version, daemon_gid))
        engine = eventually(f"rollout {version}", lambda v=version: stack.ready_engine(v),
                            bound=300)
        assert engine.metadata.uid not in seen
        seen.add(engine.metadata.uid)
        attached = next(e for e in stack.logs(engine.metadata.name, "engine")
                        if e["event"] == "attached")
        assert attached["bit_equal"] is True, attached
        assert attached["transport"] == "memfd"
        assert attached["uid"] == ENGINE_UID and attached["gid"] == daemon_gid
    after = stack.daemon_pod()
    assert after is not None and after.metadata.uid == daemon.metadata.uid
    (container,) = after.status.container_statuses
    assert container.restart_count == 0
    assert stack.host_pid(after, "daemon") == pid
    status = stack.daemon_status(after)
    assert status["load_source"] == "disk"
    assert status["clients_served"] >= served_before + ROLLS
    loads = [line for line in stack.kubectl("logs", "-n", SYSTEM_NS,
                                             after.metadata.name, "-c", "daemon").splitlines()
             if "loading from disk" in line]
    assert len(loads) == 1, loads


def test_a_deleted_daemon_pod_readopts_from_the_running_engine(stack: Stack) -> None:
    stack.steady()
    old = stack.daemon_pod()
    (engine,) = stack.engine_pods()
    assert old is not None
    engine_pid = stack.host_pid(engine, "engine")
    before = [e for e in stack.logs(engine.metadata.name, "engine") if e["event"] == "served"]
    stack.kubectl("delete", "pod", "-n", SYSTEM_NS, old.metadata.name, "--wait=true")
    gone = len([e for e in stack.logs(engine.metadata.name, "engine")
                if e["event"] == "served"])

    def replacement() -> k8s.V1Pod | None:
        pod = stack.daemon_pod()
        if pod is None or pod.metadata.uid == old.metadata.uid or not is_ready(pod):
            return None
        return pod

    new = eventually("a new daemon pod, ready", replacement, bound=300)
    status = stack.daemon_status(new)
    # /status over HTTP leaves the load reason out (docs/security.md); the source says it.
    assert status["load_source"] == "readopted", status
    assert status["readopted"] is True
    daemon_uid = stack.kubectl("exec", "-n", SYSTEM_NS, new.metadata.name, "-c", "daemon",
                               "--", "python3", "-c", "import os; print(os.getuid())").strip()
    assert int(daemon_uid) != ENGINE_UID
    # The engine kept serving, in the same process, with the same bits.
    (still,) = stack.engine_pods()
    assert still.metadata.uid == engine.metadata.uid
    assert still.status.container_statuses[0].restart_count == 0
    assert stack.host_pid(still, "engine") == engine_pid
    served = [e for e in stack.logs(engine.metadata.name, "engine") if e["event"] == "served"]
    assert all(e["bit_equal"] for e in served)
    assert len(served) > gone >= len(before)
    assert all(r.readopted for r in reports_of(new).values())


def test_a_hostpath_escape_through_socket_dir_is_refused_on_the_real_kubelet(
    stack: Stack, tmp_path: Path,
) -> None:
    """Issue 14's attack: a WeightCache author points socketDir at a directory holding a
    symlink to a host directory, hoping the root set-up step chowns whatever it leads to."""
    stack.steady()
    victim = Path(tempfile.mkdtemp(prefix="wc-victim-", dir="/tmp"))  # stands in for /etc
    (victim / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    before = victim.stat()
    namespace, root = stack.namespace, stack.socket_root
    author = "cache-author"
    stack.apply(
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": author, "namespace": namespace}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": author, "namespace": namespace},
         "rules": [{"apiGroups": [names.GROUP], "resources": [names.PLURAL],
                    "verbs": ["create", "get", "delete"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": author, "namespace": namespace},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": author},
         "subjects": [{"kind": "ServiceAccount", "name": author, "namespace": namespace}]},
    )
    as_author = stack.cluster.service_account_kubeconfig(namespace, author,
                                                         tmp_path / "author.kubeconfig")
    # 1. Through another cache's hand-back directory (where engines may write).
    planted = [root / f"{namespace}.{CACHE}" / "engines" / f"{namespace}.evil",
               root / f"{namespace}.evil"]
    planted[0].symlink_to(victim)
    evil = weightcache(stack)
    evil["metadata"]["name"] = "evil"
    evil["spec"]["engine"]["selector"] = {"matchLabels": {"app": "evil-engine"}}
    evil["spec"]["socketDir"] = str(planted[0].parent)
    refused = stack.cluster.kubectl("create", "-f", "-", input=json.dumps(evil),
                                    kubeconfig_path=as_author, check=False)
    assert refused.returncode != 0
    assert "socketDir" in refused.stderr, refused.stderr
    # 2. A symlink already at an allowed root: admitted, then refused on the node by the
    #    set-up step (O_NOFOLLOW), before any daemon container runs.
    planted[1].symlink_to(victim)
    evil["spec"]["socketDir"] = str(root)
    try:
        stack.cluster.kubectl("create", "-f", "-", input=json.dumps(evil),
                              kubeconfig_path=as_author)

        def refused_on_node() -> str | None:
            pods = stack.api.daemon_pods(namespace, "evil")
            if not pods:
                return None
            logs = stack.cluster.kubectl("logs", "-n", SYSTEM_NS, pods[0].metadata.name,
                                         "-c", "socket-dir", check=False).stdout
            return logs if "refusing to follow" in logs else None

        eventually("the set-up step refuses the symlink", refused_on_node, bound=300)
        (pod,) = stack.api.daemon_pods(namespace, "evil")
        assert all(c.state.running is None for c in pod.status.container_statuses or [])
    finally:
        stack.cluster.kubectl("delete", "wc", "-n", namespace, "evil", "--ignore-not-found",
                              "--wait=true", "--timeout=120s")
        for link in planted:
            link.unlink(missing_ok=True)
    after = victim.stat()
    assert (after.st_uid, after.st_gid, after.st_mode) == (before.st_uid, before.st_gid,
                                                           before.st_mode)
    assert (victim / "passwd").stat().st_uid == 0
    shutil.rmtree(victim)


def test_killing_the_operator_pod_mid_rollout_still_converges(stack: Stack) -> None:
    stack.steady()
    (operator,) = stack.api.core.list_namespaced_pod(
        SYSTEM_NS, label_selector="app.kubernetes.io/component=operator").items
    daemon = stack.daemon_pod()
    assert daemon is not None
    available: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            d = stack.api.apps.read_namespaced_deployment(ENGINE, stack.namespace)
            available.append(d.status.available_replicas or 0)
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        stack.apply(engine_deployment(stack, "after-crash",
                                      daemon.spec.security_context.run_as_group))
        eventually("the new engine pod exists", lambda: any(
            p.metadata.labels.get("version") == "after-crash" for p in stack.engine_pods()))
        stack.kubectl("delete", "pod", "-n", SYSTEM_NS, operator.metadata.name,
                      "--grace-period=0", "--force")
        engine = eventually("the rollout converges without the killed operator",
                            lambda: stack.ready_engine("after-crash"), bound=300)
    finally:
        stop.set()
        watcher.join()
    (replacement,) = [p for p in stack.api.core.list_namespaced_pod(
        SYSTEM_NS, label_selector="app.kubernetes.io/component=operator").items
        if p.metadata.deletion_timestamp is None]
    assert replacement.metadata.uid != operator.metadata.uid
    assert gate_of(engine)[0] == "True"
    assert min(available) >= 1, "an engine was unavailable during the rollout"
