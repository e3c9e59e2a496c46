"""Report what the daemon holds into its own pod's ``weightcache.dev/report.<device>`` annotation.

The report schema lives in :mod:`weightcache.report`. Each daemon writes only
its own device's annotation, with a merge patch that needs no prior read: the
daemon's token may ``patch`` pods and nothing else (the chart's report guard
narrows that to this annotation of this pod), so it never reads another pod's
spec or environment, and the daemons of one pod never conflict.

Reporting must never take the daemon down: every failure is logged and retried
with capped exponential backoff, on a background thread. Usage from the daemon::

    reporter = PodReporter.from_env()      # None unless POD_NAME/POD_NAMESPACE are set
    if reporter:
        reporter.start()
        daemon.status_listeners.append(reporter.update)   # never blocks, never raises
        ...
        reporter.stop()
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import threading
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from weightcache.kubeclient import api_client
from weightcache.protocol import DaemonStatus
from weightcache.report import (
    MAX_DEVICE_BYTES,
    MAX_MESSAGE_CHARS,
    MAX_RETAINED_REPORTED,
    NODE_NAME_ENV,
    REPORT_VERSION,
    SPEC_HASH_ENV,
    DeviceReport,
    RetainedReport,
    annotation_key,
    encode_report,
    rfc3339_now,
)

log = logging.getLogger(__name__)

_STATES = {"loading": "Loading", "ready": "Ready", "error": "Error"}


def device_report(status: DaemonStatus, spec_hash: str, node: str, now: str,
                  instance: str = "") -> DeviceReport:
    """The report of this daemon's status; ``ValueError`` names a field the schema refuses.
    ``instance``: this process's (``new_instance``), so that the operator tells a report
    a dead process left from its successor's."""
    for name in ("preloaded_weights_bytes", "expected_bytes"):
        value = getattr(status, name)
        if not 0 <= value <= MAX_DEVICE_BYTES:
            raise ValueError(f"daemon status field {name!r}: {value} is out of range")
    annotation_key(status.gpu)  # raises for a device name the annotation key cannot carry
    return DeviceReport(
        v=REPORT_VERSION,
        device=status.gpu,
        node=node,
        spec_hash=spec_hash,
        state=_STATES[status.state],
        preloaded_weights_bytes=status.preloaded_weights_bytes,
        expected_bytes=status.expected_bytes,
        transport=status.transport_backend or "",
        fingerprint=status.fingerprint or "",
        load_seconds=status.load_seconds,
        readopted=status.readopted,
        # An error, or else a warning of a ready daemon (the operator posts it as an event).
        message=(status.error or status.warning or "")[:MAX_MESSAGE_CHARS],
        load_source=status.load_source or "",
        seeded_from=status.seeded_from or "",
        reported_at=now,
        load_phase=(status.phase or "") if status.state == "loading" else "",
        instance=instance,
        retained=[
            RetainedReport(spec_hash=r.spec_hash, fingerprint=r.fingerprint,
                           preloaded_weights_bytes=min(r.bytes, MAX_DEVICE_BYTES),
                           expected_bytes=min(r.expected_bytes, MAX_DEVICE_BYTES))
            for r in status.retained[:MAX_RETAINED_REPORTED]
        ],
        retained_omitted=max(0, len(status.retained) - MAX_RETAINED_REPORTED),
        memory_total_bytes=_bounded(status.memory_total_bytes),
        memory_free_bytes=_bounded(status.memory_free_bytes),
        waiting_for_room=status.waiting_for_room,
    )


def _bounded(value: int | None) -> int | None:
    return None if value is None else min(value, MAX_DEVICE_BYTES)


def new_instance() -> str:
    """A fresh random name for this daemon process's reports (16 hex digits)."""
    return secrets.token_hex(8)


def report_patch(report: DeviceReport) -> dict[str, Any]:
    """Merge patch setting this device's annotation; it needs no read and no resourceVersion."""
    return {"metadata": {"annotations": {annotation_key(report.device): encode_report(report)}}}


def _default_api() -> Any:
    from kubernetes import client

    return client.CoreV1Api(api_client())


class PodReporter:
    """Keeps this device's annotation equal to the latest status."""

    def __init__(
        self,
        pod_name: str,
        namespace: str,
        spec_hash: str,
        node: str = "",
        api_factory: Callable[[], Any] = _default_api,
        backoff: tuple[float, float] = (0.5, 30.0),
        resync_seconds: float = 60.0,
    ) -> None:
        self.pod_name = pod_name
        self.namespace = namespace
        self.spec_hash = spec_hash
        self.node = node
        self._api_factory = api_factory
        self._api: Any = None
        self._backoff = backoff
        self._resync = resync_seconds
        self._lock = threading.Condition()
        self._latest: DeviceReport | None = None
        self._written: DeviceReport | None = None
        self._generation = 0
        self._reported_generation = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.instance = new_instance()

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ, **kwargs: Any) -> PodReporter | None:
        pod, namespace = env.get("POD_NAME"), env.get("POD_NAMESPACE")
        if not pod or not namespace:
            return None
        return cls(pod, namespace, env.get(SPEC_HASH_ENV, ""), env.get(NODE_NAME_ENV, ""),
                   **kwargs)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="weightcache-reporter", daemon=True)
        self._thread.start()

    def update(self, status: DaemonStatus) -> None:
        """Queue the daemon's latest status; never blocks, never raises."""
        try:
            report = device_report(status, self.spec_hash, self.node, rfc3339_now(),
                                   self.instance)
        except (ValueError, KeyError, TypeError):
            log.exception("not reporting an invalid daemon status")
            return
        with self._lock:
            self._latest = report
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
                # Between changes, rewrite the report now and then: someone may have removed it.
                wait = None if self._written is None else self._resync
                changed = self._lock.wait_for(
                    lambda: self._stopping or self._reported_generation < self._generation,
                    timeout=wait,
                )
                if self._stopping:
                    return
                generation = self._generation
                report = self._latest
            if report is None:
                continue
            if changed and _same_but_time(report, self._written):
                self._mark_reported(generation)
                continue
            try:
                self._write(report)
            except Exception as exc:  # noqa: BLE001 - any failure is retried, never fatal
                log.warning(
                    "report to pod %s/%s failed, retrying in %.1fs: %s",
                    self.namespace, self.pod_name, delay, exc,
                )
                with self._lock:
                    self._lock.wait_for(
                        lambda: self._stopping, timeout=delay * random.uniform(0.8, 1.2)
                    )
                delay = min(delay * 2, self._backoff[1])
                self._api = None if _is_auth_error(exc) else self._api
                continue
            delay = self._backoff[0]
            self._written = report
            self._mark_reported(generation)

    def _mark_reported(self, generation: int) -> None:
        with self._lock:
            self._reported_generation = max(self._reported_generation, generation)
            self._lock.notify_all()

    def _write(self, report: DeviceReport) -> None:
        if self._api is None:
            self._api = self._api_factory()
        self._api.patch_namespaced_pod(
            self.pod_name, self.namespace, report_patch(report),
            _content_type="application/merge-patch+json",
        )


# Between status changes, a report is rewritten for its memory figures only when the free
# memory moved by this much: the free memory of a busy device changes all the time.
MEMORY_STEP = 1 << 30


def _same_but_time(a: DeviceReport, b: DeviceReport | None) -> bool:
    """Whether `b` already says what `a` says: only the timestamp may differ, and the free
    memory by less than MEMORY_STEP (the total not at all)."""
    if b is None:
        return False
    if (a.memory_free_bytes is None) != (b.memory_free_bytes is None) or (
            a.memory_free_bytes is not None and b.memory_free_bytes is not None
            and abs(a.memory_free_bytes - b.memory_free_bytes) >= MEMORY_STEP):
        return False
    return msgspec.structs.replace(a, reported_at=b.reported_at,
                                   memory_free_bytes=b.memory_free_bytes) == b


def _is_auth_error(exc: Exception) -> bool:
    # A rotated service-account token shows up as 401: rebuild the client.
    return getattr(exc, "status", None) == 401
