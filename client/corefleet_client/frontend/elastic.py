# SPDX-License-Identifier: Apache-2.0
"""Resizing an MoE fleet in place: vLLM's elastic-EP protocol with pods as the engines (`ElasticResize`).

The ranks of an MoE fleet share collectives (their DP group, the expert all-to-alls, EPLB), so a
resize is not a change of the client's membership as for a dense fleet: every rank moves to a new
group together. vLLM 0.32.0 has the engine side of that (`DPEngineCoreProc.reinitialize_distributed`,
`commit_prepared_elastic_ep`, `distributed/elastic_ep/elastic_state.py`), and a client side bound
to Ray (`DPLBAsyncMPClient.prepare_elastic_ep`, `_prepare_scale_up_elastic_ep`,
`_commit_scale_down_elastic_ep`, `eep_process_engine_core_notification` assert or call the Ray
actor manager). This component replaces exactly those client steps; the engine utilities, the
`ReconfigureDistributedRequest`, the pause modes, `SCALE_ELASTIC_EP` and the notifications are
vLLM's (docs/vllm-protocol.md §10.2).

What differs from upstream, and why:

* The coordination store of a resize lives in engine 0's pod, not beside the client: every group's
  rank 0 binds at the DP master address, which is also where the store is reached. Engine 0's
  launcher serves a fresh store per resize on request (`corefleet_client.coordstore`), with free
  ports of its host for the new groups' masters.
* The new ranks are pods the operator starts (with `VLLM_ELASTIC_EP_SCALE_UP_LAUNCH=1`, the new size
  and R' in `--eplb-config`, from this operation's `num_redundant_experts`); this client answers
  their HELLO with INIT carrying the new size, the resize's ports and store, and checks READY's
  hash against the new-size config.
* A scale-down drains the leaving ranks first (upstream pauses them with mode "abort").
* Each leaving rank's SHUTDOWN_COMPLETE is counted from exactly the leaving ranks, and reported as
  that rank Retired (its pod may go); one from another rank, or twice from one, fails the operation.

Scale-up N -> M (`scale_up`):
  1. Preparing: a fresh store from engine 0's pod; the handshake ROUTER opened for ranks N..M-1
     (INIT with M, the ports, the store) while `reinitialize_distributed(M, KEEP_CURRENT_RANK)` goes
     to every old rank at once (a new rank's init blocks in collectives with the old ranks, so its
     READY comes only once they prepared); the new ranks' ready responses; the `eep_ready/0..M-1`
     keys awaited on the store. All within the join timeout.
  2. Committing: the old ranks paused ("keep": their requests stay, nothing is scheduled),
     `commit_prepared_elastic_ep` to each, RECONFIGURE_FINISHED from rank 0 awaited; then the stat
     loggers rebuilt for M, the new identities routed, the size set, `SCALE_ELASTIC_EP(M)`, the
     old ranks resumed, R' recorded.

Scale-down M -> N (`scale_down`):
  1. Draining, as for a dense fleet (cancellable; the fleet is intact if it stops here).
  2. Preparing: a fresh store; `reinitialize_distributed(N, KEEP)` to the survivors; their
     `eep_ready` keys awaited.
  3. Committing: the lists cut to N, the survivors paused ("keep"), `commit_prepared_elastic_ep` to
     each survivor and `reinitialize_distributed(N, SHUTDOWN_CURRENT_RANK)` to each leaving rank, the
     size set, `SCALE_ELASTIC_EP(N)`, RECONFIGURE_FINISHED awaited, the survivors resumed, and a
     SHUTDOWN_COMPLETE awaited from each leaving rank (Retired as each comes).

Failures: before the first `reinitialize_distributed` the fleet is untouched and serves on. After
it, vLLM has no way back (a prepared reconfiguration cannot be abandoned, and a second one is
refused while it is active), so the operation fails with `fleet_intact=False` and the operator
recreates the fleet at its committed size. A participant that dies, a deadline that passes, a
refused utility call or a protocol error (a notification out of order) all end it so.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from vllm.v1.engine import EEPNotificationType, ReconfigureDistributedRequest, ReconfigureRankType

from corefleet_client import coordstore
from corefleet_client.admin import RankState, ResizeOperation, ResizePhase
from corefleet_client.frontend.fleet import Fleet, describe, identity
from corefleet_client.frontend.handshake import handshake_address
from corefleet_client.frontend.membership import Membership
from corefleet_client.frontend.resize import drain, serve_on, stop_routing_to
from corefleet_client.frontend.types import Cancels, FleetOptions, ResizeFailed

logger = logging.getLogger("corefleet.frontend")

RECONFIGURE_TIMEOUT_S = 300.0  # commit -> RECONFIGURE_FINISHED (the EPLB reshuffle runs in between)
SHUTDOWN_TIMEOUT_S = 120.0  # a leaving rank's SHUTDOWN_COMPLETE after its shutdown request
STORE_POLL_S = 0.2
PAUSE_MODE = "keep"  # vLLM's `_eep_commit_pause_mode` for the V1 model runner


class ProtocolError(Exception):
    """A notification that breaks the elastic-EP protocol (from an unexpected rank, twice, out of order)."""


@dataclasses.dataclass
class _Notifications:
    """What one elastic-EP resize expects from the engines' notifications (`eep_process_engine_core_notification`)."""

    resize_id: str
    leaving: frozenset[int]
    finished: asyncio.Future[None]  # RECONFIGURE_FINISHED from rank 0, once committed
    error: asyncio.Future[None]  # set to the first protocol error
    shut_down: dict[int, asyncio.Future[None]]  # leaving rank -> its SHUTDOWN_COMPLETE
    committed: bool = False


@dataclasses.dataclass(frozen=True)
class _Store:
    """A resize's coordination store in engine 0's pod, and the free ports of its host for the new groups' masters."""

    host: str
    port: int
    ports: list[int]


def reconfigure_request(parallel_config: Any, size: int, rank: ReconfigureRankType) -> ReconfigureDistributedRequest:
    """`DPLBAsyncMPClient._make_reconfig_request` from a resize's parallel config (`_parallel_config`)."""
    return ReconfigureDistributedRequest(
        new_data_parallel_size=size,
        new_data_parallel_rank=rank,
        new_data_parallel_rank_local=ReconfigureRankType.KEEP_CURRENT_RANK,
        new_data_parallel_master_ip=parallel_config.data_parallel_master_ip,
        new_data_parallel_master_port=parallel_config.data_parallel_master_port,
        new_data_parallel_master_port_list=list(parallel_config._data_parallel_master_port_list),
        coord_store_port=parallel_config._coord_store_port,
    )


class ElasticResize:
    """Resizes of an MoE fleet with vLLM's elastic-EP protocol (see the module docstring)."""

    def __init__(self, members: Membership, cancels: Cancels, options: FleetOptions) -> None:
        self.members = members
        self.fleet = members.fleet
        self.cancels = cancels
        self.options = options
        self.running: _Notifications | None = None  # what the resize that runs expects from the notifications

    # ---- notifications (vLLM's output task hands the client those of call id -1) -------------------
    async def notification(self, notification_data: Sequence[Any]) -> None:
        """`DPLBAsyncMPClient.eep_process_engine_core_notification` without the Ray actor manager.

        RECONFIGURE_FINISHED resolves the running resize's wait (only from rank 0, only after its
        commit); SHUTDOWN_COMPLETE retires exactly one leaving rank, once. Anything else is a
        protocol error that fails the running resize (or is logged when none runs)."""
        kind_name, rank = notification_data
        eep = self.running
        try:
            kind = EEPNotificationType(kind_name)
            if eep is None:
                raise ProtocolError(f"{kind_name} from rank {rank} while no elastic-EP resize runs")
            if kind == EEPNotificationType.RECONFIGURE_FINISHED:
                self._reconfigure_finished(eep, rank)
            elif kind == EEPNotificationType.SHUTDOWN_COMPLETE:
                self._shutdown_complete(eep, rank)
            else:
                raise ProtocolError(f"unexpected notification {kind_name} from rank {rank}")
        except (ValueError, ProtocolError) as e:
            message = f"elastic-EP protocol error: {e}"
            logger.error("%s", message)
            if eep is not None and not eep.error.done():
                eep.error.set_exception(ProtocolError(message))

    def _reconfigure_finished(self, eep: _Notifications, rank: int) -> None:
        if rank != 0:
            raise ProtocolError(f"RECONFIGURE_FINISHED from rank {rank}: only rank 0 of the new group sends it")
        if not eep.committed or eep.finished.done():
            raise ProtocolError("RECONFIGURE_FINISHED " + ("twice" if eep.finished.done() else "before the commit"))
        logger.info("Resize %s: RECONFIGURE_FINISHED from rank 0", eep.resize_id)
        eep.finished.set_result(None)

    def _shutdown_complete(self, eep: _Notifications, rank: int) -> None:
        done = eep.shut_down.get(rank)
        if done is None:
            raise ProtocolError(f"SHUTDOWN_COMPLETE from rank {rank}, which is not leaving "
                                f"(leaving: {sorted(eep.leaving) or 'none'})")
        if done.done():
            raise ProtocolError(f"a second SHUTDOWN_COMPLETE from rank {rank}")
        if not eep.committed:
            raise ProtocolError(f"SHUTDOWN_COMPLETE from rank {rank} before the commit")
        logger.info("Resize %s: SHUTDOWN_COMPLETE from rank %d", eep.resize_id, rank)
        self.fleet.set_rank(rank, RankState.RETIRED, f"SHUTDOWN_COMPLETE: retired by resize {eep.resize_id}")
        done.set_result(None)

    # ---- scale-up ------------------------------------------------------------------------------
    async def scale_up(self, op: ResizeOperation) -> None:
        frm, to = op.from_replicas, op.to_replicas
        old, new = list(range(frm)), list(range(frm, to))
        pc = self.members.client.vllm_config.parallel_config
        deadline = time.monotonic() + op.join_timeout_s
        self.fleet.update_resize(op.id, phase=ResizePhase.PREPARING,
                                 message="asking engine 0's pod for a fresh coordination store")
        self.alive(op, old)
        store = await self._store(op)
        new_pc = self._parallel_config(to, store, op.num_redundant_experts)
        address = handshake_address(pc)
        self.cancels.check(op)
        self.members.joiner.discard_stale_ready_responses()
        eep = self.running = _new_notifications(op.id, ())
        handshake: asyncio.Task[None] | None = None
        try:
            # 1. The new ranks handshake while the old ones prepare: neither finishes without the other.
            handshake = asyncio.create_task(self.members.joiner.join(op, new, address, parallel_config=new_pc))
            self.fleet.update_resize(op.id, message=f"reinitialize_distributed({to}) to {describe(old)}; waiting for "
                                                    f"{describe(new)} to handshake on {address}")
            await self._prepare_up(op, old, new, new_pc, store, handshake, deadline)
            # 2. Commit.
            self.fleet.update_resize(op.id, phase=ResizePhase.COMMITTING,
                                     message=f"commit_prepared_elastic_ep to {describe(old)}")
            await self._commit_up(op, old, new, eep)
        except BaseException as e:
            await self._joining_failed(op, new, handshake, e)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise self._fail(_why(e)) from None
        finally:
            self.running = None
        _set_redundant_experts(self.fleet, pc, op.num_redundant_experts)
        self.fleet.commit_size(to)
        self.fleet.finish_resize(op.id)

    async def _prepare_up(self, op: ResizeOperation, old: list[int], new: list[int], new_pc: Any, store: _Store,
                          handshake: asyncio.Task[None], deadline: float) -> None:
        """The old ranks prepare the new group while the new ranks join it; then every `eep_ready` key is set."""
        request = reconfigure_request(new_pc, op.to_replicas, ReconfigureRankType.KEEP_CURRENT_RANK)
        keys = await self.call(op, old, "reinitialize_distributed", (request,), deadline, "reinitialize_distributed")
        # The handshake is bounded by the join timeout itself (and says which rank did not join).
        await self.wait(op, handshake, float("inf"), f"{describe(new)} to handshake", old)
        for rank in new:
            self.fleet.set_rank(rank, RankState.JOINING, "engine READY; reading its ready response")
        await self.members.joiner.read_ready_responses(new)
        keys = [str(k) for k in keys] + [f"eep_ready/{rank}" for rank in new]
        self.fleet.update_resize(op.id, message=f"waiting for {len(keys)} eep_ready keys on the store "
                                                f"{store.host}:{store.port}")
        await self.wait_keys(op, store, keys, deadline, old)

    async def _commit_up(self, op: ResizeOperation, old: list[int], new: list[int], eep: _Notifications) -> None:
        commit_deadline = time.monotonic() + RECONFIGURE_TIMEOUT_S
        await self.call(op, old, "pause_scheduler", (PAUSE_MODE, False), commit_deadline, "pause_scheduler")
        eep.committed = True
        await self.call(op, old, "commit_prepared_elastic_ep", (), commit_deadline, "commit_prepared_elastic_ep")
        await self.wait(op, eep.finished, commit_deadline, "RECONFIGURE_FINISHED from rank 0", old)
        await self.members.add_ranks(new, op.to_replicas)
        await self.call(op, old, "resume_scheduler", (), commit_deadline, "resume_scheduler")

    async def _joining_failed(self, op: ResizeOperation, new: list[int], handshake: asyncio.Task[None] | None,
                              e: BaseException) -> None:
        """A failed scale-up: the join stopped, and the new ranks that never became members Failed."""
        if handshake is not None and not handshake.done():
            self.members.joiner.abort(f"the resize failed: {_why(e)}")
            await asyncio.gather(handshake, return_exceptions=True)
        for rank in new:
            if rank not in self.members.records:
                self.fleet.set_rank(rank, RankState.FAILED, f"did not join: {_why(e)}")
                self.fleet.forget_rank(rank)

    # ---- scale-down ----------------------------------------------------------------------------
    async def scale_down(self, op: ResizeOperation) -> None:
        frm, to = op.from_replicas, op.to_replicas
        survivors, leaving = list(range(to)), list(range(to, frm))
        self.alive(op, survivors + leaving)
        # 1. Drain.
        store = await self._drain_leaving(op, survivors, leaving)
        new_pc = self._parallel_config(to, store, op.num_redundant_experts)
        eep = self.running = _new_notifications(op.id, leaving)
        try:
            # 2. Prepare the survivors.
            await self._prepare_down(op, survivors, leaving, new_pc, store)
            # 3. Commit: the lists cut together, then the survivors switch and the leaving ranks shut down.
            await self._commit_down(op, survivors, leaving, new_pc, eep)
        except Exception as e:
            raise self._fail(_why(e)) from None
        finally:
            self.running = None
        for rank in leaving:
            died = self.members.retire(rank)
            self.fleet.forget_rank(rank)
            if died:
                logger.warning("Resize %s: rank %d %s", op.id, rank, died)
        _set_redundant_experts(self.fleet, self.members.client.vllm_config.parallel_config, op.num_redundant_experts)
        self.fleet.commit_size(to)
        self.fleet.finish_resize(op.id)

    async def _drain_leaving(self, op: ResizeOperation, survivors: list[int], leaving: list[int]) -> _Store:
        """The leaving ranks drained, then the resize's store; cancelled (or no store), the fleet is intact."""
        self.fleet.update_resize(op.id, phase=ResizePhase.DRAINING,
                                 message=f"{describe(leaving)} finish their in-flight requests "
                                         f"(at most {op.drain_timeout_s:g}s)")
        stop_routing_to(self.members, op, leaving)
        try:
            await drain(self.members, self.cancels, op, leaving)
            self.alive(op, survivors + leaving)
            self.fleet.update_resize(op.id, phase=ResizePhase.PREPARING,
                                     message="asking engine 0's pod for a fresh coordination store")
            store = await self._store(op)
            self.cancels.check(op)
        except ResizeFailed as e:
            if not e.fleet_intact:
                raise
            serve_on(self.members, leaving)  # cancelled, or no store: they serve on
            raise
        return store

    async def _prepare_down(self, op: ResizeOperation, survivors: list[int], leaving: list[int], new_pc: Any,
                            store: _Store) -> None:
        deadline = time.monotonic() + op.join_timeout_s
        self.fleet.update_resize(op.id, message=f"reinitialize_distributed({op.to_replicas}) to {describe(survivors)}")
        request = reconfigure_request(new_pc, op.to_replicas, ReconfigureRankType.KEEP_CURRENT_RANK)
        keys = await self.call(op, survivors, "reinitialize_distributed", (request,), deadline,
                               "reinitialize_distributed")
        await self.wait_keys(op, store, [str(k) for k in keys], deadline, survivors + leaving)

    async def _commit_down(self, op: ResizeOperation, survivors: list[int], leaving: list[int], new_pc: Any,
                           eep: _Notifications) -> None:
        frm, to = op.from_replicas, op.to_replicas
        self.fleet.update_resize(op.id, phase=ResizePhase.COMMITTING,
                                 message=f"commit_prepared_elastic_ep to {describe(survivors)}; "
                                         f"SHUTDOWN_CURRENT_RANK to {describe(leaving)}")
        commit_deadline = time.monotonic() + RECONFIGURE_TIMEOUT_S
        marker = self.members.cut_routing(to)
        await self.call(op, survivors, "pause_scheduler", (PAUSE_MODE, False), commit_deadline, "pause_scheduler")
        eep.committed = True
        shutdown = reconfigure_request(new_pc, to, ReconfigureRankType.SHUTDOWN_CURRENT_RANK)
        await asyncio.gather(
            self.call(op, survivors, "commit_prepared_elastic_ep", (), commit_deadline, "commit_prepared_elastic_ep"),
            self.call(op, leaving, "reinitialize_distributed", (shutdown,), commit_deadline,
                      "reinitialize_distributed(SHUTDOWN_CURRENT_RANK)", watch=False))
        await self.members.shrink(frm, to, marker)
        await self.wait(op, eep.finished, commit_deadline, "RECONFIGURE_FINISHED from rank 0", survivors)
        await self.call(op, survivors, "resume_scheduler", (), commit_deadline, "resume_scheduler")
        shutdown_deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        for rank in leaving:
            await self.wait(op, eep.shut_down[rank], shutdown_deadline, f"SHUTDOWN_COMPLETE from rank {rank}",
                            survivors)

    # ---- helpers -------------------------------------------------------------------------------
    def _fail(self, message: str) -> ResizeFailed:
        return ResizeFailed(f"{message} (the MoE fleet's ranks were told to reconfigure: it must be recreated)",
                            fleet_intact=False)

    def alive(self, op: ResizeOperation, ranks: Iterable[int]) -> None:
        """Every participant is up: a Dead or Unresponsive one, or a leaving one that died, ends the resize."""
        members = self.members
        for rank in ranks:
            record = members.records.get(rank)
            # A dead member breaks the fleet's collectives whatever the resize did; an unresponsive one may
            # come back, so the fleet is intact if nothing was asked of the ranks yet.
            if rank in members.lost:
                raise ResizeFailed(f"rank {rank} died: {members.lost[rank]}", fleet_intact=False)
            if record is not None and record.state == RankState.DEAD:
                raise ResizeFailed(f"rank {rank} is {record.state}: {record.message}", fleet_intact=False)
            if record is not None and record.state == RankState.UNRESPONSIVE:
                raise ResizeFailed(f"rank {rank} is {record.state}: {record.message}",
                                   fleet_intact=self.running is None)

    async def _store(self, op: ResizeOperation) -> _Store:
        """A fresh coordination store for this resize, from engine 0's pod."""
        host, port = self.options.engine0_address, self.options.coord_store_port
        if not host or not port:
            raise ResizeFailed("no coordination store: the frontend was started without engine 0's address and "
                               "--coord-store-port (an elastic-EP fleet's frontend gets both)")
        try:
            store_port, ports = await asyncio.to_thread(coordstore.request_resize_store, host, port, op.id)
        except (OSError, ValueError, KeyError) as e:
            raise ResizeFailed(f"engine 0's pod made no coordination store for the resize ({host}:"
                               f"{port + coordstore.CONTROL_PORT_OFFSET}): {type(e).__name__}: {e}") from None
        logger.info("Resize %s: coordination store %s:%d, master ports %s", op.id, host, store_port, ports)
        return _Store(host, store_port, ports)

    def _parallel_config(self, size: int, store: _Store, redundant: int | None) -> Any:
        """The parallel config of the group after the resize: INIT's fields for new ranks, the reconfigure
        request's, and what a new rank's READY hash is checked against (the size and R' are hashed)."""
        pc = copy.copy(self.members.client.vllm_config.parallel_config)
        pc.data_parallel_master_ip = self.options.engine0_address
        pc.data_parallel_size = size
        pc._data_parallel_master_port_list = list(store.ports[1:])
        pc.data_parallel_master_port = store.ports[0]
        pc._coord_store_port = store.port
        if redundant is not None:
            pc.eplb_config = copy.copy(pc.eplb_config)
            pc.eplb_config.num_redundant_experts = redundant
        return pc

    async def call(self, op: ResizeOperation, ranks: Sequence[int], method: str, args: tuple[Any, ...],
                   deadline: float, what: str, watch: bool = True) -> list[Any]:
        """A utility call to each of `ranks` at once; their answers in rank order. Fails on an error answer, an
        unsendable call, a participant that dies (unless `watch` is off: leaving ranks exit after answering)
        or the deadline."""
        calls = {}
        for rank in ranks:
            try:
                calls[rank] = await self.members.send_utility_call(identity(rank), method, args)
            except Exception as e:
                raise ResizeFailed(f"{what} could not be sent to rank {rank}: {e}") from None
        gathered = asyncio.gather(*calls.values())
        try:
            await self.wait(op, gathered, deadline, f"{what} on {describe(ranks)}", ranks if watch else ())
        except ResizeFailed:
            gathered.cancel()
            raise
        return list(gathered.result())

    async def wait(self, op: ResizeOperation, future: asyncio.Future[Any], deadline: float, what: str,
                   ranks: Iterable[int]) -> None:
        """Wait for `future`, watching the participants `ranks`, the protocol and the deadline."""
        ranks = list(ranks)
        eep = self.running
        while True:
            waits = {future} | ({eep.error} if eep is not None else set())
            await asyncio.wait(waits, timeout=STORE_POLL_S, return_when=asyncio.FIRST_COMPLETED)
            if eep is not None and eep.error.done():
                raise ResizeFailed(str(eep.error.exception()))
            if future.done():
                error = future.exception()
                if error is not None:
                    raise ResizeFailed(f"{what} failed: {_why(error)}")
                return
            self.alive(op, ranks)
            if time.monotonic() > deadline:
                raise ResizeFailed(f"{what}: no answer within the deadline")

    async def wait_keys(self, op: ResizeOperation, store: _Store, keys: list[str], deadline: float,
                        ranks: Iterable[int]) -> None:
        """Wait until every key is set on the resize's store (vLLM: `self._coord_store.wait(ready_keys)`)."""
        ranks = list(ranks)
        client = await asyncio.to_thread(_store_client, store.host, store.port)
        while True:
            missing = await asyncio.to_thread(lambda: [k for k in keys if not client.check([k])])
            if not missing:
                return
            self.alive(op, ranks)
            if self.running is not None and self.running.error.done():
                raise ResizeFailed(str(self.running.error.exception()))
            if time.monotonic() > deadline:
                raise ResizeFailed(f"{', '.join(missing)} not set on the coordination store {store.host}:{store.port} "
                                   f"within the join timeout of {op.join_timeout_s:g}s")
            await asyncio.sleep(STORE_POLL_S)


def _new_notifications(resize_id: str, leaving: Iterable[int]) -> _Notifications:
    loop = asyncio.get_running_loop()
    error: asyncio.Future[None] = loop.create_future()
    error.add_done_callback(lambda f: f.cancelled() or f.exception())  # read by the waits; never "unretrieved"
    leaving = frozenset(leaving)
    return _Notifications(resize_id=resize_id, leaving=leaving, finished=loop.create_future(), error=error,
                          shut_down={rank: loop.create_future() for rank in leaving})


def _store_client(host: str, port: int) -> Any:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore(host, port, is_master=False, world_size=-1, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=30))


def _why(e: BaseException) -> str:
    if isinstance(e, asyncio.CancelledError):
        return "the frontend is shutting down"
    text = str(e)
    return text if isinstance(e, ResizeFailed | ProtocolError) else f"{type(e).__name__}: {text}"


def _set_redundant_experts(fleet: Fleet, parallel_config: Any, redundant: int | None) -> None:
    """After a commit: the fleet's R is R' (vLLM's `commit_elastic_ep` sets it on the client's config)."""
    if redundant is None:
        return
    parallel_config.eplb_config.num_redundant_experts = redundant
    if fleet.experts is not None:
        fleet.experts = dataclasses.replace(fleet.experts, num_redundant_experts=redundant)
