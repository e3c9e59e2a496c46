"""Operator memory per watched pod: the operator's resident memory as pods are added.

    python -m benchmarks.operator_memory --steps 2000,4000,8000 --out results/operator-memory.json

A control plane of its own (tools/testenv, one kwok node), the operator as its
own process under OPERATOR_RULES, one WeightCache whose selector matches the
engine pods, no daemon (every gate judged closed). Two series, one after the
other:

- unrelated: pods of another workload (no gate, no label of ours), bound to
  the kwok node: the operator's watch never sees them; its memory must not
  move;
- engine: gated pods labelled `weightcache.dev/gated`, as the webhook admits
  them, the cache's selector matching, each with a Deployment's labels and
  one binding: after each step, once the operator has written every pod's
  gate, its resident memory (VmRSS, after a settle) is recorded.

The figure is the slope of resident memory over engine pods (least squares):
everything the operator holds per pod (its view, the index, the gate it last
wrote, allocator overhead), as the process pays for it.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks import apimetrics
from benchmarks.fleet import RawApi
from tests.k8s.operator_flow import (
    OperatorProcess,
    apply,
    install_crd,
    install_operator_account,
    operator_policy,
    weightcache,
)
from tools.testenv import assets
from tools.testenv.cluster import Cluster, interrupt_on_termination
from weightcache_operator import names

NAMESPACE = "engines"
OTHERS = "others"
HOME = "wc-system"
CACHE = "llama"
SETTLE_SECONDS = 10.0


def say(message: str) -> None:
    print(f"[operator-memory] {message}", flush=True)


def engine_pod(i: int, node: str) -> dict[str, Any]:
    """A gated engine pod as a Deployment and the webhook make it (~1.5 KB of metadata)."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": f"vllm-llama-7d9f8c6b5-{i:06d}",
            "labels": {"app": f"{CACHE}-engine", "pod-template-hash": "7d9f8c6b5",
                       "app.kubernetes.io/name": "vllm", "app.kubernetes.io/instance": "prod",
                       "app.kubernetes.io/managed-by": "Helm", "helm.sh/chart": "vllm-1.2.3",
                       names.GATED_LABEL: names.GATED_VALUE},
            "annotations": {names.binding_key(NAMESPACE, CACHE): "a" * 64,
                            "kubectl.kubernetes.io/restartedAt": "2026-01-01T00:00:00Z"},
        },
        "spec": {"nodeName": node, "terminationGracePeriodSeconds": 0,
                 "readinessGates": [{"conditionType": names.GATE_CONDITION}],
                 "containers": [{"name": "vllm", "image": "registry.example/vllm:0.33.0",
                                 "args": ["--model", "/models/llama"]}]},
    }


def unrelated_pod(i: int, node: str) -> dict[str, Any]:
    pod = engine_pod(i, node)
    pod["metadata"]["name"] = f"web-{i:06d}"
    pod["metadata"]["labels"] = {"app": "web", "team": f"team-{i % 40}"}
    pod["metadata"]["annotations"] = {"prometheus.io/scrape": "true"}
    del pod["spec"]["readinessGates"]
    return pod


def slope(points: list[tuple[int, int]]) -> float | None:
    """Least-squares bytes per pod."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else None


class Run:
    def __init__(self, work: Path) -> None:
        self.cluster = Cluster(work / "testenv", assets.ensure_binaries(), node_count=1)
        self.work = work
        self.operator: OperatorProcess | None = None

    def __enter__(self) -> Run:
        self.cluster.start(timeout=240)
        self.api = RawApi(self.cluster, maxsize=16)
        self.node = self.cluster.node_names[0]
        install_crd(self.cluster)
        for ns in (NAMESPACE, OTHERS, HOME):
            self.cluster.kubectl("create", "namespace", ns)
        config = install_operator_account(self.cluster, HOME, "weightcache-operator")
        self.operator = OperatorProcess(config, self.work / "operator.log", operator_policy(HOME))
        apply(self.cluster, weightcache(NAMESPACE, CACHE, self.node))
        self.operator.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.operator is not None:
            self.operator.stop()
        self.cluster.stop()

    def rss(self) -> int:
        assert self.operator is not None and self.operator.proc is not None
        return apimetrics.rss_bytes(self.operator.proc.pid) or 0

    def create(self, namespace: str, make: Any, start: int, stop: int) -> None:
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda i: self.api.request(
                "POST", f"/api/v1/namespaces/{namespace}/pods", make(i, self.node)),
                range(start, stop)))

    def judged(self) -> int:
        """Engine pods whose gate the operator has written."""
        pods = self.api.get(f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]
        return sum(1 for p in pods if any(c.get("type") == names.GATE_CONDITION
                                          for c in (p.get("status") or {}).get("conditions")
                                          or []))

    def series(self, kind: str, steps: list[int]) -> list[dict[str, Any]]:
        out, done = [], 0
        say(f"{kind}: settling")
        time.sleep(SETTLE_SECONDS)
        out.append({"pods": 0, "rss_mib": round(self.rss() / 2**20, 2)})
        for target in steps:
            started = time.monotonic()
            if kind == "engine":
                self.create(NAMESPACE, engine_pod, done, target)
                deadline = time.monotonic() + 600
                while self.judged() < target and time.monotonic() < deadline:
                    time.sleep(2.0)
            else:
                self.create(OTHERS, unrelated_pod, done, target)
            time.sleep(SETTLE_SECONDS)
            done = target
            out.append({"pods": target, "rss_mib": round(self.rss() / 2**20, 2),
                        "seconds": round(time.monotonic() - started, 1)})
            say(json.dumps({kind: out[-1]}))
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default="2000,4000,8000")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/weightcache-operator-memory"))
    args = parser.parse_args()
    steps = [int(s) for s in args.steps.split(",") if s.strip()]
    interrupt_on_termination()
    args.work.mkdir(parents=True, exist_ok=True)
    with Run(args.work) as run:
        unrelated = run.series("unrelated", steps)
        engines = run.series("engine", steps)
    # The engine series starts where the unrelated one ended: its own baseline.
    points = [(s["pods"], int(s["rss_mib"] * 2**20)) for s in engines]
    result = {
        "unrelated_pods": unrelated,
        "engine_pods": engines,
        "unrelated_growth_mib": round(unrelated[-1]["rss_mib"] - unrelated[0]["rss_mib"], 2),
        "bytes_per_engine_pod": round(slope(points) or 0.0),
        "loadavg_end": apimetrics.loadavg(),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    say(json.dumps({k: result[k] for k in ("unrelated_growth_mib", "bytes_per_engine_pod")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
