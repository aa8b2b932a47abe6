# SPDX-License-Identifier: Apache-2.0
"""The frontend (corefleet's DPLB client + admin API) over emulated engines in separate processes.

Two fleets, each started with local mode's supervisor (`localfleet.start`: a standalone coordinator, the
frontend, and one emulator process per engine on 127.0.0.1): 4 ranks with a 20 ms per-token delay, and a
single rank (vLLM's plain async client under corefleet's). tests/e2e/test_vllm_local_fleet.py runs the same
checks on real vLLM engines with 2 ranks; here the fleet is wider (a burst spreads over 4 ranks, the other
3 serve on while one is stopped or lost) and every engine starts in a fraction of a second.

On the 4-rank fleet: completions succeed and every rank serves some; a cancelled stream is aborted on the
rank that had it; the admin API refuses requests without the token; vLLM's unauthenticated elastic-EP routes
are not served; an engine stopped (SIGSTOP) past the liveness timeout is Unresponsive while the other ranks
serve on and /health stays 200, and serves again once continued; a killed engine is reported Dead within
seconds, the stream it was serving ends with an explicit error, and the other ranks go on serving (/health
stays 200). Each test starts from a fleet serving at 4 ranks (a fresh one when a test left it broken).
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from corefleet_client.admin import AdminClient, AdminError, FleetState, RankState
from corefleet_harness import local
from corefleet_harness.support import wait_until
from corefleet_harness.tinymodel import write_tiny_model
from localfleet import Fleet, PinnedLoad, flags, start

pytestmark = pytest.mark.e2e

LONG_CONTEXT = 8192
REPLICAS = 4
POLL = 0.05


class Held:
    """The module's 4-rank fleet: started on first use, and afresh for a test that finds it not serving at 4."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.starts = tmp, 0
        self._gen: Iterator[Fleet] | None = None
        self._fleet: Fleet | None = None

    def get(self) -> Fleet:
        if self._fleet is not None and not _whole(self._fleet, REPLICAS):
            self.close()
        if self._fleet is None:
            self.starts += 1
            tmp = self.tmp / f"fleet-{self.starts}"
            self._gen = start(tmp, local.ENGINE_EMULATOR, REPLICAS, _long_context_model(tmp), flags(LONG_CONTEXT),
                              max_tokens_long=1000, token_delay_ms=20, ready_timeout=180, liveness_timeout=3)
            self._fleet = next(self._gen)
        return self._fleet

    def close(self) -> None:
        if self._gen is not None:
            self._gen.close()
        self._gen = self._fleet = None


def _whole(fleet: Fleet, replicas: int) -> bool:
    try:
        status = fleet.status()
    except (OSError, AdminError, ValueError):
        return False
    return (status.state == FleetState.SERVING and status.data_parallel_size == replicas
            and all(r.state == RankState.SERVING for r in status.ranks) and fleet.health() == 200)


def _long_context_model(tmp: Path) -> str:
    return str(write_tiny_model(tmp / "tiny-long", context=LONG_CONTEXT))


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Held]:
    h = Held(tmp_path_factory.mktemp("emulated-fleet"))
    yield h
    h.close()


@pytest.fixture
def fleet(held: Held) -> Fleet:
    return held.get()


def test_completions_are_spread_over_every_rank(fleet: Fleet) -> None:
    before = {r.rank: r.requests_total for r in fleet.status().ranks}
    n = 4 * fleet.rec.replicas
    for i in range(n):
        code, body = fleet.complete(f"Hello number {i}")
        assert code == 200, body
        assert body["choices"][0]["finish_reason"] in ("length", "stop"), body
        assert body["usage"]["completion_tokens"] >= 1, body
    status = fleet.status()
    assert status.state == FleetState.SERVING
    served = {r.rank: r.requests_total - before[r.rank] for r in status.ranks}
    assert sum(served.values()) == n, served
    assert all(count >= 1 for count in served.values()), f"a rank served nothing: {served}"
    assert all(r.state == RankState.SERVING and r.in_flight == 0 for r in status.ranks), status


def test_admin_api_needs_the_token(fleet: Fleet) -> None:
    status = fleet.status()  # with the token
    assert status.data_parallel_size == fleet.rec.replicas
    assert [r.identity for r in status.ranks] == [r.to_bytes(2, "little").hex() for r in range(fleet.rec.replicas)]
    for client in (AdminClient(fleet.rec.admin_url, token="wrong"), AdminClient(fleet.rec.admin_url, token="")):
        with pytest.raises(AdminError) as err:
            client.fleet()
        assert err.value.status == 401
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(fleet.rec.admin_url + "/v1/fleet", timeout=5)
    assert raw.value.code == 401


def test_cancelled_stream_is_aborted_on_its_rank(fleet: Fleet) -> None:
    """The race this test once lost (issue #9, defect 11): it used to read one event and then stop reading
    while it looked for the rank; vLLM's engine does not wait for the client, so under load the request
    could finish on the engine before the client went away, and a finished request has nothing to abort.
    The stream is now read throughout, and the test checks that the request was still running when the
    client left."""
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
               f"an abort routed to rank {rank}", interval=POLL,
               diagnose=lambda: f"aborts before: {before}; now: {fleet.status().ranks}")
    status = wait_until(lambda: (s := fleet.status()).rank(rank).in_flight == 0 and s, 15,
                        f"rank {rank} to finish the aborted request", interval=POLL)
    others = {r.rank: r.aborts_total - before[r.rank] for r in status.ranks if r.rank != rank}
    assert not any(others.values()), f"aborts went to other ranks: {others}"


def test_the_public_port_does_not_serve_elastic_ep_routes(fleet: Fleet) -> None:
    """vLLM mounts these without authentication; a fleet's size is the operator's (issue #9, defect 8)."""
    for path, body in (("/scale_elastic_ep", {"new_data_parallel_size": 1}), ("/is_scaling_elastic_ep", {})):
        req = urllib.request.Request(f"http://{fleet.host}:{fleet.port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=10)
        assert refused.value.code == 404, (path, refused.value.read())
    assert fleet.status().data_parallel_size == fleet.rec.replicas


def test_a_stopped_engine_is_unresponsive_and_serves_again_once_continued(fleet: Fleet) -> None:
    """SIGSTOP one engine past the liveness timeout while a client loads another rank, then SIGCONT (issue #9)."""
    slow, other = fleet.rec.replicas - 1, 0
    frontend = fleet.frontend_pid()
    # A request in flight on the slow rank when it stops: it waits for the rank, it does not fail.
    held = fleet.stream(max(fleet.max_tokens_long // 4, 200), rank=slow)
    try:
        assert held.next_event() is not None
        os.killpg(fleet.engine_pid(slow), signal.SIGSTOP)  # the launcher and its EngineCore process
        try:
            with PinnedLoad(fleet, other) as load:
                status = wait_until(lambda: (s := fleet.status()).rank(slow).state != RankState.SERVING and s,
                                    fleet.liveness_timeout + 30, f"rank {slow} to leave Serving", interval=POLL)
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
                wait_until(lambda: load.ok >= served + 5, 60, f"rank {other} to serve more requests", interval=POLL)
        finally:
            os.killpg(fleet.engine_pid(slow), signal.SIGCONT)
        assert load.ok > 0
        assert load.failures == []
        assert set(load.health) == {200}
        wait_until(lambda: fleet.status().rank(slow).state == RankState.SERVING, 30, f"rank {slow} Serving again",
                   interval=POLL)
        # The held request finishes normally; the frontend survived the late answers.
        events = held.rest()
        assert not [e for e in events if "error" in e], events[-3:]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        held.close()
    os.kill(frontend, 0)  # still running
    assert fleet.health() == 200
    assert fleet.status().state == FleetState.SERVING
    # Back in the routing: an unpinned burst of one stream per rank puts one on each, the returned rank too.
    burst = [fleet.stream(fleet.max_tokens_long) for _ in range(fleet.rec.replicas)]
    try:
        for s in burst:
            assert s.next_event() is not None
        status = fleet.status()
        assert [r.in_flight for r in status.ranks] == [1] * fleet.rec.replicas, status
    finally:
        for s in burst:
            s.close()
    wait_until(lambda: all(r.in_flight == 0 for r in fleet.status().ranks), 30, "the burst's streams to end",
               interval=POLL)
    code, body = fleet.complete("after the stop", rank=slow)
    assert code == 200, body


def test_killed_engine_is_reported_and_its_requests_fail(fleet: Fleet) -> None:
    """It leaves the fleet degraded: the next test gets a fresh one."""
    victim = fleet.rec.replicas - 1
    # One long stream pinned to each rank. (Unpinned, vLLM's router spreads a burst by the coordinator's
    # load counts, which may lag the engines': after the stopped-engine test it once put two streams on
    # one rank. Routing has its own test; this one is about the loss.)
    streams = [fleet.stream(fleet.max_tokens_long, rank=r) for r in range(fleet.rec.replicas)]
    try:
        for s in streams:
            assert s.next_event() is not None
        status = fleet.status()
        assert all(r.in_flight == 1 for r in status.ranks), status

        os.killpg(fleet.engine_pid(victim), signal.SIGKILL)  # the launcher and its EngineCore process
        killed_at = time.monotonic()
        wait_until(lambda: fleet.status().rank(victim).state == RankState.DEAD, 10, f"rank {victim} reported Dead",
                   interval=POLL)
        detected_s = time.monotonic() - killed_at
        assert fleet.health() == 200  # the other ranks serve: one lost rank never takes the endpoint down
        status = fleet.status()
        assert status.state == FleetState.DEGRADED
        assert f"rank {victim}" in status.message
        assert status.rank(victim).failed_total == 1
        assert detected_s < 10

        # Exactly one stream (the victim's) ends with an explicit error; the others complete.
        outcomes = []
        for s in streams:
            events = s.rest()
            errors = [e for e in events if "error" in e]
            finishes = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
            outcomes.append("error" if errors else (finishes[-1] if finishes else "vanished"))
        assert sorted(outcomes) == sorted(["error"] + ["length"] * (fleet.rec.replicas - 1)), outcomes
    finally:
        for s in streams:
            s.close()
    # New requests go to the surviving ranks.
    code, body = fleet.complete("after the loss")
    assert code == 200, body
    assert fleet.status().rank(victim).in_flight == 0


@pytest.fixture(scope="module")
def single_rank_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """replicas: 1 (vLLM's plain async client under corefleet's KubeMPClient), emulator engine."""
    tmp = tmp_path_factory.mktemp("fleet-single")
    yield from start(tmp, local.ENGINE_EMULATOR, 1, _long_context_model(tmp), flags(LONG_CONTEXT),
                     max_tokens_long=1000, token_delay_ms=20, ready_timeout=180)


def test_single_rank_fleet_serves_aborts_and_reports_its_dead_engine(single_rank_fleet: Fleet) -> None:
    fleet = single_rank_fleet
    code, body = fleet.complete("Hello")
    assert code == 200, body
    status = fleet.status()
    assert (status.state, status.data_parallel_size) == (FleetState.SERVING, 1)
    assert (status.rank(0).requests_total, status.rank(0).in_flight) == (1, 0)

    cancelled = fleet.stream(fleet.max_tokens_long)
    try:
        assert cancelled.next_event() is not None
        assert fleet.in_flight_rank() == 0
    finally:
        cancelled.close()
    wait_until(lambda: (r := fleet.status().rank(0)).aborts_total == 1 and r.in_flight == 0, 15, "the abort",
               interval=POLL)

    stream = fleet.stream(fleet.max_tokens_long)
    try:
        assert stream.next_event() is not None
        assert fleet.in_flight_rank() == 0
        os.killpg(fleet.engine_pid(0), signal.SIGKILL)
        wait_until(lambda: fleet.status().rank(0).state == RankState.DEAD, 10, "rank 0 reported Dead", interval=POLL)
        wait_until(lambda: fleet.health() == 503, 5, "/health 503", interval=POLL)
        events = stream.rest()
        assert any("error" in e for e in events), events[-3:]
    finally:
        stream.close()
    assert fleet.status().rank(0).failed_total == 1
    code, body = fleet.complete("after the loss")
    assert code >= 500, body  # no rank left: an explicit error, not a hang
