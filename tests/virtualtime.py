# SPDX-License-Identifier: Apache-2.0
"""Clocks for unit tests: time that passes only when the code under test waits, and time held still.

`run(main)` runs a coroutine on an event loop whose clock is virtual: whenever the loop has nothing
ready to run it jumps at once to its next timer (an `asyncio.sleep`, an `asyncio.wait` timeout), so
a scenario of several seconds of timeouts runs in milliseconds and its times are exact. `LoopClock`
is the operator's `Clock` on that loop (its `monotonic` is the loop's time, as the daemon requires).
No threads in such a scenario: the virtual clock does not wait for them.

`FakeClock` is a `Clock` that stands still until a test moves it.
"""

from __future__ import annotations

import asyncio
import datetime
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
EPOCH = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


class _InstantSelector(selectors.SelectSelector):
    """Polls without blocking; a wait for the next timer makes that time pass instead."""

    def __init__(self) -> None:
        super().__init__()
        self.elapsed = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:  # no timer at all: wait for I/O as any loop would
            return super().select(None)
        events = super().select(0)
        if not events and timeout > 0:
            self.elapsed += timeout
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose `time()` moves only when it is idle, straight to its next timer."""

    def __init__(self) -> None:
        self._instant = _InstantSelector()
        super().__init__(self._instant)

    def time(self) -> float:
        return self._instant.elapsed


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` in virtual time (starting at 0)."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main)


class LoopClock:
    """The operator's `Clock` on the running event loop: `monotonic` is the loop's time, `now` is
    `EPOCH` plus it."""

    def monotonic(self) -> float:
        return asyncio.get_running_loop().time()

    def now(self) -> datetime.datetime:
        return EPOCH + datetime.timedelta(seconds=self.monotonic())


class FakeClock:
    """A `Clock` that stands still: `advance` moves both of its times."""

    def __init__(self, now: datetime.datetime = EPOCH, monotonic: float = 1000.0) -> None:
        self._now, self._monotonic = now, monotonic

    def advance(self, seconds: float) -> None:
        self._now += datetime.timedelta(seconds=seconds)
        self._monotonic += seconds

    def monotonic(self) -> float:
        return self._monotonic

    def now(self) -> datetime.datetime:
        return self._now
