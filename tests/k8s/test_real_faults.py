"""Faults on the real node while engine pods serve requests (issue 27).

One installation (tests/k8s/realstack.py: the chart, a CPU WeightCache whose
socket directory sits on the node's small tmpfs, engine Deployments from
examples/minilm-engine.Dockerfile) and one client (tests/k8s/traffic.py)
sending requests to every engine pod from start to end. Each test injects one
fault the way a platform team meets it, waits for the promised recovery and
checks it: requests sent, failed and wrong; gate transitions; daemon
restarts; the daemon's fds and RSS and the files in the cache's socket
directory before and after. The counts are printed at the end of the module
(`-s`) and recorded in docs/reliability.md. The soak (last) runs a minute
here; `make soak` runs it for 20 minutes and commits the result.

The operator runs beside the node, as a process with the chart's
ServiceAccount and cache policy (as on another node of a real cluster): the
whole-node restart must not take it down with the node. The tests run in
order on the one installation. Waits poll with bounds; nothing asserts on
time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from tests.k8s.operator_flow import Api, OperatorProcess, eventually, gate_of, is_ready
from tests.k8s.realstack import CACHE, RELEASE, SYSTEM_NS, Stack, deploy, installed, reports_of
from tests.k8s.traffic import Traffic, sample
from tools.testenv import images
from tools.testenv.cluster import Cluster
from tools.testenv.node import RealNode
from weightcache.daemon.faults import OOM_TRIGGER_SUFFIX
from weightcache_operator import names
from weightcache_operator.policy import POLICY_ENV

ENGINES = ("engine-a", "engine-b")
# What each fault did, for docs/reliability.md (printed at the end of the module).
RESULTS: dict[str, dict[str, Any]] = {}
# How long kubelet / containerd stay down: well inside the node controller's grace period
# (50 s here), as in a package upgrade or a crash and restart.
KUBELET_DOWN_SECONDS = 5.0
CONTAINERD_DOWN_SECONDS = 5.0
NODE_DOWN_SECONDS = 5.0
# After kubelet is back: it re-syncs every pod and probes each again before we look.
SETTLE_SECONDS = 10.0
SOAK_SECONDS = float(os.environ.get("WEIGHTCACHE_SOAK_SECONDS", "60"))
SOAK_PAUSE_SECONDS = 3.0  # between one rollout finishing and the next starting
REST_SAMPLES = 3  # of the daemon at the end of the soak, 5 s apart


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def node(real_cluster: Cluster) -> RealNode:
    assert real_cluster.node is not None
    return real_cluster.node


@pytest.fixture(scope="module")
def stack(real_cluster: Cluster, real_api: k8s.ApiClient, node_images: images.ImageSet,
          node: RealNode, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("faults")
    with installed(real_cluster, Api(real_api), node_images.refs, work,
                   socket_root=node.socket_root, engine_labels={"engines": CACHE}) as s:
        with operator_beside_the_node(s, work):
            deploy(s, deployments=ENGINES)
            yield s
            # While our operator runs: it removes the cache's finalizer.
            s.kubectl("delete", "wc", "-n", s.namespace, CACHE, "--wait=true", "--timeout=120s")
        print_results()


@contextlib.contextmanager
def operator_beside_the_node(stack: Stack, work: Path) -> Iterator[OperatorProcess]:
    """The chart's operator moved off the real node: its Deployment scaled to zero and the
    operator run as a process here, with the chart's ServiceAccount and cache policy, as it
    would run on another node of a cluster. A restart of the real node must not take the
    operator down with it, or nobody would be there to close the gates."""
    name = f"{RELEASE}-weightcache-operator"
    deployment = stack.api.apps.read_namespaced_deployment(name, SYSTEM_NS)
    (container,) = deployment.spec.template.spec.containers
    policy = json.loads(next(e.value for e in container.env if e.name == POLICY_ENV))
    stack.kubectl("scale", "deployment", "-n", SYSTEM_NS, name, "--replicas=0")
    eventually("the operator's pod gone", lambda: not stack.api.core.list_namespaced_pod(
        SYSTEM_NS, label_selector="app.kubernetes.io/component=operator").items, bound=120)
    kubeconfig = stack.cluster.service_account_kubeconfig(
        SYSTEM_NS, deployment.spec.template.spec.service_account_name,
        work / "operator.kubeconfig", expiration_seconds=6 * 3600)
    operator = OperatorProcess(kubeconfig, work / "operator.log", policy=policy)
    operator.start()
    try:
        yield operator
    finally:
        operator.stop()


@pytest.fixture(scope="module")
def traffic(stack: Stack, node: RealNode, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Traffic]:
    assert node.layout is not None
    t = Traffic(stack.api.core, stack.namespace, SYSTEM_NS, CACHE, node.layout.netns,
                stack.engine_labels).start()
    yield t
    t.stop()
    # Every request and transition, for a failure's post-mortem.
    path = tmp_path_factory.mktemp("traffic") / "record.json"
    path.write_text(json.dumps({"requests": [dataclasses.astuple(r) for r in t.requests],
                                "transitions": [dataclasses.astuple(x) for x in t.transitions]}))
    print(f"\n--- the traffic's record: {path}")


def print_results() -> None:
    print("\n--- faults on the real node (docs/reliability.md)")
    for fault, result in RESULTS.items():
        print(json.dumps({"fault": fault, **result}, sort_keys=True))


# --------------------------------------------------------------------------- what we look at


@dataclass(frozen=True)
class Process:
    pod_uid: str
    restarts: int
    host_pid: int


@dataclass(frozen=True)
class Snapshot:
    """The daemon and engine processes, the daemon's fds and RSS, the socket directory."""

    daemon: Process
    engines: dict[str, Process]
    fds: int
    rss_kib: int
    files: tuple[str, ...]

    @classmethod
    def take(cls, stack: Stack) -> Snapshot:
        daemon = stack.daemon_pod()
        assert daemon is not None
        pid = stack.host_pid(daemon, "daemon")
        return cls(
            daemon=process(stack, daemon, "daemon"),
            engines={p.metadata.name: process(stack, p, "engine") for p in stack.engine_pods()},
            fds=sample(lambda: len(os.listdir(f"/proc/{pid}/fd"))),
            rss_kib=rss_kib(pid),
            files=socket_files(stack),
        )

    def summary(self) -> dict[str, Any]:
        return {"fds": self.fds, "rss_mib": round(self.rss_kib / 1024, 1),
                "files": len(self.files)}


def process(stack: Stack, pod: k8s.V1Pod, container: str) -> Process:
    (status,) = [s for s in pod.status.container_statuses if s.name == container]
    return Process(pod.metadata.uid, status.restart_count, stack.host_pid(pod, container))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def socket_files(stack: Stack) -> tuple[str, ...]:
    """Every entry under the cache's socket directory but directories, relative to it."""
    root = stack.cache_dir
    found = []
    for directory, _, entries in os.walk(root):
        found += [os.path.relpath(os.path.join(directory, e), root) for e in entries]
    return tuple(sorted(found))


def engine_sockets(files: tuple[str, ...]) -> list[str]:
    return [f for f in files if f.startswith("engines/") and f.endswith(".sock")]


def fetches(stack: Stack, pod: k8s.V1Pod) -> int:
    """The daemon's fetch_state count (its /metrics through the API server's proxy)."""
    path = (f"/api/v1/namespaces/{pod.metadata.namespace}/pods/{pod.metadata.name}:8470"
            "/proxy/metrics")
    text = stack.kubectl("get", "--raw", path)
    found = re.search(r'^weightcache_requests_total\{op="fetch_state"\} (\S+)$', text, re.M)
    return int(float(found.group(1))) if found else 0


def daemon_container(pod: k8s.V1Pod) -> k8s.V1ContainerStatus:
    (status,) = [s for s in pod.status.container_statuses if s.name == "daemon"]
    return status


def record(fault: str, traffic: Traffic, since: float, until: float, before: Snapshot,
           after: Snapshot, **extra: Any) -> dict[str, int]:
    counts = traffic.counts(since, until)
    RESULTS[fault] = {**counts, "before": before.summary(), "after": after.summary(), **extra}
    return counts


def settle(seconds: float) -> None:
    time.sleep(seconds)  # not a check: give kubelet time to re-sync before we look


def all_gates_open(stack: Stack) -> bool:
    pods = stack.engine_pods()
    return bool(pods) and all(gate_of(p) and gate_of(p)[0] == "True" for p in pods)


def daemon_ready_again(stack: Stack, check: Callable[[k8s.V1Pod], bool]) -> k8s.V1Pod | None:
    pod = stack.daemon_pod()
    if pod is None or not is_ready(pod) or not stack.daemon_reported_ready() or not check(pod):
        return None
    return pod


def replace_daemon(stack: Stack, successor: str) -> k8s.V1Pod:
    """The daemon pod deleted (and gone), then its successor once it is Ready and reported
    Ready (`successor`: what is waited for, for the failure's message)."""
    old = stack.daemon_pod()
    assert old is not None
    stack.kubectl("delete", "pod", "-n", old.metadata.namespace, old.metadata.name,
                  "--wait=true")
    return eventually(successor, lambda: daemon_ready_again(
        stack, lambda p: p.metadata.uid != old.metadata.uid), bound=300)


def gid(stack: Stack) -> int:
    return stack.daemon_gid()


def closed_gates_reopened(stack: Stack, traffic: Traffic, since: float) -> bool:
    """Every engine pod (still there) whose gate closed since `since` has it open again."""
    changes = traffic.gate_changes(since)
    last = {t.pod: t.after for t in changes}
    closed = {t.pod for t in changes if t.before == "True"}
    alive = {p.metadata.name for p in stack.engine_pods()}
    return all(last[p] == "True" for p in closed & alive)


# --------------------------------------------------------------------------- the faults


def test_kubelet_restarted_pods_keep_serving_and_nothing_reloads(
    stack: Stack, traffic: Traffic, node: RealNode,
) -> None:
    stack.steady(ENGINES)
    since = traffic.wait_for_requests(pods=len(ENGINES))
    before = Snapshot.take(stack)
    node.stop_kubelet()
    time.sleep(KUBELET_DOWN_SECONDS)
    node.start_kubelet()
    settle(SETTLE_SECONDS)
    stack.steady(ENGINES)
    until = traffic.wait_for_requests(pods=len(ENGINES))
    after = Snapshot.take(stack)
    counts = record("kubelet restarted", traffic, since, until, before, after,
                    down_seconds=KUBELET_DOWN_SECONDS)
    assert counts["failed"] == counts["wrong"] == 0, traffic.failures(since, until)
    assert counts["daemon_starts"] == 0
    # The same daemon and engine processes: nothing restarted, nothing reloaded.
    assert (after.daemon, after.engines) == (before.daemon, before.engines)
    assert (after.fds, after.files) == (before.fds, before.files)


def test_kubelet_restart_closes_no_gate(traffic: Traffic) -> None:
    """kubelet starts every readiness probe anew as failed, so the daemon pod is NotReady
    for a moment after kubelet restarts; the operator's flap grace (issue 25 item 1,
    gate.FLAP_SECONDS) keeps the node's gates open through it."""
    counts = RESULTS["kubelet restarted"]
    assert counts["gate_closed"] == 0, counts


def test_containerd_restarted_pods_keep_serving_no_gate_closes_no_reload(
    stack: Stack, traffic: Traffic, node: RealNode,
) -> None:
    stack.steady(ENGINES)
    since = traffic.wait_for_requests(pods=len(ENGINES))
    before = Snapshot.take(stack)
    node.stop_containerd()
    time.sleep(CONTAINERD_DOWN_SECONDS)
    node.start_containerd()
    settle(SETTLE_SECONDS)
    stack.steady(ENGINES)
    until = traffic.wait_for_requests(pods=len(ENGINES))
    after = Snapshot.take(stack)
    counts = record("containerd restarted", traffic, since, until, before, after,
                    down_seconds=CONTAINERD_DOWN_SECONDS)
    assert counts["failed"] == counts["wrong"] == 0, traffic.failures(since, until)
    assert counts["gate_closed"] == counts["ready_lost"] == 0, traffic.gate_changes(since)
    assert counts["daemon_starts"] == 0
    assert (after.daemon, after.engines) == (before.daemon, before.engines)
    assert (after.fds, after.files) == (before.fds, before.files)


def test_daemon_oom_killed_engines_keep_serving_and_the_new_container_readopts(
    stack: Stack, traffic: Traffic,
) -> None:
    stack.steady(ENGINES)
    since = traffic.wait_for_requests(pods=len(ENGINES))
    before = Snapshot.take(stack)
    # Root on the node creates the trigger in the daemon's private directory; the daemon
    # pushes itself past its container's memory limit (docs/security.md says who can).
    trigger = stack.cache_dir / ".daemon" / f"cpu.sock{OOM_TRIGGER_SUFFIX}"
    trigger.touch()
    pod = eventually("the daemon container OOM-killed, restarted and ready", lambda:
                     daemon_ready_again(stack, lambda p: daemon_container(p).restart_count
                                        > before.daemon.restarts), bound=300)
    killed = daemon_container(pod).last_state.terminated
    assert killed is not None and killed.reason == "OOMKilled", killed
    assert not trigger.exists()  # consumed: the new container does not do it again
    status = stack.daemon_status(pod)
    assert status["load_source"] == "readopted", status["load_reason"]
    eventually("every gate open again", lambda: all_gates_open(stack), bound=120)
    stack.steady(ENGINES)
    until = traffic.wait_for_requests(pods=len(ENGINES))
    after = Snapshot.take(stack)
    counts = record("daemon OOM-killed", traffic, since, until, before, after,
                    load_source=status["load_source"])
    # The engines kept serving from their mappings, and kept their gates (issue 42: the
    # operator carries the killed process's verdict until its successor re-adopts).
    assert counts["failed"] == counts["wrong"] == 0, traffic.failures(since, until)
    assert counts["gate_closed"] == 0, traffic.gate_changes(since)
    assert after.daemon.pod_uid == before.daemon.pod_uid
    assert after.daemon.restarts == before.daemon.restarts + 1
    assert after.engines == before.engines
    assert after.files == before.files


def test_engine_oom_killed_between_receiving_fds_and_mapping_them(
    stack: Stack, traffic: Traffic,
) -> None:
    stack.steady(ENGINES)
    since = traffic.now()
    before = Snapshot.take(stack)
    daemon = stack.daemon_pod()
    assert daemon is not None
    fetched = fetches(stack, daemon)
    name = "engine-oom"
    stack.apply(stack.engine_deployment("v1", gid(stack), name,
                                        extra_args=["--oom-after-fds-once", "/tmp/oom-once"]))
    try:
        engine = eventually("the engine OOM-killed once, then attached and ready",
                            lambda: stack.ready_engine("v1", name), bound=300)
        (status,) = engine.status.container_statuses
        assert status.restart_count == 1
        assert status.last_state.terminated.reason == "OOMKilled", status.last_state
        died = stack.logs(engine.metadata.name, "engine", previous=True)
        assert [e["event"] for e in died] == ["fds_received"], died
        attached = next(e for e in stack.logs(engine.metadata.name, "engine")
                        if e["event"] == "attached")
        assert attached["bit_equal"] is True
        middle = Snapshot.take(stack)
        # Two fetches: the killed one and the one that attached; nothing counted twice.
        assert fetches(stack, daemon) == fetched + 2
        # The same daemon process, no fd of the dead engine's kept, and one hand-back
        # socket: the attached run's (the killed one never mapped, so never offered).
        assert middle.daemon == before.daemon
        assert middle.fds == before.fds
        new = sorted(set(middle.files) - set(before.files))
        assert len(new) == 1 and engine_sockets(tuple(new)) == new, new
    finally:
        stack.kubectl("delete", "deployment", "-n", stack.namespace, name, "--wait=true")
    eventually("the OOM engine's pod gone", lambda: not any(
        p.metadata.labels.get("app") == name for p in stack.api.core.list_namespaced_pod(
            stack.namespace, label_selector=f"app={name}").items), bound=120)
    until = traffic.now()
    after = Snapshot.take(stack)
    counts = record("engine OOM-killed mid-attach", traffic, since, until, before, after,
                    fetches=2)
    assert counts["wrong"] == 0 and counts["failed_ready"] == 0, traffic.failures(since, until)
    assert counts["gate_closed"] == 0
    assert after.files == before.files  # its socket went with it
    assert after.fds == before.fds


def test_whole_node_restarted_engines_leave_service_the_daemon_reloads_and_nothing_stale_blocks_it(
    stack: Stack, traffic: Traffic, node: RealNode,
) -> None:
    stack.steady(ENGINES)
    since = traffic.wait_for_requests(pods=len(ENGINES))
    before = Snapshot.take(stack)
    manifest = stack.cache_dir / ".daemon" / "cpu.sock.manifest"
    manifest_before = manifest.read_bytes()
    stale = engine_sockets(before.files)
    assert stale, "no engine offered its weights back before the restart"
    down = traffic.now()
    node.restart(down_seconds=NODE_DOWN_SECONDS)
    pod = eventually("the daemon container restarted and ready", lambda: daemon_ready_again(
        stack, lambda p: daemon_container(p).restart_count > before.daemon.restarts), bound=300)
    reopened = eventually("every engine attached again and its gate open", lambda: (
        all_gates_open(stack) and all(map(is_ready, stack.engine_pods()))
        and all(process(stack, p, "engine").restarts > before.engines[p.metadata.name].restarts
                for p in stack.engine_pods() if p.metadata.name in before.engines)
        and traffic.now()), bound=300)
    status = stack.daemon_status(pod)
    stack.steady(ENGINES)
    until = traffic.wait_for_requests(pods=len(ENGINES))
    after = Snapshot.take(stack)
    counts = record("whole node restarted", traffic, since, until, before, after,
                    down_seconds=NODE_DOWN_SECONDS, load_source=status["load_source"],
                    failed_while_down=traffic.counts(down, reopened)["failed"])
    # The weights died with the node: loaded from disk again, past what the old boot left.
    assert status["load_source"] == "disk"
    assert f"({len(stale)} dead engine socket(s) removed)" in status["load_reason"], status
    assert manifest.read_bytes() != manifest_before  # a fresh one, with a fresh key
    assert after.daemon.pod_uid == before.daemon.pod_uid  # kubelet restarted the same pods
    # Every engine left service while the weights were gone (its process died with the
    # node), and came back. Its gate may not show it: the operator carries the daemon
    # process's verdict until its successor's first report (issue 42), and a successor
    # that reloads within one status interval reports Ready before a close is written.
    out = {t.pod for t in traffic.ready_changes(down) if t.before == "True"}
    out |= {t.pod for t in traffic.gate_changes(down) if t.before == "True"}
    assert out >= set(before.engines), (traffic.ready_changes(down), traffic.gate_changes(down))
    assert counts["wrong"] == 0
    assert traffic.counts(reopened, until)["failed"] == 0, traffic.failures(reopened, until)
    # The old engines' sockets are gone; each engine offers its weights again.
    assert not set(stale) & set(after.files)
    assert len(engine_sockets(after.files)) == len(ENGINES)
    fixed = [f for f in after.files if not f.startswith("engines/")]
    assert fixed == [f for f in before.files if not f.startswith("engines/")]


@contextlib.contextmanager
def filled(root: Path) -> Iterator[Callable[[], None]]:
    """The filesystem of `root` filled, every block and every inode, by root; yields a
    function that fills again what something freed since. Emptied afterwards."""
    filler = root / "filler"
    filler.mkdir()
    count = 0

    def fill() -> None:
        nonlocal count
        with contextlib.suppress(OSError), open(filler / f"blocks-{count}", "ab") as f:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        while True:
            count += 1
            try:
                (filler / f"inode-{count}").touch()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                break
        stat = os.statvfs(root)
        assert stat.f_bavail == 0 and stat.f_favail == 0, stat

    try:
        fill()
        yield fill
    finally:
        shutil.rmtree(filler)


def test_socket_filesystem_full_writes_fail_clearly_serving_goes_on_next_start_reads_disk(
    stack: Stack, traffic: Traffic,
) -> None:
    stack.steady(ENGINES)
    since = traffic.wait_for_requests(pods=len(ENGINES))
    before = Snapshot.take(stack)
    with filled(stack.socket_root) as refill:
        # Every engine replaced: none can create its hand-back socket.
        stack.apply(*(stack.engine_deployment("full", gid(stack), name) for name in ENGINES))
        for name in ENGINES:
            engine = eventually(f"a new {name} attached on the full filesystem",
                                lambda n=name: stack.ready_engine("full", n), bound=300)
            attached = next(e for e in stack.logs(engine.metadata.name, "engine")
                            if e["event"] == "attached")
            assert attached["bit_equal"] is True
            assert attached["handback"].startswith("cannot offer the weights back"), attached
            assert "No space left on device" in attached["handback"]
        eventually("the old engines gone", lambda: all(
            p.metadata.labels["version"] == "full" for p in stack.api.core.list_namespaced_pod(
                stack.namespace, label_selector="engines=" + CACHE).items), bound=120)
        assert engine_sockets(socket_files(stack)) == []
        refill()  # what the old engines' sockets freed
        # The daemon restarts: no engine offers, so it loads from disk; its manifest
        # cannot be written, and its status and an event say so.
        pod = replace_daemon(stack, "a new daemon pod, ready")
        status = stack.daemon_status(pod)
        assert status["load_source"] == "disk", status
        assert "no live engine to re-adopt from" in status["load_reason"], status
        assert status["warning"].startswith("manifest "), status
        assert "No space left on device" in status["warning"], status
        event = eventually("a DaemonWarning event on the WeightCache", lambda: next(
            (e for e in stack.api.core.list_namespaced_event(stack.namespace).items
             if e.reason == "DaemonWarning" and "No space left" in e.message), None), bound=120)
        wc = stack.api.cache(stack.namespace, CACHE)
        messages = [g["message"] for n in wc["status"]["nodes"] for g in n["gpus"]]
        assert any("No space left on device" in m for m in messages), messages
        eventually("every gate open again", lambda: all_gates_open(stack), bound=120)
        until = traffic.wait_for_requests(pods=len(ENGINES))
    after = Snapshot.take(stack)
    counts = record("socket filesystem full", traffic, since, until, before, after,
                    load_source=status["load_source"], event=event.message[:200])
    assert counts["failed_ready"] == counts["wrong"] == 0, traffic.failures(since, until)
    assert closed_gates_reopened(stack, traffic, since), traffic.gate_changes(since)
    with_room_again(stack)


def with_room_again(stack: Stack) -> None:
    """Once the filesystem has room again, nothing writes the daemon's manifest or the
    engines' hand-back sockets before their next start: the daemon restarted (it writes its
    manifest) and the engines rolled to version "room" (each offers its weights back), so that the
    next daemon replacement re-adopts. Without it, the soak after this test counted every
    gate closing while the daemon it replaced reloaded from disk."""
    pod = replace_daemon(stack, "a new daemon pod, ready, its manifest written")
    assert stack.daemon_status(pod)["warning"] is None, stack.daemon_status(pod)
    stack.apply(*(stack.engine_deployment("room", gid(stack), name) for name in ENGINES))
    for name in ENGINES:
        eventually(f"{name} rolled to room", lambda n=name: stack.ready_engine("room", n),
                   bound=300)
    eventually("every engine offering its weights back", lambda: len(engine_sockets(
        socket_files(stack))) == len(ENGINES), bound=120)


def test_soak_rolling_engines_and_deleted_daemons_serve_every_request(
    stack: Stack, traffic: Traffic, node: RealNode,
) -> None:
    """Engine Deployments roll one after another for SOAK_SECONDS (each new pod attaching);
    the daemon pod is deleted at a third and at two thirds of it."""
    stack.steady(ENGINES)
    daemon_gid = gid(stack)
    since = traffic.wait_for_requests(pods=len(ENGINES))
    start = time.monotonic()
    samples: list[dict[str, Any]] = []
    deletions = [start + SOAK_SECONDS / 3, start + 2 * SOAK_SECONDS / 3]
    rolls = 0
    pending: dict[str, str] = {}  # deployment -> version rolling out
    next_roll = {name: start for name in ENGINES}
    last_sample = 0.0
    while time.monotonic() < start + SOAK_SECONDS:
        now = time.monotonic()
        if deletions and now >= deletions[0]:
            deletions.pop(0)
            pod = stack.daemon_pod()
            if pod is not None:
                stack.kubectl("delete", "pod", "-n", pod.metadata.namespace, pod.metadata.name,
                              "--wait=false")
        for name in ENGINES:
            version = pending.get(name)
            if version is not None and stack.ready_engine(version, name) is not None:
                del pending[name]
                next_roll[name] = time.monotonic() + SOAK_PAUSE_SECONDS
            elif version is None and time.monotonic() >= next_roll[name]:
                rolls += 1
                pending[name] = f"soak-{rolls}"
                stack.apply(stack.engine_deployment(pending[name], daemon_gid, name))
        if now - last_sample >= 5:
            last_sample = now
            # Mid-churn the daemon may be between pods or containers: skip that sample.
            with contextlib.suppress(AssertionError, AttributeError, OSError, StopIteration,
                                     TypeError, ValueError):
                samples.append(vital_signs(stack, now - start))
        time.sleep(0.5)
    eventually("the last rollouts done", lambda: all(
        stack.ready_engine(v, n) for n, v in pending.items()), bound=300)
    stack.steady(ENGINES)
    until = traffic.wait_for_requests(pods=len(ENGINES))
    for _ in range(REST_SAMPLES):  # at rest: nothing rolling, nothing restarting
        samples.append(vital_signs(stack, time.monotonic() - start))
        settle(5)
    counts = traffic.counts(since, until)
    trend = trends(samples)
    files = socket_files(stack)
    RESULTS["soak"] = {**counts, "seconds": round(time.monotonic() - start), "rolls": rolls,
                       **trend, "files_end": list(files)}
    write_soak_result(RESULTS["soak"], samples)
    assert counts["failed_ready"] == counts["wrong"] == 0, traffic.failures(since, until)
    assert counts["daemon_starts"] >= 2  # both deletions replaced the daemon
    # Each replaced daemon's successor re-adopted: no gate closed (issue 42 item 2).
    assert counts["gate_closed"] == 0, traffic.gate_changes(since)
    # Nothing accumulates in the socket directory: the fixed files and one hand-back
    # socket per live engine.
    assert len(engine_sockets(files)) == len(stack.engine_pods()), files
    assert [f for f in files if not f.startswith("engines/")] == [
        ".daemon/cpu.sock.lock", ".daemon/cpu.sock.manifest",
        f".daemon/load-{status_fingerprint(stack)}.lock", "cpu.sock"], files
    # Flat: the last daemon process's fds the same at every sample once it served, its
    # RSS within 32 MiB (a leak of one engine's mapping per attach would be 87 MiB each).
    last = [s for s in samples if s["daemon_pid"] == samples[-1]["daemon_pid"] and s["ready"]]
    assert len({s["fds"] for s in last}) == 1, last
    rss = [s["rss_kib"] for s in last]
    assert max(rss) - min(rss) < 32 * 1024, last


def status_fingerprint(stack: Stack) -> str:
    pod = stack.daemon_pod()
    assert pod is not None
    return stack.daemon_status(pod)["fingerprint"]


def vital_signs(stack: Stack, at: float) -> dict[str, Any]:
    pod = stack.daemon_pod()
    assert pod is not None
    pid = stack.host_pid(pod, "daemon")
    return {"at": round(at, 1), "daemon_pid": pid,
            "ready": is_ready(pod) and stack.daemon_reported_ready(),
            "fds": sample(lambda: len(os.listdir(f"/proc/{pid}/fd"))),
            "rss_kib": rss_kib(pid), "files": len(socket_files(stack)),
            "engine_pods": len(stack.engine_pods())}


def slope_per_minute(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value), per minute; None under three points."""
    if len(points) < 3:
        return None
    return statistics.linear_regression([p[0] for p in points],
                                        [p[1] for p in points]).slope * 60


def trends(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per daemon process (each deletion starts another): fds and RSS slopes, and the
    socket directory's file count over the whole run."""
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for s in samples:
        by_pid.setdefault(s["daemon_pid"], []).append(s)
    segments = []
    for pid, points in by_pid.items():
        points = [p for p in points if p["ready"]] or points  # once it served
        rss = slope_per_minute([(p["at"], p["rss_kib"] / 1024) for p in points])
        fds = slope_per_minute([(p["at"], p["fds"]) for p in points])
        segments.append({"daemon_pid": pid, "samples": len(points),
                         "seconds": round(points[-1]["at"] - points[0]["at"], 1),
                         "rss_mib": [round(points[0]["rss_kib"] / 1024, 1),
                                     round(points[-1]["rss_kib"] / 1024, 1)],
                         "fds": [points[0]["fds"], points[-1]["fds"]],
                         "rss_mib_per_min": None if rss is None else round(rss, 3),
                         "fds_per_min": None if fds is None else round(fds, 3)})
    files = [s["files"] for s in samples]
    return {"daemon_processes": segments,
            "files": {"min": min(files), "max": max(files), "end": files[-1]} if files else {}}


def write_soak_result(result: dict[str, Any], samples: list[dict[str, Any]]) -> None:
    """benchmarks/results/<machine>-soak.json when WEIGHTCACHE_RESULTS_DIR is set (make soak)."""
    out = os.environ.get("WEIGHTCACHE_RESULTS_DIR")
    if not out:
        return
    from benchmarks import machine

    load = os.getloadavg()
    body = {"machine": machine.describe(), "date": time.strftime("%Y-%m-%d"),
            "load_average_at_end": [round(x, 2) for x in load], "result": result,
            "samples": samples}
    path = Path(out) / f"{os.environ.get('WEIGHTCACHE_MACHINE', 'polyglot')}-soak.json"
    path.write_text(json.dumps(body, indent=2) + "\n")



# --------------------------------------------------------------------------- model upgrades


def spec_hash_now(stack: Stack) -> str:
    """The cache's generation as the operator has it (status.fingerprint), once observed."""
    def observed() -> str | None:
        cache = stack.api.cache(stack.namespace, CACHE) or {}
        status = cache.get("status") or {}
        done = status.get("observedGeneration") == cache["metadata"]["generation"]
        return status.get("fingerprint") if done else None

    return eventually("the operator's status of the spec", observed, bound=120)


def bound_rollout(stack: Stack, version: str, generation: str) -> None:
    """Both engine Deployments rolled to pods bound to `generation` (the annotation the
    webhook writes; these selector-gated pods carry it in their template)."""
    binding = {names.binding_key(stack.namespace, CACHE): generation}
    stack.apply(*(stack.engine_deployment(version, gid(stack), name, annotations=binding)
                  for name in ENGINES))
    for name in ENGINES:
        eventually(f"{name} rolled to {version}", lambda n=name: stack.ready_engine(version, n),
                   bound=300)


def daemon_holding(stack: Stack, generation: str, kept: set[str],
                   replaced: Callable[[k8s.V1Pod], bool]) -> k8s.V1Pod | None:
    """The daemon pod once `replaced` says it is the successor, Ready, reporting
    `generation` Ready and keeping exactly `kept`."""
    pod = stack.daemon_pod()
    if pod is None or not replaced(pod) or not is_ready(pod):
        return None
    reports = list(reports_of(pod).values())
    if len(reports) != 1:  # Ready a moment before its first report lands
        return None
    (report,) = reports
    if (report.state, report.spec_hash) != ("Ready", generation):
        return None
    return pod if {r.spec_hash for r in report.retained} == kept else None


def test_a_daemonset_rollout_a_model_change_a_rollback_and_a_daemon_kill_close_no_gate(
    stack: Stack, traffic: Traffic,
) -> None:
    """Issue 42: every daemon replacement closed every engine gate on its node (37 of 43
    requests then went to pods that were not Ready, the engines answering correctly).
    Under traffic, with both engines bound to the generation they run: the DaemonSet rolls
    (its template changed: a larger memory limit, room for two generations), the model
    changes (the new daemon keeps the old weights for the engines that map them and loads
    the new beside them; the engines roll; the old weights go once no engine holds them),
    the model rolls back (the newer weights kept in turn), and the daemon is killed
    (SIGKILL; it takes the kept weights back again). No gate closes, no request fails."""
    stack.steady(ENGINES)
    first = spec_hash_now(stack)
    bound_rollout(stack, "bound-1", first)
    stack.steady(ENGINES)
    since = traffic.wait_for_requests(pods=len(ENGINES))
    before = Snapshot.take(stack)

    # 1. The DaemonSet replaces the daemon pod (a template change, the same weights).
    resources = {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "3Gi"}}
    stack.kubectl("patch", "wc", "-n", stack.namespace, CACHE, "--type", "merge", "-p",
                  json.dumps({"spec": {"sidecar": {"resources": resources}}}))
    pod = eventually("the daemon pod replaced, re-adopted, Ready", lambda: daemon_holding(
        stack, first, set(), lambda p: p.metadata.uid != before.daemon.pod_uid), bound=300)
    assert stack.daemon_status(pod)["load_source"] == "readopted"

    # 2. The model changes: the old weights are kept for the engines that run them.
    revision = stack.api.cache(stack.namespace, CACHE)["spec"]["model"]["revision"]
    replaced = pod.metadata.uid
    stack.kubectl("patch", "wc", "-n", stack.namespace, CACHE, "--type", "merge", "-p",
                  json.dumps({"spec": {"model": {"revision": "v2"}}}))
    second = spec_hash_now(stack)
    assert second != first
    pod = eventually("the new generation beside the kept one", lambda: daemon_holding(
        stack, second, {first}, lambda p: p.metadata.uid != replaced), bound=300)
    status = stack.daemon_status(pod)
    assert status["load_source"] == "disk" and "kept layout" in status["load_reason"], status
    assert [r["spec_hash"] for r in status["retained"]] == [first]
    bound_rollout(stack, "bound-2", second)
    eventually("the old weights dropped once no engine holds them", lambda: daemon_holding(
        stack, second, set(), lambda p: p.metadata.uid == pod.metadata.uid), bound=180)

    # 3. Back to the first model: the newer weights are kept in turn.
    replaced = pod.metadata.uid
    stack.kubectl("patch", "wc", "-n", stack.namespace, CACHE, "--type", "merge", "-p",
                  json.dumps({"spec": {"model": {"revision": revision}}}))
    assert spec_hash_now(stack) == first
    pod = eventually("the first generation back, the second kept", lambda: daemon_holding(
        stack, first, {second}, lambda p: p.metadata.uid != replaced), bound=300)

    # 4. The daemon killed (SIGKILL): kubelet restarts it; it keeps the engines' weights.
    restarts = daemon_container(pod).restart_count
    os.kill(stack.host_pid(pod, "daemon"), 9)
    pod = eventually("the daemon restarted, keeping the engines' weights", lambda:
                     daemon_holding(stack, first, {second}, lambda p:
                                    daemon_container(p).restart_count > restarts), bound=300)
    stack.steady(ENGINES)
    until = traffic.wait_for_requests(pods=len(ENGINES))
    after = Snapshot.take(stack)
    counts = record("daemonset rollout, model change, rollback, daemon kill", traffic, since,
                    until, before, after)
    assert counts["failed"] == counts["wrong"] == 0, traffic.failures(since, until)
    assert counts["gate_closed"] == 0, (traffic.gate_changes(since), gate_events(stack))
    assert counts["daemon_starts"] >= 4
    # The engines bound to the second generation still run it from the weights kept.
    assert {gate_of(p)[0] for p in stack.engine_pods()} == {"True"}


def gate_events(stack: Stack) -> list[str]:
    """The operator's Warning events on engine pods (a gate closing, and why), in order."""
    events = stack.api.core.list_namespaced_event(
        stack.namespace, field_selector="involvedObject.kind=Pod,type=Warning").items
    return [f"{e.last_timestamp} {e.involved_object.name} {e.reason}: {e.message}"
            for e in sorted(events, key=lambda e: str(e.last_timestamp))
            if e.reason in GATE_REASONS]


GATE_REASONS = {"DaemonNotReady", "FingerprintMismatch", "NoDaemonOnNode", "BytesBelowExpected",
                "ReportMalformed", "EvaluationFailed", "BindingInvalid"}
