# SPDX-License-Identifier: Apache-2.0
"""One headless vLLM engine core (one DP rank) per pod, with health endpoints for the kubelet.

    python -m corefleet_client.engine --health-port 8002 [--health-host 0.0.0.0] -- MODEL --headless \\
        --data-parallel-size N --data-parallel-size-local 1 --data-parallel-start-rank R \\
        --data-parallel-address FRONTEND_HOST --data-parallel-rpc-port 29550 [other vLLM flags]

This does the job of `vllm serve --headless` (`vllm/entrypoints/cli/serve.py::run_headless`) for
exactly one engine: everything after `--` is parsed by vLLM's own `serve` parser
(`make_arg_parser` under a `FlexibleArgumentParser`, so `--config`, `--model`, dotted and
underscore forms all behave as in `vllm serve`), the `VllmConfig` comes from
`create_engine_config(usage_context, headless=True)`, and the engine core process is started by
vLLM's `CoreEngineProcManager(local_client=False)` with start index = the rank.

What differs from `run_headless`:

1. One rank per pod: `--headless` and `--data-parallel-size-local 1` are required, and so is the
   internal-LB form (`--data-parallel-start-rank`; not `--data-parallel-rank` or the other LB modes).
   Violations exit 2 with a message, as argparse does.
2. The frontend's host must resolve (retried for `--resolve-timeout` seconds). libzmq accepts
   `connect("tcp://no-such-host:29550")` and then retries for ever, so without this check a typo
   in the address would look like a frontend that never answers.
3. The engine does not connect to the frontend's handshake ROUTER itself: it is given a local
   `ipc://` handshake address on which `enginehealth.HandshakeRelay` listens and passes HELLO,
   INIT and READY through unchanged, under the engine's own identity, to
   `tcp://{--data-parallel-address}:{--data-parallel-rpc-port}`. That is how the launcher knows,
   without patching vLLM, that the engine has joined the fleet (see enginehealth.py for why the
   relay is invisible to both ends). If the frontend never answers, the engine gives up after
   vLLM's `HANDSHAKE_TIMEOUT_MINS` and exits; until then the launcher reports not ready.
4. `GET /livez` and `GET /readyz` on `--health-host:--health-port` (enginehealth.HealthServer).
5. Exit status for a pod with `restartPolicy: Never`: 0 after SIGTERM/SIGINT (the engine is shut
   down through `CoreEngineProcManager.shutdown`, with `--shutdown-timeout` as in `run_headless`);
   otherwise, when the engine exits on its own, its exit code if non-zero (128+N if killed by
   signal N), else 1, so the pod ends Failed and the operator sees the lost rank.
6. The launcher is a child subreaper: if the engine core dies first, its executor workers become
   the launcher's children, and are stopped (SIGTERM, 5 s, SIGKILL) before it exits; /livez says
   503 meanwhile. vLLM's workers usually notice their parent's death and exit by themselves; a
   wedged one would otherwise outlive the launcher wherever it is not PID 1 of a container.

Liveness is vLLM's own `monitor_engine_liveness` (a wait on the process sentinel), run in the
main thread as `run_headless` does. Multi-node TP/PP (`--nnodes`, `node_rank_within_dp > 0`) is
refused: a rank and its TP group live in one pod.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import signal
import socket
import sys
import time
from collections.abc import Sequence
from types import FrameType

import psutil  # type: ignore[import-untyped]  # a vLLM dependency
import vllm
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.entrypoints.launchers.cli_args import propagate_flash_late_interaction
from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
from vllm.logger import configure_logging_from_args
from vllm.reasoning import ReasoningParserManager
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.utils.network_utils import get_open_zmq_ipc_path, get_tcp_uri
from vllm.v1.engine.utils import CoreEngineProcManager
from vllm.v1.executor import Executor

from corefleet_client.argv import split_launcher_argv
from corefleet_client.enginehealth import EngineState, HandshakeRelay, HealthServer
from corefleet_client.process import configure_logging, exit_promptly

logger = logging.getLogger(__name__)

PROG = "python -m corefleet_client.engine"
DEFAULT_HEALTH_HOST = "0.0.0.0"
# The frontend pod may get its address (and DNS record) a little after the engine pods start.
DEFAULT_RESOLVE_TIMEOUT_S = 120.0
_RESOLVE_RETRY_S = 2.0

# vLLM's grace for processes it stops without a configured timeout (v1/utils.py::shutdown).
ORPHAN_GRACE_S = 5.0
_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} --health-port PORT [--health-host HOST] [--resolve-timeout S] -- MODEL --headless ...",
        description="Run one headless vLLM engine core (one DP rank) with /livez and /readyz. "
                    "Everything after `--` is parsed as `vllm serve` arguments.",
    )
    parser.add_argument("--health-port", type=int, required=True, help="port of /livez and /readyz")
    parser.add_argument("--health-host", default=DEFAULT_HEALTH_HOST, help="address to serve /livez and /readyz on")
    parser.add_argument("--resolve-timeout", type=float, default=DEFAULT_RESOLVE_TIMEOUT_S,
                        help="seconds to keep retrying while --data-parallel-address does not resolve")
    return parser


def build_serve_parser() -> FlexibleArgumentParser:
    """vLLM's `vllm serve` parser, built as `vllm.entrypoints.cli.main` builds it."""
    parser = FlexibleArgumentParser(prog=f"{PROG} --")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    ServeSubcommand().subparser_init(subparsers)
    return parser


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(launcher args, vLLM serve args); exits 2 with a message on anything this launcher refuses."""
    parser = build_parser()
    own_argv, vllm_argv = split_launcher_argv(argv)
    args = parser.parse_args(own_argv)
    if not 0 < args.health_port < 65536:
        parser.error(f"--health-port must be in 1..65535, got {args.health_port}")
    if not vllm_argv:
        parser.error("expected `-- MODEL --headless ...`: the vLLM serve arguments follow `--`")

    serve_parser = build_serve_parser()
    try:
        serve_args = serve_parser.parse_args(["serve", *vllm_argv])
    except ValueError as e:  # FlexibleArgumentParser's own checks (model placement, --config)
        parser.error(str(e))

    # As ServeSubcommand.cmd: a positional model wins.
    if serve_args.model_tag is not None:
        serve_args.model = serve_args.model_tag
    if not serve_args.headless:
        parser.error("--headless is required after `--`: this launcher runs a headless engine core "
                     "whose frontend (API server) runs in another pod")
    if serve_args.data_parallel_size_local != 1:
        got = "unset" if serve_args.data_parallel_size_local is None else serve_args.data_parallel_size_local
        parser.error(f"--data-parallel-size-local must be 1 (one DP rank per pod), got {got}")
    if serve_args.api_server_count not in (None, 0):
        parser.error(f"--api-server-count={serve_args.api_server_count} cannot be used with --headless")
    if serve_args.data_parallel_rank is not None or serve_args.data_parallel_external_lb:
        parser.error("--data-parallel-rank / --data-parallel-external-lb select external load balancing; "
                     "this launcher runs internal-LB engines: give the rank with --data-parallel-start-rank")
    if serve_args.data_parallel_hybrid_lb or serve_args.data_parallel_multi_port_external_lb:
        parser.error("--data-parallel-hybrid-lb / --data-parallel-multi-port-external-lb do not apply to a "
                     "headless engine")
    serve_args.api_server_count = 0
    try:
        ServeSubcommand().validate(serve_args)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    return args, serve_args


def wait_resolvable(host: str, port: int, timeout: float) -> str | None:
    """None once `host` resolves; an error message if it still does not after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    logged = False
    while True:
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            return None
        except (socket.gaierror, UnicodeError) as e:
            left = deadline - time.monotonic()
            if left <= 0:
                return (f"the frontend address --data-parallel-address {host!r} does not resolve "
                        f"({e}; gave up after {timeout:.0f} s)")
            if not logged:
                logger.warning("Frontend address %r does not resolve yet (%s); retrying for up to %.0f s",
                               host, e, left)
                logged = True
            time.sleep(min(_RESOLVE_RETRY_S, left))  # DNS has nothing to wait on


def become_subreaper() -> bool:
    """Make processes orphaned below this one (the engine's executor workers, when the engine core
    dies first) this process's children rather than init's, so that `stop_orphans` can stop them.
    In a container the launcher is PID 1 and gets them anyway; run elsewhere, it needs this."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


def stop_orphans(timeout: float = ORPHAN_GRACE_S) -> None:
    """Stop whatever the engine left behind, as vLLM's `shutdown` stops the engine: SIGTERM, wait, SIGKILL.

    After `CoreEngineProcManager.shutdown` the only children left should be multiprocessing's
    resource tracker (which exits by itself, after cleaning up, when this process exits) and
    orphans reparented here by `become_subreaper`.
    """
    orphans = []
    for child in psutil.Process().children():
        try:
            if "resource_tracker" not in " ".join(child.cmdline()):
                orphans.append(child)
        except psutil.Error:
            continue
    if not orphans:
        return
    logger.warning("Stopping %d process(es) the engine left behind: %s", len(orphans), [p.pid for p in orphans])
    for p in orphans:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(orphans, timeout=timeout)
    for p in alive:
        logger.warning("Killing pid %d, still running %.0f s after SIGTERM", p.pid, timeout)
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=timeout)


def _exit_status(exitcode: int | None) -> int:
    if exitcode is None or exitcode == 0:
        return EXIT_FAILED
    return 128 - exitcode if exitcode < 0 else exitcode


def main(argv: Sequence[str] | None = None) -> int:
    args, serve_args = parse_args(sys.argv[1:] if argv is None else argv)
    cli_env_setup()  # spawn, as `vllm serve` does
    configure_logging_from_args(serve_args)
    configure_logging(logging.INFO)

    # SIGTERM (the kubelet) and SIGINT stop the engine once, as run_headless's handler does.
    stop_requested = False
    stopping = False  # the engine is being stopped (asked to, or it exited): a signal changes nothing

    def _request_stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stop_requested
        if stop_requested or stopping:
            return  # already shutting the engine down; do not interrupt that
        stop_requested = True
        logger.info("Received %s, shutting the engine down", signal.Signals(signum).name)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _request_stop)
    signal.signal(signal.SIGINT, _request_stop)

    become_subreaper()
    rank = serve_args.data_parallel_start_rank or 0
    state = EngineState(rank)
    try:
        health = HealthServer(args.health_host, args.health_port, state)
    except OSError as e:
        logger.error("Cannot serve health on %s:%d: %s", args.health_host, args.health_port, e)
        return EXIT_FAILED
    engine_manager: CoreEngineProcManager | None = None
    relay: HandshakeRelay | None = None
    shutdown_timeout: int | None = None
    try:
        health.start()

        # 1. The config, as run_headless builds it.
        if serve_args.reasoning_parser_plugin and len(serve_args.reasoning_parser_plugin) > 3:
            ReasoningParserManager.import_reasoning_parser(serve_args.reasoning_parser_plugin)
        engine_args = vllm.AsyncEngineArgs.from_cli_args(serve_args)
        propagate_flash_late_interaction(serve_args, engine_args)
        vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER,
                                                       headless=True)
        shutdown_timeout = vllm_config.shutdown_timeout
        parallel_config = vllm_config.parallel_config
        if parallel_config.node_rank_within_dp > 0:
            logger.error("Multi-node TP/PP (node rank %d within the DP rank) is not supported: "
                         "a DP rank and its TP group run in one pod", parallel_config.node_rank_within_dp)
            return EXIT_USAGE
        assert parallel_config.data_parallel_size_local == 1, parallel_config.data_parallel_size_local
        assert parallel_config.data_parallel_rank == rank, (parallel_config.data_parallel_rank, rank)

        # 2. The frontend's handshake address must at least resolve.
        host, port = parallel_config.data_parallel_master_ip, parallel_config.data_parallel_rpc_port
        if (error := wait_resolvable(host, port, args.resolve_timeout)) is not None:
            logger.error("Cannot join the fleet: %s", error)
            return EXIT_FAILED

        # 3. The relay, then the engine, which handshakes through it.
        relay = HandshakeRelay(rank, get_open_zmq_ipc_path(), get_tcp_uri(host, port), joined=state.joined)
        relay.start()
        logger.info("Launching data parallel engine rank %d of %d in headless mode, frontend %s",
                    rank, parallel_config.data_parallel_size, relay.frontend_address)
        engine_manager = CoreEngineProcManager(
            local_engine_count=1,
            start_index=rank,
            local_start_index=0,
            vllm_config=vllm_config,
            local_client=False,
            handshake_address=relay.engine_address,
            executor_class=Executor.get_class(vllm_config),
            log_stats=not engine_args.disable_log_stats,
        )
        engine = engine_manager.processes[0]
        state.attach(engine)
        logger.info("Engine core %s started (pid %s)", engine.name, engine.pid)

        # 4. Until the engine exits or a signal arrives.
        engine_manager.monitor_engine_liveness()
        stopping = True
        logger.error("Engine core %s exited with code %s without a stop signal; exiting",
                     engine.name, engine.exitcode)
    except KeyboardInterrupt:
        if not stop_requested:
            raise
    finally:
        stopping = True
        if relay is not None:
            relay.close()
        if engine_manager is not None:
            timeout = shutdown_timeout if stop_requested else None
            if stop_requested:
                logger.info("Waiting up to %s seconds for the engine to exit", timeout)
            engine_manager.shutdown(timeout=timeout)
            stop_orphans()
        health.close()  # /livez has said 503 since the engine exited

    if stop_requested:
        logger.info("Engine stopped")
        return EXIT_OK
    assert engine_manager is not None
    return _exit_status(engine_manager.processes[0].exitcode)


if __name__ == "__main__":
    exit_promptly(main())
