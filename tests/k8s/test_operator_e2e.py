"""Issue 6 acceptance on the real control plane: the operator, the real daemon, gated rollouts.

Waits poll for a state with a generous bound; nothing asserts on time.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

from tests.k8s.operator_flow import (
    CPU_REPORT,
    SOCKET_ROOT,
    Api,
    OperatorProcess,
    Scene,
    eventually,
    gate_of,
    install_crd,
    is_ready,
    minilm_tensor_bytes,
    reports_of,
    template_spec_hash,
    weightcache,
)
from tools.testenv.cluster import Cluster

pytestmark = pytest.mark.k8s


def node_entry(status: dict) -> dict:
    (node,) = status.get("nodes") or [{}]
    return node


def condition(status: dict, kind: str) -> tuple[str, str]:
    c = next(c for c in status["conditions"] if c["type"] == kind)
    return c["status"], c["reason"]


def test_rollout_waits_for_verified_weights(scene: Scene, api: Api,
                                            operator: OperatorProcess) -> None:
    ns, name = scene.namespace, scene.name
    scene.apply_cache()

    # The DaemonSet is rendered, owned by the cache, and carries the spec hash.
    ds = eventually("the DaemonSet exists", lambda: api.daemonset(ns, name))
    (owner,) = ds.metadata.owner_references
    assert (owner.kind, owner.name, owner.controller) == ("WeightCache", name, True)
    spec_hash = template_spec_hash(ds)
    daemon_pod = scene.daemon_pod()
    status = scene.status_where(
        "status lists the daemon pod, not yet reporting",
        lambda s: node_entry(s).get("pod") == daemon_pod.metadata.name,
    )
    assert status["fingerprint"] == spec_hash
    assert node_entry(status)["reason"] == "DaemonNotReady"
    assert (status["phase"], status["ready"]) == ("Loading", "0/1")
    header, row = scene.wc_table()
    assert header == ["NAME", "READY", "PHASE", "RESIDENT", "TRANSPORT", "AGE"]
    assert row[:5] == [name, "0/1", "Loading", "0B", "memfd"]

    # Engines serve before the cache exists; the new version adds the gate.
    scene.deploy_engine("v1", gated=False)
    scene.rolled_out()
    (old,) = api.engine_pods(ns, name, "v1")
    scene.deploy_engine("v2", gated=True)
    new = scene.engine("v2", ("False", "DaemonNotReady"))
    assert not is_ready(new)
    assert is_ready(api.core.read_namespaced_pod(old.metadata.name, ns))
    rollout = api.apps.read_namespaced_deployment(f"{name}-engine", ns).status
    assert (rollout.replicas, rollout.updated_replicas, rollout.available_replicas) == (2, 1, 1)

    # The real daemon loads MiniLM and reports into its pod: the gate opens.
    scene.start_daemon()
    expected = minilm_tensor_bytes()
    status = scene.status_where("the node is verified", lambda s: s.get("readyNodes") == 1)
    (gpu,) = node_entry(status)["gpus"]
    assert gpu["id"] == "cpu" and gpu["state"] == "Ready"
    assert gpu["preloadedWeightsBytes"] == expected == gpu["expectedBytes"]
    assert gpu["transport"] == "memfd" and len(gpu["fingerprint"]) == 64
    assert gpu["readopted"] is False and "loadSeconds" in gpu
    assert status["phase"] == "Ready" and status["residentBytes"] == expected
    assert condition(status, "Ready") == ("True", "Ready")
    assert condition(status, "WeightsResident") == ("True", "WeightsResident")
    scene.rolled_out()
    assert api.engine_pods(ns, name, "v1") == []
    (v2,) = api.engine_pods(ns, name, "v2")
    assert gate_of(v2) == ("True", "WeightsResident") and is_ready(v2)
    assert eventually("the node is labelled", scene.label) == "Ready"
    assert scene.wc_table()[1][:5] == [name, "1/1", "Ready", "86.6MiB", "memfd"]
    assert api.events(ns, name, "NodeReady")
    assert 'weightcache_operator_gate_decisions_total{reason="WeightsResident",status="True"}' in (
        operator.metrics()
    )

    # A daemon holding weights for another spec closes the gate and holds a new rollout.
    scene.daemons[-1].stop()
    scene.start_daemon(spec_hash="0" * 64)
    scene.engine("v2", ("False", "FingerprintMismatch"))
    scene.status_where("status shows the mismatch",
                       lambda s: node_entry(s).get("reason") == "FingerprintMismatch")
    eventually("the node label is removed", lambda: scene.label() is None)
    scene.deploy_engine("v3", gated=True)
    v3 = scene.engine("v3", ("False", "FingerprintMismatch"))
    assert not is_ready(v3)
    assert api.engine_pods(ns, name, "v2")  # the old pod is not taken down

    # The right weights again: the held rollout completes.
    scene.daemons[-1].stop()
    scene.start_daemon()
    scene.rolled_out()
    (v3,) = api.engine_pods(ns, name, "v3")
    assert gate_of(v3) == ("True", "WeightsResident")

    # Too few bytes against a pinned expectation (the weights themselves are unchanged).
    scene.cluster.kubectl("patch", "wc", name, "-n", ns, "--type=merge", "-p",
                          json.dumps({"spec": {"engine": {"expectedBytes": 2 * expected}}}))
    scene.engine("v3", ("False", "BytesBelowExpected"))
    status = scene.status_where("status shows the shortfall",
                                lambda s: s.get("phase") == "Degraded")
    assert condition(status, "Degraded") == ("True", "BytesBelowExpected")
    assert template_spec_hash(api.daemonset(ns, name)) == spec_hash


def test_operator_killed_mid_rollout_converges(scene: Scene, api: Api,
                                               operator: OperatorProcess) -> None:
    ns, name = scene.namespace, scene.name
    scene.apply_cache()
    scene.deploy_engine("v1", gated=False)
    scene.rolled_out()
    scene.deploy_engine("v2", gated=True)
    scene.engine("v2", ("False", "DaemonNotReady"))

    operator.kill()
    try:
        daemon = scene.start_daemon()
        eventually(
            "the daemon reports without the operator",
            lambda: getattr(reports_of(api.core.read_namespaced_pod(daemon.pod, ns)).get("cpu"),
                            "state", None) == "Ready",
        )
        # Nobody else opens the gate.
        (v2,) = api.engine_pods(ns, name, "v2")
        assert gate_of(v2) == ("False", "DaemonNotReady") and not is_ready(v2)
    finally:
        operator.start()

    scene.rolled_out()
    (v2,) = api.engine_pods(ns, name, "v2")
    assert gate_of(v2) == ("True", "WeightsResident")
    status = scene.status_where("the cache is Ready", lambda s: s.get("phase") == "Ready")
    assert eventually("the node is labelled", scene.label) == "Ready"
    assert len(api.events(ns, name, "NodeReady")) == 1

    # A converged state survives another restart untouched: no write, no event.
    before = api.core.read_namespaced_pod(v2.metadata.name, ns)
    events = len(api.core.list_namespaced_event(ns).items)
    operator.stop()
    operator.start()
    eventually("the restarted operator re-judged the engine pod",
               lambda: operator.reconciles("engine_pod") >= 1)
    after = api.core.read_namespaced_pod(v2.metadata.name, ns)
    assert after.metadata.resource_version == before.metadata.resource_version
    assert api.status(ns, name) == status
    assert len(api.core.list_namespaced_event(ns).items) == events


def test_deleting_the_cache_cleans_up(scene: Scene, api: Api) -> None:
    ns, name = scene.namespace, scene.name
    scene.apply_cache()
    scene.start_daemon()
    scene.deploy_engine("v1", gated=True)
    scene.engine("v1", ("True", "WeightsResident"))
    assert eventually("the node is labelled", scene.label) == "Ready"

    scene.cluster.kubectl("delete", "wc", name, "-n", ns, "--timeout=60s")
    assert api.cache(ns, name) is None
    eventually("the DaemonSet is garbage-collected", lambda: api.daemonset(ns, name) is None)
    eventually("the node label is removed", lambda: scene.label() is None)
    (engine,) = api.engine_pods(ns, name, "v1")
    assert gate_of(engine) == ("False", "NoWeightCache")
    assert not is_ready(engine)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model": None}, "spec.model: Required value"),
        ({"transport": "nccl"}, 'spec.transport: Unsupported value: "nccl"'),
        ({"gpus": {"perNode": -1}}, "spec.gpus.perNode"),
        ({"sidecar": {"resources": {"requests": {"memory": "1GB"}}}},
         "spec.sidecar.resources.requests.memory"),
        ({"model": {"path": "models/relative"}}, "spec.model.path"),
        ({"socketDir": "/run/../etc"}, "spec.socketDir"),
        # Root as a peer would let any root process on the node map the weights.
        ({"sidecar": {"allowedPeers": {"uids": [0]}}}, "spec.sidecar.allowedPeers.uids[0]"),
        ({"sidecar": {"allowedPeers": {"gids": [0]}}}, "spec.sidecar.allowedPeers.gids[0]"),
        # An empty selector would hold every gated pod of the namespace closed.
        ({"engine": {"selector": {}}}, "spec.engine.selector: empty"),
        ({"rollout": {"maxUnavailable": 0}}, "spec.rollout.maxUnavailable"),
        ({"rollout": {"maxUnavailable": "0%"}}, "spec.rollout.maxUnavailable"),
    ],
)
def test_invalid_caches_are_rejected_naming_the_field(
    cluster: Cluster, namespace: str, change: dict, field: str
) -> None:
    install_crd(cluster)
    doc = weightcache(namespace, "invalid", cluster.node_names[0])
    for key, value in change.items():
        if value is None:
            doc["spec"].pop(key)
        else:
            doc["spec"][key] = value
    with pytest.raises(subprocess.CalledProcessError) as err:
        cluster.kubectl("create", "-f", "-", input=json.dumps(doc))
    assert "is invalid" in err.value.stderr
    assert field in err.value.stderr


def forged_report(node: str, **changes: Any) -> str:
    """A report as the daemon writes it, with fields an attacker or a bug changed."""
    body = {"v": 1, "device": "cpu", "node": node, "specHash": "0" * 64, "state": "Ready",
            "preloadedWeightsBytes": 1, "expectedBytes": 1, **changes}
    return json.dumps(body)


@pytest.mark.parametrize(
    ("raw", "detail"),
    [
        (lambda node: "{not json", "not JSON"),
        (lambda node: forged_report(node, preloadedWeightsBytes=-1), "preloadedWeightsBytes"),
        # Past int64: once, this passed decoding and the status write then failed with 422.
        (lambda node: forged_report(node, preloadedWeightsBytes=2**64 - 1),
         "preloadedWeightsBytes"),
        (lambda node: forged_report(node, pad="x" * (100 * 1024)), "over the 4096-byte cap"),
    ],
    ids=["not-json", "negative-bytes", "past-int64", "oversized"],
)
def test_malformed_report_is_ignored_with_an_event(
    scene: Scene, api: Api, operator: OperatorProcess, raw: Callable[[str], str], detail: str
) -> None:
    ns, name = scene.namespace, scene.name
    scene.apply_cache()
    pod = scene.daemon_pod()
    api.core.patch_namespaced_pod(pod.metadata.name, ns, {"metadata": {"annotations": {
        CPU_REPORT: raw(pod.spec.node_name)}}})
    status = scene.status_where("status flags the report",
                                lambda s: node_entry(s).get("reason") == "ReportMalformed")
    assert detail in node_entry(status)["message"]
    assert condition(status, "Degraded") == ("True", "ReportMalformed")
    (event,) = eventually("a ReportMalformed event",
                          lambda: api.events(ns, name, "ReportMalformed"))
    assert event.type == "Warning" and pod.spec.node_name in event.message
    operator.check_running()

    # The real daemon's next report replaces the bad one.
    scene.start_daemon()
    scene.status_where("the node is verified", lambda s: s.get("readyNodes") == 1)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        # Inside another cache's directory, where that cache's daemon could plant a symlink.
        ({"socketDir": f"{SOCKET_ROOT}/other.cache"}, "spec.socketDir"),
        ({"socketDir": "/etc"}, "spec.socketDir"),
        ({"model": {"path": "/etc"}}, "spec.model.path"),
        ({"transport": "torch_ipc", "device": "cuda"}, "spec.transport"),
    ],
    ids=["other-cache-dir", "etc", "model-etc", "torch-ipc"],
)
def test_policy_violation_is_refused_naming_the_field_until_fixed(
    scene: Scene, api: Api, operator: OperatorProcess, change: dict, field: str
) -> None:
    """Admitted without the chart's admission policy, the operator still renders nothing."""
    ns, name = scene.namespace, scene.name
    scene.apply_cache(**change)
    status = scene.status_where("the cache reports the refusal",
                                lambda s: s.get("phase") == "Error")
    assert condition(status, "Degraded") == ("True", "PolicyViolation")
    message = next(c["message"] for c in status["conditions"] if c["type"] == "Degraded")
    assert message.startswith(field), message
    assert api.daemonset(ns, name) is None
    assert eventually("a PolicyViolation event", lambda: api.events(ns, name, "PolicyViolation"))
    operator.check_running()

    scene.apply_cache()
    eventually("the DaemonSet appears once the spec is fixed",
               lambda: api.daemonset(ns, name))
    scene.status_where("the error clears", lambda s: s.get("phase") in ("Loading", "Pending"))
