"""``weightcache-sidecar``: run the daemon (``serve``), ask one for its status (``status``),
or answer the kubelet's probe (``probe``).

``probe`` runs every few seconds in every daemon container, so it must start
fast: it is dispatched before anything imports torch, and the modules that do
(the daemon, the transports, the checkpoint reader) are imported where
``serve`` and ``status`` need them, not at the top of this module.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from weightcache.daemon.health import STALL_SECONDS
from weightcache.daemon.lock import DaemonAlreadyRunning
from weightcache.protocol import (
    MAX_REQUEST_BYTES,
    MAX_REQUEST_FRAME,
    ShardSpec,
    check_socket_path,
    socket_path,
)
from weightcache.shard import PLAN_NAMES, ShardError, check_spec
from weightcache.sockets import PeerPolicy

if TYPE_CHECKING:
    from weightcache.daemon.service import DaemonOptions


def _http_address(value: str) -> tuple[str, int] | None:
    if value == "none":
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT or 'none', got {value!r}")
    return host or "0.0.0.0", int(port)


def _cache_name(value: str) -> tuple[str, str]:
    namespace, sep, name = value.partition(".")
    if not sep or not namespace or not name:
        raise argparse.ArgumentTypeError(f"expected NAMESPACE.NAME, got {value!r}")
    return namespace, name


def _non_negative_int(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value!r}")
    return int(value)


def _positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return int(value)


def _non_negative_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {value!r}")
    return number


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
    return number


def build_parser() -> argparse.ArgumentParser:
    from weightcache.checkpoint import TORCH_DTYPES
    from weightcache.daemon.generations import CHECK_SECONDS, UNHELD_SECONDS
    from weightcache.daemon.layouts import DEFAULT_MAX_LAYOUTS
    from weightcache.daemon.seed import WAIT_SECONDS
    from weightcache.transport import TRANSPORT_NAMES

    parser = argparse.ArgumentParser(prog="weightcache-sidecar", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="load a checkpoint and serve it over a Unix socket")
    serve.add_argument("--model", required=True, type=Path, help="safetensors checkpoint directory")
    serve.add_argument("--device", default="cpu", help="cpu or cuda:N (default: cpu)")
    serve.add_argument("--gpu-uuid", help="pin to the GPU with this UUID instead of --device")
    where = serve.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket", help="socket path")
    where.add_argument("--socket-dir", help="derive <dir>/<namespace>.<name>/gpu-<UUID>.sock")
    serve.add_argument("--cache", type=_cache_name, help="NAMESPACE.NAME, with --socket-dir")
    serve.add_argument("--transport", default="auto", choices=("auto", *TRANSPORT_NAMES))
    serve.add_argument("--dtype", choices=sorted(TORCH_DTYPES), help="cast floating-point weights")
    serve.add_argument("--revision", help="model revision recorded in the CacheConfig")
    serve.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size")
    serve.add_argument("--tp-rank", type=int, default=0, help="the rank whose shard to hold")
    serve.add_argument(
        "--shard-plan", choices=PLAN_NAMES, help="how tensors split across ranks (--tp-size > 1)"
    )
    serve.add_argument(
        "--allow-uid",
        type=_non_negative_int,
        action="append",
        default=[],
        help="peer uid allowed to connect (repeatable; default: the daemon's own)",
    )
    serve.add_argument(
        "--allow-gid",
        type=_non_negative_int,
        action="append",
        default=[],
        help="peer gid allowed to connect (repeatable)",
    )
    serve.add_argument("--max-connections", type=int, default=64)
    serve.add_argument(
        "--timeout", type=_positive_float, default=10.0, help="per-connection timeout in seconds"
    )
    serve.add_argument(
        "--max-frame",
        type=int,
        default=MAX_REQUEST_FRAME,
        help=f"largest request frame in bytes (default {MAX_REQUEST_FRAME})",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=MAX_REQUEST_BYTES,
        help="request bytes all connections may hold unfinished together "
        f"(default {MAX_REQUEST_BYTES})",
    )
    serve.add_argument(
        "--readopt-seconds",
        type=_positive_float,
        default=60.0,
        help="bound on asking engines for their weights at start, all engines together; "
        "each engine gets --timeout of it at most (default 60)",
    )
    serve.add_argument(
        "--no-peer-seed",
        dest="peer_seed",
        action="store_false",
        help="never copy the weights from a neighbour daemon of this socket directory",
    )
    serve.add_argument(
        "--peer-wait-seconds",
        type=_non_negative_float,
        default=WAIT_SECONDS,
        help="how long to wait for a neighbour that is reading the same weights from disk "
        f"before reading them too (default {WAIT_SECONDS:g})",
    )
    serve.add_argument(
        "--keep-checkpoint-layout",
        action="store_true",
        help="keep the checkpoint's own layout once an engine layout is built from it "
        "(default: drop it when no engine mapped it; it is rebuilt from disk on demand)",
    )
    serve.add_argument(
        "--max-layouts",
        type=_positive_int,
        default=DEFAULT_MAX_LAYOUTS,
        help="engine layouts (load plans) held or built at once; more are refused "
        f"(default {DEFAULT_MAX_LAYOUTS})",
    )
    serve.add_argument(
        "--rollout",
        choices=("auto", "surge"),
        default="auto",
        help="auto (default): while earlier generations' weights are kept (taken back from "
        "live engines after a model change), a load waits until the device's free memory "
        "holds it plus 256 MiB; surge: load regardless",
    )
    serve.add_argument(
        "--retained-grace-seconds",
        type=_positive_float,
        default=UNHELD_SECONDS,
        help="drop an earlier generation's kept weights once no engine held them this long "
        f"(default {UNHELD_SECONDS:g})",
    )
    serve.add_argument(
        "--retained-check-seconds",
        type=_positive_float,
        default=CHECK_SECONDS,
        help="ask the engines' hand-back sockets this often whether they still hold kept "
        f"weights (default {CHECK_SECONDS:g})",
    )
    serve.add_argument(
        "--stall-seconds",
        type=_positive_float,
        default=STALL_SECONDS,
        help="/healthz fails once loading makes no progress for this long "
        f"(default {STALL_SECONDS:g})",
    )
    serve.add_argument(
        "--http-address",
        type=_http_address,
        default=("127.0.0.1", 8470),
        help="HOST:PORT for /healthz /readyz /status /metrics, or 'none' "
        "(default 127.0.0.1:8470; a pod uses 'none': its probes are `probe`)",
    )
    serve.add_argument(
        "--metrics-address",
        type=_http_address,
        default=None,
        help="HOST:PORT serving /metrics alone, e.g. 0.0.0.0:PORT in a pod (default: none)",
    )
    serve.add_argument(
        "--socket-path-file",
        help="write the socket's path here once it listens (for `probe --socket-path-file`)",
    )

    status = sub.add_parser("status", help="print a daemon's status as JSON")
    where = status.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket")
    where.add_argument("--socket-path-file", help="a file holding the socket's path")
    # Parsed by weightcache.daemon.probe (main dispatches it first); listed here for --help.
    sub.add_parser("probe", add_help=False,
                   help="exit 0 if the daemon is live/ready (`probe --help`)")
    return parser


def _options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> DaemonOptions:
    from weightcache.checkpoint import dtype_from_name
    from weightcache.daemon.server import ServerLimits
    from weightcache.daemon.service import DaemonOptions
    from weightcache.devices import resolve_device
    from weightcache.transport import default_daemon_transport

    device, gpu = resolve_device(args.device, args.gpu_uuid)
    if args.socket_dir is not None:
        if args.cache is None:
            parser.error("--socket-dir needs --cache NAMESPACE.NAME")
        path = socket_path(args.socket_dir, *args.cache, None if gpu == "cpu" else gpu)
    else:
        path = os.path.abspath(args.socket)
        check_socket_path(path)
    if args.tp_size < 1 or not 0 <= args.tp_rank < args.tp_size:
        parser.error(
            f"--tp-rank must be in [0, --tp-size); got rank {args.tp_rank} of {args.tp_size}"
        )
    shard = ShardSpec(tp_size=args.tp_size, tp_rank=args.tp_rank, plan=args.shard_plan)
    try:
        check_spec(shard)
    except ShardError as exc:
        parser.error(f"--tp-size/--tp-rank/--shard-plan: {exc}")
    if args.max_connections < 1:
        parser.error("--max-connections must be at least 1")
    transport = default_daemon_transport(device) if args.transport == "auto" else args.transport
    # The daemon's own uid always (its probes); by default no other.
    uids = frozenset(args.allow_uid) | {os.getuid()}
    return DaemonOptions(
        model_dir=args.model,
        device=device,
        gpu=gpu,
        socket_path=path,
        transport=transport,
        dtype=dtype_from_name(args.dtype) if args.dtype else None,
        shard=shard,
        revision=args.revision,
        policy=PeerPolicy(uids, frozenset(args.allow_gid)),
        limits=ServerLimits(
            args.max_frame, args.max_connections, args.timeout, args.max_request_bytes
        ),
        http_address=args.http_address,
        metrics_address=args.metrics_address,
        socket_path_file=args.socket_path_file,
        stall_seconds=args.stall_seconds,
        readopt_seconds=args.readopt_seconds,
        peer_seed=args.peer_seed,
        peer_wait_seconds=args.peer_wait_seconds,
        keep_checkpoint_layout=args.keep_checkpoint_layout,
        max_layouts=args.max_layouts,
        rollout=args.rollout,
        retained_grace_seconds=args.retained_grace_seconds,
        retained_check_seconds=args.retained_check_seconds,
    )


def _serve(options: DaemonOptions) -> int:
    """Run the daemon; inside a pod (POD_NAME/POD_NAMESPACE set) also report to Kubernetes."""
    from weightcache.daemon.reporter import PodReporter
    from weightcache.daemon.service import Daemon

    daemon = Daemon(options)
    reporter = PodReporter.from_env()
    if reporter is None:
        return daemon.run()
    reporter.start()
    daemon.status_listeners.append(reporter.update)
    try:
        return daemon.run()
    finally:
        reporter.stop()  # waits briefly so the final (error or stopping) report lands


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["probe"]:
        from weightcache.daemon.probe import main as probe

        return probe(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "status":
        from weightcache.client import daemon_status
        from weightcache.daemon.probe import read_socket_path

        try:
            status = daemon_status(args.socket or read_socket_path(args.socket_path_file))
        except (OSError, RuntimeError) as exc:
            print(f"weightcache-sidecar: {exc}", file=sys.stderr)
            return 1
        print(json.dumps(msgspec.to_builtins(status), indent=2, sort_keys=True))
        return 0
    try:
        options = _options(args, parser)
        return _serve(options)
    except (DaemonAlreadyRunning, ValueError, RuntimeError, OSError) as exc:
        print(f"weightcache-sidecar: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
