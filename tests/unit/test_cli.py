# SPDX-License-Identifier: Apache-2.0
"""The `corefleet` command: argument handling, and local mode's supervision with stand-in processes.

Local mode (`corefleet up/status/down`, `corefleet_harness.local`) is exercised here with `sleep`
processes and a fake interpreter that plays the coordinator, frontend (health + admin API) and
engines in a few lines; the real fleet runs in tests/e2e/test_local.py. `corefleet cluster up`
runs in tests/e2e/test_up.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from corefleet_client import commands
from corefleet_client.admin import FLEET_PATH, FleetState, FleetStatus, RankState, RankStatus, authorized
from corefleet_harness import local
from corefleet_harness.cli import build_parser, main
from corefleet_harness.emulator import EMULATOR_MODULE
from corefleet_harness.support import free_ports, http_get, wait_until
from corefleet_harness.tinymodel import VLLM_CPU_FLAGS
from corefleet_operator import __version__, builders, constants
from factories import make_ecs
from procs import read_lines_until

# ---- argument handling -----------------------------------------------------------------------------


def test_cluster_up_without_control_plane_binaries_explains_the_fix(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("COREFLEET_K8S_BIN", raising=False)

    rc = main(["cluster", "up", "--exit-when-ready"])

    assert rc == 2
    assert "hack/control-plane.sh" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == __version__


@pytest.mark.parametrize(("argv", "code"), [(["version"], 128 + signal.SIGPIPE), (["up", "--help"], 0)])
def test_a_reader_that_went_away_ends_the_command_quietly(argv: list[str], code: int) -> None:
    """`corefleet status | head`: the pipe's reader is gone before the command writes. No traceback on
    stderr (nor Python's "Exception ignored" at exit); a command's output lost that way exits as a process
    killed by SIGPIPE would (argparse's help ignores the failed write itself and exits 0)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "corefleet_harness.cli", *argv], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=25, check=False)
    finally:
        os.close(write_end)
    assert done.stderr == ""
    assert done.returncode == code


@pytest.mark.parametrize("argv", [[], ["cluster"]])
def test_a_command_is_required(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as err:
        build_parser().parse_args(argv)
    assert err.value.code == 2


def test_operator_arguments_pass_through(monkeypatch: pytest.MonkeyPatch) -> None:
    from corefleet_operator import __main__ as operator_main

    seen: list[list[str]] = []

    def operator_main_stand_in(argv: Sequence[str]) -> int:
        seen.append(list(argv))
        return 0

    monkeypatch.setattr(operator_main, "main", operator_main_stand_in)

    assert main(["operator", "--namespace", "a", "--verbose"]) == 0
    assert seen == [["--namespace", "a", "--verbose"]]


def test_operator_parser_accepts_namespaces_and_liveness() -> None:
    from corefleet_operator.__main__ import parse_args

    args = parse_args(["-n", "a", "--namespace", "b", "--liveness", ""])
    assert args.namespace == ["a", "b"]
    assert args.liveness == ""


def _captured_options(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> tuple[local.FleetOptions, bool]:
    seen: list[tuple[local.FleetOptions, bool]] = []

    def fake_up(opts: local.FleetOptions, *, detach: bool) -> int:
        seen.append((opts, detach))
        return 0

    monkeypatch.setattr(local, "up", fake_up)
    assert main(argv) == 0
    return seen[0]


def test_up_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))

    opts, detach = _captured_options(monkeypatch, ["up"])

    assert (opts.replicas, opts.engine, opts.model, opts.port, detach) == (2, "vllm", None, 8000, False)
    assert opts.state_dir == tmp_path / "corefleet"
    assert opts.vllm_flags is None  # the tiny model's CPU flags
    assert opts.python == sys.executable


def test_up_options_and_vllm_flags_after_the_separator(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    opts, detach = _captured_options(monkeypatch, [
        "up", "--replicas", "4", "--engine", "emulator", "--port", "9000", "--state-dir", str(tmp_path),
        "--detach", "--token-delay-ms", "5", "--timeout", "30", "--", "--max-model-len", "128", "--detach"])

    assert (opts.replicas, opts.engine, opts.port, opts.state_dir, detach) == (4, "emulator", 9000, tmp_path, True)
    assert (opts.token_delay_ms, opts.ready_timeout) == (5, 30.0)
    assert opts.vllm_flags == ("--max-model-len", "128", "--detach")


def test_up_elastic_ep_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    opts, _ = _captured_options(monkeypatch, ["up", "--moe", "--elastic-ep-max", "4", "--gpus-per-rank", "2"])

    assert (opts.moe, opts.elastic_ep_max, opts.gpus_per_rank) == (True, 4, 2)


@pytest.mark.parametrize(("argv", "message"), [
    (["up", "--replicas", "3", "--elastic-ep-max", "2"], "--elastic-ep-max (2) must be at least --replicas (3)"),
    (["up", "--gpus-per-rank", "-1"], "--gpus-per-rank must be >= 0"),
    (["up", "--replicas", "0"], "--replicas must be at least 1"),
    (["up", "--token-delay-ms", "3"], "--engine emulator only"),
    (["up", "--port", "70000"], "--port must be in 1..65535"),
])
def test_up_refuses_bad_options(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_default_state_dir_without_runtime_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))

    assert local.default_state_dir() == tmp_path / ".cache" / "corefleet" / "local"


def test_status_and_down_without_a_fleet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--state-dir", str(tmp_path)]) == 1
    assert main(["down", "--state-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"no fleet recorded in {tmp_path}" in out


# ---- command lines: local mode's, and the one builder it shares with the pods ---------------------
PORTS = local.Ports(http=8000, admin=1001, rpc=1002, coord_front_publish=1003, coord_back_output=1004,
                    coord_back_publish=1005, health=(1010, 1011))


def test_command_lines() -> None:
    py = "/venv/bin/python"
    assert local.coordinator_argv(py, 2, PORTS, moe=False) == [
        py, "-m", "corefleet_client.coordinator", "--engine-count", "2", "--host", "127.0.0.1",
        "--front-publish-port", "1003", "--back-output-port", "1004", "--back-publish-port", "1005",
        "--no-wave-coordination"]
    assert "--no-wave-coordination" not in local.coordinator_argv(py, 2, PORTS, moe=True)
    assert local.frontend_argv(py, "/m", 2, PORTS, Path("/s/admin-token"), ["--enforce-eager"]) == [
        py, "-m", "corefleet_client.frontend", "--admin-host", "127.0.0.1", "--admin-port", "1001",
        "--admin-token-file", "/s/admin-token", "--coordinator-address", "127.0.0.1",
        "--coordinator-front-publish-port", "1003", "--coordinator-back-output-port", "1004",
        "--coordinator-back-publish-port", "1005", "--",
        "/m", "--host", "127.0.0.1", "--port", "8000", "--data-parallel-size", "2", "--data-parallel-size-local", "0",
        "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", "1002", "--enforce-eager"]
    assert local.engine_argv(py, "vllm", "/m", 2, 1, PORTS, ["--enforce-eager"]) == [
        py, "-m", "corefleet_client.engine", "--health-host", "127.0.0.1", "--health-port", "1011", "--",
        "/m", "--headless", "--data-parallel-size", "2", "--data-parallel-size-local", "1",
        "--data-parallel-start-rank", "1", "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port",
        "1002", "--enforce-eager"]
    emulator = local.engine_argv(py, "emulator", "/m", 2, 0, PORTS, [], token_delay_ms=7)
    assert emulator[:9] == [py, "-m", "corefleet_harness.emulator", "--health-host", "127.0.0.1",
                            "--health-port", "1010", "--token-delay-ms", "7"]
    assert emulator[9:] == local.engine_argv(py, "vllm", "/m", 2, 0, PORTS, [])[7:]


@pytest.mark.parametrize("moe", [False, True])
def test_pods_and_local_mode_build_their_command_lines_with_commands(moe: bool) -> None:
    """One source for the fleet's command lines: the operator's pods and local mode both run
    `python -m MODULE *commands.<role>_args(...)`, each with its own addresses and ports."""
    fleet = make_ecs("a").replicas(2).tp(2).expert_parallel(moe).arg("--max-model-len", "256").obj()
    spec = fleet.spec
    tp = ["--tensor-parallel-size", "2"]
    ep = ["--enable-expert-parallel", "--enable-elastic-ep", "--enable-eplb", "--elastic-ep-max-dp-size", "2"]
    ep = ep if moe else []
    user = ["--max-model-len", "256"]
    coord = builders.coordinator_pod(fleet, dp_size=2)["spec"]["containers"][0]
    front = builders.frontend_pod(fleet, dp_size=2, coordinator_address="c")["spec"]["containers"][0]
    engine = builders.engine_pod(fleet, 1, dp_size=2, frontend_address="f")["spec"]["containers"][0]
    rank0 = builders.engine_pod(fleet, 0, dp_size=2, frontend_address="f")["spec"]["containers"][0]
    engine0 = constants.pod_dns("a", constants.engine_name("a", 0), "ns") if moe else None
    store = constants.COORD_STORE_PORT if moe else None  # elastic EP: engine 0 serves the startup's store
    admin = None if moe else constants.FRONTEND_ADMIN_PORT  # a dense rank's drain ends early once it is closed

    # The pods: `python` from the image, listeners on 0.0.0.0 (no --health-host/--admin-host), fixed ports.
    assert coord["command"] == ["python", "-m", commands.COORDINATOR_MODULE]
    assert coord["args"] == commands.coordinator_args(
        engine_count=2, host="0.0.0.0", front_publish_port=constants.COORDINATOR_FRONT_PUBLISH_PORT,
        back_output_port=constants.COORDINATOR_BACK_OUTPUT_PORT,
        back_publish_port=constants.COORDINATOR_BACK_PUBLISH_PORT, wave_coordination=moe)
    assert front["command"] == ["python", "-m", commands.FRONTEND_MODULE]
    assert front["args"] == commands.frontend_args(
        model=spec.model, dp_size=2, host="0.0.0.0", port=spec.frontend.port, dp_address="$(POD_IP)",
        rpc_port=constants.DP_RPC_PORT, admin_port=constants.FRONTEND_ADMIN_PORT,
        admin_token_file=f"{constants.ADMIN_TOKEN_DIR}/{constants.ADMIN_TOKEN_KEY}", coordinator_address="c",
        coordinator_front_publish_port=constants.COORDINATOR_FRONT_PUBLISH_PORT,
        coordinator_back_output_port=constants.COORDINATOR_BACK_OUTPUT_PORT,
        coordinator_back_publish_port=constants.COORDINATOR_BACK_PUBLISH_PORT, engine0_address=engine0,
        coord_store_port=store,
        engine_ports=(constants.FRONTEND_ENGINE_INPUT_PORT, constants.FRONTEND_ENGINE_OUTPUT_PORT),
        advertise_address=constants.pod_dns("a", constants.frontend_name("a"), "ns"),
        policy=["--routing", "prefix-affinity", "--routing-prefix-tokens", "256", "--routing-balance", "1.25",
                "--hold-requests", "256", "--hold-timeout", "30"],
        vllm_flags=[*tp, *ep, *user])
    assert engine["command"] == ["python", "-m", commands.ENGINE_MODULE]
    assert engine["args"] == commands.engine_args(
        model=spec.model, dp_size=2, rank=1, dp_address="f", rpc_port=constants.DP_RPC_PORT,
        health_port=constants.ENGINE_HEALTH_PORT, frontend_admin_port=admin,
        vllm_flags=[*tp, "--load-format", "auto", *ep, *user])
    assert rank0["args"] == commands.engine_args(
        model=spec.model, dp_size=2, rank=0, dp_address="f", rpc_port=constants.DP_RPC_PORT,
        health_port=constants.ENGINE_HEALTH_PORT, coord_store_port=store, frontend_admin_port=admin,
        vllm_flags=[*tp, "--load-format", "auto", *ep, *user])

    # Local mode: this interpreter, every listener on 127.0.0.1, free ports.
    py = "/venv/bin/python"
    assert local.coordinator_argv(py, 2, PORTS, moe=moe) == [
        py, "-m", commands.COORDINATOR_MODULE, *commands.coordinator_args(
            engine_count=2, host="127.0.0.1", front_publish_port=1003, back_output_port=1004, back_publish_port=1005,
            wave_coordination=moe)]
    assert local.frontend_argv(py, "/m", 2, PORTS, Path("/t"), ["--enforce-eager"], moe=moe) == [
        py, "-m", commands.FRONTEND_MODULE, *commands.frontend_args(
            model="/m", dp_size=2, host="127.0.0.1", port=8000, dp_address="127.0.0.1", rpc_port=1002,
            admin_host="127.0.0.1", admin_port=1001, admin_token_file="/t", coordinator_address="127.0.0.1",
            coordinator_front_publish_port=1003, coordinator_back_output_port=1004, coordinator_back_publish_port=1005,
            engine0_address="127.0.0.1" if moe else None, vllm_flags=["--enforce-eager"])]
    for kind, module, delay in (("vllm", commands.ENGINE_MODULE, None), ("emulator", EMULATOR_MODULE, 7)):
        assert local.engine_argv(py, kind, "/m", 2, 1, PORTS, ["--enforce-eager"], token_delay_ms=7) == [
            py, "-m", module, *commands.engine_args(
                model="/m", dp_size=2, rank=1, dp_address="127.0.0.1", rpc_port=1002, health_host="127.0.0.1",
                health_port=1011, token_delay_ms=delay, vllm_flags=["--enforce-eager"])]


def test_both_callers_go_through_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not merely equal output: the pod builders and local mode call the same functions."""
    calls: list[tuple[str, str | None]] = []

    def spy(name: str, host_key: str) -> Callable[..., list[str]]:
        def fake(**kwargs: Any) -> list[str]:
            calls.append((name, kwargs.get(host_key)))
            return [f"<{name}>"]
        return fake

    monkeypatch.setattr(commands, "coordinator_args", spy("coordinator", "host"))
    monkeypatch.setattr(commands, "frontend_args", spy("frontend", "admin_host"))
    monkeypatch.setattr(commands, "engine_args", spy("engine", "health_host"))
    fleet = make_ecs("a").obj()
    pods = [builders.coordinator_pod(fleet, dp_size=1),
            builders.frontend_pod(fleet, dp_size=1, coordinator_address="c"),
            builders.engine_pod(fleet, 0, dp_size=1, frontend_address="f")]
    assert [p["spec"]["containers"][0]["args"] for p in pods] == [["<coordinator>"], ["<frontend>"], ["<engine>"]]
    assert calls == [("coordinator", "0.0.0.0"), ("frontend", None), ("engine", None)]
    calls.clear()
    assert local.coordinator_argv("py", 2, PORTS, moe=False)[3:] == ["<coordinator>"]
    assert local.frontend_argv("py", "/m", 2, PORTS, Path("/t"), [])[3:] == ["<frontend>"]
    assert local.engine_argv("py", "vllm", "/m", 2, 0, PORTS, [])[3:] == ["<engine>"]
    assert calls == [("coordinator", "127.0.0.1"), ("frontend", "127.0.0.1"), ("engine", "127.0.0.1")]


def test_moe_is_read_from_the_model_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_local_experts": 4}))
    assert local.is_moe_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert not local.is_moe_model(str(tmp_path))
    assert not local.is_moe_model("org/some-hub-model")


# ---- the state file, /proc, down and status with stand-in processes -------------------------------
@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts; whatever it leaves running (children included) is killed and reaped after it."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        with contextlib.suppress(ProcessLookupError):  # each leads its own group: its children go too
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _spawn(spawned: list[subprocess.Popen[bytes]], argv: list[str], role: str, rank: int | None) -> local.ProcessRecord:
    p = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL)
    spawned.append(p)
    st = local.proc_stat(p.pid)
    assert st is not None
    wait_until(lambda: local.proc_cmdline(p.pid) == argv, 10, f"{argv} to exec", interval=0.05)
    return local.ProcessRecord(role=role, rank=rank, pid=p.pid, start_time=st.start_time, argv=tuple(argv),
                               log="/dev/null")


def _record(state_dir: Path, procs: list[local.ProcessRecord], admin_url: str = "http://127.0.0.1:9",
            token_file: Path | None = None) -> local.FleetRecord:
    if token_file is None:
        token_file = state_dir / "admin-token"
        token_file.write_text("secret\n")
    rec = local.FleetRecord(
        state_dir=str(state_dir), engine="emulator", model="/m", served_model_name="tiny", replicas=2,
        endpoint="http://127.0.0.1:8000/v1", admin_url=admin_url, token_file=str(token_file),
        ports=PORTS, boot_id=local.boot_id(), processes=tuple(procs), started_at=1.0)
    local.save_record(rec)
    return rec


def test_state_file_round_trips(tmp_path: Path) -> None:
    proc = local.ProcessRecord(role="engine", rank=1, pid=123, start_time=456, argv=("a", "b"), log="/l")
    rec = _record(tmp_path, [proc])

    assert local.load_record(tmp_path) == rec
    data = json.loads((tmp_path / "fleet.json").read_text())
    assert data["processes"][0] == {"role": "engine", "rank": 1, "pid": 123, "start_time": 456,
                                    "argv": ["a", "b"], "log": "/l", "retiring": False}
    del data["processes"][0]["retiring"], data["vllm_flags"]  # a state file written before `corefleet scale`
    (tmp_path / "fleet.json").write_text(json.dumps(data))
    assert local.load_record(tmp_path) == rec
    assert local.load_record(tmp_path / "nothing") is None
    (tmp_path / "fleet.json").write_text("{}")
    with pytest.raises(local.LocalFleetError, match="not a corefleet state file"):
        local.load_record(tmp_path)


def test_spawn_gives_each_process_its_own_group_in_the_callers_session(
        tmp_path: Path, spawned: list[subprocess.Popen[bytes]]) -> None:
    """Its own process group keeps a terminal's Ctrl-C away from the fleet; the caller's session keeps
    the fleet in one scheduling autogroup (a session each halved the frontend's CPU share, issue 10)."""
    (tmp_path / local.LOG_DIR).mkdir()
    rec = _record(tmp_path, [])
    rec, p = local.spawn(rec, "engine", 0, ["sleep", "1000"], {})
    spawned.append(p)
    st = local.proc_stat(p.pid)
    assert st is not None
    assert st.pgrp == p.pid != os.getpgrp()
    assert st.session == os.getsid(0)
    assert [(q.role, q.rank, q.pid) for q in rec.processes] == [("engine", 0, p.pid)]
    assert local.load_record(tmp_path) == rec


def test_down_stops_exactly_the_recorded_processes(tmp_path: Path, spawned: list[subprocess.Popen[bytes]]) -> None:
    ours = [_spawn(spawned, ["sleep", "1001"], "coordinator", None),
            _spawn(spawned, ["sleep", "1002"], "engine", 0)]
    bystander = _spawn(spawned, ["sleep", "1003"], "engine", 1)
    _record(tmp_path, ours)
    out = io.StringIO()

    assert local.down(tmp_path, out=out) == 0

    assert all(not local.is_running(local.proc_stat(p.pid)) for p in ours)
    assert local.is_running(local.proc_stat(bystander.pid))
    assert not (tmp_path / "fleet.json").exists()
    assert "stopped 2 of 2 processes" in out.getvalue()


def test_down_never_signals_a_recycled_pid(tmp_path: Path, spawned: list[subprocess.Popen[bytes]]) -> None:
    """A recorded pid now held by another process (other start time, other command line) is left alone."""
    other = _spawn(spawned, ["sleep", "1004"], "engine", 0)
    # As if pid `other.pid` had been an engine of the fleet once, and the pid was then reused.
    stale = dataclasses.replace(other, start_time=other.start_time - 1,
                                argv=("python", "-m", "corefleet_client.engine"))
    same_start_other_cmdline = dataclasses.replace(other, argv=("python", "-m", "corefleet_client.frontend"))
    for recorded in (stale, same_start_other_cmdline):
        _record(tmp_path, [recorded])
        out = io.StringIO()

        assert local.down(tmp_path, out=out) == 0

        assert local.is_running(local.proc_stat(other.pid))
        assert "belongs to another process; left alone" in out.getvalue()
        assert "stopped 0 of 1" in out.getvalue()


def test_down_stops_what_is_left_of_a_group_whose_leader_died(
        tmp_path: Path, spawned: list[subprocess.Popen[bytes]]) -> None:
    """vLLM's EngineCore children outlive a killed launcher: they are stopped through the process group."""
    pid_file = tmp_path / "child.pid"
    leader = _spawn(spawned, ["sh", "-c", f"sleep 1005 & echo $! > {pid_file}; wait"], "engine", 0)
    wait_until(lambda: pid_file.exists() and pid_file.read_text().strip().isdigit(), 10, "the child's pid",
               interval=0.05)
    child = int(pid_file.read_text())
    os.kill(leader.pid, signal.SIGKILL)
    spawned[-1].wait()
    _record(tmp_path, [leader])

    assert local.is_running(local.proc_stat(child))
    assert local.down(tmp_path, out=io.StringIO()) == 0
    assert not local.is_running(local.proc_stat(child))


def test_down_kills_what_ignores_sigterm(tmp_path: Path, spawned: list[subprocess.Popen[bytes]]) -> None:
    stubborn = _spawn(spawned, ["sh", "-c", "trap '' TERM; sleep 1006 & wait; sleep 1006"], "frontend", None)
    rec = _record(tmp_path, [stubborn])
    out = io.StringIO()

    stopped = local.stop_fleet(rec, grace=0.5, out=out)

    assert stopped == [stubborn]
    assert not local.is_running(local.proc_stat(stubborn.pid))
    assert "still running after 0 s, killing: frontend" in out.getvalue()  # after its grace, not the default 20 s


def test_stop_waits_for_a_group_whose_leader_changes_while_it_stops(
        tmp_path: Path, spawned: list[subprocess.Popen[bytes]]) -> None:
    """An exiting leader shows an empty command line while its group still runs; ownership is decided
    once, before the first signal, so the stop still waits for the whole group."""
    leader = _spawn(spawned, ["sh", "-c", "trap 'exec sleep 1' TERM; sleep 1007 & wait"], "engine", 0)
    rec = _record(tmp_path, [leader])

    assert local.stop_fleet(rec, grace=10, out=io.StringIO()) == [leader]

    assert not local.is_running(local.proc_stat(leader.pid))  # `sleep 1` (the changed leader) was waited for


class _FakeAdmin(BaseHTTPRequestHandler):
    token = "secret"
    fleet = FleetStatus(
        state=FleetState.SERVING, model="tiny", data_parallel_size=2, vllm_version="0.32.0",
        ranks=(RankStatus(rank=0, identity="0000", state=RankState.SERVING, waiting=1, running=2, in_flight=3,
                          requests_total=40),
               RankStatus(rank=1, identity="0100", state=RankState.SERVING, requests_total=41)),
    )

    def do_GET(self) -> None:
        if self.path != FLEET_PATH or not authorized(self.headers.get("Authorization"), self.token):
            self.send_response(401)
            self.end_headers()
            return
        body = json.dumps(self.fleet.to_json()).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def admin_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeAdmin)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_status_reports_processes_and_ranks(tmp_path: Path, spawned: list[subprocess.Popen[bytes]],
                                            admin_server: str, capsys: pytest.CaptureFixture[str]) -> None:
    procs = [_spawn(spawned, ["sleep", "1007"], "coordinator", None),
             _spawn(spawned, ["sh", "-c", "sleep 1008 & wait"], "frontend", None),
             _spawn(spawned, ["sleep", "1009"], "engine", 0),
             _spawn(spawned, ["sleep", "1010"], "engine", 1)]
    _record(tmp_path, procs, admin_url=admin_server)

    assert main(["status", "--state-dir", str(tmp_path)]) == 0

    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "OpenAI endpoint: http://127.0.0.1:8000/v1" in lines
    rows = [ln.split() for ln in lines[lines.index(next(ln for ln in lines if ln.startswith("PROCESS"))) + 1:][:4]]
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        ("coordinator", "-", str(procs[0].pid), "yes"), ("frontend", "-", str(procs[1].pid), "yes"),
        ("engine", "0", str(procs[2].pid), "yes"), ("engine", "1", str(procs[3].pid), "yes")]
    assert all(float(r[4]) >= 0 for r in rows)
    assert "fleet: Serving  data-parallel size 2  vLLM 0.32.0" in out
    ranks = [ln.split() for ln in lines[lines.index(next(ln for ln in lines if ln.strip().startswith("RANK"))) + 1:]]
    assert ranks == [["0", "Serving", "1", "2", "3", "40"], ["1", "Serving", "0", "0", "0", "41"]]

    os.kill(procs[3].pid, signal.SIGKILL)
    spawned[3].wait()
    assert main(["status", "--state-dir", str(tmp_path)]) == 1
    rows = [ln.split()[:4] for ln in capsys.readouterr().out.splitlines()]
    assert ["engine", "1", str(procs[3].pid), "no"] in rows


def test_status_without_an_admin_api(tmp_path: Path, spawned: list[subprocess.Popen[bytes]],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    _record(tmp_path, [_spawn(spawned, ["sleep", "1011"], "coordinator", None)],
            admin_url=f"http://127.0.0.1:{free_ports(1)[0]}")

    assert main(["status", "--state-dir", str(tmp_path)]) == 1
    assert "fleet: unknown (admin API:" in capsys.readouterr().out


def test_rss_includes_child_processes(spawned: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    # A parent whose child holds ~64 MiB: the tree's RSS counts it.
    child = f"import time; b = bytearray(64 << 20); open({str(tmp_path / 'ready')!r}, 'w').close(); time.sleep(1000)"
    parent = _spawn(spawned, [sys.executable, "-c",
                              f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"],
                    "engine", 0)
    wait_until(lambda: (tmp_path / "ready").exists(), 20, "the child to allocate", interval=0.05)

    own = local.proc_stat(parent.pid)
    assert own is not None
    assert local.tree_rss_bytes(parent.pid, local.all_procs()) > own.rss_bytes + (60 << 20)


# ---- up: the whole supervision with a fake interpreter --------------------------------------------
FAKE_PYTHON = '''\
#!{python}
"""Plays `python -m corefleet_client.{{coordinator,frontend,engine,emulator}}` for local mode's tests."""
import json, os, signal, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from corefleet_client.admin import FleetState, FleetStatus, RankState, RankStatus, authorized
from corefleet_harness.emulator import EMULATOR_MODULE

assert sys.argv[1] == "-m", sys.argv
module, args = sys.argv[2].rsplit(".", 1)[1], sys.argv[3:]
def opt(name):
    return args[args.index(name) + 1]
def serve(port, routes):
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            status, body = routes(self)
            self.send_response(status); self.end_headers(); self.wfile.write(json.dumps(body).encode())
        def log_message(self, *a): pass
    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
print(module, "starting", flush=True)
if module == "coordinator":
    signal.pause()
elif module == "frontend":
    import threading
    token = open(opt("--admin-token-file")).read().strip()
    n = int(opt("--data-parallel-size"))
    def fleet():
        # Like vLLM: a rank serves once its engine is up; HTTP answers once all are.
        ready = [os.path.exists(os.path.join(os.environ["FAKE_READY_DIR"], f"rank-{{r}}")) for r in range(n)]
        return FleetStatus(state=FleetState.SERVING if all(ready) else FleetState.STARTING,
                           model=args[args.index("--") + 1], data_parallel_size=n, vllm_version="fake",
                           ranks=tuple(RankStatus(r, f"{{r:02x}}00", RankState.SERVING if ok else RankState.JOINING)
                                       for r, ok in enumerate(ready)))
    def admin(h):
        if not authorized(h.headers.get("Authorization"), token):
            return 401, {{}}
        return 200, fleet().to_json()
    threading.Thread(target=serve, args=(int(opt("--admin-port")), admin), daemon=True).start()
    serve(int(opt("--port")), lambda h: (200 if fleet().state == FleetState.SERVING else 503, {{}}))
else:
    rank = int(opt("--data-parallel-start-rank"))
    if os.environ.get("FAKE_ENGINE_EXIT_RANK") == str(rank):
        print("engine failed: out of fake memory", flush=True)
        sys.exit(3)
    if os.environ.get("FAKE_ENGINE_SLOW_RANK") == str(rank):
        signal.pause()
    open(os.path.join(os.environ["FAKE_READY_DIR"], f"rank-{{rank}}"), "w").close()
    serve(int(opt("--health-port")), lambda h: (200, {{}}))
'''


@pytest.fixture
def fake_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The fake interpreter; a fleet a failed test leaves in tmp_path/state is stopped after it."""
    (tmp_path / "ready").mkdir()
    monkeypatch.setenv("FAKE_READY_DIR", str(tmp_path / "ready"))
    path = tmp_path / "fake-python"
    path.write_text(FAKE_PYTHON.format(python=sys.executable))
    path.chmod(0o755)
    yield str(path)
    if local.load_record(tmp_path / "state") is not None:
        local.down(tmp_path / "state", out=io.StringIO(), grace=2)


def _options(tmp_path: Path, fake_python: str, **kw: object) -> local.FleetOptions:
    defaults: dict[str, object] = dict(replicas=2, engine="emulator", port=free_ports(1)[0],
                                       state_dir=tmp_path / "state", python=fake_python, ready_timeout=20.0)
    defaults.update(kw)
    return local.FleetOptions(**defaults)  # type: ignore[arg-type]


def test_up_detach_status_down(tmp_path: Path, fake_python: str) -> None:
    opts = _options(tmp_path, fake_python, replicas=3)
    out, err = io.StringIO(), io.StringIO()
    try:
        assert local.up(opts, detach=True, out=out, err=err) == 0, err.getvalue()

        text = out.getvalue()
        assert f"OpenAI endpoint: http://127.0.0.1:{opts.port}/v1" in text
        rec = local.load_record(opts.state_dir)
        assert rec is not None
        assert [p.name for p in rec.processes] == ["coordinator", "frontend", "engine-0", "engine-1", "engine-2",
                                                   "supervisor"]
        assert f"admin API: {rec.admin_url}/v1/fleet" in text
        assert all(local.owns(rec, p) for p in rec.processes)
        assert rec.model == str(opts.state_dir / "models" / "tiny-llama")
        assert (Path(rec.model) / "tokenizer.json").exists()
        assert rec.processes[1].argv[-len(VLLM_CPU_FLAGS) - 2:] == (*VLLM_CPU_FLAGS, "--served-model-name",
                                                                       "tiny-llama")
        assert oct(Path(rec.token_file).stat().st_mode & 0o777) == "0o600"
        assert (opts.state_dir / "logs" / "engine-2.log").read_text().strip() == "emulator starting"
        # A second fleet in the same state dir is refused while this one runs.
        again = io.StringIO()
        assert local.up(dataclasses.replace(opts, port=free_ports(1)[0]), detach=True, out=io.StringIO(),
                        err=again) == 1
        assert "is still running" in again.getvalue()
        status_out = io.StringIO()
        assert local.status(opts.state_dir, out=status_out) == 0, status_out.getvalue()
        assert "fleet: Serving" in status_out.getvalue()
    finally:
        assert local.down(opts.state_dir, out=io.StringIO()) == 0
    assert all(not local.is_running(local.proc_stat(p.pid)) for p in rec.processes)


def test_the_supervisor_of_a_detached_fleet_replaces_its_lost_members_and_down_stops_it_first(
        tmp_path: Path, fake_python: str) -> None:
    """`up --detach` leaves `corefleet supervise` running: a killed frontend comes back with `--attach` at the
    recorded size, a killed coordinator with its command line, under their names and logs; the engines are
    untouched and an engine's exit is only reported; `down` stops the supervisor first, then everything."""
    opts = _options(tmp_path, fake_python, replicas=2)
    state = opts.state_dir
    assert local.up(opts, detach=True, out=io.StringIO(), err=io.StringIO()) == 0
    try:
        rec = local.load_record(state)
        assert rec is not None
        supervisor = next(p for p in rec.processes if p.role == local.ROLE_SUPERVISOR)
        assert supervisor.argv[:5] == (sys.executable, "-m", "corefleet_harness.cli", "supervise", "--state-dir")
        engines = {p.rank: p.pid for p in rec.processes if p.role == local.ROLE_ENGINE}
        for role in (local.ROLE_FRONTEND, local.ROLE_COORDINATOR):
            old = next(p for p in rec.processes if p.role == role)
            os.kill(old.pid, signal.SIGKILL)

            def replaced(role: str = role, old: local.ProcessRecord = old) -> local.ProcessRecord | None:
                latest = local.load_record(state)
                assert latest is not None
                new = [p for p in latest.processes if p.role == role]
                assert len(new) == 1, new
                return new[0] if new[0].pid != old.pid and local.owns(latest, new[0]) else None

            new = wait_until(replaced, 20, f"the {role} replaced", interval=0.1)
            assert new.argv == tuple(local.member_argv(rec, role))
            assert ("--attach" in new.argv) == (role == local.ROLE_FRONTEND)
            assert new.log == old.log
            assert "its replacement follows" in Path(old.log).read_text()
        rec = local.load_record(state)
        assert rec is not None
        wait_until(lambda: http_get(rec.endpoint.removesuffix("/v1") + "/health", 2, unanswered_ok=True)[0] == 200,
                   20, "the replacement frontend serving")
        assert {p.rank: p.pid for p in rec.processes if p.role == local.ROLE_ENGINE} == engines
        # An engine's exit is reported, not acted on: the frontend serves on without the rank.
        os.kill(engines[1], signal.SIGKILL)
        log = tmp_path / "state" / "logs" / "supervisor.log"
        wait_until(lambda: "engine-1 (pid" in log.read_text(), 20, "the supervisor to report the engine")
        assert local.owns(rec, supervisor)
        assert local.load_record(state) == rec  # nothing replaced for it
    finally:
        assert local.down(state, out=io.StringIO()) == 0
    assert all(not local.is_running(local.proc_stat(p.pid)) for p in rec.processes)


def test_up_in_the_foreground_stops_its_processes_on_sigterm(tmp_path: Path, fake_python: str) -> None:
    """`corefleet up` as a command: prints the endpoint, runs until SIGTERM, then nothing it started is left."""
    state = tmp_path / "state"
    port = free_ports(1)[0]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    code = ("import functools, sys; from corefleet_harness import local; from corefleet_harness.cli import main; "
            f"local.FleetOptions = functools.partial(local.FleetOptions, python={fake_python!r}); "
            "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.Popen([sys.executable, "-c", code, "up", "--engine", "emulator", "--state-dir", str(state),
                             "--port", str(port), "--timeout", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = read_lines_until(proc, "running; Ctrl-C", timeout=30)
        assert f"  OpenAI endpoint: http://127.0.0.1:{port}/v1   (model 'tiny-llama')" in lines
        rec = local.load_record(state)
        assert rec is not None
        assert len(rec.processes) == 4

        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:  # kill only as a last resort: SIGTERM is what is under test
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    assert proc.returncode == 0, err
    assert "corefleet up: stopped" in out
    assert all(not local.is_running(local.proc_stat(p.pid)) for p in rec.processes)
    assert not (state / "fleet.json").exists()


def test_up_fails_with_the_log_of_the_process_that_died(
        tmp_path: Path, fake_python: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_ENGINE_EXIT_RANK", "1")
    opts = _options(tmp_path, fake_python)
    err = io.StringIO()

    assert local.up(opts, detach=True, out=io.StringIO(), err=err) == 1

    assert "engine-1 (pid" in err.getvalue()
    assert "exited with 3 before the fleet was ready" in err.getvalue()
    assert "engine failed: out of fake memory" in err.getvalue()
    assert not (opts.state_dir / "fleet.json").exists()  # everything else was stopped


def test_up_names_the_slow_process_at_the_deadline(
        tmp_path: Path, fake_python: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_ENGINE_SLOW_RANK", "0")
    opts = _options(tmp_path, fake_python, ready_timeout=1.0)
    err = io.StringIO()

    assert local.up(opts, detach=True, out=io.StringIO(), err=err) == 1

    assert "not ready within 1 s" in err.getvalue()
    assert "engine-0 (pid" in err.getvalue()
    assert "looks slowest" in err.getvalue()


def test_up_refuses_a_taken_port(tmp_path: Path, fake_python: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        opts = _options(tmp_path, fake_python, port=s.getsockname()[1])
        err = io.StringIO()

        assert local.up(opts, detach=True, out=io.StringIO(), err=err) == 1

    assert f"--port {opts.port} on 127.0.0.1 is taken" in err.getvalue()
    assert not (opts.state_dir / "fleet.json").exists()



def test_up_with_a_model_directory_and_own_vllm_flags(tmp_path: Path, fake_python: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "my-moe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_local_experts": 8}))
    monkeypatch.chdir(tmp_path)
    opts = _options(tmp_path, fake_python, model="my-moe", vllm_flags=("--max-model-len", "128"))
    try:
        assert local.up(opts, detach=True, out=io.StringIO(), err=io.StringIO()) == 0
        rec = local.load_record(opts.state_dir)
        assert rec is not None
        coordinator, frontend, *engines = (p.argv for p in rec.processes if p.role != local.ROLE_SUPERVISOR)
        assert "--no-wave-coordination" not in coordinator  # MoE: vLLM's wave coordination stays on
        for argv in (frontend, *engines):
            assert argv[argv.index("--") + 1] == str(model)  # absolute: the record means the same anywhere
            assert argv[-2:] == ("--max-model-len", "128")
            assert "--load-format" not in argv
        assert rec.served_model_name == str(model)
        assert not (opts.state_dir / "models").exists()
    finally:
        local.down(opts.state_dir, out=io.StringIO())


def test_local_elastic_ep_command_lines_and_gpus() -> None:
    """Elastic EP in local mode: engine 0 serves the coordination stores on loopback, the frontend is told their
    port; with --gpus-per-rank each rank sees its own GPUs."""
    ports = dataclasses.replace(PORTS, coord_store=1020)
    py = "/venv/bin/python"
    front = local.frontend_argv(py, "/m", 2, ports, Path("/t"), ["--enforce-eager"], moe=True)
    assert front[front.index("--coord-store-port") + 1] == "1020"
    assert "--coord-store-port" not in local.frontend_argv(py, "/m", 2, ports, Path("/t"), [], moe=False)
    rank0 = local.engine_argv(py, "vllm", "/m", 2, 0, ports, [])
    assert rank0[rank0.index("--coord-store-port") + 1] == "1020"
    assert "--coord-store-port" not in local.engine_argv(py, "vllm", "/m", 2, 1, ports, [])
    assert local.engine_env("vllm", 1, gpus_per_rank=2)["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert "CUDA_VISIBLE_DEVICES" not in local.engine_env("emulator", 1)


def test_local_cpu_engines_leave_the_last_core_to_the_other_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks go round the usable cores but the reserved last one(s), as vLLM's own binding leaves them; a machine with
    no more cores than reserved shares them all; a binding the user set is passed on unchanged."""
    assert [local.engine_cpu(r, [1, 0]) for r in range(3)] == [0, 0, 0]
    assert [local.engine_cpu(r, [0, 1, 2, 3]) for r in range(4)] == [0, 1, 2, 0]
    assert [local.engine_cpu(r, [0, 1, 2, 3], reserved=2) for r in range(3)] == [0, 1, 0]
    assert [local.engine_cpu(r, [0, 1], reserved=0) for r in range(3)] == [0, 1, 0]
    assert [local.engine_cpu(r, [4]) for r in range(2)] == [4, 4]
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert local.reserved_cpus() == 0
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "two")
    assert local.reserved_cpus() == local.DEFAULT_RESERVED_CPUS
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU")
    cpus = sorted(os.sched_getaffinity(0))
    assert local.engine_env("vllm", 1)["VLLM_CPU_OMP_THREADS_BIND"] == str(local.engine_cpu(1, cpus))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1|2-3")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in local.engine_env("vllm", 1)


def test_local_elastic_ep_needs_a_moe_model(tmp_path: Path) -> None:
    opts = local.FleetOptions(replicas=2, engine="emulator", state_dir=tmp_path, elastic_ep_max=4,
                              port=free_ports(1)[0])
    with pytest.raises(local.LocalFleetError, match="--elastic-ep-max needs a MoE model"):
        local.start(opts)
    assert local.load_record(tmp_path) is None  # nothing started
