"""What the operator keeps of an engine pod, within podlimits.LIMITS (pure), and what it costs.

Issue 43: a tenant's 340 gated pods of ~1.1 MB of labels and annotations each
took the operator from 94 MB to its 512 MiB limit (the views kept them whole).
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

from weightcache_operator import names, podlimits, views

LIMITS = podlimits.LIMITS
ROOT = Path(__file__).resolve().parents[3]


def engine_pod(i: int, labels: dict[str, str] | None = None,
               annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A gated engine pod as a Deployment makes it, with the webhook's additions."""
    base = {"app": "vllm-llama", "pod-template-hash": "7d9f8c6b5",
            "app.kubernetes.io/name": "vllm", "app.kubernetes.io/instance": "llama-prod",
            "app.kubernetes.io/managed-by": "Helm", "helm.sh/chart": "vllm-1.2.3",
            names.CACHE_LABEL: "llama", names.GATED_LABEL: names.GATED_VALUE}
    notes = {names.binding_key("serving", "llama"): "a" * 64,
             "kubectl.kubernetes.io/restartedAt": "2026-01-01T00:00:00Z"}
    return {
        "metadata": {"name": f"vllm-llama-7d9f8c6b5-{i:05d}", "namespace": "serving",
                     "uid": f"6f1c2b3a-0000-4000-8000-{i:012d}",
                     "resourceVersion": str(100000 + i),
                     "labels": base if labels is None else labels,
                     "annotations": notes if annotations is None else annotations},
        "spec": {"nodeName": f"gpu-node-{i % 500:04d}",
                 "readinessGates": [{"conditionType": names.GATE_CONDITION}]},
        "status": {"phase": "Running", "conditions": [{
            "type": names.GATE_CONDITION, "status": "True", "reason": "WeightsResident",
            "message": f"on gpu-node-{i % 500:04d}: WeightCache llama: daemon pod "
                       f"weightcache-serving.llama-x{i % 500}: 8 device(s) hold "
                       "16060522496 bytes via vmm_fd"}]},
    }


def attack_pod(i: int) -> dict[str, Any]:
    """Issue 43's pod: 2,700 labels (~900 KB) and ~200 KB of binding-like annotations."""
    labels = {f"tenant.example/k{j:04d}-{'x' * 250}": "v" * 63 for j in range(2700)}
    annotations = {f"{names.BINDING_PREFIX}x{j}": "y" * 1000 for j in range(200)}
    return engine_pod(i, labels, annotations)


def test_a_pod_within_the_limits_keeps_what_decisions_read_and_nothing_else() -> None:
    body = engine_pod(1)
    view = views.engine_pod_view(body)
    assert view.labels == body["metadata"]["labels"]
    assert view.bindings == {names.binding_key("serving", "llama"): "a" * 64}
    assert (view.cache, view.cache_namespace, view.over_limits) == ("llama", "serving", "")
    # Values no decision can match are kept cut: still matching nothing.
    body["metadata"]["annotations"] = {names.binding_key("serving", "llama"): "b" * 5000,
                                       names.CACHE_NAMESPACE_LABEL: "n" * 5000}
    view = views.engine_pod_view(body)
    assert view.bindings[names.binding_key("serving", "llama")] == "b" * 65
    assert view.cache_namespace == "n" * 65
    body["status"]["conditions"][0]["message"] = "m" * 100_000
    assert len(views.engine_pod_view(body).gate.message) == podlimits.MAX_MESSAGE_CHARS


def test_a_pod_past_a_limit_keeps_only_why() -> None:
    for body, limit in (
        (engine_pod(1, {f"k{j}": "v" for j in range(LIMITS.labels + 1)}),
         f"over the limit of {LIMITS.labels} labels"),
        (engine_pod(1, {f"{'d' * 200}{j}.io/{'n' * 63}": "v" * 63 for j in range(60)}),
         f"over the limit of {LIMITS.label_bytes} bytes of labels"),
        (engine_pod(1, None, {f"{names.BINDING_PREFIX}x{j}": "a" * 64
                              for j in range(LIMITS.bindings + 1)}),
         f"over the limit of {LIMITS.bindings}"),
        (attack_pod(1), f"over the limit of {LIMITS.labels} labels"),
    ):
        view = views.engine_pod_view(body)
        assert limit in view.over_limits
        assert (view.labels, view.bindings, view.cache) == ({}, {}, "")
        assert view.uid and view.node and view.gate is not None
    # At each limit exactly: kept.
    at = {f"k{j}": "v" for j in range(LIMITS.labels)}
    assert views.engine_pod_view(engine_pod(1, at)).labels == at
    assert podlimits.violation(at, {f"{names.BINDING_PREFIX}{j}": "" for j in range(
        LIMITS.bindings)}) is None


def heavy(i: int) -> dict[str, str]:
    """64 labels of 16 KiB, none shared with another pod's."""
    return {f"{'d' * 170}{i:04d}{j:02d}.io/{'n' * 40}": "v" * 10 for j in range(LIMITS.labels)}


PODS = {"typical": lambda i: engine_pod(i), "at_limits": lambda i: engine_pod(i, heavy(i)),
        "attack": attack_pod}


def bytes_per_view(kind: str, count: int) -> float:
    """What keeping one view per pod of `kind` costs, measured by tracemalloc: each body is
    read from its JSON and dropped once viewed, as the watch does (the JSON is not counted).
    The interned strings' table grows with the views and is counted."""
    encoded = [json.dumps(PODS[kind](i)).encode() for i in range(count)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = [views.engine_pod_view(json.loads(e)) for e in encoded]
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(kept) == len(encoded)
    return (after - before) / count


def measured(kind: str, count: int) -> float:
    """bytes_per_view in a fresh interpreter: in this one, strings interned by earlier tests
    make the table's next resize (megabytes) land in whichever measurement comes first."""
    code = ("import sys; from tests.unit.operator.test_podlimits import bytes_per_view; "
            f"print(bytes_per_view({kind!r}, {count}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=ROOT)
    return float(done.stdout.strip().splitlines()[-1])


def test_memory_per_watched_pod_is_bounded() -> None:
    """The view of a typical engine pod, of one at the limits, and of the issue's attack
    pod (past them: identity and why only). docs/design.md states these figures."""
    assert podlimits.violation(heavy(0), {}) is None
    typical = measured("typical", 2000)
    at_limits = measured("at_limits", 1000)
    attack = measured("attack", 20)
    print(f"bytes per view: typical {typical:.0f}, at the limits {at_limits:.0f}, "
          f"attack {attack:.0f}")
    assert typical < 2048
    # The label strings themselves (16 KiB at most); per label, two string headers, a dict
    # entry and an interned-table slot.
    assert at_limits < LIMITS.label_bytes + LIMITS.labels * 160
    assert attack < 2048
