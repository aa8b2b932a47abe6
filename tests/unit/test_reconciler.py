# SPDX-License-Identifier: Apache-2.0
"""One reconcile pass against a fake API server (corefleet_operator/reconciler.py), with its clocks held
still: a refused action is an event and then a condition; a name the fleet does not control is never
written; a pod stuck terminating is force-deleted; the admin token survives a deleted Secret; a refused
status write stops the pass. (Moved from test_pending_creates.py with the code.)"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest

from corefleet_operator import builders, executor
from corefleet_operator.actions import Event
from corefleet_operator.executor import ActionFailure
from corefleet_operator.kube import KubeError
from corefleet_operator.models import EngineCoreSetStatus
from corefleet_operator.observe import FleetObs, FrontendObs, FrontendResize, RankObs, ResizeObs, Terminating, pod_obs
from corefleet_operator.planner import PlanSettings
from corefleet_operator.reconciler import (
    DEAF_SECONDS,
    MAX_BACKOFF_SECONDS,
    Backoff,
    FleetIndexes,
    FleetReconciler,
    with_action_failures,
)
from factories import make_ecs
from fakekube import QUOTA, FakeKube, refused
from virtualtime import FakeClock


def test_failures_become_the_degraded_condition_bounded() -> None:
    status = EngineCoreSetStatus.parse({})
    assert with_action_failures(status, [], 1, "2026-01-01T00:00:00Z") is status
    many = [ActionFailure(f"Pod a-engine-{i}", f"write refused (403): {QUOTA}") for i in range(9)]
    out = with_action_failures(status, many, 3, "2026-01-01T00:00:00Z")
    (degraded,) = [c for c in out.conditions if c.type == "Degraded"]
    assert (degraded.status, degraded.reason, degraded.observedGeneration) == ("True", "ActionsFailing", 3)
    assert degraded.message.startswith(f"Pod a-engine-0: write refused (403): {QUOTA}; Pod a-engine-1")
    assert degraded.message.endswith("(and 4 more)")
    conflict = with_action_failures(status, [ActionFailure("Service a", "taken", conflict=True)], 1, "t")
    assert [c.reason for c in conflict.conditions if c.type == "Degraded"] == ["ChildConflict"]


def test_a_failing_fleet_waits_twice_as_long_each_time_deaf_for_a_bounded_while() -> None:
    backoff = Backoff()
    assert [backoff.failed() for _ in range(8)] == [(1, 1), (2, 2), (4, 4), (8, DEAF_SECONDS), (16, DEAF_SECONDS),
                                                    (32, DEAF_SECONDS), (MAX_BACKOFF_SECONDS, DEAF_SECONDS),
                                                    (MAX_BACKOFF_SECONDS, DEAF_SECONDS)]
    backoff.succeeded()
    assert backoff.failed() == (1, 1)


# ---- one reconcile pass against a fake API server -------------------------------------------------
def ecs_body(name: str = "a", replicas: int = 1) -> dict[str, Any]:
    body = make_ecs(name).replicas(replicas).raw()
    body["metadata"]["namespace"] = "ns"
    return body


def indexes_for(pods: Sequence[dict[str, Any]] = (), objects: Sequence[dict[str, Any]] = (), uid: str = "",
                terminating: Sequence[Terminating] = ()) -> FleetIndexes:
    key = ("ns", "a", uid)
    obs = [pod_obs(p["metadata"]["name"], p["metadata"], p["spec"], p.get("status", {})) for p in pods]
    kinds = ("Service", "Secret", "NetworkPolicy", "PodDisruptionBudget")  # one index each
    by_kind: dict[str, dict[tuple[str, str, str], list[tuple[str, str, dict[str, Any]]]]] = {k: {} for k in kinds}
    for o in objects:
        by_kind[o["kind"]].setdefault(key, []).append((o["kind"], o["metadata"]["name"], o))
    return FleetIndexes(pods={key: obs}, terminating={key: list(terminating)},
                        objects=tuple(by_kind[k] for k in kinds))


@pytest.fixture
def posted() -> list[tuple[str, str]]:
    """The events the reconciler posts, as (reason, message)."""
    return []


def reconciler(kube: FakeKube, body: Mapping[str, Any], posted: list[tuple[str, str]],
               clock: FakeClock | None = None) -> FleetReconciler:
    def post(event: Event) -> None:
        posted.append((event.reason, event.message))
    return FleetReconciler(kube, body, settings=PlanSettings(), post=post,  # type: ignore[arg-type]
                           clock=clock or FakeClock())


def written_condition(rec: FleetReconciler, condition_type: str) -> dict[str, Any]:
    """A condition of the status the reconciler last wrote."""
    assert rec.written_status is not None
    condition: dict[str, Any] = next(c for c in rec.written_status["conditions"] if c["type"] == condition_type)
    return condition


def test_events_go_out_before_the_actions_and_a_refusal_is_an_event_then_a_condition(
        posted: list[tuple[str, str]]) -> None:
    body = ecs_body()
    kube = FakeKube(refuse={"a-engine-0": refused(403, QUOTA)})
    order: list[str] = []
    kube_create = kube.create

    async def create(obj: Mapping[str, Any]) -> dict[str, Any]:
        order.append(f"events so far: {[r for r, _ in posted]}")
        return await kube_create(obj)
    kube.create = create  # type: ignore[method-assign]
    rec = reconciler(kube, body, posted)

    asyncio.run(rec.reconcile(indexes_for(uid=body["metadata"]["uid"])))

    assert order[0] == "events so far: ['Creating']"  # the plan's event was posted before any action
    assert ("ActionFailed", f"Pod a-engine-0: write refused (403): {QUOTA}") in posted
    assert rec.failing
    # The next pass writes the failure into the status (the one status write) ...
    asyncio.run(rec.reconcile(indexes_for(uid=body["metadata"]["uid"])))
    degraded = written_condition(rec, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ActionsFailing")
    assert QUOTA in degraded["message"]
    assert [r for r, _ in posted].count("ActionFailed") == 1  # ... and posts no second event for the same refusal
    # Once the quota allows it, the failure and the condition go.
    kube.refuse.clear()
    asyncio.run(rec.reconcile(indexes_for(uid=body["metadata"]["uid"])))
    assert not rec.failing
    asyncio.run(rec.reconcile(indexes_for(uid=body["metadata"]["uid"])))
    degraded = written_condition(rec, "Degraded")
    assert degraded["reason"] != "ActionsFailing"


def test_children_of_another_uid_are_not_the_fleets(posted: list[tuple[str, str]]) -> None:
    """Pods labelled for fleet `a` but controlled by another EngineCoreSet `a` (deleted, being garbage-
    collected) are neither counted nor deleted: the fleet reads its own UID's entries only."""
    body = ecs_body()
    old = ecs_body()
    old["metadata"]["uid"] = "0ld-uid"
    old_pod = builders.engine_pod(make_ecs("a").obj(), 0, dp_size=1, frontend_address="f")
    old_pod["metadata"]["ownerReferences"][0]["uid"] = "0ld-uid"
    old_pod["metadata"]["uid"] = "p0"
    idx = indexes_for(pods=[old_pod], uid="0ld-uid")
    kube = FakeKube()
    asyncio.run(reconciler(kube, body, posted).reconcile(idx))
    assert ("delete", "a-engine-0") not in kube.calls


def test_a_deleted_admin_secret_comes_back_with_the_token_the_reconciler_saw(posted: list[tuple[str, str]]) -> None:
    body = ecs_body()
    uid = body["metadata"]["uid"]
    fleet = make_ecs("a").replicas(1).obj()
    secret = builders.admin_secret(fleet, "the-token")
    kube = FakeKube()
    rec = reconciler(kube, body, posted)
    asyncio.run(rec.reconcile(indexes_for(objects=[secret], uid=uid)))
    asyncio.run(rec.reconcile(indexes_for(objects=[], uid=uid)))  # the Secret was deleted

    written = kube.objects[("Secret", "a-admin")]
    assert written["data"] == secret["data"]


def running_fleet_pods(replicas: int = 1) -> list[dict[str, Any]]:
    """The pods of incarnation 1 of fleet `a`, every one Running and Ready."""
    fleet = make_ecs("a").replicas(replicas).obj()
    pods = [c for c in builders.fleet_children(fleet, dp_size=replicas, admin_token="t", fleet_generation=1)
            if c["kind"] == "Pod"]
    for i, p in enumerate(pods):
        p["metadata"]["uid"] = f"uid-{p['metadata']['name']}"
        p["spec"]["nodeName"] = "n"
        p["status"] = {"phase": "Running", "podIP": f"10.0.0.{i + 1}",
                       "conditions": [{"type": "Ready", "status": "True"}]}
    return pods


def test_an_operator_restart_with_the_admin_secret_gone_replaces_the_frontend(posted: list[tuple[str, str]]) -> None:
    body = ecs_body()
    uid = body["metadata"]["uid"]
    body["status"] = {"phase": "Running", "fleetGeneration": 1, "replicas": 1, "readyReplicas": 1}
    pods = running_fleet_pods()
    kube = FakeKube()
    rec = reconciler(kube, body, posted)  # a fresh operator: no token seen
    asyncio.run(rec.reconcile(indexes_for(pods=pods, uid=uid)))

    assert ("apply", "a-admin") in kube.calls
    assert kube.calls.index(("apply", "a-admin")) < kube.calls.index(("delete", "a-frontend"))
    assert [c for c in kube.calls if c[0] == "delete"] == [("delete", "a-frontend")]
    assert any(reason == "AdminTokenLost" for reason, _ in posted)
    # Once: the next pass (the Secret not yet seen by the watch) deletes nothing more of its own.
    kube.calls.clear()
    asyncio.run(rec.reconcile(indexes_for(pods=pods, uid=uid)))
    assert [r for r, _ in posted].count("AdminTokenLost") == 1


def test_a_running_fleet_whose_secret_is_seen_keeps_its_frontend(posted: list[tuple[str, str]]) -> None:
    body = ecs_body()
    uid = body["metadata"]["uid"]
    body["status"] = {"phase": "Running", "fleetGeneration": 1, "replicas": 1, "readyReplicas": 1}
    secret = builders.admin_secret(make_ecs("a").replicas(1).obj(), "t")
    kube = FakeKube()
    asyncio.run(reconciler(kube, body, posted).reconcile(
        indexes_for(pods=running_fleet_pods(), objects=[secret], uid=uid)))
    assert not [c for c in kube.calls if c[0] == "delete"]
    assert "AdminTokenLost" not in [r for r, _ in posted]


def test_a_stuck_terminating_pod_is_force_deleted_with_an_event(posted: list[tuple[str, str]]) -> None:
    body = ecs_body()
    uid = body["metadata"]["uid"]
    clock = FakeClock()

    def at(seconds: float) -> str:
        return (clock.now() + datetime.timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")
    idx = indexes_for(uid=uid, terminating=[Terminating("a-engine-0", "u0", at(-120), "lost-node"),
                                            Terminating("a-engine-1", "u1", at(10), "n")])
    kube = FakeKube()
    requeue = asyncio.run(reconciler(kube, body, posted, clock).reconcile(idx))

    assert [c for c in kube.calls if c[0].startswith("delete")] == [("delete/0", "a-engine-0")]
    (message,) = [m for r, m in posted if r == "ForceDeleted"]
    assert "a-engine-0" in message
    assert "lost-node" in message
    assert requeue == 10 + executor.STUCK_TERMINATION_SECONDS  # looked at again when a-engine-1 is due


def test_a_refused_status_write_is_an_event_once_and_nothing_is_done_without_it(
        posted: list[tuple[str, str]]) -> None:
    body = ecs_body()
    kube = FakeKube()

    async def too_large(namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        raise KubeError("PATCH", "/status", 413, json.dumps({"message": "Request entity too large"}))
    kube.patch_status = too_large  # type: ignore[method-assign]
    rec = reconciler(kube, body, posted)
    for _ in range(3):
        with pytest.raises(KubeError):
            asyncio.run(rec.reconcile(indexes_for(uid=body["metadata"]["uid"])))

    shown = [m for r, m in posted if r == "StatusWriteFailed"]
    assert shown == ["status write refused (413): Request entity too large"]
    assert kube.calls == []  # no child written while the fleet's memory cannot be


def test_ready_timeout_is_not_repeated_on_every_pass_while_actions_fail(posted: list[tuple[str, str]]) -> None:
    body = make_ecs("a").replicas(1).set("scaling.readyTimeoutSeconds", 60).raw()
    body["metadata"]["namespace"] = "ns"
    uid = body["metadata"]["uid"]
    long_ago = "2020-01-01T00:00:00Z"
    body["status"] = {"phase": "Starting", "fleetGeneration": 1, "replicas": 1, "observedGeneration": 1,
                      "conditions": [{"type": "Progressing", "status": "True", "reason": "CreatingPods",
                                      "message": "", "lastTransitionTime": long_ago, "observedGeneration": 1}]}
    kube = FakeKube(refuse={n: refused(403, QUOTA) for n in ("a-coordinator", "a-frontend", "a-engine-0")})
    rec = reconciler(kube, body, posted)
    for _ in range(4):
        asyncio.run(rec.reconcile(indexes_for(uid=uid)))
    assert [r for r, _ in posted].count("ReadyTimeout") <= 1
    kube.refuse.clear()
    for _ in range(3):
        asyncio.run(rec.reconcile(indexes_for(uid=uid)))
    assert [r for r, _ in posted].count("ReadyTimeout") <= 2


class CountingFrontend:
    """The frontend's admin API as the reconciler asks it: every rank Serving; counts the reads of its view."""

    def __init__(self) -> None:
        self.reads = 0

    async def fleet(self, pod: Any, token: str) -> FleetObs:
        self.reads += 1
        return FleetObs(reachable=True, ranks={r: RankObs(r, "Serving") for r in range(2)})

    async def observe(self, pod: Any, token: str, resize_id: str) -> FrontendObs:
        return FrontendObs(reachable=True)

    async def start(self, pod: Any, token: str, action: Any) -> None:
        pass

    async def cancel(self, pod: Any, token: str, action: Any) -> None:
        pass


def serving_two_ranks(posted: list[tuple[str, str]], frontend: CountingFrontend) -> tuple[
        FleetReconciler, dict[str, Any], list[dict[str, Any]], Callable[[list[dict[str, Any]]], None]]:
    """A reconciler of a 2-rank fleet that serves, asking `frontend`: (it, the body, the pods, one pass with pods)."""
    body = ecs_body(replicas=2)
    uid = body["metadata"]["uid"]
    body["status"] = {"phase": "Running", "fleetGeneration": 1, "replicas": 2, "readyReplicas": 2}
    secret = builders.admin_secret(make_ecs("a").replicas(2).obj(), "t")
    rec = reconciler(FakeKube(), body, posted)
    rec.frontend = frontend  # type: ignore[assignment]

    def reconcile(with_pods: list[dict[str, Any]]) -> None:
        asyncio.run(rec.reconcile(indexes_for(pods=with_pods, objects=[secret], uid=uid)))

    return rec, body, running_fleet_pods(2), reconcile


def test_an_engine_pod_newly_being_removed_is_checked_with_the_frontend_at_once(posted: list[tuple[str, str]]) -> None:
    """The frontend's view of the ranks is read at most every FRONTEND_POLL_SECONDS, except once for each engine pod
    that starts terminating: whether its rank still serves decides between a drain and a loss."""
    frontend = CountingFrontend()
    _, _, pods, reconcile = serving_two_ranks(posted, frontend)

    reconcile(pods)
    reconcile(pods)
    assert frontend.reads == 1  # rate-limited
    evicted = copy.deepcopy(pods)
    next(p for p in evicted if p["metadata"]["name"] == "a-engine-1")["metadata"]["deletionTimestamp"] = \
        "2026-01-01T00:00:00Z"
    reconcile(evicted)
    assert frontend.reads == 2  # at once
    reconcile(evicted)
    assert frontend.reads == 2  # once per pod


class ResizingFrontend(CountingFrontend):
    """A frontend that runs a scale-down 2 -> 1 (`resizing`), reported in its view of the fleet; records the resizes
    it is asked to start."""

    def __init__(self) -> None:
        super().__init__()
        self.resizing = False
        self.starts: list[str] = []

    async def fleet(self, pod: Any, token: str) -> FleetObs:
        view = await super().fleet(pod, token)
        if not self.resizing:
            return view
        account = ResizeObs(id="2to1-g1-earlier", phase="Draining", ranks={1: ("Draining", "")}, message="draining")
        return dataclasses.replace(view, size=2, resize=FrontendResize(from_replicas=2, to_replicas=1, replace=(),
                                                                          account=account))

    async def start(self, pod: Any, token: str, action: Any) -> None:
        self.starts.append(action.resize_id)


def test_after_a_lost_status_the_next_pass_reads_what_the_frontend_runs(posted: list[tuple[str, str]]) -> None:
    """The frontend's view is rate-limited, but the pass after a lost status is adopted reads it at once: a resize
    the frontend runs is followed, not answered with another one (the frontend would refuse it)."""
    frontend = ResizingFrontend()
    rec, body, pods, reconcile_with = serving_two_ranks(posted, frontend)

    def reconcile() -> None:
        reconcile_with(pods)

    reconcile()
    assert frontend.reads == 1
    # A scale-down started, then the status was wiped (an etcd restore) before the operator followed it.
    frontend.resizing = True
    wiped = copy.deepcopy(body)
    wiped["spec"]["replicas"] = 1
    wiped["metadata"]["generation"] = 2
    wiped["metadata"]["resourceVersion"] = "wiped"
    wiped["status"] = {}
    rec.body = wiped

    reconcile()  # the pods adopted
    assert [r for r, _ in posted].count("StatusLost") == 1
    reconcile()  # within the view's rate limit: read all the same

    assert frontend.reads == 2
    assert ("ResizeAdopted", "resize 2to1-g1-earlier (2 -> 1) runs on the frontend and the status does not record it "
                             "(lost?): followed as the operation in flight") in posted
    assert frontend.starts == []
    assert rec.written_status is not None
    assert rec.written_status["operation"]["id"] == "2to1-g1-earlier"
