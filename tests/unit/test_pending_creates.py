# SPDX-License-Identifier: Apache-2.0
"""A pod the reconciler just created is not applied again before the watch shows it."""

from __future__ import annotations

from corefleet_operator import builders
from corefleet_operator.handlers.fleet import EXPECTATION_SECONDS, PendingCreates
from corefleet_operator.planner import Apply, Delete
from factories import make_ecs


def pod(generation: int = 1) -> dict:
    fleet = make_ecs("a").replicas(1).obj()
    return builders.engine_pod(fleet, 0, dp_size=1, frontend_address="f", fleet_generation=generation)


def test_created_pod_is_skipped_until_seen_or_expired() -> None:
    pending = PendingCreates()
    obj = pod()
    other = Delete("v1", "Pod", "x", "uid")
    pending.created(obj, now=100.0)

    assert pending.filter([Apply(obj), other], seen=set(), now=101.0) == [other]
    # Seen by the watch: the expectation is met and forgotten; a later apply (it vanished) goes out.
    assert pending.filter([], seen={"a-engine-0"}, now=102.0) == []
    assert pending.filter([Apply(obj)], seen=set(), now=103.0) == [Apply(obj)]


def test_expectation_expires() -> None:
    pending = PendingCreates()
    pending.created(pod(), now=100.0)

    assert pending.filter([Apply(pod())], seen=set(), now=100.0 + EXPECTATION_SECONDS + 1) == [Apply(pod())]


def test_a_pod_of_another_incarnation_is_not_held_back() -> None:
    pending = PendingCreates()
    pending.created(pod(generation=1), now=100.0)

    assert pending.filter([Apply(pod(generation=2))], seen=set(), now=101.0) == [Apply(pod(generation=2))]


def test_wakeup_handler_successes_are_not_logged_but_failures_are() -> None:
    import logging

    from corefleet_operator.handlers.fleet import QuietWakeups

    def record(level: int, msg: str) -> logging.LogRecord:
        return logging.LogRecord("kopf.objects", level, __file__, 1, msg, None, None)

    quiet = QuietWakeups()
    assert not quiet.filter(record(logging.INFO, "Handler 'child_changed' succeeded."))
    assert quiet.filter(record(logging.ERROR, "Handler 'child_changed' failed with an exception."))
    assert quiet.filter(record(logging.INFO, "Handler 'startup' succeeded."))
