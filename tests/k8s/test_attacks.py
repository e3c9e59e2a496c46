"""The security review's Kubernetes attacks (issue 14), tried on the real control plane.

Each test plays someone who may create WeightCaches or pods in one namespace
and checks that it buys them nothing: a look-alike daemon pod opens no gate,
a same-named cache in another namespace labels no node, a refused status
write leaves no gate open, and the biggest status the reports can produce
still fits. The policy attacks (host paths, images, transports, the
ServiceAccount) are in test_chart.py (admission) and test_operator_e2e.py
(the operator's own refusal); the daemon's token in test_operator_reporter.py.
Waits poll for a state with a generous bound; nothing asserts on time.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tests.k8s.conftest import OPERATOR_SA
from tests.k8s.operator_flow import (
    SOCKET_ROOT,
    Api,
    OperatorProcess,
    Scene,
    eventually,
    gate_of,
    install_crd,
    minilm_tensor_bytes,
    operator_rules,
    template_spec_hash,
)
from tests.unit.operator.builders import annotations, device_report
from tools.testenv.cluster import Cluster
from weightcache.report import MAX_DEVICE_BYTES, MAX_DEVICES, MAX_MESSAGE_CHARS, annotation_key
from weightcache_operator import aggregate, names, rbac, render
from weightcache_operator.policy import HostPaths, Policy
from weightcache_operator.spec import parse_spec, spec_hash
from weightcache_operator.views import DaemonPodView, DaemonSetView

pytestmark = pytest.mark.k8s

REPO_ROOT = Path(__file__).resolve().parents[2]


def settled(operator: OperatorProcess, kind: str, after: float) -> bool:
    """The operator has made a reconcile pass of `kind` since the count `after`."""
    return operator.reconciles(kind) > after


def test_a_look_alike_daemon_pod_opens_no_gate(
    scene: Scene, api: Api, operator: OperatorProcess
) -> None:
    """Labels and a perfect report on a pod the cache's DaemonSet did not make count for nothing.

    Once, such a pod (with a foreign controller reference) opened an engine's
    gate and labelled the node.
    """
    ns, name, node = scene.namespace, scene.name, scene.node
    scene.apply_cache()
    ds = eventually("the DaemonSet exists", lambda: api.daemonset(ns, name))
    digest = template_spec_hash(ds)
    scene.deploy_engine("v1", gated=True)
    scene.engine("v1", ("False", "DaemonNotReady"))

    bait = api.core.create_namespaced_config_map(ns, {"metadata": {"name": "bait"}})
    expected = minilm_tensor_bytes()
    forged = annotations(device_report(
        "cpu", digest, node, preloaded=expected, expected=expected, transport="memfd"))
    api.core.create_namespaced_pod(ns, {
        "metadata": {
            "name": "look-alike",
            "labels": render.selector_labels(ns, name),
            "annotations": forged,
            "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "bait",
                                 "uid": bait.metadata.uid, "controller": True}],
        },
        "spec": {"nodeName": node, "containers": [{"name": "daemon", "image": "evil:1"}]},
    })
    eventually("the look-alike pod runs and is Ready", lambda: any(
        c.type == "Ready" and c.status == "True"
        for c in api.core.read_namespaced_pod("look-alike", ns).status.conditions or []))
    before = operator.reconciles("cache")
    api.core.patch_namespaced_pod("look-alike", ns, {"metadata": {"annotations": {"x": "poke"}}})
    eventually("the operator judged the cache again", lambda: settled(operator, "cache", before))
    eventually("every engine pod was judged", lambda: settled(operator, "engine_pod", 0))

    (engine,) = api.engine_pods(ns, name, "v1")
    assert gate_of(engine) == ("False", "DaemonNotReady")
    assert scene.label() is None
    status = api.status(ns, name)
    assert status["readyNodes"] == 0
    assert [n.get("pod") for n in status.get("nodes", [])] != ["look-alike"]

    # The same report from the DaemonSet's own pod opens the gate: the test can fail.
    scene.start_daemon()
    scene.engine("v1", ("True", "WeightsResident"))
    assert eventually("the node is labelled", scene.label) == "Ready"


def test_a_look_alike_the_daemonset_controller_adopts_counts_for_nothing(
    scene: Scene, api: Api, operator: OperatorProcess
) -> None:
    """Issue 25 item 2: right after the daemon pod was deleted, an orphan pod with its labels
    (revision label included) and no owner reference was adopted by the DaemonSet
    controller, which then owns it as controller and keeps it as current; it ran its
    creator's image with a report set at creation, opened the gate 5 s later and kept it
    open 70 s.

    Without the chart's admission policy (which refuses creating it at all: test_chart.py),
    the operator counts a pod only with a shape it rendered."""
    ns, name, node, system = scene.namespace, scene.name, scene.node, scene.daemon_namespace
    cluster = scene.cluster
    scene.apply_cache()
    scene.deploy_engine("v1", gated=True)
    real = scene.daemon_pod()
    ds = eventually("the DaemonSet exists", lambda: api.daemonset(ns, name))
    # A NoSchedule taint keeps the DaemonSet from replacing its pod (it keeps pods already
    # there), so the look-alike wins the node without a race.
    taint = f"weightcache.dev/test-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("taint", "node", node, f"{taint}=x:NoSchedule")
    look_alike = f"{name}-look-alike"
    try:
        api.core.delete_namespaced_pod(real.metadata.name, system, grace_period_seconds=0)
        eventually("the daemon pod is gone", lambda: not [
            p for p in api.daemon_pods(ns, name) if p.metadata.name == real.metadata.name])
        expected = minilm_tensor_bytes()
        forged = annotations(device_report("cpu", template_spec_hash(ds), node,
                                           preloaded=expected, expected=expected,
                                           transport="memfd"))
        api.core.create_namespaced_pod(system, {
            "metadata": {"name": look_alike, "labels": real.metadata.labels,
                         "annotations": forged},
            "spec": {"nodeName": node, "containers": [{"name": "daemon", "image": "evil:1"}]},
        })

        def adopted() -> bool:
            found = api.core.list_namespaced_pod(
                system, field_selector=f"metadata.name={look_alike}").items
            return bool(found) and any(c.type == "Ready" and c.status == "True"
                                       for c in found[0].status.conditions or []) and any(
                ref.kind == "DaemonSet" and ref.controller
                for ref in found[0].metadata.owner_references or [])

        eventually("the DaemonSet controller adopts the look-alike", adopted)
        assert [p.metadata.name for p in api.daemon_pods(ns, name)] == [look_alike]
        samples = []
        for _ in range(24):  # 12 s; the gate opened after 5
            (engine,) = api.engine_pods(ns, name, "v1")
            samples.append((adopted(), gate_of(engine), scene.label(),
                            api.status(ns, name).get("readyNodes", 0)))
            time.sleep(0.5)
        assert all(s == (True, ("False", "NoDaemonOnNode"), None, 0) for s in samples[4:]), \
            samples
    finally:
        api.core.delete_collection_namespaced_pod(
            system, field_selector=f"metadata.name={look_alike}", grace_period_seconds=0)
        cluster.kubectl("taint", "node", node, f"{taint}-")
    # The DaemonSet's own pod with the real daemon's report opens it: the test can fail.
    scene.start_daemon()
    scene.engine("v1", ("True", "WeightsResident"))


def test_a_hand_edited_daemonset_is_restored(
    scene: Scene, api: Api, operator: OperatorProcess
) -> None:
    """Issue 25 item 7: hostPID, root and privileged set by hand on the DaemonSet stayed after
    two resyncs: the operator compared only its own annotations."""
    scene.apply_cache()
    ds = eventually("the DaemonSet exists", lambda: api.daemonset(scene.namespace, scene.name))
    system, ds_name = ds.metadata.namespace, ds.metadata.name
    rendered_user = ds.spec.template.spec.security_context.run_as_user
    api.apps.patch_namespaced_daemon_set(ds_name, system, [
        {"op": "add", "path": "/spec/template/spec/hostPID", "value": True},
        {"op": "replace", "path": "/spec/template/spec/securityContext/runAsUser", "value": 0},
        {"op": "replace", "path": "/spec/template/spec/securityContext/runAsNonRoot",
         "value": False},
        {"op": "replace", "path": "/spec/template/spec/containers/0/securityContext/privileged",
         "value": True},
        {"op": "replace",
         "path": "/spec/template/spec/containers/0/securityContext/allowPrivilegeEscalation",
         "value": True},
    ], _content_type="application/json-patch+json")

    def restored() -> bool:
        pod = api.apps.read_namespaced_daemon_set(ds_name, system).spec.template.spec
        return (not pod.host_pid and pod.security_context.run_as_user == rendered_user
                and pod.security_context.run_as_non_root is True
                and pod.containers[0].security_context.privileged is False
                and pod.containers[0].security_context.allow_privilege_escalation is False)

    # Within one resync of the operator's (30 s): the edit itself triggers the restore.
    eventually("the rendered pod template is back", restored, bound=45)
    api.wait_events(scene.namespace, scene.name, "DaemonSetRestored")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def settled_rss(pid: int) -> float:
    """The process's RSS once it stopped moving (three readings 2 s apart within 1 MiB)."""
    readings: list[float] = []

    def steady() -> float | None:
        readings.append(rss_mib(pid))
        time.sleep(2)
        last = readings[-3:]
        return last[-1] if len(last) == 3 and max(last) - min(last) < 1 else None

    return eventually("the operator's memory to settle", steady, bound=180)


def test_look_alike_pods_with_huge_reports_cost_the_operator_nothing(
    cluster: Cluster, api: Api, operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    """Issue 25 item 6: 120 never-scheduled pods with the daemon labels and a 250 KB report
    each, in a namespace with no cache, once added 33 MiB to the operator: it kept every
    report whole. It keeps reports only of pods a DaemonSet controls, bounded first.

    A second operator process (same rights; nothing here for it to write) is measured, with
    glibc's mmap threshold fixed at 128 KiB: each report then lives in memory of its own and
    goes back to the system when freed, so the RSS shows what is kept, not what the
    allocator holds on to."""
    pods, size = 120, 250_000
    measured = OperatorProcess(operator.kubeconfig, tmp_path / "measured.log",
                               policy=operator.policy,
                               env={"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)})
    measured.start()
    assert measured.proc is not None
    before = settled_rss(measured.proc.pid)
    report = {annotation_key("cpu"): "x" * size}
    for i in range(pods):
        api.core.create_namespaced_pod(namespace, {
            "metadata": {"name": f"hoard-{i}", "labels": render.selector_labels(namespace, "c"),
                         "annotations": report},
            # Never scheduled: no node has this label.
            "spec": {"nodeSelector": {"weightcache.dev/nowhere": "true"},
                     "containers": [{"name": "daemon", "image": "evil:1"}]},
        })
    eventually("every pod exists", lambda: len(api.core.list_namespaced_pod(
        namespace, label_selector=f"{names.CACHE_LABEL}=c").items) == pods)
    try:
        grown = settled_rss(measured.proc.pid) - before
        measured.check_running()
    finally:
        measured.stop()
    print(f"\noperator RSS: {before:.1f} MiB, +{grown:.1f} MiB after {pods} pods of "
          f"{size // 1000} KB reports")
    # kopf's own state for 120 more pods takes ~11 MiB here; keeping the reports would take
    # pods x size = 29 MiB more (measured: +11 MiB without them, +37 MiB with them).
    assert grown < 20, f"the operator grew by {grown:.1f} MiB"


def test_same_named_caches_in_two_namespaces_never_share_a_label(
    cluster: Cluster, api: Api, operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    """Once, a same-named cache elsewhere set the label on a node where the victim held nothing."""
    other_ns = f"t-{uuid.uuid4().hex[:10]}"
    cluster.kubectl("create", "namespace", other_ns)
    name = "shared-name"
    victim = Scene(cluster, api, namespace, operator, tmp_path / "victim", name=name)
    attacker = Scene(cluster, api, other_ns, operator, tmp_path / "attacker", name=name)
    for scene in (victim, attacker):
        scene.logs.mkdir()
    try:
        victim.apply_cache()
        attacker.apply_cache()
        attacker.daemon_pod()
        attacker.start_daemon()
        assert eventually("the attacker's cache is verified", attacker.label) == "Ready"
        key = names.node_label_key(other_ns, name)
        assert attacker.status_where("status names the label",
                                     lambda s: s.get("nodeLabel") == key)
        # The victim's daemon never reported: its label must not be there.
        victim.status_where("the victim's cache is judged",
                            lambda s: s.get("nodeLabel") == names.node_label_key(namespace, name))
        labels = api.node_labels(victim.node)
        assert labels.get(key) == "Ready"
        assert names.node_label_key(namespace, name) not in labels
        assert f"{names.NODE_LABEL_PREFIX}{name}" not in labels
    finally:
        attacker.close()
        victim.close()
        cluster.kubectl("delete", "namespace", other_ns, "--wait=false")


def test_gates_follow_the_daemons_when_status_writes_are_refused(
    cluster: Cluster, scene: Scene, api: Api, operator: OperatorProcess, operator_home: str
) -> None:
    """A status the apiserver refuses must not freeze the gates.

    Once, a report the status schema refused (422) made every reconcile raise
    before gates were re-evaluated: a gate stayed True after the only good
    daemon pod was deleted.
    """
    ns, name = scene.namespace, scene.name
    scene.apply_cache()
    scene.start_daemon()
    scene.deploy_engine("v1", gated=True)
    scene.engine("v1", ("True", "WeightsResident"))
    assert eventually("the node is labelled", scene.label) == "Ready"
    ready_status = scene.status_where("status says Ready", lambda s: s.get("phase") == "Ready")

    status_rule = f"{names.PLURAL}/status"
    operator_rules(cluster, operator_home, OPERATOR_SA,
                   [r for r in rbac.OPERATOR_RULES if status_rule not in r["resources"]])
    try:
        for daemon in scene.daemons:
            daemon.stop()
        pod = scene.daemon_pod()
        api.core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace,
                                       grace_period_seconds=0)
        # The DaemonSet replaces the pod at once; the new one has no report yet.
        closed = eventually("the gate closes", lambda: next(
            (p for p in api.engine_pods(ns, name, "v1") if (gate_of(p) or ("",))[0] == "False"),
            None))
        assert gate_of(closed) in (("False", "NoDaemonOnNode"), ("False", "DaemonNotReady"))
        eventually("the node label is removed", lambda: scene.label() is None)
        eventually("the operator tried and failed to write the status",
                   lambda: "writing status: 403" in operator.log_tail(400))
        # The stored status could not follow: it still says what it said.
        assert api.status(ns, name)["phase"] == ready_status["phase"] == "Ready"
    finally:
        operator_rules(cluster, operator_home, OPERATOR_SA, rbac.OPERATOR_RULES)
    scene.status_where("the status catches up once writes are allowed",
                       lambda s: s.get("phase") != "Ready")


def maximal_pod(node: int, digest: str) -> DaemonPodView:
    """A daemon pod on a node with the longest name, every report field at its bound."""
    node_name = f"{'n' * 240}-{node:03d}"
    reports = annotations(*(
        device_report(f"GPU-{gpu:02d}-" + "u" * 48, digest, node_name, state="Error",
                      preloaded=MAX_DEVICE_BYTES, expected=MAX_DEVICE_BYTES,
                      message="m" * MAX_MESSAGE_CHARS, transport="t" * 64, load_seconds=1e9)
        for gpu in range(MAX_DEVICES)
    ))
    return DaemonPodView(
        namespace="ns", name="p" * 250 + f"{node:03d}", cache="wc", node=node_name,
        phase="Running", ready=True, terminating=False, reports=reports, spec_hash=digest,
        created="2026-01-01T00:00:00Z", controller_uid="ds",
    )


def test_the_largest_status_reports_can_produce_is_accepted(
    cluster: Cluster, api: Api, namespace: str
) -> None:
    """200 nodes of 64 GPUs, every report field maximal: the apiserver takes the status."""
    raw_spec = {"model": {"pvc": {"claimName": "m"}}, "gpus": {"perNode": MAX_DEVICES},
                "transport": "vmm_fd", "engine": {"selector": {"matchLabels": {"app": "e"}}}}
    spec = parse_spec(raw_spec)
    digest = spec_hash(spec)
    ds = DaemonSetView(namespace, "weightcache-big", "ds", "uid", "big", 200, 200, 1, 1, 1, "h")
    result = aggregate.build_status(
        spec=spec, spec_hash=digest, generation=1, old_status={}, daemonset=ds,
        pods=[maximal_pod(i, digest) for i in range(200)],
        node_label=names.node_label_key(namespace, "big"), now="2026-01-01T00:00:00Z",
    )
    install_crd(cluster)
    # No operator watches this namespace's caches in a way that matters here: the write is ours.
    api.custom.create_namespaced_custom_object(
        names.GROUP, names.VERSION, namespace, names.PLURAL,
        {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": "big"},
         "spec": raw_spec})
    stored = api.custom.patch_namespaced_custom_object_status(
        names.GROUP, names.VERSION, namespace, names.PLURAL, "big",
        [{"op": "add", "path": "/status", "value": result.status}],
        _content_type="application/json-patch+json")
    assert len(stored["status"]["nodes"]) == len(result.status["nodes"]) > 0
    assert stored["status"]["nodesOmitted"] == 200 - len(result.status["nodes"])
    # Well inside etcd's 1.5 MiB object limit, with room for the spec.
    assert len(json.dumps(stored)) < 1024 * 1024
    # Not for other modules' operators to trip over (its claim is no allowed one).
    cluster.kubectl("patch", "wc", "big", "-n", namespace, "--type=merge",
                    "-p", '{"metadata":{"finalizers":null}}')
    cluster.kubectl("delete", "wc", "big", "-n", namespace, "--wait=false")


def test_pod_security_restricted_admits_the_operator_but_no_daemon(
    cluster: Cluster, api: Api
) -> None:
    """The namespace layout docs/security.md prescribes, checked by the apiserver's own PSA.

    The operator pod meets `restricted`; daemon pods mount hostPath and are
    refused there, so they need a namespace of their own at `privileged`.
    """
    restricted, privileged = (f"psa-{kind}-{uuid.uuid4().hex[:6]}"
                              for kind in ("restricted", "privileged"))
    for ns, level in ((restricted, "restricted"), (privileged, "privileged")):
        cluster.kubectl("create", "namespace", ns)
        cluster.kubectl("label", "namespace", ns, f"pod-security.kubernetes.io/enforce={level}")
        cluster.kubectl("create", "serviceaccount", "-n", ns, "weightcache-daemon")
    try:
        chart = REPO_ROOT / "charts" / "weightcache-operator"
        rendered = cluster.helm("template", "psa", str(chart), "-n", restricted,
                                "--show-only", "templates/deployment.yaml").stdout
        deployment = yaml.safe_load(rendered)
        pod_spec = deployment["spec"]["template"]["spec"]
        pod_spec["serviceAccountName"] = "default"
        pod_spec["nodeSelector"] = {"kubernetes.io/hostname": cluster.node_names[0]}
        api.apps.create_namespaced_deployment(restricted, deployment)
        eventually("the operator pod is admitted under restricted", lambda: [
            p for p in api.core.list_namespaced_pod(restricted).items
            if p.metadata.labels.get("app.kubernetes.io/component") == "operator"])

        cache = parse_spec({"model": {"path": "/models/m"}, "device": "cpu",
                            "sidecar": {"image": "s:1"}})
        for ns in (restricted, privileged):
            # Rendered as if each were the daemon namespace.
            policy = Policy(setup_image="op:1", daemon_namespace=ns,
                            allowed_host_paths=HostPaths((SOCKET_ROOT,), ("/models",)))
            ds = render.render_daemonset(render.CacheRef("team", "psa", "uid", 1), cache,
                                         spec_hash(cache), policy, operator_uid=65532)
            pod_spec = ds["spec"]["template"]["spec"]
            pod_spec["nodeSelector"] = {"kubernetes.io/hostname": cluster.node_names[0]}
            api.apps.create_namespaced_daemon_set(ns, ds)
        eventually("the daemon pod is admitted under privileged",
                   lambda: api.core.list_namespaced_pod(privileged).items)
        refusal = eventually("the daemon pod is refused under restricted", lambda: [
            e for e in api.core.list_namespaced_event(restricted).items
            if e.reason == "FailedCreate" and "violates PodSecurity" in (e.message or "")])
        assert "hostPath" in refusal[0].message
        assert api.core.list_namespaced_pod(
            restricted, label_selector=f"{names.CACHE_LABEL}=psa").items == []
    finally:
        cluster.kubectl("delete", "namespace", restricted, privileged, "--wait=false")

