# SPDX-License-Identifier: Apache-2.0
"""The operator's admin API calls (corefleet_operator.frontend_api) against a real admin server and fleet registry."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from unittest import mock

import pytest

from corefleet_client.admin import (
    FleetState,
    FleetStatus,
    RankState,
    ResizeOperation,
    ResizePhase,
    ResizeRank,
    ResizeRequest,
)
from corefleet_client.frontend.adminserver import AdminServer
from corefleet_client.frontend.fleet import Fleet
from corefleet_client.frontend.types import ResizeRefused
from corefleet_operator import constants, frontend_api
from corefleet_operator.actions import CancelResize, StartResize
from corefleet_operator.frontend_api import FrontendAPI
from corefleet_operator.observe import PodObs, RankObs, fleet_obs
from standins import IdleView, RecordingRunner

TOKEN = "tok"


@pytest.fixture
def frontend(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Fleet, RecordingRunner, PodObs]]:
    fleet = Fleet("m", 2)
    runner = RecordingRunner()
    fleet.serving(IdleView(), runner)
    server = AdminServer("127.0.0.1", 0, TOKEN, fleet)
    server.start()
    monkeypatch.setattr(constants, "FRONTEND_ADMIN_PORT", server.port)
    try:
        yield fleet, runner, PodObs(name="a-frontend", uid="u", role="frontend", phase="Running", ip="127.0.0.1")
    finally:
        server.stop()


def test_start_observe_cancel(frontend: tuple[Fleet, RecordingRunner, PodObs],
                              caplog: pytest.LogCaptureFixture) -> None:
    fleet, runner, pod = frontend
    api = FrontendAPI()
    asyncio.run(api.start(pod, TOKEN, StartResize("r1", 3, 30.0, 60.0)))
    op = fleet.resize("r1")
    assert op is not None
    assert (op.to_replicas, op.drain_timeout_s, op.join_timeout_s) == (3, 30.0, 60.0)
    fleet.update_resize("r1", phase=ResizePhase.PREPARING, message="waiting")
    fleet.set_rank(2, RankState.JOINING, "engine initialising (INIT sent)")

    seen = asyncio.run(api.observe(pod, TOKEN, "r1"))

    assert seen.reachable
    assert seen.resize is not None
    assert (seen.resize.phase, seen.resize.message) == ("Preparing", "waiting")
    assert seen.resize.ranks == {2: ("Joining", "engine initialising (INIT sent)")}
    asyncio.run(api.cancel(pod, TOKEN, CancelResize("r1", "pod failed")))
    assert runner.cancels == [("r1", "pod failed")]
    with caplog.at_level(logging.INFO, logger="corefleet_operator.frontend_api"):
        asyncio.run(api.cancel(pod, TOKEN, CancelResize("never-started", "interrupted")))  # nothing runs: no warning
    assert runner.cancels == [("r1", "pod failed")]
    assert [(r.levelname, r.getMessage()) for r in caplog.records if "never-started" in r.getMessage()] == \
        [("INFO", "resize never-started: nothing to cancel, the frontend does not know it")]
    unknown = asyncio.run(api.observe(pod, TOKEN, "nope"))
    assert (unknown.reachable, unknown.resize, unknown.refused) == (True, None, "")


def test_a_replacement_names_its_ranks_and_is_refused_while_they_are_not_dead(
        frontend: tuple[Fleet, RecordingRunner, PodObs]) -> None:
    fleet, _, pod = frontend
    api = FrontendAPI()
    asyncio.run(api.start(pod, TOKEN, StartResize("early", 2, 30.0, 60.0, replace=(1,))))
    early = asyncio.run(api.observe(pod, TOKEN, "early"))
    assert early.resize is None
    assert "refused it (409)" in early.refused
    assert "rank 1 is Serving" in early.refused
    fleet.set_rank(1, RankState.DEAD, "connection lost")
    unknown = asyncio.run(api.observe(pod, TOKEN, "rep"))  # not started yet: the ranks' states come along
    assert unknown.resize is None
    assert unknown.fleet is not None
    assert {r: o.state for r, o in unknown.fleet.ranks.items()} == {0: "Serving", 1: "Dead"}

    asyncio.run(api.start(pod, TOKEN, StartResize("rep", 2, 30.0, 60.0, replace=(1,))))

    op = fleet.resize("rep")
    assert op is not None
    assert (op.replace, op.from_replicas, op.to_replicas, op.join_timeout_s) == ((1,), 2, 2, 60.0)
    seen = asyncio.run(api.observe(pod, TOKEN, "rep"))
    assert seen.resize is not None
    assert seen.resize.phase == "Pending"
    assert seen.resize.ranks == {1: ("Dead", "waiting for a new engine")}


def test_a_vacating_replacement_is_accepted_for_a_serving_rank_and_sent_as_such(
        frontend: tuple[Fleet, RecordingRunner, PodObs]) -> None:
    """A rank whose pod is being removed: the frontend takes it while it still serves (it drains it first)."""
    fleet, runner, pod = frontend
    api = FrontendAPI()
    asyncio.run(api.start(pod, TOKEN, StartResize("vac", 2, 30.0, 60.0, replace=(1,), vacate=True)))
    op = fleet.resize("vac")
    assert op is not None
    assert (op.replace, op.drain_timeout_s) == ((1,), 30.0)
    assert op.rank(1).state == RankState.DRAINING
    assert runner.runs == ["vac"]
    # The same id again is the same operation (the operator asks on every pass until it sees it).
    asyncio.run(api.start(pod, TOKEN, StartResize("vac", 2, 30.0, 60.0, replace=(1,), vacate=True)))
    assert runner.runs == ["vac"]


def test_a_vacating_replacement_of_a_rank_in_no_state_to_leave_is_refused() -> None:
    fleet = Fleet("m", 3)
    fleet.serving(IdleView(), RecordingRunner())
    fleet.set_rank(2, RankState.JOINING, "joining")
    with pytest.raises(ResizeRefused, match="only a Serving, Unresponsive or Dead rank can be vacated: rank 2 is "
                                            "Joining"):
        fleet.start_resize(ResizeRequest("v", 3, replace=(2,), vacate=True))


def test_vacate_travels_only_with_a_replacement() -> None:
    request = ResizeRequest("v", 2, replace=(1,), vacate=True)
    assert ResizeRequest.from_json(request.to_json()) == request
    assert "vacate" not in ResizeRequest("r", 2, replace=(1,)).to_json()  # as before, for an older frontend
    assert ResizeRequest("v", 2, vacate=True).validate() == "vacate needs the ranks it replaces (replace)"
    with pytest.raises(ValueError, match="vacate must be a boolean"):
        ResizeRequest.from_json({"id": "v", "replicas": 2, "replace": [1], "vacate": "yes"})


def test_a_refused_start_is_reported_by_the_next_observe(frontend: tuple[Fleet, RecordingRunner, PodObs]) -> None:
    _, _, pod = frontend
    api = FrontendAPI()
    asyncio.run(api.start(pod, TOKEN, StartResize("first", 3, 30.0, 60.0)))
    asyncio.run(api.start(pod, TOKEN, StartResize("second", 4, 30.0, 60.0)))  # one runs already: 409

    seen = asyncio.run(api.observe(pod, TOKEN, "second"))

    assert seen.reachable
    assert seen.resize is None
    assert "refused it (409)" in seen.refused
    assert "'first'" in seen.refused


def test_unreachable_or_unauthorized_is_not_reachable(frontend: tuple[Fleet, RecordingRunner, PodObs]) -> None:
    _, _, pod = frontend
    api = FrontendAPI(timeout=2)
    wrong = asyncio.run(api.observe(pod, "wrong-token", "r1"))
    assert not wrong.reachable
    assert "401" in wrong.error
    assert not asyncio.run(api.observe(None, TOKEN, "r1")).reachable
    with mock.patch.object(constants, "FRONTEND_ADMIN_PORT", 1):
        down = asyncio.run(api.observe(pod, TOKEN, "r1"))
    assert not down.reachable
    assert "admin API at http://127.0.0.1:1" in down.error


def test_ipv6_addresses_are_bracketed() -> None:
    pod = PodObs(name="f", uid="u", role="frontend", ip="fd00::5")
    assert frontend_api.admin_url(pod) == f"http://[fd00::5]:{constants.FRONTEND_ADMIN_PORT}"


def test_fleet_reads_each_ranks_state(frontend: tuple[Fleet, RecordingRunner, PodObs]) -> None:
    fleet, _, pod = frontend
    fleet.set_rank(1, RankState.DEAD, "no heartbeat for 30s")

    seen = asyncio.run(FrontendAPI().fleet(pod, TOKEN))

    assert seen.reachable
    assert {r: (o.state, o.message) for r, o in seen.ranks.items()} == {
        0: ("Serving", ""), 1: ("Dead", "no heartbeat for 30s")}


def test_fleet_unreachable_or_unauthorized_is_not_reachable(frontend: tuple[Fleet, RecordingRunner, PodObs]) -> None:
    _, _, pod = frontend
    wrong = asyncio.run(FrontendAPI(timeout=2).fleet(pod, "wrong-token"))
    assert not wrong.reachable
    assert "401" in wrong.error
    assert not asyncio.run(FrontendAPI().fleet(None, TOKEN)).reachable
    with mock.patch.object(constants, "FRONTEND_ADMIN_PORT", 1):
        down = asyncio.run(FrontendAPI(timeout=2).fleet(pod, TOKEN))
    assert not down.reachable
    assert "admin API at http://127.0.0.1:1" in down.error


def test_fleet_obs_keeps_unknown_states_and_reads_since_times() -> None:
    seen = fleet_obs({"state": "Degraded", "ranks": [
        {"rank": 0, "state": "Serving"},
        {"rank": 1, "state": "Unresponsive", "since": 1764650000.5, "message": "no answer for 61s"},
        {"rank": 2, "state": "Unresponsive", "since": "2025-12-02T04:33:20Z"},
        {"rank": 3, "state": "SomethingNew"},
        {"state": "Serving"},  # no rank number: skipped
    ]})

    assert seen.reachable
    assert seen.ranks[0] == RankObs(0, "Serving")
    assert seen.ranks[1] == RankObs(1, "Unresponsive", since=1764650000.5, message="no answer for 61s")
    assert seen.ranks[2].since == 1764650000.0
    assert seen.ranks[3].state == "SomethingNew"
    assert sorted(seen.ranks) == [0, 1, 2, 3]


@pytest.mark.parametrize("phase", list(ResizePhase))
def test_fleet_obs_reads_the_committed_size_and_the_resize_the_frontend_runs(phase: ResizePhase) -> None:
    # The frontend's own JSON (the admin contract's types): a status lost while it runs a resize is made good from it
    # (`planner.resize.frontends_resize`).
    operation = ResizeOperation(id="4to2-g1-x", from_replicas=4, to_replicas=2, phase=phase,
                                ranks=(ResizeRank(2, RankState.DRAINING), ResizeRank(3, RankState.DRAINING)),
                                message="draining")
    body = FleetStatus(state=FleetState.SERVING, model="m", data_parallel_size=4, vllm_version="0.32.0",
                       resize=operation).to_json()

    seen = fleet_obs(body)

    assert seen.size == 4
    if phase in (ResizePhase.COMPLETED, ResizePhase.FAILED):  # the last one, ended: nothing runs
        assert seen.resize is None
        return
    assert seen.resize is not None
    assert (seen.resize.from_replicas, seen.resize.to_replicas, seen.resize.replace) == (4, 2, ())
    assert (seen.resize.account.id, seen.resize.account.phase) == ("4to2-g1-x", str(phase))
    assert seen.resize.account.ranks == {2: ("Draining", ""), 3: ("Draining", "")}


def test_fleet_obs_without_a_size_or_a_readable_resize_reads_neither() -> None:
    seen = fleet_obs({"ranks": [], "data_parallel_size": True, "resize": {"id": "x", "phase": "Draining"}})

    assert (seen.size, seen.resize) == (None, None)
