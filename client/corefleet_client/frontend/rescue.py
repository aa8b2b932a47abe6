# SPDX-License-Identifier: Apache-2.0
"""A Stalled rank's requests that have not started are sent to another rank (`Rescue`).

A rank that turns Stalled (`frontend.progress`) gets no new request, but the ones it already has wait for it,
and each holds its client: a stopped rank under 4 closed-loop clients had all 4 of them within the 1.2 s it took
to find the stall. A request the rank has sent nothing for yet (no token: queued, or prefilling) can go elsewhere
without the client seeing anything: the frontend keeps each unpinned request's `EngineCoreRequest` until its first
output (`sent`, `engine_outputs`), and once its rank is Stalled (`move_from`):

1. the request leaves the rank's routing entry (vLLM's `reqs_in_flight` and `engine_inflight`) and is noted as moved
   from that rank;
2. vLLM's abort of it is sent to the stalled rank: queued on its socket, it ends the request there before the
   rank's next step once it resumes (an abort of a request the engine never got does nothing);
3. it is routed again as a new request (corefleet's `add_request_async`: the stalled rank is avoided), keeping its
   id and its output queue: the client's stream or response goes on from the new rank.

Until the old rank reports the request finished (its abort), whatever the old rank sends for it (a token of the step
it was in when it stopped, its finish) is dropped before vLLM's output handling sees it (`engine_outputs`, on the
output socket's reader, through vLLM's `process_engine_outputs` hook), so the client gets one stream, and vLLM's
routing tables count the request on its new rank only. A request that already streamed tokens stays (its state
lives on its engine); so does one pinned to the rank (`data_parallel_rank`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import zmq

from corefleet_client.frontend.fleet import identity
from corefleet_client.frontend.membership import Membership

logger = logging.getLogger("corefleet.frontend")

# `unstarted` keeps only requests vLLM's routing tables still hold: pruned when it grows past this over them.
PRUNE_SLACK = 256


class Rescue:
    """See the module docstring. Runs on vLLM's event loop (`engine_outputs` in its output socket's reader task)."""

    def __init__(self, members: Membership, resend: Callable[[Any], Awaitable[None]]) -> None:
        self.members = members
        self._resend = resend  # corefleet's `add_request_async`: routes and sends a request as a new one
        self.unstarted: dict[str, Any] = {}  # request id -> its EngineCoreRequest, until its first output
        self.moved: dict[str, int] = {}  # request id -> the rank it was moved from, until that rank ends it
        self.moved_total = 0

    def sent(self, request: Any) -> None:
        """A new request went to a rank (not one pinned to it)."""
        if request.data_parallel_rank is None:
            self.unstarted[request.request_id] = request
        if len(self.unstarted) > len(self.members.client.reqs_in_flight) + PRUNE_SLACK:
            in_flight = self.members.client.reqs_in_flight
            self.unstarted = {rid: r for rid, r in self.unstarted.items() if rid in in_flight}

    def engine_outputs(self, outputs: Any) -> None:
        """One message of engine outputs, before vLLM handles it: what a rank sends for a request moved away from it
        is dropped (its end of one forgets the move); a request with an output has started."""
        moved = self.moved
        if moved:
            rank = outputs.engine_index
            if outputs.outputs and any(moved.get(o.request_id) == rank for o in outputs.outputs):
                outputs.outputs = [o for o in outputs.outputs if moved.get(o.request_id) != rank]
            finished = outputs.finished_requests
            if finished:
                ended = {rid for rid in finished if moved.get(rid) == rank}
                if ended:
                    for rid in ended:
                        del moved[rid]
                    outputs.finished_requests = finished - ended
        unstarted = self.unstarted
        if unstarted:
            for output in outputs.outputs:
                unstarted.pop(output.request_id, None)
            for rid in outputs.finished_requests or ():
                unstarted.pop(rid, None)

    async def move_from(self, rank: int) -> int:
        """The Stalled rank's requests that have not started, sent to other ranks (see the module docstring); how
        many. Stops once the rank makes progress again, or leaves the routing."""
        members = self.members
        client = members.client
        engine = identity(rank)
        ids = [rid for rid, at in client.reqs_in_flight.items() if at == engine and rid in self.unstarted]
        count = 0
        for rid in ids:
            if rank not in members.stalled:
                break
            request = self.unstarted.pop(rid, None)
            if request is None or client.reqs_in_flight.get(rid) != engine:
                continue
            del client.reqs_in_flight[rid]
            client.engine_inflight[engine] -= 1
            self.moved[rid] = rank
            try:
                await members.abort_on_engine([rid], rank)
            except zmq.ZMQError as e:  # its connection is gone: it is Dead, the request is not there
                logger.info("Abort of moved request %s on rank %d not sent: %s", rid, rank, e)
            try:
                await self._resend(request)
            except Exception as e:  # no rank can take it: it ends with that error, not silently
                members.fail_requests([rid], f"rank {rank} stalled and no other rank took the request: {e}")
            count += 1
        if count:
            self.moved_total += count
            record = members.records.get(rank)
            if record is not None:
                record.moved_total += count
            logger.warning("Moved %d request(s) that had not started from stalled rank %d to other ranks", count, rank)
        return count

    def forget_rank(self, rank: int) -> None:
        """The rank is gone or replaced: it will end nothing it had."""
        for rid in [rid for rid, at in self.moved.items() if at == rank]:
            del self.moved[rid]
