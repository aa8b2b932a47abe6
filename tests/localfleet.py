# SPDX-License-Identifier: Apache-2.0
"""A local fleet for e2e tests (import as `from localfleet import ...`): local mode's supervisor
(`corefleet_harness.local.start`: a standalone coordinator, the frontend and one process per engine on
127.0.0.1) with what the tests do to it.

* `start`: a fleet of real vLLM or emulated engines, its frontend's liveness timeout set, ready;
* `Held`: a module's fleet, started on first use and afresh for a test that finds it broken;
* `Fleet`: requests (plain, streamed, pinned to a rank), /health, the admin API, the processes' pids, an
  engine killed and started again with its own command line;
* `corefleet`: the `corefleet` command; `scale`: `corefleet scale` to each size under load, checked;
* `Stream`: an open SSE completion, read event by event; `PinnedLoad`: a client sending short completions
  pinned to one rank, checking /health after each; `HealthWatch`: /health polled in a thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from corefleet_client.admin import AdminClient, AdminError, FleetState, RankState
from corefleet_client.frontend.__main__ import ENV_HOLD_REQUESTS, ENV_HOLD_TIMEOUT, ENV_LIVENESS_TIMEOUT
from corefleet_harness import local
from corefleet_harness.support import free_ports, http_get, wait_until
from corefleet_harness.tinymodel import VLLM_CPU_FLAGS
from fleettest import Load

MODEL_NAME = "tiny"
RANK_HEADER = "X-data-parallel-rank"  # vLLM's way to pin a request to a rank


def flags(max_model_len: int) -> tuple[str, ...]:
    """The CPU engines' vLLM flags with this context and the served name `MODEL_NAME`."""
    out = list(VLLM_CPU_FLAGS)
    out[out.index("--max-model-len") + 1] = str(max_model_len)
    return (*out, "--served-model-name", MODEL_NAME)


@dataclass
class Fleet:
    fleet: local.LocalFleet
    admin: AdminClient
    host: str
    port: int
    max_tokens_long: int  # a request this long stays in flight for several seconds
    liveness_timeout: float  # the frontend's --liveness-timeout

    @property
    def rec(self) -> local.FleetRecord:
        return self.fleet.record

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def status(self) -> Any:
        return self.admin.fleet()

    def health(self) -> int:
        return http_get(f"{self.url}/health")[0]

    def complete(self, prompt: str | list[int], max_tokens: int = 8, rank: int | None = None,
                 ignore_eos: bool = False) -> tuple[int, dict[str, Any]]:
        body: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens}
        if ignore_eos:
            body["ignore_eos"] = True
        headers = {"Content-Type": "application/json"} | ({RANK_HEADER: str(rank)} if rank is not None else {})
        req = urllib.request.Request(f"{self.url}/v1/completions", data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return int(r.status), json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def stream(self, max_tokens: int, rank: int | None = None) -> Stream:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True}
        headers = {"Content-Type": "application/json"} | ({RANK_HEADER: str(rank)} if rank is not None else {})
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        return Stream(conn, resp)

    def pid(self, role: str, rank: int | None = None) -> int:
        """The pid of the fleet's (latest) process of this role and rank."""
        return next(p.pid for p in self.rec.processes[::-1] if p.role == role and p.rank == rank)

    def engine_pid(self, rank: int) -> int:
        return self.pid(local.ROLE_ENGINE, rank)

    def frontend_pid(self) -> int:
        return self.pid(local.ROLE_FRONTEND)

    def kill_engine(self, rank: int) -> None:
        """SIGKILL the rank's launcher and engine core (its process group); wait until the group is gone."""
        pid = self.engine_pid(rank)
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

    def in_flight_rank(self) -> int:
        """The single rank holding an in-flight request."""
        def find() -> list[int] | None:
            busy = [r.rank for r in self.status().ranks if r.in_flight]
            return busy if len(busy) == 1 else None
        busy: list[int] = wait_until(find, 10, "one rank with an in-flight request", interval=0.05)
        return busy[0]


def start(tmp: Path, engine: str, replicas: int, model: str, vllm_flags: tuple[str, ...], max_tokens_long: int,
          token_delay_ms: int | None, ready_timeout: float, liveness_timeout: float = 30.0, frontends: int = 1,
          hold: tuple[int, float] | None = None) -> Generator[Fleet, None, None]:
    """A ready fleet (a generator for a fixture: stopped when it resumes); `hold`: its frontend's --hold-requests and
    --hold-timeout (None: the defaults)."""
    port = free_ports(1)[0]
    opts = local.FleetOptions(replicas=replicas, engine=engine, model=model, port=port, state_dir=tmp / "state",
                              vllm_flags=vllm_flags, token_delay_ms=token_delay_ms, frontends=frontends)
    with pytest.MonkeyPatch.context() as env:  # the frontend's --liveness-timeout (local mode passes none)
        env.setenv(ENV_LIVENESS_TIMEOUT, str(liveness_timeout))
        if hold is not None:
            env.setenv(ENV_HOLD_REQUESTS, str(hold[0]))
            env.setenv(ENV_HOLD_TIMEOUT, str(hold[1]))
        fleet = local.start(opts)
    try:
        fleet.wait_ready(timeout=ready_timeout)
        yield Fleet(fleet=fleet, admin=fleet.record.admin_client(timeout=15), host=local.LOCALHOST, port=port,
                    max_tokens_long=max_tokens_long, liveness_timeout=liveness_timeout)
    finally:
        fleet.stop(grace=10)


class Held:
    """A module's fleet, started on first use (`make(tmp)`: a generator like `start`'s), and started afresh
    for a test that finds it not serving at `replicas` ranks (a test that failed half-way, or stopped it):
    so that each test also runs alone, whatever ran before it."""

    def __init__(self, tmp: Path, replicas: int, make: Callable[[Path], Generator[Fleet, None, None]]) -> None:
        self.tmp, self.replicas, self.make, self.starts = tmp, replicas, make, 0
        self._gen: Generator[Fleet, None, None] | None = None
        self._fleet: Fleet | None = None

    def get(self) -> Fleet:
        if self._fleet is not None and not self.whole(self._fleet):
            self.close()
        if self._fleet is None:
            self.starts += 1
            self._gen = self.make(self.tmp / f"fleet-{self.starts}")
            self._fleet = next(self._gen)
        return self._fleet

    def whole(self, fleet: Fleet) -> bool:
        try:
            status = fleet.status()
        except (OSError, AdminError, ValueError):
            return False
        return (status.state == FleetState.SERVING and status.data_parallel_size == self.replicas
                and all(r.state == RankState.SERVING for r in status.ranks) and fleet.health() == 200)

    def close(self) -> None:
        if self._gen is not None:
            self._gen.close()  # the generator's `finally` stops the fleet
        self._gen = self._fleet = None


def descendants(pids: list[int]) -> set[int]:
    """Every running process below these (children, grandchildren, ...)."""
    procs = local.all_procs()
    found, todo = set(), list(pids)
    while todo:
        pid = todo.pop()
        kids = [p.pid for p in procs if p.ppid == pid and local.is_running(p)]
        found.update(kids)
        todo.extend(kids)
    return found


CLI = [sys.executable, "-m", "corefleet_harness.cli"]


def corefleet(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def engine_pids(state: Path) -> dict[int, int]:
    rec = local.load_record(state)
    assert rec is not None
    return {p.rank: p.pid for p in rec.processes if p.role == local.ROLE_ENGINE and p.rank is not None}


def scale(state: Path, port: int, sizes: list[int], timeout: float, model: str = "tiny-llama") -> None:
    """`corefleet scale N` for each size, with a client sending requests all along: none fails, the
    ranks that stay keep their processes, and the state file follows."""
    # A client that keeps sending, a second between requests (see test_node_fleet.py for why not denser).
    load = Load(f"http://127.0.0.1:{port}", model, workers=1, max_tokens=8, pause_s=1.0).start()
    try:
        for n in sizes:
            before = engine_pids(state)
            out = corefleet("scale", str(n), "--state-dir", str(state), timeout=timeout)
            assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
            assert f"the fleet serves at {n} rank(s)" in out.stdout, out.stdout
            after = engine_pids(state)
            assert sorted(after) == list(range(n)), after
            assert {r: after[r] for r in before if r < n} == {r: before[r] for r in before if r < n}
            rec = local.load_record(state)
            assert rec is not None
            assert rec.replicas == n
            admin = rec.admin_client()
            fleet = admin.fleet()
            assert [(r.rank, r.state) for r in fleet.ranks] == [(r, "Serving") for r in range(n)], fleet
            if n > len(before):  # the new ranks serve
                wait_until(lambda: all(r.requests_total > 0 for r in admin.fleet().ranks), 60,  # noqa: B023
                           "the new ranks to serve requests")
            gone = [pid for r, pid in before.items() if r >= n and local.is_running(local.proc_stat(pid))]
            assert not gone, f"retired engines still run: {gone}"
    finally:
        load.stop()
    assert len(load.outcomes) > 3, load.summary()
    assert not load.failures(), load.summary()


class Stream:
    """An open SSE completion stream, read event by event."""

    def __init__(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
        self.conn, self.resp = conn, resp

    def next_event(self) -> dict[str, Any] | None:
        """The next `data:` payload; None at `[DONE]` or the end of the response."""
        while True:
            line = self.resp.readline()
            if not line:
                return None
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[len(b"data:"):].strip()
            if data == b"[DONE]":
                return None
            event: dict[str, Any] = json.loads(data)
            return event

    def rest(self) -> list[dict[str, Any]]:
        events = []
        while (e := self.next_event()) is not None:
            events.append(e)
        return events

    def close(self) -> None:
        self.conn.close()

    def drain_in_background(self) -> Callable[[], dict[str, Any] | None]:
        """Keep reading the stream in a thread (as a browser does), so the server never blocks on a full
        socket; returns a function giving the last event read so far (None before any)."""
        last: list[dict[str, Any]] = []

        def read() -> None:
            try:
                while (event := self.next_event()) is not None:
                    last[:] = [event]
            except (OSError, ValueError, AttributeError, http.client.HTTPException):
                pass  # closed by the test

        threading.Thread(target=read, name="stream-reader", daemon=True).start()
        return lambda: last[0] if last else None


class PinnedLoad:
    """A client sending short completions pinned to one rank, one after another, and checking /health."""

    def __init__(self, fleet: Fleet, rank: int) -> None:
        self.fleet, self.rank = fleet, rank
        self.ok = 0
        self.failures: list[tuple[int, dict[str, Any]]] = []
        self.health: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"load-rank-{rank}", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            code, body = self.fleet.complete(f"load {self.ok}", max_tokens=4, rank=self.rank)
            if code == 200:
                self.ok += 1
            else:
                self.failures.append((code, body))
            self.health.append(self.fleet.health())

    def __enter__(self) -> PinnedLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=150)


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


def kill_member_under_load(state: Path, url: str, model: str, role: str, replicas: int,
                           timeout: float = 300.0) -> tuple[float, Load]:
    """SIGKILL a local fleet's `role` process (frontend or coordinator) while 2 clients send requests; wait until
    its supervisor's replacement is recorded, the endpoint serves and every rank is Serving, then until 4 more
    requests succeeded; every request sent once it served again must have. Returns the seconds from the kill to
    serving again, and the load."""
    rec = local.load_record(state)
    assert rec is not None
    admin = rec.admin_client(timeout=5)
    load = Load(url, model, workers=2, max_tokens=16).start()
    try:
        wait_until(lambda: len([o for o in load.outcomes if o.ok]) >= 4, 60, "the load to get going")
        old = next(p.pid for p in rec.processes if p.role == role)
        killed = time.monotonic()
        os.kill(old, signal.SIGKILL)

        def replaced() -> bool:
            latest = local.load_record(state)
            assert latest is not None
            new = next(p for p in latest.processes if p.role == role)
            if new.pid == old or not local.owns(latest, new):
                return False
            try:  # refused until the replacement listens
                if http_get(f"{url}/health", 2, unanswered_ok=True)[0] != 200:
                    return False
                status = admin.fleet()
            except (OSError, AdminError, ValueError):
                return False
            return status.state == FleetState.SERVING and [(r.rank, r.state) for r in status.ranks] == [
                (r, RankState.SERVING) for r in range(replicas)]

        wait_until(replaced, timeout, f"the {role} replaced and the fleet serving", interval=0.2)
        back = time.monotonic()
        wait_until(lambda: len([o for o in load.outcomes if o.ok and o.started > back]) >= 4, 60,
                   "4 requests served after the replacement")
    finally:
        load.stop()
    late = [o.detail for o in load.failures() if o.started > back]
    assert not late, f"requests sent once the {role} served again failed: {late[:5]}; {load.summary()}"
    print(f"{role} killed: serving again after {back - killed:.1f} s; {load.summary()}")
    return back - killed, load


@contextlib.contextmanager
def supervised(fleet: Fleet) -> Iterator[subprocess.Popen[bytes]]:
    """The fleet with the supervisor `corefleet up --detach` leaves running (a replacement frontend it starts gets
    the fleet's --liveness-timeout); on the way out the state file forgets it, as `corefleet down` does, and it must
    leave with 0."""
    state = Path(fleet.rec.state_dir)
    rec = local.load_record(state)
    assert rec is not None
    with pytest.MonkeyPatch.context() as env:
        env.setenv(ENV_LIVENESS_TIMEOUT, str(fleet.liveness_timeout))
        rec, supervisor = local.spawn_supervisor(rec)
    fleet.fleet.record = rec
    try:
        yield supervisor
    finally:
        latest = local.load_record(state)
        assert latest is not None
        fleet.fleet.record = dataclasses.replace(latest, processes=tuple(
            p for p in latest.processes if p.role != local.ROLE_SUPERVISOR))
        local.save_record(fleet.fleet.record)
        assert supervisor.wait(30) == 0
