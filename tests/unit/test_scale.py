"""The scale harness's pure parts: what a wave expects, and how its figures are summarised."""

from __future__ import annotations

from benchmarks import scale
from benchmarks.fleet import Gate, gpu_uuid
from weightcache.report import annotation_key
from weightcache_operator import gate


def test_percentiles_by_nearest_rank() -> None:
    assert scale.percentiles([]) is None
    figures = scale.percentiles(float(i) for i in range(1, 101))
    assert figures == {"p50": 50.0, "p99": 99.0, "max": 100.0, "n": 100}
    assert scale.percentiles([3.0]) == {"p50": 3.0, "p99": 3.0, "max": 3.0, "n": 1}


def test_one_percent_of_the_fleet_degrades_every_way_at_least_once() -> None:
    nodes = [f"n{i}" for i in range(1000)]
    bad = scale.degraded_nodes(nodes, 0.01, seed=1)
    assert len(bad) == 10 and set(bad) <= set(nodes)
    assert sorted(set(bad.values())) == ["bytes", "deleted", "fingerprint"]
    small = scale.degraded_nodes(nodes[:10], 0.01, seed=1)
    assert sorted(small.values()) == ["bytes", "deleted", "fingerprint"]
    assert scale.degraded_nodes(nodes, 0.01, seed=1) == bad  # the same run, the same nodes


def test_expectations() -> None:
    ready = scale.opened("wc-1")
    assert ready.gate_ok(Gate("True", gate.WEIGHTS_RESIDENT, "on n: daemon pod wc-1: 8 ...", 0))
    assert not ready.gate_ok(Gate("True", gate.WEIGHTS_RESIDENT, "daemon pod wc-2: ...", 0))
    assert not ready.gate_ok(None)
    loading = scale.closed(gate.DAEMON_NOT_READY, message=" is Loading")
    assert loading.gate_ok(Gate("False", gate.DAEMON_NOT_READY, "GPU-1 is Loading", 0))
    assert not loading.gate_ok(Gate("False", gate.DAEMON_NOT_READY, "3 of 8 GPUs reported", 0))
    assert not loading.label


def test_gpu_uuids_look_real_and_fit_an_annotation_key() -> None:
    uuid = gpu_uuid("kwok-gpu-999", 7)
    assert len(uuid) == len("GPU-00000000-0000-0000-0000-000000000000")
    assert annotation_key(uuid).startswith("weightcache.dev/report.GPU-")
    assert gpu_uuid("kwok-gpu-999", 7) != gpu_uuid("kwok-gpu-999", 6)
