"""`python -m weightcache_operator run`: run the operator; `... webhook`: serve the webhook.

    python -m weightcache_operator run [--metrics-port 8080]
        [--liveness http://0.0.0.0:8081/healthz] [--carry-seconds 120]
    python -m weightcache_operator webhook --port 9443 --cert tls.crt --key tls.key

The two run apart (the chart's operator Deployment and webhook Deployment), so
that admission does not depend on the operator being up (webhook.py).

Credentials come from the pod's ServiceAccount in a cluster, else $KUBECONFIG.
What WeightCaches may ask for (images, host paths, transports) comes from
$WEIGHTCACHE_POLICY (weightcache_operator.policy), which the chart sets.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .gate import CARRY_SECONDS


def _run(args: argparse.Namespace) -> int:
    import kopf

    from . import handlers, metrics  # noqa: F401 - importing registers the handlers
    from .policy import PolicyError, policy_from_env

    try:
        policy = policy_from_env()
    except PolicyError as exc:
        print(f"weightcache-operator: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    memo = kopf.Memo(policy=policy, carry_seconds=args.carry_seconds)
    if args.metrics_port:
        metrics.serve(args.metrics_port, args.metrics_addr)
    kopf.run(
        standalone=True,
        clusterwide=True,
        liveness_endpoint=args.liveness or None,
        memo=memo,
    )
    return 0


def _webhook(args: argparse.Namespace) -> int:
    from .webhook import WebhookConfig, run

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    run(WebhookConfig(args.port, args.cert, args.key, args.address))
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
    run.add_argument("--carry-seconds", type=float, default=CARRY_SECONDS,
                     help="keep a replaced daemon pod's verdict (its node's engine gates) at "
                     "most this long, until its successor says whether it took the weights "
                     f"back (default {CARRY_SECONDS:g}; 0: never)")
    run.add_argument("-v", "--verbose", action="store_true")
    run.set_defaults(func=_run)
    hook = sub.add_parser("webhook", help="serve the mutating admission webhook (HTTPS)")
    hook.add_argument("--port", type=int, default=9443)
    hook.add_argument("--address", default="0.0.0.0")
    hook.add_argument("--cert", required=True, help="the serving certificate (PEM)")
    hook.add_argument("--key", required=True, help="its private key (PEM)")
    hook.add_argument("-v", "--verbose", action="store_true")
    hook.set_defaults(func=_webhook)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
