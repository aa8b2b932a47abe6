# SPDX-License-Identifier: Apache-2.0
"""`python -m corefleet_operator`: run the operator (kopf) against the current kubeconfig."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from corefleet_operator import constants


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="corefleet-operator", description=__doc__)
    p.add_argument("-n", "--namespace", action="append", default=[],
                   help="watch only this namespace (repeatable); default: the whole cluster")
    p.add_argument("--liveness", default=f"http://0.0.0.0:{constants.OPERATOR_HEALTH_PORT}/healthz",
                   help="kopf's liveness endpoint (empty to disable)")
    p.add_argument("--metrics-port", type=int, default=constants.OPERATOR_METRICS_PORT,
                   help="port of the Prometheus metrics endpoint (0 to disable)")
    p.add_argument("--metrics-address", default="0.0.0.0", help="address of the metrics endpoint")
    p.add_argument("--resync-seconds", type=float, default=60.0,
                   help="reconcile every fleet at least this often, even when nothing was seen")
    p.add_argument("--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import kopf
    import prometheus_client

    import corefleet_operator.handlers  # noqa: F401  (registers the handlers)

    if args.metrics_port:
        prometheus_client.start_http_server(args.metrics_port, addr=args.metrics_address)
    kopf.run(
        memo=kopf.Memo(resync_seconds=args.resync_seconds),
        standalone=True,  # one operator replica; no peering CRDs needed
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
