"""The daemon's pod reporter: pure merge, and the retry loop around it.

The loop runs against an in-memory pod store with the API server's
optimistic-concurrency rule (a patch naming a stale resourceVersion gets 409);
failures the real API server cannot be made to produce on demand (500s,
dropped connections) are injected there. tests/k8s/test_operator_reporter.py
runs the same reporter against the real API server.
"""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from weightcache.daemon import reporter
from weightcache.protocol import DaemonStatus

STATUS = {"state": "ready", "gpu": "GPU-1", "preloaded_weights_bytes": 100,
          "expected_bytes": 100, "transport_backend": "memfd", "fingerprint": "f",
          "load_seconds": 1.25, "readopted": False, "error": None}
ENTRY = {"state": "Ready", "preloadedWeightsBytes": 100, "expectedBytes": 100,
         "transport": "memfd", "fingerprint": "f", "loadSeconds": 1.25, "readopted": False,
         "message": ""}
NOW = "2026-01-01T00:00:00Z"


def test_gpu_entry_from_dict_and_from_daemon_status() -> None:
    assert reporter.gpu_entry(STATUS) == ("GPU-1", ENTRY)
    struct = DaemonStatus(state="loading", pid=1, device="cpu", gpu="cpu",
                          transport_backend="memfd", preloaded_weights_bytes=0,
                          expected_bytes=100, fingerprint=None, load_seconds=None,
                          load_source=None, readopted=False, socket="/s", clients_served=0,
                          error=None)
    key, entry = reporter.gpu_entry(struct)
    assert key == "cpu"
    assert entry == {**ENTRY, "state": "Loading", "preloadedWeightsBytes": 0,
                     "fingerprint": "", "loadSeconds": None}


def test_gpu_entry_error_message() -> None:
    _, entry = reporter.gpu_entry({**STATUS, "state": "error", "error": "x" * 5000})
    assert entry["state"] == "Error" and len(entry["message"]) == 1024


@pytest.mark.parametrize(("change", "field"), [
    ({"state": "sleeping"}, "state"),
    ({"gpu": ""}, "gpu"),
    ({"preloaded_weights_bytes": -1}, "non-negative"),
    ({"expected_bytes": "9"}, "expected_bytes"),
    ({"preloaded_weights_bytes": True}, "preloaded_weights_bytes"),
    ({"load_seconds": "fast"}, "load_seconds"),
])
def test_gpu_entry_rejects_bad_status(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        reporter.gpu_entry({**STATUS, **change})


def test_merge_into_empty_and_keep_other_gpus() -> None:
    first = reporter.merge_report(None, "GPU-1", ENTRY, "h", NOW)
    assert first is not None
    assert json.loads(first) == {"v": 1, "specHash": "h", "gpus": {"GPU-1": ENTRY},
                                 "reportedAt": NOW}
    other = {**ENTRY, "state": "Loading"}
    second = reporter.merge_report(first, "GPU-2", other, "h", NOW)
    assert second is not None
    assert json.loads(second)["gpus"] == {"GPU-1": ENTRY, "GPU-2": other}


def test_merge_is_a_no_op_when_already_reported() -> None:
    first = reporter.merge_report(None, "GPU-1", ENTRY, "h", NOW)
    assert reporter.merge_report(first, "GPU-1", ENTRY, "h", "2027-01-01T00:00:00Z") is None


@pytest.mark.parametrize("existing", [
    "{not json", "[]", json.dumps({"v": 2, "specHash": "h", "gpus": {"GPU-9": ENTRY}}),
    json.dumps({"v": 1, "specHash": "other", "gpus": {"GPU-9": ENTRY}}),
    json.dumps({"v": 1, "specHash": "h", "gpus": []}),
])
def test_merge_replaces_unusable_or_stale_reports(existing: str) -> None:
    merged = reporter.merge_report(existing, "GPU-1", ENTRY, "h", NOW)
    assert merged is not None
    assert json.loads(merged)["gpus"] == {"GPU-1": ENTRY}


def test_report_patch_carries_the_precondition() -> None:
    assert reporter.report_patch("{}", "42") == {
        "metadata": {"resourceVersion": "42", "annotations": {reporter.REPORT_ANNOTATION: "{}"}}
    }


def test_from_env() -> None:
    assert reporter.PodReporter.from_env({}) is None
    assert reporter.PodReporter.from_env({"POD_NAME": "p"}) is None
    made = reporter.PodReporter.from_env(
        {"POD_NAME": "p", "POD_NAMESPACE": "ns", reporter.SPEC_HASH_ENV: "h"})
    assert made is not None
    assert (made.pod_name, made.namespace, made.spec_hash) == ("p", "ns", "h")


class ApiError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


class PodStore:
    """One pod's metadata with the API server's resourceVersion precondition."""

    def __init__(self) -> None:
        self.annotations: dict[str, str] = {}
        self.version = 1
        self.lock = threading.Lock()
        self.failures: list[Exception] = []
        self.conflicts_to_inject = 0
        self.patches = 0

    def read_namespaced_pod(self, name: str, namespace: str) -> Any:
        with self.lock:
            if self.failures:
                raise self.failures.pop(0)
            return SimpleNamespace(metadata=SimpleNamespace(
                annotations=dict(self.annotations), resource_version=str(self.version)))

    def patch_namespaced_pod(self, name: str, namespace: str, body: dict,
                             _content_type: str) -> None:
        assert _content_type == "application/merge-patch+json"
        with self.lock:
            if self.conflicts_to_inject:
                # Another writer got in between our read and our write.
                self.conflicts_to_inject -= 1
                self.version += 1
                raise ApiError(409)
            if body["metadata"]["resourceVersion"] != str(self.version):
                raise ApiError(409)
            self.annotations.update(body["metadata"]["annotations"])
            self.version += 1
            self.patches += 1

    def report(self) -> dict[str, Any]:
        return json.loads(self.annotations[reporter.REPORT_ANNOTATION])


def make(store: PodStore, **kwargs: Any) -> reporter.PodReporter:
    r = reporter.PodReporter("pod", "ns", "h", api_factory=lambda: store,
                             backoff=(0.01, 0.05), **kwargs)
    r.start()
    return r


def test_reporter_writes_latest_status_and_skips_unchanged() -> None:
    store = PodStore()
    r = make(store)
    try:
        r.update({**STATUS, "state": "loading"})
        r.update(STATUS)
        assert r.flush(timeout=10)
        assert store.report()["gpus"]["GPU-1"] == ENTRY
        patches = store.patches
        r.update(STATUS)
        assert r.flush(timeout=10)
        assert store.patches == patches
    finally:
        r.stop()


def test_reporter_survives_errors_and_conflicts() -> None:
    store = PodStore()
    store.failures = [ApiError(500), ConnectionResetError("reset"), ApiError(403)]
    store.conflicts_to_inject = 3
    r = make(store)
    try:
        r.update(STATUS)
        assert r.flush(timeout=10)
        assert store.report()["gpus"]["GPU-1"] == ENTRY
        assert r._thread is not None and r._thread.is_alive()
    finally:
        r.stop()


def test_invalid_status_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    store = PodStore()
    r = make(store)
    try:
        r.update({"state": "nonsense"})
        assert r.flush(timeout=1)
        assert "invalid daemon status" in caplog.text
        assert reporter.REPORT_ANNOTATION not in store.annotations
    finally:
        r.stop()


def test_daemons_sharing_a_pod_all_land() -> None:
    store = PodStore()
    reporters = [make(store) for _ in range(8)]
    try:
        for i, r in enumerate(reporters):
            r.update({**STATUS, "gpu": f"GPU-{i}"})
        assert all(r.flush(timeout=10) for r in reporters)
        assert sorted(store.report()["gpus"]) == [f"GPU-{i}" for i in range(8)]
    finally:
        for r in reporters:
            r.stop()


def test_resync_restores_a_clobbered_report() -> None:
    store = PodStore()
    r = make(store, resync_seconds=0.05)
    try:
        r.update(STATUS)
        assert r.flush(timeout=10)
        with store.lock:
            store.annotations[reporter.REPORT_ANNOTATION] = "garbage"
            store.version += 1
        for _ in range(400):
            with store.lock:
                if store.annotations[reporter.REPORT_ANNOTATION] != "garbage":
                    break
            time.sleep(0.025)
        assert store.report()["gpus"]["GPU-1"] == ENTRY
    finally:
        r.stop()
