# SPDX-License-Identifier: Apache-2.0
"""The operator's two clocks, passed in where time is read so that tests can hold them still.

`monotonic()` measures the operator's own waits and deadlines (the daemon's backoff, how long a
created pod may stay unseen, when the frontend may be asked again); it must be the event loop's
clock, because the daemon's timeouts (`asyncio.wait`) run on that one: in production both are
`time.monotonic`, in tests a virtual-time event loop's `time()`. `now()` is wall time, compared with
the API server's timestamps (a pod's `deletionTimestamp`) and written into the status.

A leaf module: no kopf, no Kubernetes client, nothing of corefleet.
"""

from __future__ import annotations

import datetime
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on the event loop's clock (only differences mean anything)."""
        ...

    def now(self) -> datetime.datetime:
        """The wall time, timezone-aware, in UTC."""
        ...


class SystemClock:
    """The real clocks: `time.monotonic` (asyncio's default event loop clock) and the system's UTC time."""

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> datetime.datetime:
        return datetime.datetime.now(datetime.UTC)


SYSTEM_CLOCK = SystemClock()


def timestamp(when: datetime.datetime) -> str:
    """RFC 3339 to the second in UTC, as Kubernetes writes times (`2026-01-01T00:00:00Z`)."""
    return when.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
