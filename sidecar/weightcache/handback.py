"""The engine's side of re-adoption: hand the weights' fds back to a restarting daemon.

An engine attached over an fd transport (vmm_fd, memfd) keeps the fds it
received. It listens on ``<socket dir>/engines/<pid>-<random>.sock`` (socket
0660; the random part because engines in different pods share the directory
and may have the same pid in their own PID namespaces). The daemon creates
``engines/`` with mode 3770 and its own group, so engines under other uids in
the daemon's group can add sockets the daemon may connect to, and none can
remove another's. The engine answers exactly one request, ``readopt``: from a
peer whose SO_PEERCRED uid or gid is allowed (:func:`weightcache.client.attach`
admits the daemon uid it verified at attach), naming the socket the engine
attached to and the fingerprint it holds, it replies with the allocation sizes
and the fds (SCM_RIGHTS). It keeps serving afterwards, since the next restart
may come. The daemon's side is ``weightcache.daemon.readopt``.

The driver refuses to export an *imported* VMM handle again, so a daemon that
re-adopts serves these very fds (duplicates of its predecessor's exports).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import socket
import threading
import time

from weightcache.protocol import (
    READOPT_MAX_FRAME,
    ProtocolError,
    ReadoptReply,
    ReadoptRequest,
    check_socket_path,
    decode_readopt_request,
)
from weightcache.sockets import PeerPolicy, engines_dir, listen_unix, peer_credentials
from weightcache.wire import PeerClosed, recv_frame, send_message

log = logging.getLogger(__name__)


class HandbackServer:
    """One attachment's hand-back socket, served by a daemon thread until :meth:`close`."""

    def __init__(
        self,
        daemon_socket_path: str,
        fingerprint: str,
        allocation_sizes: list[int],
        fds: list[int],
        policy: PeerPolicy | None = None,
        timeout: float = 5.0,
    ) -> None:
        """Does not take ownership of ``fds``: close this server before closing them."""
        self.socket_name = os.path.basename(daemon_socket_path)
        self.fingerprint = fingerprint
        self._sizes = list(allocation_sizes)
        self._fds = fds
        self._policy = policy or PeerPolicy(frozenset({os.getuid()}))
        self._timeout = timeout
        # Held while fds are sent, so close() never returns mid-send.
        self._lock = threading.Lock()
        self._closed = False
        # The daemon creates it (and keeps its mode); an engine only adds its socket.
        directory = engines_dir(daemon_socket_path)
        name = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.path = os.path.join(directory, f"{name}.sock")
        check_socket_path(self.path)
        self._listener = listen_unix(self.path, backlog=8)
        self._thread = threading.Thread(target=self._serve, daemon=True, name="wc-handback")
        self._thread.start()
        atexit.register(self.close)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                # Transient (out of fds, aborted handshake): keep offering.
                time.sleep(0.1)
                continue
            with conn:
                try:
                    self._answer(conn)
                except (OSError, PeerClosed) as exc:
                    log.info("hand-back connection dropped: %s", exc)
                except Exception:  # one bad exchange must not end the offer
                    log.exception("hand-back request failed")

    def _refuse(self, conn: socket.socket, error: str) -> None:
        send_message(conn, ReadoptReply(v=1, status="refused", pid=os.getpid(), error=error))

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(self._timeout)
        pid, uid, gid = peer_credentials(conn)
        if not self._policy.allows(uid, gid):
            log.warning("refused hand-back to pid %d uid %d gid %d: not allowed", pid, uid, gid)
            self._refuse(conn, f"peer uid {uid} / gid {gid} is not allowed")
            return
        try:
            # A deadline for the whole frame: one peer trickling bytes must not
            # hold the (single-threaded) offer for long.
            deadline = time.monotonic() + self._timeout
            body, _ = recv_frame(conn, READOPT_MAX_FRAME, max_fds=0, deadline=deadline)
            request = decode_readopt_request(body)
        except ProtocolError as exc:
            self._refuse(conn, str(exc))
            return
        refusal = self._refusal(request)
        if refusal is not None:
            self._refuse(conn, refusal)
            return
        with self._lock:
            if self._closed:
                self._refuse(conn, "engine is detaching")
                return
            reply = ReadoptReply(v=1, status="ok", pid=os.getpid(), allocation_sizes=self._sizes)
            send_message(conn, reply, fds=self._fds)
        log.info("handed %d allocation(s) back to pid %d", len(self._fds), pid)

    def _refusal(self, request: ReadoptRequest) -> str | None:
        if request.socket_name != self.socket_name:
            return f"attached to {self.socket_name}, not {request.socket_name}"
        if request.fingerprint != self.fingerprint:
            return f"holds fingerprint {self.fingerprint}, not {request.fingerprint}"
        return None

    def close(self) -> None:
        """Stop answering and remove the socket; in-flight hand-backs finish first."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        if self._thread is not threading.current_thread():
            self._thread.join(self._timeout + 1)
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def offer_handback(
    daemon_socket_path: str,
    fingerprint: str,
    allocation_sizes: list[int],
    fds: list[int],
    policy: PeerPolicy | None = None,
) -> tuple[HandbackServer | None, str | None]:
    """A :class:`HandbackServer`, or None and why not (logged) where the engines directory
    is unusable or its filesystem full.

    Attaching must not fail because a future daemon restart would be slower.
    """
    try:
        return HandbackServer(daemon_socket_path, fingerprint, allocation_sizes, fds, policy), None
    except (OSError, ValueError) as exc:
        why = ("cannot offer the weights back to a restarting daemon "
               f"(it will reload from disk): {exc}")
        log.warning("weights attached, but %s", why)
        return None, why
