# SPDX-License-Identifier: Apache-2.0
"""Rank liveness: which engines of the fleet are lost or hung, and what the frontend does about it (`Liveness`).

vLLM watches only engine processes it started itself, so with external engines a killed rank went
unnoticed and requests routed to it hung. Two signals, two states:

- Dead: the rank's connection is lost. The requests ROUTER is put in ROUTER_MANDATORY mode (by the
  client), so a send to a rank whose connection is gone fails at once (EHOSTUNREACH) instead of
  being dropped; when the process exits, its connection goes with it. A Dead rank's in-flight
  requests end with an explicit error (HTTP 503, or an error event in a stream), new requests
  avoid it, and a request whose send fails is routed again to a live rank (`rank_died`, called by
  the client wherever a send fails, and by the watcher).
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
unknown call id and so takes the whole output task down). The watcher therefore never removes or
replaces an entry of a call it sent; an answer that comes late is processed as any other. The
watcher is stall-aware: when its own tick comes later than the liveness timeout allows, the
frontend's event loop itself stalled (the answers may be waiting unread), and the outstanding
probes' clocks restart instead of blaming the ranks. The watcher task is supervised: if it ever
fails, the failure is logged and the watcher restarted (its state lives on this object), so
detection never stops silently; exiting instead would fail every in-flight request on every rank.
`/health` is 503 only while no rank is Serving: one hung or lost rank never takes the endpoint down.

Long before the liveness timeout, a rank that makes no progress is Stalled (`frontend.progress`): no output for its
output bound while it has requests in flight (checked every `OUTPUT_CHECK_S`), or its probe unanswered past its call
bound. It stays Serving with its in-flight requests, new requests go to the other ranks, and its next output or
answer ends it. The bounds are learned from its outputs' gaps and its answers' waits (`outputs`, told by the client's
`process_engine_outputs`), with the prefill cost from vLLM's request stats (`prefilled`, told by `FleetStatLoggers`).

vLLM's fan-out utilities (`call_utility_all`) go to the live ranks only, for the same reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import zmq
from vllm.exceptions import GracefulHTTPError

from corefleet_client.admin import RankState
from corefleet_client.frontend.fleet import describe
from corefleet_client.frontend.membership import Membership
from corefleet_client.frontend.progress import RankProgress, fleet_prefill_cost
from corefleet_client.frontend.rescue import Rescue
from corefleet_client.frontend.types import FleetOptions

logger = logging.getLogger("corefleet.frontend")

# The utility the liveness watcher calls: answered between engine steps, no side effects.
LIVENESS_UTILITY = "is_sleeping"
# How often the watcher checks the ranks' outputs for a stall (probes go every liveness interval).
OUTPUT_CHECK_S = 0.1
_DOWN = (RankState.DEAD, RankState.UNRESPONSIVE, RankState.IDLE)
# Ranks without an engine: nothing to watch.
_GONE = (RankState.DEAD, RankState.IDLE)


def connection_lost(e: zmq.ZMQError) -> str:
    return f"connection to the engine lost ({e.strerror})"


@dataclass
class Probe:
    """A rank's outstanding liveness call."""

    future: asyncio.Future[Any]
    sent_at: float  # loop time; moved on when the frontend's own loop stalled


class Liveness:
    """The liveness watcher over the fleet's members, and what follows from a rank's loss (see the module docstring).

    Built on vLLM's event loop once every rank joined; `start` starts the watcher, `stop` ends it."""

    def __init__(self, members: Membership, options: FleetOptions) -> None:
        self.members = members
        self.fleet = members.fleet
        self.options = options
        self.probes: dict[int, Probe] = {}  # rank -> its outstanding liveness call
        self.progress: dict[int, RankProgress] = {}  # rank -> what its answers showed (`frontend.progress`)
        # Stalled ranks whose stall an answer ends (their call went unanswered); one found by outputs ends at an output.
        self.call_stalls: set[int] = set()
        self.rescue: Rescue | None = None  # moves a Stalled rank's requests that have not started (`frontend.rescue`)
        self._rescues: set[asyncio.Task[int]] = set()
        self.task: asyncio.Task[None] | None = None
        self._last_tick: float | None = None  # when the watcher last ran (loop time)
        self._last_check: float | None = None  # when it last checked the ranks' outputs
        self._stopping = False
        self._loop = asyncio.get_running_loop()

    # ---- the watcher task ------------------------------------------------------------------------
    def start(self) -> None:
        task = asyncio.create_task(self._watch(), name="corefleet-engine-liveness")
        task.add_done_callback(self._watcher_done)
        self.task = task

    def stop(self) -> None:
        self._stopping = True
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def _watcher_done(self, task: asyncio.Task[None]) -> None:
        """The watcher never ends on its own: a failure is logged and the watcher restarted."""
        if task.cancelled() or self._stopping:
            return
        error = task.exception()
        logger.error("The engine liveness watcher failed (%s); restarting it", error or "it returned",
                     exc_info=error)
        self.start()

    async def _watch(self) -> None:
        """Every interval, probe each rank (see the module docstring); never wait on one rank's answer. In between,
        every `OUTPUT_CHECK_S`, look for ranks whose outputs stopped (`check_outputs`)."""
        loop = asyncio.get_running_loop()
        interval = self.options.liveness_interval_s
        step = min(interval, OUTPUT_CHECK_S) if self.options.stall.enabled else interval
        next_tick = loop.time() + interval
        while True:
            await asyncio.sleep(step)
            now = loop.time()
            if now >= next_tick - step / 2:
                await self.tick(now)
                next_tick = now + interval
            if self.options.stall.enabled:
                self.check_outputs(loop.time())

    async def tick(self, now: float) -> None:
        options = self.options
        self.fleet.beat()  # the pod's livenessProbe (admin /livez) reads it
        self.fleet.note_busy(bool(self.members.client.reqs_in_flight) or self.fleet.demand() > 0)
        last, self._last_tick = self._last_tick, now
        if last is not None and now - last > options.liveness_interval_s + options.liveness_timeout_s:
            logger.warning("The frontend's event loop stalled for %.1fs (over the liveness timeout of %gs): "
                           "no rank is blamed for it, the liveness clocks restart",
                           now - last - options.liveness_interval_s, options.liveness_timeout_s)
            for outstanding in self.probes.values():
                outstanding.sent_at = now
        elif options.stall.enabled and last is not None \
                and now - last > options.liveness_interval_s + options.stall.floor_s:
            # Late by more than a stall bound can be: the loop stalled, not the ranks; their answers may wait unread.
            for outstanding in self.probes.values():
                outstanding.sent_at = max(outstanding.sent_at, now - options.liveness_interval_s)
        members = dict(enumerate(self.members.client.core_engines))
        for rank in [r for r in self.probes if r not in members]:
            del self.probes[rank]  # retired: vLLM still takes an answer that comes (nobody awaits it)
        for rank in [r for r in self.progress if r not in members]:
            del self.progress[rank]
        for rank, engine in members.items():
            record = self.members.records.get(rank)
            if record is None or record.state in _GONE or rank in self.members.lost:
                self.probes.pop(rank, None)
                continue
            probe = self.probes.get(rank)
            try:
                if probe is None:
                    self.probes[rank] = await self._send_probe(rank, engine, now)
                    continue
                if record.state == RankState.SERVING and now - probe.sent_at > options.liveness_timeout_s:
                    self._rank_unresponsive(rank, probe)
                elif record.state == RankState.SERVING and options.stall.enabled and rank not in self.members.stalled:
                    bound = self._progress(rank).bound(options.stall, self.members.prefill_tokens_on(rank),
                                                       fleet_prefill_cost(self.progress.values()))
                    if now - probe.sent_at > bound:
                        self._rank_stalled(rank, f"no step ended for {now - probe.sent_at:.1f}s (its stall bound: "
                                                 f"{bound:.1f}s)", by_call=True)
                # Its probe is still out: check only that the connection is up (a killed process is
                # Dead within an interval, whether or not it was answering).
                await self.members.send_connection_check(engine)
            except zmq.ZMQError as e:
                self.rank_died(rank, connection_lost(e))

    # ---- probes ----------------------------------------------------------------------------------
    async def _send_probe(self, rank: int, engine: bytes, now: float) -> Probe:
        future = await self.members.send_utility_call(engine, LIVENESS_UTILITY, ())
        probe = Probe(future, now)
        future.add_done_callback(lambda f: self._probe_answered(rank, probe))
        return probe

    def _probe_answered(self, rank: int, probe: Probe) -> None:
        if probe.future.cancelled():
            return
        if self.probes.get(rank) is probe:
            del self.probes[rank]
        waited = self._loop.time() - probe.sent_at
        if rank in self.call_stalls and self._end_stall(rank):
            logger.warning("Engine rank %d made progress again (its liveness call answered after %.1fs): new requests "
                           "go to it again", rank, waited)
        elif self.members.state(rank) == RankState.SERVING:
            # A step time. Not the wait that ended a stall: that would keep the rank's next stall from being seen.
            self._progress(rank).answered(waited)
        if self.members.state(rank) != RankState.UNRESPONSIVE:
            return
        self.members.route_again(rank)
        self.fleet.set_rank(rank, RankState.SERVING)
        logger.warning("Engine rank %d answered its liveness call after %.1fs: Serving again", rank, waited)

    def forget(self, rank: int) -> None:
        """A new engine took the rank (a replacement): no probe of the lost one counts for it, nor what it showed."""
        self.probes.pop(rank, None)
        self.progress.pop(rank, None)
        if self.rescue is not None:
            self.rescue.forget_rank(rank)
        self._end_stall(rank)

    # ---- progress (`frontend.progress`) -----------------------------------------------------------
    def check_outputs(self, now: float) -> None:
        """Stall each Serving rank that has had requests in flight and sent no output for its output bound."""
        policy = self.options.stall
        last, self._last_check = self._last_check, now
        if last is not None and now - last > OUTPUT_CHECK_S + policy.floor_s:
            # The loop itself stalled: outputs may wait unread; no rank is blamed for it.
            for progress in self.progress.values():
                progress.restart_clocks(now)
            return
        members = self.members
        for rank, engine in enumerate(members.client.core_engines):
            record = members.records.get(rank)
            if record is None or record.state != RankState.SERVING or rank in members.unroutable:
                continue
            progress = self._progress(rank)
            progress.work(members.client.engine_inflight[engine] > 0, now)
            quiet = progress.quiet_for(now)
            # The floor first: every bound is at least that, and the gaps' quantile sorts them.
            if quiet is None or quiet <= policy.floor_s or rank in members.stalled \
                    or quiet <= progress.output_bound_before_prefill(policy):
                continue
            bound = progress.output_bound(policy, members.prefill_tokens_on(rank),
                                          fleet_prefill_cost(self.progress.values()))
            if quiet > bound:
                self._rank_stalled(rank, f"no output for {quiet:.1f}s (its stall bound: {bound:.1f}s)")

    def outputs(self, rank: int) -> None:
        """The rank sent a step's outputs (the client's `process_engine_outputs`): progress."""
        self._progress(rank).output(self._loop.time())
        if rank in self.members.stalled and self._end_stall(rank):
            logger.warning("Engine rank %d made progress again (an output): new requests go to it again", rank)

    def _end_stall(self, rank: int) -> bool:
        """The rank is no longer Stalled (it made progress, or its engine was replaced); whether it was."""
        if not self.members.stop_avoiding(rank):
            return False
        self.fleet.set_stalled(rank, "")
        return True

    def _progress(self, rank: int) -> RankProgress:
        progress = self.progress.get(rank)
        if progress is None:
            progress = self.progress[rank] = RankProgress()
        return progress

    def prefilled(self, rank: int, finished: Any) -> None:
        """vLLM's stats of requests of `rank` that finished (`FleetStatLoggers`): each one's prefill cost."""
        progress = self._progress(rank)
        for request in finished:
            progress.prefilled(float(request.prefill_time), int(request.num_prompt_tokens))

    def _rank_stalled(self, rank: int, what: str, by_call: bool = False) -> None:
        if by_call:
            self.call_stalls.add(rank)
        else:
            self.call_stalls.discard(rank)
        in_flight = self.members.in_flight(rank)
        reason = (f"{what} with {in_flight} request(s) in flight; new requests go to the other ranks until it "
                  "makes progress")
        self.members.avoid(rank, reason)
        self.fleet.set_stalled(rank, reason)
        logger.warning("Engine rank %d is stalled: %s", rank, reason)
        if self.rescue is not None and in_flight:
            task = asyncio.create_task(self.rescue.move_from(rank), name=f"corefleet-rescue-rank-{rank}")
            self._rescues.add(task)
            task.add_done_callback(self._rescue_done)

    def _rescue_done(self, task: asyncio.Task[int]) -> None:
        self._rescues.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("Moving a stalled rank's requests failed: %s", task.exception(), exc_info=task.exception())

    # ---- a rank's loss -------------------------------------------------------------------------
    def _rank_unresponsive(self, rank: int, probe: Probe) -> None:
        timeout = self.options.liveness_timeout_s
        since = time.strftime("%H:%M:%S UTC", time.gmtime(time.time() - (self._loop.time() - probe.sent_at)))
        reason = f"no answer to a liveness call sent at {since} within {timeout:g}s; its connection is up"
        self.members.stop_routing(rank, f"rank {rank} is {RankState.UNRESPONSIVE}: {reason}")
        self.fleet.set_stalled(rank, "")
        self.fleet.set_rank(rank, RankState.UNRESPONSIVE, reason)
        logger.error("Engine rank %d is unresponsive (%s): no new requests go to it, its %d in-flight "
                     "request(s) wait for it", rank, reason, len(self.members.requests_on(rank)))

    def rank_died(self, rank: int, reason: str) -> None:
        """The rank's connection is gone: it is Dead and its requests fail (a draining rank leaves all the same)."""
        members = self.members
        record = members.records.get(rank)
        if record is None or record.state in _GONE or rank in members.lost:
            return
        lost = members.requests_on(rank)
        if record.state == RankState.DRAINING:
            # Leaving anyway: its requests fail, the resize goes on, the fleet is not degraded.
            op = self.fleet.current_resize()
            what = f"resize {op.id}" if op is not None else "a resize"
            members.lost[rank] = reason
            self.fleet.set_rank(rank, RankState.DRAINING, f"died while draining for {what}: {reason}")
            logger.error("Engine rank %d died while draining (%s); failing its %d in-flight request(s)",
                         rank, reason, len(lost))
            members.fail_requests(lost, f"rank {rank} died while it was being retired by {what}: {reason}", rank)
            return
        self.probes.pop(rank, None)
        self.fleet.set_rank(rank, RankState.DEAD, reason)
        members.stop_routing(rank, f"rank {rank} is {RankState.DEAD}: {reason}")
        self.fleet.set_stalled(rank, "")
        if self.rescue is not None:
            self.rescue.forget_rank(rank)
        serving = self.fleet.ranks_in(RankState.SERVING)
        logger.error("Engine rank %d is dead (%s); failing its %d in-flight request(s); %s", rank, reason, len(lost),
                     f"{describe(serving)} serve on" if serving else "no rank serves: /health is 503")
        members.fail_requests(lost, f"rank {rank} of the fleet died: {reason}", rank)

    # ---- vLLM's fan-out utilities ----------------------------------------------------------------
    async def call_utility_all(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        """vLLM's `call_utility_all_async` (every utility of a DPLB client goes through it), over the live ranks.

        vLLM sends the call to every engine and gathers every answer, so one hung rank made
        `/reset_prefix_cache`, `/sleep`, `/wake_up`, `/is_sleeping`, collective RPCs ... wait
        forever. Here Dead and Unresponsive ranks are skipped, and a rank that turns so while the
        call waits is given up on (its late answer is still taken by vLLM's output task). The
        answers are those of the ranks that gave one, in rank order; a 503 if no rank can answer.
        """
        calls, skipped = await self._send_to_live_ranks(method, args)
        waiting = dict(calls)
        while waiting:
            await asyncio.wait(waiting.values(), timeout=self.options.liveness_interval_s,
                               return_when=asyncio.FIRST_COMPLETED)
            for rank in list(waiting):
                state = self.members.state(rank)
                if waiting[rank].done():
                    del waiting[rank]
                elif state in _DOWN:
                    skipped[rank] = str(state)
                    del calls[rank], waiting[rank]
        if skipped:
            logger.warning("Utility %s skipped %s", method,
                           ", ".join(f"rank {r} ({state})" for r, state in sorted(skipped.items())))
        if not calls:
            raise GracefulHTTPError(f"no rank of the fleet can answer {method}: "
                                    + ", ".join(f"rank {r} is {state}" for r, state in sorted(skipped.items())),
                                    HTTPStatus.SERVICE_UNAVAILABLE)
        return [calls[rank].result() for rank in sorted(calls)]

    async def _send_to_live_ranks(self, method: str, args: tuple[Any, ...]
                                  ) -> tuple[dict[int, asyncio.Future[Any]], dict[int, str]]:
        """The call sent to each rank neither Dead nor Unresponsive: (rank -> its future, rank -> why skipped)."""
        calls: dict[int, asyncio.Future[Any]] = {}
        skipped: dict[int, str] = {}
        for rank, engine in enumerate(self.members.client.core_engines):
            state = self.members.state(rank)
            if state in _DOWN:
                skipped[rank] = str(state)
                continue
            try:
                calls[rank] = await self.members.send_utility_call(engine, method, args)
            except zmq.ZMQError as e:
                self.rank_died(rank, connection_lost(e))
                skipped[rank] = str(RankState.DEAD)
        return calls, skipped
