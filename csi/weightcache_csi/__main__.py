"""`python -m weightcache_csi serve`: run the CSI node plugin.

    python -m weightcache_csi serve --endpoint /csi/csi.sock --node-id $NODE_NAME \
        --socket-root /var/run/weightcache=/host/sockets/0 [--socket-root ...]
    python -m weightcache_csi register --csi-address /csi/csi.sock \
        --kubelet-registration-path /var/lib/kubelet/plugins/weightcache.dev/csi.sock

Each `--socket-root` maps a socket directory the cluster's cache policy
allows (a host path, as WeightCaches name it in spec.socketDir) to where this
container sees it. Credentials: the pod's ServiceAccount, else $KUBECONFIG.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading


def _root(value: str) -> tuple[str, str]:
    host, sep, local = value.partition("=")
    if not sep or not host.startswith("/") or not local.startswith("/"):
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST_PATH=LOCAL_PATH")
    return host, local


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weightcache_csi", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve CSI Identity and Node on a Unix socket")
    serve.add_argument("--endpoint", required=True, help="the Unix socket path")
    serve.add_argument("--node-id", required=True)
    serve.add_argument("--socket-root", type=_root, action="append", required=True,
                       metavar="HOST_PATH=LOCAL_PATH")
    register = sub.add_parser("register", help="kubelet plugin registration "
                              "(node-driver-registrar's flags; registrar.py)")
    register.add_argument("--csi-address", required=True)
    register.add_argument("--kubelet-registration-path", required=True)
    register.add_argument("--plugin-registration-path", default="/registration")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "register":
        from .registrar import run

        return run(args.csi_address, args.kubelet_registration_path,
                   args.plugin_registration_path)

    from weightcache.kubeclient import api_client

    from .kube import CacheReader
    from .server import Node
    from .server import serve as start

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    node = Node(args.node_id, dict(args.socket_root), CacheReader(api_client()))
    server = start(args.endpoint, node)
    logging.getLogger("weightcache_csi").info("serving %s on %s", "weightcache.dev",
                                              args.endpoint)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    # Published mounts stay: they belong to the pods, not to this process.
    server.stop(grace=5).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
