"""The scale harness's pure parts: what a wave expects, and how its figures are summarised."""

from __future__ import annotations

from benchmarks import scale
from benchmarks.fleet import Gate, gpu_uuid
from weightcache.report import annotation_key
from weightcache_operator import gate


def test_percentiles_by_nearest_rank() -> None:
    assert scale.percentiles([]) is None
    figures = scale.percentiles(float(i) for i in range(1, 101))
    assert figures == {"p50": 50.0, "p99": 99.0, "max": 100.0, "n": 100}
    assert scale.percentiles([3.0]) == {"p50": 3.0, "p99": 3.0, "max": 3.0, "n": 1}


def test_one_percent_of_the_fleet_degrades_every_way_at_least_once() -> None:
    nodes = [f"n{i}" for i in range(1000)]
    bad = scale.degraded_nodes(nodes, 0.01, seed=1)
    assert len(bad) == 10 and set(bad) <= set(nodes)
    assert sorted(set(bad.values())) == ["bytes", "deleted", "fingerprint"]
    small = scale.degraded_nodes(nodes[:10], 0.01, seed=1)
    assert sorted(small.values()) == ["bytes", "deleted", "fingerprint"]
    assert scale.degraded_nodes(nodes, 0.01, seed=1) == bad  # the same run, the same nodes


def test_expectations() -> None:
    ready = scale.opened("wc-1")
    assert ready.gate_ok(Gate("True", gate.WEIGHTS_RESIDENT, "on n: daemon pod wc-1: 8 ...", 0))
    assert not ready.gate_ok(Gate("True", gate.WEIGHTS_RESIDENT, "daemon pod wc-2: ...", 0))
    assert not ready.gate_ok(None)
    loading = scale.closed(gate.DAEMON_NOT_READY, message=" is Loading")
    assert loading.gate_ok(Gate("False", gate.DAEMON_NOT_READY, "GPU-1 is Loading", 0))
    assert not loading.gate_ok(Gate("False", gate.DAEMON_NOT_READY, "3 of 8 GPUs reported", 0))
    assert not loading.label


def test_gpu_uuids_look_real_and_fit_an_annotation_key() -> None:
    uuid = gpu_uuid("kwok-gpu-999", 7)
    assert len(uuid) == len("GPU-00000000-0000-0000-0000-000000000000")
    assert annotation_key(uuid).startswith("weightcache.dev/report.GPU-")
    assert gpu_uuid("kwok-gpu-999", 7) != gpu_uuid("kwok-gpu-999", 6)


def test_a_bound_gate_closing_while_its_weights_are_held_is_wrong_after_the_grace() -> None:
    watch = scale.BindingWatch(grace=5.0)
    opened = Gate("True", gate.WEIGHTS_RESIDENT, "daemon pod wc-1: ...", 0.0)
    watch.observe(1.0, "n1", True, opened)
    closed = Gate("False", gate.FINGERPRINT_MISMATCH, "bound to r2", 2.0)
    watch.observe(3.0, "n1", True, closed)  # its daemon pod's deletion may just be late
    assert watch.figures()["gates_closed_while_weights_held"] == 0
    watch.observe(7.5, "n1", True, closed)
    assert watch.figures()["gates_closed_while_weights_held"] == 1
    assert "bound to r2" in watch.figures()["wrong_examples"]["n1"]


def test_a_bound_gate_closing_after_its_weights_left_is_timed_not_wrong() -> None:
    watch = scale.BindingWatch(grace=5.0)
    watch.observe(1.0, "n1", True, Gate("True", gate.WEIGHTS_RESIDENT, "m", 0.0))
    watch.observe(2.0, "n1", False, Gate("True", gate.WEIGHTS_RESIDENT, "m", 0.0))
    watch.observe(3.0, "n1", False, Gate("True", gate.WEIGHTS_RESIDENT, "m", 0.0))
    assert watch.open_after_weights_left == {"n1": 1.0}  # so far
    watch.observe(4.0, "n1", False, Gate("False", gate.FINGERPRINT_MISMATCH, "m", 3.5))
    figures = watch.figures()
    assert watch.open_after_weights_left == {"n1": 1.5}
    assert figures["gates_closed_while_weights_held"] == figures[
        "gates_opened_without_weights"] == 0
    assert figures["open_after_weights_left_s"]["max"] == 1.5


def test_a_bound_gate_opening_where_its_weights_are_not_held_is_wrong_at_once() -> None:
    watch = scale.BindingWatch(grace=5.0)
    shut = Gate("False", gate.FINGERPRINT_MISMATCH, "m", 0.0)
    watch.observe(1.0, "n1", False, shut)
    assert watch.open_after_weights_left == {}  # closed before: nothing to time
    watch.observe(2.0, "n1", False, Gate("True", gate.WEIGHTS_RESIDENT, "daemon pod wc-3", 1.5))
    assert watch.figures()["gates_opened_without_weights"] == 1
    fine = scale.BindingWatch(grace=5.0)
    fine.observe(1.0, "n2", False, shut)
    fine.observe(2.0, "n2", True, shut)  # its node holds them again (rollback)
    fine.observe(3.0, "n2", True, Gate("True", gate.WEIGHTS_RESIDENT, "daemon pod wc-4", 2.5))
    assert fine.figures()["gates_opened_without_weights"] == 0
    # A closed gate whose message changes while the weights are away is not timed.
    later = scale.BindingWatch(grace=5.0)
    later.observe(1.0, "n3", False, shut)
    later.observe(2.0, "n3", False, Gate("False", gate.DAEMON_NOT_READY, "Loading", 1.5))
    assert later.open_after_weights_left == {}


def test_a_closing_seen_before_the_weights_leave_counts_as_no_delay() -> None:
    watch = scale.BindingWatch(grace=5.0)
    watch.observe(1.0, "n1", True, Gate("True", gate.WEIGHTS_RESIDENT, "m", 0.0))
    watch.observe(2.0, "n1", False, Gate("False", gate.DAEMON_NOT_READY, "terminating", 1.8))
    assert watch.open_after_weights_left == {"n1": 0.0}
    assert watch.figures()["gates_closed_while_weights_held"] == 0


def test_a_bound_gate_not_opened_yet_where_its_weights_are_held_is_latency_not_wrong() -> None:
    watch = scale.BindingWatch(grace=5.0)
    waiting = Gate("False", gate.DAEMON_NOT_READY, "1 of 8 GPUs reported", 2.0)
    watch.observe(1.0, "n1", True, waiting)  # the operator has not caught up with the reports
    watch.observe(9.0, "n1", True, waiting)
    assert watch.figures()["gates_closed_while_weights_held"] == 0


def test_node_by_node_counts_nodes_in_flight_and_daemons_under_old_engines() -> None:
    watch = scale.NodeByNodeWatch(grace=2.0)
    # a: old engine gone, new daemon not Ready (in flight); b: untouched.
    watch.poll(0.0, {"a": (False, True, False), "b": (True, False, False)})
    # b's new daemon seen while its old engine still shows: within the grace, watch lag.
    watch.poll(1.0, {"a": (False, True, True), "b": (True, True, False)})
    assert watch.replaced_under_old_engine == set()
    watch.poll(3.5, {"a": (False, True, True), "b": (True, True, False)})
    assert watch.figures(1) == {"max_nodes_in_flight": 1, "max_unavailable_nodes": 1,
                                "daemons_replaced_under_old_engines": 1, "examples": ["b"]}
    watch.poll(4.0, {"a": (False, False, False), "b": (False, True, False)})
    assert watch.max_in_flight == 2


def test_a_surge_hand_over_holds_the_weights_within_the_carry() -> None:
    watch = scale.SurgeWatch(carry_seconds=120.0)
    # a: old pod runs; b: old pod gone, successor silent; c: successor keeps them.
    held = watch.poll(0.0, {"a": (True, False, False), "b": (False, False, False),
                            "c": (False, True, False)})
    assert held == {"a": True, "b": True, "c": True}
    assert watch.handover == {"c": 0.0}  # gone and kept between two polls
    assert watch.poll(2.5, {"b": (False, True, False)}) == {"b": True}
    assert watch.handover == {"c": 0.0, "b": 2.5}
    watch.poll(3.0, {"a": (False, False, False), "b": (False, True, True)})
    assert watch.ready == {"b"} and watch.max_handing_over == 1
    # Past the carry the operator may close: not held any more, and counted.
    assert watch.poll(123.0, {"a": (False, False, False)}) == {"a": False}
    figures = watch.figures(130.0, budget=1)
    assert figures["handovers_past_carry"] == 1 and figures["examples_past_carry"] == ["a"]
    assert figures["handover_s"] == {"p50": 0.0, "p99": 2.5, "max": 2.5, "n": 2}
    assert (figures["nodes_rolled"], figures["max_unavailable_nodes"]) == (1, 1)


def test_a_surge_gate_closing_while_held_is_wrong_at_once() -> None:
    """The surge wave's BindingWatch has no grace: the weights never leave, so no watch
    ordering excuses a closing."""
    watch = scale.BindingWatch(grace=0.0)
    watch.observe(1.0, "n1", True, Gate("True", gate.WEIGHTS_RESIDENT, "daemon pod old", 0.0))
    watch.observe(2.0, "n1", True, Gate("True", gate.WEIGHTS_RESIDENT, "replaced (gone)", 1.5))
    assert watch.figures()["gates_closed_while_weights_held"] == 0
    watch.observe(3.0, "n1", True, Gate("False", gate.DAEMON_NOT_READY, "1 of 8", 2.9))
    assert watch.figures()["gates_closed_while_weights_held"] == 1


def test_closings_since_a_mark_count_only_the_named_pods() -> None:
    before = {"engine-a": 1, "engine-b": 2}
    now = {"engine-a": 1, "engine-b": 4, "engine-c": 1, "elsewhere": 3}
    assert scale.closings_since(before, now, ["engine-a", "engine-b", "engine-c"]) == {
        "engine-b": 2, "engine-c": 1}
    assert scale.closings_since(now, now, ["engine-b"]) == {}


def test_an_open_gate_whose_message_changes_after_its_weights_left_is_timed_not_wrong() -> None:
    """The operator carries a replaced daemon pod's verdict (gate.carried): the gate stays
    open with a new message after the pod left. That is no opening; it is timed like any
    gate still open after its weights left."""
    watch = scale.BindingWatch(grace=5.0)
    watch.observe(1.0, "n1", True, Gate("True", gate.WEIGHTS_RESIDENT, "held", 0.0))
    watch.observe(2.0, "n1", False, Gate("True", gate.WEIGHTS_RESIDENT, "held", 0.0))
    carried = Gate("True", gate.WEIGHTS_RESIDENT, "daemon pod wc-1 replaced (terminating)", 2.5)
    watch.observe(3.0, "n1", False, carried)
    assert watch.figures()["gates_opened_without_weights"] == 0
    assert watch.open_after_weights_left == {"n1": 1.0}
