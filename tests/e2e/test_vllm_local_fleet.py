# SPDX-License-Identifier: Apache-2.0
"""README's main job with real vLLM: one local fleet of 2 real vLLM engines for the whole module.

The fleet is local mode's (`corefleet_harness.local.start`, what `corefleet up` runs: a standalone
coordinator, the frontend and one engine launcher per rank on 127.0.0.1), serving the tiny dense model
(dummy weights, its context raised to 8192 so that a long request stays in flight for seconds), with the
frontend's liveness timeout at 8 s. Every test leaves it serving at 2 ranks; one that finds it otherwise
(a test that failed half-way, or `corefleet down` run before it) gets a fresh fleet, so each test also
runs alone.

* text and chat completions through the OpenAI endpoint, spread over every rank;
* each engine launcher is the parent of its engine core and maps no vLLM or torch code of its own;
* the admin API refuses requests without its token; vLLM's unauthenticated elastic-EP routes are not served;
* a cancelled stream is aborted on the rank that had it;
* an engine stopped (SIGSTOP) past the liveness timeout is Unresponsive while the other rank serves on and
  /health stays 200, and serves again once continued;
* a killed engine core (its executor worker wedged): its launcher reports /livez 503 and exits 128+9, the
  frontend reports the rank Dead within seconds and ends its streams with an explicit error; a replacement
  asked for before a new engine runs fails at its join timeout; a new engine for the rank is taken in
  place, the other rank serving a pinned client throughout, /health 200 all along;
* `corefleet scale` resizes it 2 -> 3 -> 2 in place under load (survivors keep their processes), `corefleet
  status` shows every process and rank, and `corefleet down` stops everything (children too), the launchers
  exiting 0.

Heavy (real vLLM, up to 3 engines, ~8 GiB): on shared machines run the e2e tier under
`flock /tmp/corefleet-heavy.lock`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from corefleet_client.admin import AdminClient, AdminError, FleetState, RankState, ResizePhase, ResizeRequest
from corefleet_harness import local
from corefleet_harness.support import free_port, http_get, wait_until
from corefleet_harness.tinymodel import write_tiny_model
from fleettest import Load, PinnedStream
from localfleet import MODEL_NAME, Fleet, HealthWatch, PinnedLoad, flags, start

pytestmark = pytest.mark.e2e

CONTEXT = 8192  # a long request stays in flight for 20+ s even on a fast CPU (AMX: ~3 ms a token)
REPLICAS = 2
VICTIM = 1
DOOMED = 3  # requests on the victim when it dies: its stale load outweighs a local routing increment on rank 0
JOIN_TIMEOUT = 420.0  # a new real vLLM engine starting and handshaking on 2 busy cores
CLI = [sys.executable, "-m", "corefleet_harness.cli"]


class Held:
    """The module's fleet: started on first use, and started afresh for a test that finds it not serving
    at `REPLICAS` ranks."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.starts = tmp, 0
        self._gen: Iterator[Fleet] | None = None
        self._fleet: Fleet | None = None

    def get(self) -> Fleet:
        if self._fleet is not None and not self._whole(self._fleet):
            self.close()
        if self._fleet is None:
            self.starts += 1
            tmp = self.tmp / f"fleet-{self.starts}"
            model = str(write_tiny_model(tmp / "tiny-long", context=CONTEXT))
            self._gen = start(tmp, local.ENGINE_VLLM, REPLICAS, model, flags(CONTEXT), max_tokens_long=CONTEXT - 64,
                              token_delay_ms=None, ready_timeout=600, liveness_timeout=8)
            self._fleet = next(self._gen)
        return self._fleet

    @staticmethod
    def _whole(fleet: Fleet) -> bool:
        try:
            status = fleet.status()
        except (OSError, AdminError, ValueError):
            return False
        return (status.state == FleetState.SERVING and status.data_parallel_size == REPLICAS
                and all(r.state == RankState.SERVING for r in status.ranks) and fleet.health() == 200)

    def close(self) -> None:
        if self._gen is not None:
            self._gen.close()  # the generator's `finally` stops the fleet
        self._gen = self._fleet = None


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Held]:
    h = Held(tmp_path_factory.mktemp("vllm-fleet"))
    yield h
    h.close()


@pytest.fixture
def fleet(held: Held) -> Fleet:
    return held.get()


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        data: dict[str, Any] = json.loads(r.read())
        return data


def corefleet(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def engine_core(fleet: Fleet, rank: int) -> psutil.Process:
    """The rank's engine core (it names itself VLLM::EngineCore_DP<rank>), as its launcher logs it once the
    engine core reported its rank."""
    log = (Path(fleet.rec.state_dir) / local.LOG_DIR / f"engine-{rank}.log").read_text(errors="replace")
    pids = re.findall(r"Engine core EngineCore_DP\d+ \(pid (\d+)\) is rank", log)
    assert pids, log[-3000:]
    return psutil.Process(int(pids[-1]))


def gone_or_zombie(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class LivezWatcher(threading.Thread):
    """Polls a launcher's /livez until nothing answers, keeping every answer: the launcher's last words."""

    def __init__(self, port: int, timeout: float = 60.0) -> None:
        super().__init__(daemon=True)
        self.url, self.timeout = f"http://{local.LOCALHOST}:{port}/livez", timeout
        self.seen: list[tuple[int, Any]] = []

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout
        stop = threading.Event()
        while time.monotonic() < deadline:
            try:
                status, body = http_get(self.url, 2)
                self.seen.append((status, json.loads(body) if body else None))
            except OSError:
                if self.seen:
                    return
            stop.wait(0.01)


def test_text_and_chat_completions_are_served_and_spread_over_every_rank(fleet: Fleet) -> None:
    endpoint = f"{fleet.url}/v1"
    assert fleet.rec.endpoint == endpoint
    assert [p.name for p in fleet.rec.processes] == ["coordinator", "frontend", "engine-0", "engine-1"]
    assert all(local.ENGINE_MODULES[local.ENGINE_VLLM] in p.argv for p in fleet.rec.processes[2:])
    before = {r.rank: r.requests_total for r in fleet.status().ranks}
    n = 4 * REPLICAS
    for i in range(n):
        out = post(f"{endpoint}/completions", {"model": MODEL_NAME, "prompt": f"Hello number {i}", "max_tokens": 4})
        assert out["usage"]["completion_tokens"] >= 1, out
        assert out["choices"][0]["finish_reason"] in ("length", "stop"), out
        assert isinstance(out["choices"][0]["text"], str)
    chat = post(f"{endpoint}/chat/completions",
                {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat["choices"][0]["message"]["role"] == "assistant", chat
    status = fleet.status()
    assert status.state == FleetState.SERVING
    served = {r.rank: r.requests_total - before[r.rank] for r in status.ranks}
    assert sum(served.values()) == n + 1, served
    assert all(count >= 1 for count in served.values()), f"a rank served nothing: {served}"
    assert all(r.state == RankState.SERVING and r.in_flight == 0 for r in status.ranks), status


def test_each_launcher_parents_its_engine_core_and_maps_no_vllm_or_torch(fleet: Fleet) -> None:
    for rank in range(REPLICAS):
        launcher = fleet.engine_pid(rank)
        core = engine_core(fleet, rank)
        assert core.ppid() == launcher
        assert "libtorch" in Path(f"/proc/{core.pid}/maps").read_text()
        launcher_maps = Path(f"/proc/{launcher}/maps").read_text()
        assert "libtorch" not in launcher_maps
        assert "/vllm/" not in launcher_maps


def test_admin_api_needs_the_token(fleet: Fleet) -> None:
    status = fleet.status()  # with the token
    assert status.data_parallel_size == REPLICAS
    assert [r.identity for r in status.ranks] == [r.to_bytes(2, "little").hex() for r in range(REPLICAS)]
    for client in (AdminClient(fleet.rec.admin_url, token="wrong"), AdminClient(fleet.rec.admin_url, token="")):
        with pytest.raises(AdminError) as err:
            client.fleet()
        assert err.value.status == 401
    assert http_get(fleet.rec.admin_url + "/v1/fleet")[0] == 401


def test_the_public_port_does_not_serve_elastic_ep_routes(fleet: Fleet) -> None:
    """vLLM mounts these without authentication; a fleet's size is the operator's (issue #9, defect 8)."""
    for path, body in (("/scale_elastic_ep", {"new_data_parallel_size": 1}), ("/is_scaling_elastic_ep", {})):
        req = urllib.request.Request(f"{fleet.url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=10)
        assert refused.value.code == 404, (path, refused.value.read())
    assert fleet.status().data_parallel_size == REPLICAS


def test_cancelled_stream_is_aborted_on_its_rank(fleet: Fleet) -> None:
    """The stream is read throughout (vLLM's engine does not wait for the client: a request could finish
    before the client went away, and a finished request has nothing to abort; issue #9, defect 11), and the
    test checks that the request was still running when the client left."""
    before = {r.rank: r.aborts_total for r in fleet.status().ranks}
    stream = fleet.stream(fleet.max_tokens_long)
    try:
        first = stream.next_event()
        assert first is not None
        latest = stream.drain_in_background()
        rank = fleet.in_flight_rank()
        still_running = fleet.status().rank(rank).in_flight == 1
        last = latest() or first
    finally:
        stream.close()  # the client goes away: vLLM's server aborts the request
    assert still_running, f"rank {rank} had finished the request before it could be cancelled"
    assert last["choices"][0]["finish_reason"] is None, f"the request finished before it was cancelled: {last}"
    wait_until(lambda: fleet.status().rank(rank).aborts_total == before[rank] + 1, 15,
               f"an abort routed to rank {rank}", interval=0.05,
               diagnose=lambda: f"aborts before: {before}; now: {fleet.status().ranks}")
    status = wait_until(lambda: (s := fleet.status()).rank(rank).in_flight == 0 and s, 15,
                        f"rank {rank} to finish the aborted request", interval=0.05)
    others = {r.rank: r.aborts_total - before[r.rank] for r in status.ranks if r.rank != rank}
    assert not any(others.values()), f"aborts went to other ranks: {others}"


def test_a_stopped_engine_is_unresponsive_and_serves_again_once_continued(fleet: Fleet) -> None:
    """SIGSTOP one engine past the liveness timeout while a client loads another rank, then SIGCONT (issue #9)."""
    slow, other = REPLICAS - 1, 0
    frontend = fleet.frontend_pid()
    # A request in flight on the slow rank when it stops: it waits for the rank, it does not fail.
    held_stream = fleet.stream(max(fleet.max_tokens_long // 4, 200), rank=slow)
    try:
        assert held_stream.next_event() is not None
        os.killpg(fleet.engine_pid(slow), signal.SIGSTOP)  # the launcher and its EngineCore process
        try:
            with PinnedLoad(fleet, other) as load:
                status = wait_until(lambda: (s := fleet.status()).rank(slow).state != RankState.SERVING and s,
                                    fleet.liveness_timeout + 30, f"rank {slow} to leave Serving", interval=0.05)
                assert status.rank(slow).state == RankState.UNRESPONSIVE, status.rank(slow)
                assert status.rank(slow).since is not None
                assert status.rank(slow).in_flight == 1
                assert status.state == FleetState.DEGRADED
                assert f"rank {slow} Unresponsive" in status.message
                assert status.rank(other).state == RankState.SERVING
                assert fleet.health() == 200
                # A request pinned to it is refused at once, naming the rank and its state.
                code, body = fleet.complete("pinned to the stopped rank", rank=slow)
                assert code == 503, body
                assert f"rank {slow} is Unresponsive" in json.dumps(body), body
                # The other rank serves on while it stays stopped.
                served = load.ok
                wait_until(lambda: load.ok >= served + 5, 60, f"rank {other} to serve more requests", interval=0.05)
        finally:
            os.killpg(fleet.engine_pid(slow), signal.SIGCONT)
        assert load.ok > 0
        assert load.failures == []
        assert set(load.health) == {200}
        wait_until(lambda: fleet.status().rank(slow).state == RankState.SERVING, 30, f"rank {slow} Serving again",
                   interval=0.05)
        # The held request finishes normally; the frontend survived the late answers.
        events = held_stream.rest()
        assert not [e for e in events if "error" in e], events[-3:]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        held_stream.close()
    os.kill(frontend, 0)  # still running
    assert fleet.health() == 200
    assert fleet.status().state == FleetState.SERVING
    # Back in the routing: an unpinned burst of one stream per rank puts one on each, the returned rank too.
    burst = [fleet.stream(fleet.max_tokens_long) for _ in range(REPLICAS)]
    try:
        for s in burst:
            assert s.next_event() is not None
        status = fleet.status()
        assert [r.in_flight for r in status.ranks] == [1] * REPLICAS, status
    finally:
        for s in burst:
            s.close()
    wait_until(lambda: all(r.in_flight == 0 for r in fleet.status().ranks), 30, "the burst's streams to end",
               interval=0.05)
    code, body = fleet.complete("after the stop", rank=slow)
    assert code == 200, body


def _kill_engine_core(fleet: Fleet, rank: int) -> Callable[[], None]:
    """Rank's engine core dies, leaving a wedged executor worker behind (SIGSTOP: it cannot notice its
    parent's death and exit by itself). Returns the check of what follows: the launcher says /livez 503
    while it stops the orphan (SIGTERM, 5 s grace, SIGKILL), then exits 128+SIGKILL."""
    launcher = fleet.engine_pid(rank)
    victim = engine_core(fleet, rank)
    assert victim.ppid() == launcher
    workers = victim.children(recursive=True)
    assert workers, "no executor worker under the engine core"
    watcher = LivezWatcher(fleet.rec.ports.health[rank])
    watcher.start()
    wait_until(lambda: bool(watcher.seen), 30, "the /livez watcher's first answer", interval=0.05)
    for worker in workers:
        worker.suspend()
    victim.kill()
    return lambda: _launcher_outlived(fleet, rank, launcher, watcher, [victim, *workers])


def _launcher_outlived(fleet: Fleet, rank: int, launcher: int, watcher: LivezWatcher,
                       procs: list[psutil.Process]) -> None:
    assert fleet.fleet.popens[launcher].wait(60) == 128 + signal.SIGKILL
    watcher.join(timeout=30)
    assert watcher.seen[0] == (200, {"rank": rank, "state": "ready", "exitcode": None})
    assert watcher.seen[-1] == (503, {"rank": rank, "state": "exited", "exitcode": -signal.SIGKILL}), watcher.seen[-5:]
    log = (Path(fleet.rec.state_dir) / local.LOG_DIR / f"engine-{rank}.log").read_text()
    assert f"Engine core EngineCore_DP{rank} exited with code -9 without a stop signal" in log, log[-3000:]
    assert "the engine left behind" in log, log[-3000:]
    wait_until(lambda: all(gone_or_zombie(p) for p in procs), 30,
               f"rank {rank}'s processes {[p.pid for p in procs]} gone", interval=0.1, retry_on=(psutil.Error,))


def _replace(fleet: Fleet, rank: int) -> int:
    """A replacement asked for before a new engine runs fails at its join timeout (the rank stays Dead, the
    other rank serves on); with a new engine for the rank (the same command line), the next one completes."""
    started, _ = fleet.admin.start_resize(ResizeRequest(id="replace-0", replicas=REPLICAS, replace=(rank,),
                                                        join_timeout_s=3))
    assert started
    failed = wait_until(lambda: (o := fleet.admin.resize("replace-0")) is not None and o.phase.terminal and o,
                        60, "the replacement without an engine to fail", interval=0.2)
    assert failed.phase == ResizePhase.FAILED, failed
    assert failed.fleet_intact
    assert "did not join within the join timeout of 3s" in failed.error, failed
    status = fleet.status()
    assert (status.rank(rank).state, status.rank(0).state) == (RankState.DEAD, RankState.SERVING)
    assert f"replacement replace-0 failed: {failed.error}" == status.rank(rank).message

    new_pid = fleet.restart_engine(rank)
    started, op = fleet.admin.start_resize(ResizeRequest(id="replace-1", replicas=REPLICAS, replace=(rank,),
                                                         join_timeout_s=JOIN_TIMEOUT))
    assert started
    assert (op.from_replicas, op.to_replicas, op.replace) == (REPLICAS, REPLICAS, (rank,))
    done = wait_until(lambda: (o := fleet.admin.resize("replace-1")) is not None and o.phase.terminal and o,
                      JOIN_TIMEOUT + 30, "the replacement to end", interval=0.2)
    assert (done.phase, done.error) == (ResizePhase.COMPLETED, ""), done
    status = fleet.status()
    assert status.state == FleetState.SERVING, status
    assert [r.state for r in status.ranks] == [RankState.SERVING] * REPLICAS
    assert status.data_parallel_size == REPLICAS
    # The same id again: the same operation, nothing started.
    again, same = fleet.admin.start_resize(ResizeRequest(id="replace-1", replicas=REPLICAS, replace=(rank,)))
    assert (again, same.phase) == (False, ResizePhase.COMPLETED)
    return new_pid


def test_a_killed_engine_core_is_reported_dead_and_its_rank_replaced_in_place(fleet: Fleet) -> None:
    survivors = {name: fleet.pid(role, rank) for name, role, rank in (
        ("frontend", local.ROLE_FRONTEND, None), ("coordinator", local.ROLE_COORDINATOR, None),
        ("engine-0", local.ROLE_ENGINE, 0))}
    load = Load(fleet.url, MODEL_NAME, workers=2, max_tokens=16, headers={"X-data-parallel-rank": "0"})
    with HealthWatch(f"{fleet.url}/health") as health:
        load.start()
        try:
            wait_until(lambda: len([o for o in load.outcomes if o.ok]) >= 4, 60, "rank 0's load to get going")
            # Long requests on the victim: their load is in the coordinator's counts when it dies.
            doomed = [PinnedStream(fleet.url, MODEL_NAME, rank=VICTIM, max_tokens=CONTEXT - 64) for _ in range(DOOMED)]
            assert all(d.first_token.wait(60) for d in doomed)
            wait_until(lambda: fleet.status().rank(VICTIM).running == DOOMED, 15, f"rank {VICTIM}'s load in the stats")

            launcher_outlived = _kill_engine_core(fleet, VICTIM)
            # Dead within seconds of the kill: its connection is gone (the launcher's exit takes longer).
            wait_until(lambda: fleet.status().rank(VICTIM).state == RankState.DEAD, 10, f"rank {VICTIM} Dead",
                       interval=0.05)
            launcher_outlived()
            for d in doomed:
                ok, detail = d.result(30)
                assert not ok, detail
                assert "error" in detail, detail  # ended with an explicit error, not a vanished stream
            status = fleet.status()
            assert status.state == FleetState.DEGRADED
            assert f"rank {VICTIM}" in status.message
            assert status.rank(VICTIM).failed_total == DOOMED
            assert status.rank(0).state == RankState.SERVING
            code, body = fleet.complete("pinned to the dead rank", rank=VICTIM)
            assert code == 503, body  # refused at once, not hung
            code, body = fleet.complete("unpinned, after the loss")
            assert code == 200, body  # new requests go to the surviving rank
            new_pid = _replace(fleet, VICTIM)
        finally:
            load.stop()
        assert load.outcomes, "the load sent nothing"
        assert not load.failures(), load.summary()

        # The coordinator still publishes the lost engine's last load for the rank (the new engine publishes
        # only once its own counts change): the router must not take it for the new engine's.
        wait_until(lambda: (r := fleet.status().rank(0)).running == r.waiting == r.in_flight == 0, 30, "rank 0 idle")
        wait_until(lambda: fleet.status().rank(VICTIM).running == DOOMED, 15, "the stale count for the rank")
        before = {r.rank: r.requests_total for r in fleet.status().ranks}
        for i in range(4):
            code, body = fleet.complete(f"unpinned {i}", ignore_eos=True)
            assert code == 200, body
        served = {r.rank: r.requests_total - before[r.rank] for r in fleet.status().ranks}
        assert served[VICTIM] >= 1, f"the idle new engine got no request: {served}"
        code, body = fleet.complete("pinned to the new engine", rank=VICTIM, ignore_eos=True)
        assert code == 200, body
        assert body["choices"][0]["finish_reason"] == "length", body
    assert health.polls > 0
    assert not health.bad, health.bad  # one lost rank never takes the endpoint down
    assert {name: fleet.pid(role, rank) for name, role, rank in (
        ("frontend", local.ROLE_FRONTEND, None), ("coordinator", local.ROLE_COORDINATOR, None),
        ("engine-0", local.ROLE_ENGINE, 0))} == survivors
    assert fleet.engine_pid(VICTIM) == new_pid
    assert not [(p.name, rc) for p, rc in fleet.fleet.exited()], "a fleet process exited"


def _engine_pids(state: Path) -> dict[int, int]:
    rec = local.load_record(state)
    assert rec is not None
    return {p.rank: p.pid for p in rec.processes if p.role == local.ROLE_ENGINE and p.rank is not None}


def test_corefleet_scale_resizes_it_2_3_2_in_place_under_load_and_status_shows_it(fleet: Fleet) -> None:
    state = Path(fleet.rec.state_dir)
    # A client that keeps sending, a second between requests (see test_node_fleet.py for why not denser).
    load = Load(fleet.url, MODEL_NAME, workers=1, max_tokens=8, pause_s=1.0).start()
    try:
        for n in (3, 2):
            before = _engine_pids(state)
            out = corefleet("scale", str(n), "--state-dir", str(state), timeout=600)
            assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
            assert f"the fleet serves at {n} rank(s)" in out.stdout, out.stdout
            after = _engine_pids(state)
            assert sorted(after) == list(range(n)), after
            assert {r: after[r] for r in before if r < n} == {r: before[r] for r in before if r < n}
            rec = local.load_record(state)
            assert rec is not None
            assert rec.replicas == n
            status = fleet.status()
            assert [(r.rank, r.state) for r in status.ranks] == [(r, RankState.SERVING) for r in range(n)], status
            if n > len(before):  # the new ranks serve
                wait_until(lambda: all(r.requests_total > 0 for r in fleet.status().ranks), 60,
                           "the new ranks to serve requests")
            fleet.fleet.reap()
            gone = [pid for r, pid in before.items() if r >= n and local.is_running(local.proc_stat(pid))]
            assert not gone, f"retired engines still run: {gone}"
    finally:
        load.stop()
    assert len(load.outcomes) > 3, load.summary()
    assert not load.failures(), load.summary()

    # `corefleet status`: every process alive with its RSS, every rank Serving, requests counted.
    rec = local.load_record(state)
    assert rec is not None
    pids = [p.pid for p in rec.processes]
    out = corefleet("status", "--state-dir", str(state), timeout=60)
    print(out.stdout)  # the RSS table, for the record
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("PROCESS")) + 1
    rows = [ln.split() for ln in lines[first:first + len(pids)]]
    assert [int(r[2]) for r in rows] == pids
    assert all(r[3] == "yes" and float(r[4]) > 0 for r in rows), rows
    assert "fleet: Serving" in out.stdout
    first = next(i for i, ln in enumerate(lines) if ln.strip().startswith("RANK")) + 1
    ranks = [ln.split() for ln in lines[first:first + REPLICAS]]
    assert [(int(r[0]), r[1]) for r in ranks] == [(r, "Serving") for r in range(REPLICAS)]
    assert [int(r[5]) for r in ranks] == [r.requests_total for r in fleet.status().ranks]


def _descendants(pids: list[int]) -> set[int]:
    procs = local.all_procs()
    found, todo = set(), list(pids)
    while todo:
        pid = todo.pop()
        kids = [p.pid for p in procs if p.ppid == pid and local.is_running(p)]
        found.update(kids)
        todo.extend(kids)
    return found


def test_corefleet_down_stops_every_process_and_the_launchers_exit_0(fleet: Fleet) -> None:
    """`corefleet down`: nothing the fleet started is left, children included (start times, so that a pid
    reused meanwhile by an unrelated process is not taken for ours); each launcher, SIGTERMed with its
    engine core, stops the engine and exits 0."""
    state = Path(fleet.rec.state_dir)
    rec = local.load_record(state)
    assert rec is not None
    pids = [p.pid for p in rec.processes]
    children = _descendants(pids)
    started = {pid: st.start_time for pid in [*pids, *children] if (st := local.proc_stat(pid)) is not None}
    launchers = {p.rank: p.pid for p in rec.processes if p.role == local.ROLE_ENGINE}
    down = corefleet("down", "--state-dir", str(state), timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"stopped {len(pids)} of {len(pids)} processes" in down.stdout
    left = {pid: (st, local.proc_cmdline(pid)) for pid in [*pids, *children]
            if local.is_running(st := local.proc_stat(pid)) and st is not None and st.start_time <= started[pid]}
    assert not left, f"still running after `corefleet down`: {left}"
    assert local.load_record(state) is None
    for rank, pid in launchers.items():
        assert fleet.fleet.popens[pid].wait(30) == 0, f"engine-{rank}'s launcher"
        log = (state / local.LOG_DIR / f"engine-{rank}.log").read_text()
        assert "Engine stopped" in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]


def test_a_refused_engine_core_argument_fails_the_launcher_with_its_message() -> None:
    """The whole launcher, run for real (its engine core parses the flags with vLLM's own parser): the engine
    core refuses, the launcher exits with its status 2 and the parser's message, no traceback."""
    argv = ["tiny-model", "--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-start-rank",
            "1", "--data-parallel-address", "10.0.0.5", "--data-parallel-rpc-port", "29550"]  # no --headless
    result = subprocess.run([sys.executable, "-m", "corefleet_client.engine", "--health-host", "127.0.0.1",
                             "--health-port", str(free_port()), "--", *argv],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "--headless is required" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
