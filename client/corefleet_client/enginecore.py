# SPDX-License-Identifier: Apache-2.0
"""The engine core of one DP rank, run in-process: the engine launcher's only child.

    python -m corefleet_client.enginecore --handshake-address ipc://PATH --report-fd FD \\
        [--resolve-timeout S] -- MODEL --headless --data-parallel-size-local 1 \\
        --data-parallel-start-rank R --data-parallel-address FRONTEND_HOST [other vLLM flags]

Started by `corefleet_client.engine` (the launcher, which never imports vLLM: see its docstring),
never by hand. Everything after `--` is parsed by vLLM's own `serve` parser (`make_arg_parser`
under a `FlexibleArgumentParser`, so `--config`, `--model`, dotted and underscore forms all behave
as in `vllm serve`), and the `VllmConfig` comes from `create_engine_config(usage_context,
headless=True)`, as in `vllm serve --headless` (`vllm/entrypoints/cli/serve.py::run_headless`).

Then, instead of `CoreEngineProcManager` spawning the engine core as a child of this process
(vLLM 0.32.0 `v1/engine/utils.py`), this process *becomes* the engine core: it runs the very
target that manager spawns, `EngineCoreProc.run_engine_core(dp_rank=R, local_dp_rank=0, ...)`,
after the two steps the manager takes before `proc.start()` for a single local engine:
`set_assigned_physical_gpu_ids_for_dp_rank(vllm_config, 0, ...)` where vLLM needs device-env
isolation, and `_configure_uniproc_startup_threads(executor_class, 1)` (a no-op on CPU).
The manager's third step, `numa_utils.configure_subprocess(process_kind="EngineCore")`, wraps
the spawned interpreter in `numactl`; it cannot wrap a process that already runs, so `--numa-bind`
is refused (exit 2) — bind a GPU pod's CPUs and memory with the kubelet's CPU and topology
managers instead. All of it is pinned in tests/e2e/test_vllm_pins.py.

Why: the launcher used to import vLLM (to parse these flags) and stay the engine's parent, so
every rank paid ~0.9 GiB for a process that relays a handshake and serves two health routes
(issue 10). Now the rank's processes are the launcher (the standard library, ZeroMQ and psutil),
this engine core, and the engine's executor worker(s) — the same vLLM processes as a rank of
stock `vllm serve`.

What this process does before becoming the engine core:

1. It refuses what one engine per pod cannot be (exit 2 with a message, as argparse does):
   no `--headless`, `--data-parallel-size-local` other than 1, external or hybrid LB, multi-node
   TP/PP, `--numa-bind`.
2. It waits for the frontend's host to resolve (`--resolve-timeout` seconds; exit 1 after that):
   libzmq accepts `connect("tcp://no-such-host:29550")` and then retries for ever, so without this
   check a typo in the address would look like a frontend that never answers.
3. It writes one JSON line to `--report-fd` and closes it: the rank, the frontend's handshake
   address, the DP size and the shutdown timeout. The launcher relays the handshake between
   `--handshake-address` (where it binds once it has the report) and that frontend address; the
   engine's DEALER connects to the `ipc://` path and queues HELLO until the relay is bound.

Exit status: the engine's (0 after SIGTERM/SIGINT, which vLLM's `run_engine_core` handles by
shutting the engine down; 1 on a fatal error, logged by vLLM), 2 for refused arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import vllm
import zmq
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.entrypoints.launchers.cli_args import propagate_flash_late_interaction
from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
from vllm.logger import configure_logging_from_args
from vllm.platforms import current_platform
from vllm.reasoning import ReasoningParserManager
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.utils.network_utils import get_tcp_uri
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequestType
from vllm.v1.engine import core as vllm_core
from vllm.v1.engine.core import EngineCoreProc
from vllm.v1.engine.utils import _configure_uniproc_startup_threads, set_assigned_physical_gpu_ids_for_dp_rank
from vllm.v1.executor import Executor

from corefleet_client.admin import ATTACH_UTILITY, RELEASE_UTILITY
from corefleet_client.argv import split_launcher_argv
from corefleet_client.engine import DEFAULT_RESOLVE_TIMEOUT_S, EXIT_FAILED, EXIT_OK, EXIT_USAGE
from corefleet_client.process import configure_logging, exit_promptly

logger = logging.getLogger(__name__)

# DEFAULT_RESOLVE_TIMEOUT_S and EXIT_* are the launcher's: it passes this process's status on as its own.
PROG = "python -m corefleet_client.engine"  # what the user ran: messages name the launcher
_RESOLVE_RETRY_S = 2.0



def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m corefleet_client.enginecore",
                                     description="The engine launcher's child: one vLLM engine core, in-process.")
    parser.add_argument("--handshake-address", required=True,
                        help="the launcher's relay (ipc://...) the engine sends its handshake to")
    parser.add_argument("--report-fd", type=int, required=True,
                        help="file descriptor to write the launch report (one JSON line) to")
    parser.add_argument("--release-fd", type=int, default=None,
                        help="file descriptor to write a line to when the frontend releases this engine "
                             f"(the {RELEASE_UTILITY} utility call: the pod's drain is over)")
    parser.add_argument("--resolve-timeout", type=float, default=DEFAULT_RESOLVE_TIMEOUT_S,
                        help="seconds to keep retrying while --data-parallel-address does not resolve")
    return parser


def install_release_utility(fd: int) -> None:
    """Give vLLM's engine core the utility call `RELEASE_UTILITY` (vLLM looks a utility up by name on the engine
    core: `EngineCoreProc._handle_client_request`), which tells the launcher through `fd` that the frontend
    drained and released this engine. With several frontends (the engine's clients: one input address each, from
    its handshake), each drains its own requests and releases with its client index: the launcher is told once
    every client released. Each call that completes the set writes a line; the launcher needs one."""
    os.set_inheritable(fd, False)  # not the executor's workers'

    def release(self: EngineCoreProc, client_index: int = 0) -> bool:
        released: set[int] = self.__dict__.setdefault("_corefleet_released_by", set())
        released.add(client_index)
        clients = len(self.addresses.inputs)
        if len(released) < clients:
            logger.info("Released by frontend %d; waiting for %d more frontend(s)", client_index,
                        clients - len(released))
            return True
        try:
            os.write(fd, b"released\n")
        except OSError as e:  # the launcher is gone: nothing waits for the release
            logger.warning("Cannot tell the launcher of the release: %s", e)
            return False
        logger.info("Released by the frontend: the launcher's drain is over")
        return True

    setattr(EngineCoreProc, RELEASE_UTILITY, release)


_INPUT_THREAD = threading.local()  # set in the engine's input thread (vLLM's process_input_sockets)
# The engine's connections to its frontend(s) and coordinator (sockets it connects): a connect that gets no answer
# gives up after CONNECT_TIMEOUT_MS and is tried again, resolving the peer's DNS name again (a replacement frontend
# has the same name and a new address; a SYN to the old one may go unanswered for minutes on a real network); a
# connection whose peer went silent (its node lost: no FIN, no RST) is dropped after HEARTBEAT_TIMEOUT_MS without an
# answer to the pings sent every HEARTBEAT_IVL_MS (libzmq answers them in its own thread: a busy peer still does), and
# made again. As long as the frontend's own liveness timeout (30 s): a whole machine that stalls for seconds (seen:
# 15 s on a 2-core test node) must not cut a rank off, and a replacement frontend takes longer than that to be
# scheduled and started once a node is lost.
CONNECT_TIMEOUT_MS = 3000
HEARTBEAT_IVL_MS = 5000
HEARTBEAT_TIMEOUT_MS = 30000
CONNECTION_OPTIONS = ((zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS), (zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS),
                      (zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS))


def is_attach_call(frames: Sequence[Any]) -> bool:
    """Whether a message from the frontend (type frame, data frames) is the `ATTACH_UTILITY` call."""
    if len(frames) < 2 or bytes(_buffer(frames[0])) != EngineCoreRequestType.UTILITY.value:
        return False
    data = bytes(_buffer(frames[1]))
    if ATTACH_UTILITY.encode() not in data:
        return False
    try:
        request = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return False
    return isinstance(request, list) and len(request) == 4 and request[2] == ATTACH_UTILITY


def _buffer(frame: Any) -> Any:
    return frame.buffer if isinstance(frame, zmq.Frame) else frame


def announce_again_on_attach(dealer: Any) -> None:
    """Make one of the engine's requests DEALERs (one per frontend) send its first message again, the engine's ready
    response, when a replacement frontend asks (`ATTACH_UTILITY`), on the thread that owns the socket: vLLM's
    client over running engines waits for that message (`frontend.attach`). The call itself goes on to vLLM."""
    first: list[Any] = []
    send, recv_multipart = dealer.send, dealer.recv_multipart

    def send_first_kept(data: Any, *args: Any, **kwargs: Any) -> Any:
        if not first:
            first.append(bytes(data))
        return send(data, *args, **kwargs)

    def recv_and_announce(*args: Any, **kwargs: Any) -> Any:
        frames = recv_multipart(*args, **kwargs)
        if first and is_attach_call(frames):
            logger.info("A frontend re-attaches: announcing this engine again")
            send(first[0])
        return frames

    dealer.send, dealer.recv_multipart = send_first_kept, recv_and_announce


def install_attach_support() -> None:
    """Let a replacement frontend re-attach to this running engine (`frontend.attach`): the requests DEALERs vLLM's
    input thread creates announce the engine again when asked, and the engine core gets the `ATTACH_UTILITY` call,
    which aborts every request of the calling client index (its lost predecessor's). Every socket the engine core
    makes gets `CONNECTION_OPTIONS`, so that it finds a replacement frontend at its new address."""
    original_input = EngineCoreProc.process_input_sockets
    original_make = vllm_core.make_zmq_socket

    def process_input_sockets(self: EngineCoreProc, *args: Any, **kwargs: Any) -> Any:
        _INPUT_THREAD.active = True
        return original_input(self, *args, **kwargs)

    def make_zmq_socket(ctx: Any, path: str, socket_type: Any, *args: Any, **kwargs: Any) -> Any:
        for option, value in CONNECTION_OPTIONS:  # the context's defaults for its sockets made from now on
            ctx.setsockopt(option, value)
        made = original_make(ctx, path, socket_type, *args, **kwargs)
        if socket_type == zmq.DEALER and getattr(_INPUT_THREAD, "active", False):
            announce_again_on_attach(made)
        return made

    def attach(self: EngineCoreProc, client_index: int) -> int:
        orphans = [rid for rid, request in self.scheduler.requests.items() if request.client_index == client_index]
        if orphans:
            self.abort_requests(orphans)
        logger.info("Frontend %d re-attached: aborted the %d request(s) its predecessor left", client_index,
                    len(orphans))
        return len(orphans)

    EngineCoreProc.process_input_sockets = process_input_sockets
    vllm_core.make_zmq_socket = make_zmq_socket
    setattr(EngineCoreProc, ATTACH_UTILITY, attach)


def stats_to_frontend_0(outputs: dict[int, EngineCoreOutputs]) -> dict[int, EngineCoreOutputs]:
    """A step's outputs by client index, with the step's scheduler stats moved to frontend 0's (first, created if
    it has no output this step): see `install_stats_to_frontend_0`."""
    at = next((index for index, eco in outputs.items() if eco.scheduler_stats is not None), None)
    if at is None or (at == 0 and next(iter(outputs)) == 0):
        return outputs
    first = outputs.get(0) or EngineCoreOutputs()
    if at != 0:
        first.scheduler_stats, outputs[at].scheduler_stats = outputs[at].scheduler_stats, None
    return {0: first, **{index: eco for index, eco in outputs.items() if index != 0}}


def install_stats_to_frontend_0() -> None:
    """vLLM sends each step's scheduler stats (the engine's running and waiting requests, its KV-cache usage: the
    `vllm:num_requests_*` and `vllm:kv_cache_usage_perc` gauges) to one frontend only, the first with an output in
    that step (vLLM 0.32.0 `Scheduler.update_from_output`). With several frontends each would keep whatever it last
    got, stale, and their sum (the autoscaling signal) would count an engine's requests more than once, or never go
    back to 0 on an idle fleet. So they go to frontend 0, always, and first (where vLLM attaches a step's iteration
    details): frontend 0's gauges are every engine's current ones, the others' stay 0. One frontend: nothing
    changes."""
    original = Scheduler.update_from_output

    def update_from_output(self: Scheduler, *args: Any, **kwargs: Any) -> dict[int, EngineCoreOutputs]:
        return stats_to_frontend_0(original(self, *args, **kwargs))

    Scheduler.update_from_output = update_from_output


def build_serve_parser() -> FlexibleArgumentParser:
    """vLLM's `vllm serve` parser, built as `vllm.entrypoints.cli.main` builds it."""
    parser = FlexibleArgumentParser(prog=f"{PROG} --health-port PORT --")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    ServeSubcommand().subparser_init(subparsers)
    return parser


def parse_serve_args(vllm_argv: Sequence[str]) -> argparse.Namespace:
    """vLLM's serve namespace for `vllm_argv`; exits 2 with a message on anything one engine per pod refuses."""
    serve_parser = build_serve_parser()
    try:
        serve_args: argparse.Namespace = serve_parser.parse_args(["serve", *vllm_argv])
    except ValueError as e:  # FlexibleArgumentParser's own checks (model placement, --config)
        serve_parser.error(str(e))

    def refuse(message: str) -> None:
        serve_parser.error(message)

    # As ServeSubcommand.cmd: a positional model wins.
    if serve_args.model_tag is not None:
        serve_args.model = serve_args.model_tag
    if not serve_args.headless:
        refuse("--headless is required after `--`: this launcher runs a headless engine core "
               "whose frontend (API server) runs in another pod")
    if serve_args.data_parallel_size_local != 1:
        got = "unset" if serve_args.data_parallel_size_local is None else serve_args.data_parallel_size_local
        refuse(f"--data-parallel-size-local must be 1 (one DP rank per pod), got {got}")
    if serve_args.api_server_count not in (None, 0):
        refuse(f"--api-server-count={serve_args.api_server_count} cannot be used with --headless")
    if serve_args.data_parallel_rank is not None or serve_args.data_parallel_external_lb:
        refuse("--data-parallel-rank / --data-parallel-external-lb select external load balancing; "
               "this launcher runs internal-LB engines: give the rank with --data-parallel-start-rank")
    if serve_args.data_parallel_hybrid_lb or serve_args.data_parallel_multi_port_external_lb:
        refuse("--data-parallel-hybrid-lb / --data-parallel-multi-port-external-lb do not apply to a "
               "headless engine")
    if getattr(serve_args, "numa_bind", False):
        refuse("--numa-bind is not supported: vLLM binds an engine core by starting it under numactl, and "
               "here the engine core is the launcher's child process; use the kubelet's CPU and topology "
               "managers to bind a pod's CPUs and memory")
    serve_args.api_server_count = 0
    try:
        ServeSubcommand().validate(serve_args)
    except (TypeError, ValueError) as e:
        refuse(str(e))
    return serve_args


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(this process's args, vLLM serve args); exits 2 with a message on anything refused."""
    parser = build_parser()
    own_argv, vllm_argv = split_launcher_argv(argv)
    args = parser.parse_args(own_argv)
    if not vllm_argv:
        parser.error("expected `-- MODEL --headless ...`: the vLLM serve arguments follow `--`")
    return args, parse_serve_args(vllm_argv)


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


def engine_name(rank: int, data_parallel_size: int) -> str:
    """The engine core's name and process title, as vLLM gives them (`CoreEngineProcManager`, `run_engine_core`)."""
    return f"EngineCore_DP{rank}" if data_parallel_size > 1 or rank > 0 else "EngineCore"


def report(fd: int, **fields: object) -> None:
    """Write the launch report (one JSON line) and close the descriptor, so no worker inherits it."""
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(fields) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    args, serve_args = parse_args(sys.argv[1:] if argv is None else argv)
    cli_env_setup()  # spawn for the executor's workers, as `vllm serve` does
    configure_logging_from_args(serve_args)
    configure_logging(logging.INFO)

    # 1. The config, as run_headless builds it.
    if serve_args.reasoning_parser_plugin and len(serve_args.reasoning_parser_plugin) > 3:
        ReasoningParserManager.import_reasoning_parser(serve_args.reasoning_parser_plugin)
    engine_args = vllm.AsyncEngineArgs.from_cli_args(serve_args)
    propagate_flash_late_interaction(serve_args, engine_args)
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER, headless=True)
    parallel_config = vllm_config.parallel_config
    if parallel_config.node_rank_within_dp > 0:
        logger.error("Multi-node TP/PP (node rank %d within the DP rank) is not supported: "
                     "a DP rank and its TP group run in one pod", parallel_config.node_rank_within_dp)
        return EXIT_USAGE
    assert parallel_config.data_parallel_size_local == 1, parallel_config.data_parallel_size_local
    rank = parallel_config.data_parallel_rank
    dp_size = parallel_config.data_parallel_size

    # 2. The frontend's handshake address must at least resolve.
    host, port = parallel_config.data_parallel_master_ip, parallel_config.data_parallel_rpc_port
    if (error := wait_resolvable(host, port, args.resolve_timeout)) is not None:
        logger.error("Cannot join the fleet: %s", error)
        return EXIT_FAILED

    # 3. Tell the launcher where to relay the handshake to.
    report(args.report_fd, rank=rank, data_parallel_size=dp_size, frontend_address=get_tcp_uri(host, port),
           shutdown_timeout=vllm_config.shutdown_timeout, name=engine_name(rank, dp_size))

    if args.release_fd is not None:
        install_release_utility(args.release_fd)
    install_attach_support()
    install_stats_to_frontend_0()

    # 4. What CoreEngineProcManager does for one local engine, then the engine core itself.
    executor_class = Executor.get_class(vllm_config)
    if dp_size > 1 and (not (current_platform.is_cuda_alike() or current_platform.is_xpu())
                        or parallel_config.use_ray):
        set_assigned_physical_gpu_ids_for_dp_rank(vllm_config, 0, parallel_config.assigned_physical_gpu_ids)
    logger.info("Engine core %s of %d starting in process %d, handshake through %s",
                engine_name(rank, dp_size), dp_size, os.getpid(), args.handshake_address)
    try:
        with _configure_uniproc_startup_threads(executor_class, 1):
            EngineCoreProc.run_engine_core(
                vllm_config=vllm_config, local_client=False, handshake_address=args.handshake_address,
                executor_class=executor_class, log_stats=not engine_args.disable_log_stats, tensor_queue=None,
                dp_rank=rank, local_dp_rank=0,
            )
    except SystemExit as e:  # vLLM's signal handler ends the busy loop this way
        return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_FAILED)
    except Exception:  # logged by run_engine_core ("failed to start" / "fatal error")
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    exit_promptly(main())
