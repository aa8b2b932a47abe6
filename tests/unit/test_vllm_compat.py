# SPDX-License-Identifier: Apache-2.0
"""corefleet_client.vllm_compat's changes, and corefleet's client over vLLM's utility calls, shown without an engine."""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import zmq

# The heavy vLLM modules (torch, transformers) load at collection, not inside a test's time limit.
from vllm.config import ParallelConfig
from vllm.config.parallel import EPLBConfig
from vllm.distributed.nixl_utils import is_nixl_available
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.launchers.api_server import entry
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.exceptions import GracefulHTTPError
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequestType, UtilityOutput
from vllm.v1.engine.core_client import _process_utility_output
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.serial_utils import MsgpackEncoder, UtilityResult

from corefleet_client import vllm_compat
from corefleet_client.admin import FleetState, RankState
from corefleet_client.frontend.affinity import block_hashes, rendezvous
from corefleet_client.frontend.client import KubeDPLBClient
from corefleet_client.frontend.fleet import Fleet, identity
from corefleet_client.frontend.handshake import Handshake
from corefleet_client.frontend.membership import rank_of
from corefleet_client.frontend.progress import fleet_prefill_cost
from corefleet_client.frontend.types import AffinitySettings, FleetOptions, RoutingPolicy, StallPolicy
from corefleet_harness.support import wait_until_async


class AlwaysReady:
    """A socket with a message always waiting: pyzmq then hands back a completed future."""

    def __init__(self) -> None:
        self.closed = False

    def recv_multipart(self, copy: bool = True) -> asyncio.Future[list[bytes]]:
        future: asyncio.Future[list[bytes]] = asyncio.get_running_loop().create_future()
        future.set_result([b"frame"])
        return future

    def close(self, linger: int = 0) -> None:
        self.closed = True


def reader_starves_others(socket: Any) -> bool:
    """Run a reader loop over `socket` next to another task: does the other task get to run?"""
    async def main() -> bool:
        ran = asyncio.Event()

        async def reader() -> None:
            for _ in range(1000):
                await socket.recv_multipart(copy=False)

        async def other() -> None:
            ran.set()

        reading = asyncio.create_task(reader())
        helper = asyncio.create_task(other())
        await asyncio.sleep(0)  # both are scheduled; the reader runs first
        ran_before_reader_finished = ran.is_set() and not reading.done()
        await reading
        await helper
        return not ran_before_reader_finished

    return asyncio.run(main())


def reader_pauses(socket: Any, messages: int, work_s: float) -> tuple[int, int]:
    """A reader loop over `socket` that spends `work_s` on each message (decoding it), beside a task that counts how
    often it gets to run: (its runs while the reader read, the most messages the reader read without a pause).
    Counted in messages, not seconds: a machine under load that preempts this process stretches the reader's time
    slice in seconds, but the slice then ends after fewer messages, never more."""
    async def main() -> tuple[int, int]:
        runs: list[int] = []
        read = 0
        done = False

        async def reader() -> None:
            nonlocal done, read
            for _ in range(messages):
                await socket.recv_multipart(copy=False)
                read += 1
                end = time.perf_counter() + work_s
                while time.perf_counter() < end:
                    pass
            done = True

        async def other() -> None:
            while not done:
                runs.append(read)
                await asyncio.sleep(0)

        await asyncio.gather(reader(), other())
        marks = [0, *runs, read]
        return len(runs), max(b - a for a, b in itertools.pairwise(marks))

    return asyncio.run(main())


def test_a_reader_of_a_busy_socket_starves_the_loop_and_the_yielding_socket_does_not() -> None:
    assert reader_starves_others(AlwaysReady())  # why change 7 exists
    # 0.2 ms of decoding per message, for 20 slices: the other task runs once the reader has read for a slice
    # (10 ms: 50 messages, and the one whose read ends the slice) ...
    per_slice = round(vllm_compat.OUTPUT_READER_SLICE_S / 0.0002)
    messages = 20 * per_slice
    runs, most = reader_pauses(vllm_compat.YieldingSocket(AlwaysReady()), messages, 0.0002)
    assert runs >= 10
    assert most <= per_slice + 1
    # ... yet the reader reads several messages per pause (vLLM's output handler then merges a request's tokens
    # into one chunk of its stream, as stock vLLM's does), not one message per pause.
    assert runs < messages / 3


class PausingSocket:
    """Every `every`-th message comes `pause_s` after it is asked for (pyzmq's pending future), the others are waiting
    already (a completed future)."""

    def __init__(self, every: int, pause_s: float) -> None:
        self.every, self.pause_s, self.asked = every, pause_s, 0

    def recv_multipart(self, copy: bool = True) -> asyncio.Future[list[bytes]]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[bytes]] = loop.create_future()
        self.asked += 1
        if self.asked % self.every:
            future.set_result([b"frame"])
        else:
            loop.call_later(self.pause_s, future.set_result, [b"frame"])
        return future


def test_a_reader_that_paused_starts_a_new_slice_and_is_not_made_to_yield_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Messages come in threes, 1.5 slices apart: the reader waits for each three's first one, so other
    # tasks run then; an extra yield right after the pause would let the output handler run between the three and
    # split a request's tokens over more chunks of its stream than stock vLLM's (bench_frontend.py's token events).
    forced = 0
    sleep = asyncio.sleep

    async def counted(delay: float, result: Any = None) -> Any:
        nonlocal forced
        forced += 1
        return await sleep(delay, result)

    async def read(socket: vllm_compat.YieldingSocket, messages: int) -> None:
        for _ in range(messages):
            await socket.recv_multipart(copy=False)

    monkeypatch.setattr(asyncio, "sleep", counted)
    pause_s = 1.5 * vllm_compat.OUTPUT_READER_SLICE_S
    asyncio.run(read(vllm_compat.YieldingSocket(PausingSocket(every=3, pause_s=pause_s)), 120))
    # 40 pauses; the reader's runs between them take microseconds, so a slice ends only where the machine preempted
    # this process for a slice in one of them (the reader counted each pause as reading before the fix: 40)
    assert forced < 10


def test_yielding_output_socket_is_seen_only_by_the_task_created_inside() -> None:
    class Resources:
        output_socket: Any = AlwaysReady()

    resources = Resources()
    real = resources.output_socket
    with vllm_compat.yielding_output_socket(resources):
        seen = resources.output_socket
        assert isinstance(seen, vllm_compat.YieldingSocket)
        seen.close()  # anything but recv_multipart reaches the real socket
    assert resources.output_socket is real
    assert real.closed


# ---- corefleet's client over vLLM's utility calls: liveness and fan-out, engines played by the test ----------


class Engines:
    """The requests ROUTER as the client sees it, with the engines behind it played by the test.

    A running engine answers every utility call at once, as vLLM's output task would take the
    answer: through vLLM's own `_process_utility_output` (a KeyError there is what took the
    frontend down). A stopped engine (SIGSTOP) holds its calls until it is continued; a lost one
    refuses every send as the ROUTER does in ROUTER_MANDATORY mode.
    """

    def __init__(self) -> None:
        self.client: Any = None
        self.stopped: set[int] = set()
        self.lost: set[int] = set()
        self.held: dict[int, list[int]] = {}
        self.sent: list[tuple[int, bytes, Any]] = []  # (rank, request type, decoded request)
        self.errors: list[BaseException] = []

    def setsockopt(self, *args: Any) -> None:
        pass

    async def send_multipart(self, frames: Any, copy: bool = True) -> None:
        rank = int.from_bytes(frames[0], "little")
        if rank in self.lost:
            raise zmq.ZMQError(errno.EHOSTUNREACH, "Host unreachable")
        request = msgspec.msgpack.decode(bytes(frames[2]))
        self.sent.append((rank, bytes(frames[1]), request))
        if bytes(frames[1]) == EngineCoreRequestType.UTILITY.value:
            if rank in self.stopped:
                self.held.setdefault(rank, []).append(request[1])
            else:
                asyncio.get_running_loop().call_soon(self.answer, request[1])

    def answer(self, call_id: int) -> None:
        try:
            _process_utility_output(UtilityOutput(call_id, result=UtilityResult(False)), self.client.utility_results)
        except BaseException as e:  # vLLM's output task would die of it
            self.errors.append(e)

    def cont(self, rank: int) -> None:
        self.stopped.discard(rank)
        for call_id in self.held.pop(rank, []):
            self.answer(call_id)

    def utility_calls(self, rank: int, method: str) -> int:
        return sum(1 for r, kind, req in self.sent
                   if r == rank and kind == EngineCoreRequestType.UTILITY.value and req[2] == method)


class Requests:
    """AsyncLLM's output processor, as far as `vllm_compat.fail_requests` reaches it."""

    def __init__(self) -> None:
        self.request_states: dict[str, Any] = {}
        self.errors: dict[str, Any] = {}

    def add(self, request_id: str) -> None:
        errors = self.errors

        class Queue:
            def put(self, item: Any) -> None:
                errors[request_id] = item

        self.request_states[request_id] = SimpleNamespace(queue=Queue())

    def abort_requests(self, ids: list[str], internal: bool = False) -> list[str]:
        return [i for i in ids if self.request_states.pop(i, None) is not None]


def make_client(ranks: int, engines: Engines, interval: float = 0.01, timeout: float = 0.2,
                stall: StallPolicy | None = None, routing: RoutingPolicy = RoutingPolicy.LEAST_LOADED,
                affinity: AffinitySettings | None = None) -> KubeDPLBClient:
    """corefleet's client past its handshake (which needs engines), as `_serve` leaves it."""
    client = KubeDPLBClient.__new__(KubeDPLBClient)
    engines.client = client
    options = FleetOptions(coordinator_address="127.0.0.1", coordinator_front_publish_port=1,
                           coordinator_back_output_port=2, coordinator_back_publish_port=3,
                           liveness_interval_s=interval, liveness_timeout_s=timeout, stall=stall or StallPolicy(),
                           routing=routing, affinity=affinity or AffinitySettings())
    fleet = Fleet("tiny", ranks)
    client.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=4))
    client.core_engines = [identity(r) for r in range(ranks)]
    client.lb_engines = [[0, 0, 0.0] for _ in range(ranks)]
    client.reqs_in_flight = {}
    client.engine_inflight = Counter()
    client.utility_results = {}
    client.input_socket = engines
    client.encoder = MsgpackEncoder()
    client.client_index = 0
    client.eng_start_index = 0
    client.client_count = 1
    client.outputs_queue = asyncio.Queue()
    client._ensure_output_queue_task = lambda: None  # type: ignore[method-assign]  # no output socket here
    client._serve(options, fleet, Handshake(client, options, fleet), None)
    client._members.async_llm = SimpleNamespace(output_processor=Requests())
    return client


async def until(check: Callable[[], Any], what: str, within: float = 5.0) -> None:
    """This module's wait: 5 s, checked every 5 ms (a rank's state may last a moment)."""
    await wait_until_async(check, within, what, interval=0.005)


def stop_watching(client: KubeDPLBClient) -> None:
    assert client._liveness.task is not None
    client._liveness.stop()


def state(client: KubeDPLBClient, rank: int) -> RankState:
    return client._members.fleet.snapshot().rank(rank).state


def test_a_slow_rank_is_unresponsive_then_serving_again_and_its_late_answer_is_vllms_to_take() -> None:
    async def main() -> None:
        engines = Engines()
        client = make_client(2, engines)
        try:
            await until(lambda: engines.utility_calls(1, "is_sleeping") >= 2, "rank 1 to answer liveness calls")
            engines.stopped.add(1)  # SIGSTOP
            await until(lambda: state(client, 1) != RankState.SERVING, "rank 1 to leave Serving")
            assert state(client, 1) == RankState.UNRESPONSIVE
            snapshot = client._members.fleet.snapshot()
            assert snapshot.state == FleetState.DEGRADED
            assert "rank 1 Unresponsive" in snapshot.message
            assert snapshot.rank(1).since is not None
            assert "liveness call" in snapshot.rank(1).message
            held = list(engines.held[1])
            assert held
            assert all(call_id in client.utility_results for call_id in held)
            client.check_fleet_health()  # /health: rank 0 serves
            # New requests avoid it; one pinned to it gets a 503 naming the rank and its state, unsent.
            unpinned = SimpleNamespace(request_id="free", data_parallel_rank=None, pooling_params=None)
            assert [client.get_core_engine_for_request(unpinned) for _ in range(3)] == [identity(0)] * 3
            client._members.async_llm.output_processor.add("pinned")
            await client.add_request_async(SimpleNamespace(request_id="pinned", data_parallel_rank=1))
            error = client._members.async_llm.output_processor.errors["pinned"]
            assert isinstance(error, GracefulHTTPError)
            assert error.http_status == HTTPStatus.SERVICE_UNAVAILABLE
            assert "data_parallel_rank 1 takes no requests: rank 1 is Unresponsive" in error.message, error.message
            assert not [s for s in engines.sent if s[1] == EngineCoreRequestType.ADD.value]
            # Still unresponsive after many timeouts: one outstanding call, connection checks only.
            await asyncio.sleep(0.5)
            assert state(client, 1) == RankState.UNRESPONSIVE
            assert engines.held[1] == held
            assert any(r == 1 and kind == EngineCoreRequestType.ABORT.value for r, kind, _ in engines.sent)

            engines.cont(1)  # SIGCONT: the late answers go through vLLM's output path
            await until(lambda: state(client, 1) == RankState.SERVING, "rank 1 to serve again")
            assert not engines.errors, engines.errors
            assert not any(call_id in client.utility_results for call_id in held)
            assert client.get_core_engine_for_request(
                SimpleNamespace(request_id="after", data_parallel_rank=1, pooling_params=None)) == identity(1)
        finally:
            stop_watching(client)

    asyncio.run(main())


def test_a_lost_connection_makes_an_unresponsive_rank_dead() -> None:
    async def main() -> None:
        engines = Engines()
        client = make_client(2, engines)
        try:
            engines.stopped.add(1)
            await until(lambda: state(client, 1) == RankState.UNRESPONSIVE, "rank 1 Unresponsive")
            client.reqs_in_flight["req"] = identity(1)
            client.engine_inflight[identity(1)] += 1
            client._members.async_llm.output_processor.add("req")
            engines.lost.add(1)  # the process is gone: its connection goes with it
            await until(lambda: state(client, 1) == RankState.DEAD, "rank 1 Dead")
            assert isinstance(client._members.async_llm.output_processor.errors["req"], GracefulHTTPError)
            client.check_fleet_health()  # rank 0 still serves
            assert not engines.errors
        finally:
            stop_watching(client)

    asyncio.run(main())


def test_a_killed_rank_is_dead_within_an_interval_even_while_its_probe_is_out() -> None:
    async def main() -> None:
        engines = Engines()
        client = make_client(2, engines, timeout=60)
        try:
            engines.stopped.add(1)
            await until(lambda: engines.held.get(1), "a probe held by rank 1")
            engines.lost.add(1)  # killed before it ever answered: no waiting for the 60 s timeout
            await until(lambda: state(client, 1) == RankState.DEAD, "rank 1 Dead", within=2)
            assert state(client, 0) == RankState.SERVING
        finally:
            stop_watching(client)

    asyncio.run(main())


def test_health_is_503_only_when_no_rank_serves() -> None:
    async def main() -> None:
        engines = Engines()
        client = make_client(2, engines)
        try:
            engines.stopped.update({0, 1})
            await until(lambda: state(client, 0) == state(client, 1) == RankState.UNRESPONSIVE, "both Unresponsive")
            with pytest.raises(EngineDeadError):
                client.check_fleet_health()
            client._members.async_llm.output_processor.add("any")
            await client.add_request_async(SimpleNamespace(request_id="any", data_parallel_rank=None))
            error = client._members.async_llm.output_processor.errors["any"]
            assert isinstance(error, GracefulHTTPError)
            assert "no rank of the fleet takes requests" in error.message
            # What the hold in front of the API (`frontend.hold`) reads: why no rank takes requests, every rank named.
            closed = client._members.fleet.closed()
            assert closed is not None
            assert "rank 0 is Unresponsive" in closed
            assert "rank 1 is Unresponsive" in closed
            engines.cont(0)
            await until(lambda: state(client, 0) == RankState.SERVING, "rank 0 Serving")
            client.check_fleet_health()
            assert client._members.fleet.closed() is None
        finally:
            stop_watching(client)

    asyncio.run(main())


def test_a_stall_of_the_frontends_own_loop_blames_no_rank() -> None:
    async def main() -> None:
        engines = Engines()
        client = make_client(2, engines, timeout=0.3)
        transitions: list[tuple[int, RankState]] = []
        set_rank = client._members.fleet.set_rank

        def record(rank: int, state: RankState, message: str = "") -> None:
            transitions.append((rank, state))
            set_rank(rank, state, message)

        client._members.fleet.set_rank = record  # type: ignore[method-assign]
        try:
            await until(lambda: len(client._liveness.probes) == 2 or engines.utility_calls(1, "is_sleeping") >= 2,
                        "liveness calls going")
            # The loop blocks longer than the timeout while the engines' answers wait to be read.
            engines.stopped.update({0, 1})
            await until(lambda: engines.held.get(0) and engines.held.get(1), "calls outstanding on both ranks")
            time.sleep(0.6)  # noqa: ASYNC251  # the stall itself: a blocking call on the event loop
            # The answers are read just after the watcher's first tick past the stall, as from a socket.
            loop = asyncio.get_running_loop()
            loop.call_later(0.02, engines.cont, 0)
            loop.call_later(0.02, engines.cont, 1)
            await asyncio.sleep(0.1)  # several liveness ticks after the stall
            assert (state(client, 0), state(client, 1)) == (RankState.SERVING, RankState.SERVING)
            assert not [t for t in transitions if t[1] != RankState.SERVING], transitions
        finally:
            stop_watching(client)

    asyncio.run(main())


def routed(client: KubeDPLBClient, n: int) -> list[int]:
    """The ranks `n` new unpinned requests are routed to (each stays in flight)."""
    out = []
    for _ in range(n):
        request = SimpleNamespace(request_id=f"r{next(_REQUEST_IDS)}", data_parallel_rank=None, pooling_params=None)
        out.append(int.from_bytes(client.get_core_engine_for_request(request), "little"))
    return out


_REQUEST_IDS = itertools.count()


def pump_outputs(client: KubeDPLBClient, silent: set[int]) -> asyncio.Task[None]:
    """Each engine but the `silent` ones sends a step's outputs every 5 ms (as vLLM's output socket reader hands
    them to `process_engine_outputs`)."""
    async def pump() -> None:
        while True:
            for rank in range(len(client.core_engines)):
                if rank not in silent:
                    client._liveness.outputs(rank)
            await asyncio.sleep(0.005)

    return asyncio.create_task(pump())


def test_a_rank_that_ends_no_step_is_stalled_within_its_bound_and_routed_to_again_once_it_answers() -> None:
    """Stalled long before the liveness timeout: its state (Serving) and in-flight requests stay, new requests go to
    the other rank (one pinned to it is still sent), and its next answer ends it."""
    async def main() -> None:
        engines = Engines()
        client = make_client(2, engines, timeout=30.0, stall=StallPolicy(floor_s=0.1, step_factor=10))
        pump = pump_outputs(client, engines.stopped)
        try:
            await until(lambda: engines.utility_calls(1, "is_sleeping") >= 3, "rank 1 to answer liveness calls")
            assert sorted(routed(client, 2)) == [0, 1]
            engines.stopped.add(1)  # SIGSTOP: no step ends, no call is answered
            stopped_at = time.monotonic()
            await until(lambda: client._members.fleet.snapshot().rank(1).stalled, "rank 1 Stalled")
            assert time.monotonic() - stopped_at < 1.0  # the bound (0.1 s) and a tick, not the 30 s timeout
            snapshot = client._members.fleet.snapshot()
            rank = snapshot.rank(1)
            assert rank.state == RankState.SERVING
            assert rank.in_flight == 1
            assert rank.stalls_total == 1
            assert rank.stalled_since is not None
            assert any(why in rank.message for why in ("no output for", "no step ended for")), rank.message
            assert "1 request(s) in flight" in rank.message, rank.message
            assert snapshot.state == FleetState.SERVING
            assert "rank 1 Stalled" in snapshot.message
            assert routed(client, 4) == [0, 0, 0, 0]
            pinned = SimpleNamespace(request_id="pinned", data_parallel_rank=1, pooling_params=None)
            assert client.get_core_engine_for_request(pinned) == identity(1)
            client._members.async_llm.output_processor.add("pinned")
            assert client._members.refusal(pinned) is None  # sent: it waits for the rank, as in-flight ones do

            engines.cont(1)  # SIGCONT: its outputs and its answer are progress
            await until(lambda: not client._members.fleet.snapshot().rank(1).stalled, "rank 1 no longer Stalled")
            snapshot = client._members.fleet.snapshot()
            assert snapshot.rank(1).stalls_total == 1
            assert snapshot.message == ""
            assert 1 in routed(client, 2)
            assert not engines.errors, engines.errors
        finally:
            pump.cancel()
            stop_watching(client)

    asyncio.run(main())


@pytest.mark.parametrize("shown_by", [1, 0], ids=["its-own-cost", "a-new-rank-takes-the-fleets"])
def test_a_rank_prefilling_a_long_prompt_is_not_stalled_until_its_allowance_is_spent(shown_by: int) -> None:
    """A step that is long for a reason the frontend knows: its requests' prompt tokens still prefilling, at the cost
    per prompt token the rank showed, twice over; a rank that has shown none yet (one that joined or replaced a
    lost one) is allowed the cost another rank of the fleet showed. The same silence with nothing prefilling is a
    stall."""
    async def main() -> None:
        engines = Engines()
        client = make_client(2, engines, timeout=30.0, stall=StallPolicy(floor_s=0.1, step_factor=10))
        requests = client._members.async_llm.output_processor
        pump = pump_outputs(client, engines.stopped)
        try:
            await until(lambda: engines.utility_calls(1, "is_sleeping") >= 3, "rank 1 to answer liveness calls")
            # vLLM's stats of a finished request of rank `shown_by`: 64 prompt tokens prefilled in 8 ms (0.125 ms a
            # token).
            client._liveness.prefilled(shown_by, [SimpleNamespace(prefill_time=0.008, num_prompt_tokens=64)])
            long_prompt = SimpleNamespace(request_id="long", data_parallel_rank=1, pooling_params=None)
            assert client.get_core_engine_for_request(long_prompt) == identity(1)
            requests.request_states["long"] = SimpleNamespace(is_prefilling=True, prompt_len=4000, queue=None)
            assert client._members.prefill_tokens_on(1) == 4000
            liveness = client._liveness
            bound = liveness.progress[1].bound(liveness.options.stall, 4000, fleet_prefill_cost(
                liveness.progress.values()))
            assert 1.0 <= bound < 1.2  # 0.1 s + 2 x 4000 x 0.125 ms
            engines.stopped.add(1)  # one long step
            await asyncio.sleep(0.6)  # six stall floors: still within the allowance
            assert not client._members.fleet.snapshot().rank(1).stalled
            assert sorted(routed(client, 3)) == [0, 0, 1]  # not avoided: by load, rank 1 had the long one
            requests.request_states["long"].is_prefilling = False  # its first token: the step was not the prefill
            await until(lambda: client._members.fleet.snapshot().rank(1).stalled, "rank 1 Stalled")
            engines.cont(1)
            await until(lambda: not client._members.fleet.snapshot().rank(1).stalled, "rank 1 no longer Stalled")
        finally:
            pump.cancel()
            stop_watching(client)

    asyncio.run(main())


def test_a_rank_that_answers_but_sends_no_output_while_busy_is_stalled_until_it_does() -> None:
    """The outputs' signal alone: its liveness calls are answered, yet its requests get nothing (a step that never
    ends while the engine core's loop still turns); one output ends the stall."""
    async def main() -> None:
        engines = Engines()
        client = make_client(2, engines, timeout=30.0, stall=StallPolicy(floor_s=0.1, step_factor=10))
        silent: set[int] = set()
        task = pump_outputs(client, silent)
        try:
            await until(lambda: engines.utility_calls(1, "is_sleeping") >= 3, "rank 1 to answer liveness calls")
            silent.add(1)
            await asyncio.sleep(0.3)  # three floors without an output, but nothing in flight: no stall
            assert not client._members.fleet.snapshot().rank(1).stalled
            assert sorted(routed(client, 2)) == [0, 1]
            await until(lambda: client._members.fleet.snapshot().rank(1).stalled, "rank 1 Stalled")
            assert "no output for" in client._members.fleet.snapshot().rank(1).message
            assert engines.utility_calls(1, "is_sleeping") >= 4  # its calls are answered all along
            assert routed(client, 2) == [0, 0]
            silent.discard(1)
            await until(lambda: not client._members.fleet.snapshot().rank(1).stalled, "rank 1 no longer Stalled")
        finally:
            task.cancel()
            stop_watching(client)

    asyncio.run(main())


def test_stall_detection_is_off_with_a_zero_stall_timeout() -> None:
    async def main() -> None:
        engines = Engines()
        client = make_client(2, engines, timeout=0.5, stall=StallPolicy(floor_s=0))
        try:
            await until(lambda: engines.utility_calls(1, "is_sleeping") >= 3, "rank 1 to answer liveness calls")
            engines.stopped.add(1)
            await until(lambda: state(client, 1) == RankState.UNRESPONSIVE, "rank 1 Unresponsive")
            assert client._members.fleet.snapshot().rank(1).stalls_total == 0
        finally:
            stop_watching(client)

    asyncio.run(main())


def test_a_stalled_rank_that_stays_silent_is_unresponsive_at_the_liveness_timeout() -> None:
    async def main() -> None:
        engines = Engines()
        client = make_client(2, engines, timeout=0.5, stall=StallPolicy(floor_s=0.05, step_factor=10))
        try:
            await until(lambda: engines.utility_calls(1, "is_sleeping") >= 3, "rank 1 to answer liveness calls")
            engines.stopped.add(1)
            await until(lambda: client._members.fleet.snapshot().rank(1).stalled, "rank 1 Stalled")
            await until(lambda: state(client, 1) == RankState.UNRESPONSIVE, "rank 1 Unresponsive")
            rank = client._members.fleet.snapshot().rank(1)
            assert not rank.stalled, rank
            assert "liveness call" in rank.message, rank
            assert 1 not in client._members.stalled
            assert 1 in client._members.unroutable
            engines.cont(1)
            await until(lambda: state(client, 1) == RankState.SERVING, "rank 1 Serving again")
            assert not client._members.fleet.snapshot().rank(1).stalled
        finally:
            stop_watching(client)

    asyncio.run(main())


def test_the_liveness_watcher_is_restarted_if_it_fails(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        engines = Engines()
        client = make_client(2, engines)
        try:
            first = client._liveness.task
            original = client._liveness.tick
            failures = [RuntimeError("boom")]

            async def failing_tick(now: float) -> None:
                if failures:
                    raise failures.pop()
                await original(now)

            client._liveness.tick = failing_tick  # type: ignore[method-assign]
            await until(lambda: client._liveness.task is not first, "a new watcher task")
            engines.stopped.add(1)
            await until(lambda: state(client, 1) == RankState.UNRESPONSIVE, "detection by the new watcher")
        finally:
            stop_watching(client)

    with caplog.at_level(logging.ERROR, logger="corefleet.frontend"):
        asyncio.run(main())
    assert "liveness watcher failed (boom); restarting it" in caplog.text


def test_fan_out_utilities_skip_dead_and_unresponsive_ranks() -> None:
    async def main() -> None:
        engines = Engines()
        client = make_client(3, engines)
        try:
            assert await client.call_utility_all_async("reset_prefix_cache") == [False, False, False]
            engines.stopped.add(1)
            await until(lambda: state(client, 1) == RankState.UNRESPONSIVE, "rank 1 Unresponsive")
            engines.lost.add(2)
            await until(lambda: state(client, 2) == RankState.DEAD, "rank 2 Dead")
            before = engines.utility_calls(1, "reset_prefix_cache")
            result = await asyncio.wait_for(client.call_utility_all_async("reset_prefix_cache"), 5)
            assert result == [False]  # rank 0's answer only
            assert engines.utility_calls(1, "reset_prefix_cache") == before  # never sent to it
            # A rank that stops while the call waits is given up on once it is Unresponsive.
            engines.cont(1)
            await until(lambda: state(client, 1) == RankState.SERVING, "rank 1 Serving")
            engines.stopped.add(0)
            assert await asyncio.wait_for(client.call_utility_all_async("is_sleeping"), 5) == [False]
            engines.stopped.add(1)
            await until(lambda: state(client, 1) == RankState.UNRESPONSIVE, "rank 1 Unresponsive")
            with pytest.raises(GracefulHTTPError) as refused:
                await asyncio.wait_for(client.call_utility_all_async("wake_up", None), 5)
            assert refused.value.http_status == HTTPStatus.SERVICE_UNAVAILABLE
            assert "rank 2 is Dead" in refused.value.message
            assert not engines.errors
        finally:
            stop_watching(client)

    asyncio.run(main())


def test_the_public_app_does_not_serve_vllms_elastic_ep_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Change 8, on the app vLLM's API server builds (`build_and_serve` calls `entry.build_app`)."""
    from fastapi.testclient import TestClient

    monkeypatch.setattr(entry, "build_app", entry.build_app)  # restored after the test
    args = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(["tiny"])
    stock = {r.path for r in entry.build_app(args, ("generate",), None).router.routes}
    assert set(vllm_compat.UNSERVED_ROUTES) <= stock  # what vLLM mounts

    vllm_compat.install_public_route_filter()
    app = entry.build_app(args, ("generate",), None)
    paths = {r.path for r in app.router.routes}
    assert not set(vllm_compat.UNSERVED_ROUTES) & paths
    assert paths == stock - set(vllm_compat.UNSERVED_ROUTES)  # nothing else goes
    http = TestClient(app)
    for path in vllm_compat.UNSERVED_ROUTES:
        assert http.post(path, json={"new_data_parallel_size": 4}).status_code == 404


@pytest.mark.parametrize(("engine0", "store", "want"), [
    (None, None, ("127.0.0.1", 0)),  # dense: INIT carries the frontend's own config
    ("10.0.0.7", None, ("10.0.0.7", 0)),  # MoE: engine 0 is the DP master
    ("10.0.0.7", 29554, ("10.0.0.7", 29554)),  # elastic EP: and the startup's store beside it
])
def test_init_advertises_engine_0_and_its_coordination_store(
        engine0: str | None, store: int | None, want: tuple[str, int]) -> None:

    own = ParallelConfig(data_parallel_size=2)
    advertised = vllm_compat.advertised_parallel_config(own, engine0, store)
    assert (advertised.data_parallel_master_ip, advertised._coord_store_port) == want
    assert (own.data_parallel_master_ip, own._coord_store_port) == ("127.0.0.1", 0)  # the frontend's own: unchanged
    assert advertised.compute_hash() == own.compute_hash()  # READY's hash is checked against the frontend's


@pytest.mark.parametrize(("elastic", "communicator"), [(True, "pynccl"), (False, "torch_gloo")])
def test_eplb_is_set_on_a_built_config_as_a_gpu_would_have_it(elastic: bool, communicator: str) -> None:
    """Change 9: this CPU platform refuses EPLB at construction; set afterwards, the flags reach the hash, and
    the EPLB communicator is the one `ParallelConfig.__post_init__` picks on CUDA without NIXL."""

    assert not is_nixl_available()  # this machine's vLLM: otherwise the communicator would be "nixl"
    with pytest.raises(ValueError, match="only supported on CUDA devices"):
        ParallelConfig(data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True)
    config = ParallelConfig(data_parallel_size=2, enable_expert_parallel=True)
    plain = config.compute_hash()
    vllm_compat.set_eplb_as_on_a_gpu(config, enable_eplb=True, enable_elastic_ep=elastic)
    assert (config.enable_eplb, config.enable_elastic_ep, config.eplb_config.communicator) == (True, elastic,
                                                                                               communicator)
    assert config.compute_hash() != plain


def test_the_elastic_ep_maximum_is_set_as_a_gpu_would_have_it() -> None:
    """Change 9: built with elastic EP off, vLLM makes the maximum the DP size; set afterwards, a maximum above the
    size (a fleet's maxReplicas) reaches the hash as on a GPU, where the engines hash it."""

    config = ParallelConfig(data_parallel_size=2, enable_expert_parallel=True, elastic_ep_max_dp_size=4)
    assert config.elastic_ep_max_dp_size == 2  # what construction with elastic EP off leaves
    at_size = config.compute_hash()
    vllm_compat.set_eplb_as_on_a_gpu(config, enable_eplb=True, enable_elastic_ep=True, elastic_ep_max_dp_size=4)
    assert config.elastic_ep_max_dp_size == 4
    other = ParallelConfig(data_parallel_size=2, enable_expert_parallel=True)
    vllm_compat.set_eplb_as_on_a_gpu(other, enable_eplb=True, enable_elastic_ep=True, elastic_ep_max_dp_size=2)
    assert config.compute_hash() != other.compute_hash() != at_size  # the maximum is hashed


# vLLM's model registry inspects an architecture the first time in a subprocess that imports its model module (and
# torch), then caches what it found (~/.cache/vllm/modelinfos): 6 s on this machine idle, over the tier's 30 s on a
# cold one while the node's images and control plane build beside the fast tier.
@pytest.mark.timeout(180)
def test_the_frontends_config_keeps_the_engines_eplb_settings(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Change 9 on a real EngineArgs: an MoE frontend's config, built on this CPU platform, has what the engines'
    have on a GPU: EPLB and elastic EP on, their maximum, and redundant experts (refused with EPLB off)."""

    from corefleet_harness.tinymodel import write_tiny_model

    monkeypatch.setattr(EngineArgs, "create_engine_config", EngineArgs.create_engine_config)  # restored after
    vllm_compat.install_frontend_eplb_config()
    model = write_tiny_model(tmp_path / "m", moe=True)
    args = EngineArgs(model=str(model), data_parallel_size=2, data_parallel_size_local=0, enable_expert_parallel=True,
                      enable_eplb=True, enable_elastic_ep=True, elastic_ep_max_dp_size=4,
                      eplb_config=EPLBConfig(num_redundant_experts=4), load_format="dummy", max_model_len=256)
    pc = args.create_engine_config().parallel_config
    assert (pc.enable_eplb, pc.enable_elastic_ep, pc.elastic_ep_max_dp_size) == (True, True, 4)
    assert pc.eplb_config.num_redundant_experts == 4
    assert (args.enable_eplb, args.eplb_config.num_redundant_experts) == (True, 4)  # the caller's args as they were


def _wait_for_ready_as_vllm_does(router: Any, engines: int) -> dict[bytes, bytes]:
    """`MPClient.__init__`'s wait for one ready response per engine, as vLLM 0.32.0 writes it (pinned in
    tests/e2e/test_vllm_pins.py), through the `zmq` module its core_client module sees."""
    from vllm.v1.engine import core_client

    identities = {rank.to_bytes(2, "little") for rank in range(engines)}
    seen: dict[bytes, bytes] = {}
    sync_input_socket = core_client.zmq.Socket.shadow(router)
    while identities:
        assert sync_input_socket.poll(timeout=5000), f"no ready response from {sorted(identities)}"
        engine, payload = sync_input_socket.recv_multipart()
        identities.remove(engine)
        seen[engine] = payload
    return seen


@pytest.mark.parametrize("absent_answers", [False, True], ids=["absent engine silent", "absent engine answers"])
def test_an_engine_left_out_of_the_attach_stands_in_for_vllms_ready_wait(absent_answers: bool) -> None:
    """vllm_compat change 10: attaching with rank 1 left out, vLLM's wait ends once ranks 0 and 2 answered, rank 1
    standing in with a copy of a real ready response (or with its own, had it answered); outside the attach the
    module's zmq is zmq again."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealers = []
    try:
        for rank in ((1, 0, 2) if absent_answers else (0, 2)):
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.IDENTITY, identity(rank))
            dealer.connect(f"tcp://127.0.0.1:{port}")
            dealer.send(f"ready {rank}".encode())
            dealers.append(dealer)
            if rank == 1:  # queued first: read before the others
                assert router.poll(5000)
        from vllm.v1.engine import core_client

        with vllm_compat.attaching(lambda _: None, present=2, absent=[identity(1)]):
            seen = _wait_for_ready_as_vllm_does(router, 3)
        assert core_client.zmq is zmq
    finally:
        for s in (*dealers, router):
            s.close(linger=0)
        ctx.term()
    assert seen[identity(0)] == b"ready 0"
    assert seen[identity(2)] == b"ready 2"
    assert seen[identity(1)] in ((b"ready 1",) if absent_answers else (b"ready 0", b"ready 2"))


def test_vllms_output_hook_tells_progress_and_drops_what_a_stalled_rank_sends_for_a_moved_request() -> None:
    """`process_engine_outputs` (vLLM calls it on every message of engine outputs, before its output handling): the
    rank's progress is noted, and a finish the old rank reports for a request moved away from it does not take the
    request out of vLLM's routing tables, where it now runs on its new rank."""
    async def main() -> None:
        engines = Engines()
        client = make_client(2, engines, timeout=30.0, stall=StallPolicy(floor_s=0.1, step_factor=10))
        try:
            assert client._rescue is not None
            client.reqs_in_flight["moved"] = identity(0)
            client.engine_inflight[identity(0)] += 1
            client._rescue.moved["moved"] = 1
            await KubeDPLBClient.process_engine_outputs(
                client, EngineCoreOutputs(engine_index=1, finished_requests={"moved"}))
            assert client.reqs_in_flight["moved"] == identity(0)
            assert client._liveness.progress[1].last_output is not None
            await KubeDPLBClient.process_engine_outputs(
                client, EngineCoreOutputs(engine_index=0, finished_requests={"moved"}))
            assert "moved" not in client.reqs_in_flight
            assert client.engine_inflight[identity(0)] == 0
        finally:
            stop_watching(client)

    asyncio.run(main())


@pytest.mark.parametrize(("frontends", "counted", "first_rank_kept"),
                         [(1, 2, False), (2, 2, True), (2, 3, False)])
def test_a_new_prefix_keeps_its_first_rank_within_one_request_in_the_loads_unit(frontends: int, counted: int,
                                                                               first_rank_kept: bool) -> None:
    """With two frontends each request a frontend routes counts twice in vLLM's loads until the coordinator's next
    counts: a new prefix's first rank two over the least loaded is within one request, and every frontend sends the
    prefix there; with one frontend the loads are exact in-flight counts, and two over is two requests."""
    async def main() -> None:
        engines = Engines()
        client = make_client(3, engines, timeout=30.0, routing=RoutingPolicy.PREFIX_AFFINITY,
                             affinity=AffinitySettings(prefix_tokens=8))
        client.client_count = frontends
        try:
            tokens = list(range(200, 212))
            first = rendezvous(block_hashes(tokens, 4)[1], range(3))[0]
            if frontends == 1:
                client.engine_inflight[identity(first)] = counted
            else:
                client.lb_engines[first] = [counted, 0, 0.0]
            request = SimpleNamespace(request_id="r", data_parallel_rank=None, pooling_params=None,
                                      prompt_token_ids=tokens)
            assert (client.get_core_engine_for_request(request) == identity(first)) is first_rank_kept
        finally:
            stop_watching(client)

    asyncio.run(main())


def test_prefix_affinity_routes_a_shared_prefix_to_one_rank_avoids_stalled_ranks_and_counts_its_decisions() -> None:
    """With `--routing prefix-affinity` the client routes by `frontend.affinity` and keeps vLLM's bookkeeping:
    the request's engine for aborts, the in-flight count, the load the router sees until the next stats."""
    async def main() -> None:
        engines = Engines()
        client = make_client(3, engines, timeout=30.0, routing=RoutingPolicy.PREFIX_AFFINITY,
                             affinity=AffinitySettings(prefix_tokens=8, balance=100.0))
        try:
            shared = list(range(100, 108))

            def request(rid: str, tokens: list[int], pinned: int | None = None) -> Any:
                return SimpleNamespace(request_id=rid, data_parallel_rank=pinned, pooling_params=None,
                                       prompt_token_ids=tokens)

            picks = [client.get_core_engine_for_request(request(f"q{n}", shared + [n] * 5)) for n in range(6)]
            assert len(set(picks)) == 1
            home = rank_of(picks[0])
            assert client.engine_inflight[picks[0]] == 6
            assert all(client.reqs_in_flight[f"q{n}"] == picks[0] for n in range(6))
            assert client.lb_engines[home][0] == 6  # counted until the coordinator's next stats
            first = request("again", [*shared, 1, 2, 3, 4])
            assert client.get_core_engine_for_request(first) == picks[0]
            assert first.data_parallel_rank is None  # the pin was only for vLLM's router
            # A request pinned by its client, and one too short for a block, are vLLM's to route.
            assert client.get_core_engine_for_request(request("pinned", shared, pinned=(home + 1) % 3)) \
                == identity((home + 1) % 3)
            short = client.get_core_engine_for_request(request("short", [1, 2, 3]))
            # The prefix's rank Stalled: its requests spill to the prefix's next rank while it is, and go back once it
            # makes progress.
            client._members.avoid(home, "no output")
            moved = client.get_core_engine_for_request(request("while-stalled", shared + [9] * 5))
            assert moved != picks[0]
            client._members.stop_avoiding(home)
            assert client.get_core_engine_for_request(request("after", shared + [8] * 5)) == picks[0]
            snapshot = client._members.fleet.snapshot()
            assert (snapshot.rank(home).new_prefix_total, snapshot.rank(home).affinity_total) == (1, 7)
            assert snapshot.rank(rank_of(moved)).spilled_total == 1
            assert sum(snapshot.rank(r).requests_total for r in range(3)) == 11
            assert rank_of(short) in range(3)
        finally:
            stop_watching(client)

    asyncio.run(main())
