"""The Helm chart on the real control plane.

`helm install`, then the operator runs as its own process with the chart's
ServiceAccount token and nothing else (the chart Deployment's command line),
and so does the webhook (its Deployment's command line, its account's token;
the chart's MutatingWebhookConfiguration pointed at it by URL, with a
certificate for loopback made here),
and the real daemon (CPU, memfd, MiniLM) reports into its kwok pod with a
token of the chart's daemon ServiceAccount bound to that pod, as kubelet
would mount it. The engine rollout is gated as in the operator's end-to-end
test, whose building blocks (tests/k8s/operator_flow.py) this reuses. Then
every verb of the chart's ClusterRole is taken away in turn and the operator
must hit Forbidden on exactly that verb; the daemon's report guard must
refuse every write but its own report; and `helm uninstall` must leave
nothing behind.

kwok runs no containers: the chart's operator and helm-test pods are
simulated, so the operator process and the helm-test pod's own script run on
this machine against the same endpoints. The caches live in a namespace of
their own; their daemons run in the chart's (the daemon namespace). Waits poll
for a state with a generous bound; nothing asserts on time.
"""

from __future__ import annotations

import base64
import json
import os
import re
import ssl
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from tests.k8s.operator_flow import (
    Api,
    DaemonProcess,
    OperatorProcess,
    WebhookProcess,
    apply,
    engine_deployment,
    eventually,
    gate_of,
    is_ready,
    minilm_dir,
    minilm_tensor_bytes,
    rollout_complete,
    template_spec_hash,
    weightcache,
)
from tools.testenv import kubeconfig, pki
from tools.testenv.cluster import Cluster
from weightcache.client import daemon_status
from weightcache.report import annotation_key
from weightcache_operator import names, rbac, render
from weightcache_operator.policy import policy_from_env
from weightcache_operator.spec import parse_spec, spec_hash

pytestmark = pytest.mark.k8s

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART = REPO_ROOT / "charts" / "weightcache-operator"
GATE = names.GATE_CONDITION
REPORT_GPU0 = annotation_key("GPU-0")


# --------------------------------------------------------------------------- the release


@dataclass
class Release:
    name: str
    namespace: str
    cache_namespace: str
    fullname: str
    operator_account: str
    daemon_account: str
    webhook: WebhookProcess | None = None

    @property
    def webhook_account(self) -> str:
        return f"{self.fullname}-webhook"


def helm(cluster: Cluster, *args: str) -> str:
    result = cluster.helm(*args, check=False)
    assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stderr}"
    return result.stdout


def kubectl(cluster: Cluster, *args: str, input: str | None = None) -> str:
    result = cluster.kubectl(*args, input=input, check=False)
    assert result.returncode == 0, f"kubectl {' '.join(args)}:\n{result.stderr}"
    return result.stdout


def get(cluster: Cluster, *args: str) -> Any:
    return json.loads(kubectl(cluster, "get", *args, "-o", "json"))


def try_get(cluster: Cluster, *args: str) -> Any | None:
    result = cluster.kubectl("get", *args, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


@pytest.fixture(scope="module")
def release(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    suffix = uuid.uuid4().hex[:6]
    rel = Release(
        name=f"wc{suffix}", namespace=f"wc-system-{suffix}", cache_namespace=f"wc-cache-{suffix}",
        fullname=f"wc{suffix}-weightcache-operator",
        operator_account=f"wc{suffix}-weightcache-operator", daemon_account="weightcache-daemon",
    )
    cluster.kubectl("create", "namespace", rel.cache_namespace)
    helm(
        cluster, "install", rel.name, str(CHART),
        "--namespace", rel.namespace, "--create-namespace",
        # The tests' checkpoint lives in the venv; a real cluster keeps models under /models.
        "--set", f"cachePolicy.allowedHostPaths.modelDirs={{/models,{minilm_dir()}}}",
        "--set",
        "cachePolicy.allowedSidecarImagePrefixes={registry.corp.example,ghcr.io/weightcache/}",
    )
    rel.webhook = serve_webhook(cluster, rel, tmp_path_factory.mktemp("webhook"))
    yield rel
    rel.webhook.stop()
    # The uninstall test normally did this; a failed run still leaves a clean cluster.
    if cluster.helm("status", rel.name, "-n", rel.namespace, check=False).returncode == 0:
        helm(cluster, "uninstall", rel.name, "-n", rel.namespace, "--wait")
    cluster.kubectl("delete", "namespace", rel.cache_namespace, rel.namespace, "--wait=false",
                    check=False)


class ChartWebhook(WebhookProcess):
    """The webhook as the chart's Deployment runs it: its command and args, its account's
    token; only the address, port and certificate are local (the apiserver reaches it by
    URL on loopback)."""

    def __init__(self, cluster: Cluster, rel: Release, config: Path, log_path: Path,
                 serving: pki.KeyPair) -> None:
        deployment = get(cluster, "deployment", "-n", rel.namespace, rel.webhook_account)
        self.container = deployment["spec"]["template"]["spec"]["containers"][0]
        super().__init__(config, log_path, serving.cert, serving.key)
        self.ca: Path | None = None

    def review(self, pod: dict[str, Any]) -> dict[str, Any]:
        """Its answer to an AdmissionReview creating `pod`, asked directly."""
        assert self.ca is not None
        body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                           "request": {"uid": "u", "operation": "CREATE",
                                       "kind": {"group": "", "version": "v1", "kind": "Pod"},
                                       "namespace": pod["metadata"]["namespace"],
                                       "object": pod}}).encode()
        request = urllib.request.Request(self.url, body,
                                         {"Content-Type": "application/json"})
        context = ssl.create_default_context(cafile=str(self.ca))
        with urllib.request.urlopen(request, context=context, timeout=30) as reply:
            return json.loads(reply.read())["response"]

    def argv(self) -> list[str]:
        c = self.container
        assert c["command"][:3] == ["python", "-m", "weightcache_operator"], c["command"]
        local = {"--port": str(self.port), "--cert": str(self.cert), "--key": str(self.key)}
        args = [f"{flag}={local[flag]}" if flag in local else arg
                for arg in c["args"] for flag in [arg.split("=", 1)[0]]]
        return [sys.executable, *c["command"][1:], *args, "--address=127.0.0.1"]


def serve_webhook(cluster: Cluster, rel: Release, work: Path) -> WebhookProcess:
    """The chart's webhook, running here under its account, and the chart's webhook
    configuration pointed at it (kwok runs no containers, so its Deployment's pods serve
    nothing)."""
    ca = pki.issue(pki.CertSpec("chart-webhook-test-ca", is_ca=True), work, "ca")
    serving = pki.issue(pki.CertSpec("127.0.0.1", server=True, ip_addresses=("127.0.0.1",)),
                        work, "serving", ca=ca)
    config = token_kubeconfig(cluster, work / "webhook.kubeconfig", rel.namespace,
                              rel.webhook_account)
    webhook = ChartWebhook(cluster, rel, config, work / "webhook.log", serving)
    webhook.ca = ca.cert
    webhook.start()
    hooks = get(cluster, "mutatingwebhookconfiguration", rel.fullname)
    for hook in hooks["webhooks"]:
        hook["clientConfig"] = {"url": webhook.url,
                                "caBundle": base64.b64encode(ca.cert.read_bytes()).decode()}
    kubectl(cluster, "replace", "-f", "-", input=json.dumps(hooks))
    return webhook


def ours(log_line: str, rel: Release) -> bool:
    """Whether an operator log line is about this release's namespaces (or no namespace)."""
    found = re.search(r"/namespaces/([^/\s]+)/", log_line)
    return found is None or found.group(1) in (rel.cache_namespace, rel.namespace)


def token_kubeconfig(cluster: Cluster, path: Path, namespace: str, account: str,
                     bound_pod: k8s.V1Pod | None = None) -> Path:
    """A kubeconfig holding only a TokenRequest token; `bound_pod` binds it as kubelet would."""
    spec: dict[str, Any] = {"expirationSeconds": 3600}
    if bound_pod is not None:
        spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1",
                                  "name": bound_pod.metadata.name, "uid": bound_pod.metadata.uid}
    review = cluster.api.post(
        f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
    )
    config = kubeconfig.render(cluster.server, cluster.ca.read_bytes(),
                               kubeconfig.token_user(review["status"]["token"]))
    return kubeconfig.write(path, config)


class ChartOperator(OperatorProcess):
    """The operator as the chart's Deployment runs it: its command, args and env.

    Only the listening addresses differ (loopback ports picked free here).
    """

    def __init__(self, cluster: Cluster, rel: Release, config: Path, log_path: Path) -> None:
        deployment = get(cluster, "deployment", "-n", rel.namespace, rel.fullname)
        self.container = deployment["spec"]["template"]["spec"]["containers"][0]
        policy = next(e["value"] for e in self.container["env"]
                      if e["name"] == "WEIGHTCACHE_POLICY")
        super().__init__(config, log_path, json.loads(policy))

    def argv(self) -> list[str]:
        c = self.container
        assert c["command"][0] == "python", c["command"]
        return [sys.executable, *c["command"][1:], *c["args"],
                f"--metrics-port={self.metrics_port}", "--metrics-addr=127.0.0.1",
                f"--liveness=http://127.0.0.1:{self.liveness_port}/healthz"]

    def start(self, wait: bool = True) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env.update({e["name"]: e["value"] for e in self.container["env"] if "value" in e})
        env["KUBECONFIG"] = str(self.kubeconfig)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.argv(), env=env, stdout=log,
                                         stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        if wait:
            eventually("operator liveness endpoint answers", self.alive)

    def log(self) -> str:
        # Handler errors quote the apiserver's JSON body, with escaped quotes.
        return self.log_path.read_text(errors="replace").replace('\\"', '"')


class Flow:
    """One WeightCache in the chart's daemon namespace, its daemons and engine."""

    def __init__(self, cluster: Cluster, rel: Release, api: Api, node: str, logs: Path) -> None:
        self.cluster, self.rel, self.api, self.node, self.logs = cluster, rel, api, node, logs
        self.ns = rel.cache_namespace
        self.name = f"mini-{uuid.uuid4().hex[:6]}"
        self.daemons: list[DaemonProcess] = []

    def apply_cache(self, **spec: Any) -> None:
        apply(self.cluster, weightcache(self.ns, self.name, self.node, **spec))

    def bind_engines_and_change_the_model(self) -> list[str]:
        """Bind the running engine pods to the generation they run (as the webhook binds
        at admission), then change the model's revision; the pods' names."""
        ds = self.api.daemonset(self.ns, self.name)
        body = {"metadata": {"annotations": {
            names.binding_key(self.ns, self.name): template_spec_hash(ds)}}}
        pods = [p.metadata.name for p in self.api.engine_pods(self.ns, self.name)]
        for pod in pods:
            self.api.core.patch_namespaced_pod(pod, self.ns, body)
        self.cluster.kubectl("patch", "wc", "-n", self.ns, self.name, "--type=merge",
                             "-p", '{"spec":{"model":{"revision":"r2"}}}')
        return pods

    def gone(self, pods: list[str]) -> bool:
        return not {p.metadata.name for p in self.api.engine_pods(self.ns, self.name)} & {*pods}

    def daemon_pod(self) -> k8s.V1Pod | None:
        pods = [p for p in self.api.daemon_pods(self.ns, self.name)
                if p.spec.node_name == self.node and p.status.phase == "Running"
                and p.metadata.deletion_timestamp is None]
        return pods[0] if pods else None

    def start_daemon(self, pod: k8s.V1Pod, spec_hash: str | None = None) -> DaemonProcess:
        """The real daemon as `pod`, with a token of the pod's ServiceAccount bound to it."""
        n = len(self.daemons)
        config = token_kubeconfig(self.cluster, self.logs / f"daemon-{n}.kubeconfig",
                                  pod.metadata.namespace, pod.spec.service_account_name,
                                  bound_pod=pod)
        ds = self.api.daemonset(self.ns, self.name)
        daemon = DaemonProcess(config, self.ns, self.name, pod.metadata.name,
                               spec_hash or template_spec_hash(ds), self.logs / f"daemon-{n}.log",
                               pod.spec.node_name, pod.metadata.namespace)
        daemon.start()
        self.daemons.append(daemon)
        return daemon

    def deploy_engine(self, version: str, gated: bool) -> None:
        apply(self.cluster, engine_deployment(self.ns, self.name, self.node, version, gated))

    def engine(self, version: str, gate: tuple[str, str]) -> k8s.V1Pod:
        return eventually(
            f"engine {version} pod gate is {gate}",
            lambda: next((p for p in self.api.engine_pods(self.ns, self.name, version)
                          if gate_of(p) == gate), None),
        )

    def status_where(self, what: str, check: Any) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            status = self.api.status(self.ns, self.name)
            return status if check(status) else None

        return eventually(what, probe)

    def label(self) -> str | None:
        return self.api.node_labels(self.node).get(names.node_label_key(self.ns, self.name))

    def stop_daemons(self) -> None:
        for daemon in self.daemons:
            daemon.stop()

    def force_cleanup(self) -> None:
        """As the admin, what an operator with every right would have cleaned up."""
        self.stop_daemons()
        ns, name = self.ns, self.name
        self.cluster.kubectl("delete", "deployment", "-n", ns, f"{name}-engine",
                             "--ignore-not-found", "--wait=false", check=False)
        if self.api.cache(ns, name) is not None:
            self.cluster.kubectl("patch", "wc", "-n", ns, name, "--type=merge",
                                 "-p", '{"metadata":{"finalizers":null}}', check=False)
            self.cluster.kubectl("delete", "wc", "-n", ns, name, "--ignore-not-found",
                                 check=False)
        self.cluster.kubectl("delete", "daemonset", "-n", self.rel.namespace,
                             names.daemonset_name(ns, name), "--ignore-not-found",
                             "--wait=false", check=False)
        self.cluster.kubectl("label", "node", self.node, f"{names.node_label_key(ns, name)}-",
                             check=False)


# --------------------------------------------------------------------------- the flow


def test_chart_renders_and_passes_server_side_dry_run(cluster: Cluster, release: Release) -> None:
    for values in [[], ["-f", str(CHART / "ci" / "restricted-values.yaml")]]:
        rendered = helm(cluster, "template", "dry", str(CHART), "-n", release.namespace, *values)
        docs = [d for d in yaml.safe_load_all(rendered) if d]
        # The restricted example names namespaces of its own; dry-run them in one that exists.
        for doc in docs:
            if doc["metadata"].get("namespace") not in (None, release.namespace):
                doc["metadata"]["namespace"] = release.cache_namespace
        out = kubectl(cluster, "apply", "--dry-run=server", "-f", "-",
                      input="\n---\n".join(json.dumps(d) for d in docs))
        assert out.count("(server dry run)") == len(docs), out


def test_operator_with_chart_rbac_gates_the_rollout(
    cluster: Cluster, release: Release, api: Api, tmp_path: Path
) -> None:
    rel = release
    config = token_kubeconfig(cluster, tmp_path / "operator.kubeconfig", rel.namespace,
                              rel.operator_account)
    operator = ChartOperator(cluster, rel, config, tmp_path / "operator.log")
    flow = Flow(cluster, rel, api, cluster.node_names[0], tmp_path)
    ns, name = flow.ns, flow.name
    operator.start()
    try:
        # Applying a WeightCache creates the DaemonSet, in the chart's namespace (not the
        # cache's); its pods run as the chart's daemon SA there.
        flow.apply_cache()
        ds = eventually("the DaemonSet exists", lambda: api.daemonset(ns, name))
        assert ds.metadata.namespace == rel.namespace
        assert not ds.metadata.owner_references
        pod = eventually("the daemon pod runs on the kwok node", flow.daemon_pod)
        assert pod.spec.service_account_name == rel.daemon_account
        assert pod.metadata.namespace == rel.namespace
        flow.status_where("a status", lambda s: s.get("phase") == "Loading")

        # Engines serve; rolling to a gated version while no daemon reports holds.
        flow.deploy_engine("v1", gated=False)
        eventually("v1 rolled out", lambda: rollout_complete(api, ns, f"{name}-engine"))
        (old,) = api.engine_pods(ns, name, "v1")
        flow.deploy_engine("v2", gated=True)
        new = flow.engine("v2", ("False", "DaemonNotReady"))
        assert not is_ready(new)
        assert is_ready(api.core.read_namespaced_pod(old.metadata.name, ns))

        # The real daemon reports through the chart's daemon RBAC and report guard.
        daemon = flow.start_daemon(pod)
        expected = minilm_tensor_bytes()
        status = flow.status_where("the node is verified", lambda s: s.get("readyNodes") == 1)
        (node,) = status["nodes"]
        (gpu,) = node["gpus"]
        assert gpu["state"] == "Ready" and gpu["transport"] == "memfd"
        assert gpu["preloadedWeightsBytes"] == expected == gpu["expectedBytes"]
        assert gpu["fingerprint"] == daemon_status(
            f"{daemon.socket_dir}/{ns}.{name}/cpu.sock").fingerprint
        eventually("the rollout completes", lambda: rollout_complete(api, ns, f"{name}-engine"))
        assert api.engine_pods(ns, name, "v1") == []
        (v2,) = api.engine_pods(ns, name, "v2")
        assert gate_of(v2) == ("True", "WeightsResident") and is_ready(v2)
        assert eventually("the node is labelled", flow.label) == "Ready"
        header = kubectl(cluster, "get", "wc", "-n", ns).splitlines()[0].split()
        assert header == ["NAME", "READY", "PHASE", "RESIDENT", "TRANSPORT", "ROLLOUT", "AGE"]

        # A daemon holding weights for another spec closes the gate again.
        flow.stop_daemons()
        flow.start_daemon(pod, spec_hash="0" * 64)
        flow.engine("v2", ("False", "FingerprintMismatch"))
        eventually("the node label is removed", lambda: flow.label() is None)
        flow.stop_daemons()
        flow.start_daemon(pod)
        flow.engine("v2", ("True", "WeightsResident"))

        # What the chart's `helm test` pod runs, against this operator's endpoints.
        test_pod = next(d for d in yaml.safe_load_all(helm(
            cluster, "template", rel.name, str(CHART), "-n", rel.namespace,
            "--show-only", "templates/tests/test-operator-serving.yaml")) if d)
        command = test_pod["spec"]["containers"][0]["command"]
        check = subprocess.run(
            [sys.executable, *command[1:-2],
             f"http://127.0.0.1:{operator.liveness_port}/healthz",
             f"http://127.0.0.1:{operator.metrics_port}/metrics"],
            capture_output=True, text=True, timeout=120,
        )
        assert check.returncode == 0, check.stderr
        assert "operator is serving" in check.stdout

        # Deleting the WeightCache removes the DaemonSet (the finalizer), the label, the gate.
        kubectl(cluster, "delete", "wc", "-n", ns, name, "--timeout=60s")
        eventually("the DaemonSet is deleted", lambda: api.daemonset(ns, name) is None)
        eventually("the node label is removed", lambda: flow.label() is None)
        flow.engine("v2", ("False", "NoWeightCache"))
        for daemon in flow.daemons:
            assert "Forbidden" not in daemon.log_tail(400), daemon.log_tail()
        # Earlier tests' namespaces may still be terminating, and hold caches of their own
        # this cluster's cache policy refuses: writes there are refused too.
        refused = [line for line in operator.log().splitlines()
                   if "Forbidden" in line and "because it is being terminated" not in line
                   and ours(line, rel)]
        assert not refused, "\n".join(refused)
    finally:
        flow.force_cleanup()
        operator.stop()


# --------------------------------------------------------------------------- every verb is used

# (role, apiGroup, resource, verb): every grant of the operator's ClusterRole and of its Role
# in the daemon namespace, one test each.
GRANTS = [
    (kind, group, resource, verb)
    for kind, rules in (("ClusterRole", rbac.OPERATOR_RULES),
                        ("Role", rbac.OPERATOR_DAEMON_NAMESPACE_RULES))
    for rule in rules
    for group in rule["apiGroups"] for resource in rule["resources"] for verb in rule["verbs"]
]


def without(rules: list[dict[str, Any]], group: str, resource: str, verb: str
            ) -> list[dict[str, Any]]:
    """The rules with exactly one (group, resource, verb) grant taken away."""
    out = []
    for rule in rules:
        for g in rule["apiGroups"]:
            for r in rule["resources"]:
                verbs = [v for v in rule["verbs"] if (g, r, v) != (group, resource, verb)]
                if verbs:
                    out.append({"apiGroups": [g], "resources": [r], "verbs": verbs})
    return out


def forbidden(verb: str, resource: str, group: str) -> str:
    """The apiserver's wording when that grant is missing."""
    return f'cannot {verb} resource "{resource}" in API group "{group}"'


@pytest.mark.parametrize(
    ("kind", "group", "resource", "verb"),
    GRANTS,
    ids=[f"{k}-{r}-{v}" for k, _, r, v in GRANTS],
)
def test_each_verb_of_the_operators_roles_is_used(
    cluster: Cluster, release: Release, api: Api, tmp_path: Path,
    kind: str, group: str, resource: str, verb: str,
) -> None:
    """Drive the flow (a cache, its daemon reporting, an engine, the cache deleted) under the
    chart's ClusterRole and daemon-namespace Role minus one verb: the operator hits Forbidden."""
    rel = release
    installed = {
        "ClusterRole": get(cluster, "clusterrole", rel.fullname)["rules"],
        "Role": get(cluster, "role", "-n", rel.namespace, f"{rel.fullname}-daemons")["rules"],
    }
    reduced = {k: without(rules, *((group, resource, verb) if k == kind else ("", "", "")))
               for k, rules in installed.items()}
    grants = sum(len(r["verbs"]) for rules in installed.values() for r in without(rules, "", "",
                                                                                   ""))
    assert sum(len(r["verbs"]) for rules in reduced.values() for r in rules) == grants - 1
    account = f"{rel.fullname}-minus"
    subject = [{"kind": "ServiceAccount", "name": account, "namespace": rel.namespace}]
    objects = [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": account, "namespace": rel.namespace}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": account}, "rules": reduced["ClusterRole"]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": account},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": account},
         "subjects": subject},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": account, "namespace": rel.namespace}, "rules": reduced["Role"]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": account, "namespace": rel.namespace},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
         "subjects": subject},
    ]
    apply(cluster, *objects)
    wanted = [forbidden(verb, resource, group)]
    config = token_kubeconfig(cluster, tmp_path / "minus.kubeconfig", rel.namespace, account)
    operator = ChartOperator(cluster, rel, config, tmp_path / "operator.log")
    flow = Flow(cluster, rel, api, cluster.node_names[1], tmp_path)
    deleted = False
    retiring: list[str] | None = None
    try:
        # Without list or watch kopf never gets going: do not wait for its liveness.
        operator.start(wait=False)
        flow.apply_cache(rollout={"strategy": "NodeByNode"})
        flow.deploy_engine("v1", gated=True)

        def hit() -> bool:
            nonlocal deleted, retiring
            operator.check_running()
            if any(w in operator.log() for w in wanted):
                return True
            pod = None if flow.daemons else flow.daemon_pod()
            if pod is not None:
                flow.start_daemon(pod)
            if retiring is None and flow.daemons and api.status(flow.ns, flow.name).get(
                    "phase") == "Ready":
                # A model change node by node: the engine on the old weights is evicted.
                retiring = flow.bind_engines_and_change_the_model()
            elif not deleted and retiring is not None and flow.gone(retiring):
                # The last step of a cache's life: its finalizer deletes the DaemonSet.
                cluster.kubectl("delete", "wc", "-n", flow.ns, flow.name, "--wait=false")
                deleted = True
            return False

        try:
            eventually(f"Forbidden: {' or '.join(wanted)}", hit, bound=150)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- operator log ---\n{operator.log_tail()}") from None
        # Nothing else was refused: the one missing grant is the one that broke the flow.
        refused = {part.split(" in API group")[0] for part in operator.log().split("cannot ")[1:]}
        only = forbidden(verb, resource, group).removeprefix("cannot ").split(" in API group")[0]
        assert all(r.startswith(only) for r in refused), refused
    finally:
        operator.stop()
        flow.force_cleanup()
        for obj in reversed(objects):
            namespaced = obj["kind"] in ("ServiceAccount", "Role", "RoleBinding")
            cluster.kubectl("delete", obj["kind"].lower(), obj["metadata"]["name"],
                            *(["-n", rel.namespace] if namespaced else []),
                            "--wait=false", check=False)


# ----------------------------------------------------------------------- the CSI plugin's rights


def publish_as(cluster: Cluster, config: Path, tmp: Path, cache_ns: str, cache: str,
               pod_ns: str) -> Any:
    """Run the real plugin (`python -m weightcache_csi serve`) with `config`'s identity and ask it,
    as kubelet would, to publish the cache's volume for a pod of `pod_ns`; its answer or error."""
    import grpc

    from weightcache_csi.stubs import csi_pb2, csi_pb2_grpc

    root = tmp / "sockets"
    (root / f"{cache_ns}.{cache}").mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    endpoint = tmp / "csi.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env["KUBECONFIG"] = str(config)
    plugin = subprocess.Popen(
        [sys.executable, "-m", "weightcache_csi", "serve", f"--endpoint={endpoint}",
         "--node-id=kwok", f"--socket-root=/var/run/weightcache={root}"],
        env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = tmp / "pod" / "mount"
    try:
        with grpc.insecure_channel(f"unix://{endpoint}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            node = csi_pb2_grpc.NodeStub(channel)
            try:
                return node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
                    volume_id="csi-test", target_path=str(target),
                    volume_capability=csi_pb2.VolumeCapability(
                        mount=csi_pb2.VolumeCapability.MountVolume()),
                    volume_context={"cache": f"{cache_ns}/{cache}",
                                    "csi.storage.k8s.io/pod.namespace": pod_ns,
                                    "csi.storage.k8s.io/pod.name": "engine",
                                    "csi.storage.k8s.io/ephemeral": "true"}), timeout=30)
            except grpc.RpcError as error:
                return error
            finally:
                node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
                    volume_id="csi-test", target_path=str(target)), timeout=30)
    finally:
        plugin.terminate()
        plugin.wait(timeout=30)


@pytest.mark.skipif(os.geteuid() != 0, reason="the plugin bind-mounts, as root")
def test_the_csi_plugins_one_grant_is_used(
    cluster: Cluster, release: Release, tmp_path: Path
) -> None:
    """With the chart's plugin account, a publish of a cache the pod may use succeeds; with
    that account's one rule (get weightcaches) taken away it fails naming the refusal."""
    import grpc

    rel = release
    name = f"csi-{uuid.uuid4().hex[:6]}"
    apply(cluster, weightcache(rel.cache_namespace, name, cluster.node_names[0]))
    account = f"{rel.fullname}-csi"
    config = token_kubeconfig(cluster, tmp_path / "csi.kubeconfig", rel.namespace, account)
    installed = get(cluster, "clusterrole", account)["rules"]
    assert without(installed, "", "", "") == rbac.CSI_PLUGIN_RULES
    ok = publish_as(cluster, config, tmp_path / "granted", rel.cache_namespace, name,
                    rel.cache_namespace)
    assert not isinstance(ok, grpc.RpcError), ok.details()
    refused = publish_as(cluster, config, tmp_path / "other-ns", rel.cache_namespace, name,
                         "elsewhere")
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
    minus = f"{account}-minus"
    objects = [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": minus, "namespace": rel.namespace}},
    ]
    apply(cluster, *objects)
    try:
        config = token_kubeconfig(cluster, tmp_path / "minus.kubeconfig", rel.namespace, minus)
        error = publish_as(cluster, config, tmp_path / "minus", rel.cache_namespace, name,
                           rel.cache_namespace)
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert forbidden("get", "weightcaches", "weightcache.dev") in error.details()
    finally:
        cluster.kubectl("delete", "serviceaccount", "-n", rel.namespace, minus, "--wait=false")
        cluster.kubectl("delete", "wc", "-n", rel.cache_namespace, name, "--wait=false")


def test_the_webhooks_one_grant_is_used(
    cluster: Cluster, release: Release, tmp_path: Path
) -> None:
    """The webhook's account holds `list weightcaches` and nothing else: with it, a labelled
    pod naming a cache is injected; with an account without it, the pod is refused (503)
    naming the refusal. Its ServiceAccount is not the operator's."""
    rel = release
    assert rel.webhook is not None and rel.webhook_account != rel.operator_account
    installed = get(cluster, "clusterrole", rel.webhook_account)["rules"]
    assert without(installed, "", "", "") == rbac.WEBHOOK_RULES
    name = f"hook-{uuid.uuid4().hex[:6]}"
    apply(cluster, weightcache(rel.cache_namespace, name, cluster.node_names[0]))
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "e", "namespace": rel.cache_namespace,
                        "labels": {names.CACHE_LABEL: name}},
           "spec": {"containers": [{"name": "engine", "image": "engine:1"}]}}
    try:
        assert rel.webhook.review(pod)["patchType"] == "JSONPatch"
        minus = f"{rel.webhook_account}-minus"
        apply(cluster, {"apiVersion": "v1", "kind": "ServiceAccount",
                        "metadata": {"name": minus, "namespace": rel.namespace}})
        config = token_kubeconfig(cluster, tmp_path / "minus.kubeconfig", rel.namespace, minus)
        bare = ChartWebhook(cluster, rel, config, tmp_path / "minus.log",
                            pki.KeyPair(rel.webhook.cert, rel.webhook.key))
        bare.ca = rel.webhook.ca
        bare.start()
        try:
            answer = bare.review(pod)
        finally:
            bare.stop()
            cluster.kubectl("delete", "serviceaccount", "-n", rel.namespace, minus,
                            "--wait=false")
        assert not answer["allowed"] and answer["status"]["code"] == 503
        assert "403" in answer["status"]["message"], answer
    finally:
        cluster.kubectl("delete", "wc", "-n", rel.cache_namespace, name, "--wait=false")


# --------------------------------------------------------------------------- the daemon's rights


def test_daemon_token_may_write_only_its_own_report(
    cluster: Cluster, release: Release, api: Api, tmp_path: Path
) -> None:
    """RBAC (patch pods) and the report guard together: report annotations of one pod, in the
    daemon namespace (the chart's), where the daemon account lives."""
    rel, ns = release, release.namespace
    for name in ("guard-a", "guard-b"):
        apply(cluster, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": {"app": "guard"}},
            "spec": {"serviceAccountName": rel.daemon_account,
                     "nodeSelector": {"kubernetes.io/hostname": cluster.node_names[0]},
                     "containers": [{"name": f"daemon-{i}", "image": "sidecar:1"}
                                    for i in range(2)]},
        })
    own = api.core.read_namespaced_pod("guard-a", ns)
    bound = token_kubeconfig(cluster, tmp_path / "bound.kubeconfig", ns, rel.daemon_account,
                             bound_pod=own)
    unbound = token_kubeconfig(cluster, tmp_path / "unbound.kubeconfig", ns, rel.daemon_account)
    as_bound = k8s.CoreV1Api(k8s_config.new_client_from_config(config_file=str(bound)))
    as_unbound = k8s.CoreV1Api(k8s_config.new_client_from_config(config_file=str(unbound)))
    report = {REPORT_GPU0: '{"v": 1}'}

    def annotate(client: k8s.CoreV1Api, pod: str, annotations: dict[str, str]) -> None:
        client.patch_namespaced_pod(pod, ns, {"metadata": {"annotations": annotations}},
                                    _content_type="application/merge-patch+json")

    annotate(as_bound, "guard-a", report)
    annotate(as_bound, "guard-a", {annotation_key("GPU-1"): "{}"})  # another container's

    refused = {
        "another annotation": lambda: annotate(as_bound, "guard-a", {"x.example/y": "1"}),
        "the old single report key": lambda: annotate(
            as_bound, "guard-a", {"weightcache.dev/report": "{}"}),
        "a label": lambda: as_bound.patch_namespaced_pod(
            "guard-a", ns, {"metadata": {"labels": {"app": "engine"}}}),
        "the image": lambda: as_bound.patch_namespaced_pod(
            "guard-a", ns, {"spec": {"containers": [{"name": "daemon-0", "image": "evil:1"}]}}),
        "a finalizer": lambda: as_bound.patch_namespaced_pod(
            "guard-a", ns, {"metadata": {"finalizers": ["x.example/hold"]}},
            _content_type="application/merge-patch+json"),
        "another pod": lambda: annotate(as_bound, "guard-b", report),
        "an unbound token": lambda: annotate(as_unbound, "guard-a", report),
        "an oversized report": lambda: annotate(as_bound, "guard-a", {REPORT_GPU0: "x" * 5000}),
        # Issue 25 item 13: one report per daemon container (two here), not 70.
        "a third report": lambda: annotate(as_bound, "guard-a", {annotation_key("GPU-2"): "{}"}),
        "pod status": lambda: as_bound.patch_namespaced_pod_status("guard-a", ns, {
            "status": {"conditions": [{"type": GATE, "status": "True"}]}}),
        "read its own pod": lambda: as_bound.read_namespaced_pod("guard-a", ns),
        "read another pod": lambda: as_bound.read_namespaced_pod("guard-b", ns),
        "list": lambda: as_bound.list_namespaced_pod(ns),
        "delete": lambda: as_bound.delete_namespaced_pod("guard-b", ns),
        "create": lambda: as_bound.create_namespaced_pod(ns, {
            "metadata": {"name": "x"}, "spec": {"containers": [{"name": "x", "image": "x"}]}}),
        "another namespace": lambda: as_bound.patch_namespaced_pod(
            "guard-a", rel.cache_namespace, {"metadata": {"annotations": report}}),
    }
    for what, attempt in refused.items():
        with pytest.raises(ApiException) as err:
            attempt()
        assert err.value.status == 403, (what, err.value.status, err.value.body)
    after = get(cluster, "pod", "-n", ns, "guard-a")
    assert after["metadata"]["labels"] == {"app": "guard"}
    assert set(after["metadata"]["annotations"]) == {REPORT_GPU0, annotation_key("GPU-1")}
    assert after["spec"]["containers"][0]["image"] == "sidecar:1"
    cluster.kubectl("delete", "pod", "-n", ns, "guard-a", "guard-b", "--wait=false")


def test_cache_policy_refuses_what_the_cluster_does_not_allow(
    cluster: Cluster, release: Release
) -> None:
    """Admission names the field; the same values bound the operator (test_operator_e2e)."""
    node = cluster.node_names[0]
    refusals = [
        ({"device": "cuda", "transport": "torch_ipc"},
         "spec.transport: torch_ipc is not allowed in this cluster"),
        # A symlink planted in another cache's directory would lead anywhere.
        ({"socketDir": "/var/run/weightcache/other.cache"},
         "spec.socketDir: /var/run/weightcache/other.cache is not a socket directory"),
        ({"socketDir": "/etc"}, "spec.socketDir: /etc is not a socket directory"),
        ({"model": {"path": "/etc"}}, "spec.model.path: /etc is not under a model directory"),
        ({"model": {"path": "/modelsevil/m"}}, "spec.model.path: /modelsevil/m is not under"),
        # A prefix is matched at a registry boundary, not as a plain string prefix.
        ({"sidecar": {"image": "registry.corp.example.evil.io/x:1"}},
         "spec.sidecar.image: registry.corp.example.evil.io/x:1 is not allowed"),
        ({"sidecar": {"image": "ghcr.io/weightcache-evil/sidecar:1"}},
         "spec.sidecar.image: ghcr.io/weightcache-evil/sidecar:1 is not allowed"),
        # Issue 25 item 13: the allowed host on another port is another registry; the
        # operator's uid is no daemon's.
        ({"sidecar": {"image": "registry.corp.example:5000/team/x:1"}},
         "spec.sidecar.image: registry.corp.example:5000/team/x:1 is not allowed"),
        ({"sidecar": {"image": "registry.corp.example/x:1", "runAsUser": 65532}},
         "spec.sidecar.runAsUser: 65532 is the operator's own uid"),
        # Issue 25 item 3: preempting, tolerating every taint, crowding other tenants out.
        ({"placement": {"priorityClassName": "system-node-critical"}},
         "spec.placement.priorityClassName: system-node-critical is not allowed"),
        ({"placement": {"tolerations": [{"operator": "Exists"}]}},
         "spec.placement.tolerations: a toleration this cluster does not allow"),
        ({"sidecar": {"resources": {"requests": {"cpu": "16"}}}},
         "spec.sidecar.resources.requests: each must be one of cpu, memory"),
        ({"sidecar": {"resources": {"limits": {"nvidia.com/gpu": 8}}}},
         "spec.sidecar.resources.limits: each must be one of cpu, memory"),
    ]
    for change, message in refusals:
        cache = weightcache(release.cache_namespace, "policy", node)
        cache["spec"].update(change)
        result = cluster.kubectl("apply", "--dry-run=server", "-f", "-",
                                 input=json.dumps(cache), check=False)
        assert result.returncode != 0, f"{change} admitted"
        assert message in result.stderr, (change, result.stderr)
    # Issue 34 item 4: one refusal names every violation, not the first alone.
    cache = weightcache(release.cache_namespace, "policy", node)
    cache["spec"].update({
        "socketDir": "/etc", "model": {"path": "/etc"},
        "sidecar": {"image": "registry.corp.example.evil.io/x:1", "runAsUser": 65532,
                    "resources": {"requests": {"cpu": "16"}, "limits": {"nvidia.com/gpu": 8}}},
        "placement": {"priorityClassName": "system-node-critical",
                      "tolerations": [{"operator": "Exists"}]}})
    result = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(cache),
                             check=False)
    named = [f for f in ("spec.socketDir", "spec.model.path", "spec.sidecar.image",
                         "spec.sidecar.runAsUser", "spec.placement.priorityClassName",
                         "spec.placement.tolerations", "spec.sidecar.resources.requests",
                         "spec.sidecar.resources.limits") if f + ":" in result.stderr]
    assert len(named) == 8, result.stderr
    for change in ({"transport": "auto"}, {"model": {"path": "/models/llama"}},
                   {"sidecar": {"image": "registry.corp.example/x:1"}},
                   {"sidecar": {"image": "registry.corp.example/team/x@sha256:" + "a" * 64}},
                   {"sidecar": {"resources": {"requests": {"cpu": "8", "memory": "64Gi"}}}},
                   {"placement": {"tolerations": [{"key": "nvidia.com/gpu",
                                                   "operator": "Exists", "effect": "NoSchedule"}]}},
                   {"device": "cuda", "transport": "vmm_fd",
                    "gpuAccess": {"mode": "device-plugin"}},
                   # Images are restricted here: visible-devices for any image under them.
                   {"device": "cuda", "transport": "vmm_fd",
                    "sidecar": {"image": "registry.corp.example/x:1"}},
                   {"socketDir": "/var/run/weightcache/"}):
        cache = weightcache(release.cache_namespace, "policy", node)
        cache["spec"].update(change)
        admitted = cluster.kubectl("apply", "--dry-run=server", "-f", "-",
                                   input=json.dumps(cache), check=False)
        assert admitted.returncode == 0, (change, admitted.stderr)


def tightened_cache_policy(cluster: Cluster, namespace: str, *values: str,
                           namespaces: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The chart's cache policy rendered with other values, bound to one namespace (or
    `namespaces`) only (other tests' caches share this control plane)."""
    rendered = helm(cluster, "template", "tight", str(CHART), "-n", namespace,
                    "--show-only", "templates/cache-policy.yaml", *values)
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    for doc in docs:
        if doc["kind"] == "ValidatingAdmissionPolicyBinding":
            doc["spec"]["matchResources"] = {"namespaceSelector": {"matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "In",
                 "values": list(namespaces or (namespace,))}]}}
    return docs


EXAMPLES = sorted((REPO_ROOT / "crds" / "examples").glob("*.yaml"))


def test_the_default_chart_admits_every_example_and_a_gpu_cache_naming_only_its_model(
    cluster: Cluster, release: Release
) -> None:
    """Issue 34 item 4: under the chart's defaults a GPU cache with only spec.model was
    refused for a gpuAccess.mode the user never wrote (the CRD's default), and so was the
    shipped GPU example (that mode, and a claim the default policy does not list). Each
    example is applied as it is, in its own namespace, against the default chart's policy
    (the same policy the operator gets: tests/unit/chart checks it renders them); the CPU
    one also runs Ready on the real node (tests/k8s/realstack.py applies it, its paths and
    placement adapted)."""
    docs = [yaml.safe_load(path.read_text()) for path in EXAMPLES]
    assert len(docs) >= 2
    example_namespaces = sorted({d["metadata"]["namespace"] for d in docs})
    scratch = f"wc-defaults-{uuid.uuid4().hex[:6]}"
    created = [ns for ns in (*example_namespaces, scratch)
               if try_get(cluster, "namespace", ns) is None]
    for ns in created:
        kubectl(cluster, "create", "namespace", ns)
    policy = tightened_cache_policy(cluster, scratch,
                                    namespaces=(*example_namespaces, scratch))
    apply(cluster, *policy)
    try:
        minimal = {"apiVersion": f"{names.GROUP}/{names.VERSION}", "kind": "WeightCache",
                   "metadata": {"name": "newcomer", "namespace": scratch},
                   "spec": {"model": {"path": "/models/llama"}}}

        def admitted(doc: dict[str, Any]) -> subprocess.CompletedProcess[str]:
            return cluster.kubectl("apply", "--dry-run=server", "-f", "-",
                                   input=json.dumps(doc), check=False)

        # visible-devices is for the chart's own image while images are not restricted (an
        # image the release's own policy, bound everywhere, allows). The binding takes a
        # moment to reach the API server's admission, and the release's policy refuses
        # most of what this one does (once the wait was on a socketDir both refuse, and
        # this refusal was not in force yet): wait for what only the default one refuses.
        other_image = {**minimal, "spec": {**minimal["spec"],
                                           "sidecar": {"image": "registry.corp.example/x:1"}}}
        eventually("the default policy in force", lambda: "only the chart's own sidecar "
                   "image" in admitted(other_image).stderr)
        for path, doc in zip(EXAMPLES, docs, strict=True):
            result = admitted(doc)
            assert result.returncode == 0, (path.name, result.stderr)
        result = admitted(minimal)
        assert result.returncode == 0, result.stderr
        device_plugin = {**other_image, "spec": {**other_image["spec"],
                                                 "gpuAccess": {"mode": "device-plugin"}}}
        assert admitted(device_plugin).returncode == 0
    finally:
        for doc in policy:
            cluster.kubectl("delete", doc["kind"].lower(), doc["metadata"]["name"],
                            "--ignore-not-found", check=False)
        for ns in created:
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_a_cache_the_policy_no_longer_allows_can_still_be_deleted(
    cluster: Cluster, release: Release, api: Api, tmp_path: Path
) -> None:
    """The admin tightens the policy after a cache was admitted: its spec may no longer change
    (but to something allowed), yet the operator's finalizer, kopf's annotations and a
    label are metadata, never refused; else the cache could never be deleted."""
    rel = release
    config = token_kubeconfig(cluster, tmp_path / "operator.kubeconfig", rel.namespace,
                              rel.operator_account)
    operator = ChartOperator(cluster, rel, config, tmp_path / "operator.log")
    flow = Flow(cluster, rel, api, cluster.node_names[0], tmp_path)
    ns, name = flow.ns, flow.name
    tight = tightened_cache_policy(cluster, ns,
                                   "--set", "cachePolicy.allowedHostPaths.modelDirs={/models}")
    operator.start()
    try:
        flow.apply_cache()
        eventually("the operator's finalizer is on the cache", lambda: names.FINALIZER in (
            api.cache(ns, name) or {}).get("metadata", {}).get("finalizers", []))
        eventually("the DaemonSet exists", lambda: api.daemonset(ns, name))
        apply(cluster, *tight)

        def spec_edit_refused() -> str | None:
            edit = {"spec": {"model": {"revision": uuid.uuid4().hex}}}
            result = cluster.kubectl("patch", "wc", "-n", ns, name, "--type=merge", "-p",
                                     json.dumps(edit), check=False)
            return result.stderr if result.returncode != 0 else None

        refused = eventually("the tightened policy refuses a spec edit", spec_edit_refused)
        assert "spec.model.path" in refused and "is not under a model directory" in refused
        kubectl(cluster, "label", "wc", "-n", ns, name, "team=search")
        kubectl(cluster, "delete", "wc", "-n", ns, name, "--wait=false")
        eventually("the operator removed its finalizer and the cache is gone",
                   lambda: api.cache(ns, name) is None)
        assert api.daemonset(ns, name) is None
        assert "is not under a model directory" not in operator.log()
    finally:
        operator.stop()
        for doc in tight:
            cluster.kubectl("delete", doc["kind"].lower(), doc["metadata"]["name"],
                            "--ignore-not-found", check=False)
        flow.force_cleanup()


def refusal(attempt: Any) -> str:
    """The API server's message refusing `attempt` (which must be refused)."""
    with pytest.raises(ApiException) as refused:
        attempt()
    assert refused.value.status in (403, 422), refused.value.body
    return str(json.loads(refused.value.body)["message"])


def test_only_the_daemonset_controller_makes_daemon_pods(
    cluster: Cluster, release: Release, api: Api, tmp_path: Path
) -> None:
    """Issue 25 item 2: a pod created with the daemon's labels and no owner reference was
    adopted by the cache's DaemonSet, ran its creator's image with a report set at creation,
    and opened the gate. Only the DaemonSet controller makes such pods now; nobody labels a
    pod into them, and only the daemon writes a report."""
    ns, node = release.namespace, cluster.node_names[0]
    labels = render.selector_labels(release.cache_namespace, "ghost")
    report = {REPORT_GPU0: '{"v": 1}'}

    def pod(name: str, pod_labels: dict[str, str], annotations: dict[str, str]) -> dict:
        return {"metadata": {"name": name, "labels": pod_labels, "annotations": annotations},
                "spec": {"nodeName": node, "serviceAccountName": release.daemon_account,
                         "containers": [{"name": "daemon", "image": "evil:1"}]}}

    create = api.core.create_namespaced_pod
    # Not even the cluster admin makes one, with a report or without.
    for extra in ({}, report):
        message = refusal(lambda a=extra: create(ns, pod("ghost", labels, a)))
        assert "only the DaemonSet controller may create a pod with the weightcache daemon " \
               "labels" in message, message
    # A plain pod cannot be labelled into a cache's DaemonSet afterwards.
    create(ns, pod("plain", {"app": "plain"}, {}))
    message = refusal(lambda: api.core.patch_namespaced_pod(
        "plain", ns, {"metadata": {"labels": labels}}))
    assert "the labels of a weightcache daemon pod" in message, message
    # The DaemonSet controller's own pods pass; a report on one comes from its daemon only.
    daemonset = {
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "ghost", "namespace": ns, "labels": labels},
        "spec": {"selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": labels},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                     "serviceAccountName": release.daemon_account,
                     "containers": [{"name": "daemon", "image": "sidecar:1"}]}}},
    }
    api.apps.create_namespaced_daemon_set(ns, daemonset)
    try:
        made = eventually("the DaemonSet controller makes its pod", lambda: next(iter(
            api.core.list_namespaced_pod(ns, label_selector=",".join(
                f"{k}={v}" for k, v in labels.items())).items), None))
        name = made.metadata.name
        message = refusal(lambda: api.core.patch_namespaced_pod(
            name, ns, {"metadata": {"annotations": report}}))
        assert "only the weightcache daemon writes weightcache.dev/report" in message, message
        bound = token_kubeconfig(cluster, tmp_path / "daemon.kubeconfig", ns,
                                 release.daemon_account, bound_pod=made)
        as_daemon = k8s.CoreV1Api(k8s_config.new_client_from_config(config_file=str(bound)))
        as_daemon.patch_namespaced_pod(name, ns, {"metadata": {"annotations": report}},
                                       _content_type="application/merge-patch+json")
    finally:
        cluster.kubectl("delete", "daemonset", "-n", ns, "ghost", "--wait=false")
        cluster.kubectl("delete", "pod", "-n", ns, "plain", "--wait=false")


def test_a_stolen_operator_token_writes_only_what_the_operator_does(
    cluster: Cluster, release: Release, api: Api, tmp_path: Path
) -> None:
    """Issue 25 item 5: with the operator's token, a privileged DaemonSet under another
    ServiceAccount passed a dry-run create, and any node label, taint or pod status could be
    changed. Each is refused now; what the operator itself does still passes."""
    ns, node = release.namespace, cluster.node_names[0]
    config = token_kubeconfig(cluster, tmp_path / "operator.kubeconfig", ns,
                              release.operator_account)
    as_operator = k8s_config.new_client_from_config(config_file=str(config))
    apps, core = k8s.AppsV1Api(as_operator), k8s.CoreV1Api(as_operator)

    # DaemonSets: one rendered as the operator renders it passes, each privilege refused.
    (container,) = get(cluster, "deployment", "-n", ns, release.fullname)[
        "spec"]["template"]["spec"]["containers"]
    policy = policy_from_env({e["name"]: e["value"] for e in container["env"] if "value" in e})
    spec = parse_spec(weightcache(release.cache_namespace, "stolen", node)["spec"])
    rendered = render.render_daemonset(render.CacheRef(release.cache_namespace, "stolen", "u", 1),
                                       spec, spec_hash(spec), policy, operator_uid=65532)

    def create(change: Any = None) -> None:
        manifest = json.loads(json.dumps(rendered))
        if change is not None:
            change(manifest["spec"]["template"]["spec"])
        apps.create_namespaced_daemon_set(ns, manifest, dry_run="All")

    create()
    edits = {
        "runs under weightcache-daemon only":
            lambda p: p.update(serviceAccountName="default"),
        "uses no host network, PID or IPC namespace": lambda p: p.update(hostPID=True),
        "unprivileged, without privilege escalation": lambda p: p["containers"][0][
            "securityContext"].update(privileged=True, allowPrivilegeEscalation=True),
        "runs as a non-root uid": lambda p: p["securityContext"].update(runAsUser=0),
        "mounts only the allowed socket and model host paths": lambda p: p["volumes"].append(
            {"name": "root", "hostPath": {"path": "/"}}),
        "runs the operator's own image": lambda p: p["initContainers"][0].update(image="evil:1"),
        "runs the chart's sidecar image or one under the allowed prefixes":
            lambda p: p["containers"][0].update(image="evil.example/x:1"),
    }
    for wanted, edit in edits.items():
        message = refusal(lambda e=edit: create(e))
        assert wanted in message, (wanted, message)

    # Nodes: its own labels only.
    label = "weightcache.dev/stolen.label"
    core.patch_node(node, {"metadata": {"labels": {label: "Ready"}}})
    core.patch_node(node, {"metadata": {"labels": {label: None}}})
    for patch in ({"metadata": {"labels": {"node-role.kubernetes.io/control-plane": ""}}},
                  {"metadata": {"annotations": {"x.example/y": "1"}}},
                  {"spec": {"taints": [{"key": "x", "effect": "NoSchedule"}]}},
                  {"spec": {"unschedulable": True}}):
        message = refusal(lambda p=patch: core.patch_node(node, p))
        assert "may change no node label but weightcache.dev/*" in message, message

    # pods/status: the weights-resident condition only.
    cache_ns = release.cache_namespace
    api.core.create_namespaced_pod(cache_ns, {
        "metadata": {"name": "tenant"},
        "spec": {"nodeName": node, "containers": [{"name": "app", "image": "app:1"}]}})
    try:
        eventually("kwok runs the pod", lambda: is_ready(
            api.core.read_namespaced_pod("tenant", cache_ns)))
        gate = {"type": GATE, "status": "False", "reason": "X", "message": "m"}
        core.patch_namespaced_pod_status("tenant", cache_ns,
                                         {"status": {"conditions": [gate]}})
        json_patch = "application/json-patch+json"
        redirect = [{"op": "replace", "path": "/status/podIP", "value": "10.0.0.66"},
                    {"op": "replace", "path": "/status/podIPs", "value": [{"ip": "10.0.0.66"}]}]
        for body, kind in (
            ({"status": {"conditions": [{"type": "Ready", "status": "False"}]}}, None),
            ({"status": {"conditions": [{"type": "Forged", "status": "True"}]}}, None),
            ({"status": {"phase": "Failed"}}, None),
            (redirect, json_patch),  # a Service's traffic to another address
        ):
            message = refusal(lambda b=body, k=kind: core.patch_namespaced_pod_status(
                "tenant", cache_ns, b, **({"_content_type": k} if k else {})))
            assert "may change no pod status but its weightcache.dev/weights-resident" \
                   in message, message
    finally:
        cluster.kubectl("delete", "pod", "-n", cache_ns, "tenant", "--wait=false")


def test_a_cache_cannot_pick_its_daemons_service_account(
    cluster: Cluster, release: Release, api: Api
) -> None:
    """The field is gone from the CRD: strict field validation refuses it by name."""
    cache = weightcache(release.cache_namespace, "sa", cluster.node_names[0])
    cache["spec"]["sidecar"]["serviceAccountName"] = "cluster-admin-token-holder"
    result = cluster.kubectl("apply", "--validate=strict", "-f", "-", input=json.dumps(cache),
                             check=False)
    assert result.returncode != 0
    assert 'unknown field "spec.sidecar.serviceAccountName"' in result.stderr, result.stderr


# --------------------------------------------------------------------------- uninstall (last)


def test_uninstall_leaves_no_operator_objects(cluster: Cluster, release: Release) -> None:
    rel = release
    assert get(cluster, "wc", "-n", rel.cache_namespace)["items"] == []
    helm(cluster, "uninstall", rel.name, "-n", rel.namespace, "--wait")
    kinds = kubectl(cluster, "api-resources", "--verbs=list", "-o", "name").split()
    kinds = [k for k in kinds if k not in ("events", "events.events.k8s.io")]
    left = kubectl(cluster, "get", ",".join(kinds), "--all-namespaces", "-o", "name",
                   "-l", f"app.kubernetes.io/instance={rel.name}").split()
    assert left == []
    for namespace in (rel.cache_namespace, rel.namespace):
        assert kubectl(cluster, "get", "daemonsets,serviceaccounts,roles,rolebindings", "-n",
                       namespace, "-o", "name",
                       "-l", "app.kubernetes.io/part-of=weightcache").split() == []
    names = [rel.fullname, f"{rel.fullname}-daemon-report-guard", rel.webhook_account]
    for kind in ("clusterrole", "clusterrolebinding", "validatingadmissionpolicy",
                 "validatingadmissionpolicybinding"):
        for name in names:
            assert try_get(cluster, kind, name) is None, f"{kind}/{name} left behind"
    for node in cluster.node_names:
        labels = get(cluster, "node", node)["metadata"]["labels"]
        assert not [k for k in labels if k.startswith("weightcache.dev/")], labels
    # Helm never deletes a chart's crds/ (that would delete every user's caches).
    assert try_get(cluster, "crd", "weightcaches.weightcache.dev") is not None
