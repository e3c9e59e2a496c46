"""The only two paths between the real node's network namespace and the control plane.

The control plane listens on the host's loopback; the node (kubelet,
containerd, hostNetwork pods) lives in a namespace that has nothing but `lo`.
This process, started in the host namespace, joins them at exactly two points:

- **in**: a listener inside the namespace on the `kubernetes` Service's
  ClusterIP:443 (what kubelet dials, and what in-cluster clients find in
  KUBERNETES_SERVICE_HOST/PORT, with no kube-proxy) forwarding to the API
  server's loopback port;
- **out**: the API server's egress (`--egress-selector-config-file`, the
  `cluster` selection, HTTP CONNECT over a Unix socket) for `kubectl
  logs/exec` and the API server's proxy to pods: it dials into the namespace,
  and only the node's own address and its pods' subnet.

    python -m tools.testenv.bridge --netns PATH --listen IP:PORT --upstream PORT \
        --egress-socket PATH --allow CIDR [--allow CIDR ...]
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from tools.testenv import netns

MAX_CONNECT_REQUEST = 8192


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    """Copy src to dst until EOF, then half-close dst so the other direction can finish."""
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def splice(a: socket.socket, b: socket.socket) -> None:
    """Copy both ways until both sides are done; close both."""
    other = threading.Thread(target=_pipe, args=(b, a), daemon=True)
    other.start()
    _pipe(a, b)
    other.join()
    a.close()
    b.close()


def parse_connect(request: bytes) -> tuple[str, int]:
    """Target of an HTTP CONNECT request head (`CONNECT host:port HTTP/1.1`)."""
    line = request.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split()
    if len(parts) != 3 or parts[0] != "CONNECT" or not parts[2].startswith("HTTP/1."):
        raise ValueError(f"not an HTTP CONNECT request: {line!r}")
    host, sep, port = parts[1].rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"CONNECT target without a port: {parts[1]!r}")
    return host.strip("[]"), int(port)


def egress_allowed(host: str, allowed: list[ipaddress.IPv4Network | ipaddress.IPv6Network]
                   ) -> bool:
    """Only literal addresses inside an allowed network (no names: nothing to resolve)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return any(address in network for network in allowed)


def _read_head(conn: socket.socket) -> bytes:
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = conn.recv(1024)
        if not chunk:
            raise ValueError("connection closed before the CONNECT request ended")
        head += chunk
        if len(head) > MAX_CONNECT_REQUEST:
            raise ValueError("CONNECT request head too long")
    return head


class Bridge:
    def __init__(self, ns: Path, listen: tuple[str, int], upstream_port: int,
                 egress_socket: Path, allowed: list[str]) -> None:
        self.ns = ns
        self.upstream = ("127.0.0.1", upstream_port)
        self.allowed = [ipaddress.ip_network(a) for a in allowed]
        # Made inside the namespace; a socket stays in the namespace it was made in.
        with netns.entered(ns):
            self.inbound = socket.create_server(listen, backlog=128)
        egress_socket.unlink(missing_ok=True)
        self.egress = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.egress.bind(str(egress_socket))
        os.chmod(egress_socket, 0o600)
        self.egress.listen(128)

    def serve(self) -> None:
        threading.Thread(target=self._accept, args=(self.egress, self._egress), daemon=True).start()
        self._accept(self.inbound, self._inbound)

    def _accept(self, listener: socket.socket, handle: Callable[[socket.socket], None]) -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    def _inbound(self, conn: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=10)
        except OSError:
            conn.close()
            return
        upstream.settimeout(None)
        splice(conn, upstream)

    def _egress(self, conn: socket.socket) -> None:
        # This worker dials from inside the namespace; the listener threads stay outside.
        netns.enter_for_good(self.ns)
        try:
            host, port = parse_connect(_read_head(conn))
            if not egress_allowed(host, self.allowed):
                raise PermissionError(f"egress to {host} refused: only {self.allowed}")
            target = socket.create_connection((host, port), timeout=10)
        except (OSError, ValueError) as e:
            with contextlib.suppress(OSError):
                conn.sendall(f"HTTP/1.1 502 Bad Gateway\r\n\r\n{e}\n".encode())
            conn.close()
            return
        target.settimeout(None)
        conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        splice(conn, target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.testenv.bridge", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--netns", type=Path, required=True)
    parser.add_argument("--listen", required=True, help="IP:PORT inside the namespace")
    parser.add_argument("--upstream", type=int, required=True, help="API server port on 127.0.0.1")
    parser.add_argument("--egress-socket", type=Path, required=True)
    parser.add_argument("--allow", action="append", required=True,
                        help="network the egress may dial (CIDR; repeatable)")
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    bridge = Bridge(args.netns, (host, int(port)), args.upstream, args.egress_socket, args.allow)
    print("bridge: serving", flush=True)
    bridge.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
