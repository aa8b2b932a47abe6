# SPDX-License-Identifier: Apache-2.0
"""corefleet's engine-core client: vLLM's DPLB client for engines that run in other pods.

vLLM's `DPLBAsyncMPClient` normally launches its engines and the DP coordinator itself
(`MPClient.__init__` -> `launch_core_engines`). In a fleet both run elsewhere, so this subclass
does the launch step differently (`frontend.handshake`: it binds the engine sockets, runs vLLM's own
handshake with every rank, and hands the listeners to `MPClient.__init__` as `client_addresses`,
vLLM's path for "engines managed externally") and keeps everything else vLLM's: routing
(`get_core_engine_for_request`), abort routing by request (`reqs_in_flight`) and stats handling.

What corefleet adds lives in components, each over the one interface to this client's routing
tables (`frontend.membership.Membership`):

* rank liveness: Dead and Unresponsive ranks, the watcher, fan-out utilities over live ranks
  (`frontend.liveness`);
* resizes as operations with an id (`Fleet.start_resize`, the admin API), run by
  `frontend.operations`: a dense fleet's scale-up and scale-down (`frontend.resize`), an MoE fleet's
  through vLLM's elastic-EP protocol (`frontend.elastic`), and the replacement of a dense fleet's
  Dead ranks in place (`frontend.replace`).

This class holds only what must be on vLLM's client: its overrides of vLLM's methods, each handing
over to a component, and the wiring of the components once every rank joined. The fleet's options
and registry are constructor arguments: vLLM builds its client only through its factory, which
corefleet replaces (`vllm_compat` change 1) with `client_factory(options, fleet)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from vllm.v1.engine.core_client import DPLBAsyncMPClient
from vllm.v1.engine.exceptions import EngineDeadError

from corefleet_client import vllm_compat
from corefleet_client.admin import RankState
from corefleet_client.frontend.affinity import DEFAULT_BLOCK_SIZE, PrefixAffinity
from corefleet_client.frontend.attach import announcer
from corefleet_client.frontend.elastic import ElasticResize
from corefleet_client.frontend.fleet import ExpertLayout, Fleet, describe, identity
from corefleet_client.frontend.followers import Followers
from corefleet_client.frontend.handshake import Handshake
from corefleet_client.frontend.liveness import Liveness, connection_lost
from corefleet_client.frontend.membership import Joiner, Membership, rank_of
from corefleet_client.frontend.operations import ResizeOperations
from corefleet_client.frontend.replace import Replacement
from corefleet_client.frontend.rescue import Rescue
from corefleet_client.frontend.resize import DenseResize
from corefleet_client.frontend.stats import FleetStatLoggers
from corefleet_client.frontend.types import Cancels, FleetOptions, RoutingPolicy

logger = logging.getLogger("corefleet.frontend")


def client_factory(options: FleetOptions, fleet: Fleet,
                   followers: Followers | None = None) -> Callable[..., KubeDPLBClient]:
    """What vLLM's client factory builds for this frontend's fleet (`vllm_compat.use_client_factory`); `followers`:
    frontend 0's view of the fleet's other frontends, which it drives through each resize."""
    return functools.partial(KubeDPLBClient, options=options, fleet=fleet, followers=followers)


def describe_model(fleet: Fleet, vllm_config: Any) -> None:
    """What the fleet registry must know of the model before any rank joins: MoE or not, and its experts."""
    fleet.moe = bool(vllm_config.model_config.is_moe)
    pc = vllm_config.parallel_config
    if fleet.moe and pc.enable_elastic_ep:
        fleet.experts = ExpertLayout(num_experts=int(vllm_config.model_config.get_num_experts()),
                                     num_redundant_experts=int(pc.eplb_config.num_redundant_experts),
                                     max_size=int(pc.elastic_ep_max_dp_size))


def attached_ranks(size: int, detached: Sequence[int]) -> list[int]:
    """The ranks a frontend attaching to a fleet of `size` ranks asks to re-attach: all but `detached`, which must be
    some of them, not all."""
    if not set(detached) < set(range(size)):
        raise ValueError(f"--detached-ranks {','.join(map(str, detached))} must name some of the fleet's ranks "
                         f"0..{size - 1}, not all")
    return [rank for rank in range(size) if rank not in set(detached)]


def check_client_index(options: FleetOptions, client_count: int, client_index: int) -> None:
    """vLLM builds this client with the frontend's client count and index (`serve.server_kwargs`): the engines answer
    on the socket of the index a request carries, so a wrong one would send this frontend's outputs to another."""
    if (client_count, client_index) != (options.client_count, options.client_index):
        raise ValueError(f"vLLM built the client as client {client_index} of {client_count}, but this is frontend "
                         f"{options.client_index} of {options.client_count}")


class KubeDPLBClient(DPLBAsyncMPClient):  # type: ignore[misc]  # vLLM is not type-checked
    """vLLM's DPLB client over engines in other pods, for fleets of any size (see the module docstring)."""

    # Provided by vLLM's client classes (see types.EngineClient).
    vllm_config: Any
    core_engines: list[bytes]
    lb_engines: list[list[int | float]]
    engine_ranks_managed: list[int]
    engine_inflight: Any
    reqs_in_flight: dict[str, bytes]
    outputs_queue: asyncio.Queue[Any]
    input_socket: Any
    first_req_send_socket: Any
    resources: Any
    encoder: Any
    client_index: int
    _rescue: Rescue | None = None  # with stall detection on (`frontend.rescue`)
    _outputs_seen: Callable[[int], None] | None = None  # a rank's outputs came (`Liveness.outputs`), once serving

    def __init__(self, vllm_config: Any, executor_class: Any, log_stats: bool,
                 client_addresses: dict[str, Any] | None = None, client_count: int = 1, client_index: int = 0,
                 renderer: Any = None, *, options: FleetOptions, fleet: Fleet,
                 followers: Followers | None = None) -> None:
        if client_addresses:
            raise ValueError("corefleet's frontend is one API server that binds its own engine sockets")
        check_client_index(options, client_count, client_index)
        describe_model(fleet, vllm_config)
        self._handshake = Handshake(self, options, fleet)
        addresses = self._handshake.startup(vllm_config)  # blocks until every rank is READY (not if attaching)
        size = vllm_config.parallel_config.data_parallel_size
        attached = attached_ranks(size, options.detached) if options.attach else []
        attaching = vllm_compat.attaching(announcer(attached, client_index, options.attach_timeout_s),
                                          present=len(attached), absent=map(identity, options.detached)) \
            if options.attach else contextlib.nullcontext()
        with attaching:
            vllm_compat.init_dplb_client(self, vllm_config, executor_class, log_stats, addresses, client_count,
                                         client_index, renderer)
        if options.attach:
            logger.info("Re-attached to %d running engine(s)%s", len(attached),
                        f"; {describe(options.detached)} left out, Dead until replaced" if options.detached else "")
        self._serve(options, fleet, self._handshake, followers)

    # vllm_compat change 11: the utility futures by call id, as vLLM's MPClient.__init__ sets them, in a dict that
    # drops an answer to a call this client did not make (its output task captures the dict when it starts).
    @property
    def utility_results(self) -> vllm_compat.UtilityResults:
        return self._utility_results

    @utility_results.setter
    def utility_results(self, results: dict[int, Any]) -> None:
        self._utility_results = vllm_compat.UtilityResults(results)

    def _serve(self, options: FleetOptions, fleet: Fleet, joiner: Joiner, followers: Followers | None) -> None:
        """Every rank joined: the components over this client's routing tables, then requests may flow."""
        # A send to an identity the ROUTER has no connection for raises EHOSTUNREACH instead of
        # being dropped silently: that is how a request to a dead rank fails fast.
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A rank that rejoins (same identity) after it was retired takes over a stale connection.
        self.input_socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        affinity = None
        if options.routing == RoutingPolicy.PREFIX_AFFINITY:
            affinity = PrefixAffinity(options.affinity, self.vllm_config.cache_config.block_size or DEFAULT_BLOCK_SIZE)
        members = self._members = Membership(self, fleet, joiner, vllm_abort=super()._abort_requests,
                                             affinity=affinity)
        liveness = self._liveness = Liveness(members, options)
        self._outputs_seen = liveness.outputs
        if options.stall.enabled:
            self._rescue = liveness.rescue = Rescue(members, self.add_request_async)
        cancels = Cancels()
        self._elastic = ElasticResize(members, cancels, options)
        self._resizes = ResizeOperations(members, cancels, DenseResize(members, cancels, followers), self._elastic,
                                         Replacement(members, cancels, liveness, followers),
                                         asyncio.get_running_loop())
        # Ranks left out of the attach: their new engines were deleted, nothing is routed to them until replaced.
        dead = {rank: "left out of the attach: its replacement was in flight when the frontend this one replaces "
                      "was lost" for rank in options.detached}
        for rank, why in dead.items():
            members.stop_routing(rank, f"rank {rank} is {RankState.DEAD}: {why}")
        fleet.serving(members, self._resizes, dead)
        logger.info("All %d engine(s) joined; serving", len(self.core_engines) - len(options.detached))
        liveness.start()

    def shutdown(self, timeout: float | None = None) -> None:
        for part in ("_liveness", "_resizes"):  # absent if the startup failed
            component = getattr(self, part, None)
            if component is not None:
                component.stop()
        handshake = getattr(self, "_handshake", None)
        if handshake is not None:
            handshake.abort("the frontend is shutting down")
        super().shutdown(timeout)

    def _ensure_output_queue_task(self) -> None:
        # vllm_compat change 7: the task that reads engine outputs yields after every message.
        if self.resources.output_queue_task is not None:
            return
        with vllm_compat.yielding_output_socket(self.resources):
            super()._ensure_output_queue_task()

    # ---- corefleet's hooks in AsyncLLM (vllm_compat changes 3 and 5) ------------------------------
    def attach_async_llm(self, async_llm: Any, stat_logger_options: dict[str, Any]) -> None:
        """Called once AsyncLLM is built (vllm_compat change 5)."""
        self._members.async_llm = async_llm
        if async_llm.logger_manager is not None:
            stat_loggers = FleetStatLoggers(async_llm.logger_manager, len(self.core_engines), stat_logger_options)
            stat_loggers.finished = self._liveness.prefilled
            self._members.stat_loggers = stat_loggers
            vllm_compat.set_stat_loggers(async_llm, stat_loggers)

    def check_fleet_health(self) -> None:
        """Called by `/health` (vllm_compat change 3): 503 only while no rank is Serving, unless ranks are on their
        way (the fleet is idle or going idle, or a replacement runs: `Fleet.awaits_ranks`): requests wait for them."""
        members = self._members
        if not members.any_serving() and not members.fleet.awaits_ranks():
            raise EngineDeadError()

    # ---- routing -------------------------------------------------------------------------------
    def get_core_engine_for_request(self, request: Any) -> bytes:
        # vLLM's router picks the least loaded of the ranks in `lb_engines` (membership.routing_counts), unless
        # prefix affinity picks the rank (`frontend.affinity`).
        members = self._members
        members.before_routing()
        known = request.request_id in self.reqs_in_flight
        choice = members.choose_by_prefix(request)
        if choice is None:
            engine: bytes = super().get_core_engine_for_request(request)
            if not known:
                members.routed(engine)
            return engine
        rank, decision = choice
        # vLLM's router records a pinned request's engine (for aborts, and its in-flight count) as an unpinned one's;
        # the pin is the request's only for this call.
        request.data_parallel_rank = rank
        try:
            engine = super().get_core_engine_for_request(request)
        finally:
            request.data_parallel_rank = None
        self.lb_engines[rank][0] += self.client_count  # as vLLM's router counts its choice until the next stats
        members.routed(engine, decision)
        return engine

    async def add_request_async(self, request: Any) -> None:
        refused = self._members.refusal(request)
        if refused is not None:
            self._members.fail_requests([request.request_id], refused)
            return
        # A rank whose connection is gone refuses the send (ROUTER_MANDATORY): mark it dead and
        # route the request again; no engine has seen it yet.
        for _ in range(len(self.core_engines)):
            try:
                await super().add_request_async(request)
                if self._rescue is not None:
                    self._rescue.sent(request)
                return
            except zmq.ZMQError as e:
                rank = self._members.unsend(request.request_id)
                if rank is None:
                    raise
                self._liveness.rank_died(rank, connection_lost(e))
                if request.data_parallel_rank is not None:
                    break
        raise EngineDeadError()

    @staticmethod
    async def process_engine_outputs(self: KubeDPLBClient, outputs: Any) -> None:
        """vLLM's hook on each message of engine outputs, before its output handling: the rank's progress
        (`Liveness.outputs`), and what a stalled rank sends for a request moved away from it dropped (`Rescue`).
        Then vLLM's own, which only forgets finished requests' ranks: awaited only for a message that finishes any
        (a request's tokens come in about ten messages; each await of a coroutine costs)."""
        seen = self._outputs_seen
        if seen is not None:
            seen(outputs.engine_index)
        rescue = self._rescue
        if rescue is not None:
            rescue.engine_outputs(outputs)
        if outputs.finished_requests:
            await DPLBAsyncMPClient.process_engine_outputs(self, outputs)

    async def _abort_requests(self, request_ids: list[str], engine: bytes) -> None:
        rank = rank_of(engine)
        record = self._members.records.get(rank)
        if record is None or record.state == RankState.DEAD:
            return  # its requests were already failed
        record.aborts_total += len(request_ids)
        try:
            await super()._abort_requests(request_ids, engine)
        except zmq.ZMQError as e:  # the rank is gone, so are its requests: fail them, do not raise
            self._liveness.rank_died(rank, connection_lost(e))

    # ---- utilities and notifications -------------------------------------------------------------
    async def call_utility_all_async(self, method: str, *args: Any) -> list[Any]:
        """vLLM's fan-out of a utility to every engine, over the live ranks only (`Liveness.call_utility_all`)."""
        liveness: Liveness | None = getattr(self, "_liveness", None)
        if liveness is None:  # during vLLM's own startup, before every rank joined
            results: list[Any] = await super().call_utility_all_async(method, *args)
            return results
        return await liveness.call_utility_all(method, args)

    async def eep_process_engine_core_notification(self, notification_data: Sequence[Any]) -> None:
        """vLLM's output task hands elastic-EP notifications here (`ElasticResize.notification`)."""
        elastic: ElasticResize | None = getattr(self, "_elastic", None)
        if elastic is None:  # before every rank joined: no resize can run
            logger.error("elastic-EP protocol error: %s from rank %s while no elastic-EP resize runs",
                         *notification_data)
            return
        await elastic.notification(notification_data)
