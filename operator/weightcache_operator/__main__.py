"""`python -m weightcache_operator`: run the operator, or print its RBAC rules.

    python -m weightcache_operator run [--metrics-port 8080]
        [--liveness http://0.0.0.0:8081/healthz] [--sidecar-image IMAGE]
    python -m weightcache_operator rbac

Credentials come from the pod's ServiceAccount in a cluster, else $KUBECONFIG.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import yaml


def _run(args: argparse.Namespace) -> int:
    import kopf

    from . import handlers, metrics  # noqa: F401 - importing registers the handlers

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.metrics_port:
        metrics.serve(args.metrics_port, args.metrics_addr)
    kopf.run(
        standalone=True,
        clusterwide=True,
        liveness_endpoint=args.liveness or None,
        memo=kopf.Memo(sidecar_image=args.sidecar_image or None),
    )
    return 0


def _rbac(_: argparse.Namespace) -> int:
    from . import rbac

    docs = [
        rbac.cluster_role("weightcache-operator", rbac.OPERATOR_RULES),
        rbac.cluster_role("weightcache-daemon", rbac.DAEMON_RULES),
    ]
    yaml.safe_dump_all(docs, sys.stdout, sort_keys=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weightcache-operator", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the operator")
    run.add_argument("--metrics-port", type=int, default=8080,
                     help="Prometheus /metrics port; 0 disables")
    run.add_argument("--metrics-addr", default="0.0.0.0")
    run.add_argument("--liveness", default="http://0.0.0.0:8081/healthz",
                     help="kopf liveness endpoint URL; empty disables")
    run.add_argument("--sidecar-image", default=os.environ.get("WEIGHTCACHE_SIDECAR_IMAGE", ""),
                     help="daemon image for caches that set no spec.sidecar.image")
    run.add_argument("-v", "--verbose", action="store_true")
    run.set_defaults(func=_run)
    sub.add_parser("rbac", help="print the ClusterRoles as YAML").set_defaults(func=_rbac)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
