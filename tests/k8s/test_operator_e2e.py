"""Issue 6 acceptance on the real control plane: the operator, the real daemon, gated rollouts.

Waits poll for a state with a generous bound; nothing asserts on time.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

from tests.k8s.conftest import OPERATOR_SA
from tests.k8s.operator_flow import (
    CPU_REPORT,
    SCOPED_MODEL_DIR,
    SCOPED_NAMESPACE,
    SOCKET_ROOT,
    Api,
    OperatorProcess,
    Scene,
    apply,
    eventually,
    gate_of,
    install_crd,
    is_ready,
    minilm_dir,
    minilm_tensor_bytes,
    reports_of,
    settled,
    template_spec_hash,
    weightcache,
)
from tools.testenv.cluster import Cluster
from weightcache_operator import names, rbac

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

    # The DaemonSet is rendered into the daemon namespace, names the cache's uid (owner
    # references cannot cross namespaces), and carries the spec hash.
    ds = eventually("the DaemonSet exists", lambda: api.daemonset(ns, name))
    assert ds.metadata.namespace == operator.daemon_namespace != ns
    assert not ds.metadata.owner_references
    cache_uid = api.cache(ns, name)["metadata"]["uid"]
    assert ds.metadata.annotations[names.CACHE_UID_ANNOTATION] == cache_uid
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
    assert header == ["NAME", "READY", "PHASE", "RESIDENT", "TRANSPORT", "ROLLOUT", "AGE"]
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
    api.wait_events(ns, name, "NodeReady")
    # Counted once the gate's write returned, which can be after the test saw the gate.
    eventually("the open gate is counted", lambda: (
        'weightcache_operator_gate_decisions_total{reason="WeightsResident",status="True"}'
        in operator.metrics()))

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
            lambda: getattr(reports_of(api.core.read_namespaced_pod(
                daemon.pod, daemon.pod_namespace)).get("cpu"),
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
    api.wait_events(ns, name, "NodeReady", count=1)

    # A converged state survives another restart untouched: no write, no event.
    before = api.core.read_namespaced_pod(v2.metadata.name, ns)
    events = len(api.core.list_namespaced_event(ns).items)
    operator.stop()
    operator.start()
    eventually("the restarted operator re-judged the engine pod",
               lambda: operator.reconciles("engine_pod") >= 1)
    after = api.core.read_namespaced_pod(v2.metadata.name, ns)
    assert after.metadata.resource_version == before.metadata.resource_version
    assert settled(api.status(ns, name)) == settled(status)
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
    # The finalizer deleted it: no owner reference reaches the daemon namespace.
    eventually("the DaemonSet is deleted", lambda: api.daemonset(ns, name) is None)
    eventually("the node label is removed", lambda: scene.label() is None)
    (engine,) = api.engine_pods(ns, name, "v1")
    assert gate_of(engine) == ("False", "NoWeightCache")
    assert not is_ready(engine)


def test_a_recreated_cache_finds_no_stale_daemonset(
    scene: Scene, api: Api, operator: OperatorProcess
) -> None:
    """The operator was away when the cache went (its finalizer removed by hand): the
    DaemonSet stayed. A new cache of that name deletes it and starts from its own."""
    ns, name = scene.namespace, scene.name
    scene.apply_cache()
    stale = eventually("the DaemonSet exists", lambda: api.daemonset(ns, name))
    operator.stop()
    try:
        scene.cluster.kubectl("patch", "wc", name, "-n", ns, "--type=merge",
                              "-p", '{"metadata":{"finalizers":null}}')
        scene.cluster.kubectl("delete", "wc", name, "-n", ns, "--timeout=60s")
        assert api.daemonset(ns, name).metadata.uid == stale.metadata.uid
        scene.apply_cache()
    finally:
        operator.start()
    uid = api.cache(ns, name)["metadata"]["uid"]

    def fresh() -> Any:
        ds = api.daemonset(ns, name)
        return ds if ds is not None and ds.metadata.uid != stale.metadata.uid else None

    ds = eventually("a DaemonSet of the new cache", fresh)
    assert ds.metadata.annotations[names.CACHE_UID_ANNOTATION] == uid
    scene.start_daemon()
    scene.status_where("the new cache is verified", lambda s: s.get("readyNodes") == 1)


def test_a_daemonset_of_the_older_layout_is_migrated_to_the_daemon_namespace(
    scene: Scene, api: Api, operator: OperatorProcess
) -> None:
    """Operator upgrade: a cache's DaemonSet still in the cache's own namespace, owned by it.

    Without the migration Role the operator says so in an event and leaves it serving;
    with it, the operator deletes it once and the cache's DaemonSet comes up in the daemon
    namespace (whose daemons re-adopt the weights from the running engines: docs/operator.md).
    """
    ns, name = scene.namespace, scene.name
    scene.apply_cache()
    current = eventually("the DaemonSet exists", lambda: api.daemonset(ns, name))
    manifest = api.apps.api_client.sanitize_for_serialization(current)
    cache = api.cache(ns, name)
    # What the operator before the move rendered: in the cache's namespace, owned by it.
    # The new one is deleted by hand meanwhile, standing for "not there yet".
    old_labels = {k: v for k, v in manifest["metadata"]["labels"].items()
                  if k != names.CACHE_NAMESPACE_LABEL}
    selector = {k: v for k, v in manifest["spec"]["selector"]["matchLabels"].items()
                if k != names.CACHE_NAMESPACE_LABEL}
    template = manifest["spec"]["template"]
    template["metadata"]["labels"] = old_labels
    template["spec"]["serviceAccountName"] = "default"
    legacy = {
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": names.legacy_daemonset_name(name), "namespace": ns,
                     "labels": old_labels,
                     "ownerReferences": [{"apiVersion": names.API_VERSION, "kind": names.KIND,
                                          "name": name, "uid": cache["metadata"]["uid"],
                                          "controller": True}]},
        "spec": {"selector": {"matchLabels": selector}, "template": template},
    }
    operator.stop()
    scene.cluster.kubectl("delete", "daemonset", "-n", current.metadata.namespace,
                          current.metadata.name, "--wait=true")
    scene.cluster.kubectl("apply", "-f", "-", input=json.dumps(legacy))
    eventually("the older DaemonSet's pod runs", lambda: [
        p for p in api.core.list_namespaced_pod(ns, label_selector=f"{names.CACHE_LABEL}={name}"
                                                ).items if p.status.phase == "Running"])
    operator.start()
    try:
        assert eventually("the operator says it may not delete it",
                          lambda: api.events(ns, name, "DaemonSetNotDeleted"))
        assert api.daemonset(ns, name) is None  # nothing new while the old daemons run
        apply(scene.cluster,
              rbac.role("wc-migration", ns, rbac.OPERATOR_MIGRATION_RULES),
              rbac.binding("RoleBinding", "wc-migration", "Role", "wc-migration",
                           OPERATOR_SA, operator.daemon_namespace, ns))
        ds = eventually("the DaemonSet in the daemon namespace", lambda: api.daemonset(ns, name),
                        bound=150)
        assert ds.metadata.namespace == operator.daemon_namespace
        assert api.apps.list_namespaced_daemon_set(
            ns, label_selector=f"{names.CACHE_LABEL}={name}").items == []
        scene.start_daemon()
        scene.status_where("verified from the new daemon", lambda s: s.get("readyNodes") == 1)
    finally:
        scene.cluster.kubectl("delete", "rolebinding,role", "wc-migration", "-n", ns,
                              "--ignore-not-found", check=False)


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
    api.core.patch_namespaced_pod(pod.metadata.name, pod.metadata.namespace, {"metadata": {
        "annotations": {CPU_REPORT: raw(pod.spec.node_name)}}})
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


def test_a_namespace_loads_only_its_own_model_sources(
    cluster: Cluster, api: Api, operator: OperatorProcess
) -> None:
    """Issue 34 item 2, without the chart's admission policy: a namespace the cache policy
    lists may load only its own model sources, even from a directory every unlisted
    namespace may use; the operator renders nothing for it, naming why."""
    ns, name = SCOPED_NAMESPACE, "thief"
    cluster.kubectl("create", "namespace", ns)
    try:
        cache = weightcache(ns, name, cluster.node_names[0])  # MiniLM: the default's
        apply(cluster, cache)

        def refused() -> dict | None:
            status = api.status(ns, name)
            return status if status.get("phase") == "Error" else None

        status = eventually("the cache reports the refusal", refused)
        assert condition(status, "Degraded") == ("True", "PolicyViolation")
        message = next(c["message"] for c in status["conditions"] if c["type"] == "Degraded")
        assert message.startswith(f"spec.model.path: {minilm_dir()} is not under a model "
                                  f"directory of namespace {ns}'s model sources"), message
        assert SCOPED_MODEL_DIR in message
        assert api.daemonset(ns, name) is None
        cache["spec"]["model"]["path"] = f"{SCOPED_MODEL_DIR}/minilm"
        apply(cluster, cache)
        eventually("its own model directory is rendered", lambda: api.daemonset(ns, name))
        operator.check_running()
    finally:
        cluster.kubectl("delete", "wc", "-n", ns, name, "--ignore-not-found", "--timeout=60s",
                        check=False)
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
