"""The scale harness's view of the fleet and its daemons' reports (benchmarks/fleet.py)."""

from __future__ import annotations

from typing import Any

from benchmarks import scale
from benchmarks.fleet import DaemonPod, FleetView, Kept, Report, fingerprint
from weightcache.daemon.reporter import device_report, report_patch
from weightcache.report import PHASE_LOADING, decode_pod_reports
from weightcache_operator import gate, names, views
from weightcache_operator.spec import parse_spec, spec_hash

OLD, NEW = "a" * 64, "b" * 64
SHARD = scale.SHARD_BYTES


def daemon(name: str = "wc-new") -> DaemonPod:
    return DaemonPod(name=name, uid=f"uid-{name}", node="kwok-gpu-1", phase="Running",
                     deleting=False, spec_hash=NEW, controlled=True)


def pod_body(reports: list[Report], gpus: int) -> dict[str, Any]:
    """The daemon pod as the operator reads it once the reports landed (kwok's status)."""
    annotations: dict[str, str] = {names.SPEC_HASH_ANNOTATION: NEW}
    for r in reports:
        patch = report_patch(device_report(r.status(), r.spec_hash, r.pod.node or "", "now"))
        annotations.update(patch["metadata"]["annotations"])
    containers = [{"name": f"daemon-{i}"} for i in range(gpus)]
    return {
        "metadata": {"name": "wc-new", "namespace": "wc-system", "uid": "uid-wc-new",
                     "annotations": annotations,
                     "ownerReferences": [{"kind": "DaemonSet", "uid": "ds", "controller": True}]},
        "spec": {"nodeName": "kwok-gpu-1", "containers": containers},
        "status": {"phase": "Running",
                   "conditions": [{"type": "Ready", "status": "True"}],
                   "containerStatuses": [{"name": c["name"], "restartCount": 0,
                                          "state": {"running": {}}} for c in containers]},
    }


def test_a_report_keeps_earlier_generations_as_the_reporter_writes_them() -> None:
    kept = (Kept(OLD, SHARD, SHARD),)
    report = Report(daemon(), 3, "loading", NEW, 0, SHARD, kept, PHASE_LOADING)
    body = pod_body([report], 1)
    decoded = next(iter(decode_pod_reports(views.daemon_pod_view(body).reports).values()))
    assert (decoded.state, decoded.spec_hash, decoded.load_phase) == ("Loading", NEW, "loading")
    held = decoded.holding(OLD)
    assert held is not None and decoded.holding(NEW) is None
    # The old generation's own layout for this slot, as its daemon reported it Ready.
    assert held.fingerprint == fingerprint(OLD, 3)
    assert (held.preloaded_weights_bytes, held.expected_bytes) == (SHARD, SHARD)
    assert Report(daemon(), 3, "ready", NEW, SHARD, SHARD).status().retained == []


def test_the_operator_opens_a_gate_bound_to_the_kept_generation_on_such_reports() -> None:
    """What the surge wave's reports must make the gate say: the engines' old generation
    kept while the new one loads, and once it is Ready (gate._retained_verdict's path)."""
    gpus = 8
    spec = parse_spec(scale.weightcache(gpus, "r5", "10%")["spec"])
    kept = (Kept(OLD, SHARD, SHARD),)
    for state, held in (("loading", 0), ("ready", SHARD)):
        reports = [Report(daemon(), slot, state, NEW, held, SHARD, kept)
                   for slot in range(gpus)]
        view = views.daemon_pod_view(pod_body(reports, gpus))
        verdict = gate.evaluate_pod(spec, OLD, view, bound=True)
        assert verdict.ok, verdict.message
        assert scale.opened("wc-new").gate_ok(
            scale.Gate("True", verdict.reason, verdict.message, 0.0))
        assert "keep" in verdict.message
        # Without them kept, the old generation is not there.
        bare = [Report(daemon(), slot, state, NEW, held, SHARD) for slot in range(gpus)]
        refused = gate.evaluate_pod(spec, OLD, views.daemon_pod_view(pod_body(bare, gpus)),
                                    bound=True)
        assert refused.reason == gate.FINGERPRINT_MISMATCH
    assert spec_hash(spec) != OLD


def engine(status: str, message: str = "m") -> dict[str, Any]:
    return {"metadata": {"name": "engine-n1"}, "spec": {"nodeName": "n1"},
            "status": {"conditions": [{"type": names.GATE_CONDITION, "status": status,
                                       "reason": "r", "message": message}]}}


def test_the_view_counts_every_closing_the_watch_delivers() -> None:
    view = FleetView("fleet", "app=e", "label", "wc-system")
    view.on_engine("ADDED", engine("False"), 0.0)
    assert view.closings == {}  # closed from the start: no closing
    view.on_engine("MODIFIED", engine("True"), 1.0)
    view.on_engine("MODIFIED", engine("True", "carried"), 2.0)
    assert view.closings == {}
    view.on_engine("MODIFIED", engine("False"), 3.0)
    view.on_engine("MODIFIED", engine("False", "other"), 3.5)
    view.on_engine("MODIFIED", engine("True"), 4.0)  # opened again before any poll
    view.on_engine("MODIFIED", engine("False"), 5.0)
    assert view.closings == {"engine-n1": 2}
