# SPDX-License-Identifier: Apache-2.0
"""Resize operations on vLLM's event loop: the `fleet.ResizeRunner` the admin API hands them to (`ResizeOperations`).

`Fleet.start_resize` records an operation and calls `run_resize` from the admin server's thread;
the operation then runs as a task on vLLM's event loop, by the component for its kind: a
replacement of Dead (or Idle: a wake) dense ranks and the idling of a dense fleet
(`frontend.replace`), an elastic-EP resize of an MoE fleet (`frontend.elastic`), or a dense
scale-up or scale-down (`frontend.resize`). Whatever ends it is
recorded on the operation: `ResizeFailed` with its `fleet_intact`, a shutdown (the fleet must be
recreated), or an unexpected error (logged, and the fleet recreated too). A follower's part of
frontend 0's resize (several frontends) runs by `frontend.followers` up to Prepared, and goes on
when frontend 0 calls `commit_resize` (or decides at once when a restarted frontend 0 calls
`orphan_resize` on a part its predecessor left). `cancel_resize` asks the
operation to stop: it stops at its next checkpoint (`types.Cancels`), or at once while it waits for
joining ranks' handshake; once it committed, `Fleet.cancel_resize` refuses.
"""

from __future__ import annotations

import asyncio
import logging

from corefleet_client.frontend.elastic import ElasticResize
from corefleet_client.frontend.followers import FollowerResize
from corefleet_client.frontend.membership import Membership
from corefleet_client.frontend.replace import Replacement
from corefleet_client.frontend.resize import DenseResize
from corefleet_client.frontend.types import Cancels, ResizeFailed

logger = logging.getLogger("corefleet.frontend")


class ResizeOperations:
    """Runs each resize operation by its component, one task each (see the module docstring)."""

    def __init__(self, members: Membership, cancels: Cancels, dense: DenseResize, elastic: ElasticResize,
                 replacement: Replacement, loop: asyncio.AbstractEventLoop) -> None:
        self.members = members
        self.fleet = members.fleet
        self.cancels = cancels
        self.dense = dense
        self.follower = FollowerResize(members, cancels, replacement)  # this frontend's part of frontend 0's
        self.elastic = elastic
        self.replacement = replacement
        self._loop = loop  # vLLM's, where every operation runs
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- fleet.ResizeRunner: called from the admin server's threads --------------------------------
    def run_resize(self, resize_id: str) -> None:
        self._loop.call_soon_threadsafe(self._start, resize_id)

    def cancel_resize(self, resize_id: str, reason: str) -> None:
        self._loop.call_soon_threadsafe(self._cancel, resize_id, reason)

    def commit_resize(self, resize_id: str) -> None:
        self._loop.call_soon_threadsafe(self.follower.commit, resize_id)

    def orphan_resize(self, resize_id: str, reason: str) -> None:
        self._loop.call_soon_threadsafe(self.follower.orphan, resize_id, reason)

    # ---- on the event loop -------------------------------------------------------------------------
    def stop(self) -> None:
        """The frontend shuts down: every running operation is cancelled (and recorded as failed)."""
        for task in list(self._tasks):
            if not task.done():
                task.cancel()

    def _start(self, resize_id: str) -> None:
        task = asyncio.create_task(self.run(resize_id), name=f"corefleet-resize-{resize_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _cancel(self, resize_id: str, reason: str) -> None:
        self.cancels.request(resize_id, reason)
        self.members.joiner.abort(f"cancelled: {reason}", resize_id)

    async def run(self, resize_id: str) -> None:
        """Carry out one operation, by its kind, and record how it ended."""
        op = self.fleet.resize(resize_id)
        assert op is not None
        try:
            if op.follower and op.replace:
                await self.follower.replace(op)
            elif op.follower:
                await (self.follower.scale_up(op) if op.scale_up else self.follower.scale_down(op))
            elif op.replace:
                await self.replacement.replace(op)
            elif op.idle:
                await self.replacement.idle(op)
            elif self.fleet.moe:
                await (self.elastic.scale_up(op) if op.scale_up else self.elastic.scale_down(op))
            elif op.scale_up:
                await self.dense.scale_up(op)
            else:
                await self.dense.scale_down(op)
        except ResizeFailed as e:
            self.fleet.finish_resize(op.id, error=str(e), fleet_intact=e.fleet_intact)
        except asyncio.CancelledError:
            self.fleet.finish_resize(op.id, error="the frontend is shutting down", fleet_intact=False)
            raise
        except Exception as e:
            logger.exception("Resize %s failed unexpectedly", op.id)
            self.fleet.finish_resize(op.id, error=f"unexpected error: {type(e).__name__}: {e}", fleet_intact=False)
        finally:
            self.cancels.forget(op.id)
            self.follower.forget(op.id)
