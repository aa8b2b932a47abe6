# SPDX-License-Identifier: Apache-2.0
"""The frontend's view of its fleet: ranks, per-rank counters and resize operations, thread-safe.

Two threads use it. vLLM's event loop (corefleet's client and its components) changes rank states,
bumps counters and carries out resizes; the admin server's threads read snapshots and start or
cancel resizes. Every state change happens under one lock; the per-request counters are plain
ints bumped on the event loop (an int read from another thread is atomic under the GIL).

A resize is an operation with an id (`admin.ResizeOperation`). `start_resize` checks the request
against what runs (idempotent for the same id and target, 409 for anything else while one runs),
records it as Pending and hands its id to the event loop (`ResizeRunner`: `frontend.operations`); from then on only the
event loop moves it on (`update_resize`, `finish_resize`), and every transition is logged. A
replacement (`ResizeRequest.replace`: new engines for Dead ranks, same size) is such an operation
too; only a dense fleet's Dead ranks can be replaced (`frontend.replace`).

Standard library only: it is tested without vLLM.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Protocol

from corefleet_client.admin import (
    FleetState,
    FleetStatus,
    RankState,
    RankStatus,
    ResizeOperation,
    ResizePhase,
    ResizeRank,
    ResizeRequest,
)
from corefleet_client.frontend.types import ResizeRefused

logger = logging.getLogger("corefleet.frontend")

HISTORY = 32  # finished operations kept for GET /v1/resizes


def identity(rank: int) -> bytes:
    """The ZMQ identity vLLM gives DP rank `rank`'s engine."""
    return rank.to_bytes(2, "little")


class LoadView(Protocol):
    """What the fleet reads of the client's routing state for a rank."""

    def lb_counts(self, rank: int) -> tuple[int, int, float]: ...

    def in_flight(self, rank: int) -> int: ...

    def closed(self) -> str | None: ...


class ResizeRunner(Protocol):
    """The event-loop side of resizes (the client): both are called from any thread."""

    def run_resize(self, resize_id: str) -> None: ...

    def cancel_resize(self, resize_id: str, reason: str) -> None: ...

    def commit_resize(self, resize_id: str) -> None: ...

    def orphan_resize(self, resize_id: str, reason: str) -> None: ...


@dataclass
class RankRecord:
    """One rank of the fleet (a member, or one joining or leaving in a resize)."""

    rank: int
    state: RankState
    message: str = ""
    requests_total: int = 0
    aborts_total: int = 0
    failed_total: int = 0
    since: float = dataclasses.field(default_factory=time.time)  # when it entered its state
    stalled: str = ""  # why it is Stalled (`frontend.progress`): "" while it makes progress
    stalled_since: float | None = None  # when it last turned Stalled (seconds since the epoch)
    stalls_total: int = 0  # times it turned Stalled
    moved_total: int = 0  # requests moved away from it while Stalled, before they started (`frontend.rescue`)
    new_prefix_total: int = 0  # requests with a prefix new to the frontend routed to it (`frontend.affinity`)
    affinity_total: int = 0  # requests routed to it because it holds their prefix
    spilled_total: int = 0  # requests routed to it because the rank holding their prefix was over its load bound


@dataclass
class ExpertLayout:
    """An elastic-EP fleet's experts: what vLLM's `DPLBAsyncMPClient.prepare_elastic_ep` checks a new size against.

    Elastic EP keeps the physical experts per rank fixed: at size M the fleet has
    (E + R) * M / N - E redundant experts (R'), and a size where that is negative cannot hold the
    logical experts (vLLM refuses it, naming the minimum)."""

    num_experts: int  # E, the model's logical (routed) experts
    num_redundant_experts: int  # R, at the committed size
    max_size: int  # --elastic-ep-max-dp-size

    def redundant_at(self, frm: int, to: int) -> int:
        """R' at size `to` from size `frm`; ValueError (vLLM's words) when `to` is refused."""
        if to > self.max_size:
            raise ValueError(f"Cannot scale to data_parallel_size {to}; --elastic-ep-max-dp-size is "
                             f"{self.max_size} (the fleet's maxReplicas)")
        physical = self.num_experts + self.num_redundant_experts
        redundant = physical * to // frm - self.num_experts
        if redundant < 0:
            minimum = -(-self.num_experts * frm // physical)
            raise ValueError(f"Cannot scale to data_parallel_size {to}, minimum is {minimum}: elastic EP keeps "
                             f"{physical // frm} physical experts per rank, and the model has {self.num_experts}")
        return redundant


class Fleet:
    """Ranks, counters and resize operations of one frontend (see the module docstring)."""

    def __init__(self, model: str, data_parallel_size: int, vllm_version: str = "", frontends: int = 1,
                 client_index: int = 0) -> None:
        self.model = model
        self.vllm_version = vllm_version
        # Frontends that are clients of the same engines (k-frontends design): frontend 0 takes resizes and drives
        # each of the others through its part (a follower's: `ResizeRequest.follower`), replacements of ranks
        # included.
        self.frontends = frontends
        self.client_index = client_index
        self._lock = threading.Lock()
        self._size = data_parallel_size  # the committed size
        self._ranks: dict[int, RankRecord] = {
            r: RankRecord(r, RankState.JOINING, "waiting for the engine's HELLO") for r in range(data_parallel_size)
        }
        self._view: LoadView | None = None
        self._runner: ResizeRunner | None = None
        self._join_progress: Callable[[], dict[int, str]] | None = None
        self._ops: collections.OrderedDict[str, ResizeOperation] = collections.OrderedDict()
        self._current: str | None = None
        # Set by the client before any rank joins: an MoE fleet's ranks share collectives, none is replaced alone.
        self.moe = False
        self.experts: ExpertLayout | None = None  # MoE with elastic EP: set by the client, updated by each resize
        self._beat: float | None = None  # when the serving event loop last showed progress (monotonic)
        # Requests waiting for a rank now (`frontend.hold`; set by serve): a request that comes while the fleet goes
        # idle stops the idling.
        self.demand: Callable[[], int] = lambda: 0
        self.clock: Callable[[], float] = time.monotonic
        self._busy_at: float | None = None  # when a request was last seen in flight or waiting (`note_busy`)

    # ---- liveness of the frontend itself ----------------------------------------------------------
    def beat(self) -> None:
        """The event loop made progress (called by the liveness watcher on every tick)."""
        self._beat = time.monotonic()

    def note_busy(self, busy: bool) -> None:
        """Whether a request is in flight or waiting now (the liveness watcher tells, every interval)."""
        now = self.clock()
        with self._lock:
            if busy or self._busy_at is None:
                self._busy_at = now

    def stalled_for(self) -> float:
        """Seconds since the last beat; 0 until the loop serves (it blocks in vLLM's startup handshake)."""
        beat = self._beat
        return 0.0 if beat is None else max(0.0, time.monotonic() - beat)

    # ---- ranks ---------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        with self._lock:
            return self._size

    def record(self, rank: int) -> RankRecord:
        """The rank's record (its counters are bumped in place by the event loop)."""
        with self._lock:
            return self._ranks[rank]

    def set_rank(self, rank: int, state: RankState, message: str = "") -> None:
        """A rank's state changed: in the fleet's view and in the running resize's, logged once."""
        with self._lock:
            rec = self._ranks.get(rank)
            if rec is None:
                rec = self._ranks[rank] = RankRecord(rank, state, message)
                changed = True
            else:
                changed = (rec.state, rec.message) != (state, message)
                if rec.state != state:
                    rec.since = time.time()
                rec.state, rec.message = state, message
            op = self._ops.get(self._current) if self._current else None
            if op is not None and any(r.rank == rank for r in op.ranks):
                ranks = tuple(ResizeRank(rank, state, message) if r.rank == rank else r for r in op.ranks)
                self._ops[op.id] = dataclasses.replace(op, ranks=ranks)
        if changed:
            logger.info("Rank %d: %s%s", rank, state, f" ({message})" if message else "")

    def set_stalled(self, rank: int, why: str) -> None:
        """A Serving rank turned Stalled (`why`), or made progress again (`why` empty): its requests and state stay."""
        with self._lock:
            rec = self._ranks.get(rank)
            if rec is None or bool(rec.stalled) == bool(why):
                return
            rec.stalled = why
            if why:
                rec.stalled_since = time.time()
                rec.stalls_total += 1

    def set_join_progress(self, progress: Callable[[], dict[int, str]] | None) -> None:
        """While ranks handshake: a function giving each joining rank's handshake step (read by snapshots).

        The handshake runs where nothing can report each step (vLLM's loop blocks at startup), so
        the admin API asks the handshake's own state when it is asked.
        """
        with self._lock:
            self._join_progress = progress

    def forget_rank(self, rank: int) -> None:
        """A retired or never-joined rank leaves the fleet's view (the operation keeps its last state)."""
        with self._lock:
            self._ranks.pop(rank, None)

    def ranks_in(self, *states: RankState) -> list[int]:
        with self._lock:
            return sorted(r.rank for r in self._ranks.values() if r.state in states)

    def serving(self, view: LoadView, runner: ResizeRunner, dead: Mapping[int, str] | None = None) -> None:
        """Every initial rank joined (but those `dead`: rank -> why): requests flow, resizes may start."""
        dead = dead or {}
        with self._lock:
            self._view, self._runner = view, runner
        for rank in range(self.size):
            self.set_rank(rank, RankState.DEAD if rank in dead else RankState.SERVING, dead.get(rank, ""))

    def closed(self) -> str | None:
        """None while some rank takes new requests; else why none does (on vLLM's event loop: `frontend.hold`): an
        idle fleet that wakes says so first."""
        with self._lock:
            view = self._view
            current = self._ops.get(self._current) if self._current else None
        if view is None:
            return "the fleet is starting"
        why = view.closed()
        if why is not None and current is not None and current.replace and not current.phase.terminal and self.idle():
            return f"the fleet is waking ({current.id}: {current.message}); {why}"
        return why

    def commit_size(self, size: int) -> None:
        with self._lock:
            self._size = size

    # ---- resizes -------------------------------------------------------------------------------
    def start_resize(self, request: ResizeRequest) -> tuple[bool, ResizeOperation]:
        """Record a resize and hand it to the event loop; (started now, the operation). Raises ResizeRefused."""
        with self._lock:
            existing = self._ops.get(request.id)
            replace = tuple(sorted(request.replace))
            if existing is not None:
                if existing.to_replicas == request.replicas and existing.replace == replace \
                        and existing.idle == request.idle:
                    return False, existing
                raise ResizeRefused(HTTPStatus.CONFLICT,
                                    f"resize {request.id!r} exists with target {existing.to_replicas}"
                                    f"{f' replacing {list(existing.replace)}' if existing.replace else ''}, not "
                                    f"{request.replicas}{f' replacing {list(replace)}' if replace else ''}",
                                    existing)
            current = self._ops.get(self._current) if self._current else None
            if current is not None and not current.phase.terminal:
                raise ResizeRefused(HTTPStatus.CONFLICT,
                                    f"resize {current.id!r} ({current.from_replicas} -> {current.to_replicas}) "
                                    f"is {current.phase}; one resize runs at a time", current)
            self._check_role(request)
            if self._runner is None:
                raise ResizeRefused(HTTPStatus.SERVICE_UNAVAILABLE, "the fleet is still starting: its ranks are "
                                    "joining")
            op = self._replace_op(request, replace) if replace else \
                self._idle_op(request) if request.idle else self._resize_op(request)
            self._remember(op)
            if op.phase.terminal:  # nothing to do
                return True, op
            self._current = op.id
            runner = self._runner
        if op.replace:
            logger.info("Resize %s: replacement of %s accepted (join timeout %gs)", op.id, describe(op.replace),
                        op.join_timeout_s)
        elif op.idle:
            logger.info("Resize %s: the fleet goes idle (drain timeout %gs)", op.id, op.drain_timeout_s)
        else:
            logger.info("Resize %s: %d -> %d accepted (drain timeout %gs, join timeout %gs)", op.id,
                        op.from_replicas, op.to_replicas, op.drain_timeout_s, op.join_timeout_s)
        runner.run_resize(op.id)
        return True, op

    def _check_role(self, request: ResizeRequest) -> None:
        """With several frontends: frontend 0 takes resizes, the others only their part of one (under the lock)."""
        if request.follower and self.client_index == 0:
            raise ResizeRefused(HTTPStatus.BAD_REQUEST, "this is frontend 0, which drives resizes: a follower's part "
                                "goes to one of the other frontends")
        if not request.follower and self.client_index > 0:
            raise ResizeRefused(HTTPStatus.CONFLICT, f"this is frontend {self.client_index} of {self.frontends}: "
                                "resizes go to frontend 0, which drives every frontend through its part")
        if self.frontends > 1 and self.moe:
            raise ResizeRefused(HTTPStatus.NOT_IMPLEMENTED,
                                f"this MoE fleet has {self.frontends} frontends: vLLM's elastic EP tells only its "
                                "first client of a resize, so an MoE fleet with more than one cannot resize")

    def _resize_op(self, request: ResizeRequest) -> ResizeOperation:
        """A resize's operation: Pending, or Completed if the size is already right (under the lock)."""
        dead = sorted(r.rank for r in self._ranks.values() if r.state == RankState.DEAD)
        if dead:
            raise ResizeRefused(HTTPStatus.SERVICE_UNAVAILABLE,
                                f"rank(s) {dead} are dead: the fleet must be recreated before it can resize")
        frm, to = self._size, request.replicas
        now = time.time()
        if to == frm:
            logger.info("Resize %s: %d -> %d: nothing to do", request.id, frm, to)
            return ResizeOperation(id=request.id, from_replicas=frm, to_replicas=to, phase=ResizePhase.COMPLETED,
                                   started_at=now, finished_at=now, drain_timeout_s=request.drain_timeout_s,
                                   join_timeout_s=request.join_timeout_s, message=f"the fleet already has {to} rank(s)")
        redundant = None
        if self.moe:
            if self.experts is None:
                raise ResizeRefused(HTTPStatus.BAD_REQUEST, "this MoE fleet runs without elastic EP "
                                    "(--enable-elastic-ep): it can only be recreated at a new size")
            try:
                redundant = self.experts.redundant_at(frm, to)
            except ValueError as e:
                raise ResizeRefused(HTTPStatus.BAD_REQUEST, str(e)) from None
        if to > frm:
            ranks = tuple(ResizeRank(r, RankState.JOINING, "waiting for the engine's HELLO") for r in range(frm, to))
        else:
            ranks = tuple(ResizeRank(r, RankState.SERVING) for r in range(to, frm))
        return ResizeOperation(id=request.id, from_replicas=frm, to_replicas=to, phase=ResizePhase.PENDING,
                               ranks=ranks, started_at=now, drain_timeout_s=request.drain_timeout_s,
                               join_timeout_s=request.join_timeout_s, message="accepted",
                               num_redundant_experts=redundant, follower=request.follower)

    def _replace_op(self, request: ResizeRequest, replace: tuple[int, ...]) -> ResizeOperation:
        """A replacement's operation, Pending, once its preconditions hold (under the lock); raises ResizeRefused."""
        if self.moe:
            raise ResizeRefused(HTTPStatus.BAD_REQUEST, "an MoE fleet's ranks cannot be replaced one by one (their "
                                "collectives cannot lose a member): the fleet is recreated instead")
        if request.replicas != self._size:
            raise ResizeRefused(HTTPStatus.CONFLICT, f"a replacement keeps the fleet's size: replicas must be "
                                f"{self._size}, not {request.replicas}")
        states = {r: self._ranks[r].state if r in self._ranks else None for r in replace}
        # Idle ranks are replaced as Dead ones are (the wake of an idle fleet); a vacating replacement takes none.
        resting = (RankState.DEAD,) if request.vacate else (RankState.DEAD, RankState.IDLE)
        # A follower's part takes the ranks as this frontend sees them: one that still serves here is drained first
        # (frontend 0 releases its engine once every frontend drained it, or this frontend has yet to see it die).
        vacating = (RankState.SERVING, RankState.UNRESPONSIVE, RankState.DEAD) \
            if request.vacate or request.follower else ()
        alive = {r: state for r, state in states.items() if state not in resting and state not in vacating}
        if alive:
            what = ("only a Serving, Unresponsive or Dead rank can be vacated" if request.vacate
                    else "only a Dead or Idle rank can be replaced")
            raise ResizeRefused(HTTPStatus.CONFLICT, f"{what}: " + ", ".join(
                f"rank {r} is {state or 'not a member'}" for r, state in sorted(alive.items())))
        ranks = tuple(ResizeRank(r, RankState.DEAD, "waiting for a new engine") if states[r] == RankState.DEAD
                      else ResizeRank(r, RankState.IDLE, "waking: waiting for a new engine")
                      if states[r] == RankState.IDLE
                      else ResizeRank(r, RankState.DRAINING, "to be drained: its pod is being removed")
                      for r in replace)
        return ResizeOperation(id=request.id, from_replicas=self._size, to_replicas=self._size,
                               phase=ResizePhase.PENDING, ranks=ranks, started_at=time.time(),
                               drain_timeout_s=request.drain_timeout_s, join_timeout_s=request.join_timeout_s,
                               message="accepted", replace=replace, follower=request.follower)

    def _idle_op(self, request: ResizeRequest) -> ResizeOperation:
        """The operation that idles the fleet: Pending, or Completed if every rank is Idle already (under the lock);
        raises ResizeRefused."""
        if self.moe:
            raise ResizeRefused(HTTPStatus.BAD_REQUEST, "an MoE fleet cannot go idle in place (its ranks share "
                                "collectives; waking needs a fresh group): stop it instead (replicas 0)")
        if self.frontends > 1:
            raise ResizeRefused(HTTPStatus.NOT_IMPLEMENTED, f"this fleet has {self.frontends} frontends: only a "
                                "fleet of one frontend goes idle in place")
        if request.replicas != self._size:
            raise ResizeRefused(HTTPStatus.CONFLICT, f"idling keeps the fleet's size: replicas must be {self._size}, "
                                f"not {request.replicas}")
        busy = {r.rank: r.state for r in self._ranks.values()
                if r.state not in (RankState.SERVING, RankState.DEAD, RankState.IDLE)}
        if busy:
            raise ResizeRefused(HTTPStatus.CONFLICT, "only a fleet whose ranks are Serving, Dead or Idle goes idle: "
                                + ", ".join(f"rank {r} is {state}" for r, state in sorted(busy.items())))
        now = time.time()
        op = ResizeOperation(id=request.id, from_replicas=self._size, to_replicas=self._size,
                             phase=ResizePhase.PENDING, started_at=now, drain_timeout_s=request.drain_timeout_s,
                             join_timeout_s=request.join_timeout_s, message="accepted", idle=True)
        if all(r.state == RankState.IDLE for r in self._ranks.values()):
            return dataclasses.replace(op, phase=ResizePhase.COMPLETED, finished_at=now,
                                       message="the fleet is idle already")
        return dataclasses.replace(op, ranks=tuple(
            ResizeRank(r.rank, r.state, "to be drained and released: the fleet goes idle")
            for r in sorted(self._ranks.values(), key=lambda r: r.rank)))

    def idle(self) -> bool:
        """Whether the fleet is idle or going idle: every rank Idle, or an idling operation runs. Its endpoint then
        answers (`/health` 200) and requests wait for the wake (`frontend.hold`): idle, not broken."""
        with self._lock:
            current = self._ops.get(self._current) if self._current else None
            if current is not None and current.idle and not current.phase.terminal:
                return True
            return bool(self._ranks) and all(r.state == RankState.IDLE for r in self._ranks.values())

    def awaits_ranks(self) -> bool:
        """Whether ranks are on their way, so that a frontend with no rank serving is not broken: the fleet is idle
        or going idle, or a replacement (a wake included) gives ranks new engines now. `/health` stays 200 then and
        requests wait for the ranks (`frontend.hold`), instead of the endpoint leaving the Service."""
        with self._lock:
            current = self._ops.get(self._current) if self._current else None
            if current is not None and current.replace and not current.phase.terminal:
                return True
        return self.idle()

    def _remember(self, op: ResizeOperation) -> None:
        self._ops[op.id] = op
        while len(self._ops) > HISTORY:
            oldest = next(iter(self._ops))
            if oldest == self._current:
                break
            del self._ops[oldest]

    def resize(self, resize_id: str) -> ResizeOperation | None:
        with self._lock:
            return self._ops.get(resize_id)

    def resizes(self) -> list[ResizeOperation]:
        with self._lock:
            return list(reversed(self._ops.values()))

    def current_resize(self) -> ResizeOperation | None:
        """The resize in flight, or None."""
        with self._lock:
            op = self._ops.get(self._current) if self._current else None
            return op if op is not None and not op.phase.terminal else None

    def update_resize(self, resize_id: str, *, phase: ResizePhase | None = None, message: str | None = None) -> None:
        """Move a running resize on (event loop only); a phase change is logged."""
        with self._lock:
            op = self._ops[resize_id]
            changes: dict[str, object] = {}
            if phase is not None and phase != op.phase:
                changes["phase"] = phase
            if message is not None:
                changes["message"] = message
            self._ops[resize_id] = dataclasses.replace(op, **changes)  # type: ignore[arg-type]
        if "phase" in changes:
            logger.info("Resize %s: %s%s", resize_id, phase, f": {message}" if message else "")
        elif message:
            logger.info("Resize %s: %s", resize_id, message)

    def finish_resize(self, resize_id: str, *, error: str = "", fleet_intact: bool = True, message: str = "") -> None:
        """The resize ended: Completed without an error, else Failed."""
        with self._lock:
            op = self._ops[resize_id]
            phase = ResizePhase.FAILED if error else ResizePhase.COMPLETED
            self._ops[resize_id] = op = dataclasses.replace(
                op, phase=phase, error=error, fleet_intact=fleet_intact, finished_at=time.time(),
                message=message or (f"failed: {error}" if error else f"the fleet serves at {op.to_replicas} rank(s)"))
        took = (op.finished_at or 0.0) - op.started_at
        if error:
            logger.error("Resize %s: %d -> %d failed after %.1fs (%s): %s", resize_id, op.from_replicas,
                         op.to_replicas, took, "fleet intact" if fleet_intact else "the fleet must be recreated",
                         error)
        else:
            logger.info("Resize %s: %d -> %d completed in %.1fs", resize_id, op.from_replicas, op.to_replicas, took)

    def cancel_resize(self, resize_id: str, reason: str) -> ResizeOperation:
        with self._lock:
            op = self._ops.get(resize_id)
            if op is None:
                raise ResizeRefused(HTTPStatus.NOT_FOUND, f"no resize {resize_id!r}")
            if op.phase == ResizePhase.FAILED:
                return op
            if op.phase in (ResizePhase.COMMITTING, ResizePhase.COMPLETED):
                raise ResizeRefused(HTTPStatus.CONFLICT, f"resize {resize_id!r} is {op.phase}: too late to cancel", op)
            runner = self._runner
        assert runner is not None  # an operation exists only once the fleet serves
        logger.warning("Resize %s: cancel requested: %s", resize_id, reason)
        runner.cancel_resize(resize_id, reason)
        return op

    def commit_resize(self, resize_id: str) -> ResizeOperation:
        """A follower's part of a resize, Prepared, goes on to its commit (frontend 0 calls this once every frontend
        is Prepared); idempotent once it commits."""
        with self._lock:
            op = self._followers_part(resize_id, "it commits by itself")
            if op.phase in (ResizePhase.COMMITTING, ResizePhase.COMPLETED):
                return op
            if op.phase != ResizePhase.PREPARED:
                raise ResizeRefused(HTTPStatus.CONFLICT, f"resize {resize_id!r} is {op.phase}, not "
                                    f"{ResizePhase.PREPARED}: {op.error or op.message}", op)
            runner = self._runner
        assert runner is not None
        runner.commit_resize(resize_id)
        return op

    def orphan_resize(self, resize_id: str, reason: str) -> ResizeOperation:
        """A follower's part whose driving frontend 0 is gone decides now, as at the end of its commit grace (a
        restarted frontend 0 calls this on a part its predecessor left); idempotent, and a no-op once it ended."""
        with self._lock:
            op = self._followers_part(resize_id, "this frontend drives it")
            if op.phase.terminal or op.phase == ResizePhase.COMMITTING:
                return op
            runner = self._runner
        assert runner is not None
        logger.warning("Resize %s: orphaned: %s", resize_id, reason)
        runner.orphan_resize(resize_id, reason)
        return op

    def _followers_part(self, resize_id: str, why_not: str) -> ResizeOperation:
        """The operation `resize_id`, a follower's part (404 if there is none, 400 if it is this frontend's own); under
        the lock."""
        op = self._ops.get(resize_id)
        if op is None:
            raise ResizeRefused(HTTPStatus.NOT_FOUND, f"no resize {resize_id!r}")
        if not op.follower:
            raise ResizeRefused(HTTPStatus.BAD_REQUEST, f"resize {resize_id!r} is not a follower's part: {why_not}",
                                op)
        return op

    # ---- the admin API's view ------------------------------------------------------------------
    def snapshot(self) -> FleetStatus:
        with self._lock:
            view, size, progress, busy_at = self._view, self._size, self._join_progress, self._busy_at
            records = [dataclasses.replace(r) for r in sorted(self._ranks.values(), key=lambda r: r.rank)]
            ops = list(self._ops.values())
            current = self._ops.get(self._current) if self._current else None
        steps = progress() if progress is not None else {}
        ranks = []
        for rec in records:
            if rec.state == RankState.JOINING and rec.rank in steps:
                rec.message = steps[rec.rank]
            waiting = running = in_flight = 0
            kv = 0.0
            if view is not None and rec.state not in (RankState.JOINING, RankState.RETIRED, RankState.FAILED):
                waiting, running, kv = view.lb_counts(rec.rank)
                in_flight = view.in_flight(rec.rank)
            ranks.append(RankStatus(
                rank=rec.rank, identity=identity(rec.rank).hex(), state=rec.state, waiting=int(waiting),
                running=int(running), kv_cache_usage=float(kv), in_flight=in_flight,
                requests_total=rec.requests_total, aborts_total=rec.aborts_total, failed_total=rec.failed_total,
                message=rec.message or rec.stalled, since=rec.since, stalled=bool(rec.stalled),
                stalled_since=rec.stalled_since, stalls_total=rec.stalls_total, moved_total=rec.moved_total,
                new_prefix_total=rec.new_prefix_total, affinity_total=rec.affinity_total,
                spilled_total=rec.spilled_total,
            ))
        troubled = [r for r in ranks if r.state in (RankState.DEAD, RankState.UNRESPONSIVE)]
        if ranks and all(r.state == RankState.IDLE for r in ranks):
            state = FleetState.IDLE
            message = f"idle: {len(ranks)} rank(s) released; requests wait at the frontend for the wake"
        elif troubled:
            state = FleetState.DEGRADED
            message = "; ".join(f"rank {r.rank} {r.state}: {r.message}" for r in troubled)
        elif view is not None:  # a Stalled rank is said, not a degraded fleet: it is back at its next step
            state = FleetState.SERVING
            message = "; ".join(f"rank {r.rank} Stalled: {r.message}" for r in ranks
                                if r.stalled and r.state == RankState.SERVING)
        else:
            state, message = FleetState.STARTING, "engines joining"
        resize = current if current is not None else (ops[-1] if ops else None)
        quiet = 0.0 if busy_at is None else max(0.0, self.clock() - busy_at)
        return FleetStatus(state=state, model=self.model, data_parallel_size=size, vllm_version=self.vllm_version,
                           ranks=tuple(ranks), message=message, resize=resize, requests_waiting=self.demand(),
                           quiet_s=round(quiet, 3))

    def dead(self) -> dict[int, str]:
        with self._lock:
            return {r.rank: r.message for r in self._ranks.values() if r.state == RankState.DEAD}


def describe(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"

