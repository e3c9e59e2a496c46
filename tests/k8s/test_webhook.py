"""The mutating webhook on the real control plane, served apart from the operator.

The webhook (`python -m weightcache_operator webhook`, under an account
holding only WEBHOOK_RULES) serves with a certificate of a CA made here; the
MutatingWebhookConfiguration is the chart's own (objectSelectors,
matchConditions, failurePolicy Fail), pointed at the webhook's loopback port by
URL, since the API server here reaches this machine's loopback directly
(tests/k8s/test_real_csi.py runs the chart's Deployment and Service on the real
node). The operator runs beside it as its own process. The daemon is the real
one, reporting into its kwok pod; kwok runs no containers, so the CSI volume
the webhook adds is checked as written.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from tests.k8s.conftest import OPERATOR_SA
from tests.k8s.operator_flow import (
    REPO_ROOT,
    Api,
    OperatorProcess,
    Scene,
    WebhookProcess,
    apply,
    default_service_account,
    eventually,
    gate_of,
    install_operator_account,
    install_webhook_account,
    is_ready,
    minilm_dir,
    operator_policy,
    oversized_labels,
)
from tools.testenv import pki
from tools.testenv.cluster import Cluster
from weightcache.report import SPEC_HASH_ENV
from weightcache_operator import inject, names, podlimits

pytestmark = pytest.mark.k8s

CHART = REPO_ROOT / "charts" / "weightcache-operator"
WEBHOOK_SA = "weightcache-webhook"


@pytest.fixture(scope="module")
def webhook_tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[pki.KeyPair, pki.KeyPair]:
    out = tmp_path_factory.mktemp("webhook-tls")
    ca = pki.issue(pki.CertSpec("webhook-test-ca", is_ca=True), out, "ca")
    serving = pki.issue(pki.CertSpec("127.0.0.1", server=True, ip_addresses=("127.0.0.1",)),
                        out, "serving", ca=ca)
    return ca, serving


@pytest.fixture(scope="module")
def webhook(cluster: Cluster, operator_home: str, tmp_path_factory: pytest.TempPathFactory,
            webhook_tls: tuple[pki.KeyPair, pki.KeyPair]) -> Iterator[WebhookProcess]:
    """The module's webhook, under its own account, and the chart's webhook configuration."""
    ca, serving = webhook_tls
    kubeconfig = install_webhook_account(cluster, operator_home, WEBHOOK_SA)
    hook = WebhookProcess(kubeconfig, tmp_path_factory.mktemp("webhook") / "webhook.log",
                          serving.cert, serving.key)
    config = chart_webhook(cluster, operator_home, hook.url, ca.cert.read_bytes())
    hook.start()
    apply(cluster, config)
    yield hook
    cluster.kubectl("delete", "mutatingwebhookconfiguration", config["metadata"]["name"],
                    "--ignore-not-found")
    hook.stop()


@pytest.fixture(scope="module")
def operator(cluster: Cluster, operator_home: str, tmp_path_factory: pytest.TempPathFactory,
             webhook: WebhookProcess) -> Iterator[OperatorProcess]:
    """The module's operator, a process of its own beside the webhook."""
    kubeconfig = install_operator_account(cluster, operator_home, OPERATOR_SA)
    op = OperatorProcess(kubeconfig, tmp_path_factory.mktemp("operator") / "operator.log",
                         operator_policy(operator_home))
    op.start()
    yield op
    op.stop()


def chart_webhook(cluster: Cluster, namespace: str, url: str, ca: bytes) -> dict[str, Any]:
    """The chart's MutatingWebhookConfiguration, reaching the operator at `url`."""
    rendered = cluster.helm("template", "wc", str(CHART), "-n", namespace,
                            "--show-only", "templates/webhook.yaml").stdout
    (config,) = [d for d in yaml.safe_load_all(rendered)
                 if d and d["kind"] == "MutatingWebhookConfiguration"]
    config["metadata"]["name"] = f"wc-webhook-test-{namespace}"
    for hook in config["webhooks"]:
        hook["clientConfig"] = {"url": url, "caBundle": base64.b64encode(ca).decode()}
    return config


def labelled_pod(namespace: str, name: str, cache: str, node: str,
                 cache_namespace: str | None = None) -> dict[str, Any]:
    """Only the label (and the engine's image and command): what a platform user writes."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace,
                            "labels": {names.CACHE_LABEL: cache}}
    if cache_namespace:
        meta["annotations"] = {names.CACHE_NAMESPACE_LABEL: cache_namespace}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                     "securityContext": {"runAsNonRoot": True, "runAsUser": 1000},
                     "containers": [{"name": "engine", "image": "engine:1"}]}}


def create(api: Api, pod: dict[str, Any]) -> k8s.V1Pod:
    return api.core.create_namespaced_pod(pod["metadata"]["namespace"], pod)


def refused(api: Api, pod: dict[str, Any]) -> ApiException:
    with pytest.raises(ApiException) as err:
        create(api, pod)
    return err.value


def test_a_labelled_pod_gets_what_it_needs_and_is_gated(scene: Scene, api: Api) -> None:
    ns, name = scene.namespace, scene.name
    scene.apply_cache()
    pod = create(api, labelled_pod(ns, "one-label", name, scene.node))
    assert [g.condition_type for g in pod.spec.readiness_gates] == [names.GATE_CONDITION]
    (volume,) = [v for v in pod.spec.volumes if v.name == inject.VOLUME]
    assert volume.csi.driver == "weightcache.dev"
    assert volume.csi.volume_attributes == {"cache": f"{ns}/{name}"}
    (container,) = pod.spec.containers
    assert [(m.name, m.mount_path) for m in container.volume_mounts
            if m.name == inject.VOLUME] == [(inject.VOLUME, f"/run/wc/{ns}.{name}")]
    env = {e.name: e.value for e in container.env}
    assert env == {inject.SOCKET_DIR_ENV: "/run/wc", inject.CACHE_ENV: f"{ns}.{name}",
                   inject.DAEMON_UIDS_ENV: "65533"}
    assert pod.spec.security_context.supplemental_groups == [65533]
    # The operator gates it although the cache's selector does not match it.
    eventually("the gate waits for the daemon", lambda: gate_of(
        api.core.read_namespaced_pod("one-label", ns)) == ("False", "DaemonNotReady"))
    scene.start_daemon()
    eventually("the gate opens once the daemon reports", lambda: gate_of(
        api.core.read_namespaced_pod("one-label", ns)) == ("True", "WeightsResident"))
    eventually("the pod Ready once its gate is open",
               lambda: is_ready(api.core.read_namespaced_pod("one-label", ns)))


def test_a_pod_is_bound_to_the_weights_of_its_admission_and_judged_by_them(
    scene: Scene, api: Api
) -> None:
    """A model change (issue 36): each pod's gate follows the generation it was admitted
    with, not the spec of the moment; `kubectl get wc` shows engines left on the old one."""
    ns, name = scene.namespace, scene.name
    key = names.binding_key(ns, name)
    scene.apply_cache()
    v1 = scene.spec_hash()
    on_v1 = create(api, labelled_pod(ns, "on-v1", name, scene.node))
    assert on_v1.metadata.annotations[key] == v1
    first = scene.start_daemon()
    eventually("the v1 pod's gate opens", lambda: gate_of(
        api.core.read_namespaced_pod("on-v1", ns)) == ("True", "WeightsResident"))

    scene.apply_cache(model={"path": str(minilm_dir()), "revision": "v2"})
    v2 = eventually("the DaemonSet renders the new model",
                    lambda: (digest := scene.spec_hash()) != v1 and digest)
    on_v2 = create(api, labelled_pod(ns, "on-v2", name, scene.node))
    assert on_v2.metadata.annotations[key] == v2
    # A pod that brings its binding keeps it; one that names no generation is refused.
    pinned = labelled_pod(ns, "pinned-v1", name, scene.node)
    pinned["metadata"]["annotations"] = {key: v1}
    assert create(api, pinned).metadata.annotations[key] == v1
    typo = labelled_pod(ns, "typo", name, scene.node)
    typo["metadata"]["annotations"] = {key: "v2"}
    err = refused(api, typo)
    assert err.status == 400 and key in err.body

    first.stop()
    eventually("only the new model's daemon pod runs", lambda: all(
        pod_spec_hash(p) == v2 for p in api.daemon_pods(ns, name)
        if p.metadata.deletion_timestamp is None) and scene.daemon_pod())
    scene.start_daemon(spec_hash=v2)
    eventually("the v2 pod's gate opens", lambda: gate_of(
        api.core.read_namespaced_pod("on-v2", ns)) == ("True", "WeightsResident"))
    for pod in ("on-v1", "pinned-v1"):
        eventually(f"{pod}'s gate is closed: no daemon holds its weights", lambda pod=pod: gate_of(
            api.core.read_namespaced_pod(pod, ns)) == ("False", "FingerprintMismatch"))
    want = [{"fingerprint": v2, "current": True, "nodes": 1, "enginePods": 1},
            {"fingerprint": v1, "current": False, "nodes": 0, "enginePods": 2}]
    scene.status_where("the status counts the node on v2 and the pods left on v1",
                       lambda s: s.get("generations") == want)
    header, row = scene.wc_table()
    assert row[header.index("ROLLOUT")] == "EnginesOnOldWeights"


def pod_spec_hash(pod: k8s.V1Pod) -> str | None:
    """The spec hash a daemon pod was rendered for (its template's environment)."""
    return next((e.value for c in pod.spec.containers for e in c.env or []
                 if e.name == SPEC_HASH_ENV), None)


def test_every_pod_the_webhook_is_sent_is_injected_or_refused_never_passed(
    scene: Scene, api: Api
) -> None:
    """The configuration sends every labelled pod but those with both daemon labels (Helm
    charts label their pods `managed-by: Helm`): each is injected, and one naming a missing
    cache refused, never admitted as it came."""
    ns, name = scene.namespace, scene.name
    scene.apply_cache()
    helm_pod = labelled_pod(ns, "from-helm", name, scene.node)
    helm_pod["metadata"]["labels"][names.MANAGED_BY_LABEL] = "Helm"
    pod = create(api, helm_pod)
    assert [g.condition_type for g in pod.spec.readiness_gates or []] == [names.GATE_CONDITION]
    assert [v.name for v in pod.spec.volumes if v.name == inject.VOLUME] == [inject.VOLUME]
    missing = labelled_pod(ns, "from-helm-missing", "no-such-cache", scene.node)
    missing["metadata"]["labels"][names.MANAGED_BY_LABEL] = "Helm"
    assert refused(api, missing).status == 403
    # Issue 34 item 3: the operator's own `managed-by` once skipped the webhook altogether.
    # One daemon label alone exempts nothing: only both (guarded by the chart's daemon-pod
    # guard, tests/k8s/test_real_csi.py).
    for extra in ({names.MANAGED_BY_LABEL: names.MANAGER},
                  {names.COMPONENT_LABEL: names.DAEMON_COMPONENT}):
        posing = labelled_pod(ns, f"posing-{len(extra)}-{next(iter(extra.values()))}", name,
                              scene.node)
        posing["metadata"]["labels"].update(extra)
        pod = create(api, posing)
        assert [g.condition_type for g in pod.spec.readiness_gates or []] == [
            names.GATE_CONDITION], extra
        assert [v.name for v in pod.spec.volumes if v.name == inject.VOLUME] == [inject.VOLUME]
        posing["metadata"]["name"] += "-missing"
        posing["metadata"]["labels"][names.CACHE_LABEL] = "no-such-cache"
        assert refused(api, posing).status == 403


def test_a_pod_naming_a_missing_cache_or_another_namespaces_is_refused(
    cluster: Cluster, scene: Scene, api: Api
) -> None:
    ns, name = scene.namespace, scene.name
    scene.apply_cache()
    missing = refused(api, labelled_pod(ns, "nope", "no-such-cache", scene.node))
    assert missing.status == 403
    assert f"WeightCache {ns}/no-such-cache does not exist" in missing.body
    other = f"t-{uuid.uuid4().hex[:10]}"
    cluster.kubectl("create", "namespace", other)
    try:
        default_service_account(api, other)
        intruder = labelled_pod(other, "intruder", name, scene.node, cache_namespace=ns)
        error = refused(api, intruder)
        assert error.status == 403
        assert f"namespace {other} may not use WeightCache {ns}/{name}" in error.body
        # Naming the cache's namespace in its spec lets the pods of that one in.
        scene.apply_cache(engine={"selector": {"matchLabels": {"app": f"{name}-engine"}},
                                  "namespaces": [other]})

        def admitted() -> k8s.V1Pod | None:
            try:
                return create(api, intruder)
            except ApiException:
                return None

        pod = eventually("the listed namespace's pod is admitted", admitted)
        (volume,) = [v for v in pod.spec.volumes if v.name == inject.VOLUME]
        assert volume.csi.volume_attributes == {"cache": f"{ns}/{name}"}
    finally:
        cluster.kubectl("delete", "namespace", other, "--wait=false")


def test_with_the_webhook_down_labelled_and_gated_pods_are_refused_others_admitted(
    scene: Scene, api: Api, webhook: WebhookProcess
) -> None:
    ns, name = scene.namespace, scene.name
    scene.apply_cache()
    daemon = scene.daemon_pod()
    webhook.stop()
    try:
        error = refused(api, labelled_pod(ns, "while-down", name, scene.node))
        assert error.status == 500 and "failed calling webhook" in error.body, error.body
        # A pod listing the gate itself is refused too: admitted, it would carry no label
        # for the operator's watch, and wait unseen.
        gated = labelled_pod(ns, "gated-while-down", name, scene.node)
        del gated["metadata"]["labels"]
        gated["spec"]["readinessGates"] = [{"conditionType": names.GATE_CONDITION}]
        assert "failed calling webhook" in refused(api, gated).body
        plain = labelled_pod(ns, "plain", name, scene.node)
        del plain["metadata"]["labels"]
        assert create(api, plain).spec.readiness_gates is None
        # The cache's daemon pods carry the label too, and are never sent to the webhook.
        api.core.delete_namespaced_pod(daemon.metadata.name, daemon.metadata.namespace,
                                       grace_period_seconds=0)
        eventually("the DaemonSet recreates its pod", lambda: [
            p for p in api.daemon_pods(ns, name) if p.metadata.uid != daemon.metadata.uid])
    finally:
        webhook.start()
    pod = eventually("admitted again once the webhook answers", lambda: _try_create(
        api, labelled_pod(ns, "after", name, scene.node)))
    assert pod.spec.readiness_gates


def test_the_webhook_admits_while_the_operator_is_killed(
    scene: Scene, api: Api, operator: OperatorProcess
) -> None:
    """Issue 43 item 2: the operator OOM-killed in a crash loop once took every tenant's
    admission with it (`no endpoints available`). Served apart, the webhook admits and
    injects with the operator dead; the operator, back, gates what was admitted."""
    ns, name = scene.namespace, scene.name
    scene.apply_cache()
    scene.daemon_pod()
    operator.kill()
    try:
        pod = create(api, labelled_pod(ns, "while-operator-down", name, scene.node))
        assert [g.condition_type for g in pod.spec.readiness_gates] == [names.GATE_CONDITION]
        assert pod.metadata.labels[names.GATED_LABEL] == names.GATED_VALUE
        assert pod.metadata.annotations[names.binding_key(ns, name)] == scene.spec_hash()
        assert gate_of(pod) is None
    finally:
        operator.start()
    scene.start_daemon()
    eventually("the operator, back, opens its gate", lambda: gate_of(
        api.core.read_namespaced_pod("while-operator-down", ns)) == ("True", "WeightsResident"))


def test_a_selector_gated_pod_is_marked_for_the_watch_and_gated(
    scene: Scene, api: Api
) -> None:
    """A pod listing the gate itself (its cache's selector matches it), sent by the chart's
    third entry (matchConditions, run by the real apiserver): the webhook adds the label
    the operator watches, and nothing else; the operator then gates it."""
    ns, name = scene.namespace, scene.name
    scene.apply_cache()
    gated = labelled_pod(ns, "selected", name, scene.node)
    gated["metadata"]["labels"] = {"app": f"{name}-engine"}
    gated["spec"]["readinessGates"] = [{"conditionType": names.GATE_CONDITION}]
    pod = create(api, gated)
    assert pod.metadata.labels == {"app": f"{name}-engine", names.GATED_LABEL: "true"}
    assert not [v for v in pod.spec.volumes or [] if v.name == inject.VOLUME]
    assert pod.metadata.annotations is None
    scene.start_daemon()
    eventually("the selected pod's gate opens", lambda: gate_of(
        api.core.read_namespaced_pod("selected", ns)) == ("True", "WeightsResident"))
    # The gate's transitions are posted as the pod's Events, as before the watch moved.
    eventually("the pod's WeightsResident event", lambda: [
        e for e in api.core.list_namespaced_event(ns).items
        if e.involved_object.name == "selected" and e.reason == "WeightsResident"])


def test_a_gated_pod_past_the_limits_is_refused_naming_the_limit(
    scene: Scene, api: Api
) -> None:
    """Issue 43 item 1: 2,700 labels (~900 KB) on a pod listing the gate, as the tenant of
    the security review made 340 of. Refused at admission, naming the limit; the same pod
    without the gate is none of weightcache's business and is admitted."""
    ns, name = scene.namespace, scene.name
    attack = labelled_pod(ns, "oversized", name, scene.node)
    attack["metadata"]["labels"] = oversized_labels(2700)
    attack["spec"]["nodeSelector"] = {"no-such-node": "anywhere"}
    attack["spec"]["readinessGates"] = [{"conditionType": names.GATE_CONDITION}]
    error = refused(api, attack)
    assert error.status == 400, error.body
    assert f"over the limit of {podlimits.LIMITS.labels} labels" in error.body
    one_label = labelled_pod(ns, "oversized-one-label", name, scene.node)
    one_label["metadata"]["labels"].update(oversized_labels(podlimits.LIMITS.labels))
    assert f"over the limit of {podlimits.LIMITS.labels}" in refused(api, one_label).body
    bindings = labelled_pod(ns, "many-bindings", name, scene.node)
    bindings["metadata"]["annotations"] = {f"{names.BINDING_PREFIX}x{i}": "a" * 64
                                           for i in range(200)}
    assert "(one per WeightCache that gates the pod)" in refused(api, bindings).body
    ungated = labelled_pod(ns, "ungated", name, scene.node)
    ungated["metadata"]["labels"] = oversized_labels(2700)
    assert create(api, ungated).spec.readiness_gates is None


def test_past_the_limits_after_admission_or_unlabelled_the_gate_closes_saying_why(
    scene: Scene, api: Api
) -> None:
    """A pod admitted within the limits, relabelled past them (a tenant with `patch pods`):
    its view keeps nothing but why, and its gate closes naming the limit. One whose watch
    label is removed leaves the operator's watch: its open gate is closed (NotWatched),
    never left reported resident. Relabelled away from its cache: NoWeightCache."""
    ns, name = scene.namespace, scene.name
    scene.apply_cache()
    for pod in ("grows", "unlabelled", "renamed"):
        create(api, labelled_pod(ns, pod, name, scene.node))
    scene.start_daemon()
    for pod in ("grows", "unlabelled", "renamed"):
        eventually(f"{pod}'s gate opens", lambda pod=pod: gate_of(
            api.core.read_namespaced_pod(pod, ns)) == ("True", "WeightsResident"))
    api.core.patch_namespaced_pod("grows", ns, {"metadata": {"labels": oversized_labels(200)}})
    eventually("the grown pod's gate closes naming the limit", lambda: gate_of(
        api.core.read_namespaced_pod("grows", ns)) == ("False", podlimits.OVER_LIMITS))
    condition = next(c for c in api.core.read_namespaced_pod("grows", ns).status.conditions
                     if c.type == names.GATE_CONDITION)
    assert f"over the limit of {podlimits.LIMITS.labels} labels" in condition.message
    api.core.patch_namespaced_pod("unlabelled", ns,
                                  {"metadata": {"labels": {names.GATED_LABEL: None}}})
    eventually("the unwatched pod's gate is closed", lambda: gate_of(
        api.core.read_namespaced_pod("unlabelled", ns)) == ("False", "NotWatched"))
    api.core.patch_namespaced_pod("renamed", ns,
                                  {"metadata": {"labels": {names.CACHE_LABEL: "another"}}})
    eventually("the relabelled pod's gate closes", lambda: gate_of(
        api.core.read_namespaced_pod("renamed", ns)) == ("False", "NoWeightCache"))


def _try_create(api: Api, pod: dict[str, Any]) -> k8s.V1Pod | None:
    try:
        return create(api, pod)
    except ApiException:
        return None


def test_admitting_a_pod_twice_adds_nothing_twice(scene: Scene, api: Api) -> None:
    """A pod that already has what the webhook adds (e.g. written from a previous admission)."""
    ns, name = scene.namespace, scene.name
    scene.apply_cache()
    first = create(api, labelled_pod(ns, "first", name, scene.node))
    again = api.core.api_client.sanitize_for_serialization(first)
    again["metadata"] = {"name": "again", "namespace": ns,
                         "labels": again["metadata"]["labels"]}
    again["spec"].pop("nodeName", None)
    second = create(api, json.loads(json.dumps(again)))
    for pod in (first, second):
        assert len(pod.spec.readiness_gates) == 1
        assert len([v for v in pod.spec.volumes if v.name == inject.VOLUME]) == 1
        assert pod.spec.security_context.supplemental_groups == [65533]
        (container,) = pod.spec.containers
        assert len([e for e in container.env if e.name == inject.CACHE_ENV]) == 1


def test_a_gated_pod_the_watch_cannot_see_is_closed_when_the_operator_starts(
    scene: Scene, api: Api, operator: OperatorProcess
) -> None:
    """A pod whose watch label went while the operator was down (or one admitted before the
    label existed, gate opened by an older operator): the new operator's watch never sees
    it, so at start it looks such pods up by each cache's selector and the one-label form,
    and closes their open gates (NotWatched), never leaving them reported resident."""
    ns, name = scene.namespace, scene.name
    scene.apply_cache()
    create(api, labelled_pod(ns, "one-label", name, scene.node))
    selected = labelled_pod(ns, "selected", name, scene.node)
    selected["metadata"]["labels"] = {"app": f"{name}-engine"}
    selected["spec"]["readinessGates"] = [{"conditionType": names.GATE_CONDITION}]
    create(api, selected)
    scene.start_daemon()
    for pod in ("one-label", "selected"):
        eventually(f"{pod}'s gate opens", lambda pod=pod: gate_of(
            api.core.read_namespaced_pod(pod, ns)) == ("True", "WeightsResident"))
    operator.stop()
    try:
        for pod in ("one-label", "selected"):
            api.core.patch_namespaced_pod(pod, ns, {"metadata": {"labels": {
                names.GATED_LABEL: None}}})
    finally:
        operator.start()
    for pod in ("one-label", "selected"):
        eventually(f"{pod}'s gate is closed at the operator's start", lambda pod=pod: gate_of(
            api.core.read_namespaced_pod(pod, ns)) == ("False", "NotWatched"))
