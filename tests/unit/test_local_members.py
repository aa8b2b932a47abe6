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
