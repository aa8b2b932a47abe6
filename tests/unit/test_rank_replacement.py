# SPDX-License-Identifier: Apache-2.0
"""Replacing a Dead rank in place: the request, the registry's checks and the client's bookkeeping.

1. `ResizeRequest.replace` on the wire (validation, JSON both ways, a plain resize unchanged).
2. `Fleet.start_resize` for a replacement, behind a real AdminServer: only Dead ranks, same size,
   dense fleets, one operation at a time, idempotent by id.
3. `Replacement.replace`, run through the client's own dispatch (`ResizeOperations.run`) over a real
   `Membership` of a stand-in for vLLM's client, the handshake and ready responses played by the
   test: what the commit changes (routing counters, unroutable, Serving, the KV block total, the
   lost engine's probe) and what a failure leaves (the rank Dead and unroutable, the operation
   Failed, the fleet intact). The handshake itself runs against real engine processes in
   tests/e2e/test_frontend_replace.py.
4. Several frontends: frontend 0's replacement sends each follower its part (over real admin APIs) and commits
   them after its own; a follower's part (`FollowerResize.replace`) drains what it still routes to the rank, waits
   for the engine to go, reads the new engine's ready response and serves the rank again at frontend 0's commit,
   or by itself once frontend 0 stayed silent past the grace.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest

from corefleet_client.admin import (
    RELEASE_UTILITY,
    AdminClient,
    AdminError,
    FleetState,
    RankState,
    ResizeOperation,
    ResizePhase,
    ResizeRequest,
)
from corefleet_client.frontend import followers as followers_module
from corefleet_client.frontend.adminserver import AdminServer
from corefleet_client.frontend.elastic import ElasticResize
from corefleet_client.frontend.fleet import Fleet, identity
from corefleet_client.frontend.followers import Followers
from corefleet_client.frontend.membership import Membership
from corefleet_client.frontend.operations import ResizeOperations
from corefleet_client.frontend.replace import Replacement
from corefleet_client.frontend.resize import DenseResize
from corefleet_client.frontend.types import Cancels, FleetOptions, FollowerLost, ResizeFailed, ResizeRefused
from corefleet_harness.support import free_port
from standins import IdleView

TOKEN = "t0ken"


# ---- 1. the request -------------------------------------------------------------------------------
def test_a_replacement_request_round_trips_and_a_plain_one_reads_as_before() -> None:
    req = ResizeRequest(id="rep-1", replicas=3, join_timeout_s=60, replace=(2, 0))
    assert req.validate() is None
    data = json.loads(json.dumps(req.to_json()))
    assert data["replace"] == [2, 0]
    assert ResizeRequest.from_json(data) == req
    plain = ResizeRequest(id="up-1", replicas=3).to_json()
    assert "replace" not in plain  # a frontend that predates replacements refuses unknown fields
    assert ResizeRequest.from_json(plain).replace == ()


@pytest.mark.parametrize(("replace", "message"), [
    ((3,), "outside the fleet's ranks 0..2"),
    ((-1,), "outside the fleet's ranks 0..2"),
    ((1, 1), "names a rank twice"),
])
def test_replacement_requests_are_validated(replace: tuple[int, ...], message: str) -> None:
    problem = ResizeRequest(id="rep-1", replicas=3, replace=replace).validate()
    assert problem is not None
    assert message in problem


@pytest.mark.parametrize("value", [1, "1", [True], ["0"], [0.5]])
def test_replace_must_be_a_list_of_ranks(value: Any) -> None:
    with pytest.raises(ValueError, match="replace must be a list of rank numbers"):
        ResizeRequest.from_json({"id": "rep-1", "replicas": 2, "replace": value})


def test_a_replacement_operation_round_trips_through_json() -> None:
    op = ResizeOperation(id="rep-1", from_replicas=2, to_replicas=2, phase=ResizePhase.PENDING, replace=(1,))
    assert ResizeOperation.from_json(json.loads(json.dumps(op.to_json()))) == op
    assert not op.scale_up
    legacy = op.to_json()
    del legacy["replace"]  # an operation from a frontend that predates replacements
    assert ResizeOperation.from_json(legacy).replace == ()


# ---- 2. the registry ------------------------------------------------------------------------------
@dataclass
class Runner:
    runs: list[str] = field(default_factory=list)

    def run_resize(self, resize_id: str) -> None:
        self.runs.append(resize_id)

    def cancel_resize(self, resize_id: str, reason: str) -> None:
        pass

    def commit_resize(self, resize_id: str) -> None:
        raise AssertionError("a replacement is not a follower's part")

    def orphan_resize(self, resize_id: str, reason: str) -> None:
        raise AssertionError("a replacement is not a follower's part")


@dataclass
class Setup:
    fleet: Fleet
    runner: Runner
    client: AdminClient
    url: str

    def post(self, body: Any) -> tuple[int, dict[str, Any]]:
        req = urllib.request.Request(self.url + "/v1/resizes", data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def refused(self, request: ResizeRequest) -> AdminError:
        with pytest.raises(AdminError) as err:
            self.client.start_resize(request)
        return err.value


@pytest.fixture
def setup() -> Iterator[Setup]:
    fleet = Fleet("tiny", 3, vllm_version="0.32.0")
    server = AdminServer("127.0.0.1", 0, TOKEN, fleet)
    server.start()
    url = f"http://127.0.0.1:{server.port}"
    try:
        s = Setup(fleet, Runner(), AdminClient(url, TOKEN), url)
        fleet.serving(IdleView(), s.runner)
        yield s
    finally:
        server.stop()


def test_a_dead_rank_is_replaced_once_by_id(setup: Setup) -> None:
    setup.fleet.set_rank(1, RankState.DEAD, "connection to the engine lost")
    started, op = setup.client.start_resize(ResizeRequest(id="rep-1", replicas=3, join_timeout_s=60, replace=(1,)))
    assert started
    assert (op.from_replicas, op.to_replicas, op.phase, op.replace) == (3, 3, ResizePhase.PENDING, (1,))
    assert [(r.rank, r.state) for r in op.ranks] == [(1, RankState.DEAD)]
    assert setup.runner.runs == ["rep-1"]
    # The same request again (an operator that restarted): the same operation, not a second one.
    again, same = setup.client.start_resize(ResizeRequest(id="rep-1", replicas=3, replace=(1,)))
    assert (again, same.id, setup.runner.runs) == (False, "rep-1", ["rep-1"])
    # The same id for another replacement, or for a plain resize: a conflict.
    assert setup.refused(ResizeRequest(id="rep-1", replicas=3, replace=(2,))).status == 409
    assert setup.refused(ResizeRequest(id="rep-1", replicas=3)).status == 409
    # One operation at a time: a resize waits for the replacement.
    err = setup.refused(ResizeRequest(id="up-1", replicas=4))
    assert err.status == 409
    assert "one resize runs at a time" in err.body
    # The fleet's view follows the replaced rank until the event loop commits it.
    setup.fleet.set_rank(1, RankState.SERVING)
    setup.fleet.finish_resize("rep-1", message="rank 1 replaced in place")
    status = setup.client.fleet()
    assert status.state == FleetState.SERVING
    assert status.resize is not None
    assert (status.resize.id, status.resize.phase, status.resize.rank(1).state) == (
        "rep-1", ResizePhase.COMPLETED, RankState.SERVING)


def test_only_dead_ranks_are_replaced(setup: Setup) -> None:
    setup.fleet.set_rank(2, RankState.UNRESPONSIVE, "no answer to a liveness call")
    setup.fleet.set_rank(0, RankState.DEAD, "connection to the engine lost")
    err = setup.refused(ResizeRequest(id="rep-1", replicas=3, replace=(0, 1, 2)))
    assert err.status == 409
    assert "only a Dead or Idle rank can be replaced: rank 1 is Serving, rank 2 is Unresponsive" in err.body
    assert setup.runner.runs == []
    assert setup.client.resizes() == []


def test_a_replacement_keeps_the_size(setup: Setup) -> None:
    setup.fleet.set_rank(1, RankState.DEAD, "connection to the engine lost")
    err = setup.refused(ResizeRequest(id="rep-1", replicas=2, replace=(1,)))
    assert err.status == 409
    assert "replicas must be 3, not 2" in err.body


def test_a_bad_replacement_is_400(setup: Setup) -> None:
    code, body = setup.post({"id": "rep-1", "replicas": 3, "replace": [1, 1]})
    assert code == 400
    assert "names a rank twice" in body["error"]
    code, body = setup.post({"id": "rep-1", "replicas": 3, "replace": [3]})
    assert code == 400
    assert "outside the fleet's ranks" in body["error"]
    assert setup.runner.runs == []


def test_an_moe_fleet_replaces_no_rank() -> None:
    fleet = Fleet("tiny-moe", 2)
    fleet.moe = True  # what the client sets for an MoE model
    runner = Runner()
    fleet.serving(IdleView(), runner)
    fleet.set_rank(1, RankState.DEAD, "connection to the engine lost")
    server = AdminServer("127.0.0.1", 0, TOKEN, fleet)
    server.start()
    try:
        with pytest.raises(AdminError) as err:
            AdminClient(f"http://127.0.0.1:{server.port}", TOKEN).start_resize(
                ResizeRequest(id="rep-1", replicas=2, replace=(1,)))
    finally:
        server.stop()
    assert err.value.status == 400
    assert "MoE" in err.value.body
    assert runner.runs == []


def test_a_dead_rank_still_blocks_a_plain_resize_but_not_its_replacement(setup: Setup) -> None:
    setup.fleet.set_rank(1, RankState.DEAD, "connection to the engine lost")
    setup.fleet.set_rank(2, RankState.DEAD, "connection to the engine lost")
    assert setup.refused(ResizeRequest(id="up-1", replicas=4)).status == 503
    started, _ = setup.client.start_resize(ResizeRequest(id="rep-2", replicas=3, replace=(2,)))  # rank 1 waits
    assert started


# ---- 3. the client's side -------------------------------------------------------------------------
OPTIONS = FleetOptions(coordinator_address="127.0.0.1", coordinator_front_publish_port=1,
                       coordinator_back_output_port=2, coordinator_back_publish_port=3)


class Joiner:
    """The new engines' handshake and ready responses, played by the test."""

    def __init__(self, client: FakeClient) -> None:
        self.client = client
        self.handshakes: list[tuple[list[int], str]] = []

    def discard_stale_ready_responses(self) -> None:
        pass

    async def join(self, op: ResizeOperation, ranks: list[int], address: str, parallel_config: Any = None) -> None:
        self.handshakes.append((list(ranks), address))
        if self.client.handshake_error is not None:
            raise self.client.handshake_error

    async def read_ready_responses(self, ranks: list[int], wait_s: float = 30.0) -> None:
        self.client.ready_reads.append(list(ranks))
        if self.client.ready_error is not None:
            raise self.client.ready_error
        # What vLLM's _apply_ready_response does with each ready response.
        self.client.vllm_config.cache_config.num_gpu_blocks += 100 * len(ranks)

    def abort(self, reason: str, resize_id: str | None = None) -> None:
        pass


class RecordingMembership(Membership):
    """The client's real membership, recording the requests it ends with an error."""

    failed: list[tuple[list[str], str]]

    def fail_requests(self, request_ids: Any, message: str, rank: int | None = None) -> None:
        ids = list(request_ids)
        self.failed.append((ids, message))
        super().fail_requests(ids, message, rank)


class FakeClient:
    """vLLM's client as far as `Membership` reads it, its membership, and the probes the replacement forgets."""

    def __init__(self, fleet: Fleet, handshake_error: Exception | None = None,
                 ready_error: Exception | None = None) -> None:
        self.fleet = fleet
        self.client_index = 1  # one of several frontends: it releases an engine under its own index
        self.vllm_config = SimpleNamespace(
            parallel_config=SimpleNamespace(data_parallel_master_ip="127.0.0.1", data_parallel_rpc_port=29550),
            cache_config=SimpleNamespace(num_gpu_blocks=200))
        self.core_engines = [identity(r) for r in range(fleet.size)]
        self.lb_engines: list[list[int | float]] = [[0, 1, 0.1] for _ in range(fleet.size)]
        self.engine_inflight: Counter[bytes] = Counter({identity(r): 1 for r in range(fleet.size)})
        self.reqs_in_flight: dict[str, bytes] = {}
        self.outputs_queue: asyncio.Queue[Any] = asyncio.Queue()
        self.handshake_error, self.ready_error = handshake_error, ready_error
        self.ready_reads: list[list[int]] = []  # the ranks whose ready responses were read, by read
        self.joiner = Joiner(self)
        self.members = RecordingMembership(self, fleet, self.joiner, vllm_abort=self._vllm_abort)  # type: ignore[arg-type]
        self.members.failed = []
        self.cancels = Cancels()
        self.forgotten: list[int] = []  # ranks whose probes the liveness watcher was told to forget

    async def _vllm_abort(self, request_ids: list[str], engine: bytes) -> None:
        raise AssertionError("a replacement aborts nothing on an engine")

    def forget(self, rank: int) -> None:
        self.forgotten.append(rank)

    def kill(self, rank: int) -> None:
        """What `Liveness.rank_died` leaves: Dead, unroutable, its requests failed."""
        self.fleet.set_rank(rank, RankState.DEAD, "connection to the engine lost")
        self.members.unroutable[rank] = f"rank {rank} is Dead"
        self.engine_inflight[identity(rank)] = 0
        self.lb_engines[rank] = [1 << 60, 1 << 60, 0.0]

    def operations(self, followers: Followers | None = None) -> ResizeOperations:
        members, cancels = self.members, self.cancels
        return ResizeOperations(members, cancels, DenseResize(members, cancels),
                                ElasticResize(members, cancels, OPTIONS),
                                Replacement(members, cancels, self, followers), asyncio.get_running_loop())

    async def run(self, resize_id: str, followers: Followers | None = None) -> None:
        """The operation, run by the client's dispatch."""
        await self.operations(followers).run(resize_id)


async def until(condition: Any, what: str) -> None:
    for _ in range(1000):  # 10 s
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not {what} within 10 s")


def _replace(client: FakeClient, ranks: tuple[int, ...], resize_id: str = "rep-1") -> ResizeOperation:
    started, op = client.fleet.start_resize(ResizeRequest(id=resize_id, replicas=client.fleet.size,
                                                          join_timeout_s=30, replace=ranks))
    assert started
    asyncio.run(client.run(op.id))
    done = client.fleet.resize(op.id)
    assert done is not None
    return done


def test_a_replaced_rank_serves_again_with_fresh_routing_counters() -> None:
    fleet = Fleet("tiny", 3)
    client = FakeClient(fleet)
    fleet.serving(IdleView(), Runner())
    client.kill(1)
    op = _replace(client, (1,))
    assert (op.phase, op.error, op.rank(1).state) == (ResizePhase.COMPLETED, "", RankState.SERVING)
    assert "rank 1 replaced in place" in op.message
    # The handshake was for exactly the replaced rank, on the fleet's handshake address.
    assert client.joiner.handshakes == [([1], "tcp://127.0.0.1:29550")]
    assert fleet.ranks_in(RankState.SERVING) == [0, 1, 2]
    assert client.members.unroutable == {}
    assert client.lb_engines[1] == [0, 0, 0.0]
    assert client.engine_inflight[identity(1)] == 0
    assert client.members.records[1] is fleet.record(1)
    assert client.forgotten == [1]  # no probe of the lost engine counts for the new one
    # The others were not touched; neither was the size, nor the fleet's KV-cache total.
    assert client.lb_engines[0] == client.lb_engines[2] == [0, 1, 0.1]
    assert client.engine_inflight[identity(0)] == client.engine_inflight[identity(2)] == 1
    assert (fleet.size, client.core_engines) == (3, [identity(r) for r in range(3)])
    assert client.vllm_config.cache_config.num_gpu_blocks == 200


def test_a_request_left_on_the_replaced_rank_ends_with_an_error() -> None:
    fleet = Fleet("tiny", 2)
    client = FakeClient(fleet)
    fleet.serving(IdleView(), Runner())
    client.kill(1)
    client.reqs_in_flight = {"a": identity(0), "b": identity(1)}
    _replace(client, (1,))
    assert client.members.failed == [
        (["b"], "rank 1 was replaced by rep-1 before this request finished: retry the request")]
    assert client.reqs_in_flight == {"a": identity(0)}


@pytest.mark.parametrize(("handshake_error", "ready_error", "error"), [
    (ResizeFailed("rank 1 did not join within the join timeout of 30s"), None, "did not join within the join timeout"),
    (None, ResizeFailed("rank 1 runs vLLM 0.31.0, the fleet 0.32.0"), "runs vLLM 0.31.0"),
    (RuntimeError("Unexpected READY message"), None, "handshake failed: RuntimeError: Unexpected READY message"),
])
def test_a_failed_replacement_leaves_the_rank_dead_and_the_fleet_intact(
        handshake_error: Exception | None, ready_error: Exception | None, error: str) -> None:
    fleet = Fleet("tiny", 2)
    client = FakeClient(fleet, handshake_error=handshake_error, ready_error=ready_error)
    fleet.serving(IdleView(), Runner())
    client.kill(1)
    op = _replace(client, (1,))
    assert op.phase == ResizePhase.FAILED
    assert op.fleet_intact
    assert error in op.error
    assert fleet.ranks_in(RankState.DEAD) == [1]
    assert fleet.ranks_in(RankState.SERVING) == [0]
    assert f"replacement rep-1 failed: {op.error}" == fleet.record(1).message
    assert 1 in client.members.unroutable
    assert client.vllm_config.cache_config.num_gpu_blocks == 200
    # A second try with a new engine may come.
    client.handshake_error = client.ready_error = None
    assert _replace(client, (1,), "rep-2").phase == ResizePhase.COMPLETED
    assert fleet.ranks_in(RankState.SERVING) == [0, 1]


def test_a_cancelled_replacement_leaves_the_rank_dead() -> None:
    fleet = Fleet("tiny", 2)
    client = FakeClient(fleet)
    fleet.serving(IdleView(), Runner())
    client.kill(1)
    client.cancels.request("rep-1", "the operator gave up")
    op = _replace(client, (1,))
    assert (op.phase, op.error) == (ResizePhase.FAILED, "cancelled: the operator gave up")
    assert client.joiner.handshakes == []
    assert fleet.ranks_in(RankState.DEAD) == [1]


def test_the_lost_engines_load_is_ignored_until_the_new_engine_gets_a_request() -> None:
    fleet = Fleet("tiny", 2)
    client = FakeClient(fleet)
    fleet.serving(IdleView(), Runner())
    client.kill(1)
    _replace(client, (1,))
    # The coordinator still publishes the lost engine's last counts for rank 1 (a new list each time).
    client.lb_engines = [[0, 0, 0.0], [0, 3, 0.4]]
    client.members.ignore_stale_loads()
    assert client.lb_engines == [[0, 0, 0.0], [0, 0, 0.0]]
    # Its first request: from then on its engine publishes its own counts, and they are taken as they come.
    fleet.record(1).requests_total += 1
    client.lb_engines = [[0, 0, 0.0], [0, 1, 0.1]]
    client.members.ignore_stale_loads()
    assert client.lb_engines == [[0, 0, 0.0], [0, 1, 0.1]]
    assert client.members.stale_loads == {}


def test_a_replaced_rank_that_dies_again_is_left_unroutable() -> None:
    fleet = Fleet("tiny", 2)
    client = FakeClient(fleet)
    fleet.serving(IdleView(), Runner())
    client.kill(1)
    _replace(client, (1,))
    client.kill(1)
    client.members.ignore_stale_loads()
    assert client.lb_engines[1] == [1 << 60, 1 << 60, 0.0]
    assert client.members.stale_loads == {}


def test_two_dead_ranks_are_replaced_in_one_operation() -> None:
    fleet = Fleet("tiny", 3)
    client = FakeClient(fleet)
    fleet.serving(IdleView(), Runner())
    client.kill(2)
    client.kill(0)
    op = _replace(client, (2, 0))
    assert (op.phase, op.replace, [r.rank for r in op.ranks]) == (ResizePhase.COMPLETED, (0, 2), [0, 2])
    assert client.joiner.handshakes == [([0, 2], "tcp://127.0.0.1:29550")]
    assert fleet.ranks_in(RankState.SERVING) == [0, 1, 2]
    assert client.members.unroutable == {}


def test_a_vacating_replacement_drains_releases_and_waits_for_the_engine_to_stop_before_the_new_one_joins() -> None:
    """A rank whose pod is being removed while it serves: no new request, its request finishes, its engine is
    released (the utility call its launcher's pre-stop wait ends on), and only once its connection is gone does the
    new engine's handshake start. Nothing fails."""
    fleet = Fleet("tiny", 3)
    client = FakeClient(fleet)
    fleet.serving(IdleView(), Runner())
    releases: list[tuple[bytes, str, tuple[Any, ...], RankState, int]] = []

    async def send_utility_call(engine: bytes, method: str, args: tuple[Any, ...]) -> asyncio.Future[Any]:
        releases.append((engine, method, args, fleet.record(1).state, client.engine_inflight[identity(1)]))
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        answer.set_result(True)
        return answer

    client.members.send_utility_call = send_utility_call  # type: ignore[method-assign]

    async def leaving_engine() -> None:
        await until(lambda: fleet.record(1).state == RankState.DRAINING, "draining")
        assert 1 in client.members.unroutable  # no new request goes to it from now on
        assert client.joiner.handshakes == []
        client.engine_inflight[identity(1)] = 0  # its last request finished
        await until(lambda: releases, "released")
        assert client.joiner.handshakes == []  # the new engine waits for the old one to go
        client.members.lost[1] = "connection to the engine lost"  # what the liveness watcher records

    async def main() -> None:
        started, op = fleet.start_resize(ResizeRequest(id="vac", replicas=3, drain_timeout_s=30, join_timeout_s=30,
                                                       replace=(1,), vacate=True))
        assert started
        await asyncio.gather(leaving_engine(), client.run(op.id))

    asyncio.run(main())
    op = fleet.resize("vac")
    assert op is not None
    assert (op.phase, op.error, op.rank(1).state) == (ResizePhase.COMPLETED, "", RankState.SERVING)
    assert releases == [(identity(1), RELEASE_UTILITY, (client.client_index,), RankState.DRAINING, 0)]
    assert client.members.failed == []
    assert client.joiner.handshakes == [([1], "tcp://127.0.0.1:29550")]
    assert 1 not in client.members.lost
    assert client.members.unroutable == {}


# ---- idle and wake (scale to zero, issue 28) ---------------------------------------------------------------
def releasing(client: FakeClient) -> list[bytes]:
    """The engines released, in order (the utility call answered at once)."""
    released: list[bytes] = []

    async def send_utility_call(engine: bytes, method: str, args: tuple[Any, ...]) -> asyncio.Future[Any]:
        assert (method, args) == (RELEASE_UTILITY, (client.client_index,))
        released.append(engine)
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        answer.set_result(True)
        return answer

    client.members.send_utility_call = send_utility_call  # type: ignore[method-assign]
    return released


def idle(client: FakeClient, finish: Callable[[], None], resize_id: str = "idle-1") -> ResizeOperation:
    """Idle the fleet; `finish()` runs once every rank is Draining (the requests in flight end, or one comes)."""
    fleet = client.fleet

    async def ranks() -> None:
        await until(lambda: all(fleet.record(r).state == RankState.DRAINING for r in range(fleet.size)), "draining")
        assert fleet.idle()  # going idle: /health stays 200, requests wait for the ranks
        assert client.members.closed() is not None
        finish()

    async def main() -> None:
        started, op = fleet.start_resize(ResizeRequest(id=resize_id, replicas=fleet.size, drain_timeout_s=30,
                                                       idle=True))
        assert started
        assert op.idle
        await asyncio.gather(ranks(), client.run(op.id))

    asyncio.run(main())
    done = fleet.resize(resize_id)
    assert done is not None
    return done


def idle_fleet() -> tuple[Fleet, FakeClient, list[bytes]]:
    """2 ranks that were serving one request each, idled."""
    fleet = Fleet("tiny", 2)
    client = FakeClient(fleet)
    fleet.serving(IdleView(), Runner())
    released = releasing(client)

    def finished() -> None:
        for rank in range(2):
            client.engine_inflight[identity(rank)] = 0

    op = idle(client, finished)
    assert (op.phase, op.error) == (ResizePhase.COMPLETED, ""), op
    return fleet, client, released


def test_an_idled_fleet_drains_and_releases_every_rank_and_is_idle_until_a_replacement_wakes_it() -> None:
    fleet, client, released = idle_fleet()
    assert released == [identity(0), identity(1)]  # after their requests finished: nothing failed
    assert client.members.failed == []
    assert [fleet.record(r).state for r in range(2)] == [RankState.IDLE, RankState.IDLE]
    assert fleet.idle()
    status = fleet.snapshot()
    assert status.state == FleetState.IDLE, status
    assert "idle" in status.message
    assert sorted(client.forgotten) == [0, 1]  # no engine is watched
    why = client.members.closed()
    assert why is not None
    assert "rank 0 is Idle: the fleet is idle (idle-1)" in why
    # Idling an idle fleet does nothing.
    again = fleet.start_resize(ResizeRequest(id="idle-2", replicas=2, idle=True))[1]
    assert (again.phase, again.message) == (ResizePhase.COMPLETED, "the fleet is idle already")

    # The wake: a replacement of the Idle ranks. They stay Idle (not Dead: the fleet is not broken) until it commits.
    op = _replace(client, (0, 1), "wake-1")
    assert (op.phase, op.error) == (ResizePhase.COMPLETED, ""), op
    assert client.joiner.handshakes == [([0, 1], "tcp://127.0.0.1:29550")]
    assert fleet.ranks_in(RankState.SERVING) == [0, 1]
    assert client.members.unroutable == {}
    assert client.members.closed() is None
    assert not fleet.idle()
    assert fleet.snapshot().state == FleetState.SERVING
    assert client.vllm_config.cache_config.num_gpu_blocks == 200  # the new engines take the old ones' share


def test_a_request_that_comes_while_the_fleet_goes_idle_stops_it_and_the_ranks_serve_on() -> None:
    fleet = Fleet("tiny", 2)
    client = FakeClient(fleet)
    fleet.serving(IdleView(), Runner())
    released = releasing(client)
    waiting = [0]
    fleet.demand = lambda: waiting[0]

    def request_comes() -> None:
        waiting[0] = 1  # held by the frontend: no rank takes requests while they drain

    op = idle(client, request_comes)
    assert op.phase == ResizePhase.FAILED
    assert op.fleet_intact
    assert op.error == "1 request(s) came while the fleet was going idle: it serves on"
    assert released == []
    assert fleet.ranks_in(RankState.SERVING) == [0, 1]
    assert client.members.unroutable == {}  # the held request goes on to a rank
    assert not fleet.idle()


def test_an_engine_that_dies_while_the_fleet_goes_idle_leaves_it_idle_all_the_same() -> None:
    fleet = Fleet("tiny", 2)
    client = FakeClient(fleet)
    fleet.serving(IdleView(), Runner())
    releasing(client)

    def one_dies() -> None:
        client.members.lost[1] = "connection to the engine lost"  # what the liveness watcher records for a leaver
        client.engine_inflight[identity(1)] = 0  # its request failed with it
        client.engine_inflight[identity(0)] = 0

    op = idle(client, one_dies)
    assert (op.phase, op.error) == (ResizePhase.COMPLETED, ""), op
    assert [fleet.record(r).state for r in range(2)] == [RankState.IDLE, RankState.IDLE]
    assert client.members.lost == {}  # a wake starts from Idle ranks, none remembered as lost
    assert fleet.snapshot().state == FleetState.IDLE


def test_ranks_are_awaited_while_the_fleet_is_idle_or_a_replacement_runs() -> None:
    """What keeps `/health` at 200 while no rank serves (`Fleet.awaits_ranks`): not a fleet whose ranks are lost and
    that nothing replaces."""
    fleet = Fleet("tiny", 1)
    fleet.serving(IdleView(), Runner())
    assert not fleet.awaits_ranks()
    fleet.set_rank(0, RankState.DEAD, "connection to the engine lost")
    assert not fleet.awaits_ranks()  # lost, and nothing on its way: /health 503
    started, op = fleet.start_resize(ResizeRequest(id="rep-1", replicas=1, replace=(0,)))
    assert started
    assert fleet.awaits_ranks()  # a new engine is on its way: requests wait for it
    fleet.finish_resize(op.id, error="no HELLO within the join timeout")
    assert not fleet.awaits_ranks()
    fleet.set_rank(0, RankState.IDLE, "idled")
    assert fleet.awaits_ranks()


def test_while_an_idle_fleet_wakes_a_held_request_is_told_so() -> None:
    fleet, client, _ = idle_fleet()
    members_closed = client.members.closed  # the view: the real membership
    with mock.patch.object(IdleView, "closed", side_effect=members_closed):
        idle_why = fleet.closed()
        assert idle_why is not None
        assert "the fleet is idle (idle-1)" in idle_why
        started, _ = fleet.start_resize(ResizeRequest(id="wake-1", replicas=2, replace=(0, 1)))
        assert started
        waking = fleet.closed()
    assert waking is not None
    assert waking.startswith("the fleet is waking (wake-1: ")
    assert waking.endswith(idle_why)


def test_a_wake_that_fails_leaves_the_fleet_idle_not_broken() -> None:
    fleet, client, _ = idle_fleet()
    client.handshake_error = TimeoutError("no HELLO within 30s")
    op = _replace(client, (0, 1), "wake-1")
    assert (op.phase, op.fleet_intact) == (ResizePhase.FAILED, True), op
    assert [fleet.record(r).state for r in range(2)] == [RankState.IDLE, RankState.IDLE]
    assert fleet.record(0).message.startswith("wake wake-1 failed: ")
    assert fleet.snapshot().state == FleetState.IDLE
    assert fleet.idle()
    assert client.members.closed() is not None  # requests still wait; the operator tries the wake again
    client.handshake_error = None
    assert _replace(client, (0, 1), "wake-2").phase == ResizePhase.COMPLETED
    assert fleet.ranks_in(RankState.SERVING) == [0, 1]


def test_idling_is_refused_where_it_cannot_run_in_place() -> None:
    moe = Fleet("tiny-moe", 2)
    moe.moe = True
    moe.serving(IdleView(), Runner())
    with pytest.raises(ResizeRefused, match="an MoE fleet cannot go idle in place") as e:
        moe.start_resize(ResizeRequest(id="i", replicas=2, idle=True))
    assert e.value.status == 400
    several = Fleet("tiny", 2, frontends=2)
    several.serving(IdleView(), Runner())
    with pytest.raises(ResizeRefused, match="only a fleet of one frontend goes idle") as e:
        several.start_resize(ResizeRequest(id="i", replicas=2, idle=True))
    assert e.value.status == 501
    fleet = Fleet("tiny", 2)
    fleet.serving(IdleView(), Runner())
    with pytest.raises(ResizeRefused, match="idling keeps the fleet's size: replicas must be 2, not 3") as e:
        fleet.start_resize(ResizeRequest(id="i", replicas=3, idle=True))
    assert e.value.status == 409
    fleet.set_rank(1, RankState.UNRESPONSIVE, "no answer")
    with pytest.raises(ResizeRefused, match="rank 1 is Unresponsive") as e:
        fleet.start_resize(ResizeRequest(id="i", replicas=2, idle=True))
    assert e.value.status == 409
    # A Serving rank is not woken: only Dead and Idle ranks are replaced.
    with pytest.raises(ResizeRefused, match="only a Dead or Idle rank can be replaced: rank 0 is Serving"):
        fleet.start_resize(ResizeRequest(id="w", replicas=2, replace=(0,)))
    assert ResizeRequest("i", 2, idle=True, replace=(1,)).validate() == \
        "idle takes every rank of the fleet: it goes with neither replace, vacate nor follower"
    request = ResizeRequest("i", 2, drain_timeout_s=5.0, idle=True)
    assert ResizeRequest.from_json(json.loads(json.dumps(request.to_json()))) == request
    assert "idle" not in ResizeRequest("r", 2).to_json()  # a plain resize reads as before


# ---- 4. several frontends ----------------------------------------------------------------------------
def follower_fleet(size: int = 3) -> tuple[Fleet, FakeClient]:
    """Frontend 1 of 2 over `size` serving ranks."""
    fleet = Fleet("tiny", size, frontends=2, client_index=1)
    client = FakeClient(fleet)
    fleet.serving(IdleView(), Runner())
    return fleet, client


def part_of(fleet: Fleet, ranks: tuple[int, ...], resize_id: str = "rep-1") -> ResizeOperation:
    started, op = fleet.start_resize(ResizeRequest(id=resize_id, replicas=fleet.size, drain_timeout_s=30,
                                                   join_timeout_s=30, replace=ranks, follower=True))
    assert started
    assert op.follower
    return op


def phase(fleet: Fleet, op: ResizeOperation) -> ResizePhase:
    return (fleet.resize(op.id) or op).phase


def served_again(fleet: Fleet, op: ResizeOperation) -> None:
    """The part completed, and every rank serves on this frontend."""
    done = fleet.resize(op.id)
    assert done is not None
    assert (done.phase, done.error) == (ResizePhase.COMPLETED, "")
    assert fleet.ranks_in(RankState.SERVING) == [0, 1, 2]


def test_a_followers_part_for_a_dead_rank_reads_the_new_engine_and_serves_it_at_frontend_0s_commit() -> None:
    fleet, client = follower_fleet()
    client.kill(1)  # this frontend saw the engine die too
    op = part_of(fleet, (1,))

    async def main() -> None:
        operations = client.operations()
        task = asyncio.ensure_future(operations.run(op.id))
        await until(lambda: phase(fleet, op) == ResizePhase.PREPARED, "prepared")
        assert client.ready_reads == [[1]]
        assert 1 in client.members.unroutable  # nothing is routed to it before frontend 0 commits
        assert fleet.record(1).state == RankState.DEAD
        operations.follower.commit(op.id)
        await task

    asyncio.run(main())
    served_again(fleet, op)
    assert client.members.unroutable == {}
    assert client.lb_engines[1] == [0, 0, 0.0]
    assert client.forgotten == [1]
    assert client.vllm_config.cache_config.num_gpu_blocks == 200  # the new engine takes the lost one's share
    assert client.joiner.handshakes == []  # the handshake is frontend 0's


def test_a_followers_part_drains_a_rank_it_still_routes_to_before_the_engine_goes_and_reads_the_new_one_after() -> (
        None):
    """A vacating replacement (or a death this frontend has not seen yet): no new request from here, its request here
    finishes, and frontend 0 learns it drained (Preparing) before it releases the engine; the new engine's ready
    response is read only once the old engine's connection is gone."""
    fleet, client = follower_fleet()
    client.engine_inflight[identity(1)] = 1
    op = part_of(fleet, (1,))

    async def main() -> None:
        operations = client.operations()
        task = asyncio.ensure_future(operations.run(op.id))
        await until(lambda: fleet.record(1).state == RankState.DRAINING, "draining")
        assert 1 in client.members.unroutable
        assert phase(fleet, op) == ResizePhase.DRAINING
        client.engine_inflight[identity(1)] = 0  # its last request here finished
        await until(lambda: phase(fleet, op) == ResizePhase.PREPARING, "drained")
        assert client.ready_reads == []  # the old engine still runs
        client.members.lost[1] = "connection to the engine lost"  # frontend 0 released it; it stopped
        await until(lambda: phase(fleet, op) == ResizePhase.PREPARED, "prepared")
        assert client.ready_reads == [[1]]
        operations.follower.commit(op.id)
        await task

    asyncio.run(main())
    served_again(fleet, op)
    assert client.members.failed == []
    assert 1 not in client.members.lost
    assert client.members.unroutable == {}


def test_a_followers_part_without_frontend_0s_commit_serves_the_new_engine_after_the_grace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(followers_module, "COMMIT_GRACE_S", 0.2)
    fleet, client = follower_fleet()
    client.kill(2)
    op = part_of(fleet, (2,))
    asyncio.run(client.run(op.id))
    done = fleet.resize(op.id)
    assert done is not None
    assert (done.phase, fleet.record(2).state) == (ResizePhase.COMPLETED, RankState.SERVING)


def interrupted_part(fleet: Fleet, op: ResizeOperation, part: Callable[[], Coroutine[Any, Any, None]],
                     reached: ResizePhase, interrupt: Callable[[], None]) -> ResizeOperation:
    """Run a follower's part (`part()`, on the event loop) until it reaches the phase `reached`, `interrupt` it there,
    and return how it ended."""

    async def main() -> None:
        task = asyncio.ensure_future(part())
        await until(lambda: phase(fleet, op) == reached, reached.value)
        interrupt()
        await task

    asyncio.run(main())
    done = fleet.resize(op.id)
    assert done is not None
    return done


def test_a_followers_part_orphaned_by_a_restarted_frontend_0_fails_and_leaves_the_rank_dead() -> None:
    """Frontend 0 lost while this frontend was Prepared (the new engine announced itself here) and back: the operator
    deletes that engine and replaces the rank again, so the orphaned part fails at once rather than serve it."""
    fleet, client = follower_fleet()
    client.kill(1)
    op = part_of(fleet, (1,))
    operations: list[ResizeOperations] = []

    def run() -> Coroutine[Any, Any, None]:
        operations.append(client.operations())
        return operations[0].run(op.id)

    done = interrupted_part(fleet, op, run, ResizePhase.PREPARED,
                            lambda: operations[0].follower.orphan(op.id, "frontend 0 was restarted"))
    assert done.phase == ResizePhase.FAILED
    assert "frontend 0 that drove it is gone (frontend 0 was restarted): the new engine(s) of rank 1 are deleted" \
        in done.error
    assert fleet.record(1).state == RankState.DEAD
    assert 1 in client.members.unroutable


def test_a_cancelled_followers_part_serves_on_with_a_rank_whose_engine_still_runs_and_leaves_a_dead_one_dead() -> None:
    fleet, client = follower_fleet()
    client.kill(2)
    client.engine_inflight[identity(1)] = 0  # nothing in flight here on rank 1
    op = part_of(fleet, (1, 2))
    done = interrupted_part(fleet, op, lambda: client.run(op.id), ResizePhase.PREPARING, lambda: client.cancels.request(
        op.id, "replacement rep-1 failed on frontend 0: rank 2 did not join"))
    assert done.phase == ResizePhase.FAILED
    assert "rank 2 did not join" in done.error
    assert (fleet.record(1).state, fleet.record(2).state) == (RankState.SERVING, RankState.DEAD)
    assert list(client.members.unroutable) == [2]
    assert client.ready_reads == []


@dataclass
class ScriptedFollower:
    """A follower's event loop, scripted: its part goes to Prepared at once and completes on frontend 0's commit."""

    fleet: Fleet
    commits: list[str] = field(default_factory=list)

    def run_resize(self, resize_id: str) -> None:
        self.fleet.update_resize(resize_id, phase=ResizePhase.PREPARED)

    def cancel_resize(self, resize_id: str, reason: str) -> None:
        self.fleet.finish_resize(resize_id, error=f"cancelled: {reason}")

    def commit_resize(self, resize_id: str) -> None:
        self.commits.append(resize_id)
        self.fleet.finish_resize(resize_id)

    def orphan_resize(self, resize_id: str, reason: str) -> None:
        raise AssertionError("this frontend 0 sent every part")


def test_frontend_0_replaces_a_rank_through_every_follower_and_commits_them_after_itself(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(followers_module, "UNREACHABLE_S", 0.3)
    fleet = Fleet("tiny", 2, frontends=3)
    client = FakeClient(fleet)
    fleet.serving(IdleView(), Runner())
    follower = Fleet("tiny", 2, frontends=3, client_index=1)
    runner = ScriptedFollower(follower)
    follower.serving(IdleView(), runner)
    server = AdminServer("127.0.0.1", 0, TOKEN, follower)
    server.start()
    try:  # frontend 2 is gone (nothing listens on its port): passed over, its replacement attaches later
        followers = Followers({1: AdminClient(f"http://127.0.0.1:{server.port}", TOKEN, timeout=1),
                               2: AdminClient(f"http://127.0.0.1:{free_port()}", TOKEN, timeout=1)})
        client.kill(1)
        started, op = fleet.start_resize(ResizeRequest(id="rep-1", replicas=2, join_timeout_s=30, replace=(1,)))
        assert started
        asyncio.run(client.run(op.id, followers))
    finally:
        server.stop()
    done, part = fleet.resize("rep-1"), follower.resize("rep-1")
    assert done is not None
    assert part is not None
    assert (done.phase, done.error) == (ResizePhase.COMPLETED, "")
    assert (part.follower, part.replace, part.phase) == (True, (1,), ResizePhase.COMPLETED)
    assert runner.commits == ["rep-1"]
    assert fleet.ranks_in(RankState.SERVING) == [0, 1]


def test_a_replacement_passes_over_an_unreachable_follower_and_fails_for_one_that_refused() -> None:
    op = ResizeOperation(id="rep-1", from_replicas=2, to_replicas=2, phase=ResizePhase.PREPARING, replace=(1,))
    Replacement._pass_over(op, {1: FollowerLost("gone", reachable=False)})
    with pytest.raises(ResizeFailed, match="not every frontend can take the new engines: busy"):
        Replacement._pass_over(op, {1: FollowerLost("gone", reachable=False), 2: FollowerLost("busy")})
