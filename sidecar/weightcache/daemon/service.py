"""The daemon process: lock the device, open the socket, load, serve, shut down cleanly."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from weightcache.checkpoint import cache_config, read_checkpoint
from weightcache.daemon import devicememory, digest_cuda, faults, health
from weightcache.daemon.generations import (
    CHECK_SECONDS,
    UNHELD_SECONDS,
    Generations,
    Kept,
    Room,
)
from weightcache.daemon.http import ALL_PATHS, METRICS_PATHS, HttpServer
from weightcache.daemon.layouts import DEFAULT_MAX_LAYOUTS, Holdings
from weightcache.daemon.lock import DeviceLock, lock_path
from weightcache.daemon.manifest import remove_manifest, save_manifest
from weightcache.daemon.readopt import ReadoptBudget, try_readopt
from weightcache.daemon.resident import ResidentWeights, load_from_disk, planned_bytes
from weightcache.daemon.seed import WAIT_SECONDS, Obtained, obtain_weights
from weightcache.daemon.server import ServerCounters, ServerLimits, SocketServer
from weightcache.daemon.statedir import prepare_state_dir
from weightcache.protocol import DaemonStatus, ShardSpec
from weightcache.report import PHASE_LOADING, PHASE_READOPTING, PHASE_WAITING_FOR_ROOM
from weightcache.sockets import PeerPolicy, listen_unix, prepare_socket_dir

log = logging.getLogger(__name__)


@dataclass
class DaemonOptions:
    model_dir: Path
    device: torch.device
    gpu: str  # the GPU's UUID, or "cpu"
    socket_path: str
    transport: str
    dtype: torch.dtype | None = None
    shard: ShardSpec = field(default_factory=ShardSpec)
    revision: str | None = None
    policy: PeerPolicy = field(default_factory=lambda: PeerPolicy(frozenset({os.getuid()})))
    limits: ServerLimits = field(default_factory=ServerLimits)
    # All four HTTP paths (loopback outside a pod), and /metrics alone (a pod's only port).
    http_address: tuple[str, int] | None = None
    metrics_address: tuple[str, int] | None = None
    # Where to record the socket's path for `weightcache-sidecar probe` (a pod's probes).
    socket_path_file: str | None = None
    drain_seconds: float = 10.0
    # /healthz fails once a load makes no progress for this long (see daemon.health).
    stall_seconds: float = health.STALL_SECONDS
    # Re-adoption's whole asking; each engine gets limits.timeout_seconds of it at most.
    readopt_seconds: float = 60.0
    # Copy the weights from a ready neighbour daemon holding the same ones (daemon.seed);
    # wait this long for one that is reading them from disk before reading it too.
    peer_seed: bool = True
    peer_wait_seconds: float = WAIT_SECONDS
    # Engine layouts (daemon.layouts): keep the checkpoint layout once one is built; how
    # many engine layouts may be held or built at once.
    keep_checkpoint_layout: bool = False
    max_layouts: int = DEFAULT_MAX_LAYOUTS
    # Earlier generations' weights taken back from live engines (daemon.generations): dropped
    # this long after no engine holds them, engines asked this often. "auto": every load
    # waits until it fits beside them; "surge": loads regardless.
    rollout: str = "auto"
    retained_grace_seconds: float = UNHELD_SECONDS
    retained_check_seconds: float = CHECK_SECONDS
    # How often the device's memory is sampled for the report (rewritten on 1 GiB moves).
    memory_sample_seconds: float = 10.0


class Daemon:
    def __init__(self, options: DaemonOptions) -> None:
        self.options = options
        self._state = "loading"
        self._error: str | None = None
        self._load_reason: str | None = None
        # What loading does now (DaemonStatus.phase): a start re-adopts first; until it says
        # otherwise, the operator keeps the gates of the engines that map the weights.
        self._phase: str | None = PHASE_READOPTING
        # How the weights came to be held at start (re-adopted, seeded, read from disk).
        self._resident: ResidentWeights | None = None
        self._holdings: Holdings | None = None
        self._server: SocketServer | None = None
        self._progress = health.LoadProgress()
        self._stop = threading.Event()
        self._generations = Generations(
            options.socket_path, options.policy, options.device,
            exchange_seconds=options.limits.timeout_seconds,
            unheld_seconds=options.retained_grace_seconds,
            check_seconds=options.retained_check_seconds, on_change=self._changed,
        )
        self._room = Room(options.device, options.rollout, self._generations,
                          devicememory.sample, on_change=self._changed,
                          progress=self._progress.mark, stop=self._stop)
        # Called with the new status whenever the state changes (the reporter).
        self.status_listeners: list[Callable[[DaemonStatus], None]] = []

    def status(self) -> DaemonStatus:
        r = self._resident
        served = 0
        if self._server is not None:
            with self._server.counters.lock:  # the kubelet's probes are no clients
                served = sum(n for op, n in self._server.counters.served.items() if op != "probe")
        h = self._holdings
        # Every layout held: the checkpoint's (unless dropped) and engines'.
        held, expected = h.totals() if h else (0, 0)
        memory = devicememory.sample(self.options.device)
        waiting = self._room.waiting
        return DaemonStatus(
            state=self._state,  # type: ignore[arg-type]
            pid=os.getpid(),
            device=str(self.options.device),
            gpu=self.options.gpu,
            transport_backend=r.transport if r else self.options.transport,
            preloaded_weights_bytes=held,
            expected_bytes=expected,
            fingerprint=h.base_fingerprint if h else None,
            load_seconds=r.load_seconds if r else None,
            load_source=r.load_source if r else None,  # type: ignore[arg-type]
            seeded_from=r.seeded_from if r else None,
            readopted=bool(r and r.load_source == "readopted"),
            socket=self.options.socket_path,
            clients_served=served,
            error=self._error,
            load_reason=self._load_reason,
            layouts=h.statuses() if h else [],
            warning=_manifest_warning(h.held() if h else [r] if r else []),
            phase=(PHASE_WAITING_FOR_ROOM if waiting and self._state == "loading"
                   else self._phase if self._state == "loading" else None),
            retained=self._generations.statuses(),
            memory_total_bytes=memory.total if memory else None,
            memory_free_bytes=max(0, memory.free) if memory else None,
            waiting_for_room=waiting,
        )

    def counters(self) -> ServerCounters:
        return self._server.counters if self._server is not None else ServerCounters()

    def liveness(self) -> health.Probe:
        return health.liveness(
            state=self._state,
            server_died=self._server is not None and self._server.died,
            phase=self._progress.phase,
            idle_seconds=self._progress.idle_seconds(),
            stall_seconds=self.options.stall_seconds,
        )

    def readiness(self) -> health.Probe:
        accepting = self._server is not None and self._server.accepting
        return health.readiness(state=self._state, accepting=accepting)

    def probe(self, check: str) -> tuple[bool, str]:
        """A probe over the socket: ``"live"`` or ``"ready"``, as (yes, why)."""
        answer = self.liveness() if check == "live" else self.readiness()
        return answer.code == 200, answer.body.strip()

    def request_stop(self, *_: object) -> None:
        self._stop.set()

    def _changed(self) -> None:
        """Something the status shows changed (kept generations, waiting for room)."""
        self._set_state(self._state, self._error)

    def _sample_memory(self) -> None:
        """Push the status now and then, for its memory figures (the reporter rewrites its
        report for them only when the free memory moved by 1 GiB)."""
        while not self._stop.wait(self.options.memory_sample_seconds):
            self._changed()

    def _set_state(self, state: str, error: str | None = None) -> None:
        self._state, self._error = state, error
        status = self.status()
        for listener in self.status_listeners:
            try:
                listener(status)
            except Exception:  # a broken listener must not take the daemon down
                log.exception("status listener failed")

    def _hold(
        self,
        checkpoint_layout: ResidentWeights | None,
        layouts: dict[str, ResidentWeights],
        disk: tuple,
    ) -> Holdings:
        """The layouts served from now on: those just obtained, and engine layouts built on
        demand (each with its manifest, for the next restart)."""
        opts = self.options
        checkpoint = read_checkpoint(opts.model_dir)
        base = cache_config(checkpoint, opts.device, opts.dtype, opts.shard, opts.revision)

        def reload() -> ResidentWeights:
            return load_from_disk(*disk)

        return Holdings(
            base_config=base,
            checkpoint=checkpoint,
            device=opts.device,
            transport=opts.transport,
            checkpoint_layout=checkpoint_layout,
            layouts=layouts,
            checkpoint_mapped=bool(
                checkpoint_layout and checkpoint_layout.load_source == "readopted"
            ),
            load_checkpoint=reload,
            persist=lambda built: save_manifest(opts.socket_path, opts.gpu, built),
            forget=lambda plan: remove_manifest(opts.socket_path, plan),
            keep_checkpoint=opts.keep_checkpoint_layout,
            max_layouts=opts.max_layouts,
            on_change=self._changed,
            room=self._room.wait,
            checkpoint_bytes=planned_bytes(*disk),
        )

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; return the process exit code."""
        opts = self.options
        prepare_socket_dir(opts.socket_path)
        prepare_state_dir(opts.socket_path)
        lock = DeviceLock(lock_path(opts.socket_path))
        lock.acquire()
        # Under the device lock, so replacing a stale socket file is ours to do.
        listener = listen_unix(opts.socket_path, backlog=128)
        self._server = SocketServer(
            listener, opts.policy, opts.limits, lambda: self._holdings, self.status, self.probe,
            probe_uid=os.geteuid(), kept=lambda: self._generations,
        )
        https = [
            HttpServer(*address, self, paths)
            for address, paths in ((opts.http_address, ALL_PATHS),
                                   (opts.metrics_address, METRICS_PATHS))
            if address is not None
        ]
        threading.Thread(target=self._server.serve_forever, daemon=True, name="socket").start()
        threading.Thread(target=self._sample_memory, daemon=True, name="memory").start()
        if opts.socket_path_file is not None:
            write_socket_path(opts.socket_path_file, opts.socket_path)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.request_stop)
            signal.signal(signal.SIGINT, self.request_stop)
        log.info("serving %s on %s (loading %s)", opts.device, opts.socket_path, opts.model_dir)
        self._set_state("loading")
        code = 0
        obtained: Obtained | None = None
        try:
            disk = (
                opts.model_dir,
                opts.device,
                opts.transport,
                opts.dtype,
                opts.shard,
                opts.revision,
            )
            faults.watch(opts.socket_path, self._stop)  # until the finally below
            digest_cuda.warm_up_async(opts.device)  # both re-adoption and seeding digest
            self._progress.mark("re-adopting")
            readoption = try_readopt(
                opts.socket_path,
                opts.gpu,
                opts.policy,
                *disk,
                budget=ReadoptBudget(opts.limits.timeout_seconds, opts.readopt_seconds),
                progress=self._progress.mark,
            )
            self._load_reason = readoption.reason
            for resident, manifest in readoption.kept:
                self._generations.add(Kept(resident, manifest, time.monotonic()))
            if readoption.kept:
                self._generations.start()  # asks the engines at once, then every 10 s
                self._changed()
            layouts = dict(readoption.residents)
            checkpoint_layout = layouts.pop(None, None)
            self._resident = checkpoint_layout or next(iter(layouts.values()), None)
            # Engine layouts re-adopted: the checkpoint layout is loaded only if kept or
            # also re-adopted (it is rebuilt from disk if an engine asks for it).
            if checkpoint_layout is None and (not layouts or opts.keep_checkpoint_layout):
                # Re-adoption is over: what it did not take back is loaded otherwise.
                self._phase = PHASE_LOADING
                self._set_state("loading")
                if self._generations:  # else nothing could give room back: load
                    self._progress.mark("checking for room beside the kept generations")
                    self._room.wait(planned_bytes(*disk), "the checkpoint layout")
                if self._stop.is_set():
                    log.info("stopped while waiting for room to load")
                    return 0  # the finally below releases what is held
                obtained = obtain_weights(
                    opts.socket_path,
                    opts.gpu,
                    *disk,
                    seed=opts.peer_seed,
                    wait_seconds=opts.peer_wait_seconds,
                    timeout=opts.limits.timeout_seconds,
                    progress=self._progress.mark,
                    keep_checkpoint=opts.keep_checkpoint_layout,
                )
                checkpoint_layout = obtained.resident
                layouts.update(obtained.layouts)  # seeded from a neighbour
                self._resident = self._resident or checkpoint_layout or next(
                    iter(obtained.layouts.values()), None
                )
                self._load_reason = f"{readoption.reason}; {obtained.reason}"
            r = self._resident
            assert r is not None
            self._holdings = self._hold(checkpoint_layout, layouts, disk)
            log.info(
                "ready: %d bytes resident via %s in %.2f s (%s), fingerprint %s",
                r.preloaded_weights_bytes,
                r.transport,
                r.load_seconds,
                r.load_source,
                r.fingerprint,
            )
            self._set_state("ready")
            if obtained is not None:
                obtained.release()  # neighbours waiting for our disk read now find us ready
            # Not one untimed wait: SIGTERM may be taken by another thread, and then the
            # main thread, asleep in the wait, would never run the Python handler.
            while not self._stop.wait(0.5):
                pass
        except Exception as exc:
            log.error("load failed: %s", exc)
            self._set_state("error", f"load failed: {exc}")
            code = 1
        finally:
            self._stop.set()  # ends the fault-injection watcher too
            if obtained is not None:
                obtained.release()
            drained = self._server.stop(opts.drain_seconds)
            for http in https:
                http.close()
            # A connection still sending must not see its fds closed (and their
            # numbers reused) under it; the process exit releases them instead.
            if drained:
                if self._holdings is not None:
                    self._holdings.close()
                elif self._resident is not None:
                    self._resident.close()
                self._generations.close()
            try:
                os.unlink(opts.socket_path)
            except FileNotFoundError:
                pass
            lock.release()
        return code


def _manifest_warning(held: list[ResidentWeights]) -> str | None:
    """The first layout whose manifest could not be written (its successor reloads it)."""
    return next((r.manifest_error for r in held if r.manifest_error), None)


def write_socket_path(path_file: str, socket_path: str) -> None:
    """Record the socket's path for the probes, replacing the file in one step."""
    tmp = f"{path_file}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(socket_path + "\n")
    os.replace(tmp, path_file)
