# SPDX-License-Identifier: Apache-2.0
"""One headless vLLM engine core (one DP rank) per pod, with health endpoints for the kubelet.

    python -m corefleet_client.engine --health-port 8002 [--health-host 0.0.0.0] -- MODEL --headless \\
        --data-parallel-size N --data-parallel-size-local 1 --data-parallel-start-rank R \\
        --data-parallel-address FRONTEND_HOST --data-parallel-rpc-port 29550 [other vLLM flags]

This does the job of `vllm serve --headless` (`vllm/entrypoints/cli/serve.py::run_headless`) for
exactly one engine, in two processes:

* this launcher, which imports neither vLLM nor torch (the standard library, ZeroMQ, msgspec and
  psutil: ~40 MiB): health endpoints, the handshake relay, signals, exit status, orphans;
* its child `python -m corefleet_client.enginecore` (see that module), which parses everything
  after `--` with vLLM's own `serve` parser, builds the `VllmConfig` as `run_headless` does and then
  runs the engine core in-process (`EngineCoreProc.run_engine_core`), the executor's worker(s)
  below it.

So a rank's vLLM processes are the engine core and its workers, as in stock `vllm serve`. (Until
issue 10 the launcher parsed the flags itself and stayed the parent of an engine core spawned by
vLLM's `CoreEngineProcManager`, so each rank paid one more vLLM import, ~0.9 GiB, for this job.)

What differs from `run_headless`:

1. One rank per pod: `--headless` and `--data-parallel-size-local 1` are required, and so is the
   internal-LB form (`--data-parallel-start-rank`; not `--data-parallel-rank` or the other LB
   modes); `--numa-bind` is refused. The child checks, and exits 2 with a message, as argparse
   does; the launcher exits with its child's status.
2. The frontend's host must resolve (retried by the child for `--resolve-timeout` seconds).
3. The engine does not connect to the frontend's handshake ROUTER itself: it is given a local
   `ipc://` handshake address on which `enginehealth.HandshakeRelay` listens and passes HELLO,
   INIT and READY through unchanged, under the engine's own identity, to the frontend's address,
   which the child reports on a pipe once its config is built. That is how the launcher knows,
   without patching vLLM, that the engine has joined the fleet (see enginehealth.py for why the
   relay is invisible to both ends). If the frontend never answers, the engine gives up after
   vLLM's `HANDSHAKE_TIMEOUT_MINS` and exits; until then the launcher reports not ready.
4. `GET /livez` and `GET /readyz` on `--health-host:--health-port` (enginehealth.HealthServer).
5. Exit status for a pod with `restartPolicy: Never`: 0 after SIGTERM/SIGINT (passed on to the
   engine core as SIGTERM, which vLLM's `run_engine_core` handles by shutting the engine down;
   after the engine's `--shutdown-timeout` plus a 5 s grace it is killed, as vLLM's
   `CoreEngineProcManager.shutdown` does); otherwise, when the engine exits on its own, its exit
   code if non-zero (128+N if killed by signal N), else 1, so the pod ends Failed and the operator
   sees the lost rank.
6. The launcher is a child subreaper: if the engine core dies first, its executor workers become
   the launcher's children, and are stopped (SIGTERM, 5 s, SIGKILL) before it exits; /livez says
   503 meanwhile. vLLM's workers usually notice their parent's death and exit by themselves; a
   wedged one would otherwise outlive the launcher wherever it is not PID 1 of a container.

Multi-node TP/PP (`--nnodes`, `node_rank_within_dp > 0`) is refused: a rank and its TP group live
in one pod.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.parse
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType

import psutil  # a vLLM dependency

from corefleet_client.argv import ARGS_END, split_launcher_argv
from corefleet_client.enginehealth import ChildProcess, EngineState, HandshakeRelay, HealthServer
from corefleet_client.process import configure_logging, exit_promptly

logger = logging.getLogger(__name__)

PROG = "python -m corefleet_client.engine"
ENGINE_CORE_MODULE = "corefleet_client.enginecore"
COORD_STORE_MODULE = "corefleet_client.coordstore"
DEFAULT_HEALTH_HOST = "0.0.0.0"
# The frontend pod may get its address (and DNS record) a little after the engine pods start.
DEFAULT_RESOLVE_TIMEOUT_S = 120.0

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
    parser.add_argument("--frontend-admin-port", type=int, default=None,
                        help="the frontend's admin port: a drain (GET /drain, the pod's pre-stop hook) ends early once "
                             "the frontend no longer accepts connections there (it is gone: nobody will release "
                             "this engine)")
    parser.add_argument("--coord-store-port", type=int, default=None,
                        help="engine rank 0 of an elastic-EP fleet: also serve the startup's coordination store "
                             "(corefleet_client.coordstore) on --health-host at this port")
    return parser


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(launcher args, the vLLM serve arguments, unparsed: the engine core checks them); exits 2
    with a message on a bad launcher argument."""
    parser = build_parser()
    own_argv, vllm_argv = split_launcher_argv(argv)
    args = parser.parse_args(own_argv)
    if not 0 < args.health_port < 65536:
        parser.error(f"--health-port must be in 1..65535, got {args.health_port}")
    if args.coord_store_port is not None and not 0 < args.coord_store_port < 65536:
        parser.error(f"--coord-store-port must be in 1..65535, got {args.coord_store_port}")
    if not vllm_argv:
        parser.error("expected `-- MODEL --headless ...`: the vLLM serve arguments follow `--`")
    return args, vllm_argv


@dataclass(frozen=True)
class LaunchReport:
    """What the engine core tells the launcher once its config is built (`enginecore.report`)."""

    rank: int
    data_parallel_size: int
    frontend_address: str
    shutdown_timeout: float
    name: str

    @classmethod
    def parse(cls, line: bytes) -> LaunchReport:
        data = json.loads(line)
        return cls(rank=int(data["rank"]), data_parallel_size=int(data["data_parallel_size"]),
                   frontend_address=str(data["frontend_address"]),
                   shutdown_timeout=float(data["shutdown_timeout"] or 0), name=str(data["name"]))


def handshake_ipc_address() -> str:
    """A fresh `ipc://` path for the engine's side of the relay, where vLLM puts its own (VLLM_RPC_BASE_PATH)."""
    base = os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir()
    return f"ipc://{base}/corefleet-handshake-{uuid.uuid4()}"


def engine_core_argv(args: argparse.Namespace, vllm_argv: Sequence[str], handshake_address: str,
                     report_fd: int, release_fd: int) -> list[str]:
    return [sys.executable, "-m", ENGINE_CORE_MODULE, "--handshake-address", handshake_address,
            "--report-fd", str(report_fd), "--release-fd", str(release_fd),
            "--resolve-timeout", str(args.resolve_timeout), ARGS_END, *vllm_argv]


def watch_release(fd: int, state: EngineState) -> threading.Thread:
    """The engine core writes a line to its release pipe when the frontend releases it (`RELEASE_UTILITY`): the
    drain (`/drain`) is over. The pipe closes when the engine core exits."""
    def watch() -> None:
        with os.fdopen(fd, "rb") as f:
            for _ in f:
                if not state.released.is_set():
                    logger.info("The frontend released this engine: its pod may stop")
                state.released.set()

    thread = threading.Thread(target=watch, name="release-watch", daemon=True)
    thread.start()
    return thread


def coord_store_argv(args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", COORD_STORE_MODULE, "--host", args.health_host, "--port", str(args.coord_store_port)]


def watch_coord_store(store: subprocess.Popen[bytes], engine: subprocess.Popen[bytes],
                      stopping: threading.Event) -> threading.Thread:
    """A lost coordination store fails the engines that use it (as in vLLM): stop this rank's engine too,
    so that the pod ends Failed and the operator recovers the fleet."""
    def watch() -> None:
        code = store.wait()
        if stopping.is_set() or engine.poll() is not None:
            return
        logger.error("The coordination store (pid %d) exited with code %s; stopping the engine", store.pid, code)
        engine.terminate()

    thread = threading.Thread(target=watch, name="coord-store-watch", daemon=True)
    thread.start()
    return thread


def read_report(fd: int) -> LaunchReport | None:
    """The engine core's launch report, or None if it exited (closing the pipe) without one."""
    with os.fdopen(fd, "rb") as f:
        line = f.readline()
    return LaunchReport.parse(line) if line.strip() else None


def become_subreaper() -> bool:
    """Make processes orphaned below this one (the engine's executor workers, when the engine core
    dies first) this process's children rather than init's, so that `stop_orphans` can stop them.
    In a container the launcher is PID 1 and gets them anyway; run elsewhere, it needs this."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


def stop_engine(engine: subprocess.Popen[bytes], timeout: float, what: str = "the engine core") -> None:
    """SIGTERM, `timeout` seconds, SIGKILL: vLLM's `shutdown` (v1/utils.py) for the engine core (or another
    child of the launcher, named by `what`)."""
    if engine.poll() is None:
        engine.terminate()
        try:
            engine.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("Killing %s (pid %d), still running %.0f s after SIGTERM", what, engine.pid, timeout)
            engine.kill()
            engine.wait()


def stop_orphans(timeout: float = ORPHAN_GRACE_S) -> None:
    """Stop whatever the engine left behind, as vLLM's `shutdown` stops the engine: SIGTERM, wait, SIGKILL.

    Once the engine core has exited, the only children left should be orphans reparented here by
    `become_subreaper` (the engine's executor workers, multiprocessing's resource tracker).
    """
    orphans = list(psutil.Process().children())
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


class StopSignals:
    """SIGTERM (the kubelet) and SIGINT stop the engine once: the first raises KeyboardInterrupt in the main
    thread; later ones, or any once the engine is being stopped (asked to, or it exited), change nothing."""

    def __init__(self) -> None:
        self.requested = False
        self.stopping = False  # the engine is being stopped: a signal must not interrupt that

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)

    def _request_stop(self, signum: int, frame: FrameType | None) -> None:
        if self.requested or self.stopping:
            return  # already shutting the engine down; do not interrupt that
        self.requested = True
        logger.info("Received %s, shutting the engine down", signal.Signals(signum).name)
        raise KeyboardInterrupt


class Launch:
    """The launcher's children and what it learned of them: the coordination store (elastic EP's rank 0), the
    engine core, the launch report and the handshake relay. Started in `run`'s numbered steps, stopped by `stop`."""

    def __init__(self, args: argparse.Namespace, vllm_argv: list[str], state: EngineState,
                 signals: StopSignals) -> None:
        self.args = args
        self.vllm_argv = vllm_argv
        self.state = state
        self.signals = signals
        self.engine: subprocess.Popen[bytes] | None = None
        self.store: subprocess.Popen[bytes] | None = None
        self.store_stopping = threading.Event()
        self.engine_process: ChildProcess | None = None
        self.report: LaunchReport | None = None
        self.relay: HandshakeRelay | None = None
        self.handshake_address = ""  # where the engine core's handshake goes: the relay's local address

    def run(self) -> None:
        """Start everything, then wait until the engine exits (or a signal interrupts)."""
        args = self.args
        # 0. Engine rank 0 of an elastic-EP fleet: the startup's coordination store, before the engine
        #    (every engine of the fleet opens it at startup).
        if args.coord_store_port is not None:
            self.store = subprocess.Popen(coord_store_argv(args), stdin=subprocess.DEVNULL)
            logger.info("Coordination store process started (pid %d) on %s:%d", self.store.pid, args.health_host,
                        args.coord_store_port)
        # 1. The engine core: it parses vLLM's flags, builds the config and reports on a pipe.
        engine, report_r = self._start_engine()
        self.report = launch = read_report(report_r)
        # 2. The relay, to the frontend the engine core reported.
        if launch is not None:
            self.state.rank = launch.rank
            if args.frontend_admin_port is not None:
                self.state.frontend = (urllib.parse.urlsplit(launch.frontend_address).hostname or "",
                                       args.frontend_admin_port)
            self.relay = HandshakeRelay(launch.rank, self.handshake_address, launch.frontend_address,
                                        joined=self.state.joined)
            self.relay.start()
            logger.info("Engine core %s (pid %d) is rank %d of %d, frontend %s", launch.name, engine.pid,
                        launch.rank, launch.data_parallel_size, launch.frontend_address)
        # 3. Until the engine exits or a signal arrives.
        engine.wait()
        self.signals.stopping = True
        if launch is not None:
            logger.error("Engine core %s exited with code %s without a stop signal; exiting",
                         launch.name, engine.returncode)
        else:
            logger.error("The engine core exited with code %s before it was configured; exiting", engine.returncode)

    def _start_engine(self) -> tuple[subprocess.Popen[bytes], int]:
        """The engine core process, and the read end of the pipe it reports on."""
        report_r, report_w = os.pipe()
        release_r, release_w = os.pipe()
        self.handshake_address = handshake_ipc_address()
        try:
            engine = self.engine = subprocess.Popen(
                engine_core_argv(self.args, self.vllm_argv, self.handshake_address, report_w, release_w),
                stdin=subprocess.DEVNULL, pass_fds=(report_w, release_w))
        except BaseException:
            os.close(release_r)
            raise
        finally:
            os.close(report_w)
            os.close(release_w)
        watch_release(release_r, self.state)
        self.engine_process = ChildProcess(engine)
        self.state.attach(self.engine_process)
        if self.store is not None:
            watch_coord_store(self.store, engine, self.store_stopping)
        logger.info("Engine core process started (pid %d)", engine.pid)
        return engine, report_r

    def stop(self) -> None:
        """Stop what runs: the relay, the engine if a signal asked (it exited otherwise), the store, orphans."""
        if self.relay is not None:
            self.relay.close()
        if self.engine is not None and self.signals.requested:
            grace = (self.report.shutdown_timeout if self.report is not None else 0.0) + ORPHAN_GRACE_S
            logger.info("Waiting up to %.0f seconds for the engine to exit", grace)
            stop_engine(self.engine, grace)
        if self.store is not None:
            self.store_stopping.set()
            stop_engine(self.store, ORPHAN_GRACE_S, "the coordination store")  # after the engine, which may use it
        if self.engine is not None:
            stop_orphans()

    def exit_status(self) -> int:
        if self.signals.requested:
            logger.info("Engine stopped")
            return EXIT_OK
        assert self.engine is not None
        if self.report is None and self.engine.returncode == EXIT_USAGE:
            return EXIT_USAGE  # refused arguments, explained by the engine core on stderr
        return _exit_status(self.engine.returncode)


def main(argv: Sequence[str] | None = None) -> int:
    args, vllm_argv = parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging(logging.INFO)
    signals = StopSignals()
    signals.install()
    become_subreaper()
    state = EngineState(None)
    try:
        health = HealthServer(args.health_host, args.health_port, state)
    except OSError as e:
        logger.error("Cannot serve health on %s:%d: %s", args.health_host, args.health_port, e)
        return EXIT_FAILED
    launch = Launch(args, vllm_argv, state, signals)
    try:
        health.start()
        launch.run()
    except KeyboardInterrupt:
        if not signals.requested:
            raise
    finally:
        signals.stopping = True
        launch.stop()
        health.close()  # /livez has said 503 since the engine exited
        if launch.engine_process is not None:
            launch.engine_process.close()
    return launch.exit_status()


if __name__ == "__main__":
    exit_promptly(main())
