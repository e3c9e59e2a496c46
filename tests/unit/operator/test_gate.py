"""The gate decision table: one row per reason, plus the precedence between them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import msgspec
import pytest

from tests.unit.operator.builders import GIB, annotations, device_report, raw_report
from tests.unit.operator.conftest import DS_UID, daemonset
from weightcache.report import (
    MAX_DEVICES,
    PHASE_READOPTING,
    PHASE_WAITING_FOR_ROOM,
    RetainedReport,
    annotation_key,
)
from weightcache_operator import gate
from weightcache_operator.spec import WeightCacheSpec, parse_spec, spec_hash
from weightcache_operator.views import Condition, DaemonPodView

MakePod = Callable[..., DaemonPodView]


def test_ready_daemon_with_matching_fingerprint_and_bytes_opens_the_gate(
    gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod
) -> None:
    verdict = gate.evaluate_node(gpu_spec, gpu_hash, [make_pod()])
    assert verdict.ok and verdict.reason == gate.WEIGHTS_RESIDENT
    assert verdict.pod == "wc-abc"
    assert f"hold {2 * GIB} bytes via vmm_fd" in verdict.message


KEY = annotation_key("GPU-0")


@pytest.mark.parametrize(
    ("pod_kwargs", "reason", "detail"),
    [
        ({"terminating": True}, gate.DAEMON_NOT_READY, "terminating"),
        ({"reports": None}, gate.DAEMON_NOT_READY, "no report yet"),
        ({"reports": {KEY: "{not json"}}, gate.REPORT_MALFORMED, "not JSON"),
        (
            {"reports": {KEY: raw_report("GPU-0", "0" * 64, preloadedWeightsBytes=-5)}},
            gate.REPORT_MALFORMED,
            "preloadedWeightsBytes",
        ),
        # Beyond what the status's int64 (and any device) can hold.
        (
            {"reports": {KEY: raw_report("GPU-0", "0" * 64, preloadedWeightsBytes=2**64 - 1)}},
            gate.REPORT_MALFORMED,
            "preloadedWeightsBytes",
        ),
        ({"reports": {KEY: raw_report("GPU-0", "0" * 64, v=2)}}, gate.REPORT_MALFORMED, "v"),
        ({"reports": {KEY: "[]"}}, gate.REPORT_MALFORMED, "invalid report"),
        ({"reports": {KEY: "x" * 5000}}, gate.REPORT_MALFORMED, "over the"),
        (
            {"reports": {KEY: raw_report("GPU-1", "0" * 64)}},
            gate.REPORT_MALFORMED,
            "not the key's",
        ),
        (
            {"reports": {annotation_key(f"GPU-{i}"): "{}" for i in range(MAX_DEVICES + 1)}},
            gate.REPORT_MALFORMED,
            "cap",
        ),
        (
            {"reports": annotations(device_report("GPU-0", "0" * 64, "node-b"))},
            gate.REPORT_MALFORMED,
            "reports node 'node-b', but the pod runs on 'node-a'",
        ),
        (
            {"reports": annotations(*(device_report(f"GPU-{i}", "0" * 64) for i in range(2)))},
            gate.FINGERPRINT_MISMATCH,
            "holds weights for spec 000000000000",
        ),
        ({"gpus": 1}, gate.DAEMON_NOT_READY, "1 of 2 GPUs reported"),
        ({"state": "Loading"}, gate.DAEMON_NOT_READY, "GPU-0 is Loading"),
        (
            {"state": "Error", "message": "CUDA OOM"},
            gate.DAEMON_NOT_READY,
            "GPU-0 is Error: CUDA OOM",
        ),
        (
            {"preloaded": GIB // 2},
            gate.BYTES_BELOW_EXPECTED,
            f"GPU-0 holds {GIB // 2} bytes, expected {GIB}",
        ),
        ({"ready": False}, gate.DAEMON_NOT_READY, "pod is not Ready (phase Running)"),
        ({"phase": "Pending", "ready": False}, gate.DAEMON_NOT_READY, "phase Pending"),
    ],
)
def test_every_reason_the_gate_stays_closed(
    gpu_spec: WeightCacheSpec,
    gpu_hash: str,
    make_pod: MakePod,
    pod_kwargs: dict,
    reason: str,
    detail: str,
) -> None:
    verdict = gate.evaluate_node(gpu_spec, gpu_hash, [make_pod(**pod_kwargs)])
    assert not verdict.ok
    assert verdict.reason == reason
    assert detail in verdict.message


def test_no_daemon_on_node(gpu_spec: WeightCacheSpec, gpu_hash: str) -> None:
    verdict = gate.evaluate_node(gpu_spec, gpu_hash, [])
    assert (verdict.ok, verdict.reason) == (False, gate.NO_DAEMON_ON_NODE)


def test_bytes_within_tolerance_pass_and_just_below_fail(
    gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod
) -> None:
    # Default tolerance 1 %: 99 % of the expected bytes is enough, 98.9 % is not.
    assert gate.evaluate_node(gpu_spec, gpu_hash, [make_pod(preloaded=990, expected=1000)]).ok
    short = gate.evaluate_node(gpu_spec, gpu_hash, [make_pod(preloaded=989, expected=1000)])
    assert short.reason == gate.BYTES_BELOW_EXPECTED
    assert gate.evaluate_node(gpu_spec, gpu_hash, [make_pod(preloaded=2000, expected=1000)]).ok


def test_pinned_expected_bytes_override_the_report(make_pod: MakePod) -> None:
    raw = {
        "model": {"path": "/models/m"},
        "gpus": {"perNode": 2, "tpSize": 2, "shardPlan": "llama"},
        "transport": "vmm_fd",
        "engine": {"expectedBytes": 4 * GIB, "byteTolerance": 0},
    }
    pinned = parse_spec(raw)
    # The hash ignores gate parameters, so the fixture's reports still match.
    digest = spec_hash(pinned)
    verdict = gate.evaluate_node(pinned, digest, [make_pod(preloaded=GIB, expected=GIB)])
    assert verdict.reason == gate.BYTES_BELOW_EXPECTED
    assert f"expected {4 * GIB}" in verdict.message
    assert gate.evaluate_node(pinned, digest, [make_pod(preloaded=4 * GIB, expected=GIB)]).ok


def test_fingerprint_mismatch_wins_over_loading(
    gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod
) -> None:
    # A daemon still loading *other* weights will never satisfy this spec.
    other = annotations(device_report("GPU-0", "1" * 64, state="Loading"))
    pod = make_pod(reports=other)
    assert gate.evaluate_node(gpu_spec, gpu_hash, [pod]).reason == gate.FINGERPRINT_MISMATCH


def test_cpu_cache_needs_one_entry() -> None:
    spec = parse_spec({"model": {"path": "/m"}, "device": "cpu"})
    digest = spec_hash(spec)
    pod = DaemonPodView(
        namespace="ns", name="p", cache="wc", node="n", phase="Running", ready=True,
        terminating=False, reports=annotations(device_report("cpu", digest, "n")),
        spec_hash=digest, created="", controller_uid=DS_UID,
    )
    assert gate.evaluate_node(spec, digest, [pod]).ok


def test_only_pods_of_the_caches_own_daemonset_count(make_pod: MakePod) -> None:
    """A look-alike pod (same labels, a report) made by anyone else is ignored."""
    own = make_pod("own")
    impostor = make_pod("impostor", controller_uid="someone-elses-replicaset")
    orphan = make_pod("orphan", controller_uid=None)
    pods = [own, impostor, orphan]
    assert gate.controlled_pods(pods, daemonset()) == [own]
    assert gate.controlled_pods(pods, None) == []


def test_an_adopted_pod_of_another_shape_counts_for_nothing(make_pod: MakePod) -> None:
    """Issue 25 item 2: the DaemonSet controller adopts an orphan with its labels, so its
    controller reference proves nothing; the pod must also have a shape the operator rendered
    (any recorded for the DaemonSet, so old pods count while a new template rolls out)."""
    current = dataclasses.replace(make_pod("current"), shape="s2")
    rolling = dataclasses.replace(make_pod("rolling"), shape="s1")
    adopted = dataclasses.replace(make_pod("adopted"), shape="attacker's")
    ds = dataclasses.replace(daemonset(), template_shape="s2", shapes=("s2", "s1"))
    assert gate.controlled_pods([current, rolling, adopted], ds) == [current, rolling]
    # A DaemonSet from an operator that recorded no shapes: its live template's counts.
    ds = dataclasses.replace(ds, shapes=())
    assert gate.controlled_pods([current, rolling, adopted], ds) == [current]


def test_during_a_daemon_rollout_either_pod_can_satisfy_the_node(
    gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod
) -> None:
    old = make_pod("old", terminating=True, created="2026-01-01T00:00:00Z")
    new = make_pod("new", state="Loading", created="2026-01-02T00:00:00Z")
    verdict = gate.evaluate_node(gpu_spec, gpu_hash, [old, new])
    # The old pod is terminating, so the new (loading) one explains the state.
    assert (verdict.ok, verdict.pod) == (False, "new")
    ready_old = make_pod("old", created="2026-01-01T00:00:00Z")
    assert gate.evaluate_node(gpu_spec, gpu_hash, [ready_old, new]).ok


def test_pod_of_current_template_explains_a_closed_gate(
    gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod
) -> None:
    stale = make_pod(
        "stale", template_hash="9" * 64, created="2026-01-03T00:00:00Z",
        reports=annotations(device_report("GPU-0", "9" * 64)),
    )
    current = make_pod("current", reports=None, created="2026-01-01T00:00:00Z")
    verdict = gate.evaluate_node(gpu_spec, gpu_hash, [stale, current])
    assert (verdict.pod, verdict.reason) == ("current", gate.DAEMON_NOT_READY)


def test_gate_condition_table() -> None:
    ok = gate.Verdict(True, gate.WEIGHTS_RESIDENT, "2 GPU(s) hold 10 bytes")
    bad = gate.Verdict(False, gate.BYTES_BELOW_EXPECTED, "GPU-0 holds 1 bytes")
    assert gate.gate_condition("n1", {}) == Condition(
        "False", gate.NO_WEIGHTCACHE, "no WeightCache in the namespace selects it"
    )
    assert gate.gate_condition(None, {"wc": ok}).reason == gate.POD_NOT_SCHEDULED
    assert gate.gate_condition("n1", {"wc": ok}) == Condition(
        "True", gate.WEIGHTS_RESIDENT, "on n1: WeightCache wc: 2 GPU(s) hold 10 bytes"
    )
    closed = gate.gate_condition("n1", {"a": ok, "b": bad})
    assert (closed.status, closed.reason) == ("False", gate.BYTES_BELOW_EXPECTED)
    assert closed.message == "WeightCache b on n1: GPU-0 holds 1 bytes"


def test_verdicts_are_plain_values(
    gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod
) -> None:
    first = gate.evaluate_node(gpu_spec, gpu_hash, [make_pod()])
    again = gate.evaluate_node(gpu_spec, gpu_hash, [make_pod()])
    assert first == again
    assert dataclasses.replace(first, ok=False) != first


def test_one_readiness_flap_of_a_daemon_whose_reports_hold_keeps_the_gate_open(
    gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod
) -> None:
    """Issue 25 item 1: one failed readiness probe once closed every engine's gate on the
    node. A pod that was Ready, whose processes still run and report the weights resident,
    is held open for FLAP_SECONDS after it turns NotReady; nothing else is."""
    since = 1_000_000.0
    flapping = dataclasses.replace(make_pod(ready=False), not_ready_since=since,
                                   containers_running=True)

    def judge(pod: DaemonPodView, now: float, was_ready: bool = True) -> gate.Verdict:
        return gate.evaluate_node(gpu_spec, gpu_hash, [pod], now, lambda _: was_ready)

    held = judge(flapping, since + 5)
    assert held.ok and held.until == since + gate.FLAP_SECONDS
    assert "NotReady for 5 s" in held.message
    closed = [
        judge(flapping, since + gate.FLAP_SECONDS),  # the grace is over
        judge(flapping, since + 5, was_ready=False),  # never Ready, or restarted since
        judge(dataclasses.replace(flapping, containers_running=False), since + 5),
        judge(dataclasses.replace(flapping, phase="Failed"), since + 5),
        judge(dataclasses.replace(flapping, not_ready_since=None), since + 5),
        judge(make_pod(ready=False, state="Loading"), since + 5),  # its report says so
    ]
    for verdict in closed:
        assert not verdict.ok and verdict.until is None, verdict
    # Without a clock (the pure callers of old), no grace at all.
    assert not gate.evaluate_node(gpu_spec, gpu_hash, [flapping]).ok


def test_reports_the_view_did_not_keep_are_malformed(
    gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod
) -> None:
    pod = dataclasses.replace(make_pod(reports=None), report_error="70 report annotations for "
                              "at most 2 (one per daemon container)")
    verdict = gate.evaluate_node(gpu_spec, gpu_hash, [pod])
    assert (verdict.ok, verdict.reason) == (False, gate.REPORT_MALFORMED)
    assert "70 report annotations" in verdict.message


def test_an_earlier_generation_is_judged_by_its_own_gpus_and_bytes(
    make_pod: MakePod, gpu_spec: WeightCacheSpec, gpu_hash: str
) -> None:
    """A pod bound to the generation before a spec change that also changed the GPUs (or
    pinned the new model's bytes): its node's daemon is judged as rendered for that
    generation, never by the current spec's slots or pins (issue 36)."""
    def spec_with(per_node: int, **engine: object) -> WeightCacheSpec:
        return parse_spec({"model": {"path": "/models/m2"},
                           "gpus": {"perNode": per_node, "tpSize": per_node,
                                    "shardPlan": "llama"},
                           "transport": "vmm_fd",
                           "engine": {"selector": {"matchLabels": {"app": "engine"}},
                                      **engine}})

    two = dataclasses.replace(make_pod(), slots=2)  # rendered for 2 GPUs, both Ready
    for current in (spec_with(4), spec_with(1), spec_with(2, expectedBytes=100 * GIB)):
        verdict = gate.evaluate_node(current, gpu_hash, [two], bound=True)
        assert verdict.ok, verdict.message
    # A 4-GPU generation with two GPUs reported stays closed under a 2-GPU spec.
    half = dataclasses.replace(make_pod(gpus=2), slots=4)
    verdict = gate.evaluate_node(spec_with(2), gpu_hash, [half], bound=True)
    assert (verdict.ok, verdict.reason) == (False, gate.DAEMON_NOT_READY)
    assert "2 of 4 GPUs reported" in verdict.message
    # The current generation keeps the spec's rules: its pin applies.
    pinned = spec_with(2, expectedBytes=100 * GIB)
    assert gate.evaluate_node(pinned, gpu_hash, [two]).reason == gate.BYTES_BELOW_EXPECTED


# --------------------------------------------------------------------------- kept generations

OLD = "0" * 64


def test_a_generation_kept_beside_the_current_one_is_resident_while_the_daemon_runs(
    make_pod: MakePod, gpu_spec: WeightCacheSpec, gpu_hash: str
) -> None:
    """Issue 42: a daemon that a model change replaced takes the old weights back from the
    engines that map them and keeps them (`retained`); pods bound to the old generation are
    judged by that, even while the pod is NotReady (its new generation still loads)."""
    kept = RetainedReport(spec_hash=OLD, fingerprint="e" * 64,
                          preloaded_weights_bytes=GIB, expected_bytes=GIB)
    loading = dataclasses.replace(
        make_pod(state="Loading", ready=False, retained=[kept]), containers_running=True)
    verdict = gate.evaluate_node(gpu_spec, OLD, [loading], bound=True)
    assert verdict.ok, verdict.message
    assert f"keep {2 * GIB} bytes of {OLD[:12]}" in verdict.message
    # The current generation itself is still loading there.
    assert gate.evaluate_node(gpu_spec, gpu_hash, [loading]).reason == gate.DAEMON_NOT_READY
    # Not running any more (killed): nothing vouches for the kept weights.
    stopped = dataclasses.replace(loading, containers_running=False)
    assert gate.evaluate_node(gpu_spec, OLD, [stopped], bound=True).reason == (
        gate.DAEMON_NOT_READY)
    # Kept in part (less than expected), or not at all: closed.
    short = msgspec.structs.replace(kept, preloaded_weights_bytes=GIB // 2)
    for retained, reason in (([short], gate.BYTES_BELOW_EXPECTED),
                             ([], gate.FINGERPRINT_MISMATCH)):
        pod = dataclasses.replace(make_pod(retained=retained), containers_running=True)
        assert gate.evaluate_node(gpu_spec, OLD, [pod], bound=True).reason == reason


# --------------------------------------------------------------------------- the carry


def carry_scene(make_pod: MakePod, transport: str = "vmm_fd"
                ) -> tuple[DaemonPodView, gate.LastGood]:
    """A Ready daemon pod (one process: instance a…) and what the operator remembers of it."""
    pod = dataclasses.replace(make_pod(transport=transport, instance="a" * 16), uid="old-uid",
                              containers_running=True)
    verdict = gate.evaluate_pod(parse_spec(GPU), spec_hash(parse_spec(GPU)), pod)
    good = gate.last_good(verdict, [pod])
    assert good is not None
    return pod, good


GPU = {"model": {"path": "/models/m"}, "gpus": {"perNode": 2, "tpSize": 2, "shardPlan": "llama"},
       "transport": "vmm_fd", "engine": {"selector": {"matchLabels": {"app": "engine"}}}}


def test_a_replaced_daemons_verdict_is_carried_until_its_successor_decides(
    make_pod: MakePod, gpu_spec: WeightCacheSpec, gpu_hash: str
) -> None:
    """Issue 42 item 2: between the old daemon pod's exit and the new one's first report
    nothing reports, and every gate on the node closed (37 of 43 requests went to pods that
    were not Ready while the engines answered correctly). The replaced pod's verdict holds
    until its successor says whether it took the weights back, CARRY_SECONDS at most."""
    old, good = carry_scene(make_pod)
    since = 1_000_000.0
    good = dataclasses.replace(good, since=since)

    def judge(pods: list[DaemonPodView], now: float = since + 5,
              last: gate.LastGood = good) -> gate.Verdict | None:
        failed = gate.evaluate_node(gpu_spec, gpu_hash, pods)
        assert not failed.ok
        return gate.carried(failed, gpu_hash, pods, last, now)

    def successor(**entry: object) -> DaemonPodView:
        return dataclasses.replace(make_pod("wc-new", ready=False, instance="b" * 16, **entry),
                                   uid="new-uid", containers_running=True)

    terminating = dataclasses.replace(old, terminating=True)
    killed = dataclasses.replace(old, ready=False, containers_running=False)
    restarted = dataclasses.replace(old, ready=False, restarts=1)  # its old report stays
    readopting = successor(state="Loading", load_phase=PHASE_READOPTING)
    taken_back = successor(readopted=True, load_source="readopted")
    for pods in ([terminating], [], [readopting], [terminating, readopting],
                 [taken_back], [killed], [restarted],
                 [dataclasses.replace(readopting, reports={})]):
        verdict = judge(pods)
        assert verdict is not None and verdict.ok, pods
        assert verdict.until == since + gate.CARRY_SECONDS
        assert "replaced" in verdict.message and verdict.pod == old.name

    # The successor decided against it: it loads otherwise, holds other weights, errs.
    for decided in (successor(state="Loading", load_phase="loading"),
                    successor(load_source="disk"),  # Ready from disk: not taken back
                    successor(state="Error", message="CUDA OOM"),
                    dataclasses.replace(successor(), reports={KEY: "{not json"})):
        assert judge([decided]) is None, decided
    # Too long without a decision (a dead node, a successor that never reports).
    assert judge([terminating], since + gate.CARRY_SECONDS) is None
    # Nothing was replaced: the same process fails on its own (NotReady past a flap, its
    # report says Loading): not carried.
    assert judge([dataclasses.replace(old, ready=False)]) is None
    # torch_ipc: the memory died with the daemon (its engines fail-stop).
    _, ipc = carry_scene(make_pod, transport="torch_ipc")
    assert judge([terminating], last=dataclasses.replace(ipc, since=since)) is None


def test_a_model_change_carries_the_old_generation_until_the_successor_keeps_it(
    make_pod: MakePod, gpu_spec: WeightCacheSpec, gpu_hash: str
) -> None:
    """The successor of another generation decides for the old one by keeping it
    (`retained`) or not."""
    old, good = carry_scene(make_pod)
    good = dataclasses.replace(good, since=0.0)
    new_hash = "1" * 64

    def successor(**entry: object) -> DaemonPodView:
        reports = annotations(*(device_report(f"GPU-{i}", new_hash, state="Loading", **entry)
                                for i in range(2)))
        return dataclasses.replace(make_pod("wc-new", template_hash=new_hash, ready=False,
                                            reports=reports), uid="new-uid")

    kept = RetainedReport(spec_hash=gpu_hash, fingerprint="e" * 64,
                          preloaded_weights_bytes=GIB, expected_bytes=GIB)
    for pod, carried in ((successor(load_phase=PHASE_READOPTING), True),
                         (successor(retained=[kept]), True),
                         (successor(load_phase="loading"), False),
                         (successor(load_phase=PHASE_WAITING_FOR_ROOM), False)):
        failed = gate.evaluate_node(gpu_spec, gpu_hash, [pod], bound=True)
        assert (gate.carried(failed, gpu_hash, [pod], good, 5.0) is not None) is carried


def test_a_carried_verdict_keeps_an_open_gate_open_and_opens_none() -> None:
    """The kwok fleet's model wave: a LastGood re-recorded from a lagging view was carried
    again after the successor had closed the gate, opening it with the replaced pod's
    verdict. A carry only keeps open what is open."""
    failed = gate.Verdict(False, gate.DAEMON_NOT_READY, "the successor has not reported")
    carried = gate.Verdict(True, gate.WEIGHTS_RESIDENT, "daemon pod old replaced", "old",
                           instead=failed)
    plain = gate.Verdict(True, gate.WEIGHTS_RESIDENT, "held", "new")
    verdicts = {"a": carried, "b": plain}
    assert gate.for_gate(verdicts, is_open=True) == verdicts
    assert gate.for_gate(verdicts, is_open=False) == {"a": failed, "b": plain}
    closed = gate.gate_condition("node", gate.for_gate(verdicts, is_open=False))
    assert (closed.status, closed.reason) == ("False", gate.DAEMON_NOT_READY)
