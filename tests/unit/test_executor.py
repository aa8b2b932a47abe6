# SPDX-License-Identifier: Apache-2.0
"""Carrying out a plan against a fake API server (corefleet_operator/executor.py): a pod just created is
not created again before the watch shows it; a refused action is a failure and the others still run; a
name the fleet does not control is never written; a pod stuck terminating is found. (Moved from
test_pending_creates.py with the code.)"""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

from corefleet_operator import builders
from corefleet_operator.actions import Action, Apply, Delete
from corefleet_operator.executor import (
    EXPECTATION_SECONDS,
    ActionFailure,
    Executor,
    PendingCreates,
    stuck_terminations,
)
from corefleet_operator.observe import Terminating
from factories import make_ecs
from fakekube import QUOTA, FakeKube, refused
from virtualtime import FakeClock


def pod(generation: int = 1) -> dict[str, Any]:
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


def test_the_executor_expects_the_pods_it_created_for_the_expectation_time_on_its_clock() -> None:
    clock = FakeClock()
    ex = Executor(FakeKube(), "ns", make_ecs("a").uid, clock=clock)  # type: ignore[arg-type]
    actions: list[Action] = [Apply(pod())]
    assert asyncio.run(ex.carry_out(actions)) == []

    assert ex.unexpected(actions, seen=()) == []  # created, not yet seen: not created again
    clock.advance(EXPECTATION_SECONDS - 0.5)
    assert ex.unexpected(actions, seen=()) == []
    assert ex.unexpected([], seen=["a-engine-0"]) == []  # seen: the expectation is met ...
    assert ex.unexpected(actions, seen=()) == actions  # ... and forgotten (it vanished since: created again)
    ex.pending.created(pod(), clock.monotonic())
    clock.advance(EXPECTATION_SECONDS + 0.5)
    assert ex.unexpected(actions, seen=()) == actions  # unseen past the expectation: created again


def executor(kube: FakeKube, fleet: str = "a") -> Executor:
    return Executor(kube, "ns", make_ecs(fleet).uid)  # type: ignore[arg-type]


def foreign_service(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "ns", "uid": "u1"},
            "spec": {"ports": [{"port": 80}]}}


def service(name: str = "a") -> dict[str, Any]:
    return builders.frontend_service(make_ecs("a").obj())


def test_a_refused_action_is_a_failure_and_the_other_actions_still_run() -> None:
    kube = FakeKube(refuse={"a-engine-0": refused(403, QUOTA)})
    svc = service()
    failures = asyncio.run(executor(kube).carry_out([Apply(pod()), Apply(svc)]))

    assert failures == [ActionFailure("Pod a-engine-0", f"write refused (403): {QUOTA}")]
    assert ("apply", "a") in kube.calls


def test_a_foreign_object_of_a_childs_name_is_never_written() -> None:
    kube = FakeKube({("Service", "a"): foreign_service("a")})
    failures = asyncio.run(executor(kube).carry_out([Apply(service())]))

    (failure,) = failures
    assert failure.conflict
    assert failure.target == "Service a"
    assert "not created by corefleet" in failure.message
    assert kube.calls == [("get", "a")]
    assert kube.objects[("Service", "a")] == foreign_service("a")


def test_a_service_controlled_by_another_fleet_is_refused_naming_that_fleet() -> None:
    other = builders.fleet_service(make_ecs("x").obj())  # x's headless Service `x-fleet`
    kube = FakeKube({("Service", "x-fleet"): other})
    mine = builders.frontend_service(make_ecs("x-fleet").obj())  # x-fleet's endpoint, the same name
    failures = asyncio.run(executor(kube, "x-fleet").carry_out([Apply(mine)]))

    assert [(f.target, f.conflict) for f in failures] == [("Service x-fleet", True)]
    assert "controlled by EngineCoreSet x," in failures[0].message
    assert kube.objects[("Service", "x-fleet")] is other


def test_own_children_are_applied_without_a_read_and_unobserved_own_ones_after_one() -> None:
    kube = FakeKube({("Service", "a"): service()})
    assert asyncio.run(executor(kube).carry_out([Apply(service())], own=[("Service", "a")])) == []
    assert kube.calls == [("apply", "a")]
    kube.calls.clear()
    assert asyncio.run(executor(kube).carry_out([Apply(service())])) == []
    assert kube.calls == [("get", "a"), ("apply", "a")]  # the watch lags: it is ours, so it is applied


def test_pods_are_created_never_applied_and_a_taken_name_is_a_conflict() -> None:
    kube = FakeKube()
    assert asyncio.run(executor(kube).carry_out([Apply(pod())])) == []
    assert kube.calls == [("create", "a-engine-0")]
    # Created again (the watch lags): the pod is ours, no failure.
    assert asyncio.run(executor(kube).carry_out([Apply(pod())])) == []
    # A user's pod of that name: refused.
    user_pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "a-engine-0", "namespace": "ns"}}
    kube = FakeKube({("Pod", "a-engine-0"): user_pod})
    (failure,) = asyncio.run(executor(kube).carry_out([Apply(pod())]))
    assert failure.conflict
    assert kube.objects[("Pod", "a-engine-0")] is user_pod


def test_a_pod_terminating_past_its_grace_period_and_the_margin_is_stuck() -> None:
    now = datetime.datetime(2026, 1, 1, 0, 1, 0, tzinfo=datetime.UTC)
    pods = [Terminating("a-engine-0", "u0", "2026-01-01T00:00:20Z", "n"),  # 40 s past: stuck
            Terminating("a-engine-1", "u1", "2026-01-01T00:00:50Z", "n"),  # 10 s past: 20 s to go
            Terminating("a-engine-2", "u2", "2026-01-01T00:01:30Z", "n")]  # still in its grace period
    stuck, wait = stuck_terminations(pods, now, margin=30.0)
    assert [p.name for p in stuck] == ["a-engine-0"]
    assert wait == 20.0
    assert stuck_terminations([], now, 30.0) == ([], None)
