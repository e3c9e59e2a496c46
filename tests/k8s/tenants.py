"""Issue 43's tenant on the real node: what it does, and what the tests read while it does it.

A tenant that may create (and, for some attacks, patch) pods in its own
namespace, and nothing else, floods gated pods past the limits of what the
operator keeps, or churns gated pods' labels; meanwhile another tenant's
labelled pod must be admitted and gated as usual, and the operator's process
must stay under its memory limit without a restart. The operator's memory is
read from its process (/proc: resident and peak resident) and its container's
cgroup (memory.current, memory.peak, memory.max, the OOM-kill count), found
through containerd as the node runs it.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from tests.k8s.operator_flow import eventually, gate_of, is_ready, oversized_labels
from tests.k8s.realstack import CACHE, Stack
from weightcache_operator import names

SYSTEM_NS = "weightcache-system"
OPERATOR_COMPONENT = "app.kubernetes.io/component=operator"
THREADS = 8


def tenant_api(stack: Stack, namespace: str, verbs: list[str]) -> k8s.CoreV1Api:
    """A client for an account that may do `verbs` on pods in `namespace`, nothing else."""
    account = f"tenant-{'-'.join(verbs)}"
    stack.apply(
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": account, "namespace": namespace}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": account, "namespace": namespace},
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": verbs}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": account, "namespace": namespace},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
         "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]},
    )
    path = stack.cluster.service_account_kubeconfig(namespace, account)
    configuration = k8s.Configuration()
    k8s_config.load_kube_config(config_file=str(path), client_configuration=configuration)
    configuration.connection_pool_maxsize = THREADS * 2
    return k8s.CoreV1Api(k8s.ApiClient(configuration))


def gated_pod(namespace: str, name: str, labels: dict[str, str] | None = None,
              annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A pod listing the gate that no node will take (Pending), as the review's tenant made
    them; restricted-compliant."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels or {}}
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {
        "nodeSelector": {"weightcache.dev/no-such-node": "anywhere"},
        "readinessGates": [{"conditionType": names.GATE_CONDITION}],
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{"name": "c", "image": "registry.invalid/never:1",
                        "securityContext": {"allowPrivilegeEscalation": False,
                                            "capabilities": {"drop": ["ALL"]}}}]}}


def oversized(tag: str = "") -> tuple[dict[str, str], dict[str, str]]:
    """The review's ~1.1 MB of metadata: 2,700 labels (~900 KB) and ~200 KB of
    `weights.weightcache.dev/x<i>` annotations."""
    return (oversized_labels(2700, tag),
            {f"{names.BINDING_PREFIX}x{i}": "a" * 1000 for i in range(200)})


def in_parallel(work: Callable[[int], Any], count: int) -> list[Any]:
    """`work(i)` for i < count on THREADS threads; each result, or the exception raised."""
    def guarded(i: int) -> Any:
        try:
            return work(i)
        except Exception as exc:  # noqa: BLE001 - the caller judges each outcome
            return exc

    with ThreadPoolExecutor(THREADS) as pool:
        return list(pool.map(guarded, range(count)))


# --------------------------------------------------------------------------- the operator


def operator_pod(stack: Stack) -> k8s.V1Pod | None:
    pods = [p for p in stack.api.core.list_namespaced_pod(
        SYSTEM_NS, label_selector=OPERATOR_COMPONENT).items
        if p.metadata.deletion_timestamp is None and is_ready(p)]
    return pods[0] if len(pods) == 1 else None


@dataclass(frozen=True)
class Memory:
    """The operator process and its container, at one moment (bytes)."""

    rss: int
    peak_rss: int
    cgroup_current: int
    cgroup_peak: int
    cgroup_max: int
    oom_kills: int

    def mib(self) -> dict[str, float]:
        return {k: round(v / 2**20, 1) for k, v in self.__dict__.items() if k != "oom_kills"}


def operator_memory(stack: Stack, pod: k8s.V1Pod) -> Memory:
    pid = stack.host_pid(pod, "operator")
    status = dict(line.split(":", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    kib = {k: int(status[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}
    return Memory(kib["VmRSS"], kib["VmHWM"], *cgroup_memory(pid))


def cgroup_memory(pid: int) -> tuple[int, int, int, int]:
    """(current, peak, limit, OOM kills) of the process's memory cgroup, v1 or v2."""
    paths = {controllers: path for _, controllers, path in (
        line.split(":", 2) for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines())}
    v1 = next((path for controllers, path in paths.items()
               if "memory" in controllers.split(",")), None)
    if v1 is not None:
        base = Path("/sys/fs/cgroup/memory") / v1.lstrip("/")
        control = dict(x.split() for x in (base / "memory.oom_control").read_text().splitlines())
        return (int((base / "memory.usage_in_bytes").read_text()),
                int((base / "memory.max_usage_in_bytes").read_text()),
                int((base / "memory.limit_in_bytes").read_text()),
                int(control.get("oom_kill", 0)))
    base = Path("/sys/fs/cgroup") / paths[""].lstrip("/")
    events = dict(x.split() for x in (base / "memory.events").read_text().splitlines())
    limit = (base / "memory.max").read_text().strip()
    return (int((base / "memory.current").read_text()), int((base / "memory.peak").read_text()),
            int(limit) if limit != "max" else 0, int(events.get("oom_kill", 0)))


def restarts(pod: k8s.V1Pod) -> int:
    return sum(s.restart_count for s in pod.status.container_statuses or [])


# --------------------------------------------------------------------------- the other tenant


@dataclass
class Admissions:
    """The other tenant's labelled pods: seconds from create to admitted, and to gated."""

    admitted: list[float] = field(default_factory=list)
    gated: list[float] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        return {name: {"n": len(xs), "median_s": round(statistics.median(xs), 3),
                       "max_s": round(max(xs), 3)}
                for name, xs in (("admitted", self.admitted), ("gated", self.gated)) if xs}


def admit_and_gate(stack: Stack, name: str, seen: Admissions, bound: float = 120.0) -> None:
    """Create a labelled pod in the cache's namespace; it must be admitted (injected) and its
    gate opened, within `bound` (a hang guard); the times go to `seen`. Deleted after."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "labels": {names.CACHE_LABEL: CACHE}},
           "spec": {"nodeSelector": {"kubernetes.io/hostname": stack.node},
                    "terminationGracePeriodSeconds": 0,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [{
                        "name": "engine", "image": stack.refs["minilm-engine"],
                        "imagePullPolicy": "Never",
                        "command": ["python", "-c", "import time; time.sleep(3600)"],
                        "securityContext": {"allowPrivilegeEscalation": False,
                                            "capabilities": {"drop": ["ALL"]}}}]}}
    start = time.monotonic()
    created = stack.api.core.create_namespaced_pod(stack.namespace, pod)
    seen.admitted.append(time.monotonic() - start)
    assert created.metadata.labels[names.GATED_LABEL] == names.GATED_VALUE
    try:
        eventually(f"{name} is gated open", lambda: gate_of(stack.api.core.read_namespaced_pod(
            name, stack.namespace)) == ("True", "WeightsResident"), bound=bound)
        seen.gated.append(time.monotonic() - start)
    finally:
        stack.api.core.delete_namespaced_pod(name, stack.namespace, grace_period_seconds=0)


def dry_run_admission(stack: Stack) -> float:
    """Seconds the apiserver took to admit (dry run) a labelled pod of the cache's namespace
    through the webhook; AssertionError if it was refused."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": f"probe-{uuid.uuid4().hex[:8]}",
                        "labels": {names.CACHE_LABEL: CACHE}},
           "spec": {"securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [{"name": "c", "image": "registry.invalid/probe:1",
                                    "securityContext": {
                                        "allowPrivilegeEscalation": False,
                                        "capabilities": {"drop": ["ALL"]}}}]}}
    start = time.monotonic()
    stack.api.core.create_namespaced_pod(stack.namespace, pod, dry_run="All")
    return time.monotonic() - start


@contextmanager
def cleaned(api: k8s.CoreV1Api, namespace: str, selector: str) -> Iterator[None]:
    """Delete the pods `selector` matches in `namespace` afterwards, and wait for them."""
    try:
        yield
    finally:
        try:
            api.delete_collection_namespaced_pod(namespace, label_selector=selector,
                                                 grace_period_seconds=0)
        except ApiException:
            pass
        eventually("the tenant's pods are gone", lambda: not api.list_namespaced_pod(
            namespace, label_selector=selector, limit=1).items, bound=300)
