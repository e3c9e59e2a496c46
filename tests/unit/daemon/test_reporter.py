"""The daemon's pod reporter: the status-to-report mapping, and the retry loop around it.

The loop runs against an in-memory pod with the API server's merge-patch
semantics; failures the real API server cannot be made to produce on demand
(500s, dropped connections) are injected there. tests/k8s/test_operator_reporter.py
runs the same reporter against the real API server with the daemon's own rights.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import pytest

from weightcache.daemon import reporter
from weightcache.protocol import DaemonStatus, RetainedStatus
from weightcache.report import (
    MAX_ANNOTATION_BYTES,
    MAX_DEVICE_BYTES,
    MAX_MESSAGE_CHARS,
    annotation_key,
    decode_report,
    encode_report,
)

HASH = "a" * 64
NOW = "2026-01-01T00:00:00Z"


def status(**changes: Any) -> DaemonStatus:
    fields: dict[str, Any] = dict(
        state="ready", pid=1, device="cuda:1", gpu="GPU-1", transport_backend="memfd",
        preloaded_weights_bytes=100, expected_bytes=100, fingerprint="f" * 64,
        load_seconds=1.25, load_source="disk", readopted=False, socket="/s",
        clients_served=0, error=None,
    )
    fields.update(changes)
    return DaemonStatus(**fields)


def test_report_of_a_status() -> None:
    report = reporter.device_report(status(), HASH, "node-a", NOW)
    assert (report.device, report.node, report.spec_hash, report.state) == (
        "GPU-1", "node-a", HASH, "Ready")
    assert (report.preloaded_weights_bytes, report.expected_bytes) == (100, 100)
    assert (report.transport, report.fingerprint, report.load_seconds) == (
        "memfd", "f" * 64, 1.25)
    loading = reporter.device_report(
        status(state="loading", fingerprint=None, load_seconds=None, transport_backend=None),
        HASH, "node-a", NOW)
    assert (loading.state, loading.fingerprint, loading.transport) == ("Loading", "", "")
    failed = reporter.device_report(status(state="error", error="x" * 5000), HASH, "n", NOW)
    assert failed.state == "Error" and len(failed.message) == MAX_MESSAGE_CHARS
    # A serving daemon's warning travels in the message; an error wins over it.
    warned = reporter.device_report(status(warning="manifest not written"), HASH, "n", NOW)
    assert (warned.state, warned.message) == ("Ready", "manifest not written")
    both = reporter.device_report(status(state="error", error="e", warning="w"), HASH, "n", NOW)
    assert both.message == "e"
    # What a loading daemon does travels as loadPhase (the operator keeps the engines' gates
    # while it re-adopts), and each process names its reports.
    readopting = reporter.device_report(status(state="loading", phase="re-adopting"), HASH, "n",
                                        NOW, reporter.new_instance())
    assert readopting.load_phase == "re-adopting" and len(readopting.instance) == 16
    assert reporter.device_report(status(phase="re-adopting"), HASH, "n", NOW).load_phase == ""
    assert reporter.new_instance() != reporter.new_instance()


def test_the_report_says_where_the_weights_came_from() -> None:
    seeded = reporter.device_report(
        status(load_source="peer", seeded_from="GPU-0"), HASH, "node-a", NOW
    )
    assert (seeded.load_source, seeded.seeded_from) == ("peer", "GPU-0")
    raw = encode_report(seeded)
    assert '"loadSource":"peer"' in raw and '"seededFrom":"GPU-0"' in raw
    loading = reporter.device_report(status(state="loading", load_source=None), HASH, "n", NOW)
    assert (loading.load_source, loading.seeded_from) == ("", "")


def test_what_the_reporter_writes_the_operator_reads() -> None:
    report = reporter.device_report(status(readopted=True), HASH, "node-a", NOW)
    patch = reporter.report_patch(report)
    assert set(patch) == {"metadata"} and set(patch["metadata"]) == {"annotations"}
    ((key, raw),) = patch["metadata"]["annotations"].items()
    assert key == annotation_key("GPU-1")
    assert decode_report(key, raw) == report


@pytest.mark.parametrize(("change", "field"), [
    ({"preloaded_weights_bytes": MAX_DEVICE_BYTES + 1}, "preloaded_weights_bytes"),
    ({"gpu": "bad/device"}, "annotation key"),
])
def test_a_status_the_schema_cannot_carry_is_refused(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        reporter.device_report(status(**change), HASH, "n", NOW)


def test_from_env() -> None:
    assert reporter.PodReporter.from_env({}) is None
    made = reporter.PodReporter.from_env(
        {"POD_NAME": "p", "POD_NAMESPACE": "ns", "WEIGHTCACHE_SPEC_HASH": HASH,
         "NODE_NAME": "node-a"})
    assert made is not None
    assert (made.pod_name, made.namespace, made.spec_hash, made.node) == ("p", "ns", HASH,
                                                                          "node-a")


class ApiError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


class Pod:
    """One pod's annotations under merge patches; never read by the reporter."""

    def __init__(self) -> None:
        self.annotations: dict[str, str] = {}
        self.lock = threading.Lock()
        self.failures: list[Exception] = []
        self.patches = 0

    def patch_namespaced_pod(self, name: str, namespace: str, body: dict,
                             _content_type: str) -> None:
        assert _content_type == "application/merge-patch+json"
        assert "resourceVersion" not in body["metadata"]  # no read, no precondition
        with self.lock:
            if self.failures:
                raise self.failures.pop(0)
            self.annotations.update(body["metadata"]["annotations"])
            self.patches += 1

    def report(self, device: str = "GPU-1"):
        key = annotation_key(device)
        return decode_report(key, self.annotations[key])


def make(pod: Pod, **kwargs: Any) -> reporter.PodReporter:
    r = reporter.PodReporter("pod", "ns", HASH, "node-a", api_factory=lambda: pod,
                             backoff=(0.01, 0.05), **kwargs)
    r.start()
    return r


def test_writes_the_latest_status_and_skips_unchanged() -> None:
    pod = Pod()
    r = make(pod)
    try:
        r.update(status(state="loading"))
        r.update(status())
        assert r.flush(timeout=10)
        assert pod.report().state == "Ready"
        patches = pod.patches
        r.update(status())  # same content, later timestamp: nothing to write
        assert r.flush(timeout=10)
        assert pod.patches == patches
    finally:
        r.stop()


def test_survives_errors() -> None:
    pod = Pod()
    pod.failures = [ApiError(500), ConnectionResetError("reset"), ApiError(403), ApiError(401)]
    r = make(pod)
    try:
        r.update(status())
        assert r.flush(timeout=10)
        assert pod.report().state == "Ready"
        assert r._thread is not None and r._thread.is_alive()
    finally:
        r.stop()


def test_invalid_status_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    pod = Pod()
    r = make(pod)
    try:
        r.update(status(gpu="bad/device"))
        assert r.flush(timeout=1)
        assert "invalid daemon status" in caplog.text
        assert pod.annotations == {}
    finally:
        r.stop()


def test_daemons_sharing_a_pod_each_write_their_own_key() -> None:
    pod = Pod()
    reporters = [make(pod) for _ in range(8)]
    try:
        for i, r in enumerate(reporters):
            r.update(status(gpu=f"GPU-{i}"))
        assert all(r.flush(timeout=10) for r in reporters)
        assert sorted(pod.annotations) == sorted(annotation_key(f"GPU-{i}") for i in range(8))
        assert {pod.report(f"GPU-{i}").device for i in range(8)} == {f"GPU-{i}" for i in range(8)}
    finally:
        for r in reporters:
            r.stop()


def test_resync_restores_a_clobbered_report() -> None:
    pod = Pod()
    r = make(pod, resync_seconds=0.05)
    try:
        r.update(status())
        assert r.flush(timeout=10)
        key = annotation_key("GPU-1")
        with pod.lock:
            pod.annotations[key] = "garbage"
        for _ in range(400):
            with pod.lock:
                if pod.annotations[key] != "garbage":
                    break
            time.sleep(0.025)
        assert msgspec.structs.replace(pod.report(), reported_at="") == msgspec.structs.replace(
            reporter.device_report(status(), HASH, "node-a", NOW, r.instance), reported_at="")
    finally:
        r.stop()


def test_kept_generations_are_listed_four_at_most_and_the_rest_counted() -> None:
    """Issue 42 review: a report listed every kept generation; five or more pushed it past
    what the operator decodes for the rest (each ~230 bytes beside a 512-character message)."""
    kept = [RetainedStatus(spec_hash=f"{i}" * 64, fingerprint=f"{i}" * 64, plan=None,
                           bytes=MAX_DEVICE_BYTES + i, expected_bytes=10) for i in range(6)]
    report = reporter.device_report(
        status(retained=kept, error="x" * 5000, state="error", memory_total_bytes=1 << 45,
               memory_free_bytes=1 << 30, waiting_for_room=True), HASH, "n", NOW,
        reporter.new_instance())
    assert [r.spec_hash[0] for r in report.retained] == ["0", "1", "2", "3"]
    assert report.retained_omitted == 2
    assert report.retained[0].preloaded_weights_bytes == MAX_DEVICE_BYTES  # bounded
    assert (report.memory_total_bytes, report.memory_free_bytes) == (MAX_DEVICE_BYTES, 1 << 30)
    raw = encode_report(report)
    assert len(raw.encode()) <= MAX_ANNOTATION_BYTES
    assert decode_report(annotation_key("GPU-1"), raw) == report


def test_memory_alone_rewrites_the_report_only_when_it_moved_a_gib() -> None:
    pod = Pod()
    r = make(pod)
    try:
        r.update(status(memory_total_bytes=80 << 30, memory_free_bytes=40 << 30))
        assert r.flush(timeout=10)
        writes = pod.patches
        r.update(status(memory_total_bytes=80 << 30, memory_free_bytes=(40 << 30) - (900 << 20)))
        assert r.flush(timeout=10) and pod.patches == writes
        r.update(status(memory_total_bytes=80 << 30, memory_free_bytes=39 << 30))
        assert r.flush(timeout=10) and pod.patches == writes + 1
        assert pod.report().memory_free_bytes == 39 << 30
        r.update(status(state="loading", memory_total_bytes=80 << 30,
                        memory_free_bytes=39 << 30))  # a status change: written at once
        assert r.flush(timeout=10) and pod.patches == writes + 2
    finally:
        r.stop()
