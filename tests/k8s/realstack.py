"""The weightcache stack on the real node, for tests that run it end to end.

The chart installs the operator as its Deployment (the operator image built
from operator/Dockerfile, under the chart's ServiceAccount); a CPU WeightCache
(memfd, the MiniLM checkpoint on a host path) makes the operator run a real
daemon pod from sidecar/Dockerfile's image; engine pods from
examples/minilm-engine.Dockerfile attach over the hostPath socket and compare
their embeddings with a plain load, bit for bit. `installed()` sets it all up
once per test module and removes it afterwards; `Stack` is what tests read and
change through. Waits poll with bounds; nothing asserts on time.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client as k8s

from tests.k8s.operator_flow import CPU_EXAMPLE, Api, eventually, is_ready, minilm_dir
from tools import engine_pod
from tools.testenv.cluster import Cluster
from weightcache.report import DeviceReport, decode_pod_reports, report_annotations
from weightcache_operator import render

CACHE = "minilm"
ENGINE = "minilm-engine"
RELEASE = "weightcache"
SYSTEM_NS = "weightcache-system"


def tenant_pod(name: str, image: str, node: str, command: list[str],
               host_network: bool = False) -> dict[str, Any]:  # fmt: skip
    """A pod as any tenant may run one on ``node``: non-root, the restricted profile."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "hostNetwork": host_network,
            "restartPolicy": "Never",
            "nodeSelector": {"kubernetes.io/hostname": node},
            "securityContext": {"runAsNonRoot": True, "runAsUser": 4242, "runAsGroup": 4242,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": name, "image": image, "imagePullPolicy": "Never", "command": command,
                "securityContext": {"allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}},
            }],
        },
    }  # fmt: skip


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
    # The cache's engine selector; every engine Deployment's pods carry these labels.
    engine_labels: dict[str, str] = field(default_factory=lambda: {"app": ENGINE})
    # What the deployment saw: (daemon reported ready, engine pod ready) per poll.
    samples: list[tuple[bool, bool]] = field(default_factory=list)

    @property
    def node(self) -> str:
        return self.cluster.real_node_name

    @property
    def cache_dir(self) -> Path:
        """The cache's socket directory on the node."""
        return self.socket_root / f"{self.namespace}.{CACHE}"

    def kubectl(self, *args: str, input: str | None = None) -> str:
        return self.cluster.kubectl(*args, input=input).stdout

    def apply(self, *docs: dict[str, Any]) -> None:
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                     input=yaml.safe_dump_all(docs))

    def daemon_pod(self) -> k8s.V1Pod | None:
        pods = [p for p in self.api.daemon_pods(self.namespace, CACHE)
                if p.metadata.deletion_timestamp is None]
        return pods[0] if len(pods) == 1 else None

    def daemon_gid(self) -> int:
        ds = eventually("the operator's DaemonSet",
                        lambda: self.api.daemonset(self.namespace, CACHE))
        return ds.spec.template.spec.security_context.run_as_group

    def daemon_status(self, pod: k8s.V1Pod) -> dict[str, Any]:
        """The daemon's status over its Unix socket (`weightcache-sidecar status`, run in the
        daemon's container; no port serves it): the whole status, load reason and warnings
        included."""
        return json.loads(self.kubectl(
            "exec", "-n", pod.metadata.namespace, pod.metadata.name, "-c", "daemon", "--",
            "weightcache-sidecar", "status", "--socket-path-file", render.socket_path_file(0)))

    def daemon_reported_ready(self) -> bool:
        pod = self.daemon_pod()
        return pod is not None and any(r.state == "Ready" for r in reports_of(pod).values())

    def logs(self, pod: str, container: str, previous: bool = False) -> list[dict[str, Any]]:
        """The JSON lines an engine pod's container printed (of its previous run with
        `previous`)."""
        args = ["logs", "-n", self.namespace, pod, "-c", container]
        text = self.kubectl(*args, *(["--previous"] if previous else []))
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

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
        """Engine pods that are not being deleted."""
        selector = ",".join(f"{k}={v}" for k, v in self.engine_labels.items())
        return [p for p in self.api.core.list_namespaced_pod(
            self.namespace, label_selector=selector).items
            if p.metadata.deletion_timestamp is None]

    def rolled_out(self, name: str = ENGINE) -> bool:
        d = self.api.apps.read_namespaced_deployment(name, self.namespace)
        s = d.status
        return bool(s.observed_generation == d.metadata.generation
                    and s.replicas == d.spec.replicas
                    and s.updated_replicas == d.spec.replicas
                    and s.available_replicas == d.spec.replicas
                    and not s.unavailable_replicas)

    def diagnose(self) -> str:
        """What the engines' and daemons' pods are waiting on, their warnings, and the
        daemon's last log lines."""
        pods = "".join(self.kubectl("get", "pods", "-n", ns, "-o", "wide")
                       for ns in (self.namespace, SYSTEM_NS))
        events = [f"{e.involved_object.name}: {e.reason}: {e.message}"
                  for ns in (self.namespace, SYSTEM_NS)
                  for e in self.api.core.list_namespaced_event(ns).items
                  if e.type == "Warning"]
        ended = [f"{p.metadata.name}/{s.name} last ended: {t.reason} (exit {t.exit_code}) "
                 f"at {t.finished_at}"
                 for ns in (self.namespace, SYSTEM_NS)
                 for p in self.api.core.list_namespaced_pod(ns).items
                 for s in p.status.container_statuses or []
                 if s.last_state and (t := s.last_state.terminated)]
        logs = []
        pod = self.daemon_pod()
        if pod is not None:
            logs = [self.cluster.kubectl("logs", "-n", SYSTEM_NS, pod.metadata.name, "-c", c,
                                         "--tail=20", check=False).stdout
                    for c in ("socket-dir", "daemon")]
            restarted = any(s.restart_count for s in pod.status.container_statuses or []
                            if s.name == "daemon")
            if restarted:  # why the last one ended, in its own words
                logs.append("the daemon container's previous run:\n" + self.cluster.kubectl(
                    "logs", "-n", SYSTEM_NS, pod.metadata.name, "-c", "daemon", "--previous",
                    "--tail=30", check=False).stdout)
        return pods + "\n".join(ended + events[-20:] + logs)

    def steady(self, deployments: tuple[str, ...] = (ENGINE,)) -> None:
        """Wait until the daemon reports ready and the engine Deployments are fully available
        (the previous test may have left the gate closing or reopening)."""
        eventually("the daemon ready and the engines available", lambda: (
            self.daemon_reported_ready() and all(map(self.rolled_out, deployments))
            and all(map(is_ready, self.engine_pods()))), bound=300)

    def ready_engine(self, version: str, name: str = ENGINE) -> k8s.V1Pod | None:
        pods = [p for p in self.engine_pods() if p.metadata.labels.get("version") == version
                and p.metadata.labels.get("app") == name]
        if len(pods) == 1 and is_ready(pods[0]) and self.rolled_out(name):
            return pods[0]
        return None

    def engine_deployment(self, version: str, daemon_gid: int, name: str = ENGINE,
                          **extra: Any) -> dict[str, Any]:
        return engine_pod.engine_deployment(
            namespace=self.namespace, name=name, cache=CACHE, image=self.refs["minilm-engine"],
            node=self.node, socket_root=self.socket_root, model_dir=minilm_dir(),
            version=version, daemon_gid=daemon_gid, labels=self.engine_labels, **extra)


def weightcache(stack: Stack, sidecar: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The committed CPU example on the real node; `sidecar` overrides spec.sidecar fields."""
    doc = yaml.safe_load(CPU_EXAMPLE.read_text())
    doc["metadata"] = {"name": CACHE, "namespace": stack.namespace}
    spec = doc["spec"]
    spec["model"]["path"] = str(minilm_dir())
    spec["socketDir"] = str(stack.socket_root)
    spec["placement"] = {"nodeSelector": {"kubernetes.io/hostname": stack.node}}
    spec["sidecar"].pop("image")  # the chart's sidecar image
    spec["sidecar"]["imagePullPolicy"] = "Never"
    spec["sidecar"].update(sidecar or {})
    spec["engine"]["selector"] = {"matchLabels": dict(stack.engine_labels)}
    return doc


@contextlib.contextmanager
def installed(cluster: Cluster, api: Api, refs: dict[str, str], work: Path,
              socket_root: Path | None = None, **stack_fields: Any) -> Iterator[Stack]:
    """The chart installed in a fresh namespace; removed (with the socket root, when it
    made one) afterwards."""
    namespace = f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", namespace)
    # Short: the daemon's socket path inside its pod is fixed, but hostPath names are ours.
    made_root = socket_root is None
    root = Path(tempfile.mkdtemp(prefix="wc-sockets-", dir="/tmp")) if made_root else socket_root
    stack = Stack(cluster, api, namespace, root, refs, **stack_fields)
    operator_repo, operator_tag = split_ref(refs["operator"])
    sidecar_repo, sidecar_tag = split_ref(refs["sidecar"])
    values = work / "values.yaml"
    values.write_text(yaml.safe_dump({
        "image": {"repository": operator_repo, "tag": operator_tag, "pullPolicy": "Never"},
        "sidecarImage": {"repository": sidecar_repo, "tag": sidecar_tag},
        "nodeSelector": {"kubernetes.io/hostname": cluster.real_node_name},
        # The hostPath fallback, without the webhook and the CSI driver
        # (tests/k8s/test_real_csi.py runs those).
        "webhook": {"enabled": False},
        "csi": {"enabled": False},
        "sweeper": {"nodeSelector": {"kubernetes.io/hostname": cluster.real_node_name}},
        # The cache policy admits exactly this run's socket root and the checkpoint's directory.
        "cachePolicy": {"allowedHostPaths": {"socketDirs": [str(root)],
                                             "modelDirs": [str(minilm_dir())]}},
    }))
    chart = Path(__file__).resolve().parents[2] / "charts" / "weightcache-operator"
    try:
        cluster.helm("install", RELEASE, str(chart), "--namespace", SYSTEM_NS,
                     "--create-namespace", "--values", str(values))
        eventually("the operator's Deployment available", lambda: stack.api.apps
                   .read_namespaced_deployment(f"{RELEASE}-weightcache-operator", SYSTEM_NS)
                   .status.available_replicas, bound=300)
        yield stack
    finally:
        cluster.kubectl("delete", "wc", "-n", namespace, CACHE, "--ignore-not-found",
                        "--wait=true", "--timeout=120s")
        cluster.helm("uninstall", RELEASE, "--namespace", SYSTEM_NS, "--wait", check=False)
        cluster.kubectl("delete", "namespace", namespace, SYSTEM_NS, "--wait=true",
                        "--timeout=120s", "--ignore-not-found")
        if made_root:
            shutil.rmtree(root, ignore_errors=True)


def deploy(stack: Stack, sidecar: Mapping[str, Any] | None = None,
           deployments: tuple[str, ...] = (ENGINE,)) -> None:
    """Apply the WeightCache and the engine Deployments; record, until they have rolled
    out, whether an engine was ever ready before the daemon reported ready."""
    stack.apply(weightcache(stack, sidecar))
    daemon_gid = stack.daemon_gid()
    stack.apply(*(stack.engine_deployment("v1", daemon_gid, name) for name in deployments))

    def done() -> bool:
        engines = stack.engine_pods()
        stack.samples.append((stack.daemon_reported_ready(), any(map(is_ready, engines))))
        return all(stack.ready_engine("v1", name) is not None for name in deployments)

    try:
        eventually("the engines roll out once the daemon reports", done, bound=600)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{stack.diagnose()}") from None
