from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.unit.operator.builders import GIB, gpu_entry, report
from weightcache_operator import aggregate, gate
from weightcache_operator.spec import WeightCacheSpec
from weightcache_operator.views import DaemonPodView, DaemonSetView

MakePod = Callable[..., DaemonPodView]
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def ds(
    desired: int = 2, updated: int | None = None, generation: int = 1, applied: int | None = 1
) -> DaemonSetView:
    return DaemonSetView(
        "ns",
        "wc",
        desired,
        desired if updated is None else updated,
        generation,
        generation,
        applied,
        "h",
    )


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


def test_loading_node(gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod) -> None:
    s = build(
        gpu_spec, gpu_hash, [make_pod("p1", "node-a"), make_pod("p2", "node-b", state="Loading")]
    ).status
    assert s["phase"] == "Loading"
    assert s["ready"] == "1/2" and s["residentBytes"] == 2 * GIB
    assert cond(s, "Ready")["reason"] == gate.DAEMON_NOT_READY
    assert "node-b" in cond(s, "WeightsResident")["message"]
    assert (cond(s, "Progressing")["status"], cond(s, "Progressing")["reason"]) == (
        "True",
        "Loading",
    )


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
    pods = [make_pod("p1", "node-a", raw='{"v": 1, "specHash": 7}')]
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
    s = build(gpu_spec, gpu_hash, [make_pod("p1", None, raw=None)], daemonset=ds(1)).status
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
        now=T0,
    ).status
    assert s["observedGeneration"] == 3


def test_fingerprint_mismatch_node(
    gpu_spec: WeightCacheSpec, gpu_hash: str, make_pod: MakePod
) -> None:
    stale = make_pod(
        "p2",
        "node-b",
        raw=report(
            "e" * 64,
            {
                "GPU-0": gpu_entry(transport="torch_ipc", expected=7 * GIB),
                "GPU-1": gpu_entry(transport="torch_ipc", expected=7 * GIB),
            },
        ),
    )
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
