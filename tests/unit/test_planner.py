# SPDX-License-Identifier: Apache-2.0
"""The pure planner, walked through whole sequences against a simulated cluster.

`World` plays the API server, scheduler and kubelet: it carries out the planner's actions (apply,
delete by UID), schedules and starts pods one step later, finishes deletions one step after that,
and stores the status the planner returns. Invariants are checked after every step.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from corefleet_operator import builders, constants
from corefleet_operator.models import EngineCoreSetSpec, EngineCoreSetStatus, FleetRef, SpecError
from corefleet_operator.observe import Observed, PodObs
from corefleet_operator.planner import Apply, Delete, Plan, is_subset, plan, plan_invalid
from factories import make_ecs

NOW = "2026-11-29T12:00:00Z"


@dataclass
class World:
    fleet: FleetRef
    status: EngineCoreSetStatus = field(default_factory=EngineCoreSetStatus)
    pods: dict[str, PodObs] = field(default_factory=dict)
    objects: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    generation: int = 1
    writes: int = 0
    log: list[Plan] = field(default_factory=list)

    def observed(self) -> Observed:
        return Observed(generation=self.generation, status=self.status, pods=tuple(self.pods.values()),
                        objects=dict(self.objects), admin_token="token")

    def kubelet(self) -> None:
        """One step of the scheduler and kubelet: bind, start, and finish deletions."""
        for name, p in list(self.pods.items()):
            if p.terminating:
                del self.pods[name]
            elif not p.node:
                self.pods[name] = replace(p, node="gpu-node-0")
            elif p.phase == "Pending":
                self.pods[name] = replace(p, phase="Running", ready=True, ip="10.0.0.1")

    def step(self) -> Plan:
        before = self.observed()
        p = plan(self.fleet, before, NOW)
        self.log.append(p)
        check_invariants(self, before, p)
        if p.status != self.status:
            self.writes += 1
            self.status = p.status
        for a in p.actions:
            self.writes += 1
            if isinstance(a, Apply):
                obj = a.obj
                if obj["kind"] == "Pod":
                    meta = obj["metadata"]
                    existing = self.pods.get(meta["name"])
                    if existing is None:
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
        self.kubelet()
        return p

    def converge(self, max_steps: int = 12) -> None:
        for _ in range(max_steps):
            p = self.step()
            if not p.actions and self.status.phase in ("Running", "Stopped") and p.status == self.status:
                quiet = plan(self.fleet, self.observed(), NOW)
                if not quiet.actions and quiet.status == self.status:
                    return
        raise AssertionError(f"did not converge: phase {self.status.phase}, pods {sorted(self.pods)}")

    def set_spec(self, spec: EngineCoreSetSpec) -> None:
        self.fleet = replace(self.fleet, spec=spec)
        self.generation += 1

    def fail(self, name: str, message: str = "container engine exited with 137 (OOMKilled)") -> None:
        self.pods[name] = replace(self.pods[name], phase="Failed", ready=False, message=message)


def check_invariants(world: World, before: Observed, p: Plan) -> None:
    deleted = {a.name for a in p.actions if isinstance(a, Delete) and a.kind == "Pod"}
    created = [a.obj for a in p.actions if isinstance(a, Apply) and a.obj["kind"] == "Pod"]
    gen = p.status.fleetGeneration
    # Pods are created only for the current incarnation, and only once no other pod is left.
    for obj in created:
        assert int(obj["metadata"]["annotations"][constants.ANNOTATION_GENERATION]) == gen
        assert obj["metadata"]["name"] not in {q.name for q in before.pods}
    if created:
        assert all(q.fleet_generation == gen and not q.terminating for q in before.pods if q.name not in deleted)
        assert not deleted
    # Nothing of the current incarnation is deleted unless it is failed or misconfigured.
    want_hash = builders.fleet_config_hash(world.fleet.spec, world.fleet.spec.replicas)
    for q in before.pods:
        if q.name in deleted and q.fleet_generation == gen:
            assert q.spec_hash != want_hash or q.phase in ("Failed", "Succeeded") or (
                q.rank is not None and q.rank >= world.fleet.spec.replicas)
    # Deletes name their victims exactly: by name and UID.
    for a in p.actions:
        if isinstance(a, Delete) and a.kind == "Pod":
            assert any(q.name == a.name and q.uid == a.uid for q in before.pods)
    # The incarnation and the recovery count never go down.
    assert gen >= before.status.fleetGeneration
    assert p.status.recoveries >= before.status.recoveries
    assert p.status.observedGeneration == before.generation


def new_world(fleet: FleetRef) -> World:
    return World(fleet=fleet)


# ---- sequences ----------------------------------------------------------------------------------
def test_fresh_fleet_is_created_and_reaches_running() -> None:
    w = new_world(make_ecs("a").replicas(2).obj())

    first = w.step()

    kinds = sorted(a.obj["kind"] for a in first.actions if isinstance(a, Apply))
    assert kinds == ["Pod", "Pod", "Pod", "Pod", "Secret", "Service", "Service"]
    assert [e.reason for e in first.events] == ["Creating"]
    assert w.status.phase == "Starting"
    assert w.status.fleetGeneration == 1
    w.converge()
    assert w.status.phase == "Running"
    assert w.status.replicas == 2
    assert w.status.readyReplicas == 2
    assert [r.phase for r in w.status.ranks] == ["Serving", "Serving"]
    assert {c.type: c.status for c in w.status.conditions} == {
        "Available": "True", "Progressing": "False", "Degraded": "False"}
    assert w.status.selector == "corefleet.io/fleet=a,corefleet.io/role=engine"
    assert any(e.reason == "FleetReady" for pl in w.log for e in pl.events)


def test_idle_reconcile_writes_nothing() -> None:
    w = new_world(make_ecs("a").replicas(3).obj())
    w.converge()
    writes = w.writes

    for _ in range(5):
        p = w.step()
        assert p.actions == ()
        assert p.events == ()

    assert w.writes == writes


def test_failed_rank_recreates_the_fleet_once() -> None:
    w = new_world(make_ecs("a").replicas(3).obj())
    w.converge()
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
    w = new_world(make_ecs("a").replicas(2).obj())
    w.converge()

    del w.pods["a-engine-0"]
    p = w.step()

    assert w.status.phase == "Recovering"
    assert w.status.recoveries == 1
    assert "pod a-engine-0 disappeared" in next(e.message for e in p.events if e.reason == "RankLost")
    w.converge()
    assert w.status.recoveries == 1


def test_lost_frontend_is_recovered_too() -> None:
    w = new_world(make_ecs("a").replicas(2).obj())
    w.converge()

    w.fail("a-frontend", "container frontend exited with 1")
    w.converge()

    assert w.status.recoveries == 1
    assert w.status.fleetGeneration == 2


def test_replicas_change_restarts_the_fleet_at_the_new_size() -> None:
    w = new_world(make_ecs("a").replicas(2).obj())
    w.converge()

    w.set_spec(make_ecs("a").replicas(4).obj().spec)
    p = w.step()

    assert w.status.phase == "Restarting"
    assert w.status.replicas == 2  # committed size until the new fleet runs
    assert w.status.recoveries == 0
    assert "replicas 2 -> 4" in next(e.message for e in p.events if e.reason == "Restarting")
    w.converge()
    assert w.status.replicas == 4
    assert sorted(n for n in w.pods if "engine" in n) == [f"a-engine-{r}" for r in range(4)]


@pytest.mark.parametrize("change", [
    lambda f: f.image("ghcr.io/corefleet/runtime:v2"),
    lambda f: f.model("other/model"),
    lambda f: f.arg("--max-model-len=512"),
])
def test_image_model_or_args_change_restarts_every_pod(change: Any) -> None:
    w = new_world(make_ecs("a").replicas(2).obj())
    w.converge()
    before = {q.name: q.uid for q in w.pods.values()}

    w.set_spec(change(make_ecs("a").replicas(2)).obj().spec)
    w.converge()

    assert w.status.fleetGeneration == 2
    assert all(before[n] != q.uid for n, q in w.pods.items())
    assert w.status.recoveries == 0


def test_non_fleet_settings_do_not_restart() -> None:
    w = new_world(make_ecs("a").replicas(2).obj())
    w.converge()
    uids = {q.uid for q in w.pods.values()}

    w.set_spec(make_ecs("a").replicas(2).set("scaling.drainTimeoutSeconds", 30).obj().spec)
    w.converge()

    assert {q.uid for q in w.pods.values()} == uids
    assert w.status.observedGeneration == w.generation


def test_scale_to_zero_stops_and_back_up_starts() -> None:
    w = new_world(make_ecs("a").replicas(2).obj())
    w.converge()

    w.set_spec(make_ecs("a").replicas(0).obj().spec)
    w.converge()

    assert w.pods == {}
    assert w.status.phase == "Stopped"
    assert ("Service", "a") in w.objects  # the endpoint stays
    w.set_spec(make_ecs("a").replicas(1).obj().spec)
    w.converge()
    assert w.status.phase == "Running"
    assert w.status.readyReplicas == 1


def test_deleted_or_edited_service_is_repaired() -> None:
    w = new_world(make_ecs("a").replicas(1).obj())
    w.converge()

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

    p = plan(w.fleet, w.observed(), NOW)

    degraded = next(c for c in p.status.conditions if c.type == "Degraded")
    assert degraded.reason == "Unschedulable"
    assert "a-engine-0: 0/2 nodes are available: 2 Insufficient nvidia.com/gpu." in degraded.message
    assert p.status.ranks[0].phase == "Pending"


def test_invalid_spec_touches_nothing_and_says_why_once() -> None:
    w = new_world(make_ecs("a").replicas(2).obj())
    w.converge()
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
    w = new_world(make_ecs("a").replicas(1).obj())
    w.converge()
    available = next(c for c in w.status.conditions if c.type == "Available")

    later = plan(w.fleet, w.observed(), "2026-11-29T13:00:00Z")

    assert next(c for c in later.status.conditions if c.type == "Available") == available


def test_random_faults_keep_invariants_and_converge() -> None:
    rng = random.Random(20261129)
    for trial in range(30):
        w = new_world(make_ecs("r").replicas(rng.randint(1, 4)).obj())
        failures = 0
        for _ in range(rng.randint(3, 15)):
            roll = rng.random()
            live = [n for n, q in w.pods.items() if not q.terminating and q.phase == "Running"]
            if roll < 0.15 and live and w.status.phase == "Running":
                w.fail(rng.choice(live))
                failures += 1
            elif roll < 0.25:
                w.set_spec(make_ecs("r").replicas(rng.randint(0, 4)).obj().spec)
            elif roll < 0.3 and ("Service", "r") in w.objects:
                del w.objects[("Service", "r")]
            w.step()
        w.converge(max_steps=20)
        assert w.status.recoveries == failures, trial
        spec = w.fleet.spec
        assert w.status.replicas == spec.replicas
        assert sorted(w.pods) == sorted(
            [] if spec.replicas == 0 else
            ["r-coordinator", "r-frontend", *(f"r-engine-{i}" for i in range(spec.replicas))])


def test_is_subset() -> None:
    assert is_subset({"a": 1, "b": [{"c": 2}]}, {"a": 1, "b": [{"c": 2, "d": 3}], "e": 4})
    assert not is_subset({"a": 1}, {"a": 2})
    assert not is_subset({"b": [1, 2]}, {"b": [1]})
    assert not is_subset({"a": {"x": 1}}, {})
