"""The daemon's Unix socket: accept, check the peer, answer requests.

Each connection gets its own thread, up to ``max_connections``; beyond that a
client is told the daemon is busy instead of waiting, and so is a client whose
thread cannot be started (out of threads or memory): nothing one connection
meets ends the accept loop. Only a broken listener does, and then
:attr:`SocketServer.died` says so (liveness and readiness fail). Any bad frame
is answered with an error and its connection closed; other clients never
notice. When every slot is taken, a connection from the daemon's own uid
gets one of PROBE_SLOTS more, in which it may ask a liveness or readiness
probe (``weightcache-sidecar probe``) and nothing else: engines crowding the
socket cannot fail the daemon's probes.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from weightcache.protocol import (
    MAX_REQUEST_BYTES,
    MAX_REQUEST_FRAME,
    ErrorReply,
    FetchLayoutRequest,
    FetchStateReply,
    FetchStateRequest,
    PingReply,
    PingRequest,
    ProbeReply,
    ProbeRequest,
    ProtocolError,
    Request,
    StatusReply,
    StatusRequest,
    config_differences,
    decode_request,
)
from weightcache.sockets import PeerPolicy, peer_credentials, peer_groups
from weightcache.transport import choose_daemon_transport_backend
from weightcache.wire import PeerClosed, recv_frame, send_message

log = logging.getLogger(__name__)

MAX_ERROR_CHARS = 1024
# Beyond max_connections, for the daemon's own probes only.
PROBE_SLOTS = 4
# accept() errors that mean the listening socket itself is unusable.
_BROKEN_LISTENER = frozenset({errno.EBADF, errno.EINVAL, errno.ENOTSOCK, errno.EOPNOTSUPP})


@dataclass
class ServerLimits:
    # The largest request frame; requests are small (protocol.MAX_REQUEST_FRAME).
    max_frame: int = MAX_REQUEST_FRAME
    max_connections: int = 64
    # Per-connection: a client idle (or trickling bytes) this long is dropped.
    timeout_seconds: float = 10.0
    # Request bytes held by all connections together (read, not yet decoded): without
    # it, each connection could hold an unfinished frame of max_frame bytes.
    max_request_bytes: int = MAX_REQUEST_BYTES


class RequestBytesFull(RuntimeError):
    """Taking more request bytes would pass ``max_request_bytes``."""


class RequestBytes:
    """The request bytes every connection holds, bounded in total."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held = 0
        self._lock = threading.Lock()

    def change(self, n: int) -> None:
        """Take ``n`` bytes (give back when negative); ``RequestBytesFull`` past the limit."""
        with self._lock:
            if n > 0 and self._held + n > self.limit:
                raise RequestBytesFull(
                    f"busy: {self._held} bytes of requests in flight (limit {self.limit})"
                )
            self._held += n


@dataclass
class ServerCounters:
    """What the HTTP status and metrics show; updated under ``lock``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    active: int = 0
    served: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)

    def count(self, table: dict[str, int], key: str) -> None:
        with self.lock:
            table[key] = table.get(key, 0) + 1


class SocketServer:
    """Serves requests on ``listener`` until :meth:`stop`.

    ``holdings`` returns the daemon's layouts (a :class:`~.layouts.Holdings`,
    None while loading), ``status`` the current DaemonStatus and ``probe`` the
    answer to a liveness (``"live"``) or readiness (``"ready"``) probe, so the
    server never caches state that the service may change. ``probe_uid`` (the
    daemon's own) may probe past ``max_connections`` (PROBE_SLOTS).
    """

    def __init__(
        self,
        listener: socket.socket,
        policy: PeerPolicy,
        limits: ServerLimits,
        holdings: Callable[[], Any],
        status: Callable[[], object],
        probe: Callable[[str], tuple[bool, str]] | None = None,
        probe_uid: int | None = None,
        kept: Callable[[], Any] = lambda: None,
    ) -> None:
        self._listener = listener
        # Set here, not in serve_forever: stop() may close the listener before that runs.
        self._listener.settimeout(0.2)
        self._policy = policy
        self._limits = limits
        self._holdings = holdings
        self._status = status
        self._probe = probe
        self._probe_uid = probe_uid
        # Earlier generations' weights the daemon keeps (a generations.Generations): served
        # to a request for exactly their config, before (and while) the daemon loads its own.
        self._kept = kept
        self._slots = threading.BoundedSemaphore(limits.max_connections)
        self._probe_slots = threading.BoundedSemaphore(PROBE_SLOTS)
        self._request_bytes = RequestBytes(limits.max_request_bytes)
        self._stopping = threading.Event()
        self._threads: set[threading.Thread] = set()
        self._threads_lock = threading.Lock()
        self._loop = "new"  # -> "accepting" -> "stopped"
        self.counters = ServerCounters()

    @property
    def accepting(self) -> bool:
        """Whether the accept loop is running (readiness needs it)."""
        return self._loop == "accepting"

    @property
    def died(self) -> bool:
        """The accept loop ended without :meth:`stop`: nobody new will be served again."""
        return self._loop == "stopped" and not self._stopping.is_set()

    def serve_forever(self) -> None:
        self._loop = "accepting"
        try:
            self._accept_loop()
        except BaseException:
            log.exception("the socket server's accept loop died")
            raise
        finally:
            self._loop = "stopped"

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stopping.is_set():
                    return
                if exc.errno in _BROKEN_LISTENER:
                    # Not transient: the listener itself is gone. Say so (readiness and
                    # liveness fail) instead of spinning.
                    log.error("accept failed on a broken listener (%s); no longer accepting", exc)
                    return
                # Out of fds, buffers, or an aborted handshake: transient. Dying
                # here would leave a daemon that looks healthy and serves nobody.
                self.counters.count(self.counters.refused, "accept_error")
                log.warning("accept failed (%s); retrying", exc)
                time.sleep(0.1)
                continue
            try:
                self._admit(conn)
            except Exception:  # one connection must never end the loop
                self.counters.count(self.counters.refused, "admit_error")
                log.exception("admitting a connection failed; closed it")
                conn.close()

    def stop(self, grace_seconds: float = 10.0) -> bool:
        """Stop accepting; let in-flight connections finish for up to ``grace_seconds``.

        Returns whether every connection finished (False: some are still sending).
        """
        self._stopping.set()
        self._listener.close()
        deadline = time.monotonic() + grace_seconds
        with self._threads_lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in threads)

    def _admit(self, conn: socket.socket) -> None:
        conn.settimeout(self._limits.timeout_seconds)
        try:
            pid, uid, gid = peer_credentials(conn)
        except OSError:
            conn.close()
            return
        if not self._policy.allows(uid, gid, peer_groups(conn)):
            self.counters.count(self.counters.refused, "peer_credentials")
            log.warning("refused peer pid=%d uid=%d gid=%d: not in the allowlist", pid, uid, gid)
            self._reply_and_close(conn, f"peer uid {uid} / gid {gid} is not allowed")
            return
        slot = self._slots
        if not slot.acquire(blocking=False):
            # Every slot taken (engines crowding in): the daemon's own probes still pass.
            slot = self._probe_slots
            if uid != self._probe_uid or not slot.acquire(blocking=False):
                self.counters.count(self.counters.refused, "busy")
                self._reply_and_close(
                    conn, f"busy: {self._limits.max_connections} connections in progress",
                    retryable=True,
                )
                return
        thread = threading.Thread(target=self._serve_connection, args=(conn, slot), daemon=True)
        # Started and registered under one lock: stop() joins every registered thread, and
        # joining one not yet started raises (a SIGTERM right after an accept once ended
        # the daemon with "cannot join thread before it is started" instead of draining).
        with self._threads_lock:
            try:
                thread.start()
            except RuntimeError as exc:  # "can't start new thread": out of threads or memory
                failure = exc
            else:
                self._threads.add(thread)
                return
        slot.release()
        self.counters.count(self.counters.refused, "thread_start")
        log.warning("cannot start a thread for pid %d (%s); refused it", pid, failure)
        self._reply_and_close(
            conn, "busy: cannot start a thread for this connection", retryable=True
        )

    def _reply_and_close(self, conn: socket.socket, error: str, retryable: bool = False) -> None:
        if len(error) > MAX_ERROR_CHARS:
            # Decode errors quote the offending value, which may be megabytes long.
            error = error[:MAX_ERROR_CHARS] + "... (truncated)"
        try:
            send_message(conn, ErrorReply(v=1, error=error, retryable=retryable))
        except OSError:
            pass
        conn.close()

    def _serve_connection(self, conn: socket.socket, slot: threading.BoundedSemaphore) -> None:
        probes_only = slot is self._probe_slots
        with self.counters.lock:
            self.counters.active += 1
        try:
            while not self._stopping.is_set():
                request = self._read_request(conn)
                if request is None:
                    return
                if probes_only and not isinstance(request, ProbeRequest):
                    self.counters.count(self.counters.refused, "busy")
                    self._reply_and_close(
                        conn, f"busy: {self._limits.max_connections} connections in progress",
                        retryable=True,
                    )
                    return
                self._answer(conn, request)
        except (TimeoutError, OSError) as exc:
            # A slow, vanished or killed client: drop it, keep serving the rest.
            log.info("connection dropped: %s", exc)
        finally:
            conn.close()
            with self.counters.lock:
                self.counters.active -= 1
            slot.release()
            with self._threads_lock:
                self._threads.discard(threading.current_thread())

    def _read_request(self, conn: socket.socket) -> Request | None:
        """The next request, or None once the connection is done (closed, or refused)."""
        deadline = time.monotonic() + self._limits.timeout_seconds
        held = 0

        def charge(n: int) -> None:
            nonlocal held
            self._request_bytes.change(n)
            held += n

        try:
            body, _ = recv_frame(
                conn, self._limits.max_frame, max_fds=0, deadline=deadline, charge=charge
            )
            return decode_request(body)
        except PeerClosed:
            return None
        except RequestBytesFull as exc:
            self.counters.count(self.counters.refused, "request_bytes")
            self._reply_and_close(conn, str(exc), retryable=True)
            return None
        except ProtocolError as exc:
            self.counters.count(self.counters.refused, "bad_frame")
            self._reply_and_close(conn, str(exc))
            return None
        finally:
            self._request_bytes.change(-held)

    def _answer(self, conn: socket.socket, request: Request) -> None:
        if isinstance(request, PingRequest):
            send_message(conn, PingReply(v=1, pid=os.getpid()))
            op = "ping"
        elif isinstance(request, StatusRequest):
            send_message(conn, StatusReply(v=1, status=self._status()))
            op = "status"
        elif isinstance(request, ProbeRequest):
            if self._probe is None:
                ok, message = False, "this server answers no probes"
            else:
                ok, message = self._probe(request.check)
            send_message(conn, ProbeReply(v=1, ok=ok, message=message))
            op = "probe"
        elif isinstance(request, FetchStateRequest):
            op = "fetch_state"
            self._fetch_state(conn, request)
        else:
            op = "fetch_layout"
            self._fetch_layout(conn, request)
        self.counters.count(self.counters.served, op)

    def _still_loading(self, conn: socket.socket) -> None:
        send_message(
            conn,
            FetchStateReply(
                v=1, status="error", pid=os.getpid(), error="daemon is still loading",
                retryable=True,
            ),
        )

    def _serve_kept(self, conn: socket.socket, request: FetchStateRequest) -> bool:
        """Serve a kept earlier generation whose config is exactly the request's (an old
        engine restarting in its pod); False when none is kept for it."""
        kept = self._kept()
        if kept is None or request.config is None:
            return False
        with kept.lease(request.config) as resident:
            if resident is None:
                return False
            reply, backend = fetch_state_reply(request, resident)
            if backend is None:
                send_message(conn, reply)
            else:
                backend.send_fetch_state_response(conn, reply, resident.export)
        return True

    def _fetch_state(self, conn: socket.socket, request: FetchStateRequest) -> None:
        if self._serve_kept(conn, request):
            return
        holdings = self._holdings()
        if holdings is None:
            self._still_loading(conn)
            return
        # Leased while the reply is sent: a layout dropped meanwhile is closed only after.
        with holdings.checkpoint() as resident:
            if isinstance(resident, FetchStateReply):
                send_message(conn, resident)  # dropped: being rebuilt, or that failed
                return
            reply, backend = fetch_state_reply(request, resident)
            if backend is None:
                send_message(conn, reply)
            else:
                backend.send_fetch_state_response(conn, reply, resident.export)

    def _fetch_layout(self, conn: socket.socket, request: FetchLayoutRequest) -> None:
        asked = FetchStateRequest(v=1, config=msgspec.structs.replace(
            request.config, plan=request.plan_hash), transports=request.transports)
        if self._serve_kept(conn, asked):
            return
        holdings = self._holdings()
        if holdings is None:
            self._still_loading(conn)
            return
        with holdings.layout(request) as (reply, backend, export):
            if backend is None:
                send_message(conn, reply)
            else:
                backend.send_fetch_state_response(conn, reply, export)


def fetch_state_reply(request: FetchStateRequest, resident) -> tuple[FetchStateReply, object]:
    """The reply to ``request`` and the backend that sends it (None for refusals)."""
    common = dict(v=1, pid=os.getpid(), config=resident.config, fingerprint=resident.fingerprint)
    if request.config is not None and request.config != resident.config:
        fields = config_differences(request.config, resident.config)
        return FetchStateReply(
            status="mismatch",
            mismatched_fields=fields,
            error=f"config mismatch in: {', '.join(fields)}",
            **common,
        ), None
    try:
        backend = choose_daemon_transport_backend(resident.memory, request.transports)
    except RuntimeError as exc:
        return FetchStateReply(status="error", error=str(exc), **common), None
    return FetchStateReply(
        status="ok",
        transport_backend=backend.name,
        preloaded_weights_bytes=resident.preloaded_weights_bytes,
        layout=resident.layout,
        handles=resident.export.handles,
        **common,
    ), backend
