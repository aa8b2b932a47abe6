# SPDX-License-Identifier: Apache-2.0
"""Several frontends per fleet (docs/design/k-frontends.md §3): frontend 0 drives each resize through every frontend.

Every frontend is one of vLLM's clients of every engine, so a change of the fleet's membership must
reach each of them. Frontend 0 (the *lead*) takes resizes from the operator and drives the others
(*followers*) through their part over their admin APIs (the fleet's token; the admin port on each
frontend's own host): `Followers` is the lead's side, `FollowerResize` a follower's.

Scale-up N -> M:
  1. The lead runs the handshake of ranks N..M-1. Their INIT names every frontend's sockets, so each
     new engine sends its ready response to every frontend; the lead reads its own.
  2. Each follower is sent its part (`ResizeRequest.follower`): it reads the new ranks' ready
     responses from its own requests socket and stops at Prepared.
  3. Once every follower is Prepared, the lead commits (it routes to the new ranks), then commits
     each follower. No frontend routes to a new rank before every frontend can. A follower that fails
     its part, or cannot be reached, fails the resize: the other followers are cancelled and the new
     ranks retired again (nothing was routed to them); the fleet serves on at N.

Scale-down M -> N:
  1. Each follower is sent its part: it stops routing to ranks N..M-1 at once and drains its own
     requests on them (the same drain timeout); the lead stops routing to them once every follower
     did, and drains its own.
  2. Once every follower is Prepared (drained), the lead commits, then commits each follower; only
     then does it report the leaving ranks Retired (their pods may go). A follower that cannot be
     reached is passed over: it is lost, and its replacement attaches at the new size.

A follower left Prepared without the lead's commit (the lead was lost, or is hung) decides by itself
once `COMMIT_GRACE_S` passed, as the operator does for a lost frontend: a scale-up's new ranks are
retired (the operator rolls the resize back), a scale-down is committed (the operator finishes it). It decides at
once when the lead's replacement sends it a part of a new resize while it runs the old one: the new lead orphans
the old part (`POST /v1/resizes/ID/orphan`), waits until it ended, and sends its own again; an orphaned part
still waiting for new engines' ready responses ends then too (failed), and an orphaned replacement of ranks fails
rather than commits (the operator deletes the new engines a lost frontend 0 started and replaces the ranks
again: `planner.members`). A scale-down's
part commits sooner once every leaving rank's engine went: the lead committed without it (it was passed over) and
the pods were deleted, or the engines died; they leave either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import urllib.error
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol, TypeVar

from corefleet_client.admin import (
    AdminClient,
    AdminError,
    RankState,
    ResizeOperation,
    ResizePhase,
    ResizeRequest,
)
from corefleet_client.frontend.fleet import describe
from corefleet_client.frontend.handshake import READY_RESPONSE_TIMEOUT_S
from corefleet_client.frontend.membership import Membership
from corefleet_client.frontend.resize import drain, retire_leaving, serve_on, stop_routing_to
from corefleet_client.frontend.types import COMMIT_GRACE_S, Cancels, FollowerLost, ResizeFailed

logger = logging.getLogger("corefleet.frontend")

# A follower whose admin API does not answer for this long is lost (a restart of its pod takes longer). Not less: on a
# saturated node a live follower's name did not resolve, or its admin API did not answer, for 5 s at a time, and a
# live follower passed over is left Prepared until COMMIT_GRACE_S (it serves on, but without the change meanwhile).
UNREACHABLE_S = 20.0
POLL_S = 0.05
ADMIN_CALL_TIMEOUT_S = 5.0

T = TypeVar("T")


class Followers:
    """The lead's side: the other frontends' admin APIs, by client index (see the module docstring)."""

    def __init__(self, admins: dict[int, AdminClient]) -> None:
        self.admins = admins
        self._sent: set[str] = set()  # operations this lead sent parts of (a follower's others: a predecessor's)

    @classmethod
    def of(cls, addresses: Iterable[str], admin_port: int, token: str) -> Followers | None:
        """Frontend 0's followers from every frontend's advertised host (entry 0 is the lead itself); None for one."""
        hosts = list(addresses)[1:]
        if not hosts:
            return None
        return cls({i: AdminClient(f"http://{_host(h)}:{admin_port}", token, timeout=ADMIN_CALL_TIMEOUT_S)
                    for i, h in enumerate(hosts, start=1)})

    async def _call(self, index: int, what: Callable[[AdminClient], T]) -> T:
        """One admin call on follower `index`, retried while it cannot be reached, for at most UNREACHABLE_S."""
        deadline = time.monotonic() + UNREACHABLE_S
        while True:
            try:
                return await asyncio.to_thread(what, self.admins[index])
            except AdminError:
                raise
            except (urllib.error.URLError, OSError, TimeoutError) as e:
                if time.monotonic() >= deadline:
                    raise FollowerLost(f"frontend {index} did not answer for {UNREACHABLE_S:g}s: {e}",
                                       reachable=False) from None
            await asyncio.sleep(POLL_S * 4)

    async def _part(self, index: int, op: ResizeOperation) -> ResizeOperation:
        """Start follower `index`'s part of `op`. A part that an earlier frontend 0 (this one's predecessor, lost
        mid-resize) left running there is orphaned first: it decides at once (module docstring), then `op` starts."""
        request = ResizeRequest(id=op.id, replicas=op.to_replicas, drain_timeout_s=op.drain_timeout_s,
                                join_timeout_s=op.join_timeout_s, replace=op.replace, follower=True)
        self._sent.add(op.id)
        orphaned = False
        while True:
            try:
                _, part = await self._call(index, lambda admin: admin.start_resize(request))
                return part
            except AdminError as e:
                stale = None if orphaned else self._predecessors_part(e)
                if stale is None:
                    raise FollowerLost(f"frontend {index} refused its part: {e}") from None
            await self._orphan(index, stale, op)
            orphaned = True

    def _predecessors_part(self, refusal: AdminError) -> ResizeOperation | None:
        """The part in flight that a 409 names, if an earlier frontend 0 drove it (this one never sent it)."""
        if refusal.status != 409:
            return None
        try:
            part = ResizeOperation.from_json(json.loads(refusal.body)["operation"])
        except (ValueError, KeyError, TypeError):
            return None
        if not part.follower or part.phase.terminal or part.id in self._sent:
            return None
        return part

    async def _orphan(self, index: int, stale: ResizeOperation, op: ResizeOperation) -> None:
        """Follower `index`'s part `stale` decides now, and ends within UNREACHABLE_S (else it is lost for `op`)."""
        logger.warning("Resize %s: frontend %d still runs its part of resize %s (%s), which an earlier frontend 0 "
                       "drove: it decides now", op.id, index, stale.id, stale.phase)
        reason = f"frontend 0 was restarted; its resize {op.id} needs this frontend"
        try:
            await self._call(index, lambda admin: admin.orphan_resize(stale.id, reason))
        except AdminError as e:
            raise FollowerLost(f"frontend {index} refused to end its part of resize {stale.id}: {e}") from None
        deadline = time.monotonic() + UNREACHABLE_S
        while True:
            part = await self._call(index, lambda admin: admin.resize(stale.id))
            if part is None or part.phase.terminal:
                return
            if time.monotonic() >= deadline:
                raise FollowerLost(f"frontend {index}'s part of resize {stale.id}, which an earlier frontend 0 drove, "
                                   f"is still {part.phase} ({part.message})")
            await asyncio.sleep(POLL_S)

    async def _until(self, index: int, op: ResizeOperation, phases: tuple[ResizePhase, ...],
                     deadline: float, cancels: Cancels | None) -> ResizeOperation:
        """Follower `index`'s part of `op` once it reached one of `phases`; FollowerLost if it failed or is gone."""
        while True:
            if cancels is not None:
                cancels.check(op)
            part = await self._call(index, lambda admin: admin.resize(op.id))
            if part is None:
                raise FollowerLost(f"frontend {index} has no part of resize {op.id} (it was restarted)")
            if part.phase in phases:
                return part
            if part.phase == ResizePhase.FAILED:
                raise FollowerLost(f"frontend {index}'s part failed: {part.error}")
            if time.monotonic() >= deadline:
                raise FollowerLost(f"frontend {index}'s part is still {part.phase} ({part.message})")
            await asyncio.sleep(POLL_S)

    async def start(self, op: ResizeOperation, phases: tuple[ResizePhase, ...], deadline: float,
                    cancels: Cancels) -> dict[int, FollowerLost]:
        """Send every follower its part and wait until each reached one of `phases`; those that did not, by index."""
        async def one(index: int) -> None:
            await self._part(index, op)
            await self._until(index, op, phases, deadline, cancels)
        return await self._each(one)

    async def wait(self, op: ResizeOperation, indexes: Iterable[int], phases: tuple[ResizePhase, ...],
                   deadline: float, cancels: Cancels) -> dict[int, FollowerLost]:
        """Until every follower in `indexes` reached one of `phases`; those that did not, by index."""
        return await self._each(lambda index: self._until(index, op, phases, deadline, cancels), indexes)

    async def commit(self, op: ResizeOperation, indexes: Iterable[int], attaches: str) -> dict[int, FollowerLost]:
        """Commit each follower's Prepared part and wait until it completed; those that did not, by index, are lost
        (logged: their replacements attach `attaches`)."""
        async def one(index: int) -> None:
            try:
                await self._call(index, lambda admin: admin.commit_resize(op.id))
            except AdminError as e:
                raise FollowerLost(f"frontend {index} refused the commit: {e}") from None
            await self._until(index, op, (ResizePhase.COMPLETED,), time.monotonic() + COMMIT_GRACE_S, None)
        lost = await self._each(one, indexes)
        for index, why in lost.items():
            logger.warning("Resize %s: frontend %d did not commit its part (%s): it is lost, and its replacement "
                           "attaches %s", op.id, index, why, attaches)
        return lost

    async def cancel(self, op: ResizeOperation, reason: str) -> None:
        """Best effort: every follower's part of `op` stops (one that cannot be reached decides by itself)."""
        async def one(index: int) -> None:
            try:
                await self._call(index, lambda admin: admin.cancel_resize(op.id, reason))
            except AdminError as e:
                if e.status != 404:
                    raise FollowerLost(f"frontend {index} refused the cancel: {e}") from None
        lost = await self._each(one)
        for index, why in lost.items():
            logger.warning("Resize %s: frontend %d's part was not cancelled: %s", op.id, index, why)

    async def _each(self, one: Callable[[int], Awaitable[object]],
                    indexes: Iterable[int] | None = None) -> dict[int, FollowerLost]:
        """`one(index)` for every follower (or `indexes`) at once; those that raised FollowerLost, by index."""
        chosen = sorted(self.admins if indexes is None else indexes)
        results = await asyncio.gather(*(one(i) for i in chosen), return_exceptions=True)
        lost: dict[int, FollowerLost] = {}
        for index, result in zip(chosen, results, strict=True):
            if isinstance(result, FollowerLost):
                lost[index] = result
            elif isinstance(result, BaseException):
                raise result
        return lost


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class ReplacedRanks(Protocol):
    """What a follower's part of a replacement uses of this frontend's own `frontend.replace.Replacement`."""

    def gone(self, rank: int) -> bool: ...

    async def until_gone(self, op: ResizeOperation, ranks: list[int], deadline: float, timed_out: str,
                         dead: str) -> None: ...

    def keeping_kv_cache_size(self) -> contextlib.AbstractAsyncContextManager[None]: ...

    def commit_rank(self, op: ResizeOperation, rank: int) -> None: ...


class FollowerResize:
    """A follower's part of the lead's resize (see the module docstring): up to Prepared, then the lead's commit."""

    def __init__(self, members: Membership, cancels: Cancels, replacement: ReplacedRanks) -> None:
        self.members = members
        self.fleet = members.fleet
        self.cancels = cancels
        self.replacement = replacement  # this frontend's commit of a replaced rank, as frontend 0's
        self._commits: dict[str, asyncio.Event] = {}
        self._orphaned: dict[str, str] = {}  # parts whose lead is gone (a restarted lead said so): why

    def commit(self, resize_id: str) -> None:
        """The lead committed (on the event loop)."""
        self._commits.setdefault(resize_id, asyncio.Event()).set()

    def orphan(self, resize_id: str, reason: str) -> None:
        """The lead that drove this part is gone (on the event loop): it decides at once what it would decide at the
        end of its commit grace, now or as soon as it is Prepared."""
        self._orphaned[resize_id] = reason

    def forget(self, resize_id: str) -> None:
        """The part ended."""
        self._orphaned.pop(resize_id, None)

    def _uncommitted(self, op: ResizeOperation, waited_s: float) -> str:
        """Why the part goes on without the lead's commit."""
        orphaned = self._orphaned.get(op.id)
        if orphaned is not None:
            return f"frontend 0 that drove it is gone ({orphaned})"
        return f"frontend 0 did not commit within {waited_s:g}s"

    async def _committed(self, op: ResizeOperation, deadline: float,
                         settled: Callable[[], bool] = lambda: False) -> bool:
        """Prepared until the lead commits or `settled()` says the outcome can only be the commit (True), or the
        deadline passes or the part is orphaned (False); raises ResizeFailed on a cancel."""
        self.fleet.update_resize(op.id, phase=ResizePhase.PREPARED, message="waiting for frontend 0's commit")
        event = self._commits.setdefault(op.id, asyncio.Event())
        try:
            while not event.is_set():
                self.cancels.check(op)
                if settled():
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or op.id in self._orphaned:
                    return False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), min(left, 0.2))
            return True
        finally:
            self._commits.pop(op.id, None)

    async def scale_up(self, op: ResizeOperation) -> None:
        new = list(range(op.from_replicas, op.to_replicas))
        self.fleet.update_resize(op.id, phase=ResizePhase.PREPARING,
                                 message=f"reading the ready responses of {describe(new)}")
        try:
            self.cancels.check(op)
            await self._ready_responses(op, new, time.monotonic() + READY_RESPONSE_TIMEOUT_S)
            for rank in new:
                self.fleet.set_rank(rank, RankState.JOINING, "announced itself; waiting for frontend 0's commit")
            committed = await self._committed(op, time.monotonic() + COMMIT_GRACE_S)
            if not committed:
                raise ResizeFailed(f"{self._uncommitted(op, COMMIT_GRACE_S)} of this frontend's Prepared: the new "
                                   "ranks were not added (the scale-up is rolled back)")
        except ResizeFailed as e:
            for rank in new:
                self.fleet.set_rank(rank, RankState.RETIRED, f"not added: {e}")
                self.fleet.forget_rank(rank)
            raise
        self.fleet.update_resize(op.id, phase=ResizePhase.COMMITTING, message=f"adding {describe(new)}")
        await self.members.add_ranks(new, op.to_replicas)
        self.fleet.commit_size(op.to_replicas)
        self.fleet.finish_resize(op.id)

    async def scale_down(self, op: ResizeOperation) -> None:
        members, fleet = self.members, self.fleet
        frm, to = op.from_replicas, op.to_replicas
        leaving = list(range(to, frm))
        deadline = time.monotonic() + op.drain_timeout_s + COMMIT_GRACE_S
        fleet.update_resize(op.id, phase=ResizePhase.DRAINING,
                            message=f"{describe(leaving)} finish this frontend's in-flight requests "
                                    f"(at most {op.drain_timeout_s:g}s)")
        stop_routing_to(members, op, leaving)

        def gone() -> bool:
            """Every leaving rank's engine went: frontend 0 committed and their pods were deleted without this
            frontend's commit (it was passed over), or they died; either way they leave, and waiting is pointless."""
            return all(rank in members.lost for rank in leaving)

        try:
            await drain(members, self.cancels, op, leaving)
            committed = await self._committed(op, deadline, gone)
        except ResizeFailed:
            serve_on(members, leaving)
            raise
        if committed and gone():
            logger.warning("Resize %s: the engine(s) of %s went before frontend 0's commit reached this frontend; "
                           "committing this frontend's part", op.id, describe(leaving))
        if not committed:
            logger.warning("Resize %s: %s; committing this frontend's part by itself (a scale-down whose driver is "
                           "lost is finished)", op.id, self._uncommitted(op, op.drain_timeout_s + COMMIT_GRACE_S))
        fleet.update_resize(op.id, phase=ResizePhase.COMMITTING, message=f"removing {describe(leaving)}")
        marker = members.cut_routing(to)
        await members.shrink(frm, to, marker)
        retire_leaving(members, op, leaving)

    async def replace(self, op: ResizeOperation) -> None:
        """This frontend's part of a replacement: the ranks get no new request here and their requests finish (the
        engine of a lost rank ended them already), their engines stop (frontend 0 releases them once every frontend
        drained them), the new engines' ready responses are read (their INIT named every frontend), and at frontend
        0's commit the ranks serve here again. Without the commit after `COMMIT_GRACE_S` the part commits by itself:
        the new engines announced themselves to this frontend and serve the others. Orphaned (a new frontend 0 drives
        the fleet), it fails instead: the operator deletes the new engines and replaces the ranks again."""
        members, fleet = self.members, self.fleet
        ranks = sorted(op.replace)
        live = [rank for rank in ranks if not self.replacement.gone(rank)]
        what = describe(ranks)
        try:
            if live:
                fleet.update_resize(op.id, phase=ResizePhase.DRAINING,
                                    message=f"{describe(live)} finish this frontend's in-flight requests "
                                            f"(at most {op.drain_timeout_s:g}s)")
                stop_routing_to(members, op, live, why=f"it is being replaced (replacement {op.id})")
                await drain(members, self.cancels, op, live)
            # Nothing of an earlier, failed join may pass for a new engine's ready response: the new engines
            # handshake with frontend 0 only after every frontend got here.
            members.joiner.discard_stale_ready_responses()
            fleet.update_resize(op.id, phase=ResizePhase.PREPARING,
                                message=f"waiting for the engine(s) of {what} to stop and new ones to announce "
                                        "themselves")
            deadline = time.monotonic() + op.drain_timeout_s + 2 * op.join_timeout_s + COMMIT_GRACE_S
            await self.replacement.until_gone(op, ranks, deadline,
                                              f"the engine(s) of {what} did not stop within the join timeout",
                                              f"being replaced by {op.id}: waiting for the new engine's ready "
                                              "response")
            async with self.replacement.keeping_kv_cache_size():
                await self._ready_responses(op, ranks, deadline)
            committed = await self._committed(op, time.monotonic() + COMMIT_GRACE_S)
            if not committed and op.id in self._orphaned:
                raise ResizeFailed(f"{self._uncommitted(op, COMMIT_GRACE_S)}: the new engine(s) of {what} are "
                                   "deleted, and the ranks replaced again")
        except ResizeFailed as e:
            still = [rank for rank in live if not self.replacement.gone(rank)]
            serve_on(members, still)  # stopped before their engines went: they serve on here
            for rank in ranks:
                if rank not in still:
                    fleet.set_rank(rank, RankState.DEAD, f"replacement {op.id} failed: {e}")
            raise
        if not committed:
            logger.warning("Replacement %s: %s; committing this frontend's part by itself (the new engines announced "
                           "themselves here)", op.id, self._uncommitted(op, COMMIT_GRACE_S))
        fleet.update_resize(op.id, phase=ResizePhase.COMMITTING, message=f"{what} back in service")
        for rank in ranks:
            self.replacement.commit_rank(op, rank)
        fleet.finish_resize(op.id, message=f"{what} replaced in place on this frontend")

    async def _ready_responses(self, op: ResizeOperation, ranks: list[int], deadline: float) -> None:
        """The new engines' ready responses, read as they come (frontend 0 may still be waiting for the new pods), until
        `deadline`; a cancel (frontend 0's join failed) stops the wait, and so does an orphaning: the new engines
        handshake with frontend 0, which is gone, and the operator deletes those it started for it."""
        read = asyncio.ensure_future(self.members.joiner.read_ready_responses(
            ranks, wait_s=max(deadline - time.monotonic(), 0.001)))
        try:
            while not read.done():
                self.cancels.check(op)
                if op.id in self._orphaned:
                    raise ResizeFailed(f"{self._uncommitted(op, 0)} before the new engine(s) of {describe(ranks)} "
                                       "announced themselves here")
                await asyncio.wait({read}, timeout=0.2)
        finally:
            if not read.done():
                read.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await read
        read.result()
