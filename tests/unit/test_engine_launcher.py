# SPDX-License-Identifier: Apache-2.0
"""The engine launcher's parts that need no engine: the handshake relay at the wire level, the
health endpoints, the frontend-address check, and the refusal of arguments it cannot run.

The relay is driven with pyzmq playing vLLM 0.32.0's two ends: a frontend ROUTER
(`launch_core_engines` / `wait_for_engine_startup`) and an engine DEALER whose identity is its rank
(`EngineCoreProc._perform_handshake`). Payloads are msgpack maps as vLLM sends them; the relay must
pass them byte for byte.

The launcher's own argument tests import no vLLM (the launcher never does); the tests of the vLLM
arguments parse with vLLM's own `serve` parser in the engine core's module, so they import vLLM (and
torch) once, in-process; no engine starts.
"""

from __future__ import annotations

import json
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import msgspec
import pytest
import zmq

from corefleet_client import engine as launcher
from corefleet_client.enginehealth import ChildProcess, EngineState, HandshakeRelay, HealthServer, engine_identity
from corefleet_harness.support import free_ports, http_get, wait_until
from corefleet_operator import builders
from corefleet_operator.constants import ENGINE_HEALTH_PORT
from factories import make_ecs

STEP_TIMEOUT_MS = 5000

HELLO = msgspec.msgpack.encode({"status": "HELLO", "local": False, "headless": True})
# Stands in for msgpack(EngineHandshakeMetadata): the frontend's and coordinator's addresses.
INIT = msgspec.msgpack.encode({
    "addresses": {"inputs": ["tcp://10.0.0.5:41000"], "outputs": ["tcp://10.0.0.5:41001"],
                  "coordinator_input": "tcp://10.0.0.6:29553", "coordinator_output": "tcp://10.0.0.6:29552",
                  "frontend_stats_publish_address": None},
    "parallel_config": {},
})
READY = msgspec.msgpack.encode({"status": "READY", "local": False, "headless": True,
                                "parallel_config_hash": "0123abcd"})


@pytest.fixture
def ctx() -> Iterator[zmq.SyncContext]:
    context: zmq.SyncContext = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def ipc_path(tmp_path: Path) -> Iterator[str]:
    # A short path: ipc:// names are limited to ~107 bytes.
    path = Path("/tmp") / f"corefleet-relay-{uuid.uuid4().hex[:12]}"
    yield f"ipc://{path}"
    path.unlink(missing_ok=True)


def recv(sock: zmq.SyncSocket) -> list[bytes]:
    assert sock.poll(STEP_TIMEOUT_MS), "nothing arrived"
    return sock.recv_multipart()


def test_relay_passes_the_handshake_through_and_joins_only_on_ready(ctx: zmq.SyncContext, ipc_path: str) -> None:
    rank = 3
    frontend = ctx.socket(zmq.ROUTER)
    frontend.bind("tcp://127.0.0.1:*")
    frontend_address = frontend.getsockopt_string(zmq.LAST_ENDPOINT)

    relay = HandshakeRelay(rank, ipc_path, frontend_address)
    relay.start()
    engine = ctx.socket(zmq.DEALER)
    engine.setsockopt(zmq.IDENTITY, engine_identity(rank))
    engine.connect(ipc_path)
    try:
        # HELLO up: the frontend sees the engine's identity (the relay's DEALER) and the same bytes.
        engine.send(HELLO)
        identity, payload = recv(frontend)
        assert identity == b"\x03\x00" == rank.to_bytes(2, "little")
        assert payload == HELLO
        assert not relay.joined.is_set()

        # INIT down, addressed by identity as wait_for_engine_startup does.
        frontend.send_multipart([identity, INIT])
        assert recv(engine) == [INIT]
        assert not relay.joined.is_set()

        # READY up; then the relay is done and gone.
        engine.send(READY)
        assert recv(frontend) == [identity, READY]
        assert relay.joined.wait(timeout=STEP_TIMEOUT_MS / 1000)
        relay.close()
        assert not Path(ipc_path.removeprefix("ipc://")).exists()
    finally:
        relay.close()
        engine.close(linger=0)
        frontend.close(linger=0)


def test_relay_queues_hello_until_the_frontend_listens(ctx: zmq.SyncContext, ipc_path: str) -> None:
    """An engine that starts before the frontend binds: HELLO waits in the relay, as in vLLM's DEALER."""
    # Nobody listens there yet. A port below the ephemeral range: the relay's reconnects to a port
    # inside it can connect to themselves (TCP self-connect) and take the port from the frontend.
    frontend_address = f"tcp://127.0.0.1:{free_ports(1)[0]}"

    relay = HandshakeRelay(0, ipc_path, frontend_address)
    relay.start()
    engine = ctx.socket(zmq.DEALER)
    engine.setsockopt(zmq.IDENTITY, engine_identity(0))
    engine.connect(ipc_path)
    frontend = ctx.socket(zmq.ROUTER)
    try:
        engine.send(HELLO)
        frontend.bind(frontend_address)
        assert recv(frontend) == [b"\x00\x00", HELLO]
        assert not relay.joined.is_set()
    finally:
        relay.close()
        engine.close(linger=0)
        frontend.close(linger=0)


def test_relay_drops_an_engine_with_another_rank(ctx: zmq.SyncContext, ipc_path: str) -> None:
    frontend = ctx.socket(zmq.ROUTER)
    frontend.bind("tcp://127.0.0.1:*")
    relay = HandshakeRelay(1, ipc_path, frontend.getsockopt_string(zmq.LAST_ENDPOINT))
    relay.start()
    stranger = ctx.socket(zmq.DEALER)
    stranger.setsockopt(zmq.IDENTITY, engine_identity(2))
    stranger.connect(ipc_path)
    engine = ctx.socket(zmq.DEALER)
    engine.setsockopt(zmq.IDENTITY, engine_identity(1))
    engine.connect(ipc_path)
    try:
        stranger.send(READY)
        engine.send(HELLO)
        # Only rank 1's HELLO arrives (ordering across the two peers is not guaranteed, so the
        # stranger's READY, had it been relayed, could come first or second).
        assert recv(frontend) == [b"\x01\x00", HELLO]
        assert not frontend.poll(300)
        assert not relay.joined.is_set()
    finally:
        relay.close()
        stranger.close(linger=0)
        engine.close(linger=0)
        frontend.close(linger=0)


class FakeProcess:
    """A process whose sentinel is a pipe: readable (exited) once `exit()` closes the write end."""

    def __init__(self) -> None:
        self.sentinel, self._write = os.pipe()
        self.exitcode: int | None = None

    def exit(self, code: int) -> None:
        self.exitcode = code
        os.close(self._write)

    def close(self) -> None:
        os.close(self.sentinel)
        if self.exitcode is None:
            os.close(self._write)


def get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    status, body = http_get(f"http://127.0.0.1:{port}{path}")
    return status, json.loads(body)


@pytest.fixture
def served() -> Iterator[tuple[EngineState, int]]:
    state = EngineState(rank=1)
    server = HealthServer("127.0.0.1", 0, state)
    server.start()
    try:
        yield state, server.port
    finally:
        server.close()


def test_health_follows_the_engine(served: tuple[EngineState, int]) -> None:
    state, port = served
    starting = {"rank": 1, "state": "starting", "exitcode": None, "released": False}
    # Before the engine process exists (config being built) and while it starts.
    assert get(port, "/livez") == (200, starting)
    assert get(port, "/readyz") == (503, starting)
    proc = FakeProcess()
    try:
        state.attach(proc)
        assert get(port, "/readyz") == (503, starting)
        state.joined.set()  # the relay passed READY
        assert get(port, "/readyz") == (200, {"rank": 1, "state": "ready", "exitcode": None, "released": False})
        assert get(port, "/livez?verbose") == (200, {"rank": 1, "state": "ready", "exitcode": None, "released": False})
        proc.exit(-9)
        exited = {"rank": 1, "state": "exited", "exitcode": -9, "released": False}
        assert get(port, "/livez") == (503, exited)
        assert get(port, "/readyz") == (503, exited)
        assert get(port, "/metrics")[0] == 404
    finally:
        proc.close()


def test_a_drain_ends_the_readiness_and_returns_once_the_frontend_released_the_engine(
        served: tuple[EngineState, int]) -> None:
    """The pod's pre-stop hook (`GET /drain`) holds the engine until the frontend has drained and released it."""
    state, port = served
    proc = FakeProcess()
    try:
        state.attach(proc)
        state.joined.set()
        answer: list[tuple[int, dict[str, Any]]] = []
        hook = threading.Thread(target=lambda: answer.append(get(port, "/drain?timeout=60")))
        hook.start()
        wait_until(lambda: get(port, "/readyz")[0] == 503, 10, "the rank not ready once draining")
        assert get(port, "/readyz")[1]["state"] == "draining"
        assert get(port, "/livez")[0] == 200  # alive: its requests still run
        assert hook.is_alive()  # nothing released it yet
        read, write = os.pipe()
        launcher.watch_release(read, state)  # as the engine core's release pipe
        os.write(write, b"released\n")
        hook.join(10)
        assert answer == [(200, {"rank": 1, "state": "draining", "exitcode": None, "released": True,
                                 "drained": "released by the frontend"})]
        os.close(write)
    finally:
        proc.close()


def test_a_drain_ends_at_its_timeout_when_the_engine_exits_or_once_the_frontend_is_gone() -> None:
    state = EngineState(rank=0)
    proc = FakeProcess()
    state.attach(proc)
    try:
        assert state.drain(0.3) == "not released within 0.3s"
        with socket.socket() as listener:  # the frontend's admin port, up
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            state.frontend = listener.getsockname()
            assert state.drain(0.5) == "not released within 0.5s"
        assert state.drain(60) == "the frontend is gone"  # the port closed: nobody will release the engine
        state.frontend = None
        proc.exit(0)
        assert state.drain(60) == "the engine exited"
    finally:
        proc.close()


def test_a_drain_with_a_bad_timeout_is_refused(served: tuple[EngineState, int]) -> None:
    _, port = served
    status, body = get(port, "/drain?timeout=soon")
    assert status == 400
    assert "timeout" in body["error"]


def test_health_port_in_use_is_an_error(served: tuple[EngineState, int]) -> None:
    _, port = served
    with pytest.raises(OSError, match="in use"):
        HealthServer("127.0.0.1", port, EngineState(rank=0))


def test_health_before_the_engine_core_reports_its_rank() -> None:
    state = EngineState(None)
    server = HealthServer("127.0.0.1", 0, state)
    server.start()
    try:
        assert get(server.port, "/livez") == (200, {"rank": None, "state": "starting", "exitcode": None,
                                                    "released": False})
        state.rank = 3
        assert get(server.port, "/readyz") == (503, {"rank": 3, "state": "starting", "exitcode": None,
                                                     "released": False})
    finally:
        server.close()


def _engine_probes() -> dict[str, str]:
    """The path each probe of an engine pod, as the operator builds it, asks the launcher for."""
    pod = builders.engine_pod(make_ecs("a").replicas(2).obj(), 1, dp_size=2, frontend_address="a-frontend-0.a-fleet")
    container = pod["spec"]["containers"][0]
    assert {p["containerPort"] for p in container["ports"]} == {ENGINE_HEALTH_PORT}
    return {kind: container[kind]["httpGet"]["path"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}


def test_engine_pod_is_neither_started_nor_ready_before_its_engine_joins(served: tuple[EngineState, int]) -> None:
    """readyTimeoutSeconds is the startup probe's budget: it bounds the engine's start only if the
    startup probe fails until the engine has joined the fleet (the kubelet then kills the pod)."""
    state, port = served
    probes = _engine_probes()
    proc = FakeProcess()
    try:
        state.attach(proc)  # the engine core runs, loading its model: not joined
        assert {kind: get(port, path)[0] for kind, path in probes.items()} == \
            {"startupProbe": 503, "readinessProbe": 503, "livenessProbe": 200}
        state.joined.set()  # READY relayed: the engine joined the fleet
        assert {kind: get(port, path)[0] for kind, path in probes.items()} == \
            {"startupProbe": 200, "readinessProbe": 200, "livenessProbe": 200}
    finally:
        proc.close()


@pytest.mark.parametrize(("script", "exitcode"), [
    pytest.param("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL, id="killed"),
    pytest.param("raise SystemExit(3)", 3, id="exit-3"),
    pytest.param("pass", 0, id="exit-0"),
])
def test_child_process_exit_is_seen_without_reaping_it(script: str, exitcode: int) -> None:
    """The health threads read the engine core's exit without reaping it: the main thread's wait() still works."""
    popen = subprocess.Popen([sys.executable, "-c", f"import sys; sys.stdin.read(); {script}"], stdin=subprocess.PIPE)
    child = ChildProcess(popen)
    try:
        state = EngineState(0)
        state.attach(child)
        assert child.exitcode is None
        assert state.snapshot() == {"rank": 0, "state": "starting", "exitcode": None, "released": False}
        assert popen.stdin is not None
        popen.stdin.close()  # the child goes on to exit
        assert multiprocessing.connection.wait([child.sentinel], timeout=10), "the child did not exit"
        assert child.exitcode == exitcode
        assert state.snapshot() == {"rank": 0, "state": "exited", "exitcode": exitcode, "released": False}
        assert popen.returncode is None  # not reaped
        assert popen.wait(timeout=10) == exitcode
        assert child.exitcode == exitcode  # and after the main thread reaped it
    finally:
        if popen.poll() is None:
            popen.kill()
            popen.wait()
        child.close()


# --- The launcher's own arguments: no vLLM. ---

def refusal(main: Any, capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


GOOD = ["tiny-model", "--headless", "--data-parallel-size", "2", "--data-parallel-size-local", "1",
        "--data-parallel-start-rank", "1", "--data-parallel-address", "10.0.0.5", "--data-parallel-rpc-port", "29550"]


@pytest.mark.parametrize(("argv", "message"), [
    pytest.param(["--health-port", "8002", *GOOD], "unrecognized arguments", id="no-separator"),
    pytest.param(["--health-port", "8002", "--"], "the vLLM serve arguments follow `--`", id="nothing-after"),
    pytest.param(["--", *GOOD], "the following arguments are required: --health-port", id="no-health-port"),
    pytest.param(["--health-port", "0", "--", *GOOD], "--health-port must be in 1..65535", id="port-0"),
    pytest.param(["--health-port", "8002", "--coord-store-port", "0", "--", *GOOD],
                 "--coord-store-port must be in 1..65535", id="store-port-0"),
])
def test_refused_launcher_arguments(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    err = refusal(launcher.main, capsys, argv)
    assert message in err, err


def test_the_engine_core_gets_the_vllm_arguments_untouched() -> None:
    args, vllm_argv = launcher.parse_args(["--health-port", "8002", "--resolve-timeout", "7", "--", *GOOD])
    argv = launcher.engine_core_argv(args, vllm_argv, "ipc:///tmp/x", 9, 10)
    assert argv == [sys.executable, "-m", "corefleet_client.enginecore", "--handshake-address", "ipc:///tmp/x",
                    "--report-fd", "9", "--release-fd", "10", "--resolve-timeout", "7.0", "--", *GOOD]


def test_launch_report_round_trips(tmp_path: Path) -> None:
    r, w = os.pipe()
    with os.fdopen(w, "w") as f:
        f.write(json.dumps({"rank": 1, "data_parallel_size": 2, "frontend_address": "tcp://10.0.0.5:29550",
                            "shutdown_timeout": 0, "name": "EngineCore_DP1"}) + "\n")
    assert launcher.read_report(r) == launcher.LaunchReport(
        rank=1, data_parallel_size=2, frontend_address="tcp://10.0.0.5:29550", shutdown_timeout=0.0,
        name="EngineCore_DP1")
    r, w = os.pipe()
    os.close(w)  # the engine core exited before it reported
    assert launcher.read_report(r) is None


@pytest.mark.parametrize(("exitcode", "status"), [(-9, 137), (-15, 143), (3, 3), (0, 1), (None, 1)])
def test_an_engine_that_exits_on_its_own_fails_the_pod(exitcode: int | None, status: int) -> None:
    assert launcher._exit_status(exitcode) == status


# --- The engine core's vLLM arguments: vLLM's parser, imported once for the module. ---

@pytest.fixture(scope="module")
def enginecore() -> ModuleType:
    import corefleet_client.enginecore as enginecore

    return enginecore


def test_the_launcher_is_told_of_the_release_once_every_frontend_released(enginecore: ModuleType,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Several frontends (the engine's clients): each drains its own requests and releases the engine with its
    client index; the launcher's pipe gets its line once all of them did (a repeat counts once)."""
    from vllm.v1.engine.core import EngineCoreProc

    from corefleet_client.admin import RELEASE_UTILITY

    monkeypatch.setattr(EngineCoreProc, RELEASE_UTILITY, None, raising=False)  # restored after the test
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    try:
        enginecore.install_release_utility(write_end)
        release = getattr(EngineCoreProc, RELEASE_UTILITY)

        def lines() -> bytes:
            try:
                return os.read(read_end, 100)
            except BlockingIOError:
                return b""

        two = SimpleNamespace(addresses=SimpleNamespace(inputs=["tcp://f0:1", "tcp://f1:1"]))
        assert release(two, 1) is True
        assert release(two, 1) is True  # the same frontend again: still one of two
        assert lines() == b""
        assert release(two, 0) is True
        assert lines() == b"released\n"
        one = SimpleNamespace(addresses=SimpleNamespace(inputs=["tcp://f0:1"]))
        assert release(one) is True  # one frontend (an older one passes no index): released at once
        assert lines() == b"released\n"
    finally:
        os.close(read_end)
        os.close(write_end)


def test_unresolvable_frontend_fails_with_a_message(enginecore: ModuleType) -> None:
    error = enginecore.wait_resolvable("no-such-frontend.invalid", 29550, timeout=0)
    assert error is not None
    assert "--data-parallel-address 'no-such-frontend.invalid' does not resolve" in error
    assert enginecore.wait_resolvable("127.0.0.1", 29550, timeout=0) is None


@pytest.mark.parametrize(("vllm_args", "message"), [
    pytest.param([a for a in GOOD if a != "--headless"], "--headless is required", id="no-headless"),
    pytest.param([*GOOD[:5], "2", *GOOD[6:]], "--data-parallel-size-local must be 1 (one DP rank per pod), got 2",
                 id="dpl-2"),
    pytest.param([*GOOD[:4], "-dpl=0", *GOOD[6:]], "--data-parallel-size-local must be 1 (one DP rank per pod), got 0",
                 id="dpl-0-short-form"),
    pytest.param([*GOOD[:4], *GOOD[6:]], "--data-parallel-size-local must be 1 (one DP rank per pod), got unset",
                 id="dpl-unset"),
    pytest.param([*GOOD, "--data-parallel-rank", "1"], "give the rank with --data-parallel-start-rank",
                 id="external-lb"),
    pytest.param([*GOOD, "--numa-bind"], "--numa-bind is not supported", id="numa-bind"),
    pytest.param([*GOOD, "--no-such-vllm-flag"], "unrecognized arguments: --no-such-vllm-flag", id="unknown-flag"),
])
def test_refused_vllm_arguments(enginecore: ModuleType, capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch, vllm_args: list[str], message: str) -> None:
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    err = refusal(enginecore.main, capsys, ["--handshake-address", "ipc:///tmp/x", "--report-fd", "9", "--",
                                            *vllm_args])
    assert message in err, err


def test_vllm_arguments_parse_as_vllm_serve_does(enginecore: ModuleType) -> None:
    """Underscore forms, `--model`, short flags and dotted config flags all reach vLLM's namespace."""
    args, serve = enginecore.parse_args([
        "--handshake-address", "ipc:///tmp/x", "--report-fd", "9", "--",
        "--model", "tiny-model", "--headless", "-dp", "2", "--data_parallel_size_local=1", "-dpr", "1",
        "--data-parallel-address", "frontend.fleet.ns.svc", "--data-parallel-rpc-port", "29550",
        "--compilation-config.mode", "0", "--max-model-len=256",
    ])
    assert (args.handshake_address, args.report_fd) == ("ipc:///tmp/x", 9)
    assert serve.model == "tiny-model"
    assert (serve.data_parallel_size, serve.data_parallel_size_local, serve.data_parallel_start_rank) == (2, 1, 1)
    assert serve.data_parallel_address == "frontend.fleet.ns.svc"
    assert serve.api_server_count == 0
    assert serve.max_model_len == 256
    assert serve.compilation_config.mode == 0  # a dotted flag, merged into JSON by FlexibleArgumentParser


@pytest.mark.parametrize(("rank", "size", "name"), [(0, 1, "EngineCore"), (0, 2, "EngineCore_DP0"),
                                                    (3, 4, "EngineCore_DP3")])
def test_engine_core_names_follow_vllm(enginecore: ModuleType, rank: int, size: int, name: str) -> None:
    assert enginecore.engine_name(rank, size) == name


def test_rank_0_of_an_elastic_fleet_serves_the_coordination_store_on_its_health_host() -> None:
    args, _ = launcher.parse_args(["--health-host", "10.0.0.9", "--health-port", "8002", "--coord-store-port", "29554",
                                   "--", *GOOD])
    assert launcher.coord_store_argv(args) == [sys.executable, "-m", "corefleet_client.coordstore",
                                               "--host", "10.0.0.9", "--port", "29554"]
    args, _ = launcher.parse_args(["--health-port", "8002", "--", *GOOD])
    assert args.coord_store_port is None


def test_a_lost_coordination_store_stops_the_engine() -> None:
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    store = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        launcher.watch_coord_store(store, engine, threading.Event()).join(30)
        assert engine.wait(30) == -signal.SIGTERM
    finally:
        engine.kill()
        engine.wait()


def test_a_store_stopped_on_purpose_leaves_the_engine_alone() -> None:
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    store = subprocess.Popen([sys.executable, "-c", "raise SystemExit(0)"])
    stopping = threading.Event()
    stopping.set()
    try:
        launcher.watch_coord_store(store, engine, stopping).join(30)
        assert engine.poll() is None
    finally:
        engine.kill()
        engine.wait()


def test_the_engines_sockets_find_a_replacement_frontend_and_announce_again_when_it_attaches(
        enginecore: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """`install_attach_support` on real zmq sockets: the engine's requests DEALER (made in vLLM's input thread) keeps
    its first message (the ready response) and sends it again when the frontend calls the attach utility; every
    socket the engine core makes connects with a bounded connect and heartbeats (so that it resolves a replacement
    frontend's new address rather than waiting on the old one)."""
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine import core as vllm_core
    from vllm.v1.engine.core import EngineCoreProc

    from corefleet_client.admin import ATTACH_UTILITY

    for name in ("process_input_sockets", ATTACH_UTILITY):
        monkeypatch.setattr(EngineCoreProc, name, getattr(EngineCoreProc, name, None), raising=False)
    monkeypatch.setattr(vllm_core, "make_zmq_socket", vllm_core.make_zmq_socket)
    enginecore.install_attach_support()
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    router.setsockopt(zmq.RCVTIMEO, 10_000)
    made: list[Any] = []

    def input_thread() -> None:  # as vLLM's process_input_sockets: the DEALER it makes per frontend
        enginecore._INPUT_THREAD.active = True
        made.append(vllm_core.make_zmq_socket(ctx, f"tcp://127.0.0.1:{port}", zmq.DEALER, bind=False,
                                              identity=b"\x00\x00"))

    thread = threading.Thread(target=input_thread)
    thread.start()
    thread.join()
    [dealer] = made
    try:
        assert [dealer.getsockopt(o) for o, _ in enginecore.CONNECTION_OPTIONS] == \
            [v for _, v in enginecore.CONNECTION_OPTIONS]
        dealer.send(b"ready")
        dealer.send(b"an output, not kept")
        assert router.recv_multipart() == [b"\x00\x00", b"ready"]
        assert router.recv_multipart() == [b"\x00\x00", b"an output, not kept"]
        other = msgspec.msgpack.encode([0, 7, "get_supported_tasks", []])
        router.send_multipart([b"\x00\x00", EngineCoreRequestType.UTILITY.value, other])
        assert dealer.poll(10_000)
        assert dealer.recv_multipart()[1] == other
        attach = msgspec.msgpack.encode([1, 8, ATTACH_UTILITY, [1]])
        router.send_multipart([b"\x00\x00", EngineCoreRequestType.UTILITY.value, attach])
        assert dealer.poll(10_000)
        assert dealer.recv_multipart()[1] == attach
        assert router.recv_multipart() == [b"\x00\x00", b"ready"]  # announced again, once
        assert not router.poll(200)
    finally:
        dealer.close(0)
        router.close(0)
        ctx.term()

    # The utility: the requests of the attaching client index (its dead predecessor's) are aborted, no other.
    aborted: list[list[str]] = []
    engine = SimpleNamespace(
        scheduler=SimpleNamespace(requests={"a": SimpleNamespace(client_index=1),
                                            "b": SimpleNamespace(client_index=0),
                                            "c": SimpleNamespace(client_index=1)}),
        abort_requests=aborted.append)
    assert getattr(EngineCoreProc, ATTACH_UTILITY)(engine, 1) == 2
    assert aborted == [["a", "c"]]
