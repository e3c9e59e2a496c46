from __future__ import annotations

from weightcache_operator import names, views


def test_daemon_pod_view() -> None:
    body = {
        "metadata": {
            "name": "wc-x",
            "namespace": "ns",
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {names.CACHE_LABEL: "wc"},
            "annotations": {names.REPORT_ANNOTATION: "{}", names.SPEC_HASH_ANNOTATION: "h"},
        },
        "spec": {"nodeName": "n1"},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    view = views.daemon_pod_view(body)
    assert view == views.DaemonPodView(
        "ns", "wc-x", "wc", "n1", "Running", True, False, "{}", "h", "2026-01-01T00:00:00Z"
    )
    body["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:01Z"
    body["status"] = {}
    view = views.daemon_pod_view(body)
    assert (view.terminating, view.ready, view.phase) == (True, False, "Pending")


def test_engine_pod_gate_detection_and_view() -> None:
    body = {
        "metadata": {"name": "e", "namespace": "ns", "uid": "u", "labels": {"app": "e"}},
        "spec": {"readinessGates": [{"conditionType": names.GATE_CONDITION}]},
        "status": {
            "conditions": [
                {
                    "type": names.GATE_CONDITION,
                    "status": "False",
                    "reason": "DaemonNotReady",
                    "message": "m",
                }
            ]
        },
    }
    assert views.has_gate(body)
    assert not views.has_gate({"spec": {"readinessGates": [{"conditionType": "other"}]}})
    assert not views.has_gate({"spec": {}})
    view = views.engine_pod_view(body)
    assert view.gate == views.Condition("False", "DaemonNotReady", "m")
    assert view.node is None and view.labels == {"app": "e"}
    body["status"] = {}
    assert views.engine_pod_view(body).gate is None


def test_daemonset_view() -> None:
    body = {
        "metadata": {
            "name": "weightcache-wc",
            "namespace": "ns",
            "generation": 4,
            "labels": {names.CACHE_LABEL: "wc"},
            "annotations": {names.GENERATION_ANNOTATION: "7", names.RENDER_HASH_ANNOTATION: "r"},
        },
        "status": {
            "desiredNumberScheduled": 3,
            "updatedNumberScheduled": 2,
            "observedGeneration": 4,
        },
    }
    assert views.daemonset_view(body) == views.DaemonSetView("ns", "wc", 3, 2, 4, 4, 7, "r")
    body["metadata"]["annotations"][names.GENERATION_ANNOTATION] = "x"
    assert views.daemonset_view(body).applied_generation is None


def test_node_view_reads_only_ready_cache_labels() -> None:
    body = {
        "metadata": {
            "name": "n",
            "labels": {
                "weightcache.dev/minilm": "Ready",
                "weightcache.dev/other": "NotReady",
                "kubernetes.io/hostname": "n",
            },
        }
    }
    assert views.node_view(body) == views.NodeView("n", frozenset({"minilm"}))


def test_cache_view_copies_spec_and_status() -> None:
    body = {
        "metadata": {"name": "wc", "namespace": "ns", "uid": "u", "generation": 2},
        "spec": {"model": {"path": "/m"}},
        "status": {"phase": "Ready"},
    }
    view = views.cache_view(body)
    body["spec"]["model"]["path"] = "/changed"
    assert view.spec == {"model": {"path": "/m"}} and view.status == {"phase": "Ready"}
    assert (view.generation, view.deleting) == (2, False)
