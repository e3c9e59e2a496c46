"""Report what the daemon holds into its own pod's `weightcache.dev/report` annotation.

Several daemon processes (one per GPU) may share a pod, so each one merges its
own GPU entry into the annotation: GET the pod, merge, PATCH with the
resourceVersion read, and start over on 409 Conflict. The merge is a pure
function; `PodReporter` is the thin I/O around it, on a background thread.
Reporting must never take the daemon down: every failure is logged and
retried with capped exponential backoff.

Usage from the daemon::

    reporter = PodReporter.from_env()      # None unless POD_NAME/POD_NAMESPACE are set
    if reporter:
        reporter.start()
        daemon.status_listeners.append(reporter.update)   # never blocks, never raises
        ...
        reporter.stop()
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import random
import threading
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

log = logging.getLogger(__name__)

REPORT_ANNOTATION = "weightcache.dev/report"
SPEC_HASH_ENV = "WEIGHTCACHE_SPEC_HASH"
REPORT_VERSION = 1
_STATES = {"loading": "Loading", "ready": "Ready", "error": "Error"}


def gpu_entry(status: Mapping[str, Any] | msgspec.Struct) -> tuple[str, dict[str, Any]]:
    """(GPU key, report entry) from the daemon's status; `ValueError` names a bad field.

    Takes the daemon's `DaemonStatus` struct or the same fields as a dict.
    """
    if isinstance(status, msgspec.Struct):
        status = msgspec.structs.asdict(status)

    def need(key: str, kind: type | tuple[type, ...]) -> Any:
        value = status.get(key)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ValueError(f"daemon status field {key!r}: expected {kind}, got {value!r}")
        return value

    state = need("state", str)
    if state not in _STATES:
        raise ValueError(f"daemon status field 'state': unknown state {state!r}")
    key = need("gpu", str)
    if not key:
        raise ValueError("daemon status field 'gpu': empty")
    preloaded = need("preloaded_weights_bytes", int)
    expected = need("expected_bytes", int)
    if preloaded < 0 or expected < 0:
        raise ValueError("daemon status byte counts must be non-negative")
    load_seconds = status.get("load_seconds")
    if load_seconds is not None:
        load_seconds = float(need("load_seconds", (int, float)))
    error = status.get("error")
    return key, {
        "state": _STATES[state],
        "preloadedWeightsBytes": preloaded,
        "expectedBytes": expected,
        "transport": str(status.get("transport_backend") or status.get("transport") or ""),
        "fingerprint": str(status.get("fingerprint") or ""),
        "loadSeconds": load_seconds,
        "readopted": bool(status.get("readopted", False)),
        "message": str(error)[:1024] if error else "",
    }


def merge_report(
    existing: str | None, key: str, entry: Mapping[str, Any], spec_hash: str, reported_at: str
) -> str | None:
    """The annotation with this GPU's entry merged in, or None when it already says so.

    Entries of the other GPUs in the pod are kept. An unreadable annotation, or
    one written for another spec, is replaced rather than trusted.
    """
    try:
        current = json.loads(existing) if existing else None
    except ValueError:
        current = None
    gpus: dict[str, Any] = {}
    if (
        isinstance(current, dict)
        and current.get("v") == REPORT_VERSION
        and current.get("specHash") == spec_hash
        and isinstance(current.get("gpus"), dict)
    ):
        gpus = dict(current["gpus"])
        if gpus.get(key) == dict(entry):
            return None
    gpus[key] = dict(entry)
    report = {"v": REPORT_VERSION, "specHash": spec_hash, "gpus": gpus, "reportedAt": reported_at}
    return json.dumps(report, sort_keys=True, separators=(",", ":"))


def report_patch(annotation: str, resource_version: str) -> dict[str, Any]:
    """Merge patch that only applies if the pod is still at `resource_version`."""
    return {
        "metadata": {
            "resourceVersion": resource_version,
            "annotations": {REPORT_ANNOTATION: annotation},
        }
    }


def rfc3339_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _default_api() -> Any:
    """A CoreV1Api on the in-cluster config, else on $KUBECONFIG."""
    from kubernetes import client, config

    configuration = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
    else:
        # Read $KUBECONFIG now: the client library reads it once, at import.
        config.load_kube_config(os.environ.get("KUBECONFIG"), client_configuration=configuration)
    return client.CoreV1Api(client.ApiClient(configuration))


class PodReporter:
    """Keeps this GPU's entry in the pod annotation equal to the latest status."""

    def __init__(
        self,
        pod_name: str,
        namespace: str,
        spec_hash: str,
        api_factory: Callable[[], Any] = _default_api,
        backoff: tuple[float, float] = (0.5, 30.0),
        resync_seconds: float = 60.0,
        max_conflicts: int = 20,
    ) -> None:
        self.pod_name = pod_name
        self.namespace = namespace
        self.spec_hash = spec_hash
        self._api_factory = api_factory
        self._api: Any = None
        self._backoff = backoff
        self._resync = resync_seconds
        self._max_conflicts = max_conflicts
        self._lock = threading.Condition()
        self._pending: tuple[str, dict[str, Any]] | None = None
        self._latest: tuple[str, dict[str, Any]] | None = None
        self._generation = 0
        self._reported_generation = 0
        self._stopping = False
        self._thread: threading.Thread | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ, **kwargs: Any) -> PodReporter | None:
        pod, namespace = env.get("POD_NAME"), env.get("POD_NAMESPACE")
        if not pod or not namespace:
            return None
        return cls(pod, namespace, env.get(SPEC_HASH_ENV, ""), **kwargs)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="weightcache-reporter", daemon=True)
        self._thread.start()

    def update(self, status: Mapping[str, Any] | msgspec.Struct) -> None:
        """Queue the daemon's latest status; never blocks, never raises."""
        try:
            item = gpu_entry(status)
        except ValueError:
            log.exception("not reporting an invalid daemon status")
            return
        with self._lock:
            self._pending = item
            self._generation += 1
            self._lock.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until the latest queued status is in the annotation."""
        with self._lock:
            return self._lock.wait_for(
                lambda: self._reported_generation >= self._generation, timeout=timeout
            )

    def stop(self, timeout: float = 5.0) -> None:
        """Give the last status up to `timeout` seconds to land (e.g. an error before exit)."""
        if self._thread is not None and self._thread.is_alive():
            self.flush(timeout)
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        delay = self._backoff[0]
        while True:
            with self._lock:
                wait = None if self._latest is None else self._resync
                self._lock.wait_for(
                    lambda: self._stopping or self._reported_generation < self._generation,
                    timeout=wait,
                )
                if self._stopping:
                    return
                generation = self._generation
                if self._pending is not None:
                    self._latest, self._pending = self._pending, None
                item = self._latest
            if item is None:
                continue
            try:
                self._write(*item)
            except Exception as exc:  # noqa: BLE001 - any failure is retried, never fatal
                log.warning(
                    "report to pod %s/%s failed, retrying in %.1fs: %s",
                    self.namespace,
                    self.pod_name,
                    delay,
                    exc,
                )
                with self._lock:
                    self._lock.wait_for(
                        lambda: self._stopping, timeout=delay * random.uniform(0.8, 1.2)
                    )
                delay = min(delay * 2, self._backoff[1])
                self._api = None if _is_auth_error(exc) else self._api
                continue
            delay = self._backoff[0]
            with self._lock:
                self._reported_generation = max(self._reported_generation, generation)
                self._lock.notify_all()

    def _write(self, key: str, entry: dict[str, Any]) -> None:
        """One report: retries 409 Conflicts itself, raises anything else."""
        if self._api is None:
            self._api = self._api_factory()
        for _ in range(self._max_conflicts):
            pod = self._api.read_namespaced_pod(self.pod_name, self.namespace)
            annotations = pod.metadata.annotations or {}
            merged = merge_report(
                annotations.get(REPORT_ANNOTATION), key, entry, self.spec_hash, rfc3339_now()
            )
            if merged is None:
                return
            try:
                self._api.patch_namespaced_pod(
                    self.pod_name,
                    self.namespace,
                    report_patch(merged, pod.metadata.resource_version),
                    _content_type="application/merge-patch+json",
                )
                return
            except Exception as exc:
                if getattr(exc, "status", None) != 409:
                    raise
                log.debug("report conflict on pod %s, merging again", self.pod_name)
        raise RuntimeError(f"gave up after {self._max_conflicts} conflicting writers")


def _is_auth_error(exc: Exception) -> bool:
    # A rotated service-account token shows up as 401: rebuild the client.
    return getattr(exc, "status", None) == 401
