# SPDX-License-Identifier: Apache-2.0
"""corefleet's engine-core client: vLLM's DPLB client for engines that run in other pods.

vLLM's `DPLBAsyncMPClient` normally launches its engines and the DP coordinator itself
(`MPClient.__init__` -> `launch_core_engines`). In a fleet both run elsewhere, so this subclass
does the launch step differently and keeps everything else vLLM's:

1. It binds the engine sockets (requests ROUTER, outputs PULL) on the frontend's address with
   vLLM's `bind_engine_zmq_listeners`, like vLLM's multi-API-server supervisor.
2. It owns the handshake ROUTER on the fixed `--data-parallel-rpc-port` and runs vLLM's own
   `wait_for_engine_startup`: HELLO -> INIT (with the frontend's socket addresses and the
   coordinator's fixed addresses) -> READY, for every rank 0..N-1. It starts no engine.
3. It hands the bound listeners to `MPClient.__init__` through `client_addresses`, vLLM's path
   for "engines managed externally", which waits for each engine's ready response and subscribes
   to the coordinator's stats at its fixed front-publish address.

Routing (`get_core_engine_for_request`), abort routing by request (`reqs_in_flight`) and stats
handling are vLLM's. What corefleet adds:

* Rank liveness. vLLM watches only engine processes it started itself, so with external engines a
  killed rank went unnoticed and requests routed to it hung. Two signals, two states:

  - Dead: the rank's connection is lost. The requests ROUTER is put in ROUTER_MANDATORY mode, so a
    send to a rank whose connection is gone fails at once (EHOSTUNREACH) instead of being dropped;
    when the process exits, its connection goes with it. A Dead rank's in-flight requests end with
    an explicit error (HTTP 503, or an error event in a stream), new requests avoid it, and a
    request whose send fails is routed again to a live rank.
  - Unresponsive: a watcher keeps one cheap utility call (`is_sleeping`, the probe) outstanding per
    rank, sent every `liveness_interval_s` once the last one was answered. A probe unanswered for
    `liveness_timeout_s` while the connection is up (a stopped, swapping or overloaded process)
    makes the rank Unresponsive: new requests avoid it, a request pinned to it gets a 503 at once,
    fan-out utilities skip it, its in-flight requests run on, and its first answer makes it Serving
    again. Every interval, each rank gets a new probe or, while its probe is still out, a connection
    check (an abort of a request id that never exists: no answer, no effect), so a process that
    dies is Dead within an interval, answering or not.

  Probes are vLLM utility calls: their futures live in vLLM's `utility_results`, and vLLM's output
  task pops an entry when its answer comes (`_process_utility_output`, which raises KeyError for an
  unknown call id and so takes the whole output task down). The watcher therefore never removes
  or replaces an entry of a call it sent; an answer that comes late is processed as any other.
  The watcher is stall-aware: when its own tick comes later than the liveness timeout allows, the
  frontend's event loop itself stalled (the answers may be waiting unread), and the outstanding
  probes' clocks restart instead of blaming the ranks. The watcher task is supervised: if it ever
  fails, the failure is logged and the watcher restarted (its state lives on the client), so
  detection never stops silently; exiting instead would fail every in-flight request on every rank.
  `/health` is 503 only while no rank is Serving: one hung or lost rank never takes the endpoint
  down.
* Resizes of a dense fleet in place, as operations with an id (`Fleet.start_resize`, the admin
  API). Dense ranks are independent engines, so a resize is a change of this client's membership
  (docs/vllm-protocol.md §10.1), run as numbered phases on vLLM's event loop:

  Scale-up N -> M (`_scale_up`):
    1. Preparing: the handshake ROUTER is opened again, for exactly ranks N..M-1, and vLLM's own
       `wait_for_engine_startup` answers their HELLO with INIT and waits for READY, in a thread,
       bounded by the join timeout (a cancel or the deadline aborts it through a watched fd).
    2. Each new rank's ready response is read from the requests ROUTER (it arrives before READY).
    3. Committing: the stat loggers are rebuilt for M ranks (before any request can reach a new
       rank: vLLM's Prometheus logger raises on an unknown engine index), the identities join
       `core_engines`, the size is set and `SCALE_ELASTIC_EP(M)` goes to the stats task, which
       extends `lb_engines` and tells the coordinator. Only then does the router see the new ranks.
    A rank that does not join in time fails the operation; the ranks that did join are retired
    again (nothing was ever routed to them) and the fleet serves on at N.

  Scale-down M -> N (`_scale_down`), only the highest ranks leave:
    1. Draining: ranks N..M-1 get no new request at once (the router sees them fully loaded; a
       request pinned to one gets a 503 naming the resize), and their in-flight requests finish,
       for at most the drain timeout; what is left then ends with a 503 naming the resize, and
       the engine is told to abort it. A leaving rank that dies meanwhile ends its requests with
       an error and leaves all the same (no Dead alarm, no /health 503).
    2. Committing: `core_engines`, `lb_engines` and `engine_ranks_managed` are cut together
       (`len(lb_engines) <= len(core_engines)` must hold at every moment, or the router raises),
       the size is set, the stat loggers are rebuilt for N ranks (the leaving ranks' series go),
       and `SCALE_ELASTIC_EP(N)` shrinks the stats task's and the coordinator's view.
    3. The leaving ranks are forgotten by the liveness watcher and reported Retired: their pods
       may now be deleted.

  Replacement of Dead ranks, same size (`_replace`, `frontend.replace.RankReplacement`): a new
  engine for each handshakes as in a scale-up, and the rank serves again; the others serve on.

* Resizes of an MoE fleet in place (`frontend.elastic.ElasticEPResize`): its ranks share
  collectives, so a resize runs vLLM's elastic-EP protocol (reconfigure, commit, notifications)
  in place of vLLM's Ray-bound client steps, through the same operations and admin API.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar

import msgspec
import zmq
from vllm.exceptions import GracefulHTTPError
from vllm.utils.network_utils import get_tcp_uri, zmq_socket_ctx
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreReadyResponse, EngineCoreRequestType
from vllm.v1.engine import FinishReason as VllmFinishReason
from vllm.v1.engine.core_client import DPLBAsyncMPClient
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.engine.utils import (
    CoreEngine,
    CoreEngineLaunch,
    CoreEngineState,
    EngineZmqAddresses,
    bind_engine_zmq_listeners,
    wait_for_engine_startup,
)

from corefleet_client import vllm_compat
from corefleet_client.admin import RankState, ResizeOperation, ResizePhase
from corefleet_client.frontend.elastic import ElasticEPResize
from corefleet_client.frontend.fleet import ExpertLayout, Fleet, RankRecord, describe, identity
from corefleet_client.frontend.replace import RankReplacement, remote_engine
from corefleet_client.frontend.stats import FleetStatLoggers

logger = logging.getLogger("corefleet.frontend")

# A score no live rank reaches: vLLM's router picks the lowest (waiting, running) load.
_UNROUTABLE = 1 << 60
# The utility the liveness watcher calls: answered between engine steps, no side effects.
LIVENESS_UTILITY = "is_sleeping"
# What a connection check aborts: no request ever has this id, so it does nothing.
CONNECTION_CHECK_REQUEST_ID = "corefleet-connection-check"
# How long the stats task may take to apply a SCALE_ELASTIC_EP (it runs on this event loop).
ANNOUNCE_TIMEOUT_S = 10.0
# How long a new rank's ready response may lag behind its READY (sent before it, on another socket).
READY_RESPONSE_TIMEOUT_S = 30.0
# How long to retry binding the handshake port (a ROUTER closed moments ago may still hold it).
HANDSHAKE_BIND_TIMEOUT_S = 10.0
DRAIN_POLL_S = 0.05

_HANDSHAKE_PROGRESS = {
    CoreEngineState.NEW: "waiting for the engine's HELLO",
    CoreEngineState.CONNECTED: "engine initialising (INIT sent)",
    CoreEngineState.READY: "engine READY; waiting for the other ranks",
}


def routing_counts(counts: list[list[int | float]], size: int,
                   unroutable: Iterable[int]) -> list[list[int | float]]:
    """The load the router reads for each of `size` ranks, from the coordinator's last counts.

    The coordinator's counts may be shorter than the fleet: a publish it made before it applied a
    scale-up (`SCALE_ELASTIC_EP`) can reach the stats task after it, and the coordinator publishes
    again only when a count changes, or every 5 s. vLLM's router scans only `len(counts)` ranks, so
    the new ranks would get no unpinned request meanwhile: they count as idle until the coordinator
    knows them. Ranks that take no request (dead, unresponsive, leaving) look fully loaded.
    """
    if len(counts) < size:
        counts = counts + [[0, 0, 0.0] for _ in range(size - len(counts))]
    for rank in unroutable:
        if rank < len(counts):
            counts[rank] = [_UNROUTABLE, _UNROUTABLE, 0.0]
    return counts


def _connection_lost(e: zmq.ZMQError) -> str:
    return f"connection to the engine lost ({e.strerror})"


@dataclass(frozen=True)
class FleetOptions:
    """What the frontend knows about its fleet beyond vLLM's own flags (set by the entrypoint)."""

    coordinator_address: str
    coordinator_front_publish_port: int
    coordinator_back_output_port: int
    coordinator_back_publish_port: int
    engine0_address: str | None = None  # MoE: where engine rank 0 binds its DP group port
    coord_store_port: int | None = None  # elastic EP: the startup's coordination store, beside engine 0
    liveness_interval_s: float = 1.0
    liveness_timeout_s: float = 30.0

    @property
    def front_publish(self) -> str:
        return str(get_tcp_uri(self.coordinator_address, self.coordinator_front_publish_port))

    @property
    def back_output(self) -> str:
        return str(get_tcp_uri(self.coordinator_address, self.coordinator_back_output_port))

    @property
    def back_publish(self) -> str:
        return str(get_tcp_uri(self.coordinator_address, self.coordinator_back_publish_port))


@dataclass
class _Probe:
    """A rank's outstanding liveness call."""

    future: asyncio.Future[Any]
    sent_at: float  # loop time; moved on when the frontend's own loop stalled


class ResizeFailed(Exception):
    def __init__(self, message: str, *, fleet_intact: bool = True) -> None:
        super().__init__(message)
        self.fleet_intact = fleet_intact


class HandshakeAbort:
    """Stops a running `wait_for_engine_startup` from another thread.

    vLLM's handshake loop polls the handshake socket and the sentinels of "watched frontend
    processes" (`CoreEngineLaunch.watched_frontend_processes`) and raises as soon as one of those
    becomes readable. This object is such a watched process: its sentinel is the read end of a pipe,
    and `fire()` makes it readable (vLLM then raises RuntimeError naming `name`).
    """

    def __init__(self, resize_id: str) -> None:
        self.name = f"corefleet resize {resize_id}"
        self.reason = ""
        self._read, self._write = os.pipe()
        self.sentinel = self._read

    @property
    def exitcode(self) -> int | None:
        return 1 if self.reason else None

    def fire(self, reason: str) -> None:
        if not self.reason:
            self.reason = reason
            with contextlib.suppress(OSError):
                os.write(self._write, b"x")

    def close(self) -> None:
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)


class KubeDPLBClient(ElasticEPResize, RankReplacement, DPLBAsyncMPClient):  # type: ignore[misc]  # vLLM is not type-checked
    """vLLM's DPLB client over engines in other pods, for fleets of any size (see the module docstring)."""

    options: ClassVar[FleetOptions | None] = None
    fleet: ClassVar[Fleet | None] = None

    # Provided by vLLM's client classes.
    vllm_config: Any
    core_engines: list[bytes]
    lb_engines: list[list[int | float]]
    engine_ranks_managed: list[int]
    engine_inflight: Any
    reqs_in_flight: dict[str, bytes]
    utility_results: dict[int, Any]
    outputs_queue: asyncio.Queue[Any]
    input_socket: Any
    first_req_send_socket: Any
    resources: Any
    encoder: Any
    client_index: int

    def __init__(self, vllm_config: Any, executor_class: Any, log_stats: bool,
                 client_addresses: dict[str, Any] | None = None, client_count: int = 1, client_index: int = 0,
                 renderer: Any = None) -> None:
        if client_addresses:
            raise ValueError("corefleet's frontend is one API server that binds its own engine sockets")
        options, fleet = type(self).options, type(self).fleet
        if options is None or fleet is None:
            raise RuntimeError("corefleet's client needs FleetOptions and a Fleet (set by the entrypoint)")
        self._fleet_options: FleetOptions = options
        self._fleet: Fleet = fleet
        fleet.moe = bool(vllm_config.model_config.is_moe)
        pc = vllm_config.parallel_config
        if fleet.moe and pc.enable_elastic_ep:
            fleet.experts = ExpertLayout(num_experts=int(vllm_config.model_config.get_num_experts()),
                                         num_redundant_experts=int(pc.eplb_config.num_redundant_experts),
                                         max_size=int(pc.elastic_ep_max_dp_size))
        addresses = self._fleet_client_addresses(vllm_config)
        vllm_compat.init_dplb_client(self, vllm_config, executor_class, log_stats, addresses, client_count,
                                     client_index, renderer)
        self._fleet_started()

    def shutdown(self, timeout: float | None = None) -> None:
        self._shutting_down = True
        for task in (getattr(self, "_liveness_task", None), *getattr(self, "_resize_tasks", ())):
            if task is not None and not task.done():
                task.cancel()
        abort = getattr(self, "_handshake_abort", None)
        if abort is not None:
            abort.fire("the frontend is shutting down")
        super().shutdown(timeout)

    # ---- startup -------------------------------------------------------------------------------
    def _handshake(self, vllm_config: Any, handshake_socket: Any, engines: list[CoreEngine],
                   abort: HandshakeAbort | None = None, parallel_config: Any = None) -> None:
        """vLLM's HELLO -> INIT -> READY exchange with `engines` on a bound handshake ROUTER.

        `parallel_config`: the one INIT advertises and READY's hash is checked against, if not the
        fleet's own (an elastic-EP scale-up's: the new size, its ports, store and R')."""
        pc = parallel_config if parallel_config is not None else vllm_config.parallel_config
        options = self._fleet_options
        coordinated_dp = pc.data_parallel_size > 1 and vllm_config.model_config.is_moe
        progress = {e.index: e for e in engines}
        self._fleet.set_join_progress(lambda: {r: _HANDSHAKE_PROGRESS[e.state] for r, e in progress.items()})
        try:
            wait_for_engine_startup(
                handshake_socket, engines,
                pc if parallel_config is not None
                else vllm_compat.advertised_parallel_config(pc, options.engine0_address, options.coord_store_port),
                coordinated_dp, vllm_config.cache_config,
                CoreEngineLaunch(engine_manager=None, coordinator=None, addresses=self._engine_addresses,
                                 tensor_queue=None, watched_frontend_processes=[abort] if abort else []),
            )
        finally:
            self._fleet.set_join_progress(None)

    def _fleet_client_addresses(self, vllm_config: Any) -> dict[str, Any]:
        """Bind the engine sockets and handshake every rank; the `client_addresses` for MPClient."""
        options = self._fleet_options
        pc = vllm_config.parallel_config
        if pc.data_parallel_size_local != 0:
            raise ValueError("corefleet's frontend starts no engine: --data-parallel-size-local must be 0")
        listeners = bind_engine_zmq_listeners(vllm_config)
        try:
            addresses = listeners.addresses
            addresses.coordinator_input = options.back_publish
            addresses.coordinator_output = options.back_output
            addresses.frontend_stats_publish_address = options.front_publish
            self._engine_addresses: EngineZmqAddresses = addresses
            engines = [remote_engine(rank) for rank in range(pc.data_parallel_size)]
            handshake_address = get_tcp_uri(pc.data_parallel_master_ip, pc.data_parallel_rpc_port)
            logger.info("Waiting for %d engine(s) to handshake on %s; coordinator at %s",
                        len(engines), handshake_address, options.coordinator_address)
            with zmq_socket_ctx(handshake_address, zmq.ROUTER, bind=True) as handshake_socket:
                self._handshake(vllm_config, handshake_socket, engines)
        except BaseException:
            listeners.cleanup()
            raise
        # Keep the listeners referenced until MPClient adopts their sockets: EngineZmqListeners closes
        # them when it is collected, and a closed listener would make MPClient bind the port anew,
        # resetting the connections the engines have already made.
        self._engine_listeners = listeners
        return {
            "input_address": addresses.inputs[0],
            "output_address": addresses.outputs[0],
            "input_listener": listeners.inputs[0].socket,
            "output_listener": listeners.outputs[0].socket,
            "stats_update_address": addresses.frontend_stats_publish_address,
        }

    def _fleet_started(self) -> None:
        # A send to an identity the ROUTER has no connection for raises EHOSTUNREACH instead of
        # being dropped silently: that is how a request to a dead rank fails fast.
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A rank that rejoins (same identity) after it was retired takes over a stale connection.
        self.input_socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._records: dict[int, RankRecord] = {}
        self._unroutable: dict[int, str] = {}  # rank -> why no request is routed to it
        self._lost: dict[int, str] = {}  # leaving ranks that died while draining -> why
        self._resize_tasks: set[asyncio.Task[None]] = set()
        self._cancels: dict[str, str] = {}
        self._handshake_abort: HandshakeAbort | None = None
        self._async_llm: Any = None
        self._stat_loggers: FleetStatLoggers | None = None
        self._liveness_task: asyncio.Task[None] | None = None
        self._probes: dict[int, _Probe] = {}  # rank -> its outstanding liveness call
        self._last_tick: float | None = None  # when the liveness watcher last ran (loop time)
        self._shutting_down = False
        self._loop = asyncio.get_running_loop()
        self._fleet.serving(self, self)
        for rank in range(len(self.core_engines)):
            self._records[rank] = self._fleet.record(rank)
        logger.info("All %d engine(s) joined; serving", len(self.core_engines))
        self._start_liveness_watcher()

    def _ensure_output_queue_task(self) -> None:
        # vllm_compat change 7: the task that reads engine outputs yields after every message.
        if self.resources.output_queue_task is not None:
            return
        with vllm_compat.yielding_output_socket(self.resources):
            super()._ensure_output_queue_task()

    def attach_async_llm(self, async_llm: Any, stat_logger_options: dict[str, Any]) -> None:
        """Called once AsyncLLM is built (vllm_compat change 5)."""
        self._async_llm = async_llm
        if async_llm.logger_manager is not None:
            self._stat_loggers = FleetStatLoggers(async_llm.logger_manager, len(self.core_engines),
                                                  stat_logger_options)
            vllm_compat.set_stat_loggers(async_llm, self._stat_loggers)

    # ---- what the admin API reads (from its own threads) ----------------------------------------
    def lb_counts(self, rank: int) -> tuple[int, int, float]:
        counts = self.lb_engines
        if rank >= len(counts):
            return 0, 0, 0.0
        waiting, running, kv = counts[rank]
        if waiting >= _UNROUTABLE:
            return 0, 0, 0.0
        return int(waiting), int(running), float(kv)

    def in_flight(self, rank: int) -> int:
        return int(self.engine_inflight[identity(rank)])

    # ---- routing -------------------------------------------------------------------------------
    def get_core_engine_for_request(self, request: Any) -> bytes:
        # vLLM's router picks the least loaded of the ranks in `lb_engines` (see routing_counts).
        self.lb_engines = routing_counts(self.lb_engines, len(self.core_engines), self._unroutable)
        self._ignore_stale_loads()  # a replaced rank's load is not its lost engine's (frontend.replace)
        known = request.request_id in self.reqs_in_flight
        engine: bytes = super().get_core_engine_for_request(request)
        if not known:
            self._records[int.from_bytes(engine, "little")].requests_total += 1
        return engine

    async def add_request_async(self, request: Any) -> None:
        pinned = request.data_parallel_rank
        if pinned is not None and pinned in self._unroutable and request.request_id not in self.reqs_in_flight:
            self._fail_requests([request.request_id], f"data_parallel_rank {pinned} takes no requests: "
                                f"{self._unroutable[pinned]}")
            return
        if (pinned is None and request.request_id not in self.reqs_in_flight
                and all(rank in self._unroutable for rank in range(len(self.core_engines)))):
            self._fail_requests([request.request_id], "no rank of the fleet takes requests: "
                                + "; ".join(self._unroutable.values()))
            return
        # A rank whose connection is gone refuses the send (ROUTER_MANDATORY): mark it dead and
        # route the request again; no engine has seen it yet.
        for _ in range(len(self.core_engines)):
            try:
                await super().add_request_async(request)
                return
            except zmq.ZMQError as e:
                engine = self.reqs_in_flight.pop(request.request_id, None)
                if engine is None:
                    raise
                self.engine_inflight[engine] -= 1
                rank = int.from_bytes(engine, "little")
                self._records[rank].requests_total -= 1
                self._rank_died(rank, _connection_lost(e))
                if pinned is not None:
                    break
        raise EngineDeadError()

    async def _abort_requests(self, request_ids: list[str], engine: bytes) -> None:
        rank = int.from_bytes(engine, "little")
        record = self._records.get(rank)
        if record is None or record.state == RankState.DEAD:
            return  # its requests were already failed
        record.aborts_total += len(request_ids)
        try:
            await super()._abort_requests(request_ids, engine)
        except zmq.ZMQError as e:  # the rank is gone, so are its requests: fail them, do not raise
            self._rank_died(rank, _connection_lost(e))

    def _requests_on(self, rank: int) -> list[str]:
        engine = identity(rank)
        return [rid for rid, eng in self.reqs_in_flight.items() if eng == engine]

    def _fail_requests(self, request_ids: Iterable[str], message: str, rank: int | None = None) -> None:
        """End requests with an explicit error: forget them here, and in AsyncLLM with the message."""
        ids = list(request_ids)
        if not ids:
            return
        for rid in ids:
            engine = self.reqs_in_flight.pop(rid, None)
            if engine is not None:
                self.engine_inflight[engine] -= 1
        if rank is not None and rank in self._records:
            self._records[rank].failed_total += len(ids)
        if self._async_llm is not None:
            vllm_compat.fail_requests(self._async_llm, ids, message, HTTPStatus.SERVICE_UNAVAILABLE)
        else:  # no AsyncLLM (tests driving the client alone): vLLM's own error finish
            self.outputs_queue.put_nowait(EngineCoreOutputs(
                engine_index=rank or 0,
                outputs=[EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason=VllmFinishReason.ERROR)
                         for rid in ids]))

    # ---- liveness ------------------------------------------------------------------------------
    def check_fleet_health(self) -> None:
        """Called by `/health` (vllm_compat change 3): 503 only while no rank is Serving."""
        if not any(r.state == RankState.SERVING for r in self._records.values()):
            raise EngineDeadError()

    def _start_liveness_watcher(self) -> None:
        task = asyncio.create_task(self._watch_engines(), name="corefleet-engine-liveness")
        task.add_done_callback(self._liveness_watcher_done)
        self._liveness_task = task

    def _liveness_watcher_done(self, task: asyncio.Task[None]) -> None:
        """The watcher never ends on its own: a failure is logged and the watcher restarted."""
        if task.cancelled() or self._shutting_down:
            return
        error = task.exception()
        logger.error("The engine liveness watcher failed (%s); restarting it", error or "it returned",
                     exc_info=error)
        self._start_liveness_watcher()

    async def _watch_engines(self) -> None:
        """Every interval, probe each rank (see the module docstring); never wait on one rank's answer."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._fleet_options.liveness_interval_s)
            await self._liveness_tick(loop.time())

    async def _liveness_tick(self, now: float) -> None:
        options = self._fleet_options
        self._fleet.beat()  # the pod's livenessProbe (admin /livez) reads it
        last, self._last_tick = self._last_tick, now
        if last is not None and now - last > options.liveness_interval_s + options.liveness_timeout_s:
            logger.warning("The frontend's event loop stalled for %.1fs (over the liveness timeout of %gs): "
                           "no rank is blamed for it, the liveness clocks restart",
                           now - last - options.liveness_interval_s, options.liveness_timeout_s)
            for outstanding in self._probes.values():
                outstanding.sent_at = now
        members = dict(enumerate(self.core_engines))
        for rank in [r for r in self._probes if r not in members]:
            del self._probes[rank]  # retired: vLLM still takes an answer that comes (nobody awaits it)
        for rank, engine in members.items():
            record = self._records.get(rank)
            if record is None or record.state == RankState.DEAD or rank in self._lost:
                self._probes.pop(rank, None)
                continue
            probe = self._probes.get(rank)
            try:
                if probe is None:
                    self._probes[rank] = await self._send_probe(rank, engine, now)
                    continue
                if record.state == RankState.SERVING and now - probe.sent_at > options.liveness_timeout_s:
                    self._rank_unresponsive(rank, probe)
                # Its probe is still out: check only that the connection is up (a killed process is
                # Dead within an interval, whether or not it was answering).
                await self._send_connection_check(engine)
            except zmq.ZMQError as e:
                self._rank_died(rank, _connection_lost(e))

    async def _send_probe(self, rank: int, engine: bytes, now: float) -> _Probe:
        future = await self._send_utility_call(engine, LIVENESS_UTILITY, ())
        probe = _Probe(future, now)
        future.add_done_callback(lambda f: self._probe_answered(rank, probe))
        return probe

    async def _send_utility_call(self, engine: bytes, method: str, args: tuple[Any, ...]) -> asyncio.Future[Any]:
        """Send a utility call to one engine; the future its answer resolves. Raises zmq.ZMQError if not sent.

        The future is registered in vLLM's `utility_results` as vLLM's own `_call_utility_async`
        does, and stays there until vLLM's output task pops it with the answer (only a call that
        was never sent is removed again).
        """
        call_id = uuid.uuid1().int >> 64
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        # An error answer is still an answer: keep it from being logged as never retrieved.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.utility_results[call_id] = future
        message = (EngineCoreRequestType.UTILITY.value,
                   *self.encoder.encode((self.client_index, call_id, method, args)))
        try:
            await self.input_socket.send_multipart((engine, *message), copy=False)
        except zmq.ZMQError:
            self.utility_results.pop(call_id, None)
            raise
        self._ensure_output_queue_task()
        return future

    async def _send_connection_check(self, engine: bytes) -> None:
        """A message that fails (EHOSTUNREACH) only if the connection is gone: an abort of an id never used."""
        message = (EngineCoreRequestType.ABORT.value, *self.encoder.encode([CONNECTION_CHECK_REQUEST_ID]))
        await self.input_socket.send_multipart((engine, *message), copy=False)

    def _probe_answered(self, rank: int, probe: _Probe) -> None:
        if probe.future.cancelled():
            return
        if self._probes.get(rank) is probe:
            del self._probes[rank]
        record = self._records.get(rank)
        if record is None or record.state != RankState.UNRESPONSIVE:
            return
        waited = self._loop.time() - probe.sent_at
        self._unroutable.pop(rank, None)
        self._ignore_load_until_routed(rank)
        self._fleet.set_rank(rank, RankState.SERVING)
        logger.warning("Engine rank %d answered its liveness call after %.1fs: Serving again", rank, waited)

    def _rank_unresponsive(self, rank: int, probe: _Probe) -> None:
        timeout = self._fleet_options.liveness_timeout_s
        since = time.strftime("%H:%M:%S UTC", time.gmtime(time.time() - (self._loop.time() - probe.sent_at)))
        reason = f"no answer to a liveness call sent at {since} within {timeout:g}s; its connection is up"
        self._unroutable[rank] = f"rank {rank} is {RankState.UNRESPONSIVE}: {reason}"
        self._fleet.set_rank(rank, RankState.UNRESPONSIVE, reason)
        logger.error("Engine rank %d is unresponsive (%s): no new requests go to it, its %d in-flight "
                     "request(s) wait for it", rank, reason, len(self._requests_on(rank)))

    # ---- vLLM's fan-out utilities ----------------------------------------------------------------
    async def call_utility_all_async(self, method: str, *args: Any) -> list[Any]:
        """vLLM's `call_utility_all_async` (every utility of a DPLB client goes through it), over the live ranks.

        vLLM sends the call to every engine and gathers every answer, so one hung rank made
        `/reset_prefix_cache`, `/sleep`, `/wake_up`, `/is_sleeping`, collective RPCs ... wait
        forever. Here Dead and Unresponsive ranks are skipped, and a rank that turns so while the
        call waits is given up on (its late answer is still taken by vLLM's output task). The
        answers are those of the ranks that gave one, in rank order; a 503 if no rank can answer.
        """
        if not hasattr(self, "_records"):  # during vLLM's own startup, before every rank joined
            results: list[Any] = await super().call_utility_all_async(method, *args)
            return results
        calls: dict[int, asyncio.Future[Any]] = {}
        skipped: dict[int, str] = {}
        for rank, engine in enumerate(self.core_engines):
            record = self._records.get(rank)
            if record is not None and record.state in (RankState.DEAD, RankState.UNRESPONSIVE):
                skipped[rank] = str(record.state)
                continue
            try:
                calls[rank] = await self._send_utility_call(engine, method, args)
            except zmq.ZMQError as e:
                self._rank_died(rank, _connection_lost(e))
                skipped[rank] = str(RankState.DEAD)
        waiting = dict(calls)
        while waiting:
            await asyncio.wait(waiting.values(), timeout=self._fleet_options.liveness_interval_s,
                               return_when=asyncio.FIRST_COMPLETED)
            for rank in list(waiting):
                record = self._records.get(rank)
                if waiting[rank].done():
                    del waiting[rank]
                elif record is not None and record.state in (RankState.DEAD, RankState.UNRESPONSIVE):
                    skipped[rank] = str(record.state)
                    del calls[rank], waiting[rank]
        if skipped:
            logger.warning("Utility %s skipped %s", method,
                           ", ".join(f"rank {r} ({state})" for r, state in sorted(skipped.items())))
        if not calls:
            raise GracefulHTTPError(f"no rank of the fleet can answer {method}: "
                                    + ", ".join(f"rank {r} is {state}" for r, state in sorted(skipped.items())),
                                    HTTPStatus.SERVICE_UNAVAILABLE)
        return [calls[rank].result() for rank in sorted(calls)]

    def _rank_died(self, rank: int, reason: str) -> None:
        record = self._records.get(rank)
        if record is None or record.state == RankState.DEAD or rank in self._lost:
            return
        lost = self._requests_on(rank)
        if record.state == RankState.DRAINING:
            # Leaving anyway: its requests fail, the resize goes on, the fleet is not degraded.
            op = self._fleet.current_resize()
            what = f"resize {op.id}" if op is not None else "a resize"
            self._lost[rank] = reason
            self._fleet.set_rank(rank, RankState.DRAINING, f"died while draining for {what}: {reason}")
            logger.error("Engine rank %d died while draining (%s); failing its %d in-flight request(s)",
                         rank, reason, len(lost))
            self._fail_requests(lost, f"rank {rank} died while it was being retired by {what}: {reason}", rank)
            return
        self._probes.pop(rank, None)
        self._fleet.set_rank(rank, RankState.DEAD, reason)
        self._unroutable[rank] = f"rank {rank} is {RankState.DEAD}: {reason}"
        serving = self._fleet.ranks_in(RankState.SERVING)
        logger.error("Engine rank %d is dead (%s); failing its %d in-flight request(s); %s", rank, reason, len(lost),
                     f"{describe(serving)} serve on" if serving else "no rank serves: /health is 503")
        self._fail_requests(lost, f"rank {rank} of the fleet died: {reason}", rank)

    # ---- resizes: entry points (any thread) -----------------------------------------------------
    def run_resize(self, resize_id: str) -> None:
        self._loop.call_soon_threadsafe(self._start_resize_task, resize_id)

    def cancel_resize(self, resize_id: str, reason: str) -> None:
        self._loop.call_soon_threadsafe(self._cancel, resize_id, reason)

    def _start_resize_task(self, resize_id: str) -> None:
        task = asyncio.create_task(self._resize(resize_id), name=f"corefleet-resize-{resize_id}")
        self._resize_tasks.add(task)
        task.add_done_callback(self._resize_tasks.discard)

    def _cancel(self, resize_id: str, reason: str) -> None:
        self._cancels.setdefault(resize_id, reason)
        abort = self._handshake_abort
        if abort is not None and abort.name.endswith(f" {resize_id}"):
            abort.fire(f"cancelled: {reason}")

    def _check_cancel(self, op: ResizeOperation) -> None:
        reason = self._cancels.get(op.id)
        if reason is not None:
            raise ResizeFailed(f"cancelled: {reason}")

    async def _resize(self, resize_id: str) -> None:
        op = self._fleet.resize(resize_id)
        assert op is not None
        try:
            if op.replace:
                await self._replace(op)
            elif self._fleet.moe:
                await (self._eep_scale_up(op) if op.scale_up else self._eep_scale_down(op))
            elif op.scale_up:
                await self._scale_up(op)
            else:
                await self._scale_down(op)
        except ResizeFailed as e:
            self._fleet.finish_resize(op.id, error=str(e), fleet_intact=e.fleet_intact)
        except asyncio.CancelledError:
            self._fleet.finish_resize(op.id, error="the frontend is shutting down", fleet_intact=False)
            raise
        except Exception as e:
            logger.exception("Resize %s failed unexpectedly", op.id)
            self._fleet.finish_resize(op.id, error=f"unexpected error: {type(e).__name__}: {e}", fleet_intact=False)
        finally:
            self._cancels.pop(op.id, None)

    # ---- scale-up ------------------------------------------------------------------------------
    async def _scale_up(self, op: ResizeOperation) -> None:
        frm, to = op.from_replicas, op.to_replicas
        new = list(range(frm, to))
        pc = self.vllm_config.parallel_config
        address = get_tcp_uri(pc.data_parallel_master_ip, pc.data_parallel_rpc_port)
        joined: set[int] = set()
        try:
            # 1. The handshake, in a thread (vLLM's loop blocks), bounded by the join timeout.
            self._fleet.update_resize(op.id, phase=ResizePhase.PREPARING,
                                      message=f"waiting for {describe(new)} to handshake on {address}")
            self._check_cancel(op)
            self._discard_stale_ready_responses()
            engines = [remote_engine(rank) for rank in new]
            await self._run_handshake(op, engines, address)
            joined.update(new)
            for rank in new:
                self._fleet.set_rank(rank, RankState.JOINING, "engine READY; reading its ready response")
            # 2. Their ready responses, sent on the requests socket before READY.
            await self._read_ready_responses(new)
            self._check_cancel(op)
        except Exception as e:  # before the commit nothing has changed: the fleet serves on at N
            if not isinstance(e, ResizeFailed):
                logger.exception("Resize %s: the new ranks' handshake failed", op.id)
                e = ResizeFailed(f"the new ranks' handshake failed: {type(e).__name__}: {e}")
            for rank in new:
                if rank in joined:
                    self._fleet.set_rank(rank, RankState.RETIRED, f"joined, then retired again: {e}")
                else:
                    self._fleet.set_rank(rank, RankState.FAILED, f"did not join: {e}")
                self._fleet.forget_rank(rank)
            raise e from None
        # 3. Commit: loggers first, then routing, then the stats task and the coordinator.
        self._fleet.update_resize(op.id, phase=ResizePhase.COMMITTING, message=f"adding {describe(new)}")
        await self._route_new_ranks(new, to)
        self._fleet.commit_size(to)
        self._fleet.finish_resize(op.id)

    async def _route_new_ranks(self, new: list[int], size: int) -> None:
        """New ranks into the routing: the stat loggers first (vLLM's Prometheus logger raises on an unknown
        engine index), then the identities, the size, and `SCALE_ELASTIC_EP` to the stats task and coordinator."""
        if self._stat_loggers is not None:
            self._stat_loggers.resize(size)
        for rank in new:
            self._records[rank] = self._fleet.record(rank)
            self._fleet.set_rank(rank, RankState.SERVING)
        self.core_engines.extend(identity(rank) for rank in new)
        self.vllm_config.parallel_config.data_parallel_size = size
        await self._announce_size(size)

    async def _run_handshake(self, op: ResizeOperation, engines: list[CoreEngine], address: str,
                             parallel_config: Any = None) -> None:
        abort = self._handshake_abort = HandshakeAbort(op.id)
        loop = asyncio.get_running_loop()
        handshake = loop.run_in_executor(None, self._handshake_new_ranks, engines, address, abort, parallel_config)
        try:
            done, _ = await asyncio.wait({handshake}, timeout=op.join_timeout_s)
            if not done:
                waiting = [e.index for e in engines if e.state != CoreEngineState.READY]
                abort.fire(f"{describe(waiting)} did not join within the join timeout of {op.join_timeout_s:g}s")
            try:
                await handshake
            except (RuntimeError, zmq.ZMQError, OSError) as e:
                raise ResizeFailed(abort.reason or f"handshake failed: {e}") from None
        except asyncio.CancelledError:
            abort.fire("the frontend is shutting down")
            raise
        finally:
            if not handshake.done():
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(asyncio.shield(handshake), 5)
            self._handshake_abort = None
            abort.close()

    def _handshake_new_ranks(self, engines: list[CoreEngine], address: str, abort: HandshakeAbort,
                             parallel_config: Any = None) -> None:
        """The thread: bind the handshake ROUTER again and run vLLM's handshake on it.

        The ROUTER closed at the end of the last handshake may still hold the port for a moment:
        binding is retried for `HANDSHAKE_BIND_TIMEOUT_S`. With handover, an engine that reconnects
        with a rank's identity replaces a stale connection of that identity (a pod being deleted).
        """
        deadline = time.monotonic() + HANDSHAKE_BIND_TIMEOUT_S
        while True:
            bound = False
            try:
                with zmq_socket_ctx(address, zmq.ROUTER, bind=True, router_handover=True) as handshake_socket:
                    bound = True
                    self._handshake(self.vllm_config, handshake_socket, engines, abort, parallel_config)
                return
            except zmq.ZMQError as e:
                if bound or e.errno != errno.EADDRINUSE or time.monotonic() > deadline or abort.reason:
                    raise
            time.sleep(0.1)

    def _discard_stale_ready_responses(self) -> None:
        """Drop what ranks of an earlier, failed scale-up left on the requests socket (their ready responses)."""
        while True:
            future = self.input_socket.recv_multipart(flags=zmq.NOBLOCK)
            if future.exception() is not None:  # zmq.Again: nothing left
                return
            frames = future.result()
            logger.info("Discarding a stale message from engine %d on the requests socket",
                        int.from_bytes(frames[0], "little"))

    async def _read_ready_responses(self, ranks: list[int]) -> None:
        waiting = {identity(rank): rank for rank in ranks}
        deadline = time.monotonic() + READY_RESPONSE_TIMEOUT_S
        while waiting:
            left = deadline - time.monotonic()
            try:
                frames = await asyncio.wait_for(self.input_socket.recv_multipart(), max(left, 0.001))
            except TimeoutError:
                raise ResizeFailed(f"no ready response from {describe(waiting.values())} within "
                                   f"{READY_RESPONSE_TIMEOUT_S:g}s of its READY") from None
            engine, payload = frames[0], frames[-1]
            rank = waiting.pop(engine, None)
            if rank is None:
                logger.info("Ignoring a message from engine %d on the requests socket",
                            int.from_bytes(engine, "little"))
                continue
            if payload:
                response = msgspec.msgpack.decode(payload, type=EngineCoreReadyResponse)
                ours = self.vllm_config.parallel_config
                if response.vllm_version.split("+")[0] != _vllm_version().split("+")[0]:
                    raise ResizeFailed(f"rank {rank} runs vLLM {response.vllm_version}, the fleet "
                                       f"{_vllm_version()}: every rank must run the same version")
                if response.tensor_parallel_size != ours.tensor_parallel_size:
                    raise ResizeFailed(f"rank {rank} has tensor parallel size {response.tensor_parallel_size}, "
                                       f"the fleet {ours.tensor_parallel_size}")
            self._apply_ready_response(payload)

    # ---- scale-down ----------------------------------------------------------------------------
    async def _scale_down(self, op: ResizeOperation) -> None:
        frm, to = op.from_replicas, op.to_replicas
        leaving = list(range(to, frm))
        # 1. Drain: no new requests, the in-flight ones finish (or fail at the deadline).
        self._fleet.update_resize(op.id, phase=ResizePhase.DRAINING,
                                  message=f"{describe(leaving)} finish their in-flight requests "
                                          f"(at most {op.drain_timeout_s:g}s)")
        self._stop_routing_to(op, leaving)
        try:
            await self._drain(op, leaving)
        except ResizeFailed:
            for rank in leaving:  # cancelled: they serve on
                self._unroutable.pop(rank, None)
                self._fleet.set_rank(rank, RankState.SERVING)
            raise
        # 2. Commit: cut the lists together, without an await in between.
        self._fleet.update_resize(op.id, phase=ResizePhase.COMMITTING, message=f"removing {describe(leaving)}")
        pc = self.vllm_config.parallel_config
        self.core_engines = self.core_engines[:to]
        self.lb_engines = self.lb_engines[:to]
        self.engine_ranks_managed = marker = list(range(to))
        cache_config = self.vllm_config.cache_config
        if cache_config.num_gpu_blocks:  # the sum over the ranks (MPClient._apply_ready_response)
            cache_config.num_gpu_blocks = cache_config.num_gpu_blocks // frm * to
        pc.data_parallel_size = to
        if self._stat_loggers is not None:
            self._stat_loggers.resize(to)
        await self._announce_size(to, replaced=marker)
        # 3. Forget them; the operator may delete their pods.
        for rank in leaving:
            died = self._lost.pop(rank, None)
            self._unroutable.pop(rank, None)
            self._records.pop(rank, None)
            self.engine_inflight.pop(identity(rank), None)
            self._fleet.set_rank(rank, RankState.RETIRED, f"retired by resize {op.id}"
                                 + (f" (it died while draining: {died})" if died else ""))
            self._fleet.forget_rank(rank)
        self._fleet.commit_size(to)
        self._fleet.finish_resize(op.id)

    def _stop_routing_to(self, op: ResizeOperation, leaving: list[int]) -> None:
        """Leaving ranks get no new request (the router sees them fully loaded; a pinned one gets a 503)."""
        for rank in leaving:
            self._unroutable[rank] = f"rank {rank} is being retired by resize {op.id} ({op.from_replicas} -> " \
                                     f"{op.to_replicas})"
            self._fleet.set_rank(rank, RankState.DRAINING, f"{len(self._requests_on(rank))} request(s) in flight")

    async def _drain(self, op: ResizeOperation, leaving: list[int]) -> None:
        deadline = time.monotonic() + op.drain_timeout_s
        shown: dict[int, int] = {}
        while True:
            self._check_cancel(op)
            busy = {rank: self.engine_inflight[identity(rank)] for rank in leaving}
            busy = {rank: n for rank, n in busy.items() if n > 0}
            for rank in leaving:
                if shown.get(rank) != busy.get(rank, 0) and rank not in self._lost:
                    shown[rank] = busy.get(rank, 0)
                    self._fleet.set_rank(rank, RankState.DRAINING, f"{shown[rank]} request(s) in flight")
            if not busy:
                return
            if time.monotonic() >= deadline:
                for rank in busy:
                    ids = self._requests_on(rank)
                    logger.warning("Resize %s: rank %d still has %d request(s) after the %gs drain timeout; "
                                   "ending them", op.id, rank, len(ids), op.drain_timeout_s)
                    self._fail_requests(ids, f"rank {rank} was retired by resize {op.id} ({op.from_replicas} -> "
                                             f"{op.to_replicas}) before this request finished: its drain timeout "
                                             f"of {op.drain_timeout_s:g}s passed; retry the request", rank)
                    with contextlib.suppress(zmq.ZMQError):
                        await super()._abort_requests(ids, identity(rank))
                return
            await asyncio.sleep(DRAIN_POLL_S)

    # ---- both ----------------------------------------------------------------------------------
    async def _announce_size(self, size: int, replaced: list[int] | None = None) -> None:
        """`SCALE_ELASTIC_EP(size)` to vLLM's stats task (which tells the coordinator), and wait until it applied it.

        The stats task asserts the configured size equals the message's when it reads it, so the
        next resize may only change the size after that: wait until it has set `engine_ranks_managed`
        (a new list object, `replaced` being the one set here for a shrink).
        """
        self._ensure_stats_update_task()
        await self.first_req_send_socket.send(msgspec.msgpack.encode(("SCALE_ELASTIC_EP", size)))
        deadline = time.monotonic() + ANNOUNCE_TIMEOUT_S
        while True:
            ranks = self.engine_ranks_managed
            applied = ranks is not replaced if replaced is not None else len(ranks) == size
            if applied:
                return
            if time.monotonic() > deadline:
                raise ResizeFailed(f"vLLM's stats task did not apply the new size {size} within "
                                   f"{ANNOUNCE_TIMEOUT_S:g}s", fleet_intact=False)
            await asyncio.sleep(0.01)


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)
