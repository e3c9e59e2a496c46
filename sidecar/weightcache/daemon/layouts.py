"""Every layout a daemon holds: the checkpoint's own, and engines' by load-plan hash.

An engine asks for its layout with ``fetch_layout`` (the hash of its load
plan, and the plan itself when the daemon does not hold that layout yet).
The daemon hashes the plan itself, checks it against the checkpoint's headers
(:func:`weightcache.plan.check_plan`) and builds the layout on one builder
thread (:mod:`.build`), answering ``retryable`` meanwhile; the layout is then
served to every engine asking for that hash. Engines cannot poison each
other: a hash names exactly one plan, executed from the daemon's bytes.

Memory: once an engine layout is built and no engine mapped the checkpoint
layout, the checkpoint layout is dropped (``keep_checkpoint`` keeps it); an
engine that asks for it later (``fetch_state``) has it rebuilt from disk.
Dropping never pulls memory from under anyone: each layout is leased while a
reply that exports it is being sent, and closed when the last lease ends;
engines that mapped it keep their mappings (the memory is reference-counted).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import msgspec
import torch

from weightcache.checkpoint import Checkpoint, checkpoint_sources
from weightcache.daemon.build import build_layout, warm_batched_copy
from weightcache.daemon.resident import ResidentWeights
from weightcache.daemon.server import fetch_state_reply
from weightcache.plan import LoadPlan, PlanError, PlanSummary, check_plan, plan_hash
from weightcache.protocol import (
    CacheConfig,
    FetchLayoutRequest,
    FetchStateReply,
    FetchStateRequest,
    LayoutStatus,
    config_differences,
    fingerprint,
)
from weightcache.transport import get_daemon_transport_backend
from weightcache.transport.base import Export

log = logging.getLogger(__name__)

DEFAULT_MAX_LAYOUTS = 2
_STOP = "stop"  # not a plan hash (64 hex), not None (the checkpoint layout)


@dataclass
class _Held:
    resident: ResidentWeights
    leases: int = 0
    fetches: int = 0  # engines served this layout
    retired: bool = False


@dataclass
class _Build:
    plan: LoadPlan | None  # None: the checkpoint layout, from disk
    summary: PlanSummary | None
    started: float = field(default_factory=time.monotonic)
    error: str | None = None


class Holdings:
    """The layouts of one daemon and the thread that builds new ones."""

    def __init__(
        self,
        *,
        base_config: CacheConfig,
        checkpoint: Checkpoint,
        device: torch.device,
        transport: str,
        checkpoint_layout: ResidentWeights | None,
        load_checkpoint: Callable[[], ResidentWeights],
        layouts: dict[str, ResidentWeights] | None = None,
        checkpoint_mapped: bool = False,
        keep_checkpoint: bool = False,
        max_layouts: int = DEFAULT_MAX_LAYOUTS,
        on_change: Callable[[], None] = lambda: None,
        persist: Callable[[ResidentWeights], object] = lambda built: None,
        forget: Callable[[str | None], None] = lambda plan: None,
        room: Callable[[int, str], None] = lambda need, what: None,
        checkpoint_bytes: int = 0,
    ) -> None:
        self.base_config = base_config
        self.base_fingerprint = fingerprint(base_config)
        self._checkpoint_headers = checkpoint
        self._sources = checkpoint_sources(checkpoint)
        self._device = device
        warm_batched_copy(device)
        self._backend = get_daemon_transport_backend(transport)
        self._load_checkpoint = load_checkpoint
        self._keep_checkpoint = keep_checkpoint
        self._max_layouts = max_layouts
        self._on_change = on_change
        # Each layout built gets its manifest (re-adoption); a dropped one loses it.
        self._persist = persist
        self._forget = forget
        # Every build first waits until it fits beside kept generations (generations.Room).
        self._room = room
        self._checkpoint_bytes = checkpoint_bytes
        self._lock = threading.Lock()
        self._checkpoint = None
        if checkpoint_layout is not None:
            # Re-adopted from an engine: that engine maps it.
            self._checkpoint = _Held(checkpoint_layout, fetches=int(checkpoint_mapped))
        self._layouts = {h: _Held(r) for h, r in (layouts or {}).items()}
        self._builds: dict[str | None, _Build] = {}
        self._jobs: queue.Queue[str | None] = queue.Queue()  # plan hashes, None, _STOP
        self._builder: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------------ what is held

    def held(self) -> list[ResidentWeights]:
        with self._lock:
            return [h.resident for h in self._all_held()]

    def _all_held(self) -> list[_Held]:
        return ([self._checkpoint] if self._checkpoint else []) + list(self._layouts.values())

    @property
    def checkpoint_layout(self) -> ResidentWeights | None:
        held = self._checkpoint
        return held.resident if held else None

    def totals(self) -> tuple[int, int]:
        """(bytes, expected bytes) of every ready layout."""
        held = self.held()
        return (
            sum(r.preloaded_weights_bytes for r in held),
            sum(r.expected_bytes for r in held),
        )

    def statuses(self) -> list[LayoutStatus]:
        with self._lock:
            out = [
                LayoutStatus(
                    fingerprint=h.resident.fingerprint,
                    plan=h.resident.config.plan,
                    state="ready",
                    bytes=h.resident.preloaded_weights_bytes,
                    expected_bytes=h.resident.expected_bytes,
                    source=h.resident.load_source,
                    seconds=round(h.resident.load_seconds, 6),
                )
                for h in self._all_held()
            ]
            for key, build in self._builds.items():
                config = msgspec.structs.replace(self.base_config, plan=key)
                out.append(
                    LayoutStatus(
                        fingerprint=fingerprint(config),
                        plan=key,
                        state="failed" if build.error else "building",
                        bytes=0,
                        expected_bytes=build.summary.param_bytes if build.summary else 0,
                        error=build.error,
                    )
                )
        return out

    # ------------------------------------------------------------------ serving

    @contextlib.contextmanager
    def checkpoint(self) -> Iterator[ResidentWeights | FetchStateReply]:
        """The checkpoint layout, leased while its reply is sent; or the error reply to send
        instead (retryable while it is rebuilt from disk, after it was dropped)."""
        with self._lock:
            held = self._checkpoint
            if held is None:
                build = self._builds.get(None)
                if build is not None and build.error is not None:
                    del self._builds[None]  # said once; the next request rebuilds
                    refusal = self._reply(
                        "error", f"rebuilding the checkpoint layout failed: {build.error}"
                    )
                else:
                    refusal = self._reply("error", self._schedule(None, None, None),
                                          retryable=True)  # fmt: skip
            else:
                held.leases += 1
                held.fetches += 1
        if held is None:
            yield refusal
            return
        try:
            yield held.resident
        finally:
            self._release(held)

    @contextlib.contextmanager
    def layout(
        self, request: FetchLayoutRequest
    ) -> Iterator[tuple[FetchStateReply, object | None, Export | None]]:
        """The reply to ``request`` and, for ``ok``, the backend and export to send (the
        layout leased meanwhile)."""
        key = request.plan_hash
        with self._lock:
            held = self._layouts.get(key)
            if held is not None:
                held.leases += 1
                held.fetches += 1
            else:
                refusal = self._refusal(request)
        if held is None:
            yield refusal, None, None
            return
        try:
            # Served as fetch_state serves the checkpoint layout: same config check, same
            # transport negotiation, with the layout's config (plan = its hash).
            asked = FetchStateRequest(
                v=1,
                config=msgspec.structs.replace(request.config, plan=key),
                transports=request.transports,
            )
            reply, backend = fetch_state_reply(asked, held.resident)
            yield reply, backend, held.resident.export
        finally:
            self._release(held)

    def _reply(self, status: str, error: str | None = None, **kw) -> FetchStateReply:
        return FetchStateReply(
            v=1,
            status=status,  # type: ignore[arg-type]
            pid=os.getpid(),
            config=self.base_config,
            fingerprint=self.base_fingerprint,
            error=error,
            **kw,
        )

    def _refusal(self, request: FetchLayoutRequest) -> FetchStateReply:
        """Not held: why, or start building it (under the lock)."""
        key = request.plan_hash
        if request.config != self.base_config:
            fields = config_differences(request.config, self.base_config)
            return self._reply(
                "mismatch", f"config mismatch in: {', '.join(fields)}", mismatched_fields=fields
            )
        if self._backend.name not in request.transports:
            return self._reply(
                "error",
                f"this daemon serves {self._backend.name}; the client accepts "
                f"{list(request.transports)}",
            )
        build = self._builds.get(key)
        if build is not None and build.error is not None:
            del self._builds[key]  # said once; the next request builds again
            return self._reply("error", f"building layout {key[:12]} failed: {build.error}")
        if build is not None:
            return self._reply("error", self._building(key, build), retryable=True)
        if request.plan is None:
            return self._reply(
                "unknown_plan", f"this daemon holds no layout {key[:12]}: send its plan"
            )
        computed = plan_hash(request.plan)
        if computed != key:
            return self._reply("error", f"the plan hashes to {computed}, not {key}")
        try:
            summary = check_plan(request.plan, self._sources)
        except PlanError as exc:
            return self._reply("error", f"refused plan {key[:12]}: {exc}")
        engine_layouts = len(self._layouts) + sum(1 for k in self._builds if k is not None)
        if engine_layouts >= self._max_layouts:
            return self._reply(
                "error",
                f"this daemon already holds or builds {engine_layouts} engine layout(s), its "
                f"limit (--max-layouts {self._max_layouts})",
            )
        return self._reply("error", self._schedule(key, request.plan, summary), retryable=True)

    def _building(self, key: str | None, build: _Build) -> str:
        what = "the checkpoint layout from disk" if key is None else f"layout {key[:12]}"
        return f"building {what} ({time.monotonic() - build.started:.1f} s so far)"

    def _schedule(self, key: str | None, plan: LoadPlan | None, summary) -> str:
        """Queue a build (under the lock); the retryable reason to give meanwhile."""
        build = self._builds.get(key)
        if build is None or build.error is not None:
            build = self._builds[key] = _Build(plan, summary)
            self._jobs.put(key)
            if self._builder is None:
                self._builder = threading.Thread(target=self._build_loop, daemon=True,
                                                 name="layout-builder")  # fmt: skip
                self._builder.start()
        return self._building(key, build)

    def _release(self, held: _Held) -> None:
        with self._lock:
            held.leases -= 1
            close = held.retired and held.leases == 0
        if close:
            held.resident.close()

    # ------------------------------------------------------------------ building

    def _build_loop(self) -> None:
        while True:
            key = self._jobs.get()
            with self._lock:
                if self._closed or key == _STOP:
                    return
                build = self._builds.get(key)
            if build is None:
                continue
            try:
                built = self._build(key, build)
            except Exception as exc:  # the daemon keeps serving what it holds
                log.error("building %s failed: %s", self._building(key, build), exc)
                with self._lock:
                    build.error = str(exc) or type(exc).__name__
                self._on_change()
                continue
            if self._settle(key, built):
                self._on_change()
                self._persist(built)  # after serving it: digesting takes a while on a CPU

    def _build(self, key: str | None, build: _Build) -> ResidentWeights:
        if key is None:
            self._room(self._checkpoint_bytes, "the checkpoint layout")
            return self._load_checkpoint()
        assert build.plan is not None and build.summary is not None
        self._room(build.summary.param_bytes, f"layout {key[:12]}")
        with self._checkpoint_lease() as source:
            built, stats = build_layout(
                build.plan, key, build.summary, self.base_config, self._checkpoint_headers,
                self._backend, self._device, source,
            )  # fmt: skip
        log.info(
            "built layout %s: %d bytes in %.3f s (%d copies from the checkpoint layout, %d "
            "from disk)", key[:12], built.preloaded_weights_bytes, built.load_seconds,
            stats.copies_resident, stats.copies_disk,
        )  # fmt: skip
        return built

    @contextlib.contextmanager
    def _checkpoint_lease(self) -> Iterator[ResidentWeights | None]:
        with self._lock:
            held = self._checkpoint
            if held is not None:
                held.leases += 1
        try:
            yield held.resident if held else None
        finally:
            if held is not None:
                self._release(held)

    def _settle(self, key: str | None, built: ResidentWeights) -> bool:
        """A build is done: drop the checkpoint layout if nobody mapped it, then serve the
        build (so an engine told ``ok`` finds the dropped memory already released)."""
        with self._lock:
            unused = self._checkpoint is not None and self._checkpoint.fetches == 0
            retired = None
            if key is not None and unused and not self._keep_checkpoint and not self._closed:
                retired, self._checkpoint = self._checkpoint, None
                retired.retired = True
                close = retired.leases == 0
        if retired is not None:
            log.info("dropped the checkpoint layout: no engine mapped it")
            self._forget(None)
            if close:
                retired.resident.close()
        with self._lock:
            del self._builds[key]
            closed = self._closed
            if closed:
                pass
            elif key is None:
                self._checkpoint = _Held(built)
            else:
                self._layouts[key] = _Held(built)
        if closed:
            built.close()
        return not closed

    def close(self) -> None:
        """Release every layout (call only once no reply is being sent)."""
        with self._lock:
            self._closed = True
            held = self._all_held()
            self._checkpoint, self._layouts = None, {}
        self._jobs.put(_STOP)
        for h in held:
            h.resident.close()
