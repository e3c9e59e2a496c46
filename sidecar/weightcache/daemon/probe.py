"""``weightcache-sidecar probe live|ready``: the kubelet's probe, asked over the daemon's socket.

The DaemonSet's liveness and readiness probes are exec probes running this in
the daemon's container, so no port anyone can reach decides whether a daemon
is in service (docs/security.md). It connects to the daemon's Unix socket,
checks that the listener runs as this process's uid (the daemon's: the
container's), asks the question and exits 0 on yes, 1 on no or no answer,
printing the daemon's reason; 2 on a usage error.

Inside a pod the socket's name carries the GPU's UUID, which only the daemon
resolves: the daemon writes its socket's path to ``--socket-path-file`` once
it listens, and the probe reads it from there. This module imports no torch,
so the probe starts in a fraction of a second (benchmarks/probe_start.py).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

from weightcache.protocol import ErrorReply, ProbeReply, ProbeRequest, decode_reply
from weightcache.sockets import peer_credentials
from weightcache.wire import recv_frame, send_message

# A probe reply is a few dozen bytes.
MAX_REPLY_FRAME = 64 * 1024


def read_socket_path(path_file: str) -> str:
    """The socket path a daemon recorded in ``path_file`` (see ``serve --socket-path-file``)."""
    with open(path_file, encoding="utf-8") as f:
        return f.read(4096).strip()


def ask(socket_path: str, check: str, timeout: float) -> tuple[bool, str]:
    """(answer, reason) from the daemon on ``socket_path``; connection trouble answers no."""
    deadline = time.monotonic() + timeout
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(socket_path)
            _, uid, _ = peer_credentials(sock)
            if uid != os.geteuid():
                return False, f"{socket_path} is served by uid {uid}, not {os.geteuid()}"
            send_message(sock, ProbeRequest(v=1, check=check))
            body, _ = recv_frame(sock, MAX_REPLY_FRAME, max_fds=0, deadline=deadline)
        reply = decode_reply(body)
    except (OSError, RuntimeError, EOFError) as exc:  # RuntimeError: ProtocolError
        return False, f"{socket_path}: {exc}"
    if isinstance(reply, ProbeReply):
        return reply.ok, reply.message
    if isinstance(reply, ErrorReply):
        return False, reply.error
    return False, f"unexpected reply {type(reply).__name__} from {socket_path}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightcache-sidecar probe", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("check", choices=("live", "ready"))
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket", help="the daemon's socket")
    where.add_argument("--socket-path-file", help="a file holding the socket's path")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        path = args.socket or read_socket_path(args.socket_path_file)
    except (OSError, UnicodeDecodeError) as exc:
        print(f"not {args.check}: {args.socket_path_file}: {exc}", file=sys.stderr)
        return 1
    ok, message = ask(path, args.check, args.timeout)
    print(message or ("ok" if ok else f"not {args.check}"), file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1
