# SPDX-License-Identifier: Apache-2.0
"""The frontend's elastic-EP notifications (`frontend.elastic`): what vLLM's output task hands it for call id -1.

RECONFIGURE_FINISHED counts only from rank 0, after the commit, once; SHUTDOWN_COMPLETE only from a
leaving rank, after the commit, once, and it retires that rank. Anything else is a protocol error
that fails the running resize (its waits raise it)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from corefleet_client.admin import RankState, ResizeOperation, ResizePhase
from corefleet_client.frontend.elastic import ElasticResize, _new_notifications
from corefleet_client.frontend.fleet import Fleet
from corefleet_client.frontend.membership import Membership
from corefleet_client.frontend.types import Cancels, FleetOptions, ResizeFailed

OPTIONS = FleetOptions(coordinator_address="127.0.0.1", coordinator_front_publish_port=1,
                       coordinator_back_output_port=2, coordinator_back_publish_port=3)


def make_elastic() -> ElasticResize:
    """The elastic-EP component over a membership with no member records (what the notifications and waits use)."""
    client: Any = SimpleNamespace(core_engines=[])
    return ElasticResize(Membership(client, Fleet("m", 4), joiner=None, vllm_abort=None),  # type: ignore[arg-type]
                         Cancels(), OPTIONS)


OP = ResizeOperation(id="r", from_replicas=4, to_replicas=2, phase=ResizePhase.COMMITTING)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def notify(host: ElasticResize, *notifications: tuple[str, int], leaving: tuple[int, ...] = (2, 3),
                 committed: bool = True) -> Any:
    host.running = eep = _new_notifications("r", leaving)
    eep.committed = committed
    for notification in notifications:
        await host.notification(notification)
    return eep


def error_of(eep: Any) -> str:
    assert eep.error.done(), "no protocol error"
    return str(eep.error.exception())


def test_the_expected_notifications_resolve_the_waits_and_retire_the_leaving_ranks() -> None:
    host = make_elastic()

    async def scenario() -> Any:
        eep = await notify(host, ("SHUTDOWN_COMPLETE", 3), ("RECONFIGURE_FINISHED", 0), ("SHUTDOWN_COMPLETE", 2))
        assert not eep.error.done()
        await host.wait(OP, eep.finished, time.monotonic() + 5, "RECONFIGURE_FINISHED", [0, 1])
        for rank in (2, 3):
            await host.wait(OP, eep.shut_down[rank], time.monotonic() + 5, f"SHUTDOWN_COMPLETE {rank}", [0, 1])
        return eep

    run(scenario())
    assert [host.fleet.record(r).state for r in (2, 3)] == [RankState.RETIRED] * 2
    assert "SHUTDOWN_COMPLETE" in host.fleet.record(2).message


@pytest.mark.parametrize(("notifications", "committed", "words"), [
    ([("SHUTDOWN_COMPLETE", 1)], True, "SHUTDOWN_COMPLETE from rank 1, which is not leaving"),
    ([("SHUTDOWN_COMPLETE", 2), ("SHUTDOWN_COMPLETE", 2)], True, "a second SHUTDOWN_COMPLETE from rank 2"),
    ([("SHUTDOWN_COMPLETE", 2)], False, "SHUTDOWN_COMPLETE from rank 2 before the commit"),
    ([("RECONFIGURE_FINISHED", 1)], True, "RECONFIGURE_FINISHED from rank 1: only rank 0"),
    ([("RECONFIGURE_FINISHED", 0)], False, "RECONFIGURE_FINISHED before the commit"),
    ([("RECONFIGURE_FINISHED", 0), ("RECONFIGURE_FINISHED", 0)], True, "RECONFIGURE_FINISHED twice"),
    ([("SCALE_UP_READY", 0)], True, "SCALE_UP_READY"),
])
def test_a_notification_out_of_protocol_fails_the_resize(notifications: list[tuple[str, int]], committed: bool,
                                                          words: str) -> None:
    host = make_elastic()

    async def scenario() -> str:
        eep = await notify(host, *notifications, committed=committed)
        assert words in error_of(eep)
        with pytest.raises(ResizeFailed, match="elastic-EP protocol error") as failed:
            await host.wait(OP, asyncio.get_running_loop().create_future(), time.monotonic() + 5, "x", [0])
        return str(failed.value)

    assert words in run(scenario())


def test_a_notification_while_no_resize_runs_is_only_logged(caplog: pytest.LogCaptureFixture) -> None:
    host = make_elastic()
    host.running = None
    run(host.notification(("SHUTDOWN_COMPLETE", 2)))
    assert "SHUTDOWN_COMPLETE from rank 2 while no elastic-EP resize runs" in caplog.text
    assert host.fleet.record(2).state == RankState.JOINING  # nothing changed


def test_a_dead_participant_ends_a_wait_and_leaves_the_fleet_to_be_recreated() -> None:
    host = make_elastic()
    host.members.lost[2] = "connection to the engine lost"

    async def scenario() -> ResizeFailed:
        host.running = _new_notifications("r", (2, 3))
        with pytest.raises(ResizeFailed) as failed:
            await host.wait(OP, asyncio.get_running_loop().create_future(), time.monotonic() + 5, "x", [0, 2])
        return failed.value

    failed = run(scenario())
    assert "rank 2 died: connection to the engine lost" in str(failed)
    assert not failed.fleet_intact


def test_a_wait_past_its_deadline_fails() -> None:
    host = make_elastic()

    async def scenario() -> None:
        host.running = _new_notifications("r", ())
        with pytest.raises(ResizeFailed, match="RECONFIGURE_FINISHED from rank 0: no answer within the deadline"):
            await host.wait(OP, asyncio.get_running_loop().create_future(), time.monotonic() + 0.3,
                                 "RECONFIGURE_FINISHED from rank 0", [0])

    run(scenario())
