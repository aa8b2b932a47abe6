# SPDX-License-Identifier: Apache-2.0
"""The pure planner, walked through whole sequences against a simulated cluster and frontend.

`World` plays the API server, scheduler, kubelet and the fleet's frontend: it carries out the
planner's actions (apply, delete by UID, start or cancel a resize), schedules and starts pods one
step later, finishes deletions one step after that, stores the status the planner returns, and
moves resize operations on as the frontend would (new ranks join once their pods are ready, leaving
ranks drain for a step, then retire). A step is one reconcile and one second of the clock.
Invariants are checked after every step.
"""

from __future__ import annotations

import datetime
import random
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from corefleet_operator import builders, constants
from corefleet_operator.models import EngineCoreSetSpec, EngineCoreSetStatus, FleetRef, SpecError
from corefleet_operator.observe import FrontendObs, Observed, PodObs, ResizeObs
from corefleet_operator.planner import (
    RESIZE_RETRY_SECONDS,
    Apply,
    CancelResize,
    Delete,
    Plan,
    StartResize,
    is_subset,
    plan,
    plan_invalid,
)
from factories import make_ecs

T0 = datetime.datetime(2026, 11, 29, 12, 0, 0, tzinfo=datetime.UTC)
NOW = "2026-11-29T12:00:00Z"


@dataclass
class Op:
    """A resize as the simulated frontend holds it."""

    id: str
    frm: int
    to: int
    phase: str = "Pending"
    ranks: dict[int, tuple[str, str]] = field(default_factory=dict)
    error: str = ""
    intact: bool = True
    age: int = 0
    cancel: str = ""

    def obs(self) -> ResizeObs:
        return ResizeObs(id=self.id, phase=self.phase, ranks=dict(self.ranks), message=self.phase.lower(),
                         error=self.error, fleet_intact=self.intact)


@dataclass
class Frontend:
    """The frontend's resize operations (they live as long as its pod: a new frontend knows none)."""

    uid: str = ""
    size: int = 0
    ops: dict[str, Op] = field(default_factory=dict)
    reachable: bool = True
    join_steps: int = 20  # a new rank that is not ready by then fails the resize
    refuse: str = ""  # the next StartResize is refused with this
    refuse_seen: dict[str, str] = field(default_factory=dict)  # resize id -> why it was refused
    started: int = 0  # StartResize calls that started an operation

    def running(self) -> list[Op]:
        return [o for o in self.ops.values() if o.phase not in ("Completed", "Failed")]


@dataclass
class World:
    fleet: FleetRef
    status: EngineCoreSetStatus = field(default_factory=EngineCoreSetStatus)
    pods: dict[str, PodObs] = field(default_factory=dict)
    objects: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    generation: int = 1
    writes: int = 0
    log: list[Plan] = field(default_factory=list)
    frontend: Frontend = field(default_factory=Frontend)
    clock: int = 0  # seconds since T0
    drop_actions: bool = False  # the operator dies after writing the status, before acting
    built_size: dict[str, int] = field(default_factory=dict)  # pod -> the data-parallel size it was built for

    @property
    def now(self) -> str:
        return (T0 + datetime.timedelta(seconds=self.clock)).strftime("%Y-%m-%dT%H:%M:%SZ")

    def observed(self) -> Observed:
        obs = Observed(generation=self.generation, status=self.status, pods=tuple(self.pods.values()),
                       objects=dict(self.objects), admin_token="token")
        op = self.status.operation
        if op is not None and not op.done:
            frontend = self.frontend_pod()
            if frontend is None or not self.frontend.reachable:
                seen = FrontendObs(reachable=False, error="connection refused")
            elif op.id in self.frontend.ops:
                seen = FrontendObs(reachable=True, resize=self.frontend.ops[op.id].obs())
            else:
                seen = FrontendObs(reachable=True, refused=self.frontend.refuse_seen.get(op.id, ""))
            obs = replace(obs, frontend=seen)
        return obs

    def frontend_pod(self) -> PodObs | None:
        p = self.pods.get(f"{self.fleet.name}-frontend")
        if p is None or p.terminating or p.phase != "Running" or p.fleet_generation != self.status.fleetGeneration:
            return None
        return p

    # ---- the frontend ---------------------------------------------------------------------------
    def start_resize(self, a: StartResize) -> None:
        f = self.frontend
        if self.frontend_pod() is None or not f.reachable:
            return
        if a.resize_id in f.ops:
            return  # idempotent
        if f.refuse:
            f.refuse_seen[a.resize_id] = f.refuse
            f.refuse = ""
            return
        assert not f.running(), f"a second resize started while {f.running()[0].id} runs"
        op = Op(a.resize_id, f.size, a.replicas)
        if op.to > op.frm:
            op.ranks = {r: ("Joining", "") for r in range(op.frm, op.to)}
        else:
            op.ranks = {r: ("Serving", "") for r in range(op.to, op.frm)}
        if op.to == op.frm:
            op.phase = "Completed"
        f.ops[op.id] = op
        f.started += 1

    def frontend_step(self) -> None:
        f = self.frontend
        pod = self.frontend_pod()
        if pod is None or pod.uid != f.uid:  # a new frontend process: it knows only its built size
            f.ops.clear()
            f.uid = pod.uid if pod is not None else ""
            f.size = self.built_size.get(f"{self.fleet.name}-frontend", 0) if pod is not None else 0
            return
        for op in f.running():
            op.age += 1
            if op.to > op.frm:
                if op.cancel:
                    op.phase, op.error = "Failed", f"cancelled: {op.cancel}"
                    op.ranks = {r: ("Failed", op.error) for r in op.ranks}
                    continue
                op.phase = "Preparing"
                new = [self.pods.get(f"{self.fleet.name}-engine-{r}") for r in range(op.frm, op.to)]
                if op.age >= 3 and all(p is not None and p.ready and not p.terminating for p in new):
                    op.phase, f.size = "Completed", op.to
                    op.ranks = {r: ("Serving", "") for r in op.ranks}
                elif op.age > f.join_steps:
                    op.phase, op.error = "Failed", "did not join within the join timeout"
                    op.ranks = {r: ("Failed", op.error) for r in op.ranks}
            elif op.phase in ("Pending", "Preparing"):
                op.phase = "Draining"
                op.ranks = {r: ("Draining", "") for r in op.ranks}
            elif op.age < 3:
                pass  # their requests are finishing
            else:
                op.phase, f.size = "Completed", op.to
                op.ranks = {r: ("Retired", "") for r in op.ranks}

    # ---- the API server, scheduler and kubelet ---------------------------------------------------
    def kubelet(self) -> None:
        """One step of the scheduler and kubelet: bind, start, and finish deletions."""
        for name, p in list(self.pods.items()):
            if p.terminating:
                del self.pods[name]
            elif not p.node and not p.message:
                self.pods[name] = replace(p, node="gpu-node-0")
            elif p.node and p.phase == "Pending":
                self.pods[name] = replace(p, phase="Running", ready=True, ip="10.0.0.1")

    def step(self) -> Plan:
        before = self.observed()
        p = plan(self.fleet, before, self.now)
        self.log.append(p)
        check_invariants(self, before, p)
        if p.status != self.status:
            self.writes += 1
            self.status = p.status
        if self.drop_actions:
            self.drop_actions = False
        else:
            for a in p.actions:
                self.act(a)
        self.kubelet()
        self.frontend_step()
        self.clock += 1
        return p

    def act(self, a: Any) -> None:
        self.writes += 1
        if isinstance(a, Apply):
            obj = a.obj
            if obj["kind"] == "Pod":
                meta = obj["metadata"]
                if meta["name"] not in self.pods:
                    args = obj["spec"]["containers"][0]["args"]
                    size = next((int(args[i + 1]) for i, x in enumerate(args)
                                 if x in ("--data-parallel-size", "--engine-count")), 0)
                    self.built_size[meta["name"]] = size
                    self.pods[meta["name"]] = PodObs(
                        name=meta["name"], uid=str(uuid.uuid4()), role=meta["labels"][constants.LABEL_ROLE],
                        rank=int(meta["labels"][constants.LABEL_RANK]) if constants.LABEL_RANK in meta["labels"]
                        else None,
                        spec_hash=meta["annotations"][constants.ANNOTATION_SPEC_HASH],
                        fleet_generation=int(meta["annotations"][constants.ANNOTATION_GENERATION]))
            else:
                self.objects[a.key] = {**obj, "metadata": {**obj["metadata"], "uid": str(uuid.uuid4())}}
        elif isinstance(a, Delete):
            if a.kind == "Pod":
                pod = self.pods.get(a.name)
                if pod is not None and pod.uid == a.uid:
                    self.pods[a.name] = replace(pod, terminating=True)
            else:
                self.objects.pop((a.kind, a.name), None)
        elif isinstance(a, StartResize):
            self.start_resize(a)
        elif isinstance(a, CancelResize):
            op = self.frontend.ops.get(a.resize_id)
            if op is not None and self.frontend_pod() is not None and op.phase in ("Pending", "Preparing"):
                op.cancel = a.reason

    def converge(self, max_steps: int = 60, tick: int = 1) -> None:
        for _ in range(max_steps):
            p = self.step()
            self.clock += tick - 1
            if not p.actions and self.status.phase in ("Running", "Stopped") and p.status == self.status \
                    and self.status.replicas == self.fleet.spec.replicas:
                quiet = plan(self.fleet, self.observed(), self.now)
                if not quiet.actions and quiet.status == self.status:
                    return
        raise AssertionError(f"did not converge: phase {self.status.phase}, replicas {self.status.replicas}, "
                             f"operation {self.status.operation}, pods {sorted(self.pods)}")

    def set_spec(self, spec: EngineCoreSetSpec) -> None:
        self.fleet = replace(self.fleet, spec=spec)
        self.generation += 1

    def scale(self, n: int) -> None:
        self.set_spec(replace(self.fleet.spec, replicas=n))

    def fail(self, name: str, message: str = "container engine exited with 137 (OOMKilled)") -> None:
        self.pods[name] = replace(self.pods[name], phase="Failed", ready=False, message=message)

    def engines(self) -> list[str]:
        return sorted(n for n, p in self.pods.items() if p.role == constants.ROLE_ENGINE)

    def events(self, reason: str) -> list[str]:
        return [e.message for p in self.log for e in p.events if e.reason == reason]


def check_invariants(world: World, before: Observed, p: Plan) -> None:
    old, new = before.status, p.status
    deleted = {a.name for a in p.actions if isinstance(a, Delete) and a.kind == "Pod"}
    created = [a.obj for a in p.actions if isinstance(a, Apply) and a.obj["kind"] == "Pod"]
    gen = new.fleetGeneration
    spec = world.fleet.spec
    # Pods are created only for the current incarnation and never twice; a new incarnation's only
    # once no other pod is left.
    for obj in created:
        assert int(obj["metadata"]["annotations"][constants.ANNOTATION_GENERATION]) == gen
        assert obj["metadata"]["name"] not in {q.name for q in before.pods}
    if created and gen != old.fleetGeneration:
        assert not deleted
    # A pod of the current incarnation and configuration is deleted only when its rank was retired
    # (or never joined) by a resize the frontend reported, or when the fleet stops.
    want_hash = builders.fleet_config_hash(spec)
    op_seen = before.frontend.resize if before.frontend is not None else None
    for q in before.pods:
        if q.name not in deleted or q.fleet_generation != gen or q.spec_hash != want_hash:
            continue
        if new.replicas == 0:
            continue
        assert q.rank is not None, f"deleted {q.name}"
        assert q.rank >= new.replicas, f"deleted member {q.name}"
        retired = op_seen is not None and op_seen.ranks.get(q.rank, ("", ""))[0] in ("Retired", "Failed")
        refused = before.frontend is not None and before.frontend.refused
        assert retired or refused or q.phase in ("Failed", "Succeeded") or old.operation is None or \
            old.operation.done, f"deleted {q.name} before the frontend retired it"
    # Deletes name their victims exactly: by name and UID.
    for a in p.actions:
        if isinstance(a, Delete) and a.kind == "Pod":
            assert any(q.name == a.name and q.uid == a.uid for q in before.pods)
    # At most one resize: a new one starts only once the last is done, and never twice.
    if new.operation is not None and old.operation is not None and new.operation.id != old.operation.id:
        assert old.operation.done or new.fleetGeneration != old.fleetGeneration or \
            (new.operation.done and new.operation.phase == "Failed"), (old.operation, new.operation)
    starts = [a for a in p.actions if isinstance(a, StartResize)]
    assert len(starts) <= 1
    if starts:
        assert new.operation is not None
        assert starts[0].resize_id == new.operation.id
    # The committed size stays within bounds; ranks beyond it exist only during a resize.
    assert 0 <= new.replicas <= max(spec.max_replicas, old.replicas, spec.replicas)
    if new.phase != "Stopped":
        assert new.replicas >= 1 or spec.replicas == 0
    if new.operation is None or new.operation.done:
        assert new.phase != "Scaling"
    # The incarnation and the recovery count never go down.
    assert gen >= old.fleetGeneration
    assert new.recoveries >= old.recoveries
    assert new.observedGeneration == before.generation


def new_world(fleet: FleetRef) -> World:
    return World(fleet=fleet)


def running(replicas: int, **kwargs: Any) -> World:
    w = new_world(make_ecs("a").replicas(replicas).max_replicas(8).obj())
    w.converge()
    assert w.status.phase == "Running"
    return w


# ---- a fleet of fixed size ----------------------------------------------------------------------
def test_fresh_fleet_is_created_and_reaches_running() -> None:
    w = new_world(make_ecs("a").replicas(2).obj())

    first = w.step()

    kinds = sorted(a.obj["kind"] for a in first.actions if isinstance(a, Apply))
    assert kinds == ["Pod", "Pod", "Pod", "Pod", "Secret", "Service", "Service"]
    assert [e.reason for e in first.events] == ["Creating"]
    assert w.status.phase == "Starting"
    assert w.status.fleetGeneration == 1
    assert w.status.replicas == 2
    w.converge()
    assert w.status.phase == "Running"
    assert w.status.replicas == 2
    assert w.status.readyReplicas == 2
    assert [r.phase for r in w.status.ranks] == ["Serving", "Serving"]
    assert {c.type: (c.status, c.reason) for c in w.status.conditions} == {
        "Available": ("True", "RanksServing"), "Progressing": ("False", "Complete"),
        "Scaling": ("False", "Stable"), "Degraded": ("False", "AsExpected")}
    assert w.status.selector == "corefleet.io/fleet=a,corefleet.io/role=engine"
    assert w.events("FleetReady")


def test_idle_reconcile_writes_nothing() -> None:
    w = running(3)
    writes = w.writes

    for _ in range(5):
        p = w.step()
        assert p.actions == ()
        assert p.events == ()
        assert p.requeue_after is None

    assert w.writes == writes


def test_failed_rank_recreates_the_fleet_once() -> None:
    w = running(3)
    old_uids = {q.uid for q in w.pods.values()}

    w.fail("a-engine-1")
    names = set(w.pods)
    p = w.step()

    assert w.status.phase == "Recovering"
    assert w.status.recoveries == 1
    assert w.status.fleetGeneration == 2
    lost = [e for e in p.events if e.reason == "RankLost"]
    assert len(lost) == 1
    assert "rank 1 (pod a-engine-1) failed: container engine exited with 137 (OOMKilled)" in lost[0].message
    assert {a.name for a in p.actions if isinstance(a, Delete)} == names  # every pod goes
    degraded = next(c for c in w.status.conditions if c.type == "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "RankLost")
    w.converge()
    assert w.status.recoveries == 1
    assert w.status.phase == "Running"
    assert not old_uids & {q.uid for q in w.pods.values()}
    assert all(q.fleet_generation == 2 for q in w.pods.values())


def test_vanished_pod_of_a_running_fleet_is_a_lost_rank() -> None:
    w = running(2)

    del w.pods["a-engine-0"]
    p = w.step()

    assert w.status.phase == "Recovering"
    assert w.status.recoveries == 1
    assert "pod a-engine-0 disappeared" in next(e.message for e in p.events if e.reason == "RankLost")
    w.converge()
    assert w.status.recoveries == 1


def test_lost_frontend_is_recovered_too() -> None:
    w = running(2)

    w.fail("a-frontend", "container frontend exited with 1")
    w.converge()

    assert w.status.recoveries == 1
    assert w.status.fleetGeneration == 2


@pytest.mark.parametrize("change", [
    lambda f: f.image("ghcr.io/corefleet/runtime:v2"),
    lambda f: f.model("other/model"),
    lambda f: f.arg("--max-model-len=512"),
])
def test_image_model_or_args_change_restarts_every_pod(change: Any) -> None:
    w = running(2)
    before = {q.name: q.uid for q in w.pods.values()}

    w.set_spec(change(make_ecs("a").replicas(2).max_replicas(8)).obj().spec)
    w.converge()

    assert w.status.fleetGeneration == 2
    assert all(before[n] != q.uid for n, q in w.pods.items())
    assert w.status.recoveries == 0


def test_non_fleet_settings_do_not_restart() -> None:
    w = running(2)
    uids = {q.uid for q in w.pods.values()}

    w.set_spec(make_ecs("a").replicas(2).max_replicas(6).set("scaling.drainTimeoutSeconds", 30).obj().spec)
    w.converge()

    assert {q.uid for q in w.pods.values()} == uids  # neither the drain timeout nor a dense maxReplicas
    assert w.status.observedGeneration == w.generation


def test_scale_to_zero_stops_and_back_up_starts() -> None:
    w = running(2)

    w.scale(0)
    w.converge()

    assert w.pods == {}
    assert w.status.phase == "Stopped"
    assert w.status.replicas == 0
    assert ("Service", "a") in w.objects  # the endpoint stays
    w.scale(1)
    w.converge()
    assert w.status.phase == "Running"
    assert w.status.readyReplicas == 1
    assert w.status.fleetGeneration == 2


def test_deleted_or_edited_service_is_repaired() -> None:
    w = running(1)

    del w.objects[("Service", "a-fleet")]
    w.objects[("Service", "a")]["spec"] = {**w.objects[("Service", "a")]["spec"], "type": "NodePort"}
    p = w.step()

    repaired = sorted(e.message for e in p.events if e.reason == "Repaired")
    assert repaired == ["Service a was changed: applied the spec", "Service a-fleet was missing: applied the spec"]
    assert sorted(a.key for a in p.actions if isinstance(a, Apply)) == [("Service", "a"), ("Service", "a-fleet")]
    assert w.status.recoveries == 0


def test_network_policy_follows_the_spec() -> None:
    w = new_world(make_ecs("a").replicas(1).network_policy().obj())
    w.converge()
    assert ("NetworkPolicy", "a-fleet") in w.objects

    w.set_spec(make_ecs("a").replicas(1).obj().spec)
    p = w.step()

    assert [(a.kind, a.name) for a in p.actions if isinstance(a, Delete)] == [("NetworkPolicy", "a-fleet")]


def test_unschedulable_pods_are_reported() -> None:
    w = new_world(make_ecs("a").replicas(1).obj())
    w.step()
    w.pods = {n: replace(q, node="", message="0/2 nodes are available: 2 Insufficient nvidia.com/gpu.")
              for n, q in w.pods.items()}

    p = plan(w.fleet, w.observed(), w.now)

    degraded = next(c for c in p.status.conditions if c.type == "Degraded")
    assert degraded.reason == "Unschedulable"
    assert "a-engine-0: 0/2 nodes are available: 2 Insufficient nvidia.com/gpu." in degraded.message
    assert p.status.ranks[0].phase == "Pending"


def test_a_fleet_unready_past_its_ready_timeout_is_degraded_with_the_reason() -> None:
    w = new_world(make_ecs("a").replicas(2).set("scaling.readyTimeoutSeconds", 60).obj())
    first = w.step()
    assert first.requeue_after == 60  # the deadline is checked on time, without an event
    unschedulable = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    w.pods["a-engine-1"] = replace(w.pods["a-engine-1"], node="", message=unschedulable)
    w.clock += 30
    w.step()
    assert next(c for c in w.status.conditions if c.type == "Degraded").reason == "Unschedulable"

    w.clock += 40
    p = w.step()

    degraded = next(c for c in w.status.conditions if c.type == "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "ReadyTimeout")
    assert "readyTimeoutSeconds 60" in degraded.message
    assert f"a-engine-1: not scheduled ({unschedulable})" in degraded.message
    assert [e.reason for e in p.events] == ["ReadyTimeout"]
    assert w.status.phase == "Starting"
    assert not [e for e in w.step().events if e.reason == "ReadyTimeout"]  # once
    # A recovery starts the clock again.
    w.pods["a-engine-1"] = replace(w.pods["a-engine-1"], node="gpu-node-0", message="")
    w.converge()
    w.fail("a-engine-0")
    w.step()
    assert next(c for c in w.status.conditions if c.type == "Degraded").reason == "RankLost"


def test_invalid_spec_touches_nothing_and_says_why_once() -> None:
    w = running(2)
    error = SpecError("spec.engine.args", "--data-parallel-size is set by corefleet and cannot be overridden")

    first = plan_invalid(error, w.observed(), NOW)
    w.status = first.status
    second = plan_invalid(error, w.observed(), NOW)

    assert first.actions == ()
    assert [e.reason for e in first.events] == ["InvalidSpec"]
    assert second.events == ()
    degraded = next(c for c in first.status.conditions if c.type == "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "InvalidSpec")
    assert "spec.engine.args" in degraded.message
    assert first.status.phase == "Running"  # the running fleet is left as it is


def test_condition_transition_time_changes_only_on_flip() -> None:
    w = running(1)
    available = next(c for c in w.status.conditions if c.type == "Available")

    later = plan(w.fleet, w.observed(), "2026-11-29T13:00:00Z")

    assert next(c for c in later.status.conditions if c.type == "Available") == available


# ---- resizes in place --------------------------------------------------------------------------
def test_scale_up_in_place_adds_exactly_the_new_ranks() -> None:
    w = running(2)
    survivors = {n: q.uid for n, q in w.pods.items()}

    w.scale(4)
    p = w.step()

    op = w.status.operation
    assert op is not None
    assert (op.fromReplicas, op.toReplicas, op.phase) == (2, 4, "Pending")
    assert [a for a in p.actions if isinstance(a, StartResize)] == [
        StartResize(op.id, 4, drain_timeout_s=120.0, join_timeout_s=1800.0)]
    assert p.actions[0] == StartResize(op.id, 4, 120.0, 1800.0)  # the frontend first, then the pods
    new = [a.obj for a in p.actions if isinstance(a, Apply) and a.obj["kind"] == "Pod"]
    assert [o["metadata"]["name"] for o in new] == ["a-engine-2", "a-engine-3"]
    args = new[0]["spec"]["containers"][0]["args"]
    assert args[args.index("--data-parallel-size") + 1] == "4"
    assert args[args.index("--data-parallel-start-rank") + 1] == "2"
    assert not any(e["name"] == constants.ENV_SCALE_UP_LAUNCH for e in new[0]["spec"]["containers"][0]["env"])
    assert not [a for a in p.actions if isinstance(a, Delete)]
    assert w.status.phase == "Scaling"
    assert w.status.replicas == 2  # committed only once the frontend says so
    assert p.requeue_after == 1.0
    assert w.events("ResizeStarted") == [f"resize {op.id}: 2 -> 4 ranks in place: adding ranks 2..3 (new pods)"]

    w.converge()
    assert w.status.replicas == 4
    assert w.status.operation is not None
    assert w.status.operation.phase == "Completed"
    assert w.status.operation.finishedAt is not None
    assert {n: w.pods[n].uid for n in survivors} == survivors  # nobody restarted
    assert w.status.fleetGeneration == 1
    assert w.status.recoveries == 0
    assert [r.phase for r in w.status.ranks] == ["Serving"] * 4
    assert w.frontend.started == 1
    scaling = next(c for c in w.status.conditions if c.type == "Scaling")
    assert (scaling.status, scaling.reason) == ("False", "Stable")
    assert len(w.events("ResizeCompleted")) == 1


def test_a_scale_up_completes_once_the_new_pods_are_ready_too() -> None:
    """The frontend serves on a new rank as soon as it committed it; its pod's Ready condition (the
    kubelet's readiness probe) can lag a few seconds: the resize ends then, never with a Degraded blip."""
    w = running(2)
    w.scale(3)
    w.step()
    w.step()
    op = w.status.operation
    assert op is not None
    w.pods["a-engine-2"] = replace(w.pods["a-engine-2"], ready=False)
    w.frontend.ops[op.id].phase = "Completed"
    w.frontend.ops[op.id].ranks = {2: ("Serving", "")}
    w.frontend.size = 3

    p = w.step()

    assert w.status.phase == "Scaling"
    assert w.status.operation is not None
    assert w.status.operation.phase == "Committing"
    assert "waiting for the pod(s) of rank 2 to be Ready" in w.status.operation.message
    assert w.status.replicas == 2
    assert [e.reason for e in p.events] == ["ResizeCommitting"]
    w.pods["a-engine-2"] = replace(w.pods["a-engine-2"], ready=True)
    p = w.step()
    assert (w.status.phase, w.status.replicas) == ("Running", 3)
    assert [e.reason for e in p.events] == ["ResizeCompleted"]
    assert not any(pl.status.phase == "Degraded" for pl in w.log)


def test_scale_down_deletes_only_retired_ranks_after_the_frontend_says_so() -> None:
    w = running(4)
    survivors = {n: q.uid for n, q in w.pods.items() if n not in ("a-engine-2", "a-engine-3")}

    w.scale(2)
    p = w.step()
    assert not [a for a in p.actions if isinstance(a, Delete)]  # the frontend has not retired them yet
    op = w.status.operation
    assert op is not None
    assert (op.fromReplicas, op.toReplicas) == (2 + 2, 2)
    w.step()
    assert w.frontend.ops[op.id].phase == "Draining"
    p = w.step()
    assert [r.phase for r in w.status.ranks][2:] == ["Draining", "Draining"]
    assert not [a for a in p.actions if isinstance(a, Delete)]

    p = w.step()  # the frontend reported them Retired
    deleted = sorted(a.name for a in p.actions if isinstance(a, Delete))
    assert deleted == ["a-engine-2", "a-engine-3"]
    assert w.status.replicas == 2
    assert len(w.events("RankRetired")) == 2
    w.converge()
    assert {n: q.uid for n, q in w.pods.items()} == survivors
    assert w.status.recoveries == 0


@pytest.mark.parametrize(("start", "target"), [(1, 3), (3, 1), (2, 1), (1, 2)])
def test_resizes_to_and_from_one_rank_are_in_place(start: int, target: int) -> None:
    w = running(start)
    keep = {n: q.uid for n, q in w.pods.items() if q.rank is None or q.rank < min(start, target)}

    w.scale(target)
    w.converge()

    assert w.status.replicas == target
    assert {n: w.pods[n].uid for n in keep} == keep
    assert w.status.fleetGeneration == 1


def test_a_change_during_a_resize_is_queued_and_the_latest_wins() -> None:
    w = running(2)
    w.scale(3)
    w.step()
    first = w.status.operation
    assert first is not None
    w.scale(5)
    p = w.step()
    assert [e.reason for e in p.events if e.reason == "ResizeQueued"] == ["ResizeQueued"]
    w.scale(4)
    w.step()
    assert w.status.operation is not None
    assert w.status.operation.id == first.id
    w.converge()
    assert w.status.replicas == 4
    assert w.frontend.started == 2  # 2 -> 3, then 3 -> 4
    assert [o.to for o in w.frontend.ops.values()] == [3, 4]


def test_a_rank_that_never_joins_fails_the_resize_and_the_fleet_serves_on() -> None:
    w = running(2)
    w.frontend.join_steps = 5
    survivors = {n: q.uid for n, q in w.pods.items()}
    w.scale(3)
    w.step()
    w.pods["a-engine-2"] = replace(w.pods["a-engine-2"], node="", message="0/2 nodes are available")

    for _ in range(10):
        w.step()
        if w.status.operation is not None and w.status.operation.done:
            break
    op = w.status.operation
    assert op is not None
    assert op.phase == "Failed"
    assert "did not join" in op.message
    assert w.status.replicas == 2
    w.step()
    assert "a-engine-2" not in w.pods or w.pods["a-engine-2"].terminating  # the pod that never joined goes
    assert len(w.events("ResizeFailed")) == 1
    scaling = next(c for c in w.status.conditions if c.type == "Scaling")
    assert (scaling.status, scaling.reason) == ("False", "ResizeFailed")
    assert "retrying in" in scaling.message
    # It serves on at 2, untouched; the same resize is retried only after the backoff.
    for _ in range(5):
        p = w.step()
        assert not [a for a in p.actions if isinstance(a, StartResize)]
        assert p.requeue_after is not None
        assert p.requeue_after <= RESIZE_RETRY_SECONDS
    assert w.status.phase == "Running"
    assert {n: w.pods[n].uid for n in survivors} == survivors
    w.clock += int(RESIZE_RETRY_SECONDS)
    p = w.step()
    assert [a for a in p.actions if isinstance(a, StartResize)]
    w.converge()
    assert w.status.replicas == 3


def test_a_new_ranks_pod_that_fails_cancels_the_resize() -> None:
    w = running(2)
    w.scale(3)
    w.step()
    w.step()
    w.fail("a-engine-2", "container engine exited with 1 (Error)")

    p = w.step()

    cancels = [a for a in p.actions if isinstance(a, CancelResize)]
    assert len(cancels) == 1
    assert "a-engine-2" in cancels[0].reason
    assert "exited with 1" in cancels[0].reason
    assert w.status.recoveries == 0
    assert w.status.phase == "Scaling"
    w.step()
    w.step()
    assert w.status.operation is not None
    assert w.status.operation.phase == "Failed"
    assert w.status.replicas == 2
    assert w.status.recoveries == 0


def test_a_leaving_rank_that_dies_while_draining_is_no_loss() -> None:
    w = running(3)
    w.scale(2)
    w.step()
    w.step()
    w.fail("a-engine-2")
    w.converge()
    assert w.status.replicas == 2
    assert w.status.recoveries == 0
    assert w.status.fleetGeneration == 1


def test_a_frontend_lost_during_a_resize_is_a_recovery_at_the_committed_size() -> None:
    w = running(2)
    w.scale(3)
    w.step()
    w.step()
    w.fail("a-frontend", "container frontend exited with 137")

    p = w.step()

    assert w.status.phase == "Recovering"
    assert w.status.recoveries == 1
    assert w.status.operation is not None
    assert w.status.operation.phase == "Failed"
    assert "RankLost" in [e.reason for e in p.events]
    assert w.status.replicas == 2
    w.converge(max_steps=100)
    assert w.status.replicas == 3  # recovered at 2, then resized to the desired 3
    assert w.status.fleetGeneration == 2


def test_an_operator_that_dies_between_status_and_actions_resumes_the_same_resize() -> None:
    w = running(2)
    w.scale(3)
    w.drop_actions = True  # the status is written, the frontend call and the pod creation are lost
    w.step()
    op = w.status.operation
    assert op is not None
    assert op.phase == "Pending"
    assert "a-engine-2" not in w.pods

    p = w.step()  # a new operator: the frontend does not know the resize: ask again, create the pod

    assert [a.resize_id for a in p.actions if isinstance(a, StartResize)] == [op.id]
    w.converge()
    assert w.status.replicas == 3
    assert w.frontend.started == 1
    assert [o.id for o in w.frontend.ops.values()] == [op.id]


def test_a_frontend_that_stops_answering_past_the_timeouts_is_a_recovery() -> None:
    w = new_world(make_ecs("a").replicas(2).max_replicas(8).set("scaling.readyTimeoutSeconds", 30).obj())
    w.converge()
    w.scale(3)
    w.step()
    w.frontend.reachable = False
    for _ in range(30):
        w.step()
    assert w.status.phase == "Scaling"  # waiting for it
    assert w.status.operation is not None
    assert "admin API" in w.status.operation.message
    for _ in range(200):
        w.step()
        if w.status.phase == "Recovering":
            break
    assert w.status.phase == "Recovering"
    assert "no answer from the frontend" in w.events("RankLost")[0]


def test_a_refused_resize_fails_without_touching_the_fleet() -> None:
    w = running(2)
    w.frontend.refuse = "the frontend refused it (503): rank(s) [1] are dead"
    w.scale(3)
    w.step()
    p = w.step()
    assert w.status.operation is not None
    assert w.status.operation.phase == "Failed"
    assert "refused" in w.status.operation.message
    assert "a-engine-2" in {a.name for a in p.actions if isinstance(a, Delete)}
    assert w.status.recoveries == 0


def test_a_fleet_that_never_served_is_recreated_at_the_new_size() -> None:
    w = new_world(make_ecs("a").replicas(2).max_replicas(8).obj())
    w.step()
    w.scale(3)
    p = w.step()
    assert w.status.phase == "Restarting"
    assert "not serving yet" in next(e.message for e in p.events if e.reason == "Restarting")
    w.converge()
    assert w.status.replicas == 3
    assert w.frontend.started == 0


def test_moe_fleets_are_recreated_at_the_new_size() -> None:
    w = new_world(make_ecs("m").replicas(2).max_replicas(4).expert_parallel().obj())
    w.converge()
    w.set_spec(make_ecs("m").replicas(3).max_replicas(4).expert_parallel().obj().spec)
    p = w.step()
    assert w.status.phase == "Restarting"
    assert "MoE" in next(e.message for e in p.events if e.reason == "Restarting")
    w.converge()
    assert w.status.replicas == 3
    assert w.frontend.started == 0


def test_random_sequences_keep_the_invariants_and_converge() -> None:
    rng = random.Random(20261201)
    for trial in range(60):
        w = new_world(make_ecs("r").replicas(rng.randint(1, 4)).max_replicas(6).obj())
        w.frontend.join_steps = rng.choice([3, 20])
        for _ in range(rng.randint(5, 40)):
            roll = rng.random()
            live = [n for n, q in w.pods.items() if not q.terminating and q.phase == "Running"]
            if roll < 0.08 and live:
                w.fail(rng.choice(live))  # a member, a joining or a leaving rank, or the frontend
            elif roll < 0.25:
                w.scale(rng.randint(0, 6))
            elif roll < 0.3:
                w.drop_actions = True  # the operator dies mid-reconcile
            elif roll < 0.35:
                w.frontend.reachable = not w.frontend.reachable
            elif roll < 0.37:
                w.frontend.refuse = "the frontend refused it (409): another resize runs"
            elif roll < 0.4 and ("Service", "r") in w.objects:
                del w.objects[("Service", "r")]
            w.step()
            w.clock += rng.choice([0, 0, 5, 60])
        w.frontend.reachable = True
        w.frontend.join_steps = 20
        w.converge(max_steps=200, tick=10)
        spec = w.fleet.spec
        assert w.status.replicas == spec.replicas, trial
        assert sorted(w.pods) == sorted(
            [] if spec.replicas == 0 else
            ["r-coordinator", "r-frontend", *(f"r-engine-{i}" for i in range(spec.replicas))]), trial
        assert len(w.frontend.running()) == 0


def test_is_subset() -> None:
    assert is_subset({"a": 1, "b": [{"c": 2}]}, {"a": 1, "b": [{"c": 2, "d": 3}], "e": 4})
    assert not is_subset({"a": 1}, {"a": 2})
    assert not is_subset({"b": [1, 2]}, {"b": [1]})
