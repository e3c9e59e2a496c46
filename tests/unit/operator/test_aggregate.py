from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.unit.operator.builders import GIB, annotations, device_report
from tests.unit.operator.conftest import daemonset as ds
from weightcache.report import MAX_DEVICE_BYTES, MAX_DEVICES, MAX_MESSAGE_CHARS
from weightcache_operator import aggregate, gate
from weightcache_operator.spec import WeightCacheSpec, parse_spec, spec_hash
from weightcache_operator.views import DaemonPodView, DaemonSetView

MakePod = Callable[..., DaemonPodView]
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"
LABEL = "weightcache.dev/ns.wc"


def cond(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == type_)


def build(
    spec: WeightCacheSpec,
    digest: str,
    pods: list[DaemonPodView],
    *,
    daemonset: DaemonSetView | None = None,
    generation: int = 1,
    old: dict[str, Any] | None = None,
    now: str = T0,
) -> aggregate.Aggregate:
    return aggregate.build_status(
        spec=spec,
        spec_hash=digest,
        generation=generation,
        old_status=old or {},
        daemonset=daemonset if daemonset is not None else ds(),
        pods=pods,
        node_label=LABEL,
        now=now,
    )


def test_all_nodes_verified(gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod) -> None:
    result = build(gpu_spec, gpu_hash, [make_pod("p1", "node-a"), make_pod("p2", "node-b")])
    s = result.status
    assert s["phase"] == "Ready"
    assert (s["readyNodes"], s["desiredNodes"], s["ready"]) == (2, 2, "2/2")
    assert s["residentBytes"] == 4 * GIB and s["resident"] == "4.0GiB"
    assert s["expectedBytes"] == GIB
    assert s["transport"] == "vmm_fd"
    assert s["fingerprint"] == gpu_hash
    assert s["observedGeneration"] == 1
    assert s["nodesOmitted"] == 0
    assert s["nodeLabel"] == LABEL
    assert [n["name"] for n in s["nodes"]] == ["node-a", "node-b"]
    node = s["nodes"][0]
    assert (node["ready"], node["reason"], node["pod"]) == (True, gate.WEIGHTS_RESIDENT, "p1")
    assert node["gpus"][0] == {
        "id": "GPU-0",
        "state": "Ready",
        "preloadedWeightsBytes": GIB,
        "expectedBytes": GIB,
        "transport": "vmm_fd",
        "fingerprint": "f" * 64,
        "loadSeconds": 1.5,
        "readopted": False,
        "message": "",
    }
    assert {c["type"]: (c["status"], c["reason"]) for c in s["conditions"]} == {
        "Ready": ("True", "Ready"),
        "WeightsResident": ("True", gate.WEIGHTS_RESIDENT),
        "Progressing": ("False", "Complete"),
        "Degraded": ("False", "AsExpected"),
    }
    assert all(c["lastTransitionTime"] == T0 for c in s["conditions"])
    assert set(result.verdicts) == {"node-a", "node-b"}



def test_each_gpu_says_where_its_weights_came_from(
    gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod
) -> None:
    reports = annotations(
        device_report("GPU-0", gpu_hash, "node-a", load_source="disk"),
        device_report("GPU-1", gpu_hash, "node-a", load_source="peer", seeded_from="GPU-0"),
    )
    gpus = build(gpu_spec, gpu_hash, [make_pod(reports=reports)]).status["nodes"][0]["gpus"]
    assert [(g["id"], g.get("loadSource"), g.get("seededFrom")) for g in gpus] == [
        ("GPU-0", "disk", None),
        ("GPU-1", "peer", "GPU-0"),
    ]


def test_gpu_error_degrades(gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod) -> None:
    s = build(
        gpu_spec,
        gpu_hash,
        [make_pod("p1", "node-a", state="Error", message="out of memory")],
        daemonset=ds(1),
    ).status
    assert s["phase"] == "Degraded"
    degraded = cond(s, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", aggregate.DAEMON_ERROR)
    assert "out of memory" in degraded["message"]
    assert cond(s, "Progressing")["status"] == "False"


def test_malformed_report_degrades_and_warns_once(
    gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod
) -> None:
    pods = [make_pod("p1", "node-a", reports={"weightcache.dev/report.GPU-0": '{"v": 1}'})]
    first = build(gpu_spec, gpu_hash, pods, daemonset=ds(1))
    assert cond(first.status, "Degraded")["reason"] == gate.REPORT_MALFORMED
    assert first.status["nodes"][0]["gpus"] == []
    warnings = [e for e in first.events if e.reason == gate.REPORT_MALFORMED]
    assert len(warnings) == 1 and warnings[0].type == "Warning" and "node-a" in warnings[0].message
    again = build(gpu_spec, gpu_hash, pods, daemonset=ds(1), old=first.status, now=T1)
    assert again.events == []
    assert again.status == first.status


def test_bytes_below_expected_degrades(
    gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod
) -> None:
    s = build(gpu_spec, gpu_hash, [make_pod(preloaded=GIB // 4)], daemonset=ds(1)).status
    assert cond(s, "Degraded")["reason"] == gate.BYTES_BELOW_EXPECTED
    assert cond(s, "WeightsResident")["reason"] == gate.BYTES_BELOW_EXPECTED
    assert s["phase"] == "Degraded"


def test_no_nodes_is_pending(gpu_spec: WeightCacheSpec, gpu_hash: str) -> None:
    s = build(gpu_spec, gpu_hash, [], daemonset=ds(0)).status
    assert s["phase"] == "Pending" and s["ready"] == "0/0"
    assert cond(s, "WeightsResident")["reason"] == gate.NO_DAEMON_ON_NODE
    assert "spec.placement" in cond(s, "WeightsResident")["message"]
    assert s["transport"] == "vmm_fd"  # spec.transport until a daemon reports
    assert "expectedBytes" not in s


def test_scheduled_daemons_without_pods(
    gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod
) -> None:
    s = build(gpu_spec, gpu_hash, [make_pod("p1", "node-a")], daemonset=ds(3)).status
    assert s["ready"] == "1/3"
    resident = cond(s, "WeightsResident")
    assert (resident["status"], resident["reason"]) == ("False", gate.NO_DAEMON_ON_NODE)


def test_unscheduled_daemon_pod_is_not_a_node(
    gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod
) -> None:
    s = build(gpu_spec, gpu_hash, [make_pod("p1", None, reports=None)], daemonset=ds(1)).status
    assert s["nodes"] == [] and s["ready"] == "0/1"


def test_new_generation_not_applied_yet(
    gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod
) -> None:
    s = build(gpu_spec, gpu_hash, [make_pod()], daemonset=ds(1), generation=2).status
    assert s["observedGeneration"] == 1
    assert cond(s, "Progressing")["reason"] == "Applying"
    assert (cond(s, "Ready")["status"], cond(s, "Ready")["reason"]) == ("False", "Applying")
    assert s["phase"] == "Loading"


def test_daemonset_rolling_out(gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod) -> None:
    s = build(gpu_spec, gpu_hash, [make_pod()], daemonset=ds(1, updated=0)).status
    progressing = cond(s, "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("True", "RollingOut")
    assert progressing["message"] == "0/1 daemon pods updated"


def test_observed_generation_kept_without_daemonset(
    gpu_spec: WeightCacheSpec, gpu_hash: str
) -> None:
    s = aggregate.build_status(
        spec=gpu_spec,
        spec_hash=gpu_hash,
        generation=4,
        old_status={"observedGeneration": 3},
        daemonset=None,
        pods=[],
        node_label=LABEL,
        now=T0,
    ).status
    assert s["observedGeneration"] == 3


def test_fingerprint_mismatch_node(
    gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod
) -> None:
    other = (
        device_report(f"GPU-{i}", "e" * 64, "node-b", transport="torch_ipc", expected=7 * GIB)
        for i in range(2)
    )
    stale = make_pod("p2", "node-b", reports=annotations(*other))
    result = build(gpu_spec, gpu_hash, [make_pod("p1", "node-a"), stale])
    s = result.status
    assert s["nodes"][1]["reason"] == gate.FINGERPRINT_MISMATCH
    # Figures of daemons holding other weights do not describe this cache.
    assert s["transport"] == "vmm_fd" and s["expectedBytes"] == GIB
    assert cond(s, "Degraded")["status"] == "False"
    assert [e.reason for e in result.events if e.type == "Warning"] == [gate.FINGERPRINT_MISMATCH]


def test_mixed_transports(gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod) -> None:
    pods = [make_pod("p1", "node-a"), make_pod("p2", "node-b", transport="torch_ipc")]
    assert build(gpu_spec, gpu_hash, pods).status["transport"] == "mixed"


def test_transition_times_and_events(
    gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod
) -> None:
    loading = build(gpu_spec, gpu_hash, [make_pod(state="Loading")], daemonset=ds(1))
    assert [e.reason for e in loading.events] == ["PhaseChanged"]
    assert loading.events[0].message == "phase None -> Loading (0/1 ready)"

    ready = build(gpu_spec, gpu_hash, [make_pod()], daemonset=ds(1), old=loading.status, now=T1)
    assert [(e.type, e.reason) for e in ready.events] == [
        ("Normal", "NodeReady"),
        ("Normal", "PhaseChanged"),
    ]
    assert cond(ready.status, "Ready")["lastTransitionTime"] == T1
    assert cond(ready.status, "Degraded")["lastTransitionTime"] == T0  # unchanged status

    lost = build(gpu_spec, gpu_hash, [], daemonset=ds(1), old=ready.status, now=T1)
    assert ("Normal", "PhaseChanged") in [(e.type, e.reason) for e in lost.events]

    reloading = build(
        gpu_spec, gpu_hash, [make_pod(state="Loading")], daemonset=ds(1), old=ready.status, now=T1
    )
    assert ("Warning", gate.DAEMON_NOT_READY) in [(e.type, e.reason) for e in reloading.events]


def test_a_serving_daemons_warning_is_posted_once(
    gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod
) -> None:
    """A daemon that serves but could not write its manifest (its filesystem full) says so
    in its report; the operator posts it as a Warning once, and again only when it changes."""
    quiet = build(gpu_spec, gpu_hash, [make_pod()], daemonset=ds(1))
    warning = "manifest /run/wc/ns.wc/.daemon/x.manifest not written: [Errno 28] No space"
    warned = build(gpu_spec, gpu_hash, [make_pod(message=warning)], daemonset=ds(1),
                   old=quiet.status, now=T1)
    assert [(e.type, e.reason, e.message) for e in warned.events] == [
        ("Warning", aggregate.DAEMON_WARNING, f"node-a: GPU-{i}: {warning}") for i in (0, 1)]
    assert warned.status["phase"] == "Ready"  # serving: the gate and phase are unchanged
    assert warned.status["nodes"][0]["gpus"][0]["message"] == warning
    again = build(gpu_spec, gpu_hash, [make_pod(message=warning)], daemonset=ds(1),
                  old=warned.status, now=T1)
    assert again.events == []
    other = build(gpu_spec, gpu_hash, [make_pod(message=warning + "!")], daemonset=ds(1),
                  old=warned.status, now=T1)
    assert [e.reason for e in other.events] == [aggregate.DAEMON_WARNING] * 2
    cleared = build(gpu_spec, gpu_hash, [make_pod()], daemonset=ds(1), old=warned.status, now=T1)
    assert cleared.events == []


def test_node_list_is_capped_keeping_unready_nodes(
    gpu_spec: WeightCacheSpec,
    gpu_hash: str,
    make_pod: MakePod,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(aggregate, "MAX_STATUS_NODES", 3)
    pods = [make_pod(f"p{i}", f"node-{i}") for i in range(4)]
    pods.append(make_pod("p9", "node-9", state="Loading"))
    s = build(gpu_spec, gpu_hash, pods, daemonset=ds(5)).status
    assert s["nodesOmitted"] == 2
    assert len(s["nodes"]) == 3 and "node-9" in [n["name"] for n in s["nodes"]]
    assert s["readyNodes"] == 4  # counts are over all nodes


def test_status_stays_bounded_whatever_200_nodes_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """200 nodes of 64 GPUs, every report field at its maximum: the status still fits."""
    spec = parse_spec({
        "model": {"path": "/models/m"}, "gpus": {"perNode": MAX_DEVICES}, "transport": "vmm_fd",
    })
    digest = spec_hash(spec)
    longest = "n" * 240

    def maximal(node: int) -> DaemonPodView:
        node_name = f"{longest}-{node:03d}"
        reports = annotations(*(
            device_report(
                f"GPU-{gpu:02d}-" + "u" * 48, digest, node_name, state="Error",
                preloaded=MAX_DEVICE_BYTES, expected=MAX_DEVICE_BYTES,
                message="m" * MAX_MESSAGE_CHARS, transport="t" * 64, load_seconds=1e9,
            )
            for gpu in range(MAX_DEVICES)
        ))
        return DaemonPodView(
            namespace="ns", name="p" * 250 + f"{node:03d}", cache="wc", node=node_name,
            phase="Running", ready=True, terminating=False, reports=reports, spec_hash=digest,
            created=T0, controller_uid="ds-uid",
        )

    result = build(spec, digest, [maximal(i) for i in range(200)], daemonset=ds(200))
    size = len(json.dumps(result.status))
    assert size <= aggregate.MAX_STATUS_NODE_BYTES + 64 * 1024, size
    assert result.status["nodesOmitted"] == 200 - len(result.status["nodes"]) > 0
    assert result.status["residentBytes"] <= (1 << 63) - 1


def test_error_status_keeps_last_known_state() -> None:
    old = {
        "phase": "Ready",
        "nodes": [{"name": "n"}],
        "readyNodes": 1,
        "observedGeneration": 1,
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Ready",
                "message": "",
                "lastTransitionTime": T0,
            }
        ],
    }
    result = aggregate.error_status(2, old, aggregate.RENDER_FAILED, "no image", T1)
    s = result.status
    assert s["phase"] == "Error" and s["observedGeneration"] == 2
    assert s["nodes"] == [{"name": "n"}] and s["readyNodes"] == 1
    assert (cond(s, "Ready")["status"], cond(s, "Ready")["reason"]) == (
        "False",
        aggregate.RENDER_FAILED,
    )
    assert cond(s, "Degraded")["message"] == "no image"
    assert cond(s, "Ready")["lastTransitionTime"] == T1
    assert [(e.type, e.reason) for e in result.events] == [("Warning", aggregate.RENDER_FAILED)]
    assert aggregate.error_status(2, s, aggregate.RENDER_FAILED, "no image", T1).events == []


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0B"),
        (1023, "1023B"),
        (1024, "1.0KiB"),
        (90_868_376, "86.7MiB"),
        (3 * GIB // 2, "1.5GiB"),
        (5 << 40, "5.0TiB"),
        (5 << 50, "5120.0TiB"),
    ],
)
def test_human_bytes(n: int, text: str) -> None:
    assert aggregate.human_bytes(n) == text


def test_condition_messages_name_a_few_nodes_whatever_the_fleet(
    gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod
) -> None:
    """Once, the Degraded message listed every affected node: 1,000 long names, 250 KB."""
    longest = "n" * 240
    pods = [make_pod(f"p{i}", f"{longest}-{i:04d}", preloaded=GIB // 4) for i in range(1000)]
    result = build(gpu_spec, gpu_hash, pods, daemonset=ds(1000))
    degraded = cond(result.status, "Degraded")
    assert degraded["reason"] == gate.BYTES_BELOW_EXPECTED
    assert degraded["message"].endswith(f"and {1000 - aggregate.MAX_NAMED_NODES} more")
    assert len(degraded["message"]) < (aggregate.MAX_NAMED_NODES + 1) * 260
    size = len(json.dumps(result.status))
    assert size <= aggregate.MAX_STATUS_NODE_BYTES + 64 * 1024, size
    assert result.status["nodesOmitted"] == 1000 - len(result.status["nodes"])


def test_given_verdicts_are_used_and_previous_decides_the_events(
    gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod
) -> None:
    pods = [make_pod("p1", "node-a"), make_pod("p2", "node-b", state="Loading")]
    verdicts = aggregate.node_verdicts(gpu_spec, gpu_hash, pods)
    result = aggregate.build_status(
        spec=gpu_spec, spec_hash=gpu_hash, generation=1, old_status={}, daemonset=ds(2),
        verdicts=verdicts, previous={"node-a": (True, gate.WEIGHTS_RESIDENT),
                                     "node-b": (True, gate.WEIGHTS_RESIDENT)},
        node_label=LABEL, now=T0,
    )
    assert result.status == build(gpu_spec, gpu_hash, pods, daemonset=ds(2)).status
    # node-a was already announced; node-b was verified and is no longer.
    assert [(e.type, e.reason) for e in result.events] == [
        ("Warning", gate.DAEMON_NOT_READY), ("Normal", "PhaseChanged")]


def test_many_nodes_changing_alike_make_one_event_per_reason(
    gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod
) -> None:
    """Once, a fleet becoming ready posted one event per node to the WeightCache."""
    pods = [make_pod(f"p{i}", f"node-{i:02d}") for i in range(30)]
    pods.append(make_pod("p-odd", "node-odd", preloaded=GIB // 4))
    events = build(gpu_spec, gpu_hash, pods, daemonset=ds(31)).events
    ready = [e for e in events if e.reason == "NodeReady"]
    (one,) = ready
    assert one.message.startswith("30 nodes: node-00, node-01") and one.message.endswith(
        f"and {30 - aggregate.MAX_NAMED_NODES} more")
    (below,) = [e for e in events if e.reason == gate.BYTES_BELOW_EXPECTED]
    assert below.message.startswith("node-odd: daemon pod p-odd")


def test_generations_list_the_held_first_and_count_every_bound_pod(
    gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod
) -> None:
    """Issue 36: what daemons hold and what engine pods are bound to. Pods may bind
    themselves to any hash: those never crowd out what daemons hold, the list is capped
    with a count of the rest, and Progressing counts every bound pod, listed or not."""
    old = "a" * 64
    loading = make_pod("wc-b", "node-b", state="Loading")
    verdicts = {"node-a": gate.evaluate_node(gpu_spec, gpu_hash, [make_pod()]),
                "node-b": gate.evaluate_node(gpu_spec, gpu_hash, [loading])}
    fakes = {f"{i:064x}": 5 for i in range(1, 11)}
    result = aggregate.build_status(
        spec=gpu_spec, spec_hash=gpu_hash, generation=1, old_status={}, daemonset=ds(),
        verdicts=verdicts, bound={gpu_hash: 1, old: 1, **fakes}, node_label=LABEL, now=T0)
    status = result.status
    assert status["generations"][0] == {"fingerprint": gpu_hash, "current": True,
                                        "nodes": 1, "enginePods": 1}  # node-b still loads
    assert len(status["generations"]) == aggregate.MAX_STATUS_GENERATIONS
    assert status["generationsOmitted"] == 12 - aggregate.MAX_STATUS_GENERATIONS
    assert old not in [g["fingerprint"] for g in status["generations"]]  # fewest pods
    assert {n["name"]: n.get("specHash") for n in status["nodes"]} == {
        "node-a": gpu_hash, "node-b": None}
    progressing = cond(status, "Progressing")
    assert progressing["status"] == "True"
    # node-b loads: Loading is the reason first; once every node is verified the bound
    # pods are, all 51 of them (the omitted ones too).
    assert progressing["reason"] == "Loading"
    verdicts["node-b"] = gate.evaluate_node(gpu_spec, gpu_hash, [make_pod("wc-b", "node-b")])
    done = aggregate.build_status(
        spec=gpu_spec, spec_hash=gpu_hash, generation=1, old_status={}, daemonset=ds(),
        verdicts=verdicts, bound={gpu_hash: 1, old: 1, **fakes}, node_label=LABEL, now=T0)
    progressing = cond(done.status, "Progressing")
    assert progressing["reason"] == aggregate.ENGINES_ON_OLD_WEIGHTS
    assert progressing["message"].startswith("51 engine pod(s) bound to another generation")
    quiet = aggregate.build_status(
        spec=gpu_spec, spec_hash=gpu_hash, generation=1, old_status={}, daemonset=ds(),
        verdicts=verdicts, bound={gpu_hash: 2}, node_label=LABEL, now=T0)
    assert cond(quiet.status, "Progressing")["reason"] == "Complete"
    assert quiet.status["generations"] == [
        {"fingerprint": gpu_hash, "current": True, "nodes": 2, "enginePods": 2}]
    assert quiet.status["generationsOmitted"] == 0
