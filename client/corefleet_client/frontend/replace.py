# SPDX-License-Identifier: Apache-2.0
"""Replacing a lost rank of a dense fleet in place: the frontend's side (`Replacement`).

Dense ranks are independent engines (no collective spans them: docs/vllm-protocol.md §10.1), so
a rank whose engine died can be given a new engine under the same rank while the other ranks
serve on. A replacement is a resize operation whose size does not change (`from_replicas ==
to_replicas`) and that names the ranks it replaces (`ResizeRequest.replace`); it runs through the
same admin API, one operation at a time, idempotent by id.

Preconditions (checked by `Fleet.start_resize` when the request comes, 409 otherwise):

* the fleet is dense: an MoE fleet's ranks share collectives (their DP group, expert all-to-alls)
  that cannot lose a member, so an MoE fleet is recreated as a whole (400);
* each replaced rank is Dead: its connection is gone, so its in-flight requests have already been
  ended with an explicit error and nothing is routed to it. An Unresponsive rank is not replaced:
  its process may still answer and its requests still run; the operator deletes its pod, the
  connection goes, the rank turns Dead, and only then is it replaced. One rule, no request that
  two engines could answer.

A *vacating* replacement (`ResizeRequest.vacate`: the operator saw the rank's pod being removed voluntarily, by
an eviction or a delete with its grace period) also takes ranks that still serve, and first runs step 0
(`Replacement._vacate`): no new request goes to them, their in-flight requests finish (at most the drain
timeout; what is left ends with an error), their engines are released (the utility call `RELEASE_UTILITY`,
which ends the launcher's pre-stop wait, so the pod stops), and once their connections are gone they are Dead
and the steps below follow.

Steps (`Replacement.replace`, on vLLM's event loop), the rank staying Dead and unroutable until the commit:

1. Preparing: the handshake ROUTER is bound again, with ROUTER_HANDOVER, for exactly the replaced
   ranks, and vLLM's own `wait_for_engine_startup` answers the new engine's HELLO with the same INIT
   as at startup (the frontend's engine sockets, the coordinator's fixed addresses, the same fleet
   size: a dense INIT carries no parallel config), bounded by the join timeout and cancellable
   (the scale-up's `Handshake.join`).
2. The new engine's ready response is read from the requests ROUTER, which has ROUTER_HANDOVER
   set: the new connection under the rank's identity takes the dead one's place. Its version and
   tensor-parallel size are checked as in a scale-up. The fleet's summed `num_gpu_blocks` is kept
   as it was (vLLM's `_apply_ready_response` adds each ready response's blocks: the replacement
   takes the lost engine's share, it does not add one).
3. Committing, without an await: any request still recorded on the rank is ended with an error
   (there should be none: they were failed when it died), its routing counters are reset
   (`engine_inflight`, its `lb_engines` entry, the coordinator's stale load ignored until its
   first request), it leaves the unroutable ranks, the liveness watcher forgets any probe of the lost
   engine, and it is Serving again.
   `core_engines`, the size, the stat loggers and the coordinator are unchanged: the identity is
   the same, and no `SCALE_ELASTIC_EP` is sent (the size did not change).

The coordinator (vLLM 0.32.0 `v1/engine/coordinator.py`) needs nothing for a rejoined dense
engine: the new engine subscribes to the back publish XPUB (`XPUB_VERBOSE`, so the subscription
reaches the coordinator although rank 0 is subscribed to the same topic), and the coordinator answers
every late subscription with a `READY` broadcast, which the running engines ignore
(`EngineCoreProc.process_input_sockets`). Wave coordination is off for dense fleets, and the
engine count does not change. One thing it does keep: its load counts for the rank are the lost
engine's last ones (an engine publishes its counts only when they change, and the new engine's
start at (0, 0) like its `last_counts`, so it publishes nothing until it gets a request). Had the
lost engine died with requests running, the router would take the new engine for that loaded and,
on a lightly loaded fleet, never give it a request. So until the first request is routed to a
replaced rank, the router sees its load as zero (`Membership.ignore_load_until_routed` at the commit,
then `Membership.ignore_stale_loads`, called before each routing choice); from then on the engine's
own counts reach the coordinator. A rank back from Unresponsive gets the same treatment (its
coordinator counts may be from before it stalled).

On a failure (no HELLO or READY within the join timeout, a cancel, no ready response, another
vLLM version or TP size) the operation fails with the reason, the rank stays Dead and unroutable,
and the rest of the fleet is untouched (`fleet_intact`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Collection
from typing import TYPE_CHECKING, Protocol

from corefleet_client.admin import RELEASE_UTILITY, RankState, ResizeOperation, ResizePhase
from corefleet_client.frontend.fleet import describe, identity
from corefleet_client.frontend.handshake import handshake_address, handshake_failure
from corefleet_client.frontend.membership import Membership
from corefleet_client.frontend.resize import DRAIN_POLL_S, drain, serve_on, stop_routing_to
from corefleet_client.frontend.types import COMMIT_GRACE_S, Cancels, FollowerLost, ResizeFailed, pass_over

if TYPE_CHECKING:  # followers.py builds on this module's commit
    from corefleet_client.frontend.followers import Followers

logger = logging.getLogger("corefleet.frontend")

RELEASE_ANSWER_TIMEOUT_S = 5.0


class Probes(Protocol):
    """The liveness watcher's probes (`frontend.liveness.Liveness`)."""

    def forget(self, rank: int) -> None: ...


class Replacement:
    """The replacement of Dead dense ranks in place (see the module docstring)."""

    def __init__(self, members: Membership, cancels: Cancels, probes: Probes,
                 followers: Followers | None = None) -> None:
        self.members = members
        self.fleet = members.fleet
        self.cancels = cancels
        self.probes = probes
        self.followers = followers

    async def replace(self, op: ResizeOperation) -> None:
        ranks = sorted(op.replace)
        states = {rank: self.fleet.record(rank).state for rank in ranks}
        live = [rank for rank, state in states.items() if state not in (RankState.DEAD, RankState.IDLE)]
        waking = {rank for rank, state in states.items() if state == RankState.IDLE}  # the wake of an idle fleet
        try:
            following = await self._followers_drained(op, ranks)
            if live:
                await self._vacate(op, live)
            async with self.keeping_kv_cache_size():
                await self._join(op, ranks, waking)
            following = await self._followers_prepared(op, ranks, following)
        except ResizeFailed as e:
            if self.followers is not None:
                await self.followers.cancel(op, f"replacement {op.id} failed on frontend 0: {e}")
            raise
        # 3. Commit, without an await: from here on requests may be routed to them.
        self.fleet.update_resize(op.id, phase=ResizePhase.COMMITTING, message=f"{describe(ranks)} back in service")
        for rank in ranks:
            self.commit_rank(op, rank)
        if self.followers is not None:
            await self.followers.commit(op, following, "to the new engine(s)")
        logger.info("Replacement %s: %s replaced in place; %d rank(s) serve", op.id, describe(ranks),
                    len(self.fleet.ranks_in(RankState.SERVING)))
        self.fleet.finish_resize(op.id, message=f"{describe(ranks)} replaced in place; the fleet serves at "
                                                f"{op.to_replicas} rank(s)")

    @contextlib.asynccontextmanager
    async def keeping_kv_cache_size(self) -> AsyncIterator[None]:
        """The replacements take the lost engines' share of the KV cache; they do not add one (vLLM's
        `_apply_ready_response` adds each ready response's blocks)."""
        cache_config = self.members.client.vllm_config.cache_config
        blocks = cache_config.num_gpu_blocks
        try:
            yield
        finally:
            cache_config.num_gpu_blocks = blocks

    # ---- several frontends: each follower's part (`frontend.followers.FollowerResize.replace`) ----------------
    async def _followers_drained(self, op: ResizeOperation, ranks: list[int]) -> list[int]:
        """Every other frontend is sent its part: it stops routing to the ranks and drains its own requests on them
        (those of a dead engine ended already), then waits for the new engines. The followers that did (Preparing);
        one that cannot be reached is passed over (lost: its replacement attaches to the new engines); one that
        refused or failed its part fails the replacement before anything changed."""
        if self.followers is None:
            return []
        self.fleet.update_resize(op.id, message=f"every frontend stops routing to {describe(ranks)}")
        lost = await self.followers.start(op, (ResizePhase.PREPARING, ResizePhase.PREPARED),
                                          time.monotonic() + op.drain_timeout_s + COMMIT_GRACE_S, self.cancels)
        self._pass_over(op, lost)
        return [i for i in self.followers.admins if i not in lost]

    async def _followers_prepared(self, op: ResizeOperation, ranks: list[int], following: list[int]) -> list[int]:
        """The followers that read the new engines' ready responses (Prepared); the new engines announced themselves
        to every frontend (their INIT names them all) before their READY to this one."""
        if self.followers is None:
            return []
        self.fleet.update_resize(op.id, message=f"every frontend reads the ready responses of {describe(ranks)}")
        lost = await self.followers.wait(op, following, (ResizePhase.PREPARED,), time.monotonic() + COMMIT_GRACE_S,
                                         self.cancels)
        self._pass_over(op, lost)
        return [i for i in following if i not in lost]

    @staticmethod
    def _pass_over(op: ResizeOperation, lost: dict[int, FollowerLost]) -> None:
        """A follower that cannot be reached is passed over (lost; its replacement attaches to the engines that run
        then); one that refused or failed its part would never route to the new engines: the replacement fails,
        and the operator runs it again."""
        pass_over(op, lost, "not every frontend can take the new engines", "to the engines that run then")

    async def _vacate(self, op: ResizeOperation, ranks: list[int]) -> None:
        """Step 0 of a vacating replacement (the ranks' pods are being removed): no new request goes to them, their
        in-flight requests finish (those left after the drain timeout end with an error), their engines are
        released (the launcher's pre-stop call returns and the pod stops), and once their connections are gone
        they are Dead, ready for new engines. Raises ResizeFailed if a connection outlives `join_timeout_s`."""
        members = self.members
        what = describe(ranks)
        self.fleet.update_resize(op.id, phase=ResizePhase.DRAINING,
                                 message=f"draining {what}: its pod is being removed")
        stop_routing_to(members, op, ranks, why=f"its pod is being removed (replacement {op.id})")
        await drain(members, self.cancels, op, ranks)
        for rank in ranks:
            await self._release(rank)
        self.fleet.update_resize(op.id, message=f"{what} drained and released: waiting for its engine to stop")
        await self.until_gone(op, ranks, time.monotonic() + op.join_timeout_s,
                              f"{what} drained, but its engine's connection was still up {op.join_timeout_s:g}s "
                              "later (its pod did not stop)",
                              f"vacated by {op.id}: its engine stopped; waiting for a new one")
        logger.info("Replacement %s: %s vacated (drained, released, its engine stopped)", op.id, what)

    async def until_gone(self, op: ResizeOperation, ranks: list[int], deadline: float, timed_out: str,
                         dead: str) -> None:
        """Until every rank's connection is gone, then each is Dead (`dead`: why); ResizeFailed(`timed_out`) at the
        deadline, or on a cancel."""
        while any(not self.gone(rank) for rank in ranks):
            self.cancels.check(op)
            if time.monotonic() >= deadline:
                raise ResizeFailed(timed_out)
            await asyncio.sleep(DRAIN_POLL_S)
        for rank in ranks:
            self.members.lost.pop(rank, None)
            self.fleet.set_rank(rank, RankState.DEAD, dead)

    async def _release(self, rank: int) -> None:
        """Tell a drained rank's engine that its pod may stop (best effort: without the answer, the pod stops at the
        end of its grace period)."""
        try:
            answer = await self.members.send_utility_call(identity(rank), RELEASE_UTILITY,
                                                          (self.members.client.client_index,))
            await asyncio.wait_for(answer, RELEASE_ANSWER_TIMEOUT_S)
        except Exception as e:  # any failure (not sent, no answer in time, an error answer): not released
            logger.warning("Rank %d did not confirm its release (%s: %s); its pod stops at the end of its grace "
                           "period", rank, type(e).__name__, e)

    def gone(self, rank: int) -> bool:
        """Whether the rank's connection is gone (the liveness watcher saw it: a draining rank is recorded lost)."""
        return rank in self.members.lost or self.fleet.record(rank).state == RankState.DEAD

    async def _join(self, op: ResizeOperation, ranks: list[int], waking: Collection[int] = ()) -> None:
        """Steps 1 and 2; on a failure nothing changed: the ranks stay Dead (or Idle: `waking`, an idle fleet's) and
        unroutable, the others serve on."""
        joiner = self.members.joiner
        address = handshake_address(self.members.client.vllm_config.parallel_config)

        def state(rank: int) -> RankState:
            return RankState.IDLE if rank in waking else RankState.DEAD

        doing = "woken" if waking else "replaced"
        try:
            # 1. The new engines' handshake, in a thread, bounded by the join timeout.
            self.fleet.update_resize(op.id, phase=ResizePhase.PREPARING,
                                     message=f"waiting for a new engine for {describe(ranks)} to handshake "
                                             f"on {address}")
            for rank in ranks:
                self.fleet.set_rank(rank, state(rank), f"being {doing} by {op.id}: waiting for a new engine's "
                                                       "HELLO")
            self.cancels.check(op)
            joiner.discard_stale_ready_responses()
            await joiner.join(op, ranks, address)
            for rank in ranks:
                self.fleet.set_rank(rank, state(rank), f"being {doing} by {op.id}: the new engine is READY; "
                                                       "reading its ready response")
            # 2. Their ready responses (sent on the requests socket before READY).
            await joiner.read_ready_responses(ranks)
            self.cancels.check(op)
        except Exception as raised:
            e = handshake_failure(raised, f"Replacement {op.id}", "engines")
            for rank in ranks:
                self.fleet.set_rank(rank, state(rank), f"{'wake' if rank in waking else 'replacement'} {op.id} "
                                                       f"failed: {e}")
            raise e from None

    # ---- an idle fleet (scale to zero: ResizeRequest.idle) ---------------------------------------------------
    async def idle(self, op: ResizeOperation) -> None:
        """The fleet goes idle: its serving ranks get no new request (those that come wait at the frontend:
        `frontend.hold`), their in-flight requests finish (those left after the drain timeout end with an error),
        their engines are released (their pods may stop), and every rank is Idle: no engine is watched or routed to
        until a replacement of the Idle ranks wakes the fleet. A request that comes during the drain stops it: the
        ranks serve on, the operation fails with the fleet intact. Once the engines are released the fleet is idle;
        a request that comes then waits for the wake."""
        members = self.members
        ranks = [r.rank for r in op.ranks]
        live = [rank for rank in ranks if self.fleet.record(rank).state == RankState.SERVING]
        why = f"the fleet goes idle ({op.id})"
        if live:
            self.fleet.update_resize(op.id, phase=ResizePhase.DRAINING, message=f"{why}: draining {describe(live)}")
            stop_routing_to(members, op, live, why=why)
            try:
                await drain(members, self.cancels, op, live, stop=self._demand)
            except ResizeFailed:
                serve_on(members, live)
                raise
            for rank in live:
                await self._release(rank)
        self.fleet.update_resize(op.id, phase=ResizePhase.COMMITTING, message=f"{describe(ranks)} released")
        for rank in ranks:
            self.probes.forget(rank)
            members.lost.pop(rank, None)
            members.stop_routing(rank, f"rank {rank} is {RankState.IDLE}: the fleet is idle ({op.id}); it serves "
                                       "again once woken")
            self.fleet.set_rank(rank, RankState.IDLE, f"idled by {op.id}: its engine was released")
        logger.info("Resize %s: the fleet is idle; %s released", op.id, describe(ranks))
        self.fleet.finish_resize(op.id, message=f"the fleet is idle: {describe(ranks)} released; a replacement of "
                                                "them wakes it")

    def _demand(self) -> str | None:
        waiting = self.fleet.demand()
        return None if not waiting else (f"{waiting} request(s) came while the fleet was going idle: it serves on")

    def commit_rank(self, op: ResizeOperation, rank: int) -> None:
        """The rank serves again, with fresh routing counters (see the module docstring, step 3)."""
        members = self.members
        leftover = members.requests_on(rank)
        if leftover:
            members.fail_requests(leftover, f"rank {rank} was replaced by {op.id} before this request "
                                            "finished: retry the request", rank)
        members.client.engine_inflight.pop(identity(rank), None)
        self.probes.forget(rank)
        members.unroutable.pop(rank, None)
        members.records[rank] = self.fleet.record(rank)
        members.ignore_load_until_routed(rank)
        self.fleet.set_rank(rank, RankState.SERVING)
