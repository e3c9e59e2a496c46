"""Weights of earlier generations a daemon keeps beside its own, and the room check.

A daemon that a model change replaced finds its predecessor's manifests for
another config (another generation: a new revision, another model) on the
same transport and GPU. As a restart re-adopts (:mod:`.readopt`, which does the
taking back), it asks the engines that map those weights to hand them back,
checks every allocation against the manifest's keyed digests, and keeps what
verifies: an old engine restarting in its pod asks for exactly that config
and is served it, and the operator keeps the old engines' gates open (the
report lists them under ``retained``). Nothing of an old generation is ever
read from disk: its checkpoint may be gone or rewritten.

Kept weights are dropped :data:`UNHELD_SECONDS` (30 s) after no engine holds
them: the engines' hand-back sockets are asked at once and then every
:data:`CHECK_SECONDS` (10 s), and an engine counts as holding them only when
what it hands back passes the same checks as a re-adoption, sizes and keyed
digests (an engine holding another allocation of the same sizes, a
fine-tune's, holds nothing of them). A kept layout's manifest lives as
``.retained-<fingerprint>.manifest`` and goes with it.

:class:`Room` is ``--rollout auto``'s check before every load (the current
generation's first load, the checkpoint layout rebuilt, an engine layout built
later): while generations are kept, a load waits until the device's free
memory holds it plus :data:`ROOM_MARGIN` (256 MiB). On a GPU the free memory is
the device's, so kept weights count in it already. On a CPU they do not: their
pages stay charged to the cgroup of the process that wrote them (the replaced
daemon's, gone since), so the kept bytes are taken off the daemon's own free
memory. Without kept generations nothing could give room back, and a load
goes ahead as it always did.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from weightcache.daemon.devicememory import DeviceMemory
from weightcache.daemon.manifest import Manifest, remove_retained_manifest
from weightcache.daemon.readopt import adopt_from, engine_sockets
from weightcache.daemon.resident import ResidentWeights
from weightcache.protocol import CacheConfig, RetainedStatus
from weightcache.sockets import PeerPolicy
from weightcache.transport import get_daemon_transport_backend

log = logging.getLogger(__name__)

UNHELD_SECONDS = 30.0
CHECK_SECONDS = 10.0
ROOM_MARGIN = 256 << 20
ROOM_POLL_SECONDS = 1.0


@dataclass
class Kept:
    """One layout of an earlier generation, taken back and kept."""

    resident: ResidentWeights
    manifest: Manifest
    held_at: float  # monotonic: when an engine last held it (or was served it)
    leases: int = 0
    dropped: bool = False

    @property
    def spec_hash(self) -> str:
        return self.manifest.spec_hash


class Generations:
    """The kept layouts of one daemon, and the thread that drops those no engine holds."""

    def __init__(
        self,
        socket_path: str,
        policy: PeerPolicy,
        device: torch.device,
        kept: list[Kept] | None = None,
        *,
        exchange_seconds: float = 10.0,
        unheld_seconds: float = UNHELD_SECONDS,
        check_seconds: float = CHECK_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self._socket_path = socket_path
        self._policy = policy
        self._device = device
        self._exchange_seconds = exchange_seconds
        self._unheld_seconds = unheld_seconds
        self._check_seconds = check_seconds
        self._clock = clock
        self._on_change = on_change
        self._lock = threading.Lock()
        self._kept = {k.resident.fingerprint: k for k in kept or []}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ what is kept

    def add(self, kept: Kept) -> None:
        with self._lock:
            self._kept[kept.resident.fingerprint] = kept

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._kept)

    def total_bytes(self) -> int:
        with self._lock:
            return sum(k.resident.preloaded_weights_bytes for k in self._kept.values())

    def statuses(self) -> list[RetainedStatus]:
        """Every kept layout, by generation then fingerprint (a stable order: the report
        lists the first few)."""
        now = self._clock()
        with self._lock:
            kept = sorted(self._kept.values(), key=lambda k: (k.spec_hash, k.resident.fingerprint))
            return [
                RetainedStatus(
                    spec_hash=k.spec_hash,
                    fingerprint=k.resident.fingerprint,
                    plan=k.resident.config.plan,
                    bytes=k.resident.preloaded_weights_bytes,
                    expected_bytes=k.resident.expected_bytes,
                    unheld_seconds=round(max(0.0, now - k.held_at), 1),
                )
                for k in kept
            ]

    @contextlib.contextmanager
    def lease(self, config: CacheConfig) -> Iterator[ResidentWeights | None]:
        """The kept layout of exactly ``config`` (an old engine restarting), leased while
        its reply is sent; None when none is kept. Serving it counts as held."""
        with self._lock:
            kept = next((k for k in self._kept.values() if k.resident.config == config), None)
            if kept is not None:
                kept.leases += 1
                kept.held_at = self._clock()
        try:
            yield None if kept is None else kept.resident
        finally:
            if kept is not None:
                self._release(kept)

    def _release(self, kept: Kept) -> None:
        with self._lock:
            kept.leases -= 1
            close = kept.dropped and kept.leases == 0
        if close:
            kept.resident.close()

    # ------------------------------------------------------------------ dropping

    def start(self) -> None:
        """Check at once, then every CHECK_SECONDS, until :meth:`close`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="generations")
            self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self.check_once()
            except Exception:  # the daemon keeps serving; the next check tries again
                log.exception("checking the kept generations failed")
            if self._stop.wait(self._check_seconds):
                return

    def check_once(self) -> list[str]:
        """Ask the engines for each kept layout; drop those no engine held for
        UNHELD_SECONDS. Returns the fingerprints dropped."""
        with self._lock:
            kept = [k for k in self._kept.values() if not k.dropped]
        dropped = []
        for k in kept:
            if self._stop.is_set():
                break
            if self._held_by_an_engine(k):
                with self._lock:
                    k.held_at = self._clock()
                continue
            with self._lock:
                unheld = self._clock() - k.held_at
            if unheld >= self._unheld_seconds:
                self._drop(k, f"no engine held it for {unheld:.0f} s")
                dropped.append(k.resident.fingerprint)
        if dropped:
            self._on_change()
        return dropped

    def _held_by_an_engine(self, kept: Kept) -> bool:
        """Whether some engine hands back exactly these weights: its allocations' sizes and
        keyed digests equal the manifest's, as in a re-adoption (then let go again)."""
        backend = get_daemon_transport_backend(kept.resident.transport)
        try:
            engines = engine_sockets(self._socket_path)
        except OSError as exc:
            log.warning("cannot list the engines' sockets: %s", exc)
            return False
        for engine in engines:
            try:
                memory, _ = adopt_from(engine, self._socket_path, kept.manifest, backend,
                                       self._device, self._policy, self._exchange_seconds)
            except Exception as exc:  # another layout, gone, other bytes: not this one
                log.debug("engine %s does not hold %s: %s", engine, kept.resident.fingerprint,
                          exc)
                continue
            memory.close()
            return True
        return False

    def _drop(self, kept: Kept, why: str) -> None:
        with self._lock:
            if kept.dropped:
                return
            kept.dropped = True
            self._kept.pop(kept.resident.fingerprint, None)
            close = kept.leases == 0
        log.info("dropped the kept layout %s of generation %s (%d bytes): %s",
                 kept.resident.fingerprint[:12], kept.spec_hash[:12] or "<unknown>",
                 kept.resident.preloaded_weights_bytes, why)
        remove_retained_manifest(self._socket_path, kept.resident.fingerprint)
        if close:
            kept.resident.close()

    def close(self) -> None:
        """Stop checking and release every kept layout (once no reply is being sent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._exchange_seconds + 1)
        with self._lock:
            kept, self._kept = list(self._kept.values()), {}
        for k in kept:
            k.resident.close()


class Room:
    """``--rollout auto``: a load waits until it fits beside the kept generations."""

    def __init__(
        self,
        device: torch.device,
        mode: str,
        kept: Generations,
        sample: Callable[[torch.device], DeviceMemory | None],
        *,
        margin: int = ROOM_MARGIN,
        poll_seconds: float = ROOM_POLL_SECONDS,
        on_change: Callable[[], None] = lambda: None,
        progress: Callable[[str], None] = lambda phase: None,
        stop: threading.Event | None = None,
    ) -> None:
        self._device = device
        self._mode = mode
        self._kept = kept
        self._sample = sample
        self._margin = margin
        self._poll = poll_seconds
        self._on_change = on_change
        self._progress = progress
        self._stop = stop or threading.Event()
        self._waiting: set[str] = set()
        self._lock = threading.Lock()

    @property
    def waiting(self) -> bool:
        with self._lock:
            return bool(self._waiting)

    def free(self) -> int | None:
        """What a load may use now: the device's free memory, less (on a CPU) the kept bytes
        charged to another cgroup (module docstring); None where it cannot be read."""
        memory = self._sample(self._device)
        if memory is None:
            return None
        outside = 0 if self._device.type == "cuda" else self._kept.total_bytes()
        return memory.free - outside

    def wait(self, need: int, what: str) -> None:
        """Return once ``need`` bytes fit (plus the margin), or at once where nothing is kept,
        the mode is not ``auto`` or the memory cannot be read; waits while the daemon runs."""
        if self._mode != "auto":
            return
        announced = False
        try:
            while not self._stop.is_set():
                free = self.free() if self._kept else None
                if free is None or free >= need + self._margin:
                    return
                if not announced:
                    log.warning(
                        "waiting for room to load %s: it needs %d bytes and %d more, %d are "
                        "free beside %d bytes of kept generations", what, need, self._margin,
                        free, self._kept.total_bytes())
                    with self._lock:
                        self._waiting.add(what)
                    announced = True
                    self._on_change()
                self._progress(f"waiting for room to load {what}")
                self._stop.wait(self._poll)
        finally:
            if announced:
                with self._lock:
                    self._waiting.discard(what)
                self._on_change()
