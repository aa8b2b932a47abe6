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

* Dead-engine detection. vLLM watches only engine processes it started itself, so with external
  engines a killed rank went unnoticed and requests routed to it hung. The requests ROUTER is put
  in ROUTER_MANDATORY mode, so a send to a rank whose connection is gone fails at once
  (EHOSTUNREACH) instead of being dropped, and a watcher sends every rank a cheap utility call
  (`is_sleeping`) every `liveness_interval_s`: a failed send or no answer within
  `liveness_timeout_s` marks the rank Dead. Its in-flight requests then end with
  FinishReason.ERROR (the API answers 500, or an error event in a stream), new requests avoid it,
  a request whose send fails is routed again to a live rank, and `/health` is 503 (the operator
  recreates the fleet: a rank cannot rejoin).
* Per-rank bookkeeping for the admin API (`FleetTracker`): state, requests, aborts and failures.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import vllm
import zmq
from vllm.utils.network_utils import get_tcp_uri, zmq_socket_ctx
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequestType, FinishReason
from vllm.v1.engine.core_client import AsyncMPClient, DPLBAsyncMPClient
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.engine.utils import (
    CoreEngine,
    CoreEngineLaunch,
    CoreEngineState,
    bind_engine_zmq_listeners,
    wait_for_engine_startup,
)

from corefleet_client import vllm_compat
from corefleet_client.admin import FleetState, FleetStatus, RankState, RankStatus

logger = logging.getLogger("corefleet.frontend")

# A score no live rank reaches: vLLM's router picks the lowest (waiting, running) load.
_UNROUTABLE = sys.maxsize // 4
# The utility the liveness watcher calls: answered between engine steps, no side effects.
LIVENESS_UTILITY = "is_sleeping"


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


class FleetTracker:
    """Per-rank state for the admin API, readable from the admin server's thread.

    States change under a lock; the per-request counters are plain ints bumped on the event loop
    (reading an int from another thread is atomic under the GIL).
    """

    def __init__(self, model: str, data_parallel_size: int) -> None:
        self.model = model
        self.size = data_parallel_size
        self._lock = threading.Lock()
        self._handshake: list[CoreEngine] = []
        self._dead: dict[int, str] = {}
        self._client: _FleetClientMixin | None = None
        self.requests_total = [0] * data_parallel_size
        self.aborts_total = [0] * data_parallel_size
        self.failed_total = [0] * data_parallel_size

    def handshaking(self, engines: list[CoreEngine]) -> None:
        with self._lock:
            self._handshake = engines

    def serving(self, client: _FleetClientMixin) -> None:
        with self._lock:
            self._client = client

    def mark_dead(self, rank: int, reason: str) -> bool:
        with self._lock:
            if rank in self._dead:
                return False
            self._dead[rank] = reason
            return True

    def dead(self) -> dict[int, str]:
        with self._lock:
            return dict(self._dead)

    def snapshot(self) -> FleetStatus:
        with self._lock:
            client, handshake, dead = self._client, list(self._handshake), dict(self._dead)
        ranks = []
        for rank in range(self.size):
            identity = rank.to_bytes(2, "little")
            waiting = running = in_flight = 0
            kv = 0.0
            if rank in dead:
                state, message = RankState.DEAD, dead[rank]
            elif client is not None:
                state, message = RankState.SERVING, ""
            else:
                eng = next((e for e in handshake if e.identity == identity), None)
                progress = eng.state if eng is not None else CoreEngineState.NEW
                state = RankState.JOINING
                message = {
                    CoreEngineState.NEW: "waiting for the engine's HELLO",
                    CoreEngineState.CONNECTED: "engine initialising (INIT sent)",
                    CoreEngineState.READY: "engine READY; waiting for the other ranks",
                }[progress]
            if client is not None:
                counts = client.lb_counts(rank)
                waiting, running, kv = int(counts[0]), int(counts[1]), float(counts[2])
                in_flight = client.engine_inflight[identity]
            ranks.append(RankStatus(
                rank=rank, identity=identity.hex(), state=state, waiting=waiting, running=running,
                kv_cache_usage=kv, in_flight=in_flight, requests_total=self.requests_total[rank],
                aborts_total=self.aborts_total[rank], failed_total=self.failed_total[rank], message=message,
            ))
        if dead:
            fleet_state = FleetState.DEGRADED
            message = "; ".join(f"rank {r}: {why}" for r, why in sorted(dead.items()))
        elif client is not None:
            fleet_state, message = FleetState.SERVING, ""
        else:
            fleet_state, message = FleetState.STARTING, "engines joining"
        return FleetStatus(state=fleet_state, model=self.model, data_parallel_size=self.size,
                           vllm_version=vllm.__version__, ranks=tuple(ranks), message=message)


class _FleetClientMixin:
    """The launch step, liveness and bookkeeping shared by the DP and the single-rank client."""

    options: ClassVar[FleetOptions | None] = None
    tracker: ClassVar[FleetTracker | None] = None

    # Provided by vLLM's client classes.
    vllm_config: Any
    core_engines: list[bytes]
    engine_inflight: Any
    utility_results: dict[int, Any]
    outputs_queue: asyncio.Queue[Any]
    input_socket: Any
    encoder: Any
    client_index: int

    def __init__(self, vllm_config: Any, executor_class: Any, log_stats: bool,
                 client_addresses: dict[str, Any] | None = None, client_count: int = 1, client_index: int = 0,
                 renderer: Any = None) -> None:
        if client_addresses:
            raise ValueError("corefleet's frontend is one API server that binds its own engine sockets")
        client_addresses = self._fleet_client_addresses(vllm_config)
        super().__init__(vllm_config, executor_class, log_stats, client_addresses,  # type: ignore[call-arg]
                         client_count, client_index, renderer=renderer)
        self._fleet_started()

    def shutdown(self, timeout: float | None = None) -> None:
        task = getattr(self, "_liveness_task", None)
        if task is not None and not task.done():
            task.cancel()
        super().shutdown(timeout)  # type: ignore[misc]

    def _fleet_client_addresses(self, vllm_config: Any) -> dict[str, Any]:
        """Bind the engine sockets and handshake every rank; the `client_addresses` for MPClient."""
        options, tracker = type(self).options, type(self).tracker
        if options is None or tracker is None:
            raise RuntimeError("corefleet's client needs FleetOptions and a FleetTracker (set by the entrypoint)")
        pc = vllm_config.parallel_config
        if pc.data_parallel_size_local != 0:
            raise ValueError("corefleet's frontend starts no engine: --data-parallel-size-local must be 0")
        listeners = bind_engine_zmq_listeners(vllm_config)
        try:
            addresses = listeners.addresses
            addresses.coordinator_input = options.back_publish
            addresses.coordinator_output = options.back_output
            addresses.frontend_stats_publish_address = options.front_publish
            engines = [CoreEngine(index=rank, local=False) for rank in range(pc.data_parallel_size)]
            tracker.handshaking(engines)
            coordinated_dp = pc.data_parallel_size > 1 and vllm_config.model_config.is_moe
            handshake_address = get_tcp_uri(pc.data_parallel_master_ip, pc.data_parallel_rpc_port)
            logger.info("Waiting for %d engine(s) to handshake on %s; coordinator at %s",
                        len(engines), handshake_address, options.coordinator_address)
            with zmq_socket_ctx(handshake_address, zmq.ROUTER, bind=True) as handshake_socket:
                wait_for_engine_startup(
                    handshake_socket, engines,
                    vllm_compat.advertised_parallel_config(pc, options.engine0_address),
                    coordinated_dp, vllm_config.cache_config,
                    CoreEngineLaunch(engine_manager=None, coordinator=None, addresses=addresses, tensor_queue=None),
                )
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
        options, tracker = type(self).options, type(self).tracker
        assert options is not None
        assert tracker is not None
        # A send to an identity the ROUTER has no connection for raises EHOSTUNREACH instead of
        # being dropped silently: that is how a request to a dead rank fails fast.
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._fleet_options = options
        self._tracker = tracker
        if not hasattr(self, "engine_inflight"):  # vLLM's single-engine client does not count
            self.engine_inflight = Counter()
            self.reqs_in_flight: dict[str, bytes] = {}
        self._liveness_task: asyncio.Task[None] | None = None
        tracker.serving(self)
        logger.info("All %d engine(s) joined; serving", len(self.core_engines))
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._liveness_task = asyncio.create_task(self._watch_engines(), name="corefleet-engine-liveness")

    # -- bookkeeping read by the admin server ------------------------------------------------

    def lb_counts(self, rank: int) -> list[int | float]:
        counts = getattr(self, "lb_engines", None)
        if counts is None or rank >= len(counts):
            return [0, 0, 0.0]
        return list(counts[rank])

    # -- liveness ----------------------------------------------------------------------------

    def check_fleet_health(self) -> None:
        """Called by `/health` (vllm_compat change 3): 503 while a rank is dead."""
        if self._tracker.dead():
            raise EngineDeadError()

    async def _watch_engines(self) -> None:
        """Every interval, send each live rank a liveness call; never wait on one rank's answer.

        A send that fails means the connection is gone (detected within one interval); the oldest
        unanswered call of a rank growing older than the timeout means a hung engine. Answers
        resolve futures in vLLM's `utility_results`, like any utility call.
        """
        options = self._fleet_options
        loop = asyncio.get_running_loop()
        pending: dict[int, list[tuple[float, int, asyncio.Future[Any]]]] = {}
        while True:
            await asyncio.sleep(options.liveness_interval_s)
            dead = self._tracker.dead()
            now = loop.time()
            for rank, engine in enumerate(self.core_engines):
                if rank in dead:
                    self._forget_calls(pending.pop(rank, []))
                    continue
                calls = [c for c in pending.get(rank, []) if not c[2].done()]
                call = None
                if calls and now - calls[0][0] > options.liveness_timeout_s:
                    reason: str | None = f"no answer to a liveness call within {options.liveness_timeout_s:g}s"
                else:
                    reason, call = await self._send_liveness_call(engine)
                if reason is None:
                    assert call is not None
                    pending[rank] = [*calls, (now, *call)]
                    continue
                self._forget_calls(pending.pop(rank, []))
                self._rank_died(rank, reason)

    def _forget_calls(self, calls: list[tuple[float, int, asyncio.Future[Any]]]) -> None:
        for _, call_id, _ in calls:
            self.utility_results.pop(call_id, None)

    async def _send_liveness_call(self, engine: bytes) -> tuple[str | None, tuple[int, asyncio.Future[Any]] | None]:
        call_id = uuid.uuid1().int >> 64
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        # An error answer is still an answer (the engine is alive): keep it from being logged as unretrieved.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.utility_results[call_id] = future
        message = (EngineCoreRequestType.UTILITY.value,
                   *self.encoder.encode((self.client_index, call_id, LIVENESS_UTILITY, ())))
        try:
            await self.input_socket.send_multipart((engine, *message), copy=False)
        except zmq.ZMQError as e:
            self.utility_results.pop(call_id, None)
            return _connection_lost(e), None
        return None, (call_id, future)

    def _rank_died(self, rank: int, reason: str) -> None:
        if not self._tracker.mark_dead(rank, reason):
            return
        engine = rank.to_bytes(2, "little")
        reqs = getattr(self, "reqs_in_flight", None)
        lost = [rid for rid, eng in reqs.items() if eng == engine] if reqs else []
        for rid in lost:
            reqs.pop(rid, None)  # type: ignore[union-attr]
            self.engine_inflight[engine] -= 1
        self._tracker.failed_total[rank] += len(lost)
        logger.error("Engine rank %d is dead (%s); failing its %d in-flight request(s); /health is 503",
                     rank, reason, len(lost))
        if lost:
            self.outputs_queue.put_nowait(EngineCoreOutputs(
                engine_index=rank,
                outputs=[EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason=FinishReason.ERROR)
                         for rid in lost],
            ))


class KubeDPLBClient(_FleetClientMixin, DPLBAsyncMPClient):  # type: ignore[misc]  # vLLM is not type-checked
    """vLLM's DPLB client over engines in other pods (DP > 1)."""

    def get_core_engine_for_request(self, request: Any) -> bytes:
        dead = self._tracker.dead()
        if dead:
            # vLLM's router picks the least loaded rank: make dead ranks look fully loaded.
            for rank in dead:
                if rank < len(self.lb_engines):
                    self.lb_engines[rank] = [_UNROUTABLE, _UNROUTABLE, 0.0]
        known = request.request_id in self.reqs_in_flight
        engine: bytes = super().get_core_engine_for_request(request)
        if not known:
            self._tracker.requests_total[int.from_bytes(engine, "little")] += 1
        return engine

    async def add_request_async(self, request: Any) -> None:
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
                self._tracker.requests_total[rank] -= 1
                self._rank_died(rank, _connection_lost(e))
        raise EngineDeadError()

    async def _abort_requests(self, request_ids: list[str], engine: bytes) -> None:
        rank = int.from_bytes(engine, "little")
        if rank in self._tracker.dead():
            return  # its requests were already failed
        self._tracker.aborts_total[rank] += len(request_ids)
        try:
            await super()._abort_requests(request_ids, engine)
        except zmq.ZMQError as e:  # the rank is gone, so are its requests: fail them, do not raise
            self._rank_died(rank, _connection_lost(e))


class KubeMPClient(_FleetClientMixin, AsyncMPClient):  # type: ignore[misc]  # vLLM is not type-checked
    """A fleet of one rank: vLLM's plain async client over an engine in another pod.

    vLLM's single-engine client keeps no per-request record; this one does (like the DPLB client's
    `reqs_in_flight`), so that a dead engine's requests can be failed and counted.
    """

    async def add_request_async(self, request: Any) -> None:
        engine: bytes = self.core_engine
        self.reqs_in_flight[request.request_id] = engine
        self.engine_inflight[engine] += 1
        try:
            await super().add_request_async(request)
        except zmq.ZMQError as e:
            self.reqs_in_flight.pop(request.request_id, None)
            self.engine_inflight[engine] -= 1
            self._rank_died(0, _connection_lost(e))
            raise EngineDeadError() from None
        self._tracker.requests_total[0] += 1

    @staticmethod
    async def process_engine_outputs(self: KubeMPClient, outputs: EngineCoreOutputs) -> None:
        # Called by vLLM's output task for every output batch (as for DPLBAsyncMPClient).
        for req_id in outputs.finished_requests or ():
            if (engine := self.reqs_in_flight.pop(req_id, None)) is not None:
                self.engine_inflight[engine] -= 1

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if not request_ids or 0 in self._tracker.dead():
            return  # a dead engine's requests were already failed
        self._tracker.aborts_total[0] += len(request_ids)
        try:
            await super().abort_requests_async(request_ids)
        except zmq.ZMQError as e:
            self._rank_died(0, _connection_lost(e))
