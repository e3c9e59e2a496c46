"""What ``/healthz`` and ``/readyz`` answer, and the clock that says whether a load moves.

Liveness (kubelet restarts the container when it fails):
- the socket server's accept loop ended without a stop: nobody new will ever
  be served, so restart;
- a load (re-adoption or disk) made no progress for ``stall_seconds``.
  Progress is a phase starting, an engine dealt with during re-adoption, or
  this process reading at least ``MIN_READ_PROGRESS`` more bytes from files
  (``rchar`` of ``/proc/self/io``: the loader's ``preadv`` calls count there,
  so a slow but moving disk load is never mistaken for a stuck one, while a
  read hung on a dead NFS server is).

Readiness: the weights are resident and the accept loop is running.

The decisions are pure functions of what the daemon reports; only
:func:`process_read_bytes` touches the system.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

STALL_SECONDS = 120.0
MIN_READ_PROGRESS = 1 << 20


@dataclass(frozen=True)
class Probe:
    code: int
    body: str


def liveness(
    *, state: str, server_died: bool, phase: str, idle_seconds: float, stall_seconds: float
) -> Probe:
    if server_died:
        return Probe(503, "socket server stopped accepting\n")
    if state == "loading" and idle_seconds > stall_seconds:
        return Probe(
            503,
            f"stuck: no progress for {idle_seconds:.0f} s while {phase} "
            f"(limit {stall_seconds:g} s)\n",
        )
    return Probe(200, "ok\n")


def readiness(*, state: str, accepting: bool) -> Probe:
    if state != "ready":
        return Probe(503, "not ready\n")
    if not accepting:
        return Probe(503, "not accepting connections\n")
    return Probe(200, "ready\n")


def process_read_bytes() -> int | None:
    """Bytes this process has read through read-like calls (files, pipes), or None if unknown."""
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f:
                if line.startswith(b"rchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


class LoadProgress:
    """When the load last moved; :meth:`idle_seconds` also counts file reads as movement.

    Where ``/proc/self/io`` cannot be read, reads cannot be seen and a long
    disk load would look stuck: then nothing is ever reported idle.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        read_bytes: Callable[[], int | None] = process_read_bytes,
    ) -> None:
        self._clock = clock
        self._read_bytes = read_bytes
        self._lock = threading.Lock()
        self.phase = "starting"
        self._at = clock()
        self._read = read_bytes()

    def mark(self, phase: str | None = None) -> None:
        with self._lock:
            if phase is not None:
                self.phase = phase
            self._at = self._clock()
            self._read = self._read_bytes()

    def idle_seconds(self) -> float:
        with self._lock:
            now = self._clock()
            read = self._read_bytes()
            if read is None or self._read is None:
                return 0.0
            if read - self._read >= MIN_READ_PROGRESS:
                self._at, self._read = now, read
            return now - self._at
