"""The daemon process: lock the device, open the socket, load, serve, shut down cleanly."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from weightcache.daemon.http import start_http_server
from weightcache.daemon.lock import DeviceLock
from weightcache.daemon.manifest import save_manifest
from weightcache.daemon.readopt import try_readopt
from weightcache.daemon.resident import ResidentWeights, load_from_disk
from weightcache.daemon.server import (
    PeerPolicy,
    ServerLimits,
    SocketServer,
    bind_unix_socket,
    prepare_socket_dir,
)
from weightcache.protocol import DaemonStatus, ShardSpec

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
    http_address: tuple[str, int] | None = None
    drain_seconds: float = 10.0


class Daemon:
    def __init__(self, options: DaemonOptions) -> None:
        self.options = options
        self._state = "loading"
        self._error: str | None = None
        self._load_reason: str | None = None
        self._resident: ResidentWeights | None = None
        self._server: SocketServer | None = None
        self._stop = threading.Event()
        # Called with the new status whenever the state changes (the reporter).
        self.status_listeners: list[Callable[[DaemonStatus], None]] = []

    def status(self) -> DaemonStatus:
        r = self._resident
        served = 0
        if self._server is not None:
            with self._server.counters.lock:
                served = sum(self._server.counters.served.values())
        return DaemonStatus(
            state=self._state,  # type: ignore[arg-type]
            pid=os.getpid(),
            device=str(self.options.device),
            gpu=self.options.gpu,
            transport_backend=r.transport if r else self.options.transport,
            preloaded_weights_bytes=r.preloaded_weights_bytes if r else 0,
            expected_bytes=r.expected_bytes if r else 0,
            fingerprint=r.fingerprint if r else None,
            load_seconds=r.load_seconds if r else None,
            load_source=r.load_source if r else None,  # type: ignore[arg-type]
            readopted=bool(r and r.load_source == "readopted"),
            socket=self.options.socket_path,
            clients_served=served,
            error=self._error,
            load_reason=self._load_reason,
        )

    def request_stop(self, *_: object) -> None:
        self._stop.set()

    def _set_state(self, state: str, error: str | None = None) -> None:
        self._state, self._error = state, error
        status = self.status()
        for listener in self.status_listeners:
            try:
                listener(status)
            except Exception:  # a broken listener must not take the daemon down
                log.exception("status listener failed")

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; return the process exit code."""
        opts = self.options
        prepare_socket_dir(opts.socket_path)
        lock = DeviceLock(opts.socket_path + ".lock")
        lock.acquire()
        listener = bind_unix_socket(opts.socket_path)
        self._server = SocketServer(
            listener, opts.policy, opts.limits, lambda: self._resident, self.status
        )
        http = None
        if opts.http_address is not None:
            http = start_http_server(*opts.http_address, self.status, lambda: self._server.counters)
        threading.Thread(target=self._server.serve_forever, daemon=True, name="socket").start()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.request_stop)
            signal.signal(signal.SIGINT, self.request_stop)
        log.info("serving %s on %s (loading %s)", opts.device, opts.socket_path, opts.model_dir)
        self._set_state("loading")
        code = 0
        try:
            disk = (
                opts.model_dir,
                opts.device,
                opts.transport,
                opts.dtype,
                opts.shard,
                opts.revision,
            )
            readoption = try_readopt(opts.socket_path, opts.gpu, opts.policy, *disk)
            self._load_reason = readoption.reason
            self._resident = readoption.resident
            if self._resident is None:
                log.info("loading from disk: %s", readoption.reason)
                self._resident = load_from_disk(*disk)
                save_manifest(opts.socket_path, opts.gpu, self._resident)
            r = self._resident
            log.info(
                "ready: %d bytes resident via %s in %.2f s (%s), fingerprint %s",
                r.preloaded_weights_bytes,
                r.transport,
                r.load_seconds,
                r.load_source,
                r.fingerprint,
            )
            self._set_state("ready")
            # Not one untimed wait: SIGTERM may be taken by another thread, and then the
            # main thread, asleep in the wait, would never run the Python handler.
            while not self._stop.wait(0.5):
                pass
        except Exception as exc:
            log.error("load failed: %s", exc)
            self._set_state("error", f"load failed: {exc}")
            code = 1
        finally:
            drained = self._server.stop(opts.drain_seconds)
            if http is not None:
                http.shutdown()
            # A connection still sending must not see its fds closed (and their
            # numbers reused) under it; the process exit releases them instead.
            if self._resident is not None and drained:
                self._resident.close()
            try:
                os.unlink(opts.socket_path)
            except FileNotFoundError:
                pass
            lock.release()
        return code
