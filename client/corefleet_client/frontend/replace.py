# SPDX-License-Identifier: Apache-2.0
"""Replacing a lost rank of a dense fleet in place: the frontend's side (`RankReplacement`).

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

Steps (`_replace`, on vLLM's event loop), the rank staying Dead and unroutable until the commit:

1. Preparing: the handshake ROUTER is bound again, with ROUTER_HANDOVER, for exactly the replaced
   ranks, and vLLM's own `wait_for_engine_startup` answers the new engine's HELLO with the same INIT
   as at startup (the frontend's engine sockets, the coordinator's fixed addresses, the same fleet
   size: a dense INIT carries no parallel config), bounded by the join timeout and cancellable
   (the scale-up's `_run_handshake`).
2. The new engine's ready response is read from the requests ROUTER, which has ROUTER_HANDOVER
   set: the new connection under the rank's identity takes the dead one's place. Its version and
   tensor-parallel size are checked as in a scale-up. The fleet's summed `num_gpu_blocks` is kept
   as it was (vLLM's `_apply_ready_response` adds each ready response's blocks: the replacement
   takes the lost engine's share, it does not add one).
3. Committing, without an await: any request still recorded on the rank is ended with an error
   (there should be none: they were failed when it died), its routing counters are reset
   (`engine_inflight`, its `lb_engines` entry, the coordinator's stale load ignored until its
   first request), it leaves `_unroutable` and is Serving again.
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
replaced rank, the router sees its load as zero (`_ignore_load_until_routed` at the commit, then
`_ignore_stale_loads`, called by the client before each routing choice); from then on the engine's
own counts reach the coordinator. A rank back from Unresponsive gets the same treatment (its
coordinator counts may be from before it stalled).

On a failure (no HELLO or READY within the join timeout, a cancel, no ready response, another
vLLM version or TP size) the operation fails with the reason, the rank stays Dead and unroutable,
and the rest of the fleet is untouched (`fleet_intact`).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from vllm.utils.network_utils import get_tcp_uri
from vllm.v1.engine.utils import CoreEngine

from corefleet_client.admin import RankState, ResizeOperation, ResizePhase
from corefleet_client.frontend.fleet import Fleet, RankRecord, describe, identity

logger = logging.getLogger("corefleet.frontend")


class _Host(Protocol):
    """What `RankReplacement` uses of corefleet's client (`frontend.client.KubeDPLBClient`)."""

    _fleet: Fleet
    vllm_config: Any
    lb_engines: list[list[int | float]]
    engine_inflight: Any
    _records: dict[int, RankRecord]
    _unroutable: dict[int, str]
    _probes: dict[int, Any]
    _stale_loads: dict[int, int] | None

    def _check_cancel(self, op: ResizeOperation) -> None: ...

    def _discard_stale_ready_responses(self) -> None: ...

    async def _run_handshake(self, op: ResizeOperation, engines: list[CoreEngine], address: str) -> None: ...

    async def _read_ready_responses(self, ranks: list[int]) -> None: ...

    def _requests_on(self, rank: int) -> list[str]: ...

    def _fail_requests(self, request_ids: list[str], message: str, rank: int | None = None) -> None: ...

    def _ignore_load_until_routed(self, rank: int) -> None: ...


def remote_engine(rank: int) -> CoreEngine:
    """vLLM's handshake bookkeeping for one engine of another pod (shared by startup, scale-up and replacement)."""
    engine = CoreEngine(index=rank, local=False)
    engine.index = rank  # vLLM keeps only the identity
    return engine


class RankReplacement:
    """The replacement of Dead dense ranks in place (see the module docstring); mixed into KubeDPLBClient."""

    # Replaced ranks no request was routed to yet -> their requests_total at the commit (see the module docstring).
    _stale_loads: dict[int, int] | None = None

    def _ignore_stale_loads(self: _Host) -> None:
        """Before a routing choice: a replaced rank's load is zero until its first request (not the lost engine's)."""
        stale = self._stale_loads
        if not stale:
            return
        for rank, total in list(stale.items()):
            record = self._records.get(rank)
            if record is None or record.requests_total != total or record.state != RankState.SERVING \
                    or rank in self._unroutable or rank >= len(self.lb_engines):
                del stale[rank]  # it got a request (its engine now publishes its own counts), or left the routing
            else:
                self.lb_engines[rank] = [0, 0, 0.0]

    def _ignore_load_until_routed(self: _Host, rank: int) -> None:
        """A rank back in the routing: the coordinator's load for it counts as zero until a request is routed
        to it (a replaced rank's new engine, or a rank back from Unresponsive, whose last published counts
        may be older than what it runs now). The router still counts this client's own requests on it
        exactly (vLLM's score is the greater of the two)."""
        if rank < len(self.lb_engines):
            self.lb_engines[rank] = [0, 0, 0.0]
        if self._stale_loads is None:
            self._stale_loads = {}
        self._stale_loads[rank] = self._records[rank].requests_total

    async def _replace(self: _Host, op: ResizeOperation) -> None:
        # client.py imports this module (its client class inherits this one): its names come at call time.
        from corefleet_client.frontend.client import ResizeFailed

        ranks = sorted(op.replace)
        pc = self.vllm_config.parallel_config
        address = get_tcp_uri(pc.data_parallel_master_ip, pc.data_parallel_rpc_port)
        blocks = self.vllm_config.cache_config.num_gpu_blocks
        try:
            # 1. The new engines' handshake, in a thread, bounded by the join timeout.
            self._fleet.update_resize(op.id, phase=ResizePhase.PREPARING,
                                      message=f"waiting for a new engine for {describe(ranks)} to handshake "
                                              f"on {address}")
            for rank in ranks:
                self._fleet.set_rank(rank, RankState.DEAD, f"being replaced by {op.id}: waiting for a new "
                                                           "engine's HELLO")
            self._check_cancel(op)
            self._discard_stale_ready_responses()
            await self._run_handshake(op, [remote_engine(rank) for rank in ranks], address)
            for rank in ranks:
                self._fleet.set_rank(rank, RankState.DEAD, f"being replaced by {op.id}: the new engine is "
                                                           "READY; reading its ready response")
            # 2. Their ready responses (sent on the requests socket before READY).
            await self._read_ready_responses(ranks)
            self._check_cancel(op)
        except Exception as e:  # nothing changed: the ranks stay Dead and unroutable, the others serve on
            if not isinstance(e, ResizeFailed):
                logger.exception("Replacement %s: the new engines' handshake failed", op.id)
                e = ResizeFailed(f"the new engines' handshake failed: {type(e).__name__}: {e}")
            for rank in ranks:
                self._fleet.set_rank(rank, RankState.DEAD, f"replacement {op.id} failed: {e}")
            raise e from None
        finally:
            # The replacements take the lost engines' share of the KV cache; they do not add one.
            self.vllm_config.cache_config.num_gpu_blocks = blocks
        # 3. Commit, without an await: from here on requests may be routed to them.
        self._fleet.update_resize(op.id, phase=ResizePhase.COMMITTING, message=f"{describe(ranks)} back in service")
        for rank in ranks:
            leftover = self._requests_on(rank)
            if leftover:
                self._fail_requests(leftover, f"rank {rank} was replaced by {op.id} before this request "
                                              "finished: retry the request", rank)
            self.engine_inflight.pop(identity(rank), None)
            self._probes.pop(rank, None)
            self._unroutable.pop(rank, None)
            self._records[rank] = self._fleet.record(rank)
            self._ignore_load_until_routed(rank)
            self._fleet.set_rank(rank, RankState.SERVING)
        logger.info("Replacement %s: %s replaced in place; %d rank(s) serve", op.id, describe(ranks),
                    len(self._fleet.ranks_in(RankState.SERVING)))
        self._fleet.finish_resize(op.id, message=f"{describe(ranks)} replaced in place; the fleet serves at "
                                                 f"{op.to_replicas} rank(s)")
