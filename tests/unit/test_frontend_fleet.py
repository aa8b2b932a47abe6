# SPDX-License-Identifier: Apache-2.0
"""Resize operations through the admin API: the frontend's `Fleet` registry behind a real AdminServer.

The event loop's side (the client carrying a resize out) is played by the test: `RecordingRunner` records
what the registry hands over, and the test moves the operation on as the client would
(`update_resize`, `set_rank`, `finish_resize`). The client itself runs against real engines in
tests/e2e.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from corefleet_client.admin import (
    LIVE_PATH,
    LOOP_STALL_LIMIT_S,
    AdminClient,
    AdminError,
    FleetState,
    RankState,
    ResizeOperation,
    ResizePhase,
    ResizeRequest,
)
from corefleet_client.frontend import fleet as fleet_module
from corefleet_client.frontend.adminserver import AdminServer
from corefleet_client.frontend.fleet import Fleet
from standins import IdleView, RecordingRunner

TOKEN = "t0ken"


class View(IdleView):
    def lb_counts(self, rank: int) -> tuple[int, int, float]:
        return rank, 2 * rank, 0.5

    def in_flight(self, rank: int) -> int:
        return 10 + rank


@dataclass
class Setup:
    fleet: Fleet
    runner: RecordingRunner
    client: AdminClient
    url: str

    def serve(self) -> None:
        self.fleet.serving(View(), self.runner)

    def post(self, path: str, body: Any, token: str = TOKEN) -> tuple[int, dict[str, Any]]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())


@pytest.fixture
def setup() -> Iterator[Setup]:
    fleet = Fleet("tiny", 2, vllm_version="0.32.0")
    server = AdminServer("127.0.0.1", 0, TOKEN, fleet)
    server.start()
    url = f"http://127.0.0.1:{server.port}"
    try:
        yield Setup(fleet, RecordingRunner(), AdminClient(url, TOKEN), url)
    finally:
        server.stop()


def test_a_starting_fleet_shows_joining_ranks_and_refuses_resizes(setup: Setup) -> None:
    setup.fleet.set_join_progress(lambda: {0: "engine READY; waiting for the other ranks"})
    status = setup.client.fleet()
    assert status.state == FleetState.STARTING
    assert [(r.rank, r.state) for r in status.ranks] == [(0, RankState.JOINING), (1, RankState.JOINING)]
    assert status.rank(0).message == "engine READY; waiting for the other ranks"
    assert status.rank(1).message == "waiting for the engine's HELLO"
    with pytest.raises(AdminError) as err:
        setup.client.start_resize(ResizeRequest(id="r1", replicas=3))
    assert err.value.status == 503
    assert "starting" in err.value.body


def test_scale_up_is_accepted_once_and_reported_as_it_runs(setup: Setup) -> None:
    setup.serve()
    started, op = setup.client.start_resize(ResizeRequest(id="up-1", replicas=4, join_timeout_s=60))
    assert started
    assert (op.id, op.from_replicas, op.to_replicas, op.phase) == ("up-1", 2, 4, ResizePhase.PENDING)
    assert [(r.rank, r.state) for r in op.ranks] == [(2, RankState.JOINING), (3, RankState.JOINING)]
    assert op.join_timeout_s == 60
    assert setup.runner.runs == ["up-1"]  # handed to the event loop once

    # The same request again (an operator that restarted): the same operation, not a second one.
    again, same = setup.client.start_resize(ResizeRequest(id="up-1", replicas=4))
    assert not again
    assert same.id == "up-1"
    assert setup.runner.runs == ["up-1"]

    # The event loop moves it on; every reader sees it.
    setup.fleet.update_resize("up-1", phase=ResizePhase.PREPARING, message="waiting for ranks 2, 3")
    setup.fleet.set_rank(2, RankState.JOINING, "engine initialising (INIT sent)")
    seen = setup.client.resize("up-1")
    assert seen is not None
    assert seen.phase == ResizePhase.PREPARING
    assert seen.rank(2).message == "engine initialising (INIT sent)"
    assert setup.client.fleet().resize == seen

    setup.fleet.set_rank(2, RankState.SERVING)
    setup.fleet.set_rank(3, RankState.SERVING)
    setup.fleet.commit_size(4)
    setup.fleet.finish_resize("up-1")
    done = setup.client.resize("up-1")
    assert done is not None
    assert done.phase == ResizePhase.COMPLETED
    assert done.finished_at is not None
    assert done.finished_at >= done.started_at
    status = setup.client.fleet()
    assert status.data_parallel_size == 4
    assert [(r.rank, r.state, r.in_flight, r.running) for r in status.ranks] == [
        (r, RankState.SERVING, 10 + r, 2 * r) for r in range(4)]


def test_one_resize_at_a_time(setup: Setup) -> None:
    setup.serve()
    setup.client.start_resize(ResizeRequest(id="a", replicas=3))
    for request in (ResizeRequest(id="b", replicas=1), ResizeRequest(id="a", replicas=5)):
        code, body = setup.post("/v1/resizes", request.to_json())
        assert code == 409, body
        assert body["operation"]["id"] == "a"  # the one in the way is named
    assert setup.runner.runs == ["a"]
    setup.fleet.finish_resize("a", error="rank 2 did not join within the join timeout of 60s")
    assert setup.client.resize("a").phase == ResizePhase.FAILED  # type: ignore[union-attr]
    started, op = setup.client.start_resize(ResizeRequest(id="b", replicas=1))
    assert started
    assert op.from_replicas == 2
    assert [(r.rank, r.state) for r in op.ranks] == [(1, RankState.SERVING)]
    assert [o.id for o in setup.client.resizes()] == ["b", "a"]  # newest first


def test_a_resize_to_the_current_size_completes_at_once(setup: Setup) -> None:
    setup.serve()
    started, op = setup.client.start_resize(ResizeRequest(id="same", replicas=2))
    assert started
    assert op.phase == ResizePhase.COMPLETED
    assert setup.runner.runs == []


def test_a_fleet_with_a_dead_rank_cannot_resize(setup: Setup) -> None:
    setup.serve()
    setup.fleet.set_rank(1, RankState.DEAD, "connection to the engine lost")
    code, body = setup.post("/v1/resizes", {"id": "x", "replicas": 3})
    assert code == 503
    assert "rank(s) [1] are dead" in body["error"]
    assert setup.client.fleet().state == FleetState.DEGRADED


def test_an_unresponsive_rank_is_shown_with_since_when(setup: Setup) -> None:
    setup.serve()
    before = time.time()
    setup.fleet.set_rank(1, RankState.UNRESPONSIVE, "no answer to a liveness call sent at 02:40:01 UTC within 30s")
    status = setup.client.fleet()  # through the admin API, as the operator reads it
    assert status.state == FleetState.DEGRADED
    assert status.message == "rank 1 Unresponsive: no answer to a liveness call sent at 02:40:01 UTC within 30s"
    assert status.rank(1).state == RankState.UNRESPONSIVE
    since = status.rank(1).since
    assert since is not None
    assert before <= since <= time.time()
    assert status.rank(0).state == RankState.SERVING
    setup.fleet.set_rank(1, RankState.UNRESPONSIVE, "still no answer")  # the same state: the same since
    assert setup.client.fleet().rank(1).since == since
    setup.fleet.set_rank(1, RankState.SERVING)
    status = setup.client.fleet()
    assert status.state == FleetState.SERVING
    assert (status.rank(1).since or 0) >= since


@pytest.mark.parametrize(("body", "message"), [
    ({"id": "bad id!", "replicas": 3}, "must match"),
    ({"id": "x", "replicas": 0}, "at least 1"),
    ({"id": "x", "replicas": True}, "integer"),
    ({"id": "x", "replicas": "3"}, "integer"),
    ({"id": "x", "replicas": 3, "drain_timeout_s": -1}, "drain_timeout_s"),
    ({"id": "x", "replicas": 3, "join_timeout_s": 0}, "join_timeout_s"),
    ({"id": "x", "replicas": 3, "colour": "red"}, "unknown field"),
    ({"replicas": 3}, "id must be a string"),
    (b"{not json", "not JSON"),
    ([1, 2], "JSON object"),
])
def test_bad_resize_requests_get_400(setup: Setup, body: Any, message: str) -> None:
    setup.serve()
    code, answer = setup.post("/v1/resizes", body)
    assert code == 400, answer
    assert message in answer["error"]
    assert setup.runner.runs == []


def test_resizes_need_the_token(setup: Setup) -> None:
    setup.serve()
    code, answer = setup.post("/v1/resizes", {"id": "x", "replicas": 3}, token="wrong")
    assert code == 401
    assert setup.runner.runs == []
    assert "operation" not in answer


def test_cancel(setup: Setup) -> None:
    setup.serve()
    with pytest.raises(AdminError) as err:
        setup.client.cancel_resize("nope", "why")
    assert err.value.status == 404
    setup.client.start_resize(ResizeRequest(id="up", replicas=3))
    setup.fleet.update_resize("up", phase=ResizePhase.PREPARING)
    assert setup.client.cancel_resize("up", "pod llm-engine-2 failed").phase == ResizePhase.PREPARING
    assert setup.runner.cancels == [("up", "pod llm-engine-2 failed")]
    code, body = setup.post("/v1/resizes/up/cancel", {})
    assert code == 400
    assert "reason" in body["error"]
    setup.fleet.update_resize("up", phase=ResizePhase.COMMITTING)
    with pytest.raises(AdminError) as err:
        setup.client.cancel_resize("up", "too late")
    assert err.value.status == 409
    setup.fleet.finish_resize("up", error="cancelled: pod failed")
    assert setup.client.cancel_resize("up", "again").phase == ResizePhase.FAILED  # idempotent once failed
    assert len(setup.runner.cancels) == 1


def test_unknown_resize_is_404(setup: Setup) -> None:
    assert setup.client.resize("missing") is None
    with pytest.raises(AdminError) as err:
        setup.client._get("/v1/resizes/a/b")
    assert err.value.status == 404


def test_history_is_bounded_and_keeps_the_running_one(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_module, "HISTORY", 3)
    setup.serve()
    for i in range(5):
        setup.fleet.start_resize(ResizeRequest(id=f"r{i}", replicas=2))  # complete at once
    assert [o.id for o in setup.fleet.resizes()] == ["r4", "r3", "r2"]


def test_operations_round_trip_through_json() -> None:
    fleet = Fleet("m", 3)
    fleet.serving(View(), RecordingRunner())
    _, _op = fleet.start_resize(ResizeRequest(id="down", replicas=1, drain_timeout_s=5))
    fleet.set_rank(2, RankState.DRAINING, "1 request(s) in flight")
    fleet.finish_resize("down", error="boom", fleet_intact=False)
    final = fleet.resize("down")
    assert final is not None
    assert ResizeOperation.from_json(json.loads(json.dumps(final.to_json()))) == final
    assert not final.fleet_intact
    assert final.rank(2).state == RankState.DRAINING
    assert ResizeRequest.from_json(ResizeRequest(id="a", replicas=2).to_json()) == ResizeRequest(id="a", replicas=2)


def test_the_fleet_tells_how_long_it_has_been_quiet_and_how_many_requests_wait(setup: Setup) -> None:
    """What the operator reads to idle a quiet fleet and to wake an idle one (issue 28), over the admin API."""
    fleet, now, waiting = setup.fleet, [100.0], [0]
    fleet.clock = lambda: now[0]
    fleet.demand = lambda: waiting[0]
    setup.serve()
    fleet.note_busy(True)  # the liveness watcher's tick: a request in flight
    now[0] += 0.5
    assert (setup.client.fleet().quiet_s, setup.client.fleet().requests_waiting) == (0.5, 0)
    fleet.note_busy(False)
    now[0] += 61.25
    fleet.note_busy(False)
    assert setup.client.fleet().quiet_s == 61.75  # since the last tick that saw a request
    waiting[0] = 3
    fleet.note_busy(True)  # a request waiting is not quiet
    status = setup.client.fleet()
    assert (status.quiet_s, status.requests_waiting) == (0.0, 3)


def test_livez_fails_only_once_the_serving_event_loop_stalls(setup: Setup) -> None:
    """The frontend pod's livenessProbe (admin /livez, no token): a frontend blocked in vLLM's startup
    handshake is alive; a serving one is alive while its liveness watcher ticks (each tick beats)."""
    def livez() -> tuple[int, dict[str, Any]]:
        try:
            with urllib.request.urlopen(f"{setup.url}{LIVE_PATH}", timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    assert livez()[0] == 200  # starting: no beat yet
    setup.serve()
    setup.fleet.beat()
    assert livez()[0] == 200
    setup.fleet._beat = time.monotonic() - LOOP_STALL_LIMIT_S - 1  # the loop's last tick, long ago
    code, body = livez()
    assert code == 503
    assert "made no progress" in body["error"]
    setup.fleet.beat()
    assert livez()[0] == 200
