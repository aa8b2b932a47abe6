# SPDX-License-Identifier: Apache-2.0
"""The reconciler's own memory and its actions against the API server (handlers/fleet.py), with a fake
API server: a pod it just created is not applied again before the watch shows it; a refused action is an
event and then a condition; a name the fleet does not control is never written; a pod stuck terminating
is force-deleted; the admin token survives a deleted Secret."""

from __future__ import annotations

import asyncio
import datetime
import json
from collections.abc import Mapping
from typing import Any

import pytest

from corefleet_operator import builders
from corefleet_operator.actions import Apply, Delete
from corefleet_operator.handlers import fleet as fleet_handlers
from corefleet_operator.handlers.fleet import (
    EXPECTATION_SECONDS,
    ActionFailure,
    FleetReconciler,
    PendingCreates,
    Terminating,
    carry_out,
    stuck_terminations,
    with_action_failures,
)
from corefleet_operator.kube import KubeError
from corefleet_operator.observe import pod_obs
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


# ---- failed actions, name conflicts, stuck terminations, the admin token (issue #9) --------------
QUOTA = 'pods "a-engine-0" is forbidden: exceeded quota: q, requested: pods=1, used: pods=0, limited: pods=0'


def refused(status: int, message: str) -> KubeError:
    return KubeError("POST", "/api/v1/namespaces/ns/pods", status, json.dumps({"message": message}))


class FakeKube:
    """The Kube verbs the reconciler uses, against a dict of objects; records every call in order."""

    def __init__(self, objects: dict[tuple[str, str], dict[str, Any]] | None = None,
                 refuse: Mapping[str, KubeError] | None = None) -> None:
        self.objects = objects or {}
        self.refuse = dict(refuse or {})  # object name -> the error its write gets
        self.calls: list[tuple[str, str]] = []

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        name = obj["metadata"]["name"]
        self.calls.append(("create", name))
        if name in self.refuse:
            raise self.refuse[name]
        if (obj["kind"], name) in self.objects:
            raise KubeError("POST", "/x", 409, json.dumps({"message": f"{name} already exists"}))
        self.objects[(obj["kind"], name)] = dict(obj)
        return dict(obj)

    async def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        name = obj["metadata"]["name"]
        self.calls.append(("apply", name))
        if name in self.refuse:
            raise self.refuse[name]
        self.objects[(obj["kind"], name)] = dict(obj)
        return dict(obj)

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append(("get", name))
        return self.objects.get((kind, name))

    async def delete(self, api_version: str, kind: str, namespace: str, name: str, uid: str, *,
                     grace_period_seconds: int | None = None) -> bool:
        self.calls.append(("delete" if grace_period_seconds is None else f"delete/{grace_period_seconds}", name))
        return self.objects.pop((kind, name), None) is not None

    async def patch_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        self.calls.append(("status", name))
        return {}


def foreign_service(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "ns", "uid": "u1"},
            "spec": {"ports": [{"port": 80}]}}


def service(name: str = "a") -> dict[str, Any]:
    return builders.frontend_service(make_ecs("a").obj())


def test_a_refused_action_is_a_failure_and_the_other_actions_still_run() -> None:
    kube = FakeKube(refuse={"a-engine-0": refused(403, QUOTA)})
    svc = service()
    failures = asyncio.run(carry_out(kube, "ns", [Apply(pod()), Apply(svc)],  # type: ignore[arg-type]
                                     fleet_uid=make_ecs("a").uid))

    assert failures == [ActionFailure("Pod a-engine-0", f"write refused (403): {QUOTA}")]
    assert ("apply", "a") in kube.calls


def test_a_foreign_object_of_a_childs_name_is_never_written() -> None:
    kube = FakeKube({("Service", "a"): foreign_service("a")})
    failures = asyncio.run(carry_out(kube, "ns", [Apply(service())], fleet_uid=make_ecs("a").uid))  # type: ignore[arg-type]

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
    failures = asyncio.run(carry_out(kube, "ns", [Apply(mine)], fleet_uid=make_ecs("x-fleet").uid))  # type: ignore[arg-type]

    assert [(f.target, f.conflict) for f in failures] == [("Service x-fleet", True)]
    assert "controlled by EngineCoreSet x," in failures[0].message
    assert kube.objects[("Service", "x-fleet")] is other


def test_own_children_are_applied_without_a_read_and_unobserved_own_ones_after_one() -> None:
    uid = make_ecs("a").uid
    kube = FakeKube({("Service", "a"): service()})
    assert asyncio.run(carry_out(kube, "ns", [Apply(service())], fleet_uid=uid,  # type: ignore[arg-type]
                                 own=[("Service", "a")])) == []
    assert kube.calls == [("apply", "a")]
    kube.calls.clear()
    assert asyncio.run(carry_out(kube, "ns", [Apply(service())], fleet_uid=uid)) == []  # type: ignore[arg-type]
    assert kube.calls == [("get", "a"), ("apply", "a")]  # the watch lags: it is ours, so it is applied


def test_pods_are_created_never_applied_and_a_taken_name_is_a_conflict() -> None:
    uid = make_ecs("a").uid
    kube = FakeKube()
    assert asyncio.run(carry_out(kube, "ns", [Apply(pod())], fleet_uid=uid)) == []  # type: ignore[arg-type]
    assert kube.calls == [("create", "a-engine-0")]
    # Created again (the watch lags): the pod is ours, no failure.
    assert asyncio.run(carry_out(kube, "ns", [Apply(pod())], fleet_uid=uid)) == []  # type: ignore[arg-type]
    # A user's pod of that name: refused.
    user_pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "a-engine-0", "namespace": "ns"}}
    kube = FakeKube({("Pod", "a-engine-0"): user_pod})
    (failure,) = asyncio.run(carry_out(kube, "ns", [Apply(pod())], fleet_uid=uid))  # type: ignore[arg-type]
    assert failure.conflict
    assert kube.objects[("Pod", "a-engine-0")] is user_pod


def test_failures_become_the_degraded_condition_bounded() -> None:
    from corefleet_operator.models import EngineCoreSetStatus

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


def test_a_pod_terminating_past_its_grace_period_and_the_margin_is_stuck() -> None:
    now = datetime.datetime(2026, 1, 1, 0, 1, 0, tzinfo=datetime.UTC)
    pods = [Terminating("a-engine-0", "u0", "2026-01-01T00:00:20Z", "n"),  # 40 s past: stuck
            Terminating("a-engine-1", "u1", "2026-01-01T00:00:50Z", "n"),  # 10 s past: 20 s to go
            Terminating("a-engine-2", "u2", "2026-01-01T00:01:30Z", "n")]  # still in its grace period
    stuck, wait = stuck_terminations(pods, now, margin=30.0)
    assert [p.name for p in stuck] == ["a-engine-0"]
    assert wait == 20.0
    assert stuck_terminations([], now, 30.0) == ([], None)


# ---- one reconcile pass against a fake API server -------------------------------------------------
def ecs_body(name: str = "a", replicas: int = 1) -> dict[str, Any]:
    body = make_ecs(name).replicas(replicas).raw()
    body["metadata"]["namespace"] = "ns"
    return body


def indexes_for(pods: list[dict[str, Any]] = (), objects: list[dict[str, Any]] = (),  # type: ignore[assignment]
                uid: str = "") -> dict[str, Any]:
    key = ("ns", "a", uid)
    obs = [pod_obs(p["metadata"]["name"], p["metadata"], p["spec"], p.get("status", {})) for p in pods]
    by_kind = {"Service": "fleet_services", "Secret": "fleet_secrets", "NetworkPolicy": "fleet_netpols",
               "PodDisruptionBudget": "fleet_pdbs"}
    idx: dict[str, Any] = {name: {} for name in fleet_handlers.INDEXES}
    idx["fleet_pods"] = {key: obs}
    for o in objects:
        idx[by_kind[o["kind"]]].setdefault(key, []).append((o["kind"], o["metadata"]["name"], o))
    return idx


@pytest.fixture
def posted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    events: list[tuple[str, str]] = []
    monkeypatch.setattr(fleet_handlers.kopf, "event",
                        lambda body, *, type, reason, message: events.append((reason, message)))
    return events


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
    reconciler = FleetReconciler(kube, body)  # type: ignore[arg-type]

    asyncio.run(reconciler.reconcile(indexes_for(uid=body["metadata"]["uid"])))

    assert order[0] == "events so far: ['Creating']"  # the plan's event was posted before any action
    assert ("ActionFailed", f"Pod a-engine-0: write refused (403): {QUOTA}") in posted
    assert reconciler.failing
    # The next pass writes the failure into the status (the one status write) ...
    asyncio.run(reconciler.reconcile(indexes_for(uid=body["metadata"]["uid"])))
    degraded = next(c for c in reconciler.written_status["conditions"] if c["type"] == "Degraded")  # type: ignore[index]
    assert (degraded["status"], degraded["reason"]) == ("True", "ActionsFailing")
    assert QUOTA in degraded["message"]
    assert [r for r, _ in posted].count("ActionFailed") == 1  # ... and posts no second event for the same refusal
    # Once the quota allows it, the failure and the condition go.
    kube.refuse.clear()
    asyncio.run(reconciler.reconcile(indexes_for(uid=body["metadata"]["uid"])))
    assert not reconciler.failing
    asyncio.run(reconciler.reconcile(indexes_for(uid=body["metadata"]["uid"])))
    degraded = next(c for c in reconciler.written_status["conditions"] if c["type"] == "Degraded")  # type: ignore[index]
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
    asyncio.run(FleetReconciler(kube, body).reconcile(idx))  # type: ignore[arg-type]
    assert ("delete", "a-engine-0") not in kube.calls


def test_a_deleted_admin_secret_comes_back_with_the_token_the_reconciler_saw(posted: list[tuple[str, str]]) -> None:
    body = ecs_body()
    uid = body["metadata"]["uid"]
    fleet = make_ecs("a").replicas(1).obj()
    secret = builders.admin_secret(fleet, "the-token")
    kube = FakeKube()
    reconciler = FleetReconciler(kube, body)  # type: ignore[arg-type]
    asyncio.run(reconciler.reconcile(indexes_for(objects=[secret], uid=uid)))
    asyncio.run(reconciler.reconcile(indexes_for(objects=[], uid=uid)))  # the Secret was deleted

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
    reconciler = FleetReconciler(kube, body)  # type: ignore[arg-type]  # a fresh operator: no token seen
    asyncio.run(reconciler.reconcile(indexes_for(pods=pods, uid=uid)))

    assert ("apply", "a-admin") in kube.calls
    assert kube.calls.index(("apply", "a-admin")) < kube.calls.index(("delete", "a-frontend"))
    assert [c for c in kube.calls if c[0] == "delete"] == [("delete", "a-frontend")]
    assert any(reason == "AdminTokenLost" for reason, _ in posted)
    # Once: the next pass (the Secret not yet seen by the watch) deletes nothing more of its own.
    kube.calls.clear()
    asyncio.run(reconciler.reconcile(indexes_for(pods=pods, uid=uid)))
    assert [r for r, _ in posted].count("AdminTokenLost") == 1


def test_a_running_fleet_whose_secret_is_seen_keeps_its_frontend(posted: list[tuple[str, str]]) -> None:
    body = ecs_body()
    uid = body["metadata"]["uid"]
    body["status"] = {"phase": "Running", "fleetGeneration": 1, "replicas": 1, "readyReplicas": 1}
    secret = builders.admin_secret(make_ecs("a").replicas(1).obj(), "t")
    kube = FakeKube()
    asyncio.run(FleetReconciler(kube, body).reconcile(  # type: ignore[arg-type]
        indexes_for(pods=running_fleet_pods(), objects=[secret], uid=uid)))
    assert not [c for c in kube.calls if c[0] == "delete"]
    assert "AdminTokenLost" not in [r for r, _ in posted]


def test_a_stuck_terminating_pod_is_force_deleted_with_an_event(posted: list[tuple[str, str]],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    body = ecs_body()
    uid = body["metadata"]["uid"]
    idx = indexes_for(uid=uid)
    long_ago = (datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=120)).strftime("%Y-%m-%dT%H:%M:%SZ")
    soon = (datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=10)).strftime("%Y-%m-%dT%H:%M:%SZ")
    idx["fleet_terminating"] = {("ns", "a", uid): [Terminating("a-engine-0", "u0", long_ago, "lost-node"),
                                                   Terminating("a-engine-1", "u1", soon, "n")]}
    kube = FakeKube()
    requeue = asyncio.run(FleetReconciler(kube, body).reconcile(idx))  # type: ignore[arg-type]

    assert [c for c in kube.calls if c[0].startswith("delete")] == [("delete/0", "a-engine-0")]
    (message,) = [m for r, m in posted if r == "ForceDeleted"]
    assert "a-engine-0" in message
    assert "lost-node" in message
    assert requeue is not None
    assert requeue <= 10 + fleet_handlers.STUCK_TERMINATION_SECONDS  # looked at again when a-engine-1 is due


def test_a_failing_reconcile_ignores_wakeups_for_a_while() -> None:
    async def scenario() -> float:
        wake = asyncio.Event()
        stopped = asyncio.Event()
        wake.set()  # woken at once
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await fleet_handlers._sleep(wake, stopped, 10.0, deaf=0.3)  # type: ignore[arg-type]
        return loop.time() - t0

    took = asyncio.run(scenario())
    assert 0.3 <= took < 2.0


def test_a_refused_status_write_is_an_event_once_and_nothing_is_done_without_it(
        posted: list[tuple[str, str]]) -> None:
    body = ecs_body()
    kube = FakeKube()

    async def too_large(namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        raise KubeError("PATCH", "/status", 413, json.dumps({"message": "Request entity too large"}))
    kube.patch_status = too_large  # type: ignore[method-assign]
    reconciler = FleetReconciler(kube, body)  # type: ignore[arg-type]
    for _ in range(3):
        with pytest.raises(KubeError):
            asyncio.run(reconciler.reconcile(indexes_for(uid=body["metadata"]["uid"])))

    shown = [m for r, m in posted if r == "StatusWriteFailed"]
    assert shown == ["status write refused (413): Request entity too large"]
    assert kube.calls == []  # no child written while the fleet's memory cannot be


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


def test_a_fleet_whose_actions_keep_failing_does_not_reconcile_on_every_wakeup(
        posted: list[tuple[str, str]]) -> None:
    """Its pods' creation refused (a quota), woken every 50 ms (its children's events): it retries on
    a doubling timer, deaf to wake-ups meanwhile, not on each of them."""
    body = ecs_body()
    kube = FakeKube(refuse={n: refused(403, QUOTA) for n in ("a-coordinator", "a-frontend", "a-engine-0")})
    idx = indexes_for(uid=body["metadata"]["uid"])

    class Memo:
        wakeups: dict[tuple[str, str], asyncio.Event] = {}
        resync_seconds = 60.0

    memo = Memo()
    memo.kube = kube  # type: ignore[attr-defined]

    async def scenario() -> int:
        stopped = Stopped()
        daemon = asyncio.create_task(fleet_handlers.fleet(  # type: ignore[call-arg]
            body=body, name="a", namespace="ns", memo=memo, stopped=stopped,
            logger=fleet_handlers.logger, **idx))
        loop = asyncio.get_running_loop()
        end = loop.time() + 2.5
        while loop.time() < end:
            if ("ns", "a") in memo.wakeups:
                memo.wakeups[("ns", "a")].set()
            await asyncio.sleep(0.05)
        stopped.set()
        await asyncio.wait_for(daemon, 5)
        return sum(1 for verb, name in kube.calls if name == "a-coordinator" and verb in ("create", "apply"))

    attempts = asyncio.run(scenario())
    assert 2 <= attempts <= 3  # at 0 s, ~1 s, ~3 s (deaf for 1 s, then 2 s): not ~50 times


def test_ready_timeout_is_not_repeated_on_every_pass_while_actions_fail(posted: list[tuple[str, str]]) -> None:
    body = make_ecs("a").replicas(1).set("scaling.readyTimeoutSeconds", 60).raw()
    body["metadata"]["namespace"] = "ns"
    uid = body["metadata"]["uid"]
    long_ago = "2020-01-01T00:00:00Z"
    body["status"] = {"phase": "Starting", "fleetGeneration": 1, "replicas": 1, "observedGeneration": 1,
                      "conditions": [{"type": "Progressing", "status": "True", "reason": "CreatingPods",
                                      "message": "", "lastTransitionTime": long_ago, "observedGeneration": 1}]}
    kube = FakeKube(refuse={n: refused(403, QUOTA) for n in ("a-coordinator", "a-frontend", "a-engine-0")})
    reconciler = FleetReconciler(kube, body)  # type: ignore[arg-type]
    for _ in range(4):
        asyncio.run(reconciler.reconcile(indexes_for(uid=uid)))
    assert [r for r, _ in posted].count("ReadyTimeout") <= 1
    kube.refuse.clear()
    for _ in range(3):
        asyncio.run(reconciler.reconcile(indexes_for(uid=uid)))
    assert [r for r, _ in posted].count("ReadyTimeout") <= 2
