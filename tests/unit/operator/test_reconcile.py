"""The reconcile passes without a cluster: plain-dict indices in, recorded writes out.

tests/k8s run the same passes under kopf against a real apiserver; here each
rule of the passes is pinned on its own (what is written, when, and what is
not written), including the failures a real apiserver produces rarely.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from typing import Any

import kopf
import pytest
from kubernetes.client.exceptions import ApiException

from tests.unit.operator.builders import GIB, annotations, device_report
from weightcache.report import RetainedReport
from weightcache_operator import aggregate, gate, names, reconcile, render, rollout
from weightcache_operator.policy import HostPaths, Policy
from weightcache_operator.reconcile import Reconciler
from weightcache_operator.shape import shape_digest
from weightcache_operator.spec import parse_spec, spec_hash
from weightcache_operator.state import State
from weightcache_operator.views import (
    CacheView,
    Condition,
    DaemonPodView,
    DaemonSetView,
    EnginePodView,
    NodeView,
)

NS, NAME, UID, NODE = "team", "wc", "cache-uid", "node-a"
# Where the daemons run (the policy's daemonNamespace), never the cache's namespace.
SYSTEM = "weightcache-system"
SPEC = {
    "model": {"path": "/models/m"},
    "device": "cpu",
    "engine": {"selector": {"matchLabels": {"app": "engine"}}},
}
DIGEST = spec_hash(parse_spec(SPEC))
LABEL = names.node_label_name(NS, NAME)
POLICY = Policy(
    setup_image="op:1", sidecar_image="side:1", daemon_namespace=SYSTEM,
    allowed_host_paths=HostPaths(("/var/run/weightcache",), ("/models",)),
)
# The shape of the pods the operator renders for the cache (shape.py).
SHAPE = shape_digest(render.render_daemonset(
    render.CacheRef(NS, NAME, UID, 1), parse_spec(SPEC), DIGEST, POLICY, 65532,
)["spec"]["template"]["spec"])


class RecordingKube:
    """The operator's writes, recorded; `refuse` makes one kind of write fail."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, Any]] = []
        self.applied: list[Mapping[str, Any]] = []
        self.events: list[tuple[str, str]] = []
        self.refuse: dict[str, int] = {}
        self.conditions: dict[str, Condition] = {}

    def _write(self, kind: str, what: Any) -> None:
        if kind in self.refuse:
            raise ApiException(status=self.refuse[kind], reason="Refused")
        self.writes.append((kind, what))

    async def apply_daemonset(self, manifest: Mapping[str, Any]) -> None:
        self._write("daemonset", manifest["metadata"]["name"])
        self.applied.append(manifest)

    async def restore_daemonset_template(self, namespace: str, name: str, uid: str,
                                         template: Mapping[str, Any]) -> None:
        self._write("restore", (name, uid))

    async def delete_daemonset(self, namespace: str, name: str, uid: str | None) -> None:
        self._write("delete", (namespace, name, uid))

    async def replace_cache_status(self, namespace: str, name: str,
                                   status: Mapping[str, Any]) -> None:
        self._write("status", dict(status))

    async def set_pod_condition(self, namespace: str, name: str,
                                condition: Mapping[str, Any], uid: str | None = None) -> None:
        self._write("gate", (name, condition["status"], condition["reason"]))
        self.conditions[name] = Condition(
            condition["status"], condition["reason"], condition["message"])

    async def patch_node_labels(self, node: str, labels: Mapping[str, str | None]) -> None:
        self._write("labels", (node, dict(labels)))

    async def evict_pod(self, namespace: str, name: str, uid: str) -> None:
        self._write("evict", (namespace, name, uid))

    def post_event(self, obj: Mapping[str, Any], type: str, reason: str, message: str) -> None:
        self.events.append((obj["kind"], reason))

    def of(self, kind: str) -> list[Any]:
        return [what for k, what in self.writes if k == kind]


def cache(generation: int = 1, spec: dict | None = None, deleting: bool = False,
          namespace: str = NS, status: Mapping[str, Any] | None = None,
          version: str = "1") -> CacheView:
    return CacheView(namespace, NAME, UID if namespace == NS else f"{namespace}-uid", generation,
                     spec or SPEC, status or {}, deleting, version)


def daemonset(render_hash: str | None = None, applied: int | None = 1,
              cache_uid: str = UID, template_shape: str = SHAPE,
              shapes: tuple[str, ...] = (SHAPE,)) -> DaemonSetView:
    return DaemonSetView(SYSTEM, names.daemonset_name(NS, NAME), "ds-uid", None, NAME, 1, 1, 1,
                         1, applied, render_hash, NS, cache_uid, template_shape, shapes)


def legacy_daemonset() -> DaemonSetView:
    """The layout before daemons moved: in the cache's namespace, owned by the cache."""
    return DaemonSetView(NS, names.legacy_daemonset_name(NAME), "old-ds-uid", UID, NAME, 1, 1,
                         1, 1, 1, "h")


def daemon_pod(name: str = "wc-abc", controller: str | None = "ds-uid", ready: bool = True,
               reports: Mapping[str, str] | None = None, node: str = NODE,
               state: str = "Ready") -> DaemonPodView:
    if reports is None:
        reports = annotations(device_report("cpu", DIGEST, node, preloaded=GIB, expected=GIB,
                                            state=state))
    return DaemonPodView(SYSTEM, name, NAME, node, "Running", ready, False, dict(reports),
                         DIGEST, "2026-01-01T00:00:00Z", controller, NS, shape=SHAPE)


def engine(gate_now: Condition | None = None, name: str = "engine-1", node: str = NODE,
           version: str = "1") -> EnginePodView:
    return EnginePodView(NS, name, f"uid-{name}", {"app": "engine"}, node, gate_now, False,
                         version)


def state(caches: list[CacheView] | None = None, pods: list[DaemonPodView] | None = None,
          ds: DaemonSetView | list[DaemonSetView] | None = None,
          engines: list[EnginePodView] | None = None,
          labels: frozenset[str] = frozenset()) -> State:
    caches = [cache()] if caches is None else caches
    by_ns: dict[str, list[CacheView]] = {}
    for c in caches:
        by_ns.setdefault(c.namespace, []).append(c)
    # Keyed as handlers.py keys the kopf indices: pods by node.
    by_node: dict[tuple[str, str, str | None], list[DaemonPodView]] = {}
    for p in [daemon_pod()] if pods is None else pods:
        by_node.setdefault((p.cache_namespace or p.namespace, p.cache, p.node), []).append(p)
    engines_by_node: dict[tuple[str, str | None], list[EnginePodView]] = {}
    for e in [engine()] if engines is None else engines:
        engines_by_node.setdefault((e.namespace, e.node), []).append(e)
    return State(
        caches=by_ns,
        daemonsets={(NS, NAME): ds if isinstance(ds, list) else [ds or daemonset()]},
        daemon_pods_index=by_node,
        engine_pods_index=engines_by_node,
        nodes={NODE: [NodeView(NODE, labels, "1")]},
        daemon_namespace=SYSTEM,
    )


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture
def kube() -> RecordingKube:
    return RecordingKube()


@pytest.fixture
def reconciler(kube: RecordingKube) -> Reconciler:
    return Reconciler(kube, POLICY, operator_uid=65532)


def test_a_verified_node_opens_the_gate_labels_the_node_and_writes_status(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    run(reconciler.cache(state(), NS, NAME))
    (status,) = kube.of("status")
    assert (status["phase"], status["ready"], status["nodeLabel"]) == (
        "Ready", "1/1", names.node_label_key(NS, NAME))
    assert kube.of("labels") == [(NODE, {names.NODE_LABEL_PREFIX + LABEL: "Ready"})]
    assert kube.of("gate") == [("engine-1", "True", gate.WEIGHTS_RESIDENT)]
    assert ("Pod", gate.WEIGHTS_RESIDENT) in kube.events


def test_nothing_is_written_twice(kube: RecordingKube, reconciler: Reconciler) -> None:
    run(reconciler.cache(state(), NS, NAME))
    written = len(kube.writes)
    # The indices catch up with what was written: a second pass writes nothing.
    caught_up = state(engines=[engine(kube.conditions["engine-1"])], labels=frozenset({LABEL}))
    stored = CacheView(NS, NAME, UID, 1, SPEC, kube.of("status")[0], False)
    caught_up = State({NS: [stored]}, caught_up.daemonsets, caught_up.daemon_pods_index,
                      caught_up.engine_pods_index, caught_up.nodes, SYSTEM)
    run(reconciler.cache(caught_up, NS, NAME))
    assert kube.writes[written:] == []


def test_the_daemonset_is_rendered_once_per_generation_and_applied_only_when_stale(
    kube: RecordingKube, reconciler: Reconciler, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    real = render.render_daemonset
    monkeypatch.setattr(render, "render_daemonset",
                        lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    fresh = state(ds=daemonset(applied=None))
    run(reconciler.apply_daemonset(fresh, cache()))
    run(reconciler.cache(fresh, NS, NAME))
    run(reconciler.apply_daemonset(fresh, cache()))
    assert len(calls) == 1
    # the index never caught up
    assert kube.of("daemonset") == [names.daemonset_name(NS, NAME)] * 2
    manifest = reconciler.rendered(cache())
    assert isinstance(manifest, dict)
    current = daemonset(manifest["metadata"]["annotations"][names.RENDER_HASH_ANNOTATION], 1)
    run(reconciler.apply_daemonset(state(ds=current), cache()))
    assert len(kube.of("daemonset")) == 2
    run(reconciler.apply_daemonset(state(ds=current), cache(generation=2)))
    assert len(calls) == 2 and len(kube.of("daemonset")) == 3


def test_a_refused_status_write_still_decides_gates_and_labels(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    """Once, a status the apiserver refused froze every gate of the cache."""
    kube.refuse["status"] = 422
    with pytest.raises(kopf.TemporaryError, match="writing status: 422"):
        run(reconciler.cache(state(), NS, NAME))
    assert kube.of("gate") == [("engine-1", "True", gate.WEIGHTS_RESIDENT)]
    assert kube.of("labels")
    # The daemon pod goes: the gate closes and the label goes, status writes still refused.
    kube.writes.clear()
    gone = state(pods=[], engines=[engine(Condition("True", gate.WEIGHTS_RESIDENT, ""))],
                 labels=frozenset({LABEL}))
    with pytest.raises(kopf.TemporaryError):
        run(reconciler.cache(gone, NS, NAME))
    assert kube.of("gate") == [("engine-1", "False", gate.NO_DAEMON_ON_NODE)]
    assert kube.of("labels") == [(NODE, {names.NODE_LABEL_PREFIX + LABEL: None})]


def test_a_gate_whose_decision_raises_is_closed(
    kube: RecordingKube, reconciler: Reconciler, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(gate, "evaluate_node", broken)
    opened = state(engines=[engine(Condition("True", gate.WEIGHTS_RESIDENT, ""))],
                   labels=frozenset({LABEL}))
    run(reconciler.engine_pod(opened, NS, "engine-1", NODE))
    run(reconciler.node_label(opened, NODE, NS, NAME))
    assert kube.of("gate") == [("engine-1", "False", reconcile.EVALUATION_FAILED)]
    assert kube.of("labels") == [(NODE, {names.NODE_LABEL_PREFIX + LABEL: None})]


def test_look_alike_pods_and_foreign_daemonsets_count_for_nothing(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    impostor = daemon_pod("impostor", controller="someone-else")
    run(reconciler.cache(state(pods=[impostor]), NS, NAME))
    assert kube.of("gate") == [("engine-1", "False", gate.NO_DAEMON_ON_NODE)]
    kube.writes.clear()
    # A DaemonSet with the right labels and name but not owned by the cache
    # (judged by a fresh operator: this one remembers what it wrote).
    foreign = daemonset(cache_uid="other")
    run(Reconciler(kube, POLICY, operator_uid=65532).cache(state(ds=foreign), NS, NAME))
    assert kube.of("gate") == [("engine-1", "False", gate.NO_DAEMON_ON_NODE)]
    assert kube.of("labels") == []
    kube.writes.clear()
    # The right name, labels and annotations in another namespace (one a namespace user may
    # create DaemonSets in), and a pod there naming the real DaemonSet's uid.
    elsewhere = DaemonSetView(NS, names.daemonset_name(NS, NAME), "ds-uid", None, NAME, 1, 1, 1,
                              1, 1, "h", NS, UID)
    forged = DaemonPodView(NS, "forged", NAME, NODE, "Running", True, False,
                           daemon_pod().reports, DIGEST, "", "ds-uid", NS)
    run(Reconciler(kube, POLICY, operator_uid=65532).cache(
        state(ds=elsewhere), NS, NAME))
    run(Reconciler(kube, POLICY, operator_uid=65532).cache(
        state(pods=[forged]), NS, NAME))
    assert kube.of("gate") == [("engine-1", "False", gate.NO_DAEMON_ON_NODE)] * 2
    assert kube.of("labels") == []


def test_a_same_named_cache_elsewhere_has_its_own_label(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    other = cache(namespace="other")
    run(reconciler.cache(state(caches=[cache(), other]), "other", NAME))
    # "other/wc" has no daemon pods: it labels nothing and never touches team/wc's label.
    assert kube.of("labels") == []


def test_a_policy_violation_is_reported_and_nothing_is_applied(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    bad = cache(spec={**SPEC, "socketDir": "/etc"})
    run(reconciler.apply_daemonset(state(caches=[bad]), bad))
    run(reconciler.cache(state(caches=[bad]), NS, NAME))
    assert kube.of("daemonset") == []
    (status,) = kube.of("status")
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "PolicyViolation"
    assert degraded["message"].startswith("spec.socketDir")
    assert ("WeightCache", "PolicyViolation") in kube.events


def test_cleanup_deletes_the_daemonset_closes_gates_and_removes_labels(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    opened = state(engines=[engine(Condition("True", gate.WEIGHTS_RESIDENT, ""))],
                   labels=frozenset({LABEL}))
    run(reconciler.cleanup(opened, NS, NAME, UID))
    # No owner reference reaches the daemon namespace: the finalizer deletes it, by uid.
    assert kube.of("delete") == [(SYSTEM, names.daemonset_name(NS, NAME), "ds-uid")]
    assert kube.of("labels") == [(NODE, {names.NODE_LABEL_PREFIX + LABEL: None})]
    assert kube.of("gate") == [("engine-1", "False", gate.NO_WEIGHTCACHE)]
    kube.writes.clear()
    # Not in the index yet (created a moment ago): deleted by name all the same.
    run(reconciler.cleanup(state(ds=[]), NS, NAME, UID))
    assert kube.of("delete") == [(SYSTEM, names.daemonset_name(NS, NAME), None)]


def test_the_daemonset_is_rendered_into_the_daemon_namespace(reconciler: Reconciler) -> None:
    manifest = reconciler.rendered(cache())
    assert isinstance(manifest, dict)
    meta = manifest["metadata"]
    assert (meta["namespace"], meta["name"]) == (SYSTEM, f"weightcache-{NS}.{NAME}")
    assert "ownerReferences" not in meta
    assert meta["annotations"][names.CACHE_UID_ANNOTATION] == UID
    assert manifest["spec"]["selector"]["matchLabels"][names.CACHE_NAMESPACE_LABEL] == NS


def test_a_recreated_cache_deletes_the_daemonset_an_earlier_one_left_then_applies(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    left = daemonset(cache_uid="earlier-uid")
    run(reconciler.apply_daemonset(state(ds=left, pods=[]), cache()))
    assert kube.of("delete") == [(SYSTEM, names.daemonset_name(NS, NAME), "ds-uid")]
    assert kube.of("daemonset") == []
    # Its pods count for nothing meanwhile: they are not this cache's.
    run(reconciler.cache(state(ds=left), NS, NAME))
    assert kube.of("gate") == [("engine-1", "False", gate.NO_DAEMON_ON_NODE)]
    run(reconciler.apply_daemonset(state(ds=[], pods=[]), cache()))
    assert kube.of("daemonset") == [names.daemonset_name(NS, NAME)]


def test_an_older_layouts_daemonset_keeps_its_gates_until_it_is_migrated(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    """Operator upgrade: the cache's DaemonSet still in its own namespace."""
    old_pod = DaemonPodView(NS, "wc-old", NAME, NODE, "Running", True, False,
                            daemon_pod().reports, DIGEST, "", "old-ds-uid", NS)
    before = state(ds=legacy_daemonset(), pods=[old_pod])
    run(reconciler.cache(before, NS, NAME))
    assert kube.of("gate") == [("engine-1", "True", gate.WEIGHTS_RESIDENT)]
    # 1. The older DaemonSet is deleted; nothing new is applied while its daemons run
    #    (they hold the devices' locks).
    run(reconciler.apply_daemonset(before, cache()))
    assert kube.of("delete") == [(NS, names.legacy_daemonset_name(NAME), "old-ds-uid")]
    run(reconciler.apply_daemonset(state(ds=[], pods=[old_pod]), cache()))
    assert kube.of("daemonset") == []
    # 2. Its last daemon exited: the DaemonSet goes up in the daemon namespace, whose
    #    daemons re-adopt the weights from the running engines.
    run(reconciler.apply_daemonset(state(ds=[], pods=[]), cache()))
    assert kube.of("daemonset") == [names.daemonset_name(NS, NAME)]


def test_a_migration_the_operator_may_not_delete_is_told_in_an_event(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    kube.refuse["delete"] = 403
    with pytest.raises(kopf.TemporaryError, match="deleting DaemonSet team/weightcache-wc"):
        run(reconciler.apply_daemonset(state(ds=legacy_daemonset()), cache()))
    assert ("WeightCache", "DaemonSetNotDeleted") in kube.events
    assert kube.of("daemonset") == []


def test_orphan_labels_are_removed(kube: RecordingKube, reconciler: Reconciler) -> None:
    stale = state(caches=[], labels=frozenset({LABEL, "gone.cache"}))
    run(reconciler.orphan_labels(stale))
    (change,) = kube.of("labels")
    assert change == (NODE, {names.NODE_LABEL_PREFIX + "gone.cache": None,
                             names.NODE_LABEL_PREFIX + LABEL: None})


# --------------------------------------------------------------------------- a fleet


def fleet(n: int) -> tuple[State, list[str]]:
    """`n` nodes, each with a Ready daemon pod and an engine pod; nothing written yet."""
    nodes = [f"node-{i:03d}" for i in range(n)]
    return State(
        caches={NS: [cache()]},
        daemonsets={(NS, NAME): [daemonset()]},
        daemon_pods_index={(NS, NAME, node): [daemon_pod(f"wc-{node}", node=node)]
                           for node in nodes},
        engine_pods_index={(NS, node): [engine(name=f"engine-{node}", node=node)]
                           for node in nodes},
        nodes={node: [NodeView(node, frozenset(), "1")] for node in nodes},
        daemon_namespace=SYSTEM,
    ), nodes


def catch_up(st: State, kube: RecordingKube, version: str = "2") -> None:
    """The indices show what was written, at a newer resourceVersion (the watches caught up)."""
    st.caches[NS][0] = cache(status=kube.of("status")[-1], version=version)  # type: ignore[index]
    for key, (e,) in list(st.engine_pods_index.items()):
        st.engine_pods_index[key] = [  # type: ignore[index]
            dataclasses.replace(e, gate=kube.conditions.get(e.name), resource_version=version)]
    labelled = {node for node, patch in kube.of("labels")
                if patch.get(names.NODE_LABEL_PREFIX + LABEL)}
    for node in list(st.nodes):
        st.nodes[node] = [NodeView(  # type: ignore[index]
            node, frozenset({LABEL}) if node in labelled else frozenset(), version)]


def loading(st: State, node: str) -> None:
    """The node's daemon pod reports Loading: the index holds a new view of it."""
    st.daemon_pods_index[(NS, NAME, node)] = [  # type: ignore[index]
        daemon_pod(f"wc-{node}", node=node, state="Loading")]


@pytest.mark.parametrize("size", [3, 120])
def test_one_report_costs_the_same_work_and_writes_in_any_fleet(
    kube: RecordingKube, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once, one report re-judged every node and rewrote every gate of the namespace."""
    reconciler = Reconciler(kube, POLICY, operator_uid=65532, status_interval=0)
    st, nodes = fleet(size)
    run(reconciler.cache(st, NS, NAME))
    catch_up(st, kube)
    kube.writes.clear()
    judged: list[str] = []
    real = gate.evaluate_node
    monkeypatch.setattr(gate, "evaluate_node",
                        lambda spec, digest, pods, *rest, **kw: judged.extend(p.node for p in pods)
                        or real(spec, digest, pods, *rest, **kw))
    node = nodes[1]
    loading(st, node)

    async def report() -> None:
        await reconciler.daemon_pod(st, NS, NAME, node)
        await reconciler.flush()

    run(report())
    assert judged == [node]  # the status reuses every other node's verdict
    assert kube.of("gate") == [(f"engine-{node}", "False", gate.DAEMON_NOT_READY)]
    assert kube.of("labels") == [(node, {names.NODE_LABEL_PREFIX + LABEL: None})]
    (status,) = kube.of("status")
    assert status["ready"] == f"{size - 1}/{size}"


def test_status_writes_are_coalesced(kube: RecordingKube) -> None:
    """Once, each report wrote the whole status: a ready wave wrote it thousands of times."""
    reconciler = Reconciler(kube, POLICY, operator_uid=65532, status_interval=0.01)
    st, nodes = fleet(20)

    async def wave() -> None:
        reconciler.request_status(st, NS, NAME)
        await asyncio.sleep(0)  # the first request is written at once
        for node in nodes:
            loading(st, node)
            await reconciler.daemon_pod(st, NS, NAME, node)
        await reconciler.flush()

    run(wave())
    first, last = kube.of("status")  # twenty changes in one trailing write
    assert (first["readyNodes"], last["readyNodes"]) == (20, 0)


def test_a_status_write_that_fails_is_retried(
    kube: RecordingKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reconcile, "RETRY_SECONDS", 0)
    reconciler = Reconciler(kube, POLICY, operator_uid=65532, status_interval=0)
    kube.refuse["status"] = 500
    st, _ = fleet(2)

    async def refused_then_accepted() -> None:
        reconciler.request_status(st, NS, NAME)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        del kube.refuse["status"]
        await reconciler.flush()

    run(refused_then_accepted())
    assert [s["readyNodes"] for s in kube.of("status")] == [2]


def test_a_lagging_index_repeats_no_write_but_an_edit_is_undone(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    """Once, every pass before the watch caught up wrote the same gate, label and status again."""
    st = state()
    run(reconciler.cache(st, NS, NAME))
    assert len(kube.writes) == 3
    run(reconciler.cache(st, NS, NAME))  # the indices still show version "1"
    assert len(kube.writes) == 3
    # Someone removes the label and closes the gate: the indices show newer versions.
    st.nodes[NODE] = [NodeView(NODE, frozenset(), "7")]  # type: ignore[index]
    st.engine_pods_index[(NS, NODE)] = [  # type: ignore[index]
        engine(Condition("False", "Edited", ""), version="7")]
    run(reconciler.cache(st, NS, NAME))
    assert kube.of("labels")[-1] == (NODE, {names.NODE_LABEL_PREFIX + LABEL: "Ready"})
    assert kube.of("gate")[-1] == ("engine-1", "True", gate.WEIGHTS_RESIDENT)
    assert len(kube.of("status")) == 1


def test_a_decision_reverted_before_the_index_caught_up_is_written(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    """The index still shows the old value, but our write in flight says otherwise."""
    closed = engine(Condition("False", gate.DAEMON_NOT_READY, "daemon pod wc-abc: no report yet"))
    st = state(engines=[closed])
    run(reconciler.engine_pod(st, NS, "engine-1", NODE))
    assert kube.of("gate") == [("engine-1", "True", gate.WEIGHTS_RESIDENT)]
    # The daemon pod goes before the watch shows the open gate: it closes again.
    st.daemon_pods_index.clear()  # type: ignore[attr-defined]
    run(reconciler.engine_pod(st, NS, "engine-1", NODE))
    assert kube.of("gate")[-1] == ("engine-1", "False", gate.NO_DAEMON_ON_NODE)


def test_node_events_are_posted_once_however_few_nodes_the_status_lists(
    kube: RecordingKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once, every status write announced again each ready node the capped status left out."""
    monkeypatch.setattr(aggregate, "MAX_STATUS_NODES", 2)
    reconciler = Reconciler(kube, POLICY, operator_uid=65532, status_interval=0)
    st, nodes = fleet(6)
    run(reconciler.cache(st, NS, NAME))
    catch_up(st, kube)
    for node in nodes[:3]:
        loading(st, node)
        run(reconciler.daemon_pod(st, NS, NAME, node))
        run(reconciler.flush())
        catch_up(st, kube, version=f"v-{node}")
    wc_events = [reason for kind, reason in kube.events if kind == "WeightCache"]
    # The first status announced all six; none is announced again.
    assert wc_events.count("NodeReady") == 6
    assert wc_events.count(gate.DAEMON_NOT_READY) == 3


@pytest.mark.parametrize("listed", [2, 200])
def test_a_restarted_operator_announces_nothing_that_stands(
    kube: RecordingKube, monkeypatch: pytest.MonkeyPatch, listed: int
) -> None:
    monkeypatch.setattr(aggregate, "MAX_STATUS_NODES", listed)
    st, _ = fleet(4)
    first = Reconciler(kube, POLICY, operator_uid=65532)
    run(first.cache(st, NS, NAME))
    catch_up(st, kube)
    kube.events.clear()
    run(Reconciler(kube, POLICY, operator_uid=65532).cache(st, NS, NAME))
    assert kube.events == []


def test_a_gate_message_alone_is_coalesced_but_opening_is_written_at_once(
    kube: RecordingKube,
) -> None:
    """Once, each GPU of a loading node rewrote its engine's gate with a new message."""
    reconciler = Reconciler(kube, POLICY, operator_uid=65532, status_interval=0.01)
    waiting = engine(Condition("False", gate.DAEMON_NOT_READY, "daemon pod wc-abc: no report yet"))
    st = state(engines=[waiting], pods=[daemon_pod(state="Loading")])

    async def node_loads() -> None:
        await reconciler.engine_pod(st, NS, "engine-1", NODE)
        st.daemon_pods_index[(NS, NAME, NODE)] = [  # type: ignore[index]
            daemon_pod(reports=annotations(device_report(
                "cpu", DIGEST, NODE, state="Error", message="disk full")))]
        await reconciler.engine_pod(st, NS, "engine-1", NODE)
        await reconciler.flush()
        assert kube.of("gate") == [("engine-1", "False", gate.DAEMON_NOT_READY)]
        assert kube.conditions["engine-1"].message.endswith("cpu is Error: disk full")
        st.daemon_pods_index[(NS, NAME, NODE)] = [daemon_pod()]  # type: ignore[index]
        await reconciler.engine_pod(st, NS, "engine-1", NODE)
        assert kube.of("gate")[-1] == ("engine-1", "True", gate.WEIGHTS_RESIDENT)

    run(node_loads())
    assert len(kube.of("gate")) == 2


def labelled_engine(namespace: str = NS, name: str = "one-label") -> EnginePodView:
    """A pod carrying only the webhook's label (and its gate), no selector labels."""
    return EnginePodView(namespace, name, f"uid-{name}", {names.CACHE_LABEL: NAME}, NODE, None,
                         False, "1", NAME, NS)


def test_a_one_label_pod_is_gated_by_the_cache_it_names(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    run(reconciler.cache(state(engines=[labelled_engine()]), NS, NAME))
    assert kube.of("gate") == [("one-label", "True", gate.WEIGHTS_RESIDENT)]


def test_a_pod_that_left_the_watch_while_its_gate_was_being_opened_is_closed(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    """Review of issue 43: the gate opened on the pod at version 1, the label removed at
    version 2 before that write was seen; the event that takes the pod out of the watch
    shows version 2 without the condition. Our own last write (True) still says open."""
    pod = labelled_engine()
    run(reconciler.engine_pod(state(engines=[pod]), NS, pod.name, NODE))
    assert kube.of("gate") == [("one-label", "True", gate.WEIGHTS_RESIDENT)]
    gone = dataclasses.replace(pod, resource_version="2", gate=None)
    run(reconciler.close_unwatched_gate(gone))
    assert kube.of("gate")[-1] == ("one-label", "False", "NotWatched")
    kube.writes.clear()
    # A pod whose gate was never opened, by it or by us, is left alone.
    run(reconciler.close_unwatched_gate(labelled_engine(name="never-opened")))
    assert kube.of("gate") == []


def test_a_pod_of_another_namespace_is_gated_only_where_the_cache_lets_it_in(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    elsewhere = labelled_engine("serving", "cross")
    run(reconciler.engine_pod(state(engines=[elsewhere]), "serving", "cross", NODE))
    assert kube.of("gate") == [("cross", "False", gate.NO_WEIGHTCACHE)]
    kube.writes.clear()
    letting = cache(generation=2,  # a spec change
                    spec={**SPEC, "engine": {**SPEC["engine"], "namespaces": ["serving"]}})
    run(reconciler.cache(state(caches=[letting], engines=[elsewhere]), NS, NAME))
    assert kube.of("gate") == [("cross", "True", gate.WEIGHTS_RESIDENT)]


def test_a_readiness_flap_closes_no_gate_and_a_lasting_one_closes_it_when_the_grace_ends(
    kube: RecordingKube,
) -> None:
    """No pod event comes when the grace ends: the operator judges the node again itself."""
    reconciler = Reconciler(kube, POLICY, operator_uid=65532, status_interval=0,
                            flap_seconds=0.5)
    ready = dataclasses.replace(daemon_pod(), uid="pod-uid", containers_running=True)
    st = state(pods=[ready])

    async def flap() -> None:
        await reconciler.cache(st, NS, NAME)
        assert kube.conditions["engine-1"].status == "True"
        catch_up(st, kube)
        kube.writes.clear()
        # The kubelet marks the pod NotReady; its processes and reports are unchanged.
        st.daemon_pods_index[(NS, NAME, NODE)] = [dataclasses.replace(  # type: ignore[index]
            ready, ready=False, not_ready_since=reconciler.clock())]
        await reconciler.daemon_pod(st, NS, NAME, NODE)
        await reconciler.flush()
        # The gate's message may say so; it stays open and the label stays.
        assert {g[1:] for g in kube.of("gate")} <= {("True", gate.WEIGHTS_RESIDENT)}
        assert "held open" in kube.conditions["engine-1"].message
        assert kube.of("labels") == []
        # Still NotReady once the grace is over: closed, without any new event.
        await asyncio.sleep(1.0)
        await reconciler.flush()

    run(flap())
    assert kube.of("gate")[-1] == ("engine-1", "False", gate.DAEMON_NOT_READY)
    assert kube.of("labels") == [(NODE, {names.NODE_LABEL_PREFIX + LABEL: None})]


def test_a_hand_edited_pod_template_is_restored_whole_then_applied(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    """Issue 25 item 7: hostPID, root and privileged set by hand stayed after two resyncs
    (only the operator's own annotations were compared)."""
    manifest = reconciler.rendered(cache())
    assert isinstance(manifest, dict)
    stamped = manifest["metadata"]["annotations"][names.RENDER_HASH_ANNOTATION]
    edited = daemonset(stamped, template_shape="edited by hand")
    run(reconciler.apply_daemonset(state(ds=edited), cache()))
    assert [k for k, _ in kube.writes] == ["restore", "daemonset"]
    assert kube.of("restore") == [(names.daemonset_name(NS, NAME), "ds-uid")]
    # The edited shape is never recorded as one the pods may have.
    assert kube.applied[-1]["metadata"]["annotations"][names.POD_SHAPES_ANNOTATION] == SHAPE
    kube.writes.clear()
    # An older render of the operator's own is no edit: applied over, not restored.
    older = daemonset(stamped, template_shape="s0", shapes=("s0",))
    run(reconciler.apply_daemonset(state(ds=older), cache()))
    assert [k for k, _ in kube.writes] == ["daemonset"]
    assert kube.applied[-1]["metadata"]["annotations"][names.POD_SHAPES_ANNOTATION] == (
        f"{SHAPE},s0")


# --------------------------------------------------------------------------- model upgrades

V2_SPEC = {**SPEC, "model": {"path": "/models/m2"}}
V2 = spec_hash(parse_spec(V2_SPEC))
TWO_NODES = ("node-a", "node-b")


def bound_engine(name: str, node: str, generation: str | None,
                 gate_now: Condition | None = None) -> EnginePodView:
    """An engine pod bound (as the webhook binds it) to the weights of `generation`."""
    bindings = {} if generation is None else {names.binding_key(NS, NAME): generation}
    return EnginePodView(NS, name, f"uid-{name}", {"app": "engine"}, node, gate_now, False,
                         "1", bindings=bindings)


def progressing(status: Mapping[str, Any]) -> tuple[str, str]:
    cond = next(c for c in status["conditions"] if c["type"] == "Progressing")
    return cond["status"], cond["reason"]


def upgrade_scene(spec: dict, held: dict[str, str], engines: list[EnginePodView],
                  applied: int = 1) -> State:
    """Two nodes; `held[node]` is the generation that node's daemon pod reports holding."""
    def pod(node: str) -> DaemonPodView:
        reports = annotations(device_report("cpu", held[node], node))
        return dataclasses.replace(daemon_pod(f"wc-{node}", reports=reports, node=node),
                                   spec_hash=held[node])

    by_node: dict[tuple[str, str | None], list[EnginePodView]] = {}
    for e in engines:
        by_node.setdefault((e.namespace, e.node), []).append(e)
    return State(
        caches={NS: [cache(generation=1 if spec is SPEC else 2, spec=spec)]},
        daemonsets={(NS, NAME): [daemonset(applied=applied)]},
        daemon_pods_index={(NS, NAME, node): [pod(node)] for node in held},
        engine_pods_index=by_node,
        nodes={node: [NodeView(node, frozenset(), "1")] for node in held},
        daemon_namespace=SYSTEM,
    )


def gates_after(reconciler: Reconciler, kube: RecordingKube, st: State) -> dict[str, str]:
    run(reconciler.cache(st, NS, NAME))
    return {name: kube.conditions[name].status for name in kube.conditions}


def test_a_model_change_closes_no_gate_of_pods_whose_weights_are_still_resident(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    """The probe of the model-upgrade issue: spec v1 → v2 with engines serving v1.

    Once, editing the spec closed every engine's gate in the fleet at once
    (FingerprintMismatch), and once the daemons held v2 the same v1 engines were
    reported resident while no daemon held their weights any more.
    """
    v1_engines = [bound_engine(f"v1-{n}", n, DIGEST) for n in TWO_NODES]
    steady = upgrade_scene(SPEC, {n: DIGEST for n in TWO_NODES}, v1_engines)
    assert gates_after(reconciler, kube, steady) == {"v1-node-a": "True", "v1-node-b": "True"}

    # The spec is edited; the daemons still hold v1 and the engines still run it.
    edited = upgrade_scene(V2_SPEC, {n: DIGEST for n in TWO_NODES}, v1_engines)
    assert gates_after(reconciler, kube, edited) == {"v1-node-a": "True", "v1-node-b": "True"}
    status = kube.of("status")[-1]
    assert status["generations"] == [
        {"fingerprint": V2, "current": True, "nodes": 0, "enginePods": 0},
        {"fingerprint": DIGEST, "current": False, "nodes": 2, "enginePods": 2},
    ]
    assert progressing(status) == ("True", "Applying")

    # node-a's daemon now holds v2 and a v2 engine started there; node-b still holds v1.
    rolled = upgrade_scene(V2_SPEC, {"node-a": V2, "node-b": DIGEST},
                           [*v1_engines, bound_engine("v2-node-a", "node-a", V2)])
    assert gates_after(reconciler, kube, rolled) == {
        "v1-node-a": "False", "v1-node-b": "True", "v2-node-a": "True"}
    closed = kube.conditions["v1-node-a"]
    assert closed.reason == gate.FINGERPRINT_MISMATCH
    assert f"bound to {DIGEST[:12]}" in closed.message
    by_node = {n["name"]: n for n in kube.of("status")[-1]["nodes"]}
    assert (by_node["node-a"]["specHash"], by_node["node-b"]["specHash"]) == (V2, DIGEST)

    # Every daemon holds v2; one v1 engine pod is left: the rollout is not over.
    done = upgrade_scene(V2_SPEC, {n: V2 for n in TWO_NODES},
                         [v1_engines[1], bound_engine("v2-node-a", "node-a", V2)], applied=2)
    assert gates_after(reconciler, kube, done)["v1-node-b"] == "False"
    status = kube.of("status")[-1]
    assert progressing(status) == ("True", aggregate.ENGINES_ON_OLD_WEIGHTS)
    assert status["phase"] == "Ready"
    assert status["generations"][1] == {
        "fingerprint": DIGEST, "current": False, "nodes": 0, "enginePods": 1}


def test_a_rollback_opens_at_once_where_the_old_weights_are_still_held(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    """Back to v1 mid-rollout: node-b never left v1, so a pod bound to v1 there (and an
    unbound one, judged by the spec of the moment) opens in the same pass; node-a holds
    v2 and opens nothing of v1."""
    engines = [bound_engine("v1-node-b", "node-b", DIGEST), bound_engine("v1-node-a", "node-a",
               DIGEST), bound_engine("unbound-b", "node-b", None)]
    mid = upgrade_scene(V2_SPEC, {"node-a": V2, "node-b": DIGEST}, engines)
    assert gates_after(reconciler, kube, mid) == {
        "v1-node-a": "False", "v1-node-b": "True", "unbound-b": "False"}
    back = upgrade_scene(SPEC, {"node-a": V2, "node-b": DIGEST}, engines)
    back.caches[NS][0] = cache(generation=3, spec=SPEC)  # type: ignore[index]
    assert gates_after(reconciler, kube, back) == {
        "v1-node-a": "False", "v1-node-b": "True", "unbound-b": "True"}


def test_a_binding_that_names_no_generation_keeps_the_gate_closed(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    st = upgrade_scene(SPEC, {n: DIGEST for n in TWO_NODES},
                       [bound_engine("typo", "node-a", DIGEST[:12]),
                        bound_engine("stranger", "node-b", "0" * 64)])
    assert gates_after(reconciler, kube, st) == {"typo": "False", "stranger": "False"}
    assert kube.conditions["typo"].reason == gate.BINDING_INVALID
    assert names.binding_key(NS, NAME) in kube.conditions["typo"].message
    # A well-formed hash no daemon holds opens nothing either.
    assert kube.conditions["stranger"].reason == gate.FINGERPRINT_MISMATCH


def test_engine_pods_are_counted_while_they_run_and_recounted_when_they_change(
    kube: RecordingKube,
) -> None:
    """An evicted (Failed) or finished pod runs no weights: it keeps no generation in the
    rollout; and an engine pod's going is written to the status without waiting for a
    daemon's report or the resync."""
    reconciler = Reconciler(kube, POLICY, operator_uid=65532, status_interval=0)
    left = bound_engine("v1-node-b", "node-b", DIGEST)
    evicted = dataclasses.replace(bound_engine("evicted", "node-a", DIGEST), phase="Failed")
    st = upgrade_scene(V2_SPEC, {n: V2 for n in TWO_NODES}, [left, evicted], applied=2)
    run(reconciler.cache(st, NS, NAME))
    status = kube.of("status")[-1]
    assert status["generations"][1]["enginePods"] == 1
    assert progressing(status) == ("True", aggregate.ENGINES_ON_OLD_WEIGHTS)

    st.engine_pods_index[(NS, "node-b")].remove(left)  # type: ignore[union-attr]

    async def gone() -> None:
        reconciler.engine_pods_changed(st, left)
        await reconciler.flush()

    run(gone())
    status = kube.of("status")[-1]
    assert progressing(status) == ("False", "Complete")
    assert [g["fingerprint"] for g in status["generations"]] == [V2]


# ------------------------------------------------------------------ node-by-node rollouts

OLD = "0" * 64
NODE_BY_NODE = {**SPEC, "rollout": {"strategy": "NodeByNode", "maxUnavailable": 1}}


def old_daemon(node: str, terminating: bool = False) -> DaemonPodView:
    return dataclasses.replace(daemon_pod(name=f"wc-{node}", node=node), spec_hash=OLD,
                               terminating=terminating, uid=f"uid-wc-{node}")


def old_engine(node: str, terminating: bool = False) -> EnginePodView:
    return dataclasses.replace(engine(name=f"engine-{node}", node=node), terminating=terminating,
                               bindings={names.binding_key(NS, NAME): OLD})


def test_node_by_node_evicts_one_nodes_old_engines_then_its_daemon(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    caches = [cache(spec=NODE_BY_NODE)]
    daemons = [old_daemon("node-a"), old_daemon("node-b")]
    unbound = engine(name="unbound", node="node-a")  # judged by the current spec: stays
    engines = [old_engine("node-a"), old_engine("node-b"), unbound]
    run(reconciler.status(state(caches, daemons, engines=engines), NS, NAME))
    assert kube.of("evict") == [(NS, "engine-node-a", "uid-engine-node-a")]
    assert ("WeightCache", "Evicted") in kube.events
    assert progressing(kube.of("status")[-1]) == ("True", "RollingNodeByNode")
    # A lagging index shows the evicted pod still running: it is not evicted twice.
    run(reconciler.status(state(caches, daemons, engines=engines), NS, NAME))
    assert len(kube.of("evict")) == 1
    # Terminating, then gone: only then the node's daemon pod goes, and no other node starts.
    engines[0] = old_engine("node-a", terminating=True)
    run(reconciler.status(state(caches, daemons, engines=engines), NS, NAME))
    assert len(kube.of("evict")) == 1
    run(reconciler.status(state(caches, daemons, engines=engines[1:]), NS, NAME))
    assert kube.of("evict")[1:] == [(SYSTEM, "wc-node-a", "uid-wc-node-a")]


def test_a_refused_eviction_holds_the_rollout_with_an_event_and_a_reason(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    caches = [cache(spec=NODE_BY_NODE)]
    world = state(caches, [old_daemon("node-a")], engines=[old_engine("node-a")])
    kube.refuse["evict"] = 429
    run(reconciler.status(world, NS, NAME))
    run(reconciler.status(world, NS, NAME))
    assert kube.events.count(("WeightCache", "EvictionBlocked")) == 1  # once per pod and why
    (cond,) = [c for c in kube.of("status")[-1]["conditions"] if c["type"] == "Progressing"]
    assert cond["reason"] == "EvictionBlocked" and f"{NS}/engine-node-a" in cond["message"]
    del kube.refuse["evict"]
    run(reconciler.status(world, NS, NAME))
    assert kube.of("evict") == [(NS, "engine-node-a", "uid-engine-node-a")]
    assert progressing(kube.of("status")[-1]) == ("True", "RollingNodeByNode")


def test_a_listed_tenants_budget_holds_the_rollout_until_its_namespace_is_unlisted(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    """Issue 43 item 4 (docs/security.md, "What listing a namespace grants"): a tenant of a
    namespace the cache lists keeps its pod on the old generation with a budget refusing the
    eviction; the node never rolls (the daemon stays), reported as EvictionBlocked. Once the
    owner takes the namespace out of the list, that pod is no longer the cache's, and the
    node rolls without evicting it."""
    listed = {**NODE_BY_NODE, "engine": {**SPEC["engine"], "namespaces": ["tenant"]}}
    tenant_pod = dataclasses.replace(labelled_engine("tenant", "held"), node="node-a",
                                     bindings={names.binding_key(NS, NAME): OLD})
    world = state([cache(spec=listed)], [old_daemon("node-a")], engines=[tenant_pod])
    kube.refuse["evict"] = 429
    for _ in range(3):
        run(reconciler.status(world, NS, NAME))
    assert kube.of("evict") == []
    (cond,) = [c for c in kube.of("status")[-1]["conditions"] if c["type"] == "Progressing"]
    assert cond["reason"] == "EvictionBlocked" and "tenant/held" in cond["message"]
    del kube.refuse["evict"]
    unlisted = state([cache(generation=2, spec=NODE_BY_NODE)], [old_daemon("node-a")],
                     engines=[tenant_pod])
    run(reconciler.status(unlisted, NS, NAME))
    assert kube.of("evict") == [(SYSTEM, "wc-node-a", "uid-wc-node-a")]


def test_pods_a_controller_recreates_bound_to_the_old_generation_are_not_evicted_again(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    """Issue 42 item 3, found on the real node: a Deployment whose template carries the
    binding to the old generation, in its own rolling update, re-creates every pod the
    operator evicts, bound to that generation, on that node: evicting each new copy (every
    pass) never lets the node roll. The operator evicts the pods that were there, then
    leaves the copies alone and says which controller holds the node and what to change."""
    caches = [cache(spec=NODE_BY_NODE)]
    daemons = [old_daemon("node-a")]

    def replica(name: str, terminating: bool = False) -> EnginePodView:
        return dataclasses.replace(old_engine("node-a", terminating), name=name,
                                   uid=f"uid-{name}", owner="ReplicaSet/engine-5f9c",
                                   owner_uid="rs-uid")

    run(reconciler.status(state(caches, daemons, engines=[replica("e-1")]), NS, NAME))
    assert kube.of("evict") == [(NS, "e-1", "uid-e-1")]
    # Gone, and its ReplicaSet's new pod is bound to the old generation again.
    world = state(caches, daemons, engines=[replica("e-2")])
    for _ in range(3):
        run(reconciler.status(world, NS, NAME))
    assert kube.of("evict") == [(NS, "e-1", "uid-e-1")]  # the copy is left alone
    assert kube.events.count(("WeightCache", rollout.EVICTIONS_UNDONE)) == 1
    (cond,) = [c for c in kube.of("status")[-1]["conditions"] if c["type"] == "Progressing"]
    assert cond["reason"] == rollout.EVICTIONS_UNDONE, cond
    assert "ReplicaSet/engine-5f9c on node node-a" in cond["message"]
    assert "Recreate" in cond["message"]
    # The Deployment rolled (Recreate): its old pods went without the operator; the node rolls.
    run(reconciler.status(state(caches, daemons, engines=[]), NS, NAME))
    assert kube.of("evict")[1:] == [(SYSTEM, "wc-node-a", "uid-wc-node-a")]


def test_a_replica_scheduled_after_an_eviction_is_evicted_not_taken_for_a_copy(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    """A replica bound to the old generation but not yet scheduled at the first eviction
    (admitted before the edit) is no copy: once it lands on the node it is evicted."""
    caches = [cache(spec=NODE_BY_NODE)]
    daemons = [old_daemon("node-a")]

    def replica(name: str, node: str | None) -> EnginePodView:
        return dataclasses.replace(old_engine("node-a"), name=name, uid=f"uid-{name}",
                                   node=node, owner="ReplicaSet/engine-5f9c",
                                   owner_uid="rs-uid")

    run(reconciler.status(state(caches, daemons, engines=[
        replica("e-1", "node-a"), replica("pending", None)]), NS, NAME))
    assert kube.of("evict") == [(NS, "e-1", "uid-e-1")]
    run(reconciler.status(state(caches, daemons, engines=[replica("pending", "node-a")]),
                          NS, NAME))
    assert kube.of("evict")[1:] == [(NS, "pending", "uid-pending")]
    assert ("WeightCache", rollout.EVICTIONS_UNDONE) not in kube.events


def test_auto_leaves_copies_alone_too_while_the_new_daemon_waits_for_room(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    caches = [cache(spec=SPEC)]  # Auto, the default
    daemons = [waiting_daemon("node-a")]

    def replica(name: str) -> EnginePodView:
        return dataclasses.replace(old_engine("node-a"), name=name, uid=f"uid-{name}",
                                   owner="ReplicaSet/engine-5f9c", owner_uid="rs-uid")

    run(reconciler.status(state(caches, daemons, engines=[replica("e-1")]), NS, NAME))
    run(reconciler.status(state(caches, daemons, engines=[replica("e-2")]), NS, NAME))
    assert kube.of("evict") == [(NS, "e-1", "uid-e-1")]
    assert progressing(kube.of("status")[-1]) == ("True", rollout.EVICTIONS_UNDONE)


SURGE = {**SPEC, "rollout": {"strategy": "Surge"}}


def waiting_daemon(node: str, waiting: bool = True) -> DaemonPodView:
    """The node's new daemon (the current generation), keeping OLD's weights for the
    engines there; `waiting`: the new generation does not fit beside them."""
    kept = RetainedReport(spec_hash=OLD, fingerprint="e" * 64, preloaded_weights_bytes=GIB,
                          expected_bytes=GIB)
    reports = annotations(device_report("cpu", DIGEST, node, state="Loading" if waiting
                                        else "Ready", waiting_for_room=waiting, retained=[kept]))
    return dataclasses.replace(daemon_pod(f"wc-{node}", reports=reports, node=node,
                                          ready=not waiting), uid=f"uid-wc-{node}",
                               containers_running=True)


def test_a_surge_cache_evicts_nothing(kube: RecordingKube, reconciler: Reconciler) -> None:
    world = state([cache(spec=SURGE)], [old_daemon("node-a"), waiting_daemon("node-b")],
                  engines=[old_engine("node-a"), old_engine("node-b")])
    run(reconciler.status(world, NS, NAME))
    assert kube.of("evict") == []


def test_auto_evicts_old_engines_only_where_the_new_daemon_waits_for_room(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    """Issue 42 (rollout.make_room): node-a's new daemon cannot load beside the weights it
    keeps for the old engines there; node-b's could. Only node-a's old engine goes, the
    PodDisruptionBudget deciding; node-b's keeps serving from the kept weights."""
    current = dataclasses.replace(engine(name="current-a", node="node-a"),
                                  bindings={names.binding_key(NS, NAME): DIGEST})
    world = state([cache()], [waiting_daemon("node-a"), waiting_daemon("node-b", False)],
                  engines=[old_engine("node-a"), old_engine("node-b"), current])
    kube.refuse["evict"] = 429
    run(reconciler.status(world, NS, NAME))
    (cond,) = [c for c in kube.of("status")[-1]["conditions"] if c["type"] == "Progressing"]
    assert cond["reason"] == "EvictionBlocked"
    assert cond["message"].startswith(f"making room: evicting {NS}/engine-node-a")
    assert ("WeightCache", "EvictionBlocked") in kube.events
    del kube.refuse["evict"]
    run(reconciler.status(world, NS, NAME))
    assert kube.of("evict") == [(NS, "engine-node-a", "uid-engine-node-a")]
    assert progressing(kube.of("status")[-1]) == ("True", "MakingRoom")
    # The old engine on node-b is judged by what its node's daemon keeps: still open.
    run(reconciler.cache(world, NS, NAME))
    assert kube.conditions["engine-node-b"].status == "True"
    assert kube.conditions["engine-node-a"].status == "True"  # kept there too, until it goes
    status = kube.of("status")[-1]
    (gpu,) = next(n for n in status["nodes"] if n["name"] == "node-a")["gpus"]
    assert gpu["waitingForRoom"] and gpu["retained"][0]["specHash"] == OLD
    assert next(g for g in status["generations"] if g["fingerprint"] == OLD)["nodes"] == 2


def test_a_wait_for_room_with_nothing_to_evict_is_reported_held_naming_what_to_do(
    kube: RecordingKube,
) -> None:
    """Review of issue 42: under Auto, weights kept for an engine the operator cannot evict
    (here one without the cache's binding: judged current, never retiring) hold the node's
    new generation for good. After ROOM_HELD_SECONDS of waiting with nothing to evict the
    status says so and what the owner can do; the wait ending clears it."""
    now = [1000.0]
    reconciler = Reconciler(kube, POLICY, operator_uid=65532, status_interval=0,
                            clock=lambda: now[0])
    unbound = engine(name="unbound", node="node-a")
    world = state([cache()], [waiting_daemon("node-a")], engines=[unbound])
    run(reconciler.status(world, NS, NAME))
    assert progressing(kube.of("status")[-1]) == ("True", "MakingRoom")
    now[0] += rollout.ROOM_HELD_SECONDS
    run(reconciler.status(world, NS, NAME))
    (cond,) = [c for c in kube.of("status")[-1]["conditions"] if c["type"] == "Progressing"]
    assert cond["reason"] == "RoomHeld" and "node-a" in cond["message"]
    assert "spec.rollout.strategy: Surge" in cond["message"]
    assert kube.of("evict") == []
    # The daemon found room (the engine went): no longer held, and a later wait starts over.
    run(reconciler.status(state([cache()], [waiting_daemon("node-a", False)]), NS, NAME))
    assert progressing(kube.of("status")[-1])[1] != "RoomHeld"
    run(reconciler.status(world, NS, NAME))
    assert progressing(kube.of("status")[-1]) == ("True", "MakingRoom")


def test_a_cache_evicts_only_pods_it_gates_that_carry_its_own_binding(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    """Whoever may create a NodeByNode cache gets no eviction beyond the pods that opted
    into it: a pod its selector does not match, a pod bound to another cache, and a pod
    whose binding names no generation all stay; only its own bound pod goes."""
    key = names.binding_key(NS, NAME)
    not_selected = dataclasses.replace(old_engine("node-a"), name="other-app",
                                       uid="u-other-app", labels={"app": "other"})
    other_cache = dataclasses.replace(engine(name="other-cache", node="node-a"),
                                      bindings={names.binding_key(NS, "other"): OLD})
    not_a_hash = dataclasses.replace(engine(name="not-a-hash", node="node-a"),
                                     bindings={key: "v1"})
    world = state([cache(spec=NODE_BY_NODE)], [old_daemon("node-a")],
                  engines=[not_selected, other_cache, not_a_hash])
    run(reconciler.status(world, NS, NAME))
    # None of them is retiring: the node's daemon is replaced without evicting any of them.
    assert kube.of("evict") == [(SYSTEM, "wc-node-a", "uid-wc-node-a")]
    run(reconciler.status(state([cache(spec=NODE_BY_NODE)], [old_daemon("node-b")],
                                engines=[old_engine("node-b")]), NS, NAME))
    assert kube.of("evict")[1:] == [(NS, "engine-node-b", "uid-engine-node-b")]


# ------------------------------------------------------------------ daemon replacements

def replaced_scene(kube: RecordingKube, carry_seconds: float = gate.CARRY_SECONDS
                   ) -> tuple[Reconciler, State, DaemonPodView]:
    reconciler = Reconciler(kube, POLICY, operator_uid=65532, status_interval=0,
                            carry_seconds=carry_seconds)
    reports = annotations(device_report("cpu", DIGEST, transport="memfd", instance="a" * 16))
    old = dataclasses.replace(daemon_pod(reports=reports), uid="old-uid",
                              containers_running=True)
    return reconciler, state(pods=[old]), old


def test_a_replaced_daemon_pod_closes_no_gate_until_its_successor_decides(
    kube: RecordingKube,
) -> None:
    """Issue 42 item 2, as the operator lives it: the pod is deleted (terminating), gone,
    its successor starts without a report, re-adopts, reports Ready and turns Ready; not
    one gate write closes the gate, and the node keeps its label."""
    reconciler, st, old = replaced_scene(kube)
    new = dataclasses.replace(daemon_pod("wc-new", ready=False, reports={}), uid="new-uid",
                              containers_running=True)

    def readopting(state: str, **fields: Any) -> dict[str, str]:
        return annotations(device_report("cpu", DIGEST, transport="memfd", state=state,
                                         instance="b" * 16, **fields))

    steps = [
        [dataclasses.replace(old, terminating=True, ready=False)],
        [],
        [new],
        [dataclasses.replace(new, reports=readopting("Loading", load_phase="re-adopting"))],
        [dataclasses.replace(new, reports=readopting("Ready", readopted=True))],
        [dataclasses.replace(new, ready=True,
                             reports=readopting("Ready", readopted=True))],
    ]

    async def replace() -> None:
        await reconciler.cache(st, NS, NAME)
        catch_up(st, kube)
        for pods in steps:
            st.daemon_pods_index[(NS, NAME, NODE)] = pods  # type: ignore[index]
            await reconciler.daemon_pod(st, NS, NAME, NODE)
            await reconciler.flush()

    run(replace())
    assert {g[1] for g in kube.of("gate")} == {"True"}, kube.of("gate")
    assert kube.of("labels") == [(NODE, {names.NODE_LABEL_PREFIX + LABEL: "Ready"})]
    assert "wc-new" in kube.conditions["engine-1"].message  # its own verdict at the end
    assert all(s["readyNodes"] == 1 for s in kube.of("status")), kube.of("status")


def test_a_successor_that_takes_nothing_back_or_never_decides_closes_the_gate(
    kube: RecordingKube,
) -> None:
    """The carry ends when the successor loads from disk instead (the engines' weights were
    not taken back: a checksum did not match, no manifest), and after carry_seconds when it
    never decides (a dead node); a restarted operator carries nothing it did not see."""
    reconciler, st, old = replaced_scene(kube, carry_seconds=0.5)
    from_disk = annotations(device_report("cpu", DIGEST, transport="memfd", state="Loading",
                                          load_phase="loading", instance="b" * 16))
    new = dataclasses.replace(daemon_pod("wc-new", ready=False, reports=from_disk),
                              uid="new-uid", containers_running=True)

    async def scene(pods: list[list[DaemonPodView]], wait: float = 0.0) -> None:
        await reconciler.cache(st, NS, NAME)
        catch_up(st, kube)
        for step in pods:
            st.daemon_pods_index[(NS, NAME, NODE)] = step  # type: ignore[index]
            await reconciler.daemon_pod(st, NS, NAME, NODE)
            await reconciler.flush()
        await asyncio.sleep(wait)
        await reconciler.flush()

    run(scene([[], [new]]))
    assert [g[1:] for g in kube.of("gate")][-1] == ("False", gate.DAEMON_NOT_READY)
    assert [g[1] for g in kube.of("gate")].count("False") == 1
    kube.writes.clear()
    reconciler, st, old = replaced_scene(kube, carry_seconds=0.5)
    run(scene([[]], wait=1.0))  # nobody ever comes: closed when the bound ends, by a timer
    assert [g[1:] for g in kube.of("gate")][-1] == ("False", gate.NO_DAEMON_ON_NODE)

    # An operator started mid-replacement never saw the old pod's verdict hold.
    fresh = Reconciler(RecordingKube(), POLICY, operator_uid=65532)
    run(fresh.cache(state(pods=[dataclasses.replace(old, terminating=True)]), NS, NAME))
    assert fresh.kube.conditions["engine-1"].status == "False"  # type: ignore[attr-defined]


def test_an_operator_remembers_what_holds_before_its_first_apply_replaces_daemons(
    kube: RecordingKube,
) -> None:
    """An operator upgrade renders a new DaemonSet template, which replaces every daemon
    pod: the new operator judges the nodes before it applies, so the replacement it causes
    is carried too (the gate the old operator opened stays open)."""
    reconciler, _, old = replaced_scene(kube)
    st = state(pods=[old], engines=[engine(Condition("True", gate.WEIGHTS_RESIDENT, "held"))])
    run(reconciler.apply_daemonset(st, cache()))
    assert kube.of("daemonset") and kube.of("gate") == []  # nothing written but the apply
    st.daemon_pods_index[(NS, NAME, NODE)] = [dataclasses.replace(old, terminating=True)]  # type: ignore[index]
    run(reconciler.cache(st, NS, NAME))
    assert kube.conditions["engine-1"].status == "True"
    assert "replaced (terminating)" in kube.conditions["engine-1"].message


def test_a_killed_daemon_keeping_old_weights_closes_no_gate_and_its_dead_report_opens_none(
    kube: RecordingKube,
) -> None:
    """The daemon pod keeps the old generation for the engines bound to it and is SIGKILLed:
    kubelet restarts it in the same pod, where the dead process's report (still listing the
    kept weights) stays until its successor writes. That report must neither count as the
    successor's (it would open, then the successor's first report close, the gate) nor
    close anything: the verdict is carried until the successor keeps the weights again."""
    reconciler = Reconciler(kube, POLICY, operator_uid=65532, status_interval=0)
    kept = RetainedReport(spec_hash=OLD, fingerprint="e" * 64, preloaded_weights_bytes=GIB,
                          expected_bytes=GIB)

    def reports(instance: str, **fields: Any) -> dict[str, str]:
        return annotations(device_report("cpu", DIGEST, transport="memfd", instance=instance,
                                         **fields))

    alive = dataclasses.replace(
        daemon_pod(reports=reports("a" * 16, retained=[kept])), uid="pod-uid",
        containers_running=True)
    old_engine_pod = dataclasses.replace(engine(name="old"), bindings={
        names.binding_key(NS, NAME): OLD})
    st = state(pods=[alive], engines=[old_engine_pod])
    steps = [
        dataclasses.replace(alive, ready=False, containers_running=False),  # killed
        dataclasses.replace(alive, ready=False, restarts=1),  # restarted, its report stale
        dataclasses.replace(alive, ready=False, restarts=1, reports=reports(
            "b" * 16, state="Loading", load_phase="re-adopting")),
        dataclasses.replace(alive, ready=False, restarts=1, reports=reports(
            "b" * 16, state="Loading", load_phase="loading", retained=[kept])),
    ]

    async def kill() -> None:
        await reconciler.cache(st, NS, NAME)
        catch_up(st, kube)
        for pod in steps:
            st.daemon_pods_index[(NS, NAME, NODE)] = [pod]  # type: ignore[index]
            await reconciler.daemon_pod(st, NS, NAME, NODE)
            await reconciler.flush()
            messages.append(kube.conditions["old"].message)

    messages: list[str] = []
    run(kill())
    assert {g[1] for g in kube.of("gate") if g[0] == "old"} == {"True"}, (kube.of("gate"), messages)
    # Killed, restarted and re-adopting: carried; keeping the weights again: its own.
    assert ["replaced" in m for m in messages] == [True, True, True, False], messages
    assert "keep" in messages[-1]


def test_what_was_seen_of_a_daemon_pods_reports_goes_with_the_pod(
    kube: RecordingKube, reconciler: Reconciler
) -> None:
    """Review of issue 42: report histories were kept for every daemon pod uid ever judged
    (a model change makes new ones on every node), up to 256 reports of 4 KiB each. They are
    kept as 16-byte digests, and dropped when the pod is deleted."""
    pod = dataclasses.replace(daemon_pod(), uid="pod-uid", containers_running=True)
    run(reconciler.cache(state(pods=[pod]), NS, NAME))
    history = reconciler._reports_seen["pod-uid"]
    assert history.seen and all(len(d) == 16 for d in history.seen)
    reconciler.forget_daemon_pod("pod-uid")
    assert "pod-uid" not in reconciler._reports_seen
