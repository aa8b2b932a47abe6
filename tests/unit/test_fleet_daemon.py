# SPDX-License-Identifier: Apache-2.0
"""The kopf side of reconciliation (corefleet_operator/handlers/fleet.py): the per-fleet daemon's sleep
between passes and its backoff, run in virtual time (`virtualtime.run`: the scenarios' seconds pass
at once and their times are exact), and the log filter of the wake-up handlers. (Moved from
test_pending_creates.py.)"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, cast

import kopf
import pytest

from corefleet_operator.handlers import fleet as fleet_handlers
from corefleet_operator.handlers.fleet import QuietWakeups
from corefleet_operator.planner import PlanSettings
from factories import make_ecs
from fakekube import QUOTA, FakeKube, refused
from virtualtime import LoopClock, run


def test_wakeup_handler_successes_are_not_logged_but_failures_are() -> None:
    def record(level: int, msg: str) -> logging.LogRecord:
        return logging.LogRecord("kopf.objects", level, __file__, 1, msg, None, None)

    quiet = QuietWakeups()
    assert not quiet.filter(record(logging.INFO, "Handler 'child_changed' succeeded."))
    assert quiet.filter(record(logging.ERROR, "Handler 'child_changed' failed with an exception."))
    assert quiet.filter(record(logging.INFO, "Handler 'startup' succeeded."))


class Stopped:
    """kopf's DaemonStopped, as the daemon uses it: falsy until set, and awaitable."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def __bool__(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()


def sleep_for(seconds: float, deaf: float, *, woken: bool = False, stop_at: float | None = None) -> float:
    """How long (virtual seconds) the daemon's sleep of `seconds`, deaf for `deaf`, lasts: woken at once
    (a wake-up before it began) or not, stopped at `stop_at` or never."""
    async def scenario() -> float:
        clock, wake, stopped = LoopClock(), asyncio.Event(), Stopped()
        if woken:
            wake.set()
        if stop_at is not None:
            asyncio.get_running_loop().call_later(stop_at, stopped.set)
        t0 = clock.monotonic()
        await fleet_handlers._sleep(wake, stopped, seconds, deaf=deaf, clock=clock)  # type: ignore[arg-type]
        return clock.monotonic() - t0
    return run(scenario())


def test_a_failing_reconcile_ignores_wakeups_for_a_while() -> None:
    assert sleep_for(10.0, deaf=0.3, woken=True) == pytest.approx(0.3)  # woken at once: heard after 0.3 s
    assert sleep_for(10.0, deaf=0.0, woken=True) == 0.0  # not deaf: at once
    assert sleep_for(10.0, deaf=0.3) == pytest.approx(10.0)  # never woken: the whole timer
    assert sleep_for(10.0, deaf=5.0, stop_at=1.0) == pytest.approx(1.0)  # a stop is heard even while deaf


def test_a_fleet_whose_actions_keep_failing_does_not_reconcile_on_every_wakeup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its pods' creation refused (a quota), woken every 50 ms (its children's events): it retries on
    a doubling timer, deaf to wake-ups meanwhile, not on each of them."""
    monkeypatch.setattr(kopf, "event", lambda body, *, type, reason, message: None)
    body = make_ecs("a").replicas(1).raw()
    body["metadata"]["namespace"] = "ns"
    kube = FakeKube(refuse={n: refused(403, QUOTA) for n in ("a-coordinator", "a-frontend", "a-engine-0")})
    clock = LoopClock()
    attempts: list[float] = []  # when the coordinator's creation was tried
    create = kube.create

    async def timed_create(obj: Any) -> dict[str, Any]:
        if obj["metadata"]["name"] == "a-coordinator":
            attempts.append(clock.monotonic())
        return await create(obj)
    kube.create = timed_create  # type: ignore[method-assign]

    class Memo:
        wakeups: dict[tuple[str, str], asyncio.Event] = {}
        resync_seconds = 60.0
        plan_settings = PlanSettings()

    memo = Memo()
    memo.kube = kube  # type: ignore[attr-defined]
    memo.clock = clock  # type: ignore[attr-defined]
    indexes: dict[str, Any] = {name: {} for name in fleet_handlers.INDEXES}  # no children yet

    async def scenario() -> None:
        stopped = Stopped()
        # kopf's decorator declares the daemon as its DaemonFn protocol (every keyword kopf passes, kopf's own
        # types); it returns the coroutine function itself, called here with what it reads and stand-ins.
        fleet_daemon = cast("Callable[..., Coroutine[Any, Any, None]]", fleet_handlers.fleet)
        daemon = asyncio.create_task(fleet_daemon(
            body=body, name="a", namespace="ns", memo=memo, stopped=stopped,
            logger=fleet_handlers.logger, **indexes))
        loop = asyncio.get_running_loop()
        end = loop.time() + 7.5
        while loop.time() < end:
            if ("ns", "a") in memo.wakeups:
                memo.wakeups[("ns", "a")].set()
            await asyncio.sleep(0.05)
        stopped.set()
        await asyncio.wait_for(daemon, 5)

    run(scenario())
    assert attempts == pytest.approx([0.0, 1.0, 3.0, 7.0])  # deaf for 1 s, then 2 s, then 4 s: not ~150 times
    assert sum(1 for verb, name in kube.calls if name == "a-coordinator" and verb in ("create", "apply")) == 4
