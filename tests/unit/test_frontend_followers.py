# SPDX-License-Identifier: Apache-2.0
"""Several frontends (docs/design/k-frontends.md, step 3): frontend 0 drives every frontend through each resize.

Shown without an engine, over real admin APIs on 127.0.0.1: who takes which request (frontend 0 resizes and
replaces ranks, the others only their part of one), a follower's part committed only
once Prepared, and frontend 0's side (`Followers`): each part sent, waited for and committed; a follower that does
not answer is told apart from one that refused or failed (a scale-down passes over the first and stops for the
second). A follower's part of a replacement: tests/unit/test_rank_replacement.py. The whole protocol over real vLLM
engines: tests/e2e/test_frontends_local.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http import HTTPStatus

import pytest

from corefleet_client.admin import (
    AdminClient,
    AdminError,
    RankState,
    ResizeOperation,
    ResizePhase,
    ResizeRequest,
)
from corefleet_client.frontend import followers as followers_module
from corefleet_client.frontend.adminserver import AdminServer
from corefleet_client.frontend.fleet import Fleet
from corefleet_client.frontend.followers import FollowerResize, Followers
from corefleet_client.frontend.resize import DenseResize
from corefleet_client.frontend.types import Cancels, FollowerLost, ResizeFailed, ResizeRefused
from corefleet_harness.support import free_port
from standins import IdleView, RecordingRunner

TOKEN = "t0ken"


@dataclass
class Scripted:
    """A follower's event-loop side, scripted: its part goes to Prepared at once (or fails, `fail`), and completes on
    frontend 0's commit."""

    fleet: Fleet
    fail: str = ""
    commits: list[str] = field(default_factory=list)
    orphaned: list[str] = field(default_factory=list)
    ends_when_orphaned: bool = True

    def run_resize(self, resize_id: str) -> None:
        if self.fail:
            self.fleet.finish_resize(resize_id, error=self.fail)
        else:
            self.fleet.update_resize(resize_id, phase=ResizePhase.PREPARED, message="waiting for frontend 0's commit")

    def cancel_resize(self, resize_id: str, reason: str) -> None:
        self.fleet.finish_resize(resize_id, error=f"cancelled: {reason}")

    def commit_resize(self, resize_id: str) -> None:
        self.commits.append(resize_id)
        self.fleet.update_resize(resize_id, phase=ResizePhase.COMMITTING)
        self.fleet.finish_resize(resize_id)

    def orphan_resize(self, resize_id: str, reason: str) -> None:  # as a scale-up's part decides
        self.orphaned.append(resize_id)
        if self.ends_when_orphaned:
            self.fleet.finish_resize(resize_id, error=f"orphaned: {reason}")


@dataclass
class Frontend:
    fleet: Fleet
    runner: Scripted
    server: AdminServer
    admin: AdminClient


@pytest.fixture
def frontends() -> Iterator[list[Frontend]]:
    """Frontend 0 and two followers of a 2-rank fleet, each with its admin API."""
    made = []
    try:
        for index in range(3):
            fleet = Fleet("tiny", 2, frontends=3, client_index=index)
            server = AdminServer("127.0.0.1", 0, TOKEN, fleet)
            server.start()
            runner = Scripted(fleet)
            fleet.serving(IdleView(), runner)
            made.append(Frontend(fleet, runner, server, AdminClient(f"http://127.0.0.1:{server.port}", TOKEN)))
        yield made
    finally:
        for f in made:
            f.server.stop()


def lead_side(frontends: list[Frontend], *, unreachable: tuple[int, ...] = ()) -> Followers:
    """Frontend 0's `Followers` over these frontends' admin APIs (an unreachable one: a port nothing listens on)."""
    admins = {i: AdminClient(f"http://127.0.0.1:{free_port() if i in unreachable else f.server.port}", TOKEN,
                             timeout=1) for i, f in enumerate(frontends) if i > 0}
    return Followers(admins)


def operation(frm: int = 2, to: int = 3, resize_id: str = "up-1") -> ResizeOperation:
    return ResizeOperation(id=resize_id, from_replicas=frm, to_replicas=to, phase=ResizePhase.PREPARING,
                           drain_timeout_s=5, join_timeout_s=60)


# ---- who takes which request -----------------------------------------------------------------------------------
def test_frontend_0_takes_resizes_and_the_others_only_their_part_of_one(frontends: list[Frontend]) -> None:
    lead, follower = frontends[0].admin, frontends[1].admin
    with pytest.raises(AdminError) as err:
        follower.start_resize(ResizeRequest(id="up-1", replicas=3))
    assert err.value.status == HTTPStatus.CONFLICT
    assert "resizes go to frontend 0" in err.value.body
    with pytest.raises(AdminError) as err:
        lead.start_resize(ResizeRequest(id="up-1", replicas=3, follower=True))
    assert err.value.status == HTTPStatus.BAD_REQUEST
    started, part = follower.start_resize(ResizeRequest(id="up-1", replicas=3, follower=True))
    assert started
    assert part.follower
    assert (follower.resize("up-1") or part).phase == ResizePhase.PREPARED
    started, op = lead.start_resize(ResizeRequest(id="up-1", replicas=3))
    assert started
    assert not op.follower


def test_with_several_frontends_frontend_0_replaces_ranks_but_an_moe_fleet_does_not_resize() -> None:
    fleet = Fleet("tiny", 2, frontends=2)
    runner = RecordingRunner()
    fleet.serving(IdleView(), runner)
    fleet.set_rank(1, RankState.DEAD, "connection to the engine lost")
    started, op = fleet.start_resize(ResizeRequest(id="rep-1", replicas=2, replace=(1,)))
    assert started
    assert (op.replace, op.follower) == ((1,), False)
    fleet.finish_resize("rep-1")
    fleet.moe = True
    with pytest.raises(ResizeRefused) as refused:
        fleet.start_resize(ResizeRequest(id="up-1", replicas=3))
    assert refused.value.status == HTTPStatus.NOT_IMPLEMENTED
    assert "elastic EP tells only its first client" in refused.value.message


def test_a_follower_request_round_trips_and_a_followers_part_of_a_replacement_is_no_vacate() -> None:
    request = ResizeRequest(id="up-1", replicas=3, follower=True)
    assert ResizeRequest.from_json(request.to_json()) == request
    part = ResizeRequest(id="r", replicas=2, replace=(1,), follower=True)
    assert part.validate() is None
    assert ResizeRequest.from_json(part.to_json()) == part
    assert "follower" not in ResizeRequest(id="up-1", replicas=3).to_json()  # as before, for older frontends
    assert "vacate is frontend 0's" in str(ResizeRequest(id="r", replicas=2, replace=(1,), vacate=True,
                                                         follower=True).validate())
    with pytest.raises(ValueError, match="follower must be a boolean"):
        ResizeRequest.from_json({"id": "up-1", "replicas": 3, "follower": "yes"})


def test_a_followers_part_commits_only_once_prepared_and_only_once(frontends: list[Frontend]) -> None:
    f = frontends[1]
    with pytest.raises(AdminError) as err:
        f.admin.commit_resize("nope")
    assert err.value.status == HTTPStatus.NOT_FOUND
    f.runner.run_resize = lambda resize_id: None  # type: ignore[method-assign]  # stays Pending
    f.admin.start_resize(ResizeRequest(id="up-1", replicas=3, follower=True))
    with pytest.raises(AdminError) as err:
        f.admin.commit_resize("up-1")
    assert err.value.status == HTTPStatus.CONFLICT
    assert "Pending, not Prepared" in err.value.body
    f.fleet.update_resize("up-1", phase=ResizePhase.PREPARED)
    assert f.admin.commit_resize("up-1").phase == ResizePhase.PREPARED  # as it was: the commit runs on the loop
    assert f.admin.commit_resize("up-1").phase == ResizePhase.COMPLETED  # frontend 0 retrying: nothing again
    assert f.runner.commits == ["up-1"]
    lead = frontends[0]
    lead.runner.run_resize = lambda resize_id: None  # type: ignore[method-assign]
    lead.admin.start_resize(ResizeRequest(id="up-2", replicas=3))
    with pytest.raises(AdminError) as err:
        lead.admin.commit_resize("up-2")
    assert err.value.status == HTTPStatus.BAD_REQUEST


# ---- frontend 0's side ----------------------------------------------------------------------------------------
def test_frontend_0_sends_each_follower_its_part_waits_until_prepared_and_commits_it(
        frontends: list[Frontend]) -> None:
    followers = lead_side(frontends)
    op = operation()

    async def drive() -> tuple[dict[int, FollowerLost], dict[int, FollowerLost]]:
        started = await followers.start(op, (ResizePhase.PREPARED,), 1e12, Cancels())
        committed = await followers.commit(op, [1, 2], "at 3 ranks")
        return started, committed

    assert asyncio.run(drive()) == ({}, {})
    for f in frontends[1:]:
        part = f.fleet.resize("up-1")
        assert part is not None
        assert part.follower
        assert part.phase == ResizePhase.COMPLETED
        assert f.runner.commits == ["up-1"]


def test_a_follower_that_does_not_answer_is_lost_unreachable_and_one_that_fails_is_lost_reachable(
        frontends: list[Frontend], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(followers_module, "UNREACHABLE_S", 0.5)
    frontends[2].runner.fail = "no ready response from rank 2 within 30s of its READY"
    followers = lead_side(frontends, unreachable=(1,))
    lost = asyncio.run(followers.start(operation(), (ResizePhase.PREPARED,), 1e12, Cancels()))
    assert sorted(lost) == [1, 2]
    assert not lost[1].reachable
    assert "did not answer for 0.5s" in str(lost[1])
    assert lost[2].reachable
    assert "no ready response from rank 2" in str(lost[2])


def test_a_cancel_of_frontend_0s_resize_stops_waiting_for_the_followers(frontends: list[Frontend]) -> None:
    for f in frontends[1:]:
        f.runner.run_resize = lambda resize_id: None  # type: ignore[method-assign]  # never Prepared
    followers, cancels, op = lead_side(frontends), Cancels(), operation()
    stop = threading.Timer(0.3, cancels.request, args=(op.id, "the operator cancelled it"))
    stop.start()
    with pytest.raises(ResizeFailed, match="cancelled: the operator cancelled it"):
        asyncio.run(followers.start(op, (ResizePhase.PREPARED,), 1e12, cancels))
    asyncio.run(followers.cancel(op, "resize up-1 stopped on frontend 0"))
    for f in frontends[1:]:
        part = f.fleet.resize("up-1")
        assert part is not None
        assert part.phase == ResizePhase.FAILED
        assert "stopped on frontend 0" in part.error


def test_a_scale_down_passes_over_an_unreachable_follower_and_stops_for_one_that_refused() -> None:
    op = operation(3, 2, "down-1")
    DenseResize._pass_over(op, {1: FollowerLost("gone", reachable=False)})  # its replacement attaches at 2
    with pytest.raises(ResizeFailed, match="not every frontend stopped routing to the leaving ranks: busy"):
        DenseResize._pass_over(op, {1: FollowerLost("gone", reachable=False), 2: FollowerLost("busy")})


def test_followers_are_every_frontend_but_the_first_on_the_shared_admin_port() -> None:
    assert Followers.of(["f-0.fleet"], 8081, TOKEN) is None
    several = Followers.of(["f-0.fleet", "f-1.fleet", "fd00::2"], 8081, TOKEN)
    assert several is not None
    assert {i: a.base_url for i, a in several.admins.items()} == {1: "http://f-1.fleet:8081",
                                                                   2: "http://[fd00::2]:8081"}


# ---- a follower's part, on its own event loop ---------------------------------------------------------------
@dataclass
class Members:
    """What `FollowerResize` uses of the client's membership, recorded: ready responses read at once, no request in
    flight."""

    fleet: Fleet
    calls: list[str] = field(default_factory=list)
    unroutable: dict[int, str] = field(default_factory=dict)
    lost: dict[int, str] = field(default_factory=dict)
    silent: bool = False  # the new engines never announce themselves (frontend 0 was lost before their handshake)

    @property
    def joiner(self) -> Members:
        return self

    async def read_ready_responses(self, ranks: list[int], wait_s: float = 30.0) -> None:
        if self.silent:
            await asyncio.sleep(wait_s)
            raise ResizeFailed(f"no ready response from {ranks} within {wait_s:g}s")
        self.calls.append(f"ready {ranks}")

    async def add_ranks(self, new: list[int], size: int) -> None:
        self.calls.append(f"add {new} at {size}")

    def stop_routing(self, rank: int, why: str) -> None:
        self.unroutable[rank] = why
        self.calls.append(f"stop routing {rank}")

    def requests_on(self, rank: int) -> list[str]:
        return []

    def in_flight(self, rank: int) -> int:
        return 0

    def cut_routing(self, size: int) -> list[int]:
        self.calls.append(f"cut at {size}")
        return list(range(size))

    async def shrink(self, frm: int, to: int, marker: list[int]) -> None:
        self.calls.append(f"shrink {frm} -> {to}")

    def retire(self, rank: int) -> str | None:
        self.unroutable.pop(rank, None)
        return None


def follower_part(frm: int, to: int, commit_after: float | None, engines_go_after: float | None = None,
                  orphan_after: float | None = None, silent: bool = False) -> tuple[Fleet, Members, ResizeOperation]:
    """Frontend 1's part of a resize frm -> to, run on an event loop; frontend 0 commits it after `commit_after`
    seconds (None: never); the leaving ranks' engines go after `engines_go_after` seconds (None: they stay); a
    restarted frontend 0 orphans it after `orphan_after` seconds (None: none does); `silent`: no new engine announces
    itself."""
    fleet = Fleet("tiny", frm, frontends=2, client_index=1)
    runner = RecordingRunner()
    fleet.serving(IdleView(), runner)
    for rank in range(frm):
        fleet.set_rank(rank, RankState.SERVING)
    _, op = fleet.start_resize(ResizeRequest(id="r", replicas=to, drain_timeout_s=1, follower=True))
    members = Members(fleet, silent=silent)
    part = FollowerResize(members, Cancels(), None)  # type: ignore[arg-type]  # the stand-ins have what it uses

    async def run() -> None:
        async def lead() -> None:
            if commit_after is None:
                return
            await asyncio.sleep(commit_after)
            part.commit(op.id)

        async def engines_go() -> None:
            if engines_go_after is None:
                return
            await asyncio.sleep(engines_go_after)
            for rank in range(to, frm):  # as `Liveness.rank_died` records a draining rank's death
                members.lost[rank] = "connection to the engine lost"

        async def new_lead() -> None:
            if orphan_after is None:
                return
            await asyncio.sleep(orphan_after)
            part.orphan(op.id, "frontend 0 was restarted")

        try:
            await asyncio.gather(part.scale_up(op) if to > frm else part.scale_down(op), lead(), engines_go(),
                                 new_lead())
        except ResizeFailed as e:  # recorded as `operations.ResizeOperations` records it
            fleet.finish_resize(op.id, error=str(e), fleet_intact=e.fleet_intact)

    asyncio.run(run())
    done = fleet.resize(op.id)
    assert done is not None
    return fleet, members, done


@pytest.fixture
def short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(followers_module, "COMMIT_GRACE_S", 0.3)


@pytest.mark.usefixtures("short_grace")
def test_a_followers_scale_up_adds_the_new_ranks_only_at_frontend_0s_commit() -> None:
    fleet, members, op = follower_part(2, 3, commit_after=0.05)
    assert members.calls == ["ready [2]", "add [2] at 3"]
    assert (op.phase, fleet.size) == (ResizePhase.COMPLETED, 3)


@pytest.mark.usefixtures("short_grace")
def test_a_followers_scale_up_without_frontend_0s_commit_adds_nothing_and_fails() -> None:
    """Frontend 0 lost (or hung) after this frontend read the new ranks' ready responses: the scale-up is dropped, as
    the operator rolls back a scale-up whose frontend 0 is lost; nothing was routed to the new rank."""
    fleet, members, op = follower_part(2, 3, commit_after=None)
    assert members.calls == ["ready [2]"]
    assert op.phase == ResizePhase.FAILED
    assert "frontend 0 did not commit within 0.3s" in op.error
    assert fleet.size == 2


@pytest.mark.usefixtures("short_grace")
def test_a_followers_scale_down_stops_routing_at_once_and_without_frontend_0s_commit_finishes_by_itself() -> None:
    """The leaving rank gets no request from this frontend as soon as its part starts; frontend 0 lost after the
    drain: the scale-down is finished (as the operator finishes one whose frontend 0 is lost), after the drain
    timeout and the grace."""
    fleet, members, op = follower_part(3, 2, commit_after=None)
    assert members.calls == ["stop routing 2", "cut at 2", "shrink 3 -> 2"]
    assert (op.phase, fleet.size) == (ResizePhase.COMPLETED, 2)
    assert not members.unroutable


def test_a_followers_scale_down_passed_over_by_frontend_0_commits_once_the_leaving_engines_went(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Frontend 0 could not reach this frontend (it was passed over), committed and had the leaving rank's pod
    deleted: the rank's engine going is the commit this frontend did not get, so its part commits then, not after
    the grace (a minute in which it still listed the rank)."""
    monkeypatch.setattr(followers_module, "COMMIT_GRACE_S", 30.0)
    started = time.monotonic()
    fleet, members, op = follower_part(3, 2, commit_after=None, engines_go_after=0.2)
    assert time.monotonic() - started < 5.0
    assert members.calls == ["stop routing 2", "cut at 2", "shrink 3 -> 2"]
    assert (op.phase, fleet.size) == (ResizePhase.COMPLETED, 2)
    assert 2 not in [r.rank for r in fleet.snapshot().ranks]


def test_a_followers_part_orphaned_by_a_restarted_frontend_0_decides_at_once_as_at_the_end_of_its_grace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Frontend 0 lost mid-resize and back (a new process, which never drove this part): it orphans the part, which
    decides at once what it would decide after the grace (a minute in which it refused the new frontend 0's parts):
    a scale-up drops the new rank, a scale-down commits."""
    monkeypatch.setattr(followers_module, "COMMIT_GRACE_S", 30.0)
    started = time.monotonic()
    fleet, members, op = follower_part(2, 3, commit_after=None, orphan_after=0.1)
    assert members.calls == ["ready [2]"]
    assert op.phase == ResizePhase.FAILED
    assert "frontend 0 that drove it is gone (frontend 0 was restarted) of this frontend's Prepared" in op.error
    assert fleet.size == 2
    fleet, members, op = follower_part(3, 2, commit_after=None, orphan_after=0.1)
    assert members.calls == ["stop routing 2", "cut at 2", "shrink 3 -> 2"]
    assert (op.phase, fleet.size) == (ResizePhase.COMPLETED, 2)
    assert time.monotonic() - started < 10.0  # not the 30 s grace (the scale-down's 1 s drain timeout, twice)


def test_only_a_followers_part_can_be_orphaned_and_an_ended_one_stays_as_it_ended(frontends: list[Frontend]) -> None:
    f = frontends[1]
    with pytest.raises(AdminError) as err:
        f.admin.orphan_resize("nope", "frontend 0 was restarted")
    assert err.value.status == HTTPStatus.NOT_FOUND
    f.admin.start_resize(ResizeRequest(id="up-1", replicas=3, follower=True))
    with pytest.raises(AdminError) as err:
        f.admin.orphan_resize("up-1", "")
    assert err.value.status == HTTPStatus.BAD_REQUEST
    orphaned = f.admin.orphan_resize("up-1", "frontend 0 was restarted")
    assert orphaned.phase == ResizePhase.PREPARED  # it decides on the event loop
    ended = f.admin.resize("up-1")
    assert ended is not None
    assert (ended.phase, ended.error) == (ResizePhase.FAILED, "orphaned: frontend 0 was restarted")
    assert f.admin.orphan_resize("up-1", "again").error == "orphaned: frontend 0 was restarted"
    assert f.runner.orphaned == ["up-1"]
    lead = frontends[0]
    lead.runner.run_resize = lambda resize_id: None  # type: ignore[method-assign]
    lead.admin.start_resize(ResizeRequest(id="up-2", replicas=3))
    with pytest.raises(AdminError) as err:
        lead.admin.orphan_resize("up-2", "frontend 0 was restarted")
    assert err.value.status == HTTPStatus.BAD_REQUEST
    assert "this frontend drives it" in err.value.body


def test_a_restarted_frontend_0_orphans_the_part_its_predecessor_left_on_a_follower_then_sends_its_own(
        frontends: list[Frontend]) -> None:
    """Frontend 1 is Prepared in resize up-0, which the lost frontend 0 drove; the new frontend 0's resize up-1 is
    refused by it (one runs at a time) until the new frontend 0 orphaned up-0 and it ended."""
    frontends[1].admin.start_resize(ResizeRequest(id="up-0", replicas=3, follower=True))  # left by the predecessor
    followers, op = lead_side(frontends), operation(resize_id="up-1")

    async def drive() -> tuple[dict[int, FollowerLost], dict[int, FollowerLost]]:
        started = await followers.start(op, (ResizePhase.PREPARED,), 1e12, Cancels())
        committed = await followers.commit(op, [1, 2], "at 3 ranks")
        return started, committed

    assert asyncio.run(drive()) == ({}, {})
    assert frontends[1].runner.orphaned == ["up-0"]
    assert frontends[2].runner.orphaned == []
    for f in frontends[1:]:
        assert f.runner.commits == ["up-1"]
    old = frontends[1].fleet.resize("up-0")
    assert old is not None
    assert old.phase == ResizePhase.FAILED


def test_a_part_this_frontend_0_sent_is_not_orphaned_and_one_that_does_not_end_loses_the_follower(
        frontends: list[Frontend], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(followers_module, "UNREACHABLE_S", 0.5)
    followers = lead_side(frontends)
    frontends[1].runner.run_resize = lambda resize_id: None  # type: ignore[method-assign]  # never Prepared
    asyncio.run(followers._part(1, operation(resize_id="up-0")))  # this frontend 0's own, still running
    lost = asyncio.run(followers.start(operation(resize_id="up-1"), (ResizePhase.PREPARED,), 1e12, Cancels()))
    assert sorted(lost) == [1]  # frontend 2 is Prepared in up-1
    assert "refused its part" in str(lost[1])
    assert "up-0" in str(lost[1])
    assert frontends[1].runner.orphaned == []
    frontends[2].admin.cancel_resize("up-1", "test")
    frontends[2].admin.start_resize(ResizeRequest(id="up-2", replicas=3, follower=True))  # a predecessor's
    frontends[2].runner.ends_when_orphaned = False
    lost = asyncio.run(followers.start(operation(resize_id="up-3"), (ResizePhase.PREPARED,), 1e12, Cancels()))
    assert "which an earlier frontend 0 drove, is still Prepared" in str(lost[2])
    assert frontends[2].runner.orphaned == ["up-2"]


def test_a_followers_part_orphaned_while_it_waits_for_the_new_engines_ends_at_once() -> None:
    """Frontend 0 lost before the new engines' handshake (the operator deletes the engines it started for it), and
    back: the part it orphans is still waiting for their ready responses, which never come; it ends at once, failed
    (the new rank not added), instead of waiting out the ready timeout while refusing the new frontend 0's parts."""
    started = time.monotonic()
    fleet, members, op = follower_part(2, 3, commit_after=None, orphan_after=0.1, silent=True)
    assert time.monotonic() - started < 5.0  # not the 30 s ready timeout
    assert members.calls == []
    assert op.phase == ResizePhase.FAILED
    assert "frontend 0 that drove it is gone (frontend 0 was restarted) before the new engine(s) of rank 2 " \
           "announced themselves here" in op.error
    assert fleet.size == 2
