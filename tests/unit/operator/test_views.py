from __future__ import annotations

from weightcache.report import annotation_key
from weightcache_operator import names, podlimits, views
from weightcache_operator.shape import shape_digest


def test_daemon_pod_view() -> None:
    body = {
        "metadata": {
            "name": "wc-x",
            "namespace": "ns",
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {names.CACHE_LABEL: "wc"},
            "annotations": {
                annotation_key("GPU-1"): "{}",
                annotation_key("GPU-2"): "[]",
                "weightcache.dev/report": "an old-style report is not read",
                "other.example/x": "y",
                names.SPEC_HASH_ANNOTATION: "h",
            },
            "ownerReferences": [
                {"kind": "Node", "uid": "not-the-controller"},
                {"kind": "DaemonSet", "uid": "ds-uid", "controller": True},
            ],
        },
        "spec": {"nodeName": "n1", "containers": [{"name": "daemon-0"}, {"name": "daemon-1"}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    view = views.daemon_pod_view(body)
    assert view == views.DaemonPodView(
        namespace="ns", name="wc-x", cache="wc", node="n1", phase="Running", ready=True,
        terminating=False,
        reports={annotation_key("GPU-1"): "{}", annotation_key("GPU-2"): "[]"},
        spec_hash="h", created="2026-01-01T00:00:00Z", controller_uid="ds-uid",
        cache_namespace="ns",  # no label: the older layout, in the cache's own namespace
        shape=shape_digest(body["spec"]), slots=2,
    )
    body["metadata"]["labels"][names.CACHE_NAMESPACE_LABEL] = "team"
    assert views.daemon_pod_view(body).cache_namespace == "team"
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
    assert view.bindings == {} and view.phase == "Pending" and not view.finished
    body["status"] = {"phase": "Failed"}  # evicted
    assert views.engine_pod_view(body).finished
    key = names.binding_key("ns", "wc")
    body["metadata"]["annotations"] = {key: "a" * 64, "weightcache.dev/other": "x"}
    assert views.engine_pod_view(body).bindings == {key: "a" * 64}


def test_an_engine_pod_view_keeps_its_controller_bounded() -> None:
    meta = {"name": "e", "namespace": "ns", "uid": "u", "ownerReferences": [
        {"kind": "Node", "name": "n", "uid": "not-controller"},
        {"kind": "ReplicaSet", "name": "engine-5f9c", "uid": "rs-uid", "controller": True}]}
    view = views.engine_pod_view({"metadata": meta})
    assert (view.owner, view.owner_uid) == ("ReplicaSet/engine-5f9c", "rs-uid")
    meta["ownerReferences"] = [{"kind": "X", "name": "n" * 5000, "uid": "u" * 5000,
                                "controller": True}]
    view = views.engine_pod_view({"metadata": meta})
    assert len(view.owner) == podlimits.MAX_OWNER_CHARS
    assert len(view.owner_uid) == podlimits.MAX_VALUE_CHARS
    meta["ownerReferences"] = ["not an object"]
    assert views.engine_pod_view({"metadata": meta}).owner_uid == ""


def test_daemonset_view() -> None:
    body = {
        "metadata": {
            "name": "weightcache-wc",
            "namespace": "ns",
            "uid": "ds-uid",
            "ownerReferences": [{"kind": "WeightCache", "uid": "cache-uid", "controller": True}],
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
    assert views.daemonset_view(body) == views.DaemonSetView(
        "ns", "weightcache-wc", "ds-uid", "cache-uid", "wc", 3, 2, 4, 4, 7, "r",
        template_shape=shape_digest({}),
    )
    assert views.daemonset_view(body).legacy  # the older layout: owned, in the cache's namespace
    body["metadata"]["annotations"][names.GENERATION_ANNOTATION] = "x"
    assert views.daemonset_view(body).applied_generation is None
    body["metadata"]["labels"][names.CACHE_NAMESPACE_LABEL] = "team"
    body["metadata"]["annotations"][names.CACHE_UID_ANNOTATION] = "cache-uid"
    body["metadata"]["annotations"][names.POD_SHAPES_ANNOTATION] = "s2,s1"
    body["spec"] = {"template": {"spec": {"hostPID": True}}}
    view = views.daemonset_view(body)
    assert (view.cache_namespace, view.cache_uid, view.legacy) == ("team", "cache-uid", False)
    assert view.shapes == ("s2", "s1")
    assert view.template_shape == shape_digest({"hostPID": True}) != shape_digest({})


def test_node_view_reads_only_ready_cache_labels() -> None:
    body = {
        "metadata": {
            "name": "n",
            "labels": {
                "weightcache.dev/team.minilm": "Ready",
                "weightcache.dev/team.other": "NotReady",
                "kubernetes.io/hostname": "n",
            },
        }
    }
    assert views.node_view(body) == views.NodeView("n", frozenset({"team.minilm"}))


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


def test_daemon_pod_view_sees_a_readiness_flap_and_restarts() -> None:
    body = {
        "metadata": {"name": "wc-x", "namespace": "ns", "uid": "u1"},
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "False",
                            "lastTransitionTime": "2026-01-01T00:00:10Z"}],
            "containerStatuses": [
                {"name": "daemon-0", "restartCount": 0, "state": {"running": {}}},
                {"name": "daemon-1", "restartCount": 2, "state": {"running": {}}},
            ],
        },
    }
    view = views.daemon_pod_view(body)
    assert (view.uid, view.ready, view.restarts, view.containers_running) == ("u1", False, 2, True)
    assert view.not_ready_since == 1767225610.0
    body["status"]["containerStatuses"][1]["state"] = {"waiting": {"reason": "CrashLoopBackOff"}}
    assert views.daemon_pod_view(body).containers_running is False
    body["status"]["conditions"][0]["status"] = "True"
    assert views.daemon_pod_view(body).not_ready_since is None


def test_a_pod_keeps_bounded_reports_and_only_under_a_daemonset() -> None:
    """Issue 25 items 6 and 13: the operator once held whole report annotations of any pod
    with the daemon labels (120 unscheduled pods of 250 KB: +33 MiB), and a daemon could
    write 70 of them."""
    def body(reports: dict[str, str], containers: int = 2, controller: str = "DaemonSet"):
        return {"metadata": {"name": "p", "namespace": "ns", "annotations": reports,
                             "ownerReferences": [{"kind": controller, "uid": "u",
                                                  "controller": True}]},
                "spec": {"containers": [{"name": f"daemon-{i}"} for i in range(containers)]}}

    small = {annotation_key("GPU-1"): "{}"}
    assert views.daemon_pod_view(body(small)).reports == small
    huge = {annotation_key("GPU-1"): "x" * 250_000}
    view = views.daemon_pod_view(body(huge))
    assert view.reports == {} and view.report_error == (
        f"{annotation_key('GPU-1')}: 250000 bytes, over the 4096-byte cap")
    many = {annotation_key(f"GPU-{i}"): "{}" for i in range(3)}
    view = views.daemon_pod_view(body(many))
    assert view.reports == {} and view.report_error == (
        "3 report annotations for at most 2 (one per daemon container)")
    # No DaemonSet, nothing kept: such a pod can never count.
    for controller in ("ReplicaSet", None):
        view = views.daemon_pod_view(body(huge, controller=controller or "x"))
        assert view.reports == {} and view.report_error is None
