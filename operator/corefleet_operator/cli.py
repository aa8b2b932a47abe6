# SPDX-License-Identifier: Apache-2.0
"""The `corefleet` command.

  corefleet up         start a local Kubernetes control plane with the EngineCoreSet CRD and a fake
                       GPU node, and the operator against it; run until interrupted
                       (`--exit-when-ready` stops once all is healthy)
  corefleet operator   run the operator against the current kubeconfig (what the Deployment runs)
  corefleet version
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from corefleet_operator import __version__, constants, crd
from corefleet_operator.localcluster import (
    ControlPlaneError,
    LocalControlPlane,
    add_gpu_node,
    free_port,
    resolve_bin_dir,
    tail,
    wait_until,
)


def _healthy(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as r:
        status: int = r.status
        return status == 200


def cmd_up(args: argparse.Namespace) -> int:
    state = Path(args.state_dir) if args.state_dir else Path(tempfile.mkdtemp(prefix="corefleet-up-"))
    try:
        bin_dir = resolve_bin_dir()
    except ControlPlaneError as e:
        print(f"corefleet up: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    t0 = time.monotonic()
    print(f"corefleet up: starting a local control plane in {state}", flush=True)
    try:
        with LocalControlPlane(state_dir=state, bin_dir=bin_dir) as cp:
            add_gpu_node(cp, "gpu-node-0", gpus=args.gpus)
            cp.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(crd.crd()))
            cp.kubectl("wait", "--for=condition=Established", f"crd/{constants.CRD_NAME}", "--timeout=60s")
            health = f"http://127.0.0.1:{free_port()}/healthz"
            metrics_port = free_port()
            log = state / "operator.log"
            with log.open("wb") as logf:
                op = subprocess.Popen(
                    [sys.executable, "-m", "corefleet_operator", f"--liveness={health}",
                     f"--metrics-port={metrics_port}", "--metrics-address=127.0.0.1"],
                    env=cp.env(), stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
                try:
                    def operator_healthy() -> bool:
                        if op.poll() is not None:
                            raise ControlPlaneError(f"operator exited with {op.returncode}:\n{tail(log)}")
                        return _healthy(health)

                    wait_until(operator_healthy, 60, "operator liveness", fatal=(ControlPlaneError,))
                    print(f"corefleet up: control plane {cp.server} and operator (pid {op.pid}) healthy "
                          f"in {time.monotonic() - t0:.1f} s", flush=True)
                    print(f"  export KUBECONFIG={cp.kubeconfig}", flush=True)
                    print(f"  export PATH={bin_dir}:$PATH   # kubectl and helm", flush=True)
                    print("  kubectl apply -f manifests/samples/enginecoreset.yaml   # then: kubectl get ecs",
                          flush=True)
                    print(f"  operator log: {log}", flush=True)
                    print(f"  operator metrics: http://127.0.0.1:{metrics_port}/metrics", flush=True)
                    if args.exit_when_ready:
                        return 0
                    print("corefleet up: running; Ctrl-C stops everything it started", flush=True)
                    while not stop.wait(1.0):
                        if op.poll() is not None:
                            print(f"corefleet up: operator exited with {op.returncode}:\n{tail(log)}",
                                  file=sys.stderr)
                            return 1
                    return 0
                finally:
                    if op.poll() is None:
                        op.terminate()
                        try:
                            op.wait(15)
                        except subprocess.TimeoutExpired:
                            op.kill()
                            op.wait()
    except (ControlPlaneError, TimeoutError) as e:
        print(f"corefleet up: {e}", file=sys.stderr)
        return 1
    finally:
        print("corefleet up: stopped", flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="corefleet", description="corefleet: elastic vLLM engine-core fleets")
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a local control plane and the operator")
    up.add_argument("--state-dir", default=os.environ.get("COREFLEET_STATE_DIR"),
                    help="where the control plane keeps its state (default: a new temp dir)")
    up.add_argument("--gpus", type=int, default=8, help="nvidia.com/gpu capacity of the fake node")
    up.add_argument("--exit-when-ready", action="store_true", help="stop once everything is healthy")
    up.set_defaults(func=cmd_up)
    # Listed for --help; main() hands everything after "operator" to the operator's own parser.
    sub.add_parser("operator", help="run the operator against the current kubeconfig", add_help=False)
    ver = sub.add_parser("version", help="print the version")
    ver.set_defaults(func=lambda _: print(__version__) or 0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["operator"]:
        from corefleet_operator import __main__ as operator_main

        return operator_main.main(argv[1:])
    args = build_parser().parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
