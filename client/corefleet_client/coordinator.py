# SPDX-License-Identifier: Apache-2.0
"""vLLM's DP coordinator, run standalone in its own pod on fixed TCP ports.

vLLM starts the coordinator inside the rank-0 frontend (`launch_core_engines` ->
`DPCoordinator`), on addresses chosen there: IPC or `tcp://{host}:0`, read back through a pipe.
corefleet runs the same process, `DPCoordinatorProc.run_coordinator`, unmodified in the
coordinator pod, bound to three ports that the operator fixes (constants `COORDINATOR_*_PORT`),
so the frontend and the engines in other pods can be told where it is before it starts:

* front publish (XPUB): load stats and wave state to the frontend's DPLB client, which
  subscribes with `b"\\x01"` and sends wave-start and `SCALE_ELASTIC_EP` messages up;
* back output (PULL): `EngineCoreOutputs` from the engines (scheduler stats, wave events);
* back publish (XPUB): `READY` once all `engine_count` engines have subscribed (and to every
  engine that subscribes later), then `START_DP_WAVE` to the engines.

Lifecycle:

1. Check that the three ports can be bound, so that a port in use fails with a message naming
   it (libzmq's error does not say which bind failed).
2. Make SIGTERM (the kubelet) and SIGINT raise KeyboardInterrupt, which is the exit path
   `run_coordinator` itself handles: the sockets are closed and the process exits 0.
   A SIGTERM in the first seconds, while vLLM is still being imported, takes the default
   action: nothing is bound yet.
3. Run vLLM's coordinator loop in this process's main thread. It reports its bound endpoints
   through the pipe that `DPCoordinator` would read in the frontend; a thread here logs them.

If the loop returns without being asked to stop (vLLM gives up when the engine gate sees
anything but a subscription, e.g. an engine that went away before all were ready), the
process exits 1 so that Kubernetes restarts it.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import threading
from collections.abc import Sequence
from types import FrameType

import zmq
from vllm.utils.network_utils import get_tcp_uri, is_valid_ipv6_address
from vllm.v1.engine.coordinator import DPCoordinatorProc

from corefleet_client.process import configure_logging, exit_promptly

logger = logging.getLogger(__name__)

# The operator's defaults (corefleet_operator.constants.COORDINATOR_*_PORT); it always passes them.
DEFAULT_FRONT_PUBLISH_PORT = 29551
DEFAULT_BACK_OUTPUT_PORT = 29552
DEFAULT_BACK_PUBLISH_PORT = 29553

# vLLM's own defaults in DPCoordinatorProc.run_coordinator (0.32.0).
DEFAULT_MIN_STATS_UPDATE_INTERVAL_MS = 100

EXIT_OK = 0
EXIT_FAILED = 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m corefleet_client.coordinator",
        description="Run vLLM's data-parallel coordinator standalone on fixed TCP ports.",
    )
    parser.add_argument("--engine-count", type=int, required=True,
                        help="engines (DP ranks) that must subscribe before the coordinator sends READY")
    parser.add_argument("--host", default="0.0.0.0", help="address to bind the three sockets on")
    parser.add_argument("--front-publish-port", type=int, default=DEFAULT_FRONT_PUBLISH_PORT,
                        help="XPUB: stats and wave state to the frontend")
    parser.add_argument("--back-output-port", type=int, default=DEFAULT_BACK_OUTPUT_PORT,
                        help="PULL: stats and wave notifications from the engines")
    parser.add_argument("--back-publish-port", type=int, default=DEFAULT_BACK_PUBLISH_PORT,
                        help="XPUB: READY and START_DP_WAVE to the engines")
    parser.add_argument("--min-stats-update-interval-ms", type=int, default=DEFAULT_MIN_STATS_UPDATE_INTERVAL_MS,
                        help="publish changed stats to the frontend at most this often (vLLM default 100)")
    parser.add_argument("--no-wave-coordination", dest="enable_wave_coordination", action="store_false",
                        help="disable request-wave coordination; vLLM enables it only for MoE models, "
                             "whose engines run in lock-step")
    return parser


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.engine_count < 1:
        parser.error("--engine-count must be at least 1")
    ports = (args.front_publish_port, args.back_output_port, args.back_publish_port)
    if any(not 0 < p < 65536 for p in ports):
        parser.error(f"ports must be in 1..65535, got {ports}")
    if len(set(ports)) != len(ports):
        parser.error(f"the three ports must differ, got {ports}")
    return args


def _unbindable(host: str, port: int) -> OSError | None:
    """Try to bind (host, port) as libzmq's TCP listener will (SO_REUSEADDR); None if it can.

    A plain socket is released as soon as it is closed; a probe with zmq would be released by
    its I/O thread later and could make vLLM's own bind fail.
    """
    family = socket.AF_INET6 if is_valid_ipv6_address(host) else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except socket.gaierror:
        return None  # not a literal address: leave it to libzmq to resolve and report
    except OSError as e:
        return e
    return None


def _log_bound_addresses(addr_pipe: multiprocessing.connection.Connection, engine_count: int) -> None:
    """Log the endpoints vLLM reports once all three sockets are bound (nothing if it never does)."""
    try:
        front_publish, back_output, back_publish = addr_pipe.recv()
    except (EOFError, OSError):
        return
    finally:
        addr_pipe.close()
    logger.info(
        "DP coordinator bound: front_publish=%s back_output=%s back_publish=%s; waiting for %d engine(s)",
        front_publish, back_output, back_publish, engine_count,
    )


def _stop_on_signals() -> threading.Event:
    """Make SIGTERM and SIGINT raise KeyboardInterrupt in the main thread, once; the event is set then.

    Python runs a signal's handler in the main thread between bytecodes, and a blocking ZeroMQ call
    returns for it only when the signal interrupts that call's poll(). vLLM's engine gate blocks in
    `recv()` with no timeout until every engine has subscribed; a signal that lands just before that
    poll() starts (at start-up, when the test or the kubelet stops a coordinator that has just bound)
    is taken by the C-level handler and the poll() then sleeps on, the Python handler never run. So a
    thread woken through the signal wakeup fd sends the same signal to the main thread again, every
    half second, until the handler has run (the next one interrupts the poll).
    """
    stop_requested = threading.Event()

    def _request_stop(signum: int, frame: FrameType | None) -> None:
        if stop_requested.is_set():
            return  # already closing the sockets; do not interrupt that
        stop_requested.set()
        logger.info("Received %s, stopping the DP coordinator", signal.Signals(signum).name)
        raise KeyboardInterrupt

    def _until_handled(wake: int, main_thread: int) -> None:
        while data := os.read(wake, 16):
            stops = [n for n in data if n in (signal.SIGTERM, signal.SIGINT)]
            while stops and not stop_requested.wait(0.5):
                signal.pthread_kill(main_thread, stops[0])

    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGTERM, _request_stop)
    signal.signal(signal.SIGINT, _request_stop)
    signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
    main_thread = threading.main_thread().ident
    assert main_thread is not None
    threading.Thread(target=_until_handled, args=(wake_read, main_thread), name="coordinator-stop-signals",
                     daemon=True).start()
    return stop_requested


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    configure_logging(logging.INFO)

    # 1. Fail with the port's name rather than libzmq's bare "Address already in use".
    named_ports = (
        ("--front-publish-port", args.front_publish_port),
        ("--back-output-port", args.back_output_port),
        ("--back-publish-port", args.back_publish_port),
    )
    for flag, port in named_ports:
        if (err := _unbindable(args.host, port)) is not None:
            logger.error("Cannot bind %s %d on %s: %s", flag, port, args.host, err)
            return EXIT_FAILED

    front_publish_address, back_output_address, back_publish_address = (
        get_tcp_uri(args.host, port) for _, port in named_ports
    )

    # 2. Stop on SIGTERM/SIGINT through run_coordinator's KeyboardInterrupt path, once.
    stop_requested = _stop_on_signals()

    # 3. vLLM's loop, with the pipe it reports its bound endpoints on.
    addr_reader, addr_writer = multiprocessing.Pipe(duplex=False)
    reporter = threading.Thread(
        target=_log_bound_addresses, args=(addr_reader, args.engine_count),
        name="coordinator-addresses", daemon=True,
    )
    logger.info(
        "Starting vLLM DP coordinator for %d engine(s) (wave coordination %s, min stats interval %d ms)",
        args.engine_count, "on" if args.enable_wave_coordination else "off", args.min_stats_update_interval_ms,
    )
    try:
        reporter.start()
        DPCoordinatorProc.run_coordinator(
            engine_count=args.engine_count,
            front_publish_address=front_publish_address,
            back_output_address=back_output_address,
            back_publish_address=back_publish_address,
            zmq_addr_pipe=addr_writer,
            min_stats_update_interval_ms=args.min_stats_update_interval_ms,
            enable_wave_coordination=args.enable_wave_coordination,
        )
    except zmq.ZMQError as e:
        if e.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES, errno.EINVAL):
            raise
        # A port taken between the check and vLLM's bind, or a host libzmq cannot bind.
        logger.error(
            "Cannot bind the DP coordinator's sockets (front_publish=%s back_output=%s back_publish=%s): %s",
            front_publish_address, back_output_address, back_publish_address, e,
        )
        return EXIT_FAILED
    except KeyboardInterrupt:
        pass  # a stop signal outside run_coordinator, which handles those inside it
    finally:
        with contextlib.suppress(OSError):
            addr_writer.close()  # run_coordinator closes it too; the reporter then sees EOF
        if reporter.ident is not None:
            reporter.join(timeout=5)  # it closes the read end
        else:
            addr_reader.close()

    if stop_requested.is_set():
        logger.info("DP coordinator stopped")
        return EXIT_OK
    logger.error("DP coordinator loop ended without a stop signal (see vLLM's error above); exiting")
    return EXIT_FAILED


if __name__ == "__main__":
    exit_promptly(main())
