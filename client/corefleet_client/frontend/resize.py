# SPDX-License-Identifier: Apache-2.0
"""Resizing a dense fleet in place (`DenseResize`), and the drain that every scale-down begins with.

Dense ranks are independent engines, so a resize is a change of the client's membership
(docs/vllm-protocol.md §10.1), run as numbered phases on vLLM's event loop through `Membership`:

Scale-up N -> M (`scale_up`):
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

Scale-down M -> N (`scale_down`), only the highest ranks leave:
  1. Draining (`drain`, shared with the elastic-EP scale-down): ranks N..M-1 get no new request at
     once (the router sees them fully loaded; a request pinned to one gets a 503 naming the
     resize), and their in-flight requests finish, for at most the drain timeout; what is left
     then ends with a 503 naming the resize, and the engine is told to abort it. A leaving rank
     that dies meanwhile ends its requests with an error and leaves all the same (no Dead alarm,
     no /health 503).
  2. Committing: `core_engines`, `lb_engines` and `engine_ranks_managed` are cut together
     (`len(lb_engines) <= len(core_engines)` must hold at every moment, or the router raises),
     the size is set, the stat loggers are rebuilt for N ranks (the leaving ranks' series go),
     and `SCALE_ELASTIC_EP(N)` shrinks the stats task's and the coordinator's view.
  3. The leaving ranks are forgotten by the liveness watcher and reported Retired: their pods
     may now be deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from corefleet_client.admin import RankState, ResizeOperation, ResizePhase
from corefleet_client.frontend.fleet import describe
from corefleet_client.frontend.handshake import handshake_address, handshake_failure
from corefleet_client.frontend.membership import Membership
from corefleet_client.frontend.types import COMMIT_GRACE_S, Cancels, FollowerLost, ResizeFailed, pass_over

if TYPE_CHECKING:  # followers.py builds on this module's drain
    from corefleet_client.frontend.followers import Followers

logger = logging.getLogger("corefleet.frontend")

DRAIN_POLL_S = 0.05


# ---- the drain of leaving ranks (dense and elastic-EP scale-downs) ---------------------------------
def stop_routing_to(members: Membership, op: ResizeOperation, leaving: list[int], why: str = "") -> None:
    """Leaving ranks get no new request (the router sees them fully loaded; a pinned one gets a 503)."""
    for rank in leaving:
        members.stop_routing(rank, f"rank {rank} is being retired by resize {op.id} ({op.from_replicas} -> "
                                   f"{op.to_replicas})" if not why else f"rank {rank} is leaving: {why}")
        members.fleet.set_rank(rank, RankState.DRAINING, f"{len(members.requests_on(rank))} request(s) in flight")


def retire_leaving(members: Membership, op: ResizeOperation, leaving: list[int]) -> None:
    """After a scale-down's cut: the leaving ranks forgotten and reported Retired (their pods may go), the fleet at
    its new size, the operation Completed."""
    fleet = members.fleet
    for rank in leaving:
        died = members.retire(rank)
        fleet.set_rank(rank, RankState.RETIRED, f"retired by resize {op.id}"
                       + (f" (it died while draining: {died})" if died else ""))
        fleet.forget_rank(rank)
    fleet.commit_size(op.to_replicas)
    fleet.finish_resize(op.id)


def serve_on(members: Membership, leaving: list[int]) -> None:
    """A scale-down stopped before its commit: the ranks that were to leave serve on."""
    for rank in leaving:
        members.unroutable.pop(rank, None)
        members.fleet.set_rank(rank, RankState.SERVING)


async def drain(members: Membership, cancels: Cancels, op: ResizeOperation, leaving: list[int],
                stop: Callable[[], str | None] | None = None) -> None:
    """Until the leaving ranks' in-flight requests finished, or the drain timeout passed (then they end with a 503).
    `stop`: checked at each poll, as a cancel is; a reason stops the drain (ResizeFailed, the fleet intact)."""
    deadline = time.monotonic() + op.drain_timeout_s
    shown: dict[int, int] = {}
    while True:
        cancels.check(op)
        why = None if stop is None else stop()
        if why is not None:
            raise ResizeFailed(why)
        busy = {rank: members.in_flight(rank) for rank in leaving}
        busy = {rank: n for rank, n in busy.items() if n > 0}
        for rank in leaving:
            if shown.get(rank) != busy.get(rank, 0) and rank not in members.lost:
                shown[rank] = busy.get(rank, 0)
                members.fleet.set_rank(rank, RankState.DRAINING, f"{shown[rank]} request(s) in flight")
        if not busy:
            return
        if time.monotonic() >= deadline:
            for rank in busy:
                await _end_leftovers(members, op, rank)
            return
        await asyncio.sleep(DRAIN_POLL_S)


async def _end_leftovers(members: Membership, op: ResizeOperation, rank: int) -> None:
    ids = members.requests_on(rank)
    logger.warning("Resize %s: rank %d still has %d request(s) after the %gs drain timeout; "
                   "ending them", op.id, rank, len(ids), op.drain_timeout_s)
    members.fail_requests(ids, f"rank {rank} was retired by resize {op.id} ({op.from_replicas} -> "
                               f"{op.to_replicas}) before this request finished: its drain timeout "
                               f"of {op.drain_timeout_s:g}s passed; retry the request", rank)
    with contextlib.suppress(zmq.ZMQError):
        await members.abort_on_engine(ids, rank)


class DenseResize:
    """Scale-up and scale-down of a dense fleet (see the module docstring); with several frontends, frontend 0 drives
    the others through their part of each (`followers`, see `frontend.followers`)."""

    def __init__(self, members: Membership, cancels: Cancels, followers: Followers | None = None) -> None:
        self.members = members
        self.fleet = members.fleet
        self.cancels = cancels
        self.followers = followers

    async def scale_up(self, op: ResizeOperation) -> None:
        to = op.to_replicas
        new = list(range(op.from_replicas, to))
        await self._join(op, new)
        await self._followers_prepared(op, new)
        # 3. Commit: loggers first, then routing, then the stats task and the coordinator.
        self.fleet.update_resize(op.id, phase=ResizePhase.COMMITTING, message=f"adding {describe(new)}")
        await self.members.add_ranks(new, to)
        await self._commit_followers(op, list(self.followers.admins) if self.followers else [])
        self.fleet.commit_size(to)
        self.fleet.finish_resize(op.id)

    async def _followers_prepared(self, op: ResizeOperation, new: list[int]) -> None:
        """Every other frontend read the new ranks' ready responses (Prepared), or the scale-up fails: the followers
        are cancelled and the new ranks retired again (nothing was routed to them)."""
        followers = self.followers
        if followers is None:
            return
        self.fleet.update_resize(op.id, message=f"every frontend reads the ready responses of {describe(new)}")
        try:
            lost = await followers.start(op, (ResizePhase.PREPARED,), time.monotonic() + COMMIT_GRACE_S, self.cancels)
            why = "; ".join(str(e) for e in lost.values())
        except ResizeFailed as e:  # cancelled
            why = str(e)
        if not why:
            return
        await followers.cancel(op, f"resize {op.id} failed on frontend 0: {why}")
        for rank in new:
            self.fleet.set_rank(rank, RankState.RETIRED, f"joined, then retired again: {why}")
            self.fleet.forget_rank(rank)
        raise ResizeFailed(f"not every frontend can route to {describe(new)}: {why}")

    async def _commit_followers(self, op: ResizeOperation, indexes: list[int]) -> None:
        """Each Prepared follower commits its part; one that cannot is lost (its replacement attaches at the new
        size)."""
        if self.followers is None:
            return
        await self.followers.commit(op, indexes, f"at {op.to_replicas} ranks")

    async def _join(self, op: ResizeOperation, new: list[int]) -> None:
        """Phases 1 and 2 of a scale-up. Before the commit nothing has changed: on a failure the fleet serves on
        at N, and the new ranks are Failed (or Retired again, if they joined)."""
        joiner = self.members.joiner
        address = handshake_address(self.members.client.vllm_config.parallel_config)
        joined: set[int] = set()
        try:
            # 1. The handshake, in a thread (vLLM's loop blocks), bounded by the join timeout.
            self.fleet.update_resize(op.id, phase=ResizePhase.PREPARING,
                                     message=f"waiting for {describe(new)} to handshake on {address}")
            self.cancels.check(op)
            joiner.discard_stale_ready_responses()
            await joiner.join(op, new, address)
            joined.update(new)
            for rank in new:
                self.fleet.set_rank(rank, RankState.JOINING, "engine READY; reading its ready response")
            # 2. Their ready responses, sent on the requests socket before READY.
            await joiner.read_ready_responses(new)
            self.cancels.check(op)
        except Exception as raised:
            e = handshake_failure(raised, f"Resize {op.id}", "ranks")
            for rank in new:
                if rank in joined:
                    self.fleet.set_rank(rank, RankState.RETIRED, f"joined, then retired again: {e}")
                else:
                    self.fleet.set_rank(rank, RankState.FAILED, f"did not join: {e}")
                self.fleet.forget_rank(rank)
            raise e from None

    async def scale_down(self, op: ResizeOperation) -> None:
        members, fleet = self.members, self.fleet
        frm, to = op.from_replicas, op.to_replicas
        leaving = list(range(to, frm))
        # 1. Drain: no new requests, the in-flight ones finish (or fail at the deadline).
        fleet.update_resize(op.id, phase=ResizePhase.DRAINING,
                            message=f"{describe(leaving)} finish their in-flight requests "
                                    f"(at most {op.drain_timeout_s:g}s)")
        started = time.monotonic()
        try:
            draining = await self._followers_draining(op, started)
            stop_routing_to(members, op, leaving)
            await drain(members, self.cancels, op, leaving)
            drained = await self._followers_drained(op, draining, started)
        except ResizeFailed as e:
            serve_on(members, leaving)  # cancelled: they serve on
            if self.followers is not None:
                await self.followers.cancel(op, f"resize {op.id} stopped on frontend 0: {e}")
            raise
        # 2. Commit: cut the lists together, without an await in between.
        fleet.update_resize(op.id, phase=ResizePhase.COMMITTING, message=f"removing {describe(leaving)}")
        marker = members.cut_routing(to)
        await members.shrink(frm, to, marker)
        await self._commit_followers(op, drained)
        # 3. Forget them; the operator may delete their pods.
        retire_leaving(members, op, leaving)

    async def _followers_draining(self, op: ResizeOperation, started: float) -> list[int]:
        """Every other frontend stopped routing to the leaving ranks (Draining, or already drained): the followers
        that did; one that cannot be reached is passed over (it is lost)."""
        if self.followers is None:
            return []
        lost = await self.followers.start(op, (ResizePhase.DRAINING, ResizePhase.PREPARED),
                                          started + COMMIT_GRACE_S, self.cancels)
        self._pass_over(op, lost)
        return [i for i in self.followers.admins if i not in lost]

    async def _followers_drained(self, op: ResizeOperation, draining: list[int], started: float) -> list[int]:
        """The followers that drained their requests on the leaving ranks (Prepared) within the drain timeout."""
        if self.followers is None:
            return []
        lost = await self.followers.wait(op, draining, (ResizePhase.PREPARED,),
                                         started + op.drain_timeout_s + COMMIT_GRACE_S, self.cancels)
        self._pass_over(op, lost)
        return [i for i in draining if i not in lost]

    @staticmethod
    def _pass_over(op: ResizeOperation, lost: dict[int, FollowerLost]) -> None:
        """Followers that cannot be reached are passed over (lost: their replacements attach at the new size); one
        that refused or failed its part still routes to the leaving ranks, so the scale-down stops."""
        pass_over(op, lost, "not every frontend stopped routing to the leaving ranks", f"at {op.to_replicas} ranks")
