# SPDX-License-Identifier: Apache-2.0
"""The `corefleet` command.

  corefleet up [-- VLLM_FLAGS]  a local fleet without Kubernetes: the coordinator, the frontend and N
                       engines (real vLLM, or the emulator) as processes on 127.0.0.1; prints the
                       OpenAI endpoint and runs until interrupted (`--detach` leaves it running).
                       The logic is in `corefleet_harness.local`.
  corefleet status     the local fleet's processes (alive, RSS) and its ranks from the admin API
  corefleet scale N    resize the running local fleet to N ranks in place (the frontend's resize
                       operation: new engines join, leaving ones drain and retire; survivors untouched)
  corefleet down       stop exactly the local fleet's recorded processes
  corefleet cluster up start a local Kubernetes control plane with the EngineCoreSet CRD and a fake
                       GPU node, and the operator against it; run until interrupted
                       (`--exit-when-ready` stops once all is healthy)
  corefleet operator   run the operator against the current kubeconfig (what the Deployment runs)
  corefleet version
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType

from corefleet_client.frontend.types import DEFAULT_ROUTING, ENV_ROUTING, RoutingPolicy
from corefleet_harness import local
from corefleet_harness.localcluster import ControlPlaneError, LocalControlPlane, add_gpu_node, resolve_bin_dir
from corefleet_harness.support import free_port, http_get, tail, wait_until
from corefleet_harness.tinymodel import VLLM_CPU_FLAGS
from corefleet_operator import __version__, constants, crd


def cmd_cluster_up(args: argparse.Namespace) -> int:
    state = Path(args.state_dir) if args.state_dir else Path(tempfile.mkdtemp(prefix="corefleet-up-"))
    try:
        bin_dir = resolve_bin_dir()
    except ControlPlaneError as e:
        print(f"corefleet cluster up: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    t0 = time.monotonic()
    print(f"corefleet cluster up: starting a local control plane in {state}", flush=True)
    try:
        with LocalControlPlane(state_dir=state, bin_dir=bin_dir) as cp:
            add_gpu_node(cp, "gpu-node-0", gpus=args.gpus)
            cp.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(crd.crd()))
            cp.wait_established(constants.CRD_NAME)
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
                        return http_get(health, 2)[0] == 200

                    wait_until(operator_healthy, 60, "operator liveness", interval=0.1, retry_on=(Exception,),
                               fatal=(ControlPlaneError,))
                    print(f"corefleet cluster up: control plane {cp.server} and operator (pid {op.pid}) healthy "
                          f"in {time.monotonic() - t0:.1f} s", flush=True)
                    print(f"  export KUBECONFIG={cp.kubeconfig}", flush=True)
                    print(f"  export PATH={bin_dir}:$PATH   # kubectl and helm", flush=True)
                    print("  kubectl apply -f manifests/samples/enginecoreset.yaml   # then: kubectl get ecs",
                          flush=True)
                    print(f"  operator log: {log}", flush=True)
                    print(f"  operator metrics: http://127.0.0.1:{metrics_port}/metrics", flush=True)
                    if args.exit_when_ready:
                        return 0
                    print("corefleet cluster up: running; Ctrl-C stops everything it started", flush=True)
                    while not stop.wait(1.0):
                        if op.poll() is not None:
                            print(f"corefleet cluster up: operator exited with {op.returncode}:\n{tail(log)}",
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
        print(f"corefleet cluster up: {e}", file=sys.stderr)
        return 1
    finally:
        print("corefleet cluster up: stopped", flush=True)


def _local_options(args: argparse.Namespace) -> local.FleetOptions:
    return local.FleetOptions(
        replicas=args.replicas, engine=args.engine, model=args.model, port=args.port,
        state_dir=_state_dir(args), vllm_flags=tuple(args.vllm_flags) if args.vllm_flags else None,
        moe=args.moe, token_delay_ms=args.token_delay_ms, ready_timeout=args.timeout,
        elastic_ep_max=args.elastic_ep_max, gpus_per_rank=args.gpus_per_rank, frontends=args.frontends,
    )


def _state_dir(args: argparse.Namespace) -> Path:
    return Path(args.state_dir) if args.state_dir else local.default_state_dir()


def cmd_up(args: argparse.Namespace) -> int:
    try:
        opts = _local_options(args)
        opts.validate()
    except local.LocalFleetError as e:
        print(f"corefleet up: {e}", file=sys.stderr)
        return 2
    if args.routing is not None:  # the frontends read it, restarted ones too (the supervisor passes it on)
        os.environ[ENV_ROUTING] = args.routing
    return local.up(opts, detach=args.detach)


def cmd_status(args: argparse.Namespace) -> int:
    try:
        return local.status(_state_dir(args))
    except local.LocalFleetError as e:
        print(f"corefleet status: {e}", file=sys.stderr)
        return 1


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    """An event SIGINT and SIGTERM set while the block runs (their handlers restored after it)."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def cmd_scale(args: argparse.Namespace) -> int:
    with _stop_on_signals() as stop:
        return local.scale(_state_dir(args), args.replicas, join_timeout=args.timeout,
                           drain_timeout=args.drain_timeout, stop=stop)


def cmd_supervise(args: argparse.Namespace) -> int:
    with _stop_on_signals() as stop:
        try:
            return local.supervise(_state_dir(args), stop)
        except local.LocalFleetError as e:
            print(f"corefleet supervise: {e}", file=sys.stderr)
            return 1


def cmd_down(args: argparse.Namespace) -> int:
    try:
        return local.down(_state_dir(args))
    except local.LocalFleetError as e:
        print(f"corefleet down: {e}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="corefleet", description="corefleet: elastic vLLM engine-core fleets")
    sub = p.add_subparsers(dest="command", required=True)
    state_help = f"where the local fleet keeps its state file, token and logs (default {local.default_state_dir()})"

    up = sub.add_parser(
        "up", help="run a local fleet (coordinator, frontend, engines) as processes on 127.0.0.1",
        usage="corefleet up [options] [-- VLLM_FLAGS...]",
        description="Start a local fleet and print its OpenAI endpoint. vLLM flags after `--` replace the "
                    "defaults (" + " ".join(VLLM_CPU_FLAGS) + ").")
    up.add_argument("--replicas", type=int, default=local.DEFAULT_REPLICAS, help="data-parallel ranks (engines)")
    up.add_argument("--engine", choices=local.ENGINE_KINDS, default=local.ENGINE_VLLM,
                    help="real vLLM engines, or the engine emulator (fast, for tests)")
    up.add_argument("--model", help="model directory or name (default: a tiny llama written into the state dir, "
                                    "dummy weights)")
    up.add_argument("--moe", action="store_true", help="with the default model: its Mixtral (MoE) variant")
    up.add_argument("--port", type=int, default=local.DEFAULT_PORT, help="the OpenAI API's port on 127.0.0.1")
    up.add_argument("--frontends", type=int, default=1,
                    help="frontend processes, each a client of every engine, sharing the OpenAI API's port (dense "
                         "models; default 1)")
    up.add_argument("--state-dir", help=state_help)
    up.add_argument("--detach", action="store_true", help="return once the fleet serves and leave it running")
    up.add_argument("--timeout", type=float, help="seconds to wait for the fleet to serve (default: "
                    + ", ".join(f"{k} {v:.0f}" for k, v in local.DEFAULT_READY_TIMEOUT.items()) + ")")
    up.add_argument("--routing", choices=tuple(RoutingPolicy),
                    help=f"how the frontends route requests to the ranks (default ${ENV_ROUTING}, else "
                         f"{DEFAULT_ROUTING}): least-loaded, or prefix-affinity (a prompt's prefix to the rank that "
                         "holds it, bounded by load)")
    up.add_argument("--token-delay-ms", type=int, help="the emulator's delay per generated token")
    up.add_argument("--elastic-ep-max", type=int, metavar="N",
                    help="MoE models: resize with vLLM's elastic EP up to N ranks (engine 0 serves the coordination "
                         "stores; vLLM runs EPLB on GPUs only, or use --engine emulator)")
    up.add_argument("--gpus-per-rank", type=int, default=0, metavar="G",
                    help="give each engine rank its own G GPUs (CUDA_VISIBLE_DEVICES); 0: leave them as they are")
    up.set_defaults(func=cmd_up, vllm_flags=[])

    status = sub.add_parser("status", help="the local fleet's processes and ranks")
    status.add_argument("--state-dir", help=state_help)
    status.set_defaults(func=cmd_status)
    scale = sub.add_parser(
        "scale", help="resize the running local fleet in place",
        description="Resize the running local fleet to REPLICAS ranks through the frontend's resize operation: "
                    "new engines are started and join, or the highest ranks drain and retire; the other "
                    "processes are never restarted. Ctrl-C cancels a resize that has not committed.")
    scale.add_argument("replicas", type=int, help="the new number of data-parallel ranks (at least 1)")
    scale.add_argument("--state-dir", help=state_help)
    scale.add_argument("--timeout", type=float, help="seconds a new engine may take to join (default: "
                       + ", ".join(f"{k} {v:.0f}" for k, v in local.DEFAULT_READY_TIMEOUT.items()) + ")")
    scale.add_argument("--drain-timeout", type=float, default=local.DEFAULT_DRAIN_TIMEOUT,
                       help="seconds a leaving rank may finish its in-flight requests before they fail "
                            "(default %(default).0f)")
    scale.set_defaults(func=cmd_scale)
    sup = sub.add_parser(
        "supervise", help="supervise a detached local fleet (what `up --detach` leaves running)",
        description="Replace the local fleet's frontend or coordinator in place when it is lost, while the "
                    "engines serve on; runs until `corefleet down` stops the fleet.")
    sup.add_argument("--state-dir", help=state_help)
    sup.set_defaults(func=cmd_supervise)
    down = sub.add_parser("down", help="stop the local fleet's processes")
    down.add_argument("--state-dir", help=state_help)
    down.set_defaults(func=cmd_down)

    cluster = sub.add_parser("cluster", help="a local Kubernetes control plane with the operator")
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True)
    cup = cluster_sub.add_parser("up", help="start a local control plane and the operator")
    cup.add_argument("--state-dir", default=os.environ.get("COREFLEET_STATE_DIR"),
                     help="where the control plane keeps its state (default: a new temp dir)")
    cup.add_argument("--gpus", type=int, default=8, help="nvidia.com/gpu capacity of the fake node")
    cup.add_argument("--exit-when-ready", action="store_true", help="stop once everything is healthy")
    cup.set_defaults(func=cmd_cluster_up)

    # Listed for --help; main() hands everything after "operator" to the operator's own parser.
    sub.add_parser("operator", help="run the operator against the current kubeconfig", add_help=False)
    ver = sub.add_parser("version", help="print the version")
    ver.set_defaults(func=lambda _: print(__version__) or 0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()  # here, not at exit, so that a closed pipe is caught below
    except BrokenPipeError:
        # The reader went away (`corefleet status | head`): no traceback, and what is left goes nowhere;
        # the exit status a process killed by SIGPIPE would have.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _run(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["operator"]:
        from corefleet_operator import __main__ as operator_main

        return operator_main.main(argv[1:])
    vllm_flags: list[str] = []
    if argv[:1] == ["up"] and local.LAUNCHER_ARGS_END in argv:
        cut = argv.index(local.LAUNCHER_ARGS_END)
        argv, vllm_flags = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    if vllm_flags:
        args.vllm_flags = vllm_flags
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
