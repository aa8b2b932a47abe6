# SPDX-License-Identifier: Apache-2.0
"""The fleet's members as vLLM's client routes to them: the one interface the frontend's components change them through.

vLLM's DPLB client routes each request to one of `core_engines` by the loads in `lb_engines`, and
its stats task follows the size it is told (`SCALE_ELASTIC_EP`). corefleet's components (liveness,
dense and elastic-EP resizes, replacement: `frontend.liveness`, `.resize`, `.elastic`, `.replace`)
change what a rank is to the router, and only through a `Membership`:

* per rank, its record (counters bumped on the event loop, its state in `Fleet`), why no request
  may go to it (`unroutable`: dead, unresponsive, leaving), whether it died while leaving (`lost`),
  and whether the coordinator's load for it is stale (a new engine, or one back from Unresponsive);
* the routing tables, changed together: a scale-up's new ranks (`add_ranks`), a scale-down's cut
  (`cut_routing`, then `shrink`), each announced to vLLM's stats task and through it to the
  coordinator (`announce_size`), and a retired rank's bookkeeping (`retire`);
* requests: which run on a rank, and ending them with an explicit error (`fail_requests`);
* what is sent to one engine outside vLLM's request path: utility calls, aborts, connection checks;
* the handshake of ranks that join a serving fleet (`joiner`, a `frontend.handshake.Handshake`).

It runs on vLLM's event loop only, except `lb_counts` and `in_flight` (`fleet.LoadView`), which
the admin server's threads read.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from http import HTTPStatus
from typing import Any, Protocol

import msgspec
import zmq
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequestType
from vllm.v1.engine import FinishReason as VllmFinishReason

from corefleet_client import vllm_compat
from corefleet_client.admin import RankState, ResizeOperation
from corefleet_client.frontend.affinity import PrefixAffinity
from corefleet_client.frontend.fleet import Fleet, RankRecord, identity
from corefleet_client.frontend.stats import FleetStatLoggers
from corefleet_client.frontend.types import STALLED_LOAD, UNROUTABLE, Decision, EngineClient, ResizeFailed

logger = logging.getLogger("corefleet.frontend")

# How long the stats task may take to apply a SCALE_ELASTIC_EP (it runs on this event loop).
ANNOUNCE_TIMEOUT_S = 10.0
# What a connection check aborts: no request ever has this id, so it does nothing.
CONNECTION_CHECK_REQUEST_ID = "corefleet-connection-check"


def routing_counts(counts: list[list[int | float]], size: int, unroutable: Iterable[int],
                   stalled: Iterable[int] = ()) -> list[list[int | float]]:
    """The load the router reads for each of `size` ranks, from the coordinator's last counts.

    The coordinator's counts may be shorter than the fleet: a publish it made before it applied a
    scale-up (`SCALE_ELASTIC_EP`) can reach the stats task after it, and the coordinator publishes
    again only when a count changes, or every 5 s. vLLM's router scans only `len(counts)` ranks, so
    the new ranks would get no unpinned request meanwhile: they count as idle until the coordinator
    knows them. Ranks that take no request (dead, unresponsive, leaving) look fully loaded. Stalled
    ranks (`frontend.progress`) look loaded more than any working rank, less than those: the router
    picks one only when every rank that takes requests is stalled, and then by their own loads.
    """
    if len(counts) < size:
        counts = counts + [[0, 0, 0.0] for _ in range(size - len(counts))]
    closed = {rank for rank in unroutable if rank < len(counts)}
    for rank in closed:
        counts[rank] = [UNROUTABLE, UNROUTABLE, 0.0]
    avoided = {rank for rank in stalled if rank < len(counts)} - closed
    if avoided and len(avoided) + len(closed) < len(counts):
        for rank in avoided:
            counts[rank] = [0, STALLED_LOAD, 0.0]
    return counts


def rank_of(engine: bytes) -> int:
    return int.from_bytes(engine, "little")


class Joiner(Protocol):
    """The handshake of ranks that join a serving fleet (`frontend.handshake.Handshake`)."""

    def discard_stale_ready_responses(self) -> None:
        """Drop what ranks of an earlier, failed join left on the requests socket."""
        ...

    async def join(self, op: ResizeOperation, ranks: list[int], address: str, parallel_config: Any = None) -> None:
        """HELLO -> INIT -> READY with exactly `ranks` on `address`, within the operation's join timeout;
        raises ResizeFailed. `parallel_config`: the one INIT advertises, if not the fleet's own."""
        ...

    async def read_ready_responses(self, ranks: list[int], wait_s: float = ...) -> None:
        """Each joined rank's ready response from the requests socket (checked, then applied as vLLM does), within
        `wait_s` (default: the bound after a READY)."""
        ...

    def abort(self, reason: str, resize_id: str | None = None) -> None:
        """Stop the running join (only if it is `resize_id`'s, when given)."""
        ...


class Membership:
    """The fleet's members as vLLM's client routes to them (see the module docstring)."""

    def __init__(self, client: EngineClient, fleet: Fleet, joiner: Joiner,
                 vllm_abort: Callable[[list[str], bytes], Awaitable[None]],
                 affinity: PrefixAffinity | None = None) -> None:
        self.client = client
        self.affinity = affinity  # prefix-affinity routing (None: vLLM's least-loaded router alone)
        self.fleet = fleet
        self.joiner = joiner
        self._vllm_abort = vllm_abort  # vLLM's own `_abort_requests` (not corefleet's override of it)
        self.records: dict[int, RankRecord] = {rank: fleet.record(rank) for rank in range(len(client.core_engines))}
        self.unroutable: dict[int, str] = {}  # rank -> why no request is routed to it
        self.stalled: dict[int, str] = {}  # rank -> why new requests avoid it while another rank takes them
        self.lost: dict[int, str] = {}  # leaving ranks that died while draining -> why
        # Ranks back in the routing that no request was routed to yet -> their requests_total then.
        self.stale_loads: dict[int, int] = {}
        self.async_llm: Any = None  # set once AsyncLLM is built (vllm_compat change 5)
        self.stat_loggers: FleetStatLoggers | None = None

    # ---- what the admin API reads (from its own threads) ----------------------------------------
    def lb_counts(self, rank: int) -> tuple[int, int, float]:
        counts = self.client.lb_engines
        if rank >= len(counts):
            return 0, 0, 0.0
        waiting, running, kv = counts[rank]
        if waiting >= UNROUTABLE:
            return 0, 0, 0.0
        return int(waiting), int(running), float(kv)

    def in_flight(self, rank: int) -> int:
        return int(self.client.engine_inflight[identity(rank)])

    # ---- routing -------------------------------------------------------------------------------
    def any_serving(self) -> bool:
        return any(r.state == RankState.SERVING for r in self.records.values())

    def state(self, rank: int) -> RankState | None:
        record = self.records.get(rank)
        return None if record is None else record.state

    def before_routing(self) -> None:
        """What the router must read before each choice (see `routing_counts` and `ignore_load_until_routed`)."""
        client = self.client
        if self.unroutable or self.stalled or len(client.lb_engines) < len(client.core_engines):
            client.lb_engines = routing_counts(client.lb_engines, len(client.core_engines), self.unroutable,
                                               self.stalled)
        self.ignore_stale_loads()

    def routed(self, engine: bytes, decision: Decision | None = None) -> None:
        """A new request went to `engine` (by prefix affinity: `decision`)."""
        record = self.records[rank_of(engine)]
        record.requests_total += 1
        if decision == Decision.NEW:
            record.new_prefix_total += 1
        elif decision == Decision.AFFINITY:
            record.affinity_total += 1
        elif decision == Decision.SPILL:
            record.spilled_total += 1

    def routing_loads(self) -> dict[int, float]:
        """After `before_routing`: the ranks a new request may go to, with their loads: this client's requests in
        flight on each, exact, where it is the fleet's only client; with several frontends, as vLLM's router scores
        them (the greater of the coordinator's waiting + running and this client's in-flight count times the
        clients): the coordinator's counts lag by up to its publish interval, so a rank whose request just finished
        still looks busy for that long. Stalled ranks only where every rank that takes requests is stalled."""
        client = self.client
        open_ranks = [rank for rank in range(min(len(client.core_engines), len(client.lb_engines)))
                      if rank not in self.unroutable]
        ranks = [rank for rank in open_ranks if rank not in self.stalled] or open_ranks
        loads: dict[int, float] = {}
        for rank in ranks:
            in_flight = client.engine_inflight[identity(rank)]
            if client.client_count == 1:
                loads[rank] = float(in_flight)
            else:
                waiting, running, _ = client.lb_engines[rank]
                loads[rank] = float(max(client.client_count * in_flight, waiting + running))
        return loads

    def choose_by_prefix(self, request: Any) -> tuple[int, Decision] | None:
        """Prefix-affinity's rank for a new request that is not pinned (`frontend.affinity`), after `before_routing`;
        None where the policy is off or the prompt has no full block (vLLM's router picks by load)."""
        if self.affinity is None or request.data_parallel_rank is not None \
                or request.request_id in self.client.reqs_in_flight:
            return None
        # With several frontends a request routed here counts once per frontend until the coordinator's next counts
        # (`routing_loads`): one request of slack is that many.
        return self.affinity.choose(request.prompt_token_ids, self.routing_loads(), slack=self.client.client_count)

    def refusal(self, request: Any) -> str | None:
        """Why a new request cannot be routed at all (pinned to a rank that takes none, or no rank takes any)."""
        if request.request_id in self.client.reqs_in_flight:
            return None
        pinned = request.data_parallel_rank
        if pinned is not None and pinned in self.unroutable:
            return f"data_parallel_rank {pinned} takes no requests: {self.unroutable[pinned]}"
        if pinned is None:
            why = self.closed()
            if why is not None:
                return f"no rank of the fleet takes requests: {why}"
        return None

    def closed(self) -> str | None:
        """None while some rank takes new requests; else why none does."""
        unroutable = self.unroutable
        if not unroutable or any(rank not in unroutable for rank in range(len(self.client.core_engines))):
            return None
        return "; ".join(unroutable.values()) or "the fleet has no rank"

    def unsend(self, request_id: str) -> int | None:
        """A request whose send failed: forget where it went; that rank, or None if it was not recorded."""
        engine = self.client.reqs_in_flight.pop(request_id, None)
        if engine is None:
            return None
        self.client.engine_inflight[engine] -= 1
        rank = rank_of(engine)
        self.records[rank].requests_total -= 1
        return rank

    def stop_routing(self, rank: int, why: str) -> None:
        self.unroutable[rank] = why
        self.stalled.pop(rank, None)

    def avoid(self, rank: int, why: str) -> None:
        """A Stalled rank: new requests go elsewhere while another rank takes them (`routing_counts`)."""
        self.stalled[rank] = why

    def stop_avoiding(self, rank: int) -> bool:
        """A Stalled rank made progress: routed by its load again; whether it was Stalled."""
        if self.stalled.pop(rank, None) is None:
            return False
        if rank not in self.unroutable:
            self.ignore_load_until_routed(rank)
        return True

    def route_again(self, rank: int) -> None:
        """A rank takes requests again (its coordinator counts may be older than what it runs now)."""
        self.unroutable.pop(rank, None)
        self.ignore_load_until_routed(rank)

    def ignore_load_until_routed(self, rank: int) -> None:
        """A rank back in the routing: the coordinator's load for it counts as zero until a request is routed
        to it (a replaced rank's new engine, or a rank back from Unresponsive, whose last published counts
        may be older than what it runs now). The router still counts this client's own requests on it
        exactly (vLLM's score is the greater of the two)."""
        lb_engines = self.client.lb_engines
        if rank < len(lb_engines):
            lb_engines[rank] = [0, 0, 0.0]
        self.stale_loads[rank] = self.records[rank].requests_total

    def ignore_stale_loads(self) -> None:
        """Before a routing choice: such a rank's load is zero until its first request."""
        stale = self.stale_loads
        if not stale:
            return
        lb_engines = self.client.lb_engines
        for rank, total in list(stale.items()):
            record = self.records.get(rank)
            if record is None or record.requests_total != total or record.state != RankState.SERVING \
                    or rank in self.unroutable or rank in self.stalled or rank >= len(lb_engines):
                del stale[rank]  # it got a request (its engine now publishes its own counts), or left the routing
            else:
                lb_engines[rank] = [0, 0, 0.0]

    # ---- the routing tables: ranks join and leave ---------------------------------------------
    async def add_ranks(self, new: list[int], size: int) -> None:
        """New ranks into the routing: the stat loggers first (vLLM's Prometheus logger raises on an unknown
        engine index), then the identities, the size, and `SCALE_ELASTIC_EP` to the stats task and coordinator."""
        if self.stat_loggers is not None:
            self.stat_loggers.resize(size)
        for rank in new:
            self.records[rank] = self.fleet.record(rank)
            self.fleet.set_rank(rank, RankState.SERVING)
        self.client.core_engines.extend(identity(rank) for rank in new)
        self.client.vllm_config.parallel_config.data_parallel_size = size
        await self.announce_size(size)

    def cut_routing(self, size: int) -> list[int]:
        """The ranks from `size` on leave the routing: `core_engines`, `lb_engines` and `engine_ranks_managed`
        are cut together (`len(lb_engines) <= len(core_engines)` must hold at every moment, or the router
        raises). The new `engine_ranks_managed`, for `shrink`."""
        client = self.client
        client.core_engines = client.core_engines[:size]
        client.lb_engines = client.lb_engines[:size]
        client.engine_ranks_managed = marker = list(range(size))
        return marker

    async def shrink(self, frm: int, to: int, marker: list[int]) -> None:
        """After `cut_routing(to)`: the KV-cache total, the size, the stat loggers (the leaving ranks' series go)
        and `SCALE_ELASTIC_EP(to)` to the stats task and the coordinator."""
        vllm_config = self.client.vllm_config
        cache_config = vllm_config.cache_config
        if cache_config.num_gpu_blocks:  # the sum over the ranks (MPClient._apply_ready_response)
            cache_config.num_gpu_blocks = cache_config.num_gpu_blocks // frm * to
        vllm_config.parallel_config.data_parallel_size = to
        if self.stat_loggers is not None:
            self.stat_loggers.resize(to)
        await self.announce_size(to, replaced=marker)

    def retire(self, rank: int) -> str | None:
        """A rank that left the routing is forgotten; why it died while leaving, if it did."""
        died = self.lost.pop(rank, None)
        self.unroutable.pop(rank, None)
        self.stalled.pop(rank, None)
        self.records.pop(rank, None)
        self.client.engine_inflight.pop(identity(rank), None)
        if self.affinity is not None:
            self.affinity.forget(rank)
        return died

    async def announce_size(self, size: int, replaced: list[int] | None = None) -> None:
        """`SCALE_ELASTIC_EP(size)` to vLLM's stats task (which tells the coordinator), and wait until it applied it.

        The stats task asserts the configured size equals the message's when it reads it, so the
        next resize may only change the size after that: wait until it has set `engine_ranks_managed`
        (a new list object, `replaced` being the one set here for a shrink).
        """
        client = self.client
        client._ensure_stats_update_task()
        await client.first_req_send_socket.send(msgspec.msgpack.encode(("SCALE_ELASTIC_EP", size)))
        deadline = time.monotonic() + ANNOUNCE_TIMEOUT_S
        while True:
            ranks = client.engine_ranks_managed
            applied = ranks is not replaced if replaced is not None else len(ranks) == size
            if applied:
                return
            if time.monotonic() > deadline:
                raise ResizeFailed(f"vLLM's stats task did not apply the new size {size} within "
                                   f"{ANNOUNCE_TIMEOUT_S:g}s", fleet_intact=False)
            await asyncio.sleep(0.01)

    # ---- requests ------------------------------------------------------------------------------
    def prefill_tokens_on(self, rank: int) -> int:
        """Prompt tokens of the rank's requests that have no first token yet (vLLM's output processor knows each
        request's prompt length and whether it is still prefilling)."""
        states = getattr(getattr(self.async_llm, "output_processor", None), "request_states", None)
        if not states:
            return 0
        total = 0
        for request_id in self.requests_on(rank):
            state = states.get(request_id)
            if state is not None and state.is_prefilling:
                total += int(state.prompt_len or 0)
        return total

    def requests_on(self, rank: int) -> list[str]:
        engine = identity(rank)
        return [rid for rid, eng in self.client.reqs_in_flight.items() if eng == engine]

    def fail_requests(self, request_ids: Iterable[str], message: str, rank: int | None = None) -> None:
        """End requests with an explicit error: forget them here, and in AsyncLLM with the message."""
        ids = list(request_ids)
        if not ids:
            return
        client = self.client
        for rid in ids:
            engine = client.reqs_in_flight.pop(rid, None)
            if engine is not None:
                client.engine_inflight[engine] -= 1
        if rank is not None and rank in self.records:
            self.records[rank].failed_total += len(ids)
        if self.async_llm is not None:
            vllm_compat.fail_requests(self.async_llm, ids, message, HTTPStatus.SERVICE_UNAVAILABLE)
        else:  # no AsyncLLM (tests driving the client alone): vLLM's own error finish
            client.outputs_queue.put_nowait(EngineCoreOutputs(
                engine_index=rank or 0,
                outputs=[EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason=VllmFinishReason.ERROR)
                         for rid in ids]))

    # ---- messages to one engine --------------------------------------------------------------
    async def send_utility_call(self, engine: bytes, method: str, args: tuple[Any, ...]) -> asyncio.Future[Any]:
        """Send a utility call to one engine; the future its answer resolves. Raises zmq.ZMQError if not sent.

        The future is registered in vLLM's `utility_results` as vLLM's own `_call_utility_async`
        does, and stays there until vLLM's output task pops it with the answer (only a call that
        was never sent is removed again).
        """
        client = self.client
        call_id = uuid.uuid1().int >> 64
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        # An error answer is still an answer: keep it from being logged as never retrieved.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        client.utility_results[call_id] = future
        message = (EngineCoreRequestType.UTILITY.value,
                   *client.encoder.encode((client.client_index, call_id, method, args)))
        try:
            await client.input_socket.send_multipart((engine, *message), copy=False)
        except zmq.ZMQError:
            client.utility_results.pop(call_id, None)
            raise
        client._ensure_output_queue_task()
        return future

    async def send_connection_check(self, engine: bytes) -> None:
        """A message that fails (EHOSTUNREACH) only if the connection is gone: an abort of an id never used."""
        message = (EngineCoreRequestType.ABORT.value, *self.client.encoder.encode([CONNECTION_CHECK_REQUEST_ID]))
        await self.client.input_socket.send_multipart((engine, *message), copy=False)

    async def abort_on_engine(self, request_ids: list[str], rank: int) -> None:
        """vLLM's abort of requests on one engine (raises zmq.ZMQError if the rank's connection is gone)."""
        await self._vllm_abort(request_ids, identity(rank))
