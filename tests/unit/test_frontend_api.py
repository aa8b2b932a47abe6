# SPDX-License-Identifier: Apache-2.0
"""The operator's admin API calls (corefleet_operator.frontend_api) against a real admin server and fleet registry."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from unittest import mock

import pytest

from corefleet_client.admin import RankState, ResizePhase
from corefleet_client.frontend.adminserver import AdminServer
from corefleet_client.frontend.fleet import Fleet
from corefleet_operator import constants, frontend_api
from corefleet_operator.frontend_api import FrontendAPI
from corefleet_operator.observe import PodObs
from corefleet_operator.planner import CancelResize, StartResize

TOKEN = "tok"


class Runner:
    def __init__(self) -> None:
        self.cancels: list[tuple[str, str]] = []

    def run_resize(self, resize_id: str) -> None:
        pass

    def cancel_resize(self, resize_id: str, reason: str) -> None:
        self.cancels.append((resize_id, reason))


class View:
    def lb_counts(self, rank: int) -> tuple[int, int, float]:
        return 0, 0, 0.0

    def in_flight(self, rank: int) -> int:
        return 0


@pytest.fixture
def frontend(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Fleet, Runner, PodObs]]:
    fleet = Fleet("m", 2)
    runner = Runner()
    fleet.serving(View(), runner)
    server = AdminServer("127.0.0.1", 0, TOKEN, fleet)
    server.start()
    monkeypatch.setattr(constants, "FRONTEND_ADMIN_PORT", server.port)
    try:
        yield fleet, runner, PodObs(name="a-frontend", uid="u", role="frontend", phase="Running", ip="127.0.0.1")
    finally:
        server.stop()


def test_start_observe_cancel(frontend: tuple[Fleet, Runner, PodObs]) -> None:
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
    unknown = asyncio.run(api.observe(pod, TOKEN, "nope"))
    assert (unknown.reachable, unknown.resize, unknown.refused) == (True, None, "")


def test_a_refused_start_is_reported_by_the_next_observe(frontend: tuple[Fleet, Runner, PodObs]) -> None:
    _, _, pod = frontend
    api = FrontendAPI()
    asyncio.run(api.start(pod, TOKEN, StartResize("first", 3, 30.0, 60.0)))
    asyncio.run(api.start(pod, TOKEN, StartResize("second", 4, 30.0, 60.0)))  # one runs already: 409

    seen = asyncio.run(api.observe(pod, TOKEN, "second"))

    assert seen.reachable
    assert seen.resize is None
    assert "refused it (409)" in seen.refused
    assert "'first'" in seen.refused


def test_unreachable_or_unauthorized_is_not_reachable(frontend: tuple[Fleet, Runner, PodObs]) -> None:
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
