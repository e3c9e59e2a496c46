"""What the templates render: a hardened operator pod, images, policies, the test hook."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.chart.chartkit import VALUE_SETS, Renderer, files, one, values_id
from weightcache_operator.policy import Policy, policy_from_env

DIGEST = "sha256:" + "ab" * 32


def operator_pod(docs: list[dict]) -> dict:
    return one(docs, "Deployment", "-operator")["spec"]["template"]["spec"]


@pytest.mark.parametrize("values", VALUE_SETS, ids=values_id)
def test_operator_pod_is_hardened(render: Renderer, values: Path | None) -> None:
    docs = render(*files(values))
    pod = operator_pod(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not pod.get("hostPID") and not pod.get("hostIPC") and not pod.get("hostNetwork")
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"]["requests"] and container["resources"]["limits"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert f"--liveness=http://0.0.0.0:{ports['health']}/healthz" in container["args"]
    assert f"--metrics-port={ports['metrics']}" in container["args"]
    # Only the operator pod carries the operator's token; its ServiceAccount opts out.
    assert pod["automountServiceAccountToken"] is True
    assert one(docs, "ServiceAccount", "-weightcache-operator")[
        "automountServiceAccountToken"] is False
    assert one(docs, "Deployment", "-operator")["spec"]["strategy"] == {"type": "Recreate"}


def policy_of(pod: dict) -> Policy:
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    return policy_from_env(env)


def test_images_default_to_app_version_and_a_digest_pins_them(render: Renderer) -> None:
    pod = operator_pod(render())
    policy = policy_of(pod)
    assert pod["containers"][0]["image"] == "ghcr.io/weightcache/operator:0.1.0"
    # The privileged set-up step runs the operator's own image.
    assert policy.setup_image == pod["containers"][0]["image"]
    assert policy.sidecar_image == "ghcr.io/weightcache/sidecar:0.1.0"

    pod = operator_pod(render(set_values=[
        f"image.digest={DIGEST}", "image.tag=1.2.3", f"sidecarImage.digest={DIGEST}",
        "sidecarImage.repository=reg.example.com/wc/sidecar",
    ]))
    policy = policy_of(pod)
    assert pod["containers"][0]["image"] == f"ghcr.io/weightcache/operator:1.2.3@{DIGEST}"
    assert policy.setup_image == pod["containers"][0]["image"]
    assert policy.sidecar_image == f"reg.example.com/wc/sidecar:0.1.0@{DIGEST}"


def test_the_operator_gets_the_same_policy_admission_enforces(render: Renderer) -> None:
    docs = render(set_values=[
        "cachePolicy.allowedHostPaths.socketDirs={/run/wc}",
        "cachePolicy.allowedHostPaths.modelDirs={/srv/models,/data/m}",
        "cachePolicy.allowedSidecarImagePrefixes={reg.example.com/wc/}",
        "cachePolicy.allowedTransports={vmm_fd}",
        "daemon.serviceAccount.name=wc-daemon",
    ])
    policy = policy_of(operator_pod(docs))
    assert policy.allowed_host_paths.socket_dirs == ("/run/wc",)
    assert policy.allowed_host_paths.model_dirs == ("/srv/models", "/data/m")
    assert policy.allowed_sidecar_image_prefixes == ("reg.example.com/wc/",)
    assert policy.allowed_transports == ("vmm_fd",)
    assert policy.daemon_service_account == "wc-daemon"
    spec = one(docs, "ValidatingAdmissionPolicy", "-cache-policy")["spec"]
    rules = " ".join(v["expression"] for v in spec["variables"])
    for value in ("'/run/wc'", "'/srv/models','/data/m'", "'reg.example.com/wc/'", "'vmm_fd'"):
        assert value in rules


def test_metrics_service_selects_the_operator_pod(render: Renderer) -> None:
    docs = render()
    service = one(docs, "Service", "-metrics")
    labels = one(docs, "Deployment", "-operator")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"metrics", "health"}


def test_report_guard_matches_exactly_the_daemon_account(render: Renderer) -> None:
    docs = render(set_values=["daemon.namespace=daemons"])
    policy = one(docs, "ValidatingAdmissionPolicy", "-daemon-report-guard")
    (condition,) = policy["spec"]["matchConditions"]
    assert condition["expression"] == (
        "request.userInfo.username == 'system:serviceaccount:daemons:weightcache-daemon'")
    binding = one(docs, "ValidatingAdmissionPolicyBinding", "-daemon-report-guard")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"],
                               "validationActions": ["Deny"]}
    assert policy["spec"]["failurePolicy"] == "Fail"


def test_report_guard_can_be_turned_off(render: Renderer) -> None:
    docs = render(set_values=["daemon.reportGuard.enabled=false"])
    assert not [d for d in docs if "report-guard" in d["metadata"]["name"]]


def test_cache_policy_defaults_are_secure_and_admission_can_be_turned_off(
    render: Renderer,
) -> None:
    policy = policy_of(operator_pod(render()))
    # torch_ipc (hostPID, hostIPC) only when an admin adds it.
    assert "torch_ipc" not in policy.allowed_transports
    assert policy.allowed_host_paths.socket_dirs == ("/var/run/weightcache",)
    assert policy.allowed_host_paths.model_dirs == ("/models",)
    # Issue 25 items 3 and 4: no priority class, GPU nodes' taint only, bounded resources;
    # issue 34 item 4: visible-devices (the CRD's default) for the chart's own image alone
    # while images are not restricted (policy.py, cache-policy.yaml).
    assert policy.allowed_priority_classes == ()
    assert [t.key for t in policy.allowed_tolerations] == ["nvidia.com/gpu"]
    assert policy.max_sidecar_resources == {"cpu": "8", "memory": "64Gi"}
    assert policy.allowed_gpu_access_modes == ("visible-devices", "device-plugin", "dra")
    assert policy.namespace_model_sources == {}
    spec = one(render(), "ValidatingAdmissionPolicy", "-cache-policy")["spec"]
    # One validation over the list of every violation, so that one refusal names them all.
    (validation,) = spec["validations"]
    assert validation["expression"] == "size(variables.violations) == 0"
    assert validation["messageExpression"] == "variables.violations.join('; ')"
    violations = next(v["expression"] for v in spec["variables"]
                      if v["name"] == "violations")
    # transport, socketDir, model.path, model.pvc, gpuAccess.claim, GPU access mode,
    # visible-devices for another image, runAsUser, priority class, tolerations, requests,
    # limits; any image by default
    assert violations.count("? ''") == 12
    docs = render(set_values=["cachePolicy.enabled=false"])
    assert not [d for d in docs if "cache-policy" in d["metadata"]["name"]]
    # The operator enforces the policy either way.
    assert policy_of(operator_pod(docs)) == policy


def test_helm_test_pod_checks_the_operator_endpoints(render: Renderer) -> None:
    docs = render()
    pod = one(docs, "Pod", "-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert pod["spec"]["restartPolicy"] == "Never"
    (container,) = pod["spec"]["containers"]
    service = one(docs, "Service", "-metrics")["metadata"]["name"]
    assert container["command"][-2:] == [
        f"http://{service}.wc-system.svc:8081/healthz",
        f"http://{service}.wc-system.svc:8080/metrics",
    ]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert not [d for d in render(set_values=["tests.enabled=false"]) if d["kind"] == "Pod"]


def test_the_csi_driver_serves_inline_ephemeral_volumes_only(render: Renderer) -> None:
    docs = render(set_values=["csi.kubeletRootDir=/srv/kubelet"])
    driver = one(docs, "CSIDriver")
    assert driver["metadata"]["name"] == "weightcache.dev"
    assert driver["spec"]["attachRequired"] is False
    assert driver["spec"]["podInfoOnMount"] is True
    assert driver["spec"]["volumeLifecycleModes"] == ["Ephemeral"]
    plugin = one(docs, "DaemonSet", "-csi")
    spec = plugin["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in spec["containers"]}
    mounts = {m["name"]: m for m in containers["plugin"]["volumeMounts"]}
    assert mounts["pods-dir"] == {"name": "pods-dir", "mountPath": "/srv/kubelet/pods",
                                  "mountPropagation": "Bidirectional"}
    assert "--socket-root=/var/run/weightcache=/host/sockets/0" in containers["plugin"]["args"]
    assert ("--kubelet-registration-path=/srv/kubelet/plugins/weightcache.dev/csi.sock"
            in containers["registrar"]["args"])
    volumes = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
    assert volumes["registration-dir"] == "/srv/kubelet/plugins_registry"
    assert volumes["sockets-0"] == "/var/run/weightcache"
    # The operator's own image runs the privileged plugin, never an author's.
    operator = one(docs, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    assert containers["plugin"]["image"] == operator["image"]
    assert containers["registrar"]["securityContext"]["capabilities"] == {"drop": ["ALL"]}


GATED_CONDITION = (
    "(has(object.spec.readinessGates) && object.spec.readinessGates.exists(g, "
    "g.conditionType == 'weightcache.dev/weights-resident')) || (has(object.metadata.labels) "
    "&& 'weightcache.dev/gated' in object.metadata.labels)")


def selected(hook: dict, labels: dict[str, str], gate: bool = False) -> bool:
    """Whether a hook sends a pod with `labels` (and the readiness gate, with `gate`): its
    objectSelector (matchExpressions of Exists, DoesNotExist, In, NotIn), as the API server
    decides, and its one matchCondition (CEL; the real apiserver runs it in
    tests/k8s/test_webhook.py), as GATED_CONDITION says."""
    for e in hook["objectSelector"]["matchExpressions"]:
        value = labels.get(e["key"])
        if e["operator"] == "Exists" and value is None:
            return False
        if e["operator"] == "DoesNotExist" and value is not None:
            return False
        if e["operator"] == "In" and value not in e["values"]:
            return False
        if e["operator"] == "NotIn" and value in e["values"]:
            return False
    for condition in hook.get("matchConditions") or []:
        assert condition["expression"] == GATED_CONDITION
        if not (gate or "weightcache.dev/gated" in labels):
            return False
    return True


def test_the_webhook_sees_every_gated_pod_but_daemons_and_fails_closed(
    render: Renderer,
) -> None:
    from weightcache_operator import inject, names, rbac

    docs = render()
    hooks = one(docs, "MutatingWebhookConfiguration")["webhooks"]
    service = one(docs, "Service", "-webhook")
    secret = one(docs, "Secret", "-webhook-tls")
    for hook in hooks:
        assert hook["failurePolicy"] == "Fail"
        assert hook["sideEffects"] == "None"
        assert hook["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"],
                                  "operations": ["CREATE"], "resources": ["pods"],
                                  "scope": "Namespaced"}]
        assert hook["clientConfig"]["service"] == {
            "name": service["metadata"]["name"], "namespace": "wc-system", "path": "/inject",
            "port": 443}
        assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    # Issue 34 item 3: the selectors send exactly the pods the handler decides for
    # (inject.gated): every labelled pod but those with both daemon labels; issue 43: every
    # pod listing the gate, or carrying the watch label, so that each is marked for the
    # operator's watch and refused past the limits.
    cache = {names.CACHE_LABEL: "minilm"}
    daemon = {names.MANAGED_BY_LABEL: names.MANAGER,
              names.COMPONENT_LABEL: names.DAEMON_COMPONENT}
    marked = {names.GATED_LABEL: names.GATED_VALUE}
    for labels in ({}, cache, {**cache, names.MANAGED_BY_LABEL: "Helm"},
                   {**cache, names.MANAGED_BY_LABEL: names.MANAGER},
                   {**cache, names.COMPONENT_LABEL: names.DAEMON_COMPONENT},
                   {**cache, **daemon}, daemon, {"app": "engine"}, marked,
                   {**marked, "app": "engine"}, {**cache, **marked}):
        for gate in (False, True):
            spec = {"readinessGates": [{"conditionType": names.GATE_CONDITION}]} if gate else {}
            sent = [hook["name"] for hook in hooks if selected(hook, labels, gate)]
            wanted = inject.gated(labels, spec) and not (
                names.CACHE_LABEL in labels and inject.is_daemon(labels))
            assert len(sent) == int(wanted), (labels, gate, sent)
    # Served by a Deployment of its own, never the operator's (issue 43 item 2).
    operator = one(docs, "Deployment", "-operator")["spec"]["template"]["spec"]
    assert not [a for a in operator["containers"][0]["args"] if "webhook" in a]
    assert "webhook-tls" not in {v["name"] for v in operator["volumes"]}
    webhook = one(docs, "Deployment", "-webhook")
    assert webhook["spec"]["replicas"] == 2
    assert webhook["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod = webhook["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert not operator.get("affinity") or "webhook" not in str(operator)
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["python", "-m", "weightcache_operator", "webhook"]
    assert container["image"] == one(docs, "Deployment", "-operator")["spec"]["template"][
        "spec"]["containers"][0]["image"]
    assert container["resources"]["limits"]["memory"]
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert {"name": "webhook-tls", "mountPath": "/tls", "readOnly": True} in container[
        "volumeMounts"]
    spread = pod["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert spread["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    budget = one(docs, "PodDisruptionBudget", "-webhook")
    assert budget["spec"]["minAvailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    account = pod["spec"]["serviceAccountName"]
    assert account != operator["serviceAccountName"]
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"
               and d["metadata"]["name"].endswith("-webhook")]
    assert role["rules"] == rbac.WEBHOOK_RULES
    (binding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding"
                  and d["metadata"]["name"].endswith("-webhook")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account,
                                    "namespace": "wc-system"}]


def test_the_webhook_can_take_its_certificate_from_cert_manager(render: Renderer) -> None:
    docs = render(set_values=["webhook.tls.source=cert-manager"])
    config = one(docs, "MutatingWebhookConfiguration")
    assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"].startswith(
        "wc-system/")
    assert "caBundle" not in config["webhooks"][0]["clientConfig"]
    assert [d for d in docs if d["kind"] == "Secret"] == []
    certificate = one(docs, "Certificate")
    assert certificate["spec"]["secretName"].endswith("-webhook-tls")


def test_webhook_and_csi_can_be_left_out(render: Renderer) -> None:
    docs = render(set_values=["webhook.enabled=false", "csi.enabled=false"])
    assert not [d for d in docs if d["kind"] in ("MutatingWebhookConfiguration", "CSIDriver",
                                                 "PodDisruptionBudget")]
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"] == [
        "wc-weightcache-operator"]


def test_network_policies_admit_only_the_scrapers_to_daemons_and_operator(
    render: Renderer,
) -> None:
    from weightcache_operator import render as daemon_render

    docs = render(set_values=["daemon.namespace=daemons"])
    policy = one(docs, "NetworkPolicy", "-daemons")
    assert policy["metadata"]["namespace"] == "daemons"
    # It selects the pods the operator renders, and by default admits nobody.
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= daemon_render.selector_labels("ns", "any").items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == []
    operator = one(docs, "NetworkPolicy", "-weightcache-operator")
    labels = one(docs, "Deployment", "-operator")["spec"]["template"]["metadata"]["labels"]
    assert operator["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    (rule,) = operator["spec"]["ingress"]
    # The API server calls the webhook from an address the chart cannot know: its pods'
    # one port is open to all, and only that.
    webhook = one(docs, "NetworkPolicy", "-webhook")
    labels = one(docs, "Deployment", "-webhook")["spec"]["template"]["metadata"]["labels"]
    assert webhook["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert webhook["spec"]["ingress"] == [{"ports": [{"port": "webhook", "protocol": "TCP"}]}]
    test_pod = one(docs, "Pod", "-test")["metadata"]["labels"]
    (peer,) = rule["from"]  # the helm test pod alone
    assert peer["podSelector"]["matchLabels"].items() <= test_pod.items()
    assert {p["port"] for p in rule["ports"]} == {"metrics", "health"}

    scraper = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}
    docs = render(set_values=[
        "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name=mon",
        "tests.enabled=false", "webhook.enabled=false",
    ])
    assert one(docs, "NetworkPolicy", "-daemons")["spec"]["ingress"] == [{"from": [scraper]}]
    assert one(docs, "NetworkPolicy", "-weightcache-operator")["spec"]["ingress"][0]["from"] == [
        scraper]
    assert not [d for d in render(set_values=["networkPolicy.enabled=false"])
                if d["kind"] == "NetworkPolicy"]


def test_the_guards_match_the_operators_and_the_daemon_set_controllers_identities(
    render: Renderer,
) -> None:
    docs = render(set_values=["daemon.namespace=daemons", "serviceAccount.name=op"])
    operator = one(docs, "ValidatingAdmissionPolicy", "-operator-guard")
    (condition,) = operator["spec"]["matchConditions"]
    assert condition["expression"] == (
        "request.userInfo.username == 'system:serviceaccount:wc-system:op'")
    rules = {r for rule in operator["spec"]["matchConstraints"]["resourceRules"]
             for r in rule["resources"]}
    assert rules == {"nodes", "pods/status", "daemonsets"}
    pods = one(docs, "ValidatingAdmissionPolicy", "-daemon-pod-guard")
    text = json.dumps(pods["spec"])
    assert "system:serviceaccount:kube-system:daemon-set-controller" in text
    assert "system:serviceaccount:daemons:weightcache-daemon" in text
    for policy in (operator, pods):
        assert policy["spec"]["failurePolicy"] == "Fail"
        binding = one(docs, "ValidatingAdmissionPolicyBinding",
                      policy["metadata"]["name"].removeprefix("wc-weightcache-operator"))
        assert binding["spec"]["validationActions"] == ["Deny"]
    docs = render(set_values=["operatorGuard.enabled=false", "daemon.podGuard.enabled=false"])
    assert not [d for d in docs if d["metadata"]["name"].endswith(("-operator-guard",
                                                                   "-daemon-pod-guard"))]


def test_the_sweeper_runs_with_chown_alone_on_every_socket_root(render: Renderer) -> None:
    docs = render(set_values=["cachePolicy.allowedHostPaths.socketDirs={/run/a,/run/b}",
                              "daemon.namespace=daemons", "sweeper.intervalSeconds=30"])
    sweeper = one(docs, "DaemonSet", "-sweeper")
    assert sweeper["metadata"]["namespace"] == "daemons"
    pod = sweeper["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    assert container["image"] == operator_pod(docs)["containers"][0]["image"]
    assert container["command"] == ["python", "-m", "weightcache_operator.socketdir", "sweep",
                                    "--every=30", "/host/sockets/0", "/host/sockets/1"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]}}
    assert "ports" not in container
    assert [v["hostPath"] for v in pod["volumes"]] == [
        {"path": "/run/a", "type": "DirectoryOrCreate"},
        {"path": "/run/b", "type": "DirectoryOrCreate"}]
    # Wherever a cache's daemons may run: the tolerations caches may use.
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                   "effect": "NoSchedule"}]
    assert not [d for d in render(set_values=["sweeper.enabled=false"])
                if d["metadata"]["name"].endswith("-sweeper")]


def test_the_daemon_pod_guard_keeps_daemon_pods_in_the_daemon_namespace(
    render: Renderer,
) -> None:
    docs = render(set_values=["daemon.namespace=daemons",
                              "daemon.migrateFromNamespaces={old-a}"])
    guard = one(docs, "ValidatingAdmissionPolicy", "-daemon-pod-guard")
    first = guard["spec"]["validations"][0]["expression"]
    assert "request.namespace in ['daemons','old-a']" in first


def test_the_operator_gets_each_namespaces_model_sources(render: Renderer, tmp_path: Path
                                                        ) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(json.dumps({"cachePolicy": {"namespaceModelSources": {
        "team-a": {"modelDirs": ["/models/a"], "modelClaims": ["a-weights"]},
        "team-b": {}}}}))
    docs = render(values)
    policy = policy_of(operator_pod(docs))
    assert policy.model_sources("team-a")[0].model_dirs == ("/models/a",)
    assert policy.model_sources("team-a")[0].model_claims == ("a-weights",)
    assert policy.model_sources("team-b")[0].model_dirs == ()
    assert policy.model_sources("other")[0].model_dirs == ("/models",)
    variables = {v["name"]: v["expression"] for v in one(
        docs, "ValidatingAdmissionPolicy", "-cache-policy")["spec"]["variables"]}
    assert "{'team-a':['/models/a'],'team-b':[]}" in variables["modelDirs"]
    assert "{'team-a':['a-weights'],'team-b':[]}" in variables["modelClaims"]
    # The operator's guard lets its DaemonSets mount any namespace's model directory.
    guard = json.dumps(one(docs, "ValidatingAdmissionPolicy", "-operator-guard")["spec"])
    assert "['/models','/models/a']" in guard


def test_the_default_policy_renders_every_example_and_a_gpu_cache_naming_only_its_model(
    render: Renderer,
) -> None:
    """Issue 34 item 4, the operator's half (tests/k8s/test_chart.py applies the same
    objects to the default chart's admission policy): under the chart's defaults the
    operator renders each shipped example, and a GPU cache that sets spec.model alone."""
    import yaml

    from weightcache_operator.render import CacheRef, render_daemonset
    from weightcache_operator.spec import parse_spec, spec_hash

    policy = policy_of(operator_pod(render()))
    examples = sorted((Path(__file__).resolve().parents[3] / "crds" / "examples").glob("*.yaml"))
    docs = [yaml.safe_load(p.read_text()) for p in examples]
    minimal = {"metadata": {"name": "newcomer", "namespace": "team"},
               "spec": {"model": {"path": "/models/llama"}}}
    for doc in [*docs, minimal]:
        spec = parse_spec(doc["spec"])
        ref = CacheRef(doc["metadata"]["namespace"], doc["metadata"]["name"], "uid", 1)
        manifest = render_daemonset(ref, spec, spec_hash(spec), policy, 65532)
        assert manifest["kind"] == "DaemonSet"
    assert parse_spec(minimal["spec"]).gpu_access.mode == "visible-devices"
