"""rollout.py: which engine pods and daemon pods a node-by-node model rollout evicts."""

from __future__ import annotations

import pytest

from weightcache_operator import rollout
from weightcache_operator.views import DaemonPodView, EnginePodView

V1, V2 = "1" * 64, "2" * 64


def daemon(node: str, spec_hash: str = V1, *, ready: bool = True,
           terminating: bool = False) -> DaemonPodView:
    return DaemonPodView(
        namespace="weightcache-system", name=f"daemon-{node}-{spec_hash[:1]}", cache="c",
        node=node, phase="Running", ready=ready, terminating=terminating, reports={},
        spec_hash=spec_hash, created="", uid=f"uid-{node}-{spec_hash[:1]}",
    )


def engine(node: str, name: str = "e", *, terminating: bool = False) -> EnginePodView:
    return EnginePodView(namespace="ns", name=f"{name}-{node}", uid=f"{name}-{node}",
                         labels={}, node=node, gate=None, terminating=terminating,
                         phase="Running")


def names(pods: tuple) -> list[str]:
    return [p.name for p in pods]


def test_the_first_nodes_by_name_are_started_and_only_their_old_engines_evicted() -> None:
    pods = [daemon(n) for n in ("c", "a", "b")]
    retiring = {n: [engine(n)] for n in ("a", "b", "c")}
    plan = rollout.plan(V2, 2, pods, retiring)
    assert names(plan.evict_engines) == ["e-a", "e-b"]
    assert plan.evict_daemons == ()
    assert (plan.rolling, plan.waiting) == (("a", "b"), 1)


def test_a_node_whose_old_engines_are_gone_gets_its_daemon_replaced() -> None:
    plan = rollout.plan(V2, 1, [daemon("a"), daemon("b")], {"b": [engine("b")]})
    assert names(plan.evict_daemons) == ["daemon-a-1"]
    assert plan.evict_engines == ()
    assert (plan.rolling, plan.waiting) == (("a",), 1)


def test_a_terminating_engine_holds_its_node_in_flight_until_it_is_gone() -> None:
    """Its processes still map the old weights: the daemon is not replaced yet, and the
    node takes the only place."""
    pods = [daemon("a"), daemon("b")]
    plan = rollout.plan(V2, 1, pods, {"a": [engine("a", terminating=True)],
                                      "b": [engine("b")]})
    assert plan.evict_engines == plan.evict_daemons == ()
    assert (plan.rolling, plan.waiting) == (("a",), 1)


def test_a_refused_eviction_is_asked_again_and_holds_the_place() -> None:
    """A PDB refused one of two engines: the other terminates; the refused one is evicted
    again each pass, and no other node starts meanwhile."""
    pods = [daemon("a"), daemon("b")]
    retiring = {"a": [engine("a", "x", terminating=True), engine("a", "y")],
                "b": [engine("b")]}
    plan = rollout.plan(V2, 1, pods, retiring)
    assert names(plan.evict_engines) == ["y-a"]
    assert plan.rolling == ("a",)
    # The evicted one gone, the refused one still there: node a is first by name again.
    plan = rollout.plan(V2, 1, pods, {"a": [engine("a", "y")], "b": [engine("b")]})
    assert names(plan.evict_engines) == ["y-a"]


def test_a_node_loading_its_new_daemon_counts_against_max_unavailable() -> None:
    pods = [daemon("a", V2, ready=False), daemon("b"), daemon("c")]
    retiring = {"b": [engine("b")], "c": [engine("c")]}
    assert rollout.plan(V2, 1, pods, retiring) == rollout.Plan(rolling=("a",), waiting=2)
    pods[0] = daemon("a", V2)  # Ready: the next node starts
    plan = rollout.plan(V2, 1, pods, retiring)
    assert names(plan.evict_engines) == ["e-b"] and plan.rolling == ("b",)


def test_a_terminating_old_daemon_keeps_its_node_in_flight() -> None:
    pods = [daemon("a", terminating=True), daemon("b")]
    plan = rollout.plan(V2, 1, pods, {})
    assert plan == rollout.Plan(rolling=("a",), waiting=1)


def test_nothing_moves_once_every_node_holds_the_current_generation() -> None:
    pods = [daemon("a", V2), daemon("b", V2)]
    assert rollout.plan(V2, 1, pods, {}) == rollout.Plan()


def test_pods_without_a_node_are_left_alone() -> None:
    pod = daemon("a")
    unscheduled = DaemonPodView(**{**pod.__dict__, "node": None})
    assert rollout.plan(V2, 1, [unscheduled], {}) == rollout.Plan()


@pytest.mark.parametrize(("value", "nodes", "budget"), [
    (1, 10, 1), (3, 2, 3), ("10%", 1000, 100), ("10%", 5, 1), ("25%", 10, 3), ("100%", 4, 4),
])
def test_max_unavailable_counts_nodes_as_the_daemonset_controller_does(
    value: int | str, nodes: int, budget: int
) -> None:
    assert rollout.unavailable_budget(value, nodes) == budget


def test_a_node_waiting_for_room_counts_as_held_only_with_nothing_to_evict_for_long() -> None:
    old = EnginePodView("engines", "old", "u-old", {}, "node-b", None, False, "1", "c", "engines")
    held, since = rollout.room_held(["node-a", "node-b"], {"node-b": [old]}, {}, now=10.0)
    assert (held, since) == ((), {"node-a": 10.0})  # node-b has an engine to evict
    held, since = rollout.room_held(["node-a", "node-b"], {"node-b": [old]}, since,
                                    now=10.0 + rollout.ROOM_HELD_SECONDS)
    assert held == ("node-a",) and since == {"node-a": 10.0}
    # A node no longer waiting is forgotten: its next wait starts over.
    assert rollout.room_held(["node-b"], {}, since, now=500.0) == ((), {"node-b": 500.0})



def owned(node: str | None, name: str, owner: str = "rs-1") -> EnginePodView:
    return EnginePodView(namespace="ns", name=name, uid=name, labels={}, node=node, gate=None,
                         terminating=False, phase="Running", owner=f"ReplicaSet/{owner}",
                         owner_uid=owner)


def test_a_pod_its_controller_made_after_an_eviction_is_recreated_not_one_that_was_there() -> None:
    a, b, pending = owned("n1", "a"), owned("n2", "b"), owned(None, "pending")
    present = rollout.by_controller([(a, V1), (b, V1), (pending, V1)])
    key = rollout.controller_key(a, V1)
    assert present == {key: frozenset({"a", "b", "pending"})}
    # The operator evicted `a`; `b` and the unscheduled one were there then: not copies.
    evicted_from = {key: rollout.EvictedFrom(present[key], 0.0)}
    undone, kept = rollout.recreated(present, evicted_from, 1.0)
    assert undone == frozenset() and kept == {key: rollout.EvictedFrom(present[key], 1.0)}
    # `a` gone, `c` made by the same ReplicaSet bound to the same generation: re-created.
    # Another controller's pod, one on another generation, one of no controller are not.
    bare = EnginePodView(namespace="ns", name="bare", uid="bare", labels={}, node="n1",
                         gate=None, terminating=False)
    later = [(b, V1), (owned("n1", "c"), V1), (owned("n1", "other", owner="rs-2"), V1),
             (owned("n1", "newer"), V2), (pending, V1), (bare, V1)]
    undone, kept = rollout.recreated(rollout.by_controller(later), evicted_from, 2.0)
    assert undone == frozenset({"c"})


def test_a_controller_is_remembered_a_while_after_its_last_pod_went() -> None:
    """An evicted pod may be gone a moment before its controller makes the copy."""
    key = ("rs-1", V1)
    evicted_from = {key: rollout.EvictedFrom(frozenset({"a"}), 10.0)}
    undone, kept = rollout.recreated({}, evicted_from, 10.0 + rollout.FORGET_SECONDS - 1)
    assert kept == evicted_from
    undone, kept = rollout.recreated({key: frozenset({"copy"})}, kept, 80.0)
    assert undone == frozenset({"copy"})
    undone, kept = rollout.recreated({}, evicted_from, 10.0 + rollout.FORGET_SECONDS)
    assert (undone, kept) == (frozenset(), {})


def test_the_same_controller_on_another_generation_is_another_key() -> None:
    a = owned("n1", "a")
    assert rollout.controller_key(a, V1) != rollout.controller_key(a, V2)
    bare = EnginePodView(namespace="ns", name="p", uid="p", labels={}, node="n1", gate=None,
                         terminating=False)
    assert rollout.controller_key(bare, V1) is None
