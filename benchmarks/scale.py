"""Fleet scale: one WeightCache over N kwok GPU nodes x 8 GPUs, one gated engine pod per node.

    python -m benchmarks.run --suite scale --scale-nodes 10,100,1000 --out results.json

Everything is real except the GPUs and the daemons' processes: a fresh local
control plane (tools/testenv: etcd, kube-apiserver, controller-manager,
scheduler, kwok), the operator as its own process under a ServiceAccount bound
to `rbac.OPERATOR_RULES`, the cache's DaemonSet rolled out by the real
DaemonSet controller onto the kwok nodes, and the daemons' reports written by
the real reporter functions under the daemon's bound tokens, through the
chart's report guard (see benchmarks/fleet.py).

Waves, each measured from the apiserver's /metrics (the operator's requests by
verb and resource, told apart by FlowSchemas: benchmarks/apimetrics.py), the
operator's /proc (CPU seconds, peak RSS) and the watches' view of every gate
and label:

- start: the operator starts with the engine pods already there (no cache);
- install: the WeightCache is created, the DaemonSet lands on every node;
- loading: every daemon reports Loading;
- ready: every daemon reports Ready, spread over ~60 s;
- degrade: 1 % of the nodes go bad (daemon pod deleted, a wrong fingerprint,
  bytes below expected);
- spec: a new model revision, rolled across the fleet by the DaemonSet
  controller, each new daemon pod reporting Loading then Ready;
- bind: every engine pod bound to the generation it runs (the annotation the
  webhook writes at admission); no gate may move;
- model: another revision under bound engines: each gate stays open until its
  node's daemon pod is replaced, then closes (no daemon holds its weights), and
  the labels follow the new generation;
- rollback: the revision before "model" again: each bound gate opens once its
  node's new daemon reports Ready;
- nodebynode: another revision under `rollout.strategy: NodeByNode`: the
  operator evicts each node's engine pod (bound to the old generation), then
  its daemon pod, `maxUnavailable` nodes at a time; the harness creates each
  evicted engine again bound to the new generation, as its Deployment would.
  `NodeByNodeWatch` counts, poll by poll, the nodes in flight (must stay
  within `maxUnavailable`) and the daemons replaced while an old engine still
  ran there (must be 0);
- surge: every engine pod bound to the current generation (bound here if the
  waves before left it otherwise), then another revision under
  `rollout.strategy: Surge`; the DaemonSet controller replaces each node's
  daemon pod, `maxUnavailable` nodes at a time, and the harness writes each new
  pod's reports as the daemon does under Surge: Loading of the new generation,
  then Ready, each keeping the old one (`retained`: the engines' weights, taken
  back). No gate may close: the old daemon pod holds the weights, then (the
  operator's carried verdict, up to its `--carry-seconds`) the engines alone,
  then the new pod keeping them. `SurgeWatch` times each node's hand-over;
  every closing the engine watch delivered is counted as well (`gate_closings`:
  a gate that closed and opened between two polls).

In the last four, every poll checks each bound gate against what its node
holds (`BindingWatch`): gates closed while their weights were held, gates
opened where they were not (both must be 0), and how long gates stayed open
after their weights left.

After each wave the harness waits until every gate and label is what the
wave's reports justify (bounded by `wave_timeout`; a wave that does not get
there is recorded as not converged, with what was still wrong), then until the
operator has stopped writing, and records the figures. Latencies are measured
from the last report of a node (per pod) and of the wave (total), as the
harness's watches saw them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import yaml

from benchmarks import apimetrics
from benchmarks.fleet import (
    DaemonPod,
    Daemons,
    FleetView,
    FleetWatch,
    Gate,
    Kept,
    RawApi,
    Report,
)
from tests.k8s.operator_flow import (
    DAEMON_SA,
    OperatorProcess,
    apply,
    install_crd,
    install_daemon_account,
    install_operator_account,
)
from tools.testenv import assets, kubeconfig
from tools.testenv.cluster import READINESS_FROM_REPORTS, Cluster, interrupt_on_termination
from weightcache.report import PHASE_LOADING
from weightcache_operator import gate, names, rbac, rollout
from weightcache_operator.policy import GPU_TAINT
from weightcache_operator.spec import parse_spec, spec_hash

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "weightcache-operator"
NAMESPACE = "fleet"
OPERATOR_NAMESPACE = "wc-system"
OPERATOR_ACCOUNT = "weightcache-operator"
CACHE = "llama"
ENGINE_APP = "fleet-engine"
UNRELATED = "unrelated"
# A kwok node takes 110 pods (tools/testenv/nodes.py): room left for the engine, the old and
# the new daemon pod.
UNRELATED_PER_NODE = 100
SOCKET_ROOT = "/var/run/weightcache"
MODEL_ROOT = "/models"
# One TP-8 shard of a 70B bf16 checkpoint.
SHARD_BYTES = 17_637_744_640
TOKEN_SECONDS = 6 * 3600
# Seconds between the harness's looks at the watches' view during a wave.
POLL = 0.25
# The daemon pods' toleration that makes kwok keep them NotReady until their reports say Ready,
# as the daemon's readiness probe does (tools/testenv/kwok/stages.yaml): the DaemonSet
# controller and NodeByNode pace a rollout by it.
PROBED = {"key": READINESS_FROM_REPORTS, "operator": "Exists", "effect": "NoSchedule"}


@dataclass(frozen=True)
class Options:
    nodes: int = 1000
    gpus: int = 8
    ready_seconds: float = 60.0
    degrade_fraction: float = 0.01
    # Bound on each wave's convergence (a wave past it is recorded, not failed).
    wave_timeout: float = 1200.0
    # The operator counts as settled after this long without a write.
    quiet_seconds: float = 8.0
    writers: int = 8
    seed: int = 19
    # kwok's node leases: at 40 s, 1,000 nodes renew 100 times a second, load that is the
    # kubelets' and not the operator's; the node controller's grace period follows.
    node_lease_seconds: int = 600
    # The cache's spec.rollout.maxUnavailable: the pace of the spec wave's DaemonSet
    # rollout (one node at a time would take a thousand sequential replacements).
    max_unavailable: int | str = "10%"
    # Run the operator from another checkout (its operator/ and sidecar/), e.g. a baseline.
    operator_src: Path | None = None
    # Stop after the first wave that does not converge (later ones would measure the backlog).
    stop_on_timeout: bool = True
    # Waves left out (of degrade, spec, bind, model, rollback, nodebynode, surge; model and
    # rollback need bind; surge binds the engine pods itself where they are not bound).
    skip_waves: tuple[str, ...] = ()
    # Pods that are none of weightcache's business, made before the operator starts (issue
    # 43: its memory must grow with our pods only).
    unrelated_pods: int = 0


# --------------------------------------------------------------------------- expectations (pure)


@dataclass(frozen=True)
class Expect:
    """What one node's engine gate and label must show once the operator caught up."""

    status: str
    reasons: frozenset[str]
    label: bool
    # The gate message must contain this (e.g. the daemon pod that justified it).
    message: str | None = None

    def gate_ok(self, g: Gate | None) -> bool:
        return (g is not None and g.status == self.status and g.reason in self.reasons
                and (self.message is None or self.message in g.message))


def closed(*reasons: str, message: str | None = None) -> Expect:
    return Expect("False", frozenset(reasons), False, message)


def opened(pod: str) -> Expect:
    return Expect("True", frozenset({gate.WEIGHTS_RESIDENT}), True, f"daemon pod {pod}:")


def percentiles(samples: Iterable[float]) -> dict[str, float | int] | None:
    """p50, p99 and max by nearest rank; None without samples."""
    ordered = sorted(samples)
    if not ordered:
        return None

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.999999) - 1))]

    return {"p50": round(rank(0.50), 3), "p99": round(rank(0.99), 3),
            "max": round(ordered[-1], 3), "n": len(ordered)}


def degraded_nodes(nodes: list[str], fraction: float, seed: int) -> dict[str, str]:
    """Node -> how it degrades: at least one node per kind, kinds in turn."""
    kinds = ("deleted", "fingerprint", "bytes")
    count = max(len(kinds), round(len(nodes) * fraction))
    chosen = random.Random(seed).sample(sorted(nodes), min(count, len(nodes)))
    return {node: kinds[i % len(kinds)] for i, node in enumerate(sorted(chosen))}


@dataclass
class Changes:
    """What a wave changed: per node, when its last change landed."""

    last: dict[str, float] = field(default_factory=dict)
    reports: int = 0
    other: int = 0
    started: float = 0.0
    # Further figures of the wave, recorded as they are.
    extra: dict[str, Any] = field(default_factory=dict)

    def note(self, node: str, when: float | None) -> None:
        if when is not None:
            self.last[node] = max(self.last.get(node, 0.0), when)

    @property
    def ended(self) -> float:
        return max(self.last.values(), default=self.started)


@dataclass
class BindingWatch:
    """Whether engine pods bound to one generation have their gates follow it, poll by poll:
    open while their node's daemon holds it (Ready), closed once it does not.

    Wrong at any moment: a gate found closed `grace` seconds after it closed (open before)
    while the node held the pod's weights throughout (watches of pods and of daemon pods deliver in
    no common order, so a closing seen just before its daemon pod's deletion is no fault);
    a gate that opened while the node did not hold them. Figures: how long gates stayed
    open once their weights were gone (the operator's reaction, as the watches saw it).
    """

    grace: float = 5.0
    held_since: dict[str, float] = field(default_factory=dict)
    unheld_since: dict[str, float] = field(default_factory=dict)
    closed_while_held: dict[str, str] = field(default_factory=dict)
    opened_while_unheld: dict[str, str] = field(default_factory=dict)
    open_after_weights_left: dict[str, float] = field(default_factory=dict)
    seen_open: dict[str, bool] = field(default_factory=dict)  # at the last poll
    open_while_held: set[str] = field(default_factory=set)  # seen open since held

    def observe(self, now: float, node: str, held: bool, g: Gate | None) -> None:
        is_open = g is not None and g.status == "True"
        was_open = self.seen_open.get(node, False)
        self.seen_open[node] = is_open
        if held:
            self.unheld_since.pop(node, None)
            since = self.held_since.setdefault(node, now)
            if is_open:
                self.open_while_held.add(node)
            elif (g is not None and node in self.open_while_held and g.since >= since
                    and now - g.since >= self.grace):
                # A closing; a gate not opened yet is the operator's latency, not a fault.
                self.closed_while_held.setdefault(node, f"{g.reason}: {g.message[:160]}")
            return
        self.open_while_held.discard(node)
        self.held_since.pop(node, None)
        first = node not in self.unheld_since
        since = self.unheld_since.setdefault(node, now)
        if g is not None and is_open and not was_open and g.since > since:
            # Opened since the weights left (a message changing on a gate that stayed open,
            # such as a carried verdict's, is no opening).
            self.opened_while_unheld.setdefault(node, g.message[:160])
        elif g is not None and is_open:
            self.open_after_weights_left[node] = now - since  # still open: so far
        elif g is not None and was_open and (first or node in self.open_after_weights_left):
            # Closed since the last poll (a closing seen before the weights' leaving: 0).
            self.open_after_weights_left[node] = max(0.0, g.since - since)

    def figures(self) -> dict[str, Any]:
        return {
            "gates_closed_while_weights_held": len(self.closed_while_held),
            "gates_opened_without_weights": len(self.opened_while_unheld),
            "open_after_weights_left_s": percentiles(self.open_after_weights_left.values()),
            "wrong_examples": dict(sorted({**self.closed_while_held,
                                           **self.opened_while_unheld}.items())[:5]),
        }


@dataclass
class NodeByNodeWatch:
    """A node-by-node rollout, poll by poll: nodes in flight (the old engine gone, the new
    daemon pod not Ready yet: the operator's and the DaemonSet controller's measure) and new
    daemons that came while the node's old engine still ran.

    Watches of engine and daemon pods deliver in no common order: a new daemon counts as
    replaced under an old engine only when the engine was still seen `grace` seconds after
    the daemon first was.
    """

    grace: float = 2.0
    max_in_flight: int = 0
    new_daemon_since: dict[str, float] = field(default_factory=dict)
    replaced_under_old_engine: set[str] = field(default_factory=set)

    def poll(self, now: float, nodes: Mapping[str, tuple[bool, bool, bool]]) -> None:
        """`nodes`: per node, (old engine present, new daemon running, new daemon Ready)."""
        in_flight = 0
        for node, (old_engine, new_daemon, ready) in nodes.items():
            if new_daemon:
                since = self.new_daemon_since.setdefault(node, now)
                if old_engine and now - since >= self.grace:
                    self.replaced_under_old_engine.add(node)
            if not old_engine and not ready:
                in_flight += 1
        self.max_in_flight = max(self.max_in_flight, in_flight)

    def figures(self, budget: int) -> dict[str, Any]:
        return {"max_nodes_in_flight": self.max_in_flight, "max_unavailable_nodes": budget,
                "daemons_replaced_under_old_engines": len(self.replaced_under_old_engine),
                "examples": sorted(self.replaced_under_old_engine)[:5]}


@dataclass
class SurgeWatch:
    """A Surge rollout under bound engines, poll by poll, per node: its old daemon pod
    (holding the generation the engines run), the hand-over (that pod gone or terminating,
    its successor not reporting yet: the engines still map the weights and the operator
    carries the old pod's verdict, for at most `carry_seconds`), then the new daemon pod
    keeping the old generation (`retained`) while it loads and once it is Ready.

    `poll` says per node whether the node holds the engines' weights: through the
    hand-over only within the carry, the operator's bound (a gate it closes after that is
    no fault of the gate's, and shows here as a hand-over past the carry).
    """

    carry_seconds: float = gate.CARRY_SECONDS
    left: dict[str, float] = field(default_factory=dict)  # node -> its old pod first seen gone
    handover: dict[str, float] = field(default_factory=dict)  # node -> seconds until kept
    ready: set[str] = field(default_factory=set)
    max_handing_over: int = 0

    def poll(self, now: float, nodes: Mapping[str, tuple[bool, bool, bool]]) -> dict[str, bool]:
        """`nodes`: per node, (old daemon pod runs, holding the generation; new daemon pod
        reported keeping it; new daemon pod reported Ready). Returns per node whether it
        holds the generation's weights."""
        held: dict[str, bool] = {}
        handing_over = 0
        for node, (old, kept, ready) in nodes.items():
            if old or kept:
                held[node] = True
            else:
                since = self.left.setdefault(node, now)
                held[node] = now - since < self.carry_seconds
                handing_over += 1
            if kept and node not in self.handover:
                self.handover[node] = round(now - self.left.get(node, now), 3)
            if ready:
                self.ready.add(node)
        self.max_handing_over = max(self.max_handing_over, handing_over)
        return held

    def figures(self, now: float, budget: int) -> dict[str, Any]:
        late = [n for n, s in self.left.items()
                if self.handover.get(n, now - s) >= self.carry_seconds]
        return {"nodes_rolled": len(self.ready),
                "handover_s": percentiles(self.handover.values()),
                "handovers_past_carry": len(late), "carry_seconds": self.carry_seconds,
                "max_nodes_handing_over": self.max_handing_over,
                "max_unavailable_nodes": budget, "examples_past_carry": sorted(late)[:5]}


def closings_since(before: Mapping[str, int], now: Mapping[str, int],
                   names_: Iterable[str]) -> dict[str, int]:
    """Closings the engine watch delivered since `before`, per pod of `names_` that had any."""
    out = {}
    for name in names_:
        count = now.get(name, 0) - before.get(name, 0)
        if count > 0:
            out[name] = count
    return out


# --------------------------------------------------------------------------- the run


class RssSampler:
    """Peak RSS of a process between resets, sampled every half second."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self.stopping = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="rss").start()

    def _run(self) -> None:
        while not self.stopping.wait(0.5):
            rss = apimetrics.rss_bytes(self.pid)
            if rss is not None:
                self.peak = max(self.peak, rss)

    def take(self) -> int:
        peak = max(self.peak, apimetrics.rss_bytes(self.pid) or 0)
        self.peak = 0
        return peak


@dataclass
class Snapshot:
    at: float
    counts: apimetrics.Counts
    cpu: dict[str, float]
    busy: float
    harness: float


class FleetRun:
    """One control plane with `nodes` kwok GPU nodes, the operator, and the waves."""

    def __init__(self, options: Options, work: Path) -> None:
        self.o = options
        self.work = work
        self.cluster: Cluster | None = None
        self.operator: OperatorProcess | None = None
        self.watch: FleetWatch | None = None
        self.daemons: Daemons | None = None
        self.view = FleetView(NAMESPACE, f"app={ENGINE_APP}",
                              names.node_label_key(NAMESPACE, CACHE), OPERATOR_NAMESPACE)
        self.spec_hash = ""
        self.revision = self.before_model = "r1"  # spec.model.revision now, and before "model"
        self.reported: dict[str, str] = {}  # node -> the daemon pod whose reports stand
        self.ready_uids: set[str] = set()  # daemon pods whose every GPU was reported Ready
        # Daemon pod uid -> the earlier generation it was reported keeping (surge).
        self.retaining: dict[str, str] = {}
        # Node -> its engine pod now, and the generation it is bound to (None: unbound).
        self.engine_names: dict[str, str] = {}
        self.bound_to: dict[str, str | None] = {}
        # Engine pods' closings (FleetView.closings) when the surge wave began.
        self.closings_from: dict[str, int] | None = None
        self._changes_lock = threading.Lock()  # reports counted from several writers
        # The generation the engine pods are bound to, and the watch of their gates.
        self.binding: tuple[str, BindingWatch] | None = None
        self.log = work / "operator.log"

    # ------------------------------------------------------------------ set-up

    def __enter__(self) -> FleetRun:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        o = self.o
        say(f"starting a control plane with {o.nodes} kwok nodes")
        self.cluster = cluster = Cluster(self.work / "testenv", assets.ensure_binaries(),
                                         node_count=o.nodes, gpus_per_node=o.gpus,
                                         node_lease_seconds=o.node_lease_seconds)
        cluster.start(timeout=180 + o.nodes * 0.5)
        self.api = RawApi(cluster, maxsize=8)
        self.nodes = list(cluster.node_names)
        # The node controller takes the not-ready taint off new nodes at its own
        # pace (20 requests/s); the fleet is there once every node is schedulable.
        self._until("every node schedulable", self._schedulable, 180 + o.nodes * 0.5, every=2.0)
        install_crd(cluster)
        for ns in (NAMESPACE, OPERATOR_NAMESPACE):
            self.api.request("POST", "/api/v1/namespaces",
                             {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        self._until("the namespace's default ServiceAccount",
                    lambda: self.api.request(
                        "GET", f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/default",
                        ok=(404,)).__class__ is dict, 120)
        install_operator_account(cluster, OPERATOR_NAMESPACE, OPERATOR_ACCOUNT)
        # The daemons run in the operator's namespace (its daemon namespace).
        install_daemon_account(cluster, OPERATOR_NAMESPACE)
        apply(cluster, *apimetrics.flow_schemas(
            "op", OPERATOR_NAMESPACE, OPERATOR_ACCOUNT,
            rbac.OPERATOR_RULES + rbac.OPERATOR_DAEMON_NAMESPACE_RULES))
        apply(cluster, *apimetrics.flow_schemas("daemon", OPERATOR_NAMESPACE, DAEMON_SA,
                                                rbac.DAEMON_RULES))
        apply(cluster, *report_guard(cluster))
        # A token outliving the run (the default one lasts an hour).
        token = cluster.mint_token(OPERATOR_NAMESPACE, OPERATOR_ACCOUNT, TOKEN_SECONDS)
        self.operator_config = kubeconfig.write(
            self.work / "operator.kubeconfig",
            kubeconfig.render(cluster.server, cluster.ca.read_bytes(),
                              kubeconfig.token_user(token)))
        say(f"creating {o.nodes} engine pods")
        self.engine_names = {n: f"engine-{n}" for n in self.nodes}
        self.bound_to = dict.fromkeys(self.nodes)
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda n: self.api.request(
                "POST", f"/api/v1/namespaces/{NAMESPACE}/pods", engine_pod(n)), self.nodes))
        if o.unrelated_pods:
            self.create_unrelated_pods(o.unrelated_pods)
        self.daemons = Daemons(cluster, self.api, OPERATOR_NAMESPACE, DAEMON_SA, o.writers)
        self.watch = FleetWatch(self.api, self.view)
        self.watch.start()

    def create_unrelated_pods(self, count: int) -> None:
        """`count` pods of other workloads in a namespace of their own, bound to the fleet's
        nodes in turn (no scheduler work) and run there by kwok, as a cluster's other
        workloads run beside the engines; waited for until every one is Running, so kwok's
        status writes are over before the operator starts. A pod bound to a node that does
        not exist would be deleted by the pod garbage collector (an orphan), and one that
        no node matches retried by the scheduler every few minutes."""
        if count > UNRELATED_PER_NODE * len(self.nodes):
            raise ValueError(f"{count} unrelated pods are more than {UNRELATED_PER_NODE} per "
                             f"node on {len(self.nodes)} nodes (a node takes 110 pods; the "
                             "daemon pods are scheduled)")
        self.api.request("POST", "/api/v1/namespaces", {
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": UNRELATED}})
        self._until("the unrelated namespace's default ServiceAccount",
                    lambda: self.api.request(
                        "GET", f"/api/v1/namespaces/{UNRELATED}/serviceaccounts/default",
                        ok=(404,)).__class__ is dict, 120)
        say(f"creating {count} unrelated pods")
        started = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda i: self.api.request(
                "POST", f"/api/v1/namespaces/{UNRELATED}/pods",
                unrelated_pod(i, self.nodes[i % len(self.nodes)])), range(count)))
        say(f"created {count} unrelated pods in {time.monotonic() - started:.0f} s")
        self._until("every unrelated pod Running", lambda: not self.api.request(
            "GET", f"/api/v1/namespaces/{UNRELATED}/pods"
            "?fieldSelector=status.phase!%3DRunning&limit=1")["items"], 1800, every=5)
        say(f"{count} unrelated pods Running after {time.monotonic() - started:.0f} s")

    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        if self.daemons is not None:
            self.daemons.close()
        if self.operator is not None:
            self.operator.stop()
        if self.cluster is not None:
            self.cluster.stop()

    def start_operator(self) -> None:
        env = {}
        if self.o.operator_src is not None:
            src = self.o.operator_src.resolve()
            env["PYTHONPATH"] = os.pathsep.join(
                [str(src / "operator"), str(src / "sidecar"), os.environ.get("PYTHONPATH", "")])
        self.operator = OperatorProcess(self.operator_config, self.log, policy=policy(), env=env)
        self.operator.start()
        assert self.operator.proc is not None
        self.rss = RssSampler(self.operator.proc.pid)

    # ------------------------------------------------------------------ measuring

    def snapshot(self) -> Snapshot:
        assert self.cluster is not None
        cpu = {name: apimetrics.cpu_seconds(p.pid) or 0.0
               for name, p in self.cluster.group.procs.items()}
        proc = self.operator.proc if self.operator is not None else None
        cpu["operator"] = (apimetrics.cpu_seconds(proc.pid) or 0.0) if proc is not None else 0.0
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return Snapshot(
            at=time.monotonic(),
            counts=apimetrics.counts(self.api.get("/metrics")),
            cpu=cpu,
            busy=apimetrics.system_cpu()[0],
            harness=usage.ru_utime + usage.ru_stime,
        )

    def operator_writes_now(self) -> int:
        flows = apimetrics.counts(self.api.get("/metrics")).flows
        head = f"{apimetrics.FLOW_PREFIX}op-"
        return int(sum(v for k, v in flows.items() if k.startswith(head)
                       and k[len(head):].split("-", 1)[0] in apimetrics.MUTATING))

    def settle(self) -> float:
        """Wait until the operator has written nothing for `quiet_seconds`; seconds waited."""
        started = time.monotonic()
        last, quiet_since = self.operator_writes_now(), time.monotonic()
        while time.monotonic() - quiet_since < self.o.quiet_seconds:
            if time.monotonic() - started > 180:
                break
            time.sleep(1.0)
            now = self.operator_writes_now()
            if now != last:
                last, quiet_since = now, time.monotonic()
        return time.monotonic() - started

    def status(self) -> dict[str, Any]:
        return self.api.get(f"/apis/{names.GROUP}/{names.VERSION}/namespaces/{NAMESPACE}/"
                            f"{names.PLURAL}/{CACHE}")

    def converge(self, expect: Callable[[str], Expect], ready_nodes: int | None,
                 started: float) -> dict[str, Any]:
        """Wait until every gate, label and the status count agree with `expect`.

        `ready_nodes` is the status's readyNodes the wave must end with (None: no cache).
        """
        assert self.watch is not None
        deadline = started + self.o.wave_timeout
        status_at: float | None = None
        next_status = 0.0
        wrong: dict[str, Any] = {}
        while True:
            self.watch.check()
            if self.operator is not None:
                self.operator.check_running()
            now = time.monotonic()
            self.observe_bindings()
            if ready_nodes is None:
                status_at = status_at or now
            elif status_at is None and now >= next_status:
                ready = (self.status().get("status") or {}).get("readyNodes")
                if ready == ready_nodes:
                    status_at = time.monotonic()
                next_status = now + 1.0
            wrong = self.wrong(expect)
            if not wrong["gates"] and not wrong["labels"] and status_at is not None:
                return {"converged": True, "status_at": status_at}
            if now > deadline:
                return {"converged": False, "status_at": status_at, "wrong": summarize(wrong)}
            time.sleep(POLL)

    def wrong(self, expect: Callable[[str], Expect]) -> dict[str, Any]:
        gates, labels = {}, {}
        with self.view.lock:
            engines = {e.node: e for e in self.view.engines.values()}
            for node in self.nodes:
                want = expect(node)
                engine = engines.get(node)
                if engine is None or not want.gate_ok(engine.gate):
                    g = engine.gate if engine else None
                    gates[node] = (g.status, g.reason, g.message[:160]) if g else None
                has = self.view.labels.get(node, (False, 0.0))[0]
                if has != want.label:
                    labels[node] = has
        return {"gates": gates, "labels": labels}

    def wave(self, name: str, act: Callable[[], Changes], expect: Callable[[str], Expect],
             ready_nodes: Callable[[], int]) -> dict[str, Any]:
        """`act` makes the wave's changes; then `expect` and `ready_nodes` say what must follow."""
        say(f"wave {name}")
        before = self.snapshot()
        self.rss.take()
        changes = act()
        result = self.converge(expect, ready_nodes(), changes.started)
        settled = self.settle() if result["converged"] else 0.0
        after = self.snapshot()
        status = self.status()
        record = self.record(name, changes, result, before, after, status)
        record["settle_s"] = round(settled, 1)
        if self.binding is not None:
            self.observe_bindings()
            record["bound_engines"] = self.binding[1].figures()
            self.binding = (self.binding[0], BindingWatch())  # the next wave counts anew
        if self.closings_from is not None:
            with self.view.lock:
                now = dict(self.view.closings)
            closed_ = closings_since(self.closings_from, now, self.engine_names.values())
            record["gate_closings"] = {"count": sum(closed_.values()),
                                       "engines": len(closed_),
                                       "examples": dict(sorted(closed_.items())[:5])}
            self.closings_from = None
        say(json.dumps({k: record[k] for k in ("wave", "converged", "total_s", "gate_latency_s")}
                       | {"writes": record["operator"]["writes"],
                          "cpu_s": record["operator"]["cpu_s"]}))
        return record

    def record(self, name: str, changes: Changes, result: Mapping[str, Any], before: Snapshot,
               after: Snapshot, cache: Mapping[str, Any]) -> dict[str, Any]:
        assert self.daemons is not None
        op = apimetrics.flow_delta(before.counts, after.counts, "op")
        daemon = apimetrics.flow_delta(before.counts, after.counts, "daemon")
        writes = apimetrics.writes(op)
        change_count = changes.reports + changes.other
        gate_lat, label_lat, last_seen = [], [], changes.started
        with self.view.lock:
            engines = {e.node: e for e in self.view.engines.values()}
            for node in (self.nodes if result["converged"] else []):
                e = engines.get(node)
                label_since = self.view.labels.get(node, (False, changes.started))[1]
                if e is not None and e.gate is not None:
                    last_seen = max(last_seen, e.gate.since)
                last_seen = max(last_seen, label_since)
                if node in changes.last:
                    if e is not None and e.gate is not None:
                        gate_lat.append(max(0.0, e.gate.since - changes.last[node]))
                    label_lat.append(max(0.0, label_since - changes.last[node]))
        status = cache.get("status") or {}
        busy = after.busy - before.busy
        ours = sum(after.cpu[k] - before.cpu.get(k, 0.0) for k in after.cpu)
        harness = after.harness - before.harness
        wall = after.at - before.at
        record: dict[str, Any] = {
            "wave": name,
            "nodes_changed": len(changes.last),
            "report_writes": changes.reports,
            "other_changes": changes.other,
            "changes_seconds": round(changes.ended - changes.started, 2),
            "converged": result["converged"],
            "gate_latency_s": percentiles(gate_lat),
            "label_latency_s": percentiles(label_lat),
            # From the wave's last change to the last gate or label reaching its value.
            "total_s": (round(max(0.0, last_seen - changes.ended), 3)
                        if result["converged"] else None),
            "status_s": (round(max(0.0, result["status_at"] - changes.ended), 3)
                         if result.get("status_at") else None),
            "operator": {
                "requests": op,
                "writes": writes,
                "writes_per_change": round(writes / change_count, 3) if change_count else None,
                "status_writes": op.get(f"patch {names.PLURAL}/status", 0),
                "writes_per_node": round(writes / len(self.nodes), 2),
                "cpu_s": round(after.cpu["operator"] - before.cpu["operator"], 2),
                "peak_rss_mib": round(self.rss.take() / 2**20, 1),
            },
            "daemon_requests": daemon,
            "status_bytes": len(json.dumps(status, separators=(",", ":"))),
            "object_bytes": len(json.dumps(cache, separators=(",", ":"))),
            "status_nodes_listed": len(status.get("nodes") or []),
            "status_ready": status.get("ready"),
            "gate_values_seen": self.view.gate_changes,
            "apiserver_requests_all_clients": dict(
                list(apimetrics.all_clients_delta(before.counts, after.counts).items())[:25]),
            "cpu_s": {
                **{k: round(after.cpu[k] - before.cpu.get(k, 0.0), 2) for k in after.cpu},
                "harness": round(harness, 2),
                "others_on_machine": round(max(0.0, busy - ours - harness), 2),
                "machine_busy": round(busy, 2),
            },
            **changes.extra,
            "wall_s": round(wall, 1),
            "loadavg_end": apimetrics.loadavg(),
            "report_retries": dict(self.daemons.failed),
        }
        if not result["converged"]:
            record["wrong"] = result["wrong"]
        return record

    # ------------------------------------------------------------------ waves

    def run(self) -> dict[str, Any]:
        steps: list[tuple[str, Callable[[], Changes], Callable[[str], Expect],
                          Callable[[], int]]] = [
            ("install", self.act_install,
             lambda _: closed(gate.DAEMON_NOT_READY, message="no report yet"), lambda: 0),
            ("loading", self.act_loading,
             lambda _: closed(gate.DAEMON_NOT_READY, message=" is Loading"), lambda: 0),
            ("ready", self.act_ready, lambda n: opened(self.reported[n]), lambda: self.o.nodes),
            ("degrade", self.act_degrade, self.expect_degraded,
             lambda: self.o.nodes - len(self.bad)),
            ("spec", self.act_spec, lambda n: opened(self.reported[n]), lambda: self.o.nodes),
            # Engine pods bound to the generation they run, as the webhook binds them.
            ("bind", self.act_bind, lambda n: opened(self.reported[n]), lambda: self.o.nodes),
            # A model change under bound engines: each stays open until its node's daemon
            # is replaced, then closes (no daemon holds its weights); the labels follow
            # the new generation.
            ("model", self.act_model,
             lambda _: Expect("False", frozenset({gate.FINGERPRINT_MISMATCH}), True),
             lambda: self.o.nodes),
            # The model changed back: each opens again once its node holds its weights.
            ("rollback", self.act_rollback, lambda n: opened(self.reported[n]),
             lambda: self.o.nodes),
            # Another model, node by node: every engine evicted, made again for the new one.
            ("nodebynode", self.act_node_by_node, lambda n: opened(self.reported[n]),
             lambda: self.o.nodes),
            # Another model by Surge: each bound gate open throughout, on the node's new
            # daemon pod keeping the engines' generation beside the new one.
            ("surge", self.act_surge, lambda n: opened(self.reported[n]),
             lambda: self.o.nodes),
        ]
        waves = [self.wave_start()]
        for name, act, expect, ready in steps:
            if name in self.o.skip_waves:
                continue
            if not waves[-1]["converged"] and self.o.stop_on_timeout:
                say(f"wave {waves[-1]['wave']} did not converge within "
                    f"{self.o.wave_timeout:.0f} s; stopping")
                break
            waves.append(self.wave(name, act, expect, ready))
        return {"options": {k: (str(v) if isinstance(v, Path) else v)
                            for k, v in dataclasses.asdict(self.o).items()},
                "operator_source": str(self.o.operator_src or REPO),
                "waves": waves}

    def wave_start(self) -> dict[str, Any]:
        """The operator starting with every engine pod already there and no cache yet."""
        say("wave start")
        # Counted from before the operator starts: its first writes land within a second.
        before = self.snapshot()
        self.start_operator()
        self.rss.take()
        changes = Changes(started=before.at)
        result = self.converge(lambda _: closed(gate.NO_WEIGHTCACHE), None, changes.started)
        settled = self.settle() if result["converged"] else 0.0
        after = self.snapshot()
        record = self.record("start", changes, result, before, after, {})
        record["settle_s"] = round(settled, 1)
        return record

    def act_install(self) -> Changes:
        assert self.cluster is not None
        changes = Changes(started=time.monotonic())
        apply(self.cluster, weightcache(self.o.gpus, "r1", self.o.max_unavailable))
        changes.other = 1
        daemons = self._until("a daemon pod running on every node",
                              lambda: self._all_running(None), self.o.wave_timeout)
        self.spec_hash = next(iter(daemons.values())).spec_hash
        return changes

    def _schedulable(self) -> bool:
        listing = self.api.get("/api/v1/nodes")
        return all(not any(t.get("effect") == "NoSchedule" for t in n["spec"].get("taints") or [])
                   for n in listing["items"])

    def _all_running(self, spec_hash: str | None) -> dict[str, DaemonPod] | None:
        pods = self.view.running_daemons()
        if spec_hash is not None:
            pods = {n: p for n, p in pods.items() if p.spec_hash == spec_hash}
        return pods if len(pods) == len(self.nodes) else None

    def act_loading(self) -> Changes:
        assert self.daemons is not None
        pods = self.view.running_daemons()
        reports = [Report(pods[n], slot, "loading", self.spec_hash, 0, SHARD_BYTES)
                   for n in self.nodes for slot in range(self.o.gpus)]
        return self.write_all(reports, [0.0] * len(reports))

    def act_ready(self) -> Changes:
        pods = self.view.running_daemons()
        reports = [Report(pods[n], slot, "ready", self.spec_hash, SHARD_BYTES, SHARD_BYTES)
                   for n in self.nodes for slot in range(self.o.gpus)]
        rng = random.Random(self.o.seed)
        offsets = [rng.uniform(0, self.o.ready_seconds) for _ in reports]
        self.reported = {n: pods[n].name for n in self.nodes}
        self.ready_uids = {pods[n].uid for n in self.nodes}
        return self.write_all(reports, offsets)

    def act_degrade(self) -> Changes:
        pods = self.view.running_daemons()
        self.bad = degraded_nodes(self.nodes, self.o.degrade_fraction, self.o.seed)
        reports, deleted = [], []
        wrong_hash = hashlib.sha256(b"a spec nobody asked for").hexdigest()
        for node, kind in sorted(self.bad.items()):
            pod = pods[node]
            if kind == "fingerprint":
                reports.append(Report(pod, 0, "ready", wrong_hash, SHARD_BYTES, SHARD_BYTES))
            elif kind == "bytes":
                reports.append(Report(pod, 0, "ready", self.spec_hash, SHARD_BYTES // 2,
                                      SHARD_BYTES))
            else:
                deleted.append(pod)
        changes = self.write_all(reports, [0.0] * len(reports))
        for pod in deleted:
            self.api.request("DELETE",
                             f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/pods/{pod.name}")
            changes.note(pod.node or "", time.monotonic())
            changes.other += 1
        return changes

    def expect_degraded(self, node: str) -> Expect:
        kind = self.bad.get(node)
        if kind is None:
            return opened(self.reported[node])
        if kind == "fingerprint":
            return closed(gate.FINGERPRINT_MISMATCH)
        if kind == "bytes":
            return closed(gate.BYTES_BELOW_EXPECTED)
        return closed(gate.DAEMON_NOT_READY, gate.NO_DAEMON_ON_NODE)

    def act_spec(self) -> Changes:
        return self.roll_to("r2")

    def act_bind(self) -> Changes:
        """Every engine pod bound to the generation its node holds (the spec's)."""
        changes = Changes(started=time.monotonic())
        body = {"metadata": {"annotations": {names.binding_key(NAMESPACE, CACHE):
                                             self.spec_hash}}}

        def bind(node: str) -> None:
            self.api.request("PATCH", f"/api/v1/namespaces/{NAMESPACE}/pods/engine-{node}",
                             body, content_type="application/merge-patch+json")

        with ThreadPoolExecutor(self.o.writers) as pool:
            list(pool.map(bind, self.nodes))
        changes.other = len(self.nodes)
        self.bound_to = dict.fromkeys(self.nodes, self.spec_hash)
        self.binding = (self.spec_hash, BindingWatch())
        return changes

    def act_model(self) -> Changes:
        self.before_model = self.revision
        return self.roll_to("r3")

    def act_rollback(self) -> Changes:
        return self.roll_to(self.before_model)

    def act_node_by_node(self) -> Changes:
        """A new revision under `rollout.strategy: NodeByNode`. The operator evicts each
        node's engine pod, then its daemon pod; each new daemon pod loads and reports, and
        each evicted engine is created again bound to the new generation."""
        assert self.daemons is not None
        old, revision = self.spec_hash, "r4"
        new = spec_hash(parse_spec(weightcache(self.o.gpus, revision,
                                               self.o.max_unavailable)["spec"]))
        budget = rollout.unavailable_budget(self.o.max_unavailable, len(self.nodes))
        self.binding = None  # each engine pod is judged below by its own generation
        changes = Changes(started=time.monotonic())
        self.api.request(
            "PATCH", f"/apis/{names.GROUP}/{names.VERSION}/namespaces/{NAMESPACE}/"
            f"{names.PLURAL}/{CACHE}",
            {"spec": {"model": {"revision": revision}, "rollout": {"strategy": "NodeByNode"}}},
            content_type="application/merge-patch+json")
        changes.other = 1
        watch, gates_watch = NodeByNodeWatch(), BindingWatch()
        recreated: set[str] = set()
        done: dict[str, DaemonPod] = {}
        futures = []
        deadline = changes.started + self.o.wave_timeout
        pool = ThreadPoolExecutor(self.o.writers, thread_name_prefix="nodebynode")
        try:
            while time.monotonic() < deadline and (
                    len(done) < len(self.nodes) or len(recreated) < len(self.nodes)):
                assert self.watch is not None
                self.watch.check()
                now = time.monotonic()
                running = self.view.running_daemons()
                with self.view.lock:
                    gates = {e.name: e.gate for e in self.view.engines.values()}
                seen: dict[str, tuple[bool, bool, bool]] = {}
                for node in self.nodes:
                    # A new name, as a Deployment's new pod has (kwok may still be deleting
                    # the evicted one by its name).
                    was, now_named = f"engine-{node}", f"engine-{node}-{revision}"
                    if was not in gates and node not in recreated:
                        body = engine_pod(node)
                        body["metadata"]["name"] = now_named
                        body["metadata"]["annotations"] = {
                            names.binding_key(NAMESPACE, CACHE): new}
                        self.api.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", body)
                        recreated.add(node)
                        self.engine_names[node], self.bound_to[node] = now_named, new
                    pod = running.get(node)
                    fresh = pod is not None and pod.spec_hash == new
                    if fresh and (node not in done or done[node].uid != pod.uid):
                        done[node] = pod
                        futures.append(pool.submit(self._load, pod, changes))
                    # In flight as the operator counts it: until the new daemon pod is Ready
                    # (kwok's readiness follows its reports).
                    seen[node] = (was in gates, fresh, fresh and pod.ready)
                    for name, bound in ((was, old), (now_named, new)):
                        if name in gates:
                            held = (pod is not None and pod.spec_hash == bound
                                    and pod.uid in self.ready_uids)
                            gates_watch.observe(now, f"{node}/{bound[:12]}", held, gates[name])
                watch.poll(now, seen)
                time.sleep(POLL)
            for f in futures:
                f.result()
        finally:
            pool.shutdown(wait=True)
        changes.extra["rollout_s"] = round(time.monotonic() - changes.started, 1)
        changes.extra["node_by_node"] = watch.figures(budget)
        changes.extra["bound_engines"] = gates_watch.figures()
        self.spec_hash = new
        self.reported = {n: done[n].name if n in done else "<not rolled>" for n in self.nodes}
        return changes

    def _load(self, pod: DaemonPod, changes: Changes) -> None:
        """A new daemon pod loads: each GPU reports Loading, then Ready."""
        self._reports(pod, "loading", changes)
        self._reports(pod, "ready", changes)

    def _reports(self, pod: DaemonPod, state: str, changes: Changes,
                 kept: tuple[Kept, ...] = ()) -> None:
        """Each GPU of a new daemon pod reports `state` (loading: nothing held yet; ready:
        the shard); with `kept`, each report keeps those generations beside the new one
        (as a daemon under Surge that took them back from the engines on its node)."""
        assert self.daemons is not None
        if kept:
            # Kept from its first report on (the engines' weights, taken back).
            self.retaining[pod.uid] = kept[0].spec_hash
        held = SHARD_BYTES if state == "ready" else 0
        phase = PHASE_LOADING if kept and state == "loading" else None
        for slot in range(self.o.gpus):
            if state == "ready" and slot == self.o.gpus - 1:
                # Held from the last report on: the operator cannot open before it
                # lands, and the watch may show the gate before this write returns.
                self.ready_uids.add(pod.uid)
            when = self.daemons.write(
                Report(pod, slot, state, pod.spec_hash, held, SHARD_BYTES, kept, phase))
            with self._changes_lock:
                changes.reports += 1
                changes.note(pod.node or "", when)

    def observe_bindings(self) -> None:
        """One poll of the bound engine pods' gates against what their nodes hold."""
        if self.binding is None:
            return
        bound, watch = self.binding
        now = time.monotonic()
        running = self.view.running_daemons()
        with self.view.lock:
            gates = {e.node: e.gate for e in self.view.engines.values()}
        for node in self.nodes:
            watch.observe(now, node, self.holds(bound, running.get(node)), gates.get(node))

    def holds(self, bound: str, pod: DaemonPod | None) -> bool:
        """Whether a node's running daemon pod holds generation `bound`: its own, reported
        Ready, or kept beside its own (reported in `retained`)."""
        return pod is not None and (
            (pod.spec_hash == bound and pod.uid in self.ready_uids)
            or self.retaining.get(pod.uid) == bound)

    def act_surge(self) -> Changes:
        """Every engine pod bound to the current generation, then another revision under
        `rollout.strategy: Surge`: the DaemonSet controller replaces each node's daemon
        pod; each new one reports Loading, then Ready, keeping the old generation."""
        assert self.daemons is not None and self.watch is not None
        old, revision = self.spec_hash, "r5"
        new = spec_hash(parse_spec(weightcache(self.o.gpus, revision,
                                               self.o.max_unavailable)["spec"]))
        budget = rollout.unavailable_budget(self.o.max_unavailable, len(self.nodes))
        changes = Changes(started=time.monotonic())
        changes.other = self._bind_engines(old)
        kept = (Kept(old, SHARD_BYTES, SHARD_BYTES),)  # what the engines map, taken back
        gates_watch, surge = BindingWatch(grace=0.0), SurgeWatch()
        self.binding = (old, gates_watch)
        with self.view.lock:
            self.closings_from = dict(self.view.closings)
        self.api.request(
            "PATCH", f"/apis/{names.GROUP}/{names.VERSION}/namespaces/{NAMESPACE}/"
            f"{names.PLURAL}/{CACHE}",
            {"spec": {"model": {"revision": revision},
                      "rollout": {"strategy": "Surge",
                                  "maxUnavailable": self.o.max_unavailable}}},
            content_type="application/merge-patch+json")
        changes.other += 1
        self.revision = revision
        done: dict[str, DaemonPod] = {}
        # Each new pod's Loading reports go first, as each daemon writes its own at once; its
        # Ready reports wait for free writers. The DaemonSet controller replaces the next
        # nodes' pods once these are Ready, which kwok makes them when their reports say so.
        loading: list[tuple[DaemonPod, Any]] = []  # Loading being reported
        loaded: list[DaemonPod] = []  # Loading reported, Ready not submitted yet
        ready: list[Any] = []
        deadline = changes.started + self.o.wave_timeout
        pool = ThreadPoolExecutor(self.o.writers, thread_name_prefix="surge")
        try:
            def poll() -> None:
                """One look at every node: new daemon pods start loading; gates checked."""
                self.watch.check()
                now = time.monotonic()
                running = self.view.running_daemons()
                with self.view.lock:
                    gates = {e.name: e.gate for e in self.view.engines.values()}
                seen: dict[str, tuple[bool, bool, bool]] = {}
                for node in self.nodes:
                    pod = running.get(node)
                    fresh = pod is not None and pod.spec_hash == new
                    if pod is not None and fresh and (
                            node not in done or done[node].uid != pod.uid):
                        done[node] = pod
                        loading.append(
                            (pod, pool.submit(self._reports, pod, "loading", changes, kept)))
                    seen[node] = (
                        pod is not None and not fresh and self.holds(old, pod),
                        pod is not None and fresh and self.retaining.get(pod.uid) == old,
                        pod is not None and fresh and pod.uid in self.ready_uids)
                for node, held in surge.poll(now, seen).items():
                    gates_watch.observe(now, node, held, gates.get(self.engine_names[node]))

            while time.monotonic() < deadline and not (
                    len(done) == len(self.nodes) and not loading and not loaded
                    and all(f.done() for f in ready)):
                poll()
                for pod, future in [x for x in loading if x[1].done()]:
                    future.result()  # a failed write ends the wave
                    loading.remove((pod, future))
                    loaded.append(pod)
                busy = len(loading) + sum(not f.done() for f in ready)
                while loaded and busy < self.o.writers:
                    ready.append(pool.submit(self._reports, loaded.pop(0), "ready", changes,
                                             kept))
                    busy += 1
                time.sleep(POLL)
            for f in [f for _, f in loading] + ready:
                f.result()
            poll()  # the last Ready reports landed after the loop's last look
        finally:
            pool.shutdown(wait=True)
        self.spec_hash = new
        changes.extra["rollout_s"] = round(time.monotonic() - changes.started, 1)
        changes.extra["surge"] = surge.figures(time.monotonic(), budget)
        self.reported = {n: done[n].name if n in done else "<not rolled>" for n in self.nodes}
        return changes

    def _bind_engines(self, generation: str) -> int:
        """Bind every engine pod not bound to `generation` to it (the waves before may have
        left them unbound, or bound to another); waits, bounded, for their gates to open.
        The number of pods bound."""
        stray = [n for n in self.nodes if self.bound_to.get(n) != generation]
        body = {"metadata": {"annotations": {names.binding_key(NAMESPACE, CACHE): generation}}}

        def bind(node: str) -> None:
            self.api.request(
                "PATCH", f"/api/v1/namespaces/{NAMESPACE}/pods/{self.engine_names[node]}",
                body, content_type="application/merge-patch+json")
            self.bound_to[node] = generation

        with ThreadPoolExecutor(self.o.writers) as pool:
            list(pool.map(bind, stray))
        if stray:
            deadline = time.monotonic() + self.o.wave_timeout
            while time.monotonic() < deadline:
                with self.view.lock:
                    gates = {e.name: e.gate for e in self.view.engines.values()}
                if all((g := gates.get(self.engine_names[n])) is not None and g.status == "True"
                       for n in self.nodes):
                    break
                time.sleep(POLL)
        return len(stray)

    def roll_to(self, revision: str) -> Changes:
        """The cache's model revision set to `revision`; each daemon pod the DaemonSet's
        rollout creates loads and reports (Loading, then Ready)."""
        assert self.cluster is not None and self.daemons is not None
        old = self.spec_hash
        self.revision = revision
        changes = Changes(started=time.monotonic())
        self.api.request(
            "PATCH", f"/apis/{names.GROUP}/{names.VERSION}/namespaces/{NAMESPACE}/"
            f"{names.PLURAL}/{CACHE}", {"spec": {"model": {"revision": revision}}},
            content_type="application/merge-patch+json")
        changes.other = 1
        done: dict[str, DaemonPod] = {}
        futures = []
        deadline = changes.started + self.o.wave_timeout
        pool = ThreadPoolExecutor(self.o.writers, thread_name_prefix="rollout")
        try:
            while len(done) < len(self.nodes) and time.monotonic() < deadline:
                assert self.watch is not None
                self.watch.check()
                self.observe_bindings()
                for node, pod in self.view.running_daemons().items():
                    if pod.spec_hash != old and (node not in done or done[node].uid != pod.uid):
                        done[node] = pod
                        self.spec_hash = pod.spec_hash
                        futures.append(pool.submit(self._load, pod, changes))
                        # The DaemonSet controller's pace (maxUnavailable), not the operator's.
                        changes.extra["rollout_s"] = round(time.monotonic() - changes.started, 1)
                time.sleep(POLL)
            for f in futures:
                f.result()
        finally:
            pool.shutdown(wait=True)
        self.reported = {n: p.name for n, p in done.items()}
        self.bad = {}
        if len(done) < len(self.nodes):
            missing = sorted(set(self.nodes) - set(done))
            self.reported.update({n: "<not rolled>" for n in missing})
        return changes

    def write_all(self, reports: list[Report], offsets: list[float]) -> Changes:
        """Write `reports`, each at its offset (seconds) from now; when each node's last landed."""
        assert self.daemons is not None
        changes = Changes(started=time.monotonic())
        order = sorted(range(len(reports)), key=lambda i: offsets[i])
        pending = []
        for i in order:
            delay = changes.started + offsets[i] - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            pending.append((reports[i], self.daemons.submit(reports[i])))
        wait([f for _, f in pending])
        for report, future in pending:
            changes.note(report.pod.node or "", future.result())
        changes.reports = len(reports)
        return changes

    def _until(self, what: str, probe: Callable[[], Any], bound: float,
               every: float = POLL) -> Any:
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            if self.watch is not None:
                self.watch.check()
            value = probe()
            if value:
                return value
            time.sleep(every)
        raise RuntimeError(f"never reached: {what}")


def summarize(wrong: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """How many gates and labels were still wrong, with a few examples."""
    return {kind: {"count": len(items), "examples": dict(list(sorted(items.items()))[:5])}
            for kind, items in wrong.items()}


# --------------------------------------------------------------------------- objects


def policy() -> dict[str, Any]:
    return {
        "setupImage": "localhost/weightcache-operator:scale",
        "sidecarImage": "localhost/weightcache-sidecar:scale",
        "daemonServiceAccount": DAEMON_SA,
        "daemonNamespace": OPERATOR_NAMESPACE,
        "allowedHostPaths": {"socketDirs": [SOCKET_ROOT], "modelDirs": [MODEL_ROOT]},
        "allowedTransports": ["auto", "vmm_fd", "memfd", "torch_ipc"],
        # The GPU example's visible-devices needs the images restricted.
        "allowedGpuAccessModes": ["visible-devices", "device-plugin", "dra"],
        "allowedSidecarImagePrefixes": ["localhost/"],
        "allowedTolerations": [msgspec.to_builtins(GPU_TAINT), PROBED],
    }


def weightcache(gpus: int, revision: str, max_unavailable: int | str) -> dict[str, Any]:
    """The committed GPU example's shape, spanning every GPU node of the cluster."""
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": CACHE, "namespace": NAMESPACE},
        "spec": {
            "model": {"path": f"{MODEL_ROOT}/llama-70b", "revision": revision,
                      "dtype": "bfloat16"},
            "device": "cuda",
            "gpus": {"perNode": gpus, "tpSize": gpus, "shardPlan": "llama"},
            "transport": "vmm_fd",
            "gpuAccess": {"mode": "visible-devices"},
            "socketDir": SOCKET_ROOT,
            "placement": {"nodeSelector": {"nvidia.com/gpu.present": "true"},
                          "tolerations": [PROBED]},
            "engine": {"selector": {"matchLabels": {"app": ENGINE_APP}},
                       "byteTolerance": 0.01},
            "rollout": {"maxUnavailable": max_unavailable},
        },
    }


def unrelated_pod(i: int, node: str) -> dict[str, Any]:
    """A pod of another team's Deployment (~2 KB, as such pods come), bound to `node`. On
    the host's network: kwok's pod range (a /16) holds fewer addresses than the pods a
    100,000-pod run makes."""
    app = f"web-{i % 500:03d}"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{app}-7d9f8c6b5-{i:06d}",
            "labels": {"app": app, "pod-template-hash": "7d9f8c6b5",
                       "app.kubernetes.io/name": app, "app.kubernetes.io/instance": "prod",
                       "app.kubernetes.io/managed-by": "Helm", "team": f"team-{i % 40}"},
            "annotations": {"kubectl.kubernetes.io/restartedAt": "2026-01-01T00:00:00Z",
                            "prometheus.io/scrape": "true", "prometheus.io/port": "9090"},
        },
        "spec": {
            "nodeName": node,
            "hostNetwork": True,
            "terminationGracePeriodSeconds": 0,
            "containers": [{
                "name": "web", "image": f"registry.example/{app}:1.2.3",
                "ports": [{"containerPort": 8080, "name": "http"}],
                "env": [{"name": f"SETTING_{k}", "value": f"value-{k}-{i % 7}"}
                        for k in range(8)],
                "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
            }],
        },
    }


def engine_pod(node: str) -> dict[str, Any]:
    """One engine per node, bound to it, held unready by the weights gate."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"engine-{node}",
                     "labels": {"app": ENGINE_APP, names.GATED_LABEL: names.GATED_VALUE}},
        "spec": {
            "nodeName": node,
            "readinessGates": [{"conditionType": names.GATE_CONDITION}],
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "engine", "image": "engine:1"}],
        },
    }


def report_guard(cluster: Cluster) -> list[dict[str, Any]]:
    """The chart's report guard (ValidatingAdmissionPolicy + binding) for the daemon account
    (in the chart's namespace)."""
    out = cluster.helm("template", "scale", str(CHART), "-n", OPERATOR_NAMESPACE,
                       "--show-only", "templates/daemon-report-guard.yaml").stdout
    return [d for d in yaml.safe_load_all(out) if d]


def say(message: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- entry


def run(options: Options, work: Path) -> dict[str, Any]:
    """One fleet size, start to finish, on a control plane of its own."""
    work.mkdir(parents=True, exist_ok=True)
    # SIGTERM runs the clean-up too: the operator and the control plane stop.
    interrupt_on_termination()
    started = time.monotonic()
    load_before = apimetrics.loadavg()
    with FleetRun(options, work) as fleet:
        result = fleet.run()
    result["loadavg_before"] = load_before
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result


def suite(work: Path, sizes: Iterable[int], **options: Any) -> dict[str, Any]:
    """`--suite scale`: each fleet size in turn, every figure per wave."""
    out: dict[str, Any] = {"sizes": {}}
    for nodes in sizes:
        out["sizes"][str(nodes)] = run(Options(nodes=nodes, **options), work / f"scale-{nodes}")
    return out
