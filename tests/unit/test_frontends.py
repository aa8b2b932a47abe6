# SPDX-License-Identifier: Apache-2.0
"""Several frontends per fleet (docs/design/k-frontends.md), step 1: each is one of vLLM's clients of every engine.

Shown without an engine: the flags and the options they become, what frontend 0 tells the engines in INIT (every
frontend's sockets) and that the others run no handshake, how vLLM gets the client's count and index, and vLLM's own
engine output thread sending each client's outputs on that client's socket.
"""

from __future__ import annotations

import argparse
import inspect
import queue
import re
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import zmq

# The heavy vLLM modules (torch, transformers) load at collection, not inside a test's time limit.
from vllm.entrypoints.launchers.api_server import entry
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.engine.core import EngineCoreProc
from vllm.v1.engine.utils import EngineZmqAddresses
from vllm.v1.serial_utils import MsgpackDecoder

from corefleet_client import commands
from corefleet_client.frontend import __main__ as frontend_main
from corefleet_client.frontend import client, serve
from corefleet_client.frontend import handshake as handshake_module
from corefleet_client.frontend.client import check_client_index
from corefleet_client.frontend.fleet import Fleet
from corefleet_client.frontend.handshake import Handshake, advertised_addresses
from corefleet_client.frontend.types import FleetOptions
from corefleet_harness.support import free_ports

HOSTS = ("f-0.fleet", "f-1.fleet", "f-2.fleet")


def options(**kw: Any) -> FleetOptions:
    base: dict[str, Any] = {"coordinator_address": "c", "coordinator_front_publish_port": 1,
                            "coordinator_back_output_port": 2, "coordinator_back_publish_port": 3}
    return FleetOptions(**{**base, **kw})


def parse(*flags: str) -> argparse.Namespace:
    return frontend_main.build_parser().parse_args(["--coordinator-address", "c", *flags])


FIXED = ("--engine-input-port", "29556", "--engine-output-port", "29557")


# ---- flags and options ----------------------------------------------------------------------------------------
def test_the_frontend_args_name_every_frontend_and_this_ones_index() -> None:
    common: dict[str, Any] = {
        "model": "m", "dp_size": 2, "host": "0.0.0.0", "port": 8000, "dp_address": "$(POD_IP)", "rpc_port": 29550,
        "admin_port": 8001, "admin_token_file": "/t", "coordinator_address": "c",
        "coordinator_front_publish_port": 1, "coordinator_back_output_port": 2, "coordinator_back_publish_port": 3,
        "engine_ports": (29556, 29557)}
    one = commands.frontend_args(**common, advertise_address=HOSTS[0])
    assert "--frontend-addresses" not in one  # one frontend: as before
    assert "--client-index" not in one
    args = commands.frontend_args(**common, advertise_address=HOSTS[1], frontend_addresses=HOSTS, client_index=1)
    ours = args[:args.index(commands.LAUNCHER_ARGS_END)]
    assert ours[-4:] == ["--frontend-addresses", ",".join(HOSTS), "--client-index", "1"]
    opts = frontend_main.build_parser().parse_args(ours)
    assert frontend_main.frontends_problem(opts) is None
    fleet_options = serve.fleet_options(opts)
    assert (fleet_options.frontend_addresses, fleet_options.client_index) == (HOSTS, 1)
    assert (fleet_options.client_count, fleet_options.follower) == (3, True)
    with pytest.raises(ValueError, match="client index 2 without"):
        commands.frontend_args(**common, client_index=2)


def test_one_frontend_is_client_0_of_1() -> None:
    opts = parse()
    assert frontend_main.frontends_problem(opts) is None
    fleet_options = serve.fleet_options(opts)
    assert (fleet_options.client_count, fleet_options.client_index, fleet_options.follower) == (1, 0, False)
    assert serve.server_kwargs(fleet_options) == {}  # vLLM's own defaults, as before


@pytest.mark.parametrize(("flags", "problem"), [
    (("--client-index", "1"), "--client-index needs --frontend-addresses"),
    (("--frontend-addresses", "a,,c", "--advertise-address", "a", *FIXED), "empty entry"),
    (("--frontend-addresses", "a,b,a", "--advertise-address", "a", *FIXED), "names a frontend twice"),
    (("--frontend-addresses", "a,b", "--client-index", "2", "--advertise-address", "a", *FIXED),
     r"--client-index must be in 0..1, got 2"),
    (("--frontend-addresses", "a,b", "--advertise-address", "a"), "needs --engine-input-port"),
    (("--frontend-addresses", "a,b", "--client-index", "1", "--advertise-address", "a", *FIXED),
     r"must be entry 1 of --frontend-addresses \(b\)"),
    (("--frontend-addresses", "a,b", *FIXED), r"--advertise-address \(None\) must be entry 0"),
])
def test_the_frontends_flags_must_agree(flags: tuple[str, ...], problem: str) -> None:
    found = frontend_main.frontends_problem(parse(*flags))
    assert found is not None
    assert re.search(problem, found), found


def test_a_frontend_with_a_wrong_index_exits_2_before_anything_runs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        frontend_main.main(["--coordinator-address", "c", "--frontend-addresses", "a,b", "--client-index", "5",
                            *FIXED, "--advertise-address", "a", "--", "m"])
    assert exit_.value.code == 2
    assert "--client-index must be in 0..1" in capsys.readouterr().err


def test_a_frontend_attaching_with_ranks_left_out_gets_them_from_its_command_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`--detached-ranks` (a frontend replaced while a rank replacement ran): from the operator's arguments to the
    client's options; only with --attach, and never every rank."""
    common: dict[str, Any] = {
        "model": "m", "dp_size": 3, "host": "0.0.0.0", "port": 8000, "dp_address": "$(POD_IP)", "rpc_port": 29550,
        "admin_port": 8001, "admin_token_file": "/t", "coordinator_address": "c",
        "coordinator_front_publish_port": 1, "coordinator_back_output_port": 2, "coordinator_back_publish_port": 3,
        "engine_ports": (29556, 29557)}
    args = commands.frontend_args(**common, attach=True, detached=[2, 1])
    ours = args[:args.index(commands.LAUNCHER_ARGS_END)]
    assert ours[-3:] == ["--attach", "--detached-ranks", "1,2"]
    assert serve.fleet_options(frontend_main.build_parser().parse_args(ours)).detached == (1, 2)
    assert "--detached-ranks" not in commands.frontend_args(**common, attach=True)
    with pytest.raises(ValueError, match="detached ranks without attach"):
        commands.frontend_args(**common, detached=[1])
    assert client.attached_ranks(3, (1,)) == [0, 2]
    for wrong in ((0, 1, 2), (3,)):
        with pytest.raises(ValueError, match=r"must name some of the fleet's ranks 0\.\.2, not all"):
            client.attached_ranks(3, wrong)
    with pytest.raises(SystemExit) as exit_:
        frontend_main.main(["--coordinator-address", "c", "--detached-ranks", "1", "--", "m"])
    assert exit_.value.code == 2
    assert "--detached-ranks needs --attach" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--attach", "--detached-ranks", "1,x")
    assert "not a comma-separated list of ranks" in capsys.readouterr().err


# ---- vLLM gets the client count and index ------------------------------------------------------------------------
def test_several_frontends_hand_vllm_their_client_count_and_index() -> None:
    assert serve.server_kwargs(options(frontend_addresses=HOSTS, client_index=2)) == {
        "client_config": {"client_count": 3, "client_index": 2}}
    # vLLM 0.32.0's path for it: run_server passes its keyword arguments on to run_server_worker, whose
    # client_config becomes AsyncLLM's client_count/client_index (and the config's _api_process_count/_rank).
    assert "uvicorn_kwargs" in inspect.signature(entry.run_server).parameters
    assert "client_config" in inspect.signature(entry.run_server_worker).parameters
    source = inspect.getsource(entry.build_async_engine_client_from_engine_args)
    assert 'client_count = client_config.pop("client_count", 1)' in source
    assert 'client_index = client_config.pop("client_index", 0)' in source
    assert 'engine_args._api_process_count = client_config.get("client_count", 1)' in \
        inspect.getsource(entry.build_async_engine_client)


def test_the_client_refuses_an_index_vllm_did_not_pass_through() -> None:
    check_client_index(options(), 1, 0)
    check_client_index(options(frontend_addresses=HOSTS, client_index=1), 3, 1)
    with pytest.raises(ValueError, match="client 0 of 1, but this is frontend 1 of 3"):
        check_client_index(options(frontend_addresses=HOSTS, client_index=1), 1, 0)


# ---- INIT and the handshake ----------------------------------------------------------------------------------------
def test_init_names_every_frontends_sockets_by_client_index() -> None:
    own = EngineZmqAddresses(inputs=["tcp://f-1.fleet:29556"], outputs=["tcp://f-1.fleet:29557"])
    several = options(frontend_addresses=HOSTS, client_index=1, engine_input_port=29556, engine_output_port=29557)
    assert advertised_addresses(own, several) == EngineZmqAddresses(
        inputs=[f"tcp://{h}:29556" for h in HOSTS], outputs=[f"tcp://{h}:29557" for h in HOSTS])
    alone = advertised_addresses(own, options())
    assert alone == own
    assert alone.inputs is not own.inputs  # a copy: INIT's coordinator fields are set on it
    v6 = options(frontend_addresses=("fd00::1", "fd00::2"), engine_input_port=1, engine_output_port=2)
    assert advertised_addresses(EngineZmqAddresses(["tcp://[fd00::1]:1"], ["tcp://[fd00::1]:2"]), v6).inputs == [
        "tcp://[fd00::1]:1", "tcp://[fd00::2]:1"]
    with pytest.raises(ValueError, match="frontend 0 listens on"):
        advertised_addresses(own, options(frontend_addresses=HOSTS, engine_input_port=29556, engine_output_port=29557))


def vllm_config(host: str, rpc_port: int, size: int = 2) -> Any:
    pc = SimpleNamespace(data_parallel_size_local=0, data_parallel_master_ip=host, data_parallel_rpc_port=rpc_port,
                         data_parallel_size=size)
    return SimpleNamespace(parallel_config=pc, model_config=SimpleNamespace(is_moe=False), cache_config=None)


@pytest.fixture
def ports() -> list[int]:
    return free_ports(3)


def frontends(ports: list[int], index: int) -> FleetOptions:
    hosts = ("127.0.0.1", "127.0.0.2", "127.0.0.3")  # each frontend its own address, the same fixed ports
    return options(coordinator_address="127.0.0.9", engine_input_port=ports[0], engine_output_port=ports[1],
                   frontend_addresses=hosts, client_index=index, advertise_address=hosts[index])


def test_frontend_0_runs_the_handshake_and_init_names_every_frontend(
        ports: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[Any] = []

    def wait_for_engine_startup(socket: Any, engines: list[Any], pc: Any, coordinated: bool, cache: Any,
                                launch: Any) -> None:
        sent.append((sorted(e.index for e in engines), launch.addresses))

    monkeypatch.setattr(handshake_module, "wait_for_engine_startup", wait_for_engine_startup)
    opts = frontends(ports, 0)
    handshake = Handshake(None, opts, Fleet("tiny", 2, frontends=3))  # type: ignore[arg-type]  # no client yet
    client_addresses = handshake.startup(vllm_config("127.0.0.1", ports[2]))
    try:
        [(ranks, init)] = sent
        assert ranks == [0, 1]
        assert init.inputs == [f"tcp://127.0.0.{i}:{ports[0]}" for i in (1, 2, 3)]
        assert init.outputs == [f"tcp://127.0.0.{i}:{ports[1]}" for i in (1, 2, 3)]
        assert (init.coordinator_input, init.coordinator_output, init.frontend_stats_publish_address) == (
            "tcp://127.0.0.9:3", "tcp://127.0.0.9:2", "tcp://127.0.0.9:1")
        # vLLM's client over "externally managed" engines gets this frontend's own pair only.
        assert client_addresses["input_address"] == f"tcp://127.0.0.1:{ports[0]}"
        assert client_addresses["output_address"] == f"tcp://127.0.0.1:{ports[1]}"
        assert client_addresses["stats_update_address"] == "tcp://127.0.0.9:1"
    finally:
        handshake._engine_listeners.cleanup()


def test_another_frontend_runs_no_handshake_and_listens_on_its_own_address(
        ports: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    def no_handshake(*args: Any) -> None:
        raise AssertionError("a follower runs no handshake")

    monkeypatch.setattr(handshake_module, "wait_for_engine_startup", no_handshake)
    handshake = Handshake(None, frontends(ports, 2), Fleet("tiny", 2, frontends=3))  # type: ignore[arg-type]
    client_addresses = handshake.startup(vllm_config("127.0.0.3", ports[2]))
    try:
        assert client_addresses["input_address"] == f"tcp://127.0.0.3:{ports[0]}"
        assert client_addresses["output_address"] == f"tcp://127.0.0.3:{ports[1]}"
        # Its handshake port is not bound: only frontend 0 admits engines.
        with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as router:
            router.bind(f"tcp://127.0.0.3:{ports[2]}")
        # What a join would advertise later is every frontend's too.
        assert handshake._engine_addresses is not None
        assert len(handshake._engine_addresses.inputs) == 3
    finally:
        handshake._engine_listeners.cleanup()


# ---- vLLM's engine: each client's outputs on its own socket ----------------------------------------------------------
def test_vllms_engine_sends_each_clients_outputs_on_that_clients_socket() -> None:
    """`EngineCoreProc.process_output_sockets` (the engine's output thread, vLLM's own code) over three PULLs."""
    with zmq.Context() as ctx:
        pulls = [ctx.socket(zmq.PULL) for _ in range(3)]
        try:
            for pull in pulls:
                pull.bind("tcp://127.0.0.1:*")
            paths = [p.getsockopt_string(zmq.LAST_ENDPOINT) for p in pulls]
            engine: Any = SimpleNamespace(output_queue=queue.Queue(),
                                          _send_msg_tracking_payload=EngineCoreProc._send_msg_tracking_payload)
            for client in (2, 0, 2):
                engine.output_queue.put_nowait((client, EngineCoreOutputs(finished_requests={f"r-{client}"})))
            engine.output_queue.put_nowait(EngineCoreProc.ENGINE_CORE_DEAD)
            thread = threading.Thread(target=EngineCoreProc.process_output_sockets, args=(engine, paths, None, 7),
                                      daemon=True)
            thread.start()
            thread.join(10)
            assert not thread.is_alive()
            decoder = MsgpackDecoder(EngineCoreOutputs)
            received: list[list[Any]] = []
            for pull in pulls:
                got: list[Any] = []
                while pull.poll(2000 if not got or got[-1] != EngineCoreProc.ENGINE_CORE_DEAD else 0):
                    frames = pull.recv_multipart()
                    if frames[0] == EngineCoreProc.ENGINE_CORE_DEAD:
                        got.append(frames[0])
                        break
                    outputs = decoder.decode(frames)
                    got.append((outputs.engine_index, sorted(outputs.finished_requests or ())))
                received.append(got)
            dead = EngineCoreProc.ENGINE_CORE_DEAD
            assert received == [[(7, ["r-0"]), dead], [dead], [(7, ["r-2"]), (7, ["r-2"]), dead]]
        finally:
            for pull in pulls:
                pull.close(linger=0)


def test_the_routing_policy_comes_from_its_flag_else_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("COREFLEET_ROUTING", raising=False)
    assert serve.fleet_options(parse()).routing == "prefix-affinity"
    monkeypatch.setenv("COREFLEET_ROUTING", "least-loaded")
    assert serve.fleet_options(parse()).routing == "least-loaded"
    assert serve.fleet_options(parse("--routing", "prefix-affinity")).routing == "prefix-affinity"
    monkeypatch.setenv("COREFLEET_ROUTING", "round-robin")
    assert serve.fleet_options(parse()).routing == "prefix-affinity"
    assert "$COREFLEET_ROUTING='round-robin' is not one of least-loaded, prefix-affinity" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        frontend_main.main(["--coordinator-address", "c", "--routing-balance", "0.5", "--", "m"])
    assert "--routing-balance at least 1" in capsys.readouterr().err
