# SPDX-License-Identifier: Apache-2.0
"""Local mode's replacement of a lost frontend or coordinator (`corefleet_harness.local.members`): the command
lines it starts, when it refuses, and the fleet's fixed engine ports it relies on. The processes themselves:
tests/e2e/test_frontend.py (real vLLM engines)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from corefleet_harness import local
from corefleet_harness.local.members import MAX_REPLACEMENTS, REPLACEMENT_WINDOW_S, Replacements


def _record(tmp_path: Path, *, moe: bool = False, replicas: int = 3) -> local.FleetRecord:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_local_experts": 4} if moe else {"hidden_size": 64}))
    http = 18123
    ports = local.fleet_ports(http, replicas, elastic_ep=False)
    return local.FleetRecord(
        state_dir=str(tmp_path), engine=local.ENGINE_VLLM, model=str(model), served_model_name="m",
        replicas=replicas, endpoint=f"http://127.0.0.1:{http}/v1", admin_url=f"http://127.0.0.1:{ports.admin}",
        token_file=str(tmp_path / "token"), ports=ports, boot_id="b", vllm_flags=("--enforce-eager",),
        python="/py")


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_a_new_fleet_has_fixed_engine_ports_distinct_from_every_other_port(tmp_path: Path) -> None:
    ports = _record(tmp_path).ports
    assert ports.engine_ports is not None
    others = [ports.http, ports.admin, ports.rpc, ports.coord_front_publish, ports.coord_back_output,
              ports.coord_back_publish, *ports.health]
    every = [*others, *ports.engine_ports]
    assert len(set(every)) == len(every) == 6 + 3 + 2  # http, admin, rpc, 3 coordinator, 3 ranks, 2 engine
    grown = local.with_new_ranks(ports, [3, 4])
    assert not set(grown.health[3:]) & {*others, *ports.engine_ports}


def test_the_first_frontend_binds_the_engine_ports_and_the_replacement_attaches_on_them_at_the_recorded_size(
        tmp_path: Path) -> None:
    rec = _record(tmp_path)
    assert rec.ports.engine_ports is not None
    first = local.frontend_argv("/py", rec.model, 2, rec.ports, Path(rec.token_file), rec.vllm_flags)
    again = local.member_argv(dataclasses.replace(rec, replicas=3), local.ROLE_FRONTEND)
    for argv in (first, again):
        assert (_flag(argv, "--engine-input-port"), _flag(argv, "--engine-output-port")) == tuple(
            str(p) for p in rec.ports.engine_ports)
    assert "--attach" not in first
    assert "--attach" in again
    assert _flag(again, "--data-parallel-size") == "3"
    assert again[0] == "/py"
    assert again[again.index(local.LAUNCHER_ARGS_END) + 1] == rec.model
    assert "--enforce-eager" in again


def test_the_replacement_coordinator_counts_the_recorded_ranks(tmp_path: Path) -> None:
    rec = dataclasses.replace(_record(tmp_path), replicas=4)
    argv = local.member_argv(rec, local.ROLE_COORDINATOR)
    assert argv == local.coordinator_argv("/py", 4, rec.ports, moe=False)
    assert _flag(argv, "--engine-count") == "4"
    with pytest.raises(ValueError, match="not a member role"):
        local.member_argv(rec, local.ROLE_ENGINE)


def test_a_lost_member_is_replaced_until_it_crash_loops_within_the_window(tmp_path: Path) -> None:
    rec = _record(tmp_path)
    reps = Replacements()
    for i in range(MAX_REPLACEMENTS):
        assert reps.refusal(rec, local.ROLE_FRONTEND, now=float(i)) is None
        reps.count(local.ROLE_FRONTEND, now=float(i))
    refusal = reps.refusal(rec, local.ROLE_FRONTEND, now=float(MAX_REPLACEMENTS))
    assert refusal is not None
    assert "crash loop" in refusal
    assert reps.refusal(rec, local.ROLE_COORDINATOR, now=float(MAX_REPLACEMENTS)) is None  # counted per role
    # Once the first replacement is older than the window, one more is allowed.
    assert reps.refusal(rec, local.ROLE_FRONTEND, now=REPLACEMENT_WINDOW_S + 0.5) is None


def test_a_moe_fleets_members_and_an_older_fleets_frontend_are_not_replaced(tmp_path: Path) -> None:
    (tmp_path / "moe").mkdir()
    (tmp_path / "old").mkdir()
    moe = _record(tmp_path / "moe", moe=True)
    for role in local.MEMBER_ROLES:
        refusal = Replacements().refusal(moe, role, now=0.0)
        assert refusal is not None
        assert "MoE" in refusal
    older = _record(tmp_path / "old")
    older = dataclasses.replace(older, ports=dataclasses.replace(older.ports, engine_input=None, engine_output=None))
    refusal = Replacements().refusal(older, local.ROLE_FRONTEND, now=0.0)
    assert refusal is not None
    assert "fixed engine ports" in refusal
    assert Replacements().refusal(older, local.ROLE_COORDINATOR, now=0.0) is None
    with pytest.raises(ValueError, match="not a member role"):
        Replacements().refusal(older, local.ROLE_ENGINE, now=0.0)


def test_a_state_file_written_before_the_engine_ports_reads_as_a_fleet_without_them(tmp_path: Path) -> None:
    rec = _record(tmp_path)
    data = rec.to_json()
    del data["ports"]["engine_input"], data["ports"]["engine_output"]
    (tmp_path / local.STATE_FILE).write_text(json.dumps(data))
    loaded = local.load_record(tmp_path)
    assert loaded is not None
    assert loaded.ports.engine_ports is None
    assert loaded.ports.health == rec.ports.health


def test_several_local_frontends_each_bind_their_own_loopback_address_and_share_the_http_port(
        tmp_path: Path) -> None:
    """`corefleet up --frontends 2`: every frontend at the fleet's same fixed ports on its own 127.0.0.x (as each
    pod on its own IP), its index and every frontend's address on its command line; the OpenAI API on 127.0.0.1,
    shared. A lost frontend 1 comes back as frontend 1, attaching."""
    rec = dataclasses.replace(_record(tmp_path), frontends=2)
    first, second = (local.frontend_argv("/py", rec.model, 3, rec.ports, Path(rec.token_file), rec.vllm_flags,
                                         frontends=2, client_index=i) for i in range(2))
    again = local.member_argv(rec, local.ROLE_FRONTEND, 1)
    for argv, host in ((first, "127.0.0.1"), (second, "127.0.0.2"), (again, "127.0.0.2")):
        assert _flag(argv, "--frontend-addresses") == "127.0.0.1,127.0.0.2"
        assert (_flag(argv, "--advertise-address"), _flag(argv, "--admin-host"),
                _flag(argv, "--data-parallel-address")) == (host, host, host)
        assert (_flag(argv, "--host"), _flag(argv, "--port")) == ("127.0.0.1", str(rec.ports.http))
        assert _flag(argv, "--admin-port") == str(rec.ports.admin)
    assert [_flag(a, "--client-index") for a in (first, second, again)] == ["0", "1", "1"]
    assert "--attach" in again
    assert rec.frontend_admin_url(0) == rec.admin_url
    assert rec.frontend_admin_url(1) == f"http://127.0.0.2:{rec.ports.admin}"
    one = local.frontend_argv("/py", rec.model, 3, rec.ports, Path(rec.token_file), rec.vllm_flags)
    assert "--frontend-addresses" not in one  # one frontend: its command line as before
    assert "--advertise-address" not in one


@pytest.mark.parametrize(("options", "problem"), [
    (local.FleetOptions(frontends=0), "--frontends must be in 1..8, not 0"),
    (local.FleetOptions(frontends=9), "--frontends must be in 1..8, not 9"),
    (local.FleetOptions(frontends=2, moe=True), "--frontends above 1 is for dense models"),
])
def test_the_number_of_local_frontends_is_checked(options: local.FleetOptions, problem: str) -> None:
    with pytest.raises(local.LocalFleetError, match=problem):
        options.validate()


def test_each_frontend_has_its_own_crash_loop_limit(tmp_path: Path) -> None:
    rec = dataclasses.replace(_record(tmp_path), frontends=2)
    replacements = Replacements(limit=2, window_s=60)
    for t in (0.0, 1.0):
        assert replacements.refusal(rec, local.ROLE_FRONTEND, t, "frontend-1") is None
        replacements.count("frontend-1", t)
    assert "the frontend-1 was replaced 2 times" in (replacements.refusal(rec, local.ROLE_FRONTEND, 2.0,
                                                                          "frontend-1") or "")
    assert replacements.refusal(rec, local.ROLE_FRONTEND, 2.0, "frontend") is None  # frontend 0 is not in a loop
