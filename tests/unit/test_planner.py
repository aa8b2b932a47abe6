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
import json
import random
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from corefleet_operator import builders, constants
from corefleet_operator.models import EngineCoreSetSpec, EngineCoreSetStatus, FleetRef, OperationStatus, SpecError
from corefleet_operator.observe import (
    FleetObs,
    FrontendObs,
    FrontendResize,
    Observed,
    PodObs,
    RankObs,
    ResizeObs,
    fleet_view_due,
)
from corefleet_operator.planner import (
    FRONTEND_POLL_SECONDS,
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
    replace: tuple[int, ...] = ()  # a replacement in place: these Dead ranks get new engines
    redundant: int | None = None  # MoE: R' at the new size
    idle: bool = False  # going idle: every rank drains and its engine is released

    def obs(self) -> ResizeObs:
        return ResizeObs(id=self.id, phase=self.phase, ranks=dict(self.ranks), message=self.phase.lower(),
                         error=self.error, fleet_intact=self.intact, num_redundant_experts=self.redundant)


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
    dead: set[int] = field(default_factory=set)  # ranks whose engine's connection is gone (their pod ended or went)
    engines: dict[int, str] = field(default_factory=dict)  # rank -> the UID of the pod whose engine it is connected to
    experts: int | None = None  # MoE: the model's experts E (R' = (E + R) * to / frm - E)
    redundant: int = 0  # MoE: R at the committed size
    idle: set[int] = field(default_factory=set)  # Idle ranks: drained and released by going idle, until a wake
    waiting: int = 0  # requests held, waiting for a rank (its view's requests_waiting)
    quiet: float = 0.0  # seconds since a request was in flight or held (its view's quiet_s)
    interrupt_idle: bool = False  # a request arrives while the fleet drains to idle: going idle fails

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
    built_redundant: dict[str, int] = field(default_factory=dict)  # pod -> its --eplb-config's redundant experts
    built_attach: dict[str, tuple[int, ...] | None] = field(default_factory=dict)  # frontend pod -> the ranks its
    # --detached-ranks leaves out if it was built with --attach (else None)
    crash: set[str] = field(default_factory=set)  # pods (by name) whose container exits as soon as it starts
    stuck: set[str] = field(default_factory=set)  # pods whose deletion nothing completes (a lost node's)
    hang: set[str] = field(default_factory=set)  # pods (by name) that start and never become Ready
    rank_states: dict[int, RankObs] = field(default_factory=dict)  # what the frontend says of ranks (else Serving)
    fleet_asks: int = 0  # reconciles that read the frontend's view of the ranks

    @property
    def now(self) -> str:
        return (T0 + datetime.timedelta(seconds=self.clock)).strftime("%Y-%m-%dT%H:%M:%SZ")

    def current(self) -> EngineCoreSetStatus:
        """`status`, read through a call. The world's methods (step, converge, ...) replace `status`, but mypy keeps
        a narrowing of `w.status.phase` (or any `w.status.*`) across such calls (python/mypy#19783): after
        `assert w.status.phase == "Starting"` and `w.converge()`, `assert w.status.phase == "Running"` would be
        flagged as a non-overlapping comparison, and the rest of the test as unreachable (so left unchecked). An
        assertion that expects a change since an earlier one reads `w.current()` instead."""
        return self.status

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
            else:  # unknown to the frontend: its view of the ranks comes along (FrontendAPI.observe)
                refused = self.frontend.refuse_seen.get(op.id, "")
                seen = FrontendObs(reachable=True, refused=refused, fleet=None if refused else self.fleet_view())
            obs = replace(obs, frontend=seen)
        if fleet_view_due(obs):
            self.fleet_asks += 1
            obs = replace(obs, fleet=self.fleet_view())
        return obs

    def fleet_view(self) -> FleetObs:
        if self.frontend_pod() is None or not self.frontend.reachable:
            return FleetObs(reachable=False, error="connection refused")
        ranks = {r: self.rank_states.get(r, RankObs(r, "Idle" if r in self.frontend.idle else
                                                    "Dead" if r in self.frontend.dead else "Serving"))
                 for r in range(self.frontend.size)}
        running = self.frontend.running()
        resize = FrontendResize(from_replicas=running[0].frm, to_replicas=running[0].to, replace=running[0].replace,
                                account=running[0].obs()) if running else None
        return FleetObs(reachable=True, ranks=ranks, size=self.frontend.size, resize=resize,
                        requests_waiting=self.frontend.waiting, quiet_s=self.frontend.quiet)

    @property
    def epoch(self) -> float:
        return (T0 + datetime.timedelta(seconds=self.clock)).timestamp()

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
        if a.idle:  # going idle: every rank drains (no resize may be asked of an idle fleet but a wake)
            assert a.replicas == f.size, (a, f.size)
            f.ops[a.resize_id] = Op(a.resize_id, f.size, f.size, phase="Draining", idle=True,
                                    ranks={r: ("Draining", "") for r in range(f.size)})
            if f.idle == set(range(f.size)):  # idle already: completed at once
                f.ops[a.resize_id].phase = "Completed"
            f.started += 1
            return
        assert not f.idle or a.replace, f"a resize of an idle fleet: {a}"
        if a.replace:  # a replacement: only of Dead (or, waking, Idle) ranks, in a fleet of that size (else 409)
            assert a.replicas == f.size, (a, f.size)
            if not set(a.replace) <= f.dead | f.idle:
                f.refuse_seen[a.resize_id] = f"the frontend refused it (409): ranks {list(a.replace)} are not Dead"
                return
            f.ops[a.resize_id] = Op(a.resize_id, f.size, f.size, phase="Preparing", replace=a.replace,
                                    ranks={r: ("Joining", "") for r in a.replace})
            f.started += 1
            return
        op = Op(a.resize_id, f.size, a.replicas)
        if f.experts is not None:
            op.redundant = (f.experts + f.redundant) * op.to // op.frm - f.experts
            if op.redundant < 0:  # what the real frontend refuses (400), naming the minimum
                f.refuse_seen[a.resize_id] = f"Cannot scale to data_parallel_size {op.to}, minimum is {op.frm}"
                return
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
            f.dead.clear()
            f.idle.clear()
            f.engines.clear()
            name = f"{self.fleet.name}-frontend"
            f.redundant = self.built_redundant.get(name, 0) if pod is not None else 0
            f.uid = pod.uid if pod is not None else ""
            f.size = self.built_size.get(name, 0) if pod is not None else 0
            detached = self.built_attach.get(name)
            if pod is not None and detached is not None:  # attaching: every other rank must reconnect, or it exits
                f.dead = set(detached)
                missing = [r for r in range(f.size) if r not in detached and not self.engine_runs(r)]
                if missing:
                    self.fail(name, f"container frontend exited with 1: ranks {missing} did not reconnect")
                    f.uid = ""
            return
        replacing = {r for op in f.running() for r in op.replace}
        for r in range(f.size):  # an engine whose pod ended or went has lost its connection: Dead
            engine = self.pods.get(f"{self.fleet.name}-engine-{r}")
            if r in replacing or r in f.idle:
                continue
            if engine is None or engine.terminating or engine.phase in ("Failed", "Succeeded") \
                    or f.engines.setdefault(r, engine.uid) != engine.uid:
                f.dead.add(r)
        for op in f.running():
            op.age += 1
            if op.idle:
                if f.interrupt_idle:
                    op.phase, op.error = "Failed", "a request arrived while the fleet drained: the ranks serve on"
                    op.ranks = {r: ("Serving", "") for r in op.ranks}
                elif op.age >= 2:
                    op.phase, f.idle = "Completed", set(range(f.size))
                    op.ranks = {r: ("Idle", "") for r in op.ranks}
                    f.engines.clear()
                continue
            if op.replace:
                new = [self.pods.get(f"{self.fleet.name}-engine-{r}") for r in op.replace]
                if op.cancel:
                    op.phase, op.error = "Failed", f"cancelled: {op.cancel}"
                elif op.age >= 2 and all(p is not None and p.ready and not p.terminating for p in new) \
                        and self.coordinator_runs():
                    op.phase = "Completed"
                    op.ranks = {r: ("Serving", "") for r in op.replace}
                    f.dead -= set(op.replace)
                    f.idle -= set(op.replace)
                    f.engines.update({r: p.uid for r, p in zip(op.replace, new, strict=True) if p is not None})
                elif op.age > f.join_steps:
                    op.phase, op.error = "Failed", "the new engine did not join within the join timeout"
                continue
            if op.to > op.frm:
                if op.cancel:
                    op.phase, op.error = "Failed", f"cancelled: {op.cancel}"
                    op.ranks = {r: ("Failed", op.error) for r in op.ranks}
                    continue
                op.phase = "Preparing"
                new = [self.pods.get(f"{self.fleet.name}-engine-{r}") for r in range(op.frm, op.to)]
                if op.age >= 3 and all(p is not None and p.ready and not p.terminating for p in new) \
                        and self.coordinator_runs():
                    op.phase, f.size = "Completed", op.to
                    f.redundant = op.redundant if op.redundant is not None else f.redundant
                    f.engines = {r: uid for r, uid in f.engines.items() if r not in op.ranks}
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
                f.redundant = op.redundant if op.redundant is not None else f.redundant
                f.engines = {r: uid for r, uid in f.engines.items() if r not in op.ranks}
                op.ranks = {r: ("Retired", "") for r in op.ranks}

    def coordinator_runs(self) -> bool:
        """A new engine's handshake ends only once the coordinator said READY (vLLM's EngineCoreProc): its pod runs."""
        pod = self.pods.get(f"{self.fleet.name}-coordinator")
        return pod is not None and pod.phase == "Running"

    def engine_runs(self, rank: int) -> bool:
        engine = self.pods.get(f"{self.fleet.name}-engine-{rank}")
        return engine is not None and engine.phase == "Running" and not engine.terminating

    # ---- the API server, scheduler and kubelet ---------------------------------------------------
    def kubelet(self) -> None:
        """One step of the scheduler and kubelet: bind, start, and finish deletions."""
        for name, p in list(self.pods.items()):
            if p.terminating and name not in self.stuck:
                del self.pods[name]
            elif not p.node and not p.message:
                self.pods[name] = replace(p, node="gpu-node-0", unready_since=self.now)
            elif p.node and p.phase == "Pending" and name in self.crash:
                self.pods[name] = replace(p, phase="Failed", ip="10.0.0.1", unready_since="",
                                          message="container engine exited with 2 (Error)")
            elif p.node and p.phase == "Pending" and name in self.hang:
                self.pods[name] = replace(p, phase="Running", ip="10.0.0.1")
            elif p.node and p.phase == "Pending":
                self.pods[name] = replace(p, phase="Running", ready=True, ip="10.0.0.1", unready_since="")

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
                    eplb = [json.loads(args[i + 1]) for i, x in enumerate(args) if x == "--eplb-config"]
                    self.built_redundant[meta["name"]] = eplb[-1]["num_redundant_experts"] if eplb else 0
                    detached = [tuple(int(r) for r in args[i + 1].split(",")) for i, x in enumerate(args)
                                if x == "--detached-ranks"]
                    self.built_attach[meta["name"]] = (detached[-1] if detached else ()) if "--attach" in args \
                        else None
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

    def converge(self, max_steps: int = 60, tick: int = 1, phases: tuple[str, ...] = ("Running", "Stopped")) -> None:
        for _ in range(max_steps):
            p = self.step()
            self.clock += tick - 1
            if not p.actions and self.status.phase in phases and p.status == self.status \
                    and (self.status.replicas == self.fleet.spec.replicas or self.status.phase == "Idle"):
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
        self.pods[name] = replace(self.pods[name], phase="Failed", ready=False, message=message, unready_since="")

    def unready(self, name: str) -> None:
        """The pod's readiness probe stops answering (its process hangs)."""
        self.pods[name] = replace(self.pods[name], ready=False, unready_since=self.now)

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
        if new.replicas == 0 or new.phase == "Failed":  # stopped, or given up (check_recovery_invariants)
            continue
        if new.idle is not None and q.role == constants.ROLE_ENGINE:
            # an idle fleet's engines go once the frontend released them (or those of a wake that failed)
            assert old.idle is not None or (op_seen is not None and op_seen.phase == "Completed"
                                            and old.operation is not None and old.operation.idle), (q.name, new)
            continue
        if new.operation is not None and not new.operation.done \
                and q.name in {member(world.fleet.name, m) for m in new.operation.members}:
            # a lost frontend's or coordinator's old pod, replaced in place: only before the new one is created
            assert new.operation.phase == "Pending", (q.name, new.operation)
            continue
        assert q.rank is not None, f"deleted {q.name}"
        if new.operation is not None and q.rank in new.operation.replace and not new.operation.done:
            continue  # a lost rank's old pod, replaced in place (check_replacement_invariants)
        if new.operation is not None and q.rank in new.operation.detached and not new.operation.done:
            continue  # the new pod of a rank whose replacement ended with its frontend (check_member_invariants)
        assert q.rank >= new.replicas, f"deleted member {q.name}"
        retired = op_seen is not None and op_seen.ranks.get(q.rank, ("", ""))[0] in ("Retired", "Failed")
        refused = before.frontend is not None and before.frontend.refused
        # the resize ended with its lost frontend (rolled back or finished), which is replaced in place
        ended = new.operation is not None and constants.ROLE_FRONTEND in new.operation.members
        assert retired or refused or ended or q.phase in ("Failed", "Succeeded") or old.operation is None or \
            old.operation.done, f"deleted {q.name} before the frontend retired it"
    # Deletes name their victims exactly: by name and UID.
    for a in p.actions:
        if isinstance(a, Delete) and a.kind == "Pod":
            assert any(q.name == a.name and q.uid == a.uid for q in before.pods)
    # At most one resize: a new one starts only once the last is done, and never twice.
    if new.operation is not None and old.operation is not None and new.operation.id != old.operation.id:
        # (or a resize or a replacement of ranks that ended with its lost frontend, replaced in place:
        # `planner.members.interrupted_resize`, `interrupted_replacement`; or that replacement of the frontend going on
        # as a new replacement of the ranks it left out: `planner.members._replace_detached`)
        ended = bool({constants.ROLE_FRONTEND, constants.ROLE_COORDINATOR} & set(new.operation.members)) \
            and not old.operation.members and set(old.operation.replace) <= set(new.operation.detached)
        # (its left-out ranks: those it had, and any lost this very pass: `planner.members.ranks_with_members`)
        resumed = bool(old.operation.members) and bool(new.operation.replace) and not new.operation.members \
            and set(old.operation.detached) <= set(new.operation.replace) and new.operation.phase == "Preparing"
        assert old.operation.done or new.fleetGeneration != old.fleetGeneration or ended or resumed or \
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
    check_recovery_invariants(world, before, p, deleted, created)


def check_recovery_invariants(world: World, before: Observed, p: Plan, deleted: set[str],
                              created: list[Mapping[str, Any]]) -> None:
    old, new = before.status, p.status
    budget = world.fleet.spec.scaling.maxRecoveries
    if any(e.reason == "StatusLost" for e in p.events):  # a lost status: the newest incarnation was adopted
        newest = max(q.fleet_generation for q in before.pods if not q.terminating and q.fleet_generation)
        assert new.fleetGeneration in (newest, newest + 1)  # adopted, and recovered at once if it lost a pod
        if new.phase == "Failed":  # adopted with a lost pod and no recovery left (maxRecoveries 0): given up
            assert world.fleet.spec.scaling.maxRecoveries == 0
            assert [e.reason for e in p.events].count("RecoveriesExhausted") == 1
            assert not created
            assert all(q.name in deleted for q in before.pods if not q.terminating
                       and q.phase not in ("Failed", "Succeeded"))
        elif new.fleetGeneration == newest and world.fleet.spec.replicas > 0:
            # adopted as it stands (at replicas 0, adopted and stopped): none of its running members deleted
            assert not [q.name for q in before.pods if q.fleet_generation == newest and q.name in deleted
                        and q.phase == "Running" and q.ready]
        return
    # Every lost incarnation is one recovery (never two at once), within the streak's budget.
    assert new.recoveries - old.recoveries in (0, 1)
    assert len([e for e in p.events if e.reason in LOSS_EVENTS]) <= 1
    if new.recovery is not None:
        assert new.recovery.attempt <= budget, new.recovery
    replacement_started = new.operation is not None and bool(new.operation.replace or new.operation.members) \
        and (old.operation is None or old.operation.id != new.operation.id) and not resumed_replacement(old, new)
    if new.recoveries > old.recoveries:
        assert new.recovery is not None
        assert new.recovery.lostAt == world.now
        assert new.fleetGeneration == old.fleetGeneration + (0 if replacement_started else 1)
        streak = old.recovery.attempt if old.recovery is not None and \
            old.recovery.observedGeneration == before.generation else 0
        assert new.recovery.attempt in (1, streak + 1), (old.recovery, new.recovery)
        assert any(e.reason in LOSS_EVENTS and f"recovery {new.recovery.attempt} of {budget}" in e.message
                   for e in p.events)
    # No pod is created before the recovery's backoff ends.
    if created and new.phase == "Recovering" and new.recovery is not None and new.recovery.retryAt:
        assert world.now >= new.recovery.retryAt, (world.now, new.recovery)
    # A fleet given up creates nothing until its spec changes; its running pods go, its ended ones stay.
    if old.phase == "Failed" and old.recovery is not None and old.recovery.observedGeneration == before.generation:
        assert new.phase == "Failed"
    if new.phase == "Failed":
        assert not created
        assert new.recovery is not None
        assert next(c.reason for c in new.conditions if c.type == "Degraded") == "RecoveriesExhausted"
        for q in before.pods:
            if not q.terminating:
                assert (q.name in deleted) == (q.phase not in ("Failed", "Succeeded")), q
    # Never two incarnations' pods kept running at once.
    kept = {q.fleet_generation for q in before.pods
            if not q.terminating and q.name not in deleted and q.phase not in ("Failed", "Succeeded")}
    kept |= {int(obj["metadata"]["annotations"][constants.ANNOTATION_GENERATION]) for obj in created}
    assert len(kept) <= 1, kept
    check_replacement_invariants(world, before, p, created, replacement_started)


def resumed_replacement(old: EngineCoreSetStatus, new: EngineCoreSetStatus) -> bool:
    """A replacement of the members that left ranks out of their attach (or lost ranks this very pass), going on as
    their new replacement (no loss)."""
    before, after = old.operation, new.operation
    return before is not None and after is not None and before.id != after.id and bool(before.members) \
        and bool(after.replace) and set(before.detached) <= set(after.replace) and not after.members \
        and new.recoveries == old.recoveries and new.fleetGeneration == old.fleetGeneration


def check_replacement_invariants(world: World, before: Observed, p: Plan, created: list[Mapping[str, Any]],
                                 started: bool) -> None:
    old, new = before.status, p.status
    op = new.operation
    spec = world.fleet.spec
    check_member_invariants(world, before, p, created, started and op is not None and bool(op.members))
    if started and op is not None and op.members:
        return
    if op is not None and op.wake:
        check_wake_invariants(world, before, p, started)
        return
    if started:
        assert op is not None
        # Only a dense fleet that served, with its frontend and coordinator Ready, replaces ranks in place; each
        # replacement is one loss of the streak (the budget and backoff count it).
        assert not spec.expertParallel
        assert old.phase in ("Running", "Degraded")
        assert old.operation is None or old.operation.done
        for name in (constants.frontend_name(world.fleet.name), constants.coordinator_name(world.fleet.name)):
            q = next(q for q in before.pods if q.name == name)
            assert q.ready, q
            assert q.phase == "Running", q
            assert not q.terminating, q
        assert new.recoveries == old.recoveries + 1
        assert new.fleetGeneration == old.fleetGeneration
        assert (op.fromReplicas, op.toReplicas) == (old.replicas, old.replicas)
        assert set(op.replace) < set(range(old.replicas))
        assert [e.reason for e in p.events].count("RankLost") == 1
    if op is not None and op.replace and not op.done:
        assert new.phase == "Degraded"  # the other ranks serve on
        assert not [a for a in p.actions if isinstance(a, StartResize) and not a.replace]
    # A replaced rank's new pod is created only once its old pod is gone (never two pods for one rank: names
    # are fixed) and its backoff is over; the replacement is asked of the frontend only for ranks it reports Dead.
    names = {q.name for q in before.pods}
    for obj in created:
        assert obj["metadata"]["name"] not in names
        if op is not None and op.replace and new.recovery is not None and new.recovery.lostAt == op.startedAt \
                and new.recovery.retryAt:
            assert world.now >= new.recovery.retryAt, (world.now, new.recovery)
    for a in p.actions:
        if isinstance(a, StartResize) and a.replace:
            assert before.frontend is not None
            assert before.frontend.fleet is not None
            assert all(before.frontend.fleet.ranks[r].state == "Dead" for r in a.replace), before.frontend


def check_wake_invariants(world: World, before: Observed, p: Plan, started: bool) -> None:
    """A wake: only of an idle fleet, every rank at the size it idled at, in place; not a loss; one that fails leaves it
    idle."""
    old, new = before.status, p.status
    op = new.operation
    assert op is not None
    if new.fleetGeneration != old.fleetGeneration:  # its frontend or coordinator lost: recreated, awake
        assert (op.phase, new.idle, started) == ("Failed", None, False), (op, new)
        return
    assert new.recoveries == old.recoveries
    if started:
        assert old.idle is not None, old
        assert old.phase == "Idle", old
        assert old.operation is None or old.operation.done
        assert op.replace == tuple(range(old.replicas))
        assert (op.fromReplicas, op.toReplicas) == (old.replicas,) * 2
        assert [e.reason for e in p.events].count("FleetWaking") == 1
    if not op.done:
        assert new.phase == "Waking"
        assert new.idle is not None
    if op.phase == "Failed" and not (old.operation is not None and old.operation.id == op.id and old.operation.done):
        assert new.idle is not None
        assert new.idle.wakeFailures >= 1
    if op.phase == "Completed":
        assert new.idle is None
    for a in p.actions:
        if isinstance(a, StartResize):
            assert a.replace == op.replace
            assert not a.idle
            seen = before.frontend.fleet if before.frontend is not None and before.frontend.fleet is not None \
                else before.fleet
            assert seen is not None
            assert all(seen.ranks[r].state in ("Idle", "Dead") for r in a.replace), seen


def check_member_invariants(world: World, before: Observed, p: Plan, created: list[Mapping[str, Any]],
                            started: bool) -> None:
    """A replacement of the frontend and/or coordinator in place: the engines are left alone throughout."""
    old, new = before.status, p.status
    op = new.operation
    spec = world.fleet.spec
    name = world.fleet.name
    if started:
        assert op is not None
        # Only a dense fleet that served with nothing in flight (but a resize its lost frontend ran, which ends with
        # it), and only its frontend and/or coordinator lost, as attempt 1 or 2 of the streak; one loss of the
        # streak, counted, without backoff.
        assert not spec.expertParallel
        interrupted = old.operation is not None and not old.operation.done
        if interrupted:
            assert old.operation is not None
            assert not old.operation.members
            # a replacement of ranks frontend 0 ran, or whose new engines waited for the lost coordinator: its ranks
            # are left out of the new frontend's attach, and a frontend that lives on is told to cancel its part
            assert set(old.operation.replace) <= set(op.detached)
            if constants.ROLE_FRONTEND in op.members:
                assert not op.cancelling
            else:
                assert op.members == (constants.ROLE_COORDINATOR,)
                assert op.detached
                assert op.cancelling == old.operation.id
            assert (op.fromReplicas, op.toReplicas) == (min(old.operation.fromReplicas, old.operation.toReplicas),) * 2
        assert old.phase in (("Running", "Degraded", "Scaling") if interrupted else ("Running", "Degraded"))
        assert not op.replace
        # ranks left out of the attach and replaced after: an interrupted replacement's, and engine ranks lost with
        # the members (not serving), never every rank
        interrupted_ranks = set(old.operation.replace) if interrupted and old.operation is not None else set()
        for rank in set(op.detached) - interrupted_ranks:
            q = next((q for q in before.pods if q.name == constants.engine_name(name, rank)
                      and q.fleet_generation == new.fleetGeneration), None)
            # Dead, or Unresponsive (past the liveness timeout: the planner's own clock of it is tested elsewhere)
            dead = before.fleet is not None and rank in before.fleet.ranks \
                and before.fleet.ranks[rank].state in ("Dead", "Unresponsive")
            assert q is None or q.phase in ("Failed", "Succeeded") or not q.ready or q.terminating or dead, q
        assert len(op.detached) < op.toReplicas, op
        assert new.recoveries == old.recoveries + 1
        assert new.fleetGeneration == old.fleetGeneration
        if not interrupted:
            assert (op.fromReplicas, op.toReplicas) == (old.replicas, old.replicas)
        assert new.recovery is not None
        assert new.recovery.members <= 2, new.recovery  # the streak's first two member losses only
        assert new.recovery.members == (old.recovery.members if old.recovery is not None
                                        and old.recovery.observedGeneration == new.recovery.observedGeneration
                                        and new.recovery.attempt > 1 else 0) + 1, (old.recovery, new.recovery)
        assert new.recovery.retryAt == new.recovery.lostAt
        assert [e.reason for e in p.events].count("MemberLost") == 1
        assert "RankLost" not in [e.reason for e in p.events]
        for role in op.members:  # the lost ones: not serving
            q = next((q for q in before.pods if q.name == member(name, role)
                      and q.fleet_generation == new.fleetGeneration), None)
            assert q is None or q.phase in ("Failed", "Succeeded") or not q.ready or q.terminating, q
    running = op is not None and bool(op.members) and not op.done
    if running:
        assert op is not None
        assert new.phase == "Degraded"
        assert new.replicas == op.toReplicas
        deleted = {a.name for a in p.actions if isinstance(a, Delete) and a.kind == "Pod"}
        # the lost members' old pods; the pods of ranks an interrupted resize added or was removing; the new pods of
        # ranks an interrupted replacement was replacing
        beyond = {q.name for q in before.pods if q.rank is not None and q.rank >= new.replicas}
        left_out = {constants.engine_name(name, rank) for rank in op.detached}
        assert deleted <= {member(name, role) for role in op.members} | beyond | left_out, deleted
        # (once Preparing, only where the coordinator alone is replaced: `planner.members.ranks_with_members`)
        assert not deleted & left_out or op.phase == "Pending" or op.members == (constants.ROLE_COORDINATOR,), \
            (deleted, op)
        assert not [a for a in p.actions if isinstance(a, StartResize)]
        # The PodDisruptionBudget lets no engine go meanwhile.
        for a in p.actions:
            if isinstance(a, Apply) and a.obj["metadata"]["name"] == constants.engines_budget_name(name):
                assert a.obj["spec"]["minAvailable"] == new.replicas, a.obj
    for obj in created:
        assert obj["metadata"]["name"] not in {q.name for q in before.pods}
        role = obj["metadata"]["labels"][constants.LABEL_ROLE]
        if role == constants.ROLE_ENGINE:
            assert not running, obj["metadata"]["name"]  # no engine is created while the members are replaced
        if role == constants.ROLE_FRONTEND:
            # --attach exactly when a frontend is created by a replacement of that frontend in place
            args = obj["spec"]["containers"][0]["args"]
            attach = "--attach" in args
            replaced = running and obj["metadata"]["name"] in {
                member(name, m) for m in op.members}  # type: ignore[union-attr]
            assert attach == replaced, (attach, op)
            # the ranks of an interrupted replacement are left out of the attach, exactly
            given = args[args.index("--detached-ranks") + 1] if "--detached-ranks" in args else ""
            wanted = ",".join(map(str, op.detached)) if replaced and op is not None else ""
            assert given == wanted, (args, op)
            assert not (attach and spec.expertParallel)


LOSS_EVENTS = ("RankLost", "MemberLost")


def member(fleet: str, role: str) -> str:
    """A member's pod (`coordinator`, `frontend`, `frontend-1`, ...)."""
    return f"{fleet}-{role}"


def new_world(fleet: FleetRef) -> World:
    world = World(fleet=fleet)
    if fleet.spec.expertParallel:
        world.frontend.experts = 0  # R' is 0 at every size (a test that needs another sets the experts)
    return world


def running(replicas: int, moe: bool = False) -> World:
    ecs = make_ecs("a").replicas(replicas).max_replicas(8)
    w = new_world((ecs.expert_parallel() if moe else ecs).obj())
    w.converge()
    assert w.status.phase == "Running"
    return w


# ---- a fleet of fixed size ----------------------------------------------------------------------
def test_fresh_fleet_is_created_and_reaches_running() -> None:
    w = new_world(make_ecs("a").replicas(2).obj())

    first = w.step()

    kinds = sorted(a.obj["kind"] for a in first.actions if isinstance(a, Apply))
    assert (kinds.count("Pod"), kinds.count("Secret"), kinds.count("Service")) == (4, 1, 2)
    assert [e.reason for e in first.events] == ["Creating"]
    assert w.status.phase == "Starting"
    assert w.status.fleetGeneration == 1
    assert w.status.replicas == 2
    w.converge()
    assert w.current().phase == "Running"
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
        assert p.requeue_after == FRONTEND_POLL_SECONDS  # the frontend's view of the ranks is read this often

    assert w.writes == writes


def test_a_failed_rank_of_an_moe_fleet_recreates_the_fleet_once() -> None:
    w = running(3, moe=True)  # its ranks share collectives that cannot lose a member
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
    assert w.current().phase == "Running"
    assert not old_uids & {q.uid for q in w.pods.values()}
    assert all(q.fleet_generation == 2 for q in w.pods.values())


def test_vanished_pod_of_a_running_moe_fleet_is_a_lost_rank() -> None:
    w = running(2, moe=True)

    del w.pods["a-engine-0"]
    p = w.step()

    assert w.status.phase == "Recovering"
    assert w.status.recoveries == 1
    assert "pod a-engine-0 disappeared" in next(e.message for e in p.events if e.reason == "RankLost")
    w.converge()
    assert w.status.recoveries == 1


def test_a_lost_frontend_of_an_moe_fleet_recreates_the_fleet() -> None:
    """Elastic EP's frontend holds the EPLB state: an MoE fleet is recreated (a dense one replaces it in place,
    `test_a_lost_frontend_or_coordinator_of_a_dense_fleet_is_replaced_in_place`)."""
    w = running(2, moe=True)

    w.fail("a-frontend", "container frontend exited with 1")
    w.converge()

    assert w.status.recoveries == 1
    assert w.status.fleetGeneration == 2
    assert not w.events("MemberLost")


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
    assert w.current().phase == "Running"
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
    generation = w.status.fleetGeneration
    w.fail("a-frontend")
    w.fail("a-engine-0")
    w.fail("a-engine-1")  # the frontend and every engine: the fleet is recreated
    w.step()
    assert w.status.fleetGeneration == generation + 1
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


def scale_up_served_before_its_pod_is_ready() -> World:
    """A 2 -> 3 scale-up that the frontend completed (it serves on rank 2) while rank 2's pod is not Ready yet."""
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
    return w


def test_a_scale_up_completes_once_the_new_pods_are_ready_too() -> None:
    """The frontend serves on a new rank as soon as it committed it; its pod's Ready condition (the
    kubelet's readiness probe) can lag a few seconds: the resize ends then, never with a Degraded blip."""
    w = scale_up_served_before_its_pod_is_ready()

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


def test_a_new_ranks_pod_that_fails_while_committing_is_a_loss_at_once_not_after_the_timeout() -> None:
    w = scale_up_served_before_its_pod_is_ready()
    w.step()
    assert w.status.operation is not None
    assert w.status.operation.phase == "Committing"
    w.fail("a-engine-2")

    p = w.step()  # the same second: the resize's timeout (readyTimeoutSeconds) is far

    assert [e.reason for e in p.events] == ["ResizeCompleted"]
    assert w.status.replicas == 3
    p = w.step()  # the fleet at its new size lost rank 2
    assert "rank 2 (pod a-engine-2)" in next(e.message for e in p.events if e.reason == "RankLost")
    assert (w.status.replicas, w.status.fleetGeneration, w.status.recoveries) == (3, 1, 1)
    assert w.status.operation is not None
    assert w.status.operation.replace == (2,)  # replaced in place at the new size
    w.converge()
    assert (w.status.phase, w.status.replicas, w.status.fleetGeneration) == ("Running", 3, 1)


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


@pytest.mark.parametrize("restart", [False, True])
@pytest.mark.parametrize("direction", ["up", "down"])
def test_a_frontend_lost_during_a_dense_resize_is_replaced_in_place_and_the_resize_rolled_back_or_finished(
        direction: str, restart: bool) -> None:
    """The resize lives in the frontend process and ends with it; no engine that stays is touched: a scale-up
    2 -> 3 is rolled back (rank 2's pod goes, the frontend is replaced in place at 2 and the resize runs again), a
    scale-down 3 -> 2 is finished (rank 2's pod goes, the frontend is replaced in place at 2). `restart`: the operator
    dies after the status write of the pass that decides it, before its actions."""
    w = running(2 if direction == "up" else 3)
    w.scale(3 if direction == "up" else 2)
    step_until(w, lambda p: w.status.operation is not None and w.status.operation.phase in ("Preparing", "Draining"),
               max_steps=10, what="the resize under way")
    assert w.status.phase == "Scaling"
    resize = w.status.operation
    assert resize is not None
    stays = {n: q.uid for n, q in w.pods.items() if n in ("a-engine-0", "a-engine-1", "a-coordinator")}
    mark = len(w.log)
    w.fail("a-frontend", "container frontend exited with 137 (OOMKilled)")
    w.drop_actions = restart

    p = w.step()

    op = w.status.operation
    assert op is not None
    assert (op.members, op.fromReplicas, op.toReplicas) == (("frontend",), 2, 2)
    assert (w.status.replicas, w.status.fleetGeneration, w.status.recoveries) == (2, 1, 1)
    told = {e.reason: e.message for e in p.events}
    if direction == "up":
        assert f"resize {resize.id} (2 -> 3) rolled back to 2 ranks" in told["ResizeFailed"]
    else:
        assert f"resize {resize.id} (3 -> 2) finished at 2 ranks" in told["ResizeCompleted"]
    assert "replacing the frontend in place" in told["MemberLost"]
    assert "RankLost" not in told

    step_until(w, member_replaced, max_steps=40, what="the frontend replaced")
    assert "a-engine-2" not in w.pods or direction == "up"  # a scale-up is tried again once it is replaced
    w.converge(max_steps=100)
    assert (w.status.replicas, w.status.fleetGeneration, w.status.recoveries) == (w.fleet.spec.replicas, 1, 1)
    assert {n: q.uid for n, q in w.pods.items() if n in stays} == stays  # no engine that stays restarted
    frontends = [obj for obj in created_pods(w, mark) if obj["metadata"]["name"] == "a-frontend"]
    assert len(frontends) == 1
    args = frontends[0]["spec"]["containers"][0]["args"]
    assert "--attach" in args
    assert args[args.index("--data-parallel-size") + 1] == "2"
    assert not w.events("Recovering")


REPLACEMENT_STAGES = ["old pod going", "new pod starting", "asked", "committing"]


def reach_replacement_stage(w: World, op_id: str, stage: str) -> None:
    """Step a replacement of rank 1 to `stage`: its old pod still going, its new pod starting, asked of the frontend,
    or committing (the frontend serves on the new engine, whose pod is not Ready yet)."""
    if stage == "old pod going":
        w.pods["a-engine-1"] = replace(w.pods["a-engine-1"], terminating=True)
        return
    if stage == "committing":
        w.hang.add("a-engine-1")  # its engine serves (the frontend commits below), its pod is not Ready yet

    def reached() -> bool:
        pod, op = w.pods.get("a-engine-1"), w.current().operation
        return {"new pod starting": pod is not None and pod.phase == "Pending",
                "asked": op_id in w.frontend.ops,
                "committing": op is not None and op.phase == "Committing"}[stage]

    for _ in range(40):
        if reached():
            return
        w.step()
        held = w.frontend.ops.get(op_id)
        if stage == "committing" and held is not None and held.phase != "Completed":
            held.phase, held.ranks = "Completed", {1: ("Serving", "")}
            w.frontend.dead.discard(1)
            w.frontend.engines[1] = w.pods["a-engine-1"].uid  # it serves on the new engine
    raise AssertionError(f"the replacement did not reach {stage}: {w.status.operation}")


def resume_rank_1(w: World, member: str) -> OperationStatus:
    """Rank 1's new pod may start and go: once `member` is replaced, rank 1's replacement goes on (Preparing)."""
    w.hang.discard("a-engine-1")
    w.stuck.discard("a-engine-1")
    step_until(w, member_replaced, max_steps=40, what=f"{member} replaced")
    again = w.current().operation
    assert again is not None
    assert (again.replace, again.phase) == ((1,), "Preparing")
    assert w.events("RankReplacementResumed")
    return again


def replacement_of_rank_1_at(stage: str) -> tuple[World, OperationStatus]:
    """A fleet of 3 whose rank 1 is lost, its replacement brought to `stage` (`reach_replacement_stage`)."""
    w = running(3)
    if stage == "old pod going":
        w.stuck.add("a-engine-1")  # its deletion takes a while (a lost node's pod)
    w.fail("a-engine-1")
    w.step()
    replacement = w.status.operation
    assert replacement is not None
    assert replacement.replace == (1,)
    reach_replacement_stage(w, replacement.id, stage)
    return w, replacement


@pytest.mark.parametrize("restart", [False, True], ids=["", "operator restarted"])
@pytest.mark.parametrize("stage", REPLACEMENT_STAGES)
def test_a_frontend_lost_during_a_replacement_of_a_rank_is_replaced_in_place_and_the_rank_replaced_again(
        stage: str, restart: bool) -> None:
    """The replacement lives in frontend 0 and ends with it; no engine that stays is touched: rank 1's new pod (or
    its old one, still going) is deleted, the new frontend attaches to ranks 0 and 2 with rank 1 left out (Dead),
    then rank 1 is replaced again, asked of the new frontend, as one more step of the same recovery. `restart`: the
    operator dies after the status write of the pass that decides it, before its actions."""
    w, replacement = replacement_of_rank_1_at(stage)
    stays = {n: q.uid for n, q in w.pods.items() if n in ("a-engine-0", "a-engine-2", "a-coordinator")}
    mark = len(w.log)
    recoveries = w.status.recoveries
    w.fail("a-frontend", "container frontend exited with 137 (OOMKilled)")
    w.drop_actions = restart

    p = w.step()

    op = w.status.operation
    assert op is not None
    assert (op.members, op.detached, op.fromReplicas, op.toReplicas) == (("frontend",), (1,), 3, 3)
    assert (w.status.replicas, w.status.fleetGeneration, w.status.recoveries) == (3, 1, recoveries + 1)
    told = {e.reason: e.message for e in p.events}
    assert f"replacement {replacement.id} of rank 1 rolled back" in told["ResizeFailed"]
    assert "replacing the frontend in place" in told["MemberLost"]
    assert "RankLost" not in told

    again = resume_rank_1(w, "the frontend")
    assert again.id != replacement.id
    step_until(w, replaced, max_steps=40, what="rank 1 replaced again")
    w.converge(max_steps=100)
    assert (w.status.replicas, w.status.fleetGeneration, w.status.recoveries) == (3, 1, recoveries + 1)
    assert {n: q.uid for n, q in w.pods.items() if n in stays} == stays  # no engine that stays restarted
    frontends = [obj for obj in created_pods(w, mark) if obj["metadata"]["name"] == "a-frontend"]
    assert len(frontends) == 1
    args = frontends[0]["spec"]["containers"][0]["args"]
    assert args[args.index("--detached-ranks") + 1] == "1"
    assert "--attach" in args
    engines = [obj["metadata"]["name"] for obj in created_pods(w, mark) if obj["metadata"]["name"].startswith("a-e")]
    assert engines == ["a-engine-1"]  # once, after the frontend
    assert [o.replace for o in w.frontend.ops.values()] == [(1,)]  # asked of the new frontend once
    assert not w.events("Recovering")


@pytest.mark.parametrize("restart", [False, True], ids=["", "operator restarted"])
@pytest.mark.parametrize("stage", REPLACEMENT_STAGES)
def test_a_coordinator_lost_during_a_replacement_of_a_rank_is_replaced_in_place_and_the_rank_replaced_again(
        stage: str, restart: bool) -> None:
    """Rank 1's new engine waits for the coordinator's READY before its handshake ends: a replacement of it not yet
    committed is rolled back (its new pod, or its old one still going, deleted; frontend 0, which lives on, told to
    cancel its part until the new coordinator serves), the coordinator replaced in place, then rank 1 replaced again,
    asked of the same frontend once it reports rank 1 Dead again. A committing one (the frontend serves on the new
    engine) completes first, and the coordinator is replaced after. No pod that stays is touched; one recovery more.
    `restart`: the operator dies after the status write of the pass that decides it, before its actions."""
    w, replacement = replacement_of_rank_1_at(stage)
    stays = {n: q.uid for n, q in w.pods.items() if n in ("a-engine-0", "a-engine-2", "a-frontend")}
    engine1 = w.pods["a-engine-1"].uid if stage == "committing" else None
    mark = len(w.log)
    recoveries = w.status.recoveries
    w.fail("a-coordinator", "container coordinator exited with 137")
    w.drop_actions = restart

    p = w.step()

    told = {e.reason: e.message for e in p.events}
    assert "RankLost" not in told
    if stage == "committing":  # it completes, then the coordinator is replaced
        assert w.status.operation is not None
        assert w.status.operation.id == replacement.id
        assert w.status.recoveries == recoveries
        w.hang.discard("a-engine-1")
        w.pods["a-engine-1"] = replace(w.pods["a-engine-1"], ready=True, unready_since="")  # its probe answers
        step_until(w, lambda p: w.status.operation is not None and bool(w.status.operation.members), max_steps=40,
                   what="the replacement completed and the coordinator's replacement started")
        assert w.events("RankReplaced")
        after = w.current().operation
        assert after is not None
        assert (after.members, after.detached, after.cancelling) == (("coordinator",), (), "")
        step_until(w, member_replaced, max_steps=40, what="the coordinator replaced")
        assert w.pods["a-engine-1"].uid == engine1
    else:
        interrupting = w.current().operation
        assert interrupting is not None
        assert (interrupting.members, interrupting.detached, interrupting.cancelling) == \
            (("coordinator",), (1,), replacement.id)
        assert (w.status.replicas, w.status.fleetGeneration, w.status.recoveries) == (3, 1, recoveries + 1)
        assert f"replacement {replacement.id} of rank 1 rolled back" in told["ResizeFailed"]
        assert "replaced again once the coordinator is" in told["ResizeFailed"]
        assert "replacing the coordinator in place" in told["MemberLost"]
        resume_rank_1(w, "the coordinator")
        step_until(w, replaced, max_steps=40, what="rank 1 replaced again")
        if replacement.id in w.frontend.ops:  # asked: frontend 0 gave its part up
            assert w.frontend.ops[replacement.id].phase == "Failed"
            assert "cancelled" in w.frontend.ops[replacement.id].error
        cancels = {a.resize_id for q in w.log[mark:] for a in q.actions if isinstance(a, CancelResize)}
        assert cancels == {replacement.id}
    w.converge(max_steps=100)
    assert (w.status.replicas, w.status.fleetGeneration, w.status.recoveries) == (3, 1, recoveries + 1)
    assert {n: q.uid for n, q in w.pods.items() if n in stays} == stays
    assert [obj["metadata"]["name"] for obj in created_pods(w, mark) if "frontend" in obj["metadata"]["name"]] == []
    assert [o.phase for o in w.frontend.ops.values()][-1] == "Completed"
    assert not w.events("Recovering")


def test_a_frontend_lost_during_a_replacement_with_every_other_engine_recreates_the_fleet() -> None:
    """The frontend and the engines but the one being replaced lost: no rank would serve, the fleet is recreated."""
    w = running(3)
    w.fail("a-engine-1")
    w.step()
    w.fail("a-frontend")
    w.fail("a-engine-0")
    w.fail("a-engine-2")

    p = w.step()

    assert w.status.phase == "Recovering"
    assert w.status.fleetGeneration == 2
    assert "RankLost" in [e.reason for e in p.events]


@pytest.mark.parametrize("restart", [False, True], ids=["", "operator restarted"])
@pytest.mark.parametrize("how", ["failed", "vanished", "terminating"])
@pytest.mark.parametrize("direction", ["up", "down"])
def test_a_coordinator_lost_during_a_dense_resize_is_replaced_in_place_once_the_resize_ended(
        direction: str, how: str, restart: bool) -> None:
    """The frontend needs no coordinator to finish its resize, but a new engine does (it waits for the coordinator's
    READY before its handshake ends): a scale-up 2 -> 3 still joining is cancelled (rank 2's pod goes), a scale-down
    3 -> 2 runs on. Meanwhile the loss is not counted and no coordinator pod is created; once the resize ended, the
    coordinator is replaced in place at the size it left, and the scale-up runs again, as `replicas` still asks. No
    pod that stays is touched, one recovery, no new incarnation. `restart`: the operator dies after the status write
    of the pass that sees the loss, before its actions."""
    up = direction == "up"
    w = running(2 if up else 3)
    w.scale(3 if up else 2)
    step_until(w, lambda p: w.status.operation is not None and w.status.operation.phase in ("Preparing", "Draining"),
               max_steps=10, what="the resize under way")
    resize = w.status.operation
    assert resize is not None
    stays = {n: q.uid for n, q in w.pods.items() if n in ("a-engine-0", "a-engine-1", "a-frontend")}
    mark = len(w.log)
    lose_member(w, how, "a-coordinator")
    w.drop_actions = restart

    w.step()

    assert (w.status.recoveries, w.status.fleetGeneration) == (0, 1)  # not a loss while the resize runs
    step_until(w, lambda p: w.status.operation is not None and w.status.operation.id != resize.id, max_steps=60,
               what="the resize ended and the coordinator's replacement started")
    op = w.status.operation
    assert op is not None
    assert (op.members, op.fromReplicas, op.toReplicas) == (("coordinator",), 2, 2)
    cancels = {a.resize_id for p in w.log[mark:] for a in p.actions if isinstance(a, CancelResize)}
    told = {e.reason: e.message for p in w.log[mark:] for e in p.events}
    for q in w.log[mark:]:  # no coordinator pod created while the resize ran
        if any(isinstance(a, Apply) and a.obj["metadata"]["name"] == "a-coordinator" for a in q.actions):
            assert q.status.operation is not None
            assert q.status.operation.members == ("coordinator",)
    if up:
        assert cancels == {resize.id}
        assert "a new rank cannot join without it" in told["ResizeCancelling"]
        assert "the fleet serves on at 2 ranks; retried once the coordinator is replaced in place" \
            in told["ResizeFailed"]
    else:
        assert not cancels
        assert f"resize {resize.id}: the fleet serves at 2 ranks" in told["ResizeCompleted"]
    step_until(w, member_replaced, max_steps=40, what="the coordinator replaced")
    assert w.built_size["a-coordinator"] == 2
    w.converge(max_steps=100)
    assert (w.status.replicas, w.status.fleetGeneration, w.status.recoveries) == (w.fleet.spec.replicas, 1, 1)
    assert {n: q.uid for n, q in w.pods.items() if n in stays} == stays
    assert not w.events("Recovering")
    assert not w.events("RankLost")
    if up:
        assert [m for m in w.events("ResizeCompleted") if "the fleet serves at 3 ranks" in m]


def test_a_coordinator_lost_during_an_moe_resize_recreates_the_fleet() -> None:
    """Elastic EP's coordinator holds the wave state that the resize runs through: its loss is a recovery."""
    w = running(2, moe=True)
    w.scale(3)
    w.step()
    w.step()
    w.fail("a-coordinator", "container coordinator exited with 137")

    p = w.step()

    assert w.status.phase == "Recovering"
    assert (w.status.recoveries, w.status.fleetGeneration) == (1, 2)
    assert w.status.operation is not None
    assert w.status.operation.phase == "Failed"
    assert "RankLost" in [e.reason for e in p.events]


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
        if w.current().phase == "Recovering":
            break
    assert w.current().phase == "Recovering"
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


def test_moe_fleets_resize_in_place_and_new_pods_wait_for_the_frontends_redundant_experts() -> None:
    w = new_world(make_ecs("m").replicas(2).max_replicas(4).expert_parallel().obj())
    w.frontend.experts = 4
    w.converge()
    survivors = {n: q.uid for n, q in w.pods.items()}
    w.set_spec(make_ecs("m").replicas(4).max_replicas(4).expert_parallel().obj().spec)
    p = w.step()
    assert w.status.phase == "Scaling"
    assert [a for a in p.actions if isinstance(a, StartResize)]
    assert not [a for a in p.actions if isinstance(a, Apply) and a.obj["kind"] == "Pod"]  # R' is not known yet
    assert p.requeue_after == 0.2  # the frontend answers at once: asked again soon
    p = w.step()
    new = [a.obj for a in p.actions if isinstance(a, Apply) and a.obj["kind"] == "Pod"]
    assert [o["metadata"]["name"] for o in new] == ["m-engine-2", "m-engine-3"]
    container = new[0]["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--data-parallel-size") + 1] == "4"
    assert json.loads(args[len(args) - 1 - args[::-1].index("--eplb-config") + 1]) == {"num_redundant_experts": 4}
    assert {"name": constants.ENV_SCALE_UP_LAUNCH, "value": "1"} in container["env"]
    w.converge()
    assert (w.status.replicas, w.status.fleetGeneration, w.status.recoveries) == (4, 1, 0)
    assert {n: w.pods[n].uid for n in survivors} == survivors
    assert w.frontend.started == 1

    w.set_spec(make_ecs("m").replicas(2).max_replicas(4).expert_parallel().obj().spec)
    w.converge()
    assert (w.status.replicas, w.status.fleetGeneration, w.status.recoveries) == (2, 1, 0)
    assert sorted(w.pods) == sorted(survivors)
    assert {n: w.pods[n].uid for n in survivors} == survivors

    w.set_spec(make_ecs("m").replicas(1).max_replicas(4).expert_parallel().obj().spec)  # below vLLM's minimum
    for _ in range(3):
        w.step()
    assert w.status.operation is not None
    assert w.status.operation.phase == "Failed"
    assert "minimum is 2" in w.status.operation.message
    assert (w.status.phase, w.status.replicas, w.status.fleetGeneration) == ("Running", 2, 1)
    assert any("minimum is 2" in m for m in w.events("ResizeFailed"))


def test_an_moe_fleet_recreated_at_a_size_it_was_resized_to_keeps_its_redundant_experts() -> None:
    """Elastic EP keeps the physical experts per rank: a fleet born at 2 ranks of 4 experts has 4 redundant ones
    at 4 ranks. Recreated at 4 (a recovery) with none, it could not go back to 2 (vLLM: minimum is 4)."""
    w = new_world(make_ecs("m").replicas(2).max_replicas(4).expert_parallel().obj())
    w.frontend.experts = 4
    w.converge()
    assert w.status.redundantExperts is None  # the user's (none given: vLLM's default)
    w.set_spec(make_ecs("m").replicas(4).max_replicas(4).expert_parallel().obj().spec)
    w.converge()
    assert (w.current().replicas, w.current().redundantExperts) == (4, 4)
    w.fail("m-engine-1")
    w.converge()
    assert (w.current().fleetGeneration, w.current().recoveries, w.current().redundantExperts) == (2, 1, 4)
    assert {n: w.built_redundant[n] for n in ("m-frontend", *w.engines())} == {
        "m-frontend": 4, "m-engine-0": 4, "m-engine-1": 4, "m-engine-2": 4, "m-engine-3": 4}
    w.set_spec(make_ecs("m").replicas(2).max_replicas(4).expert_parallel().obj().spec)
    w.converge()
    assert (w.current().replicas, w.current().fleetGeneration, w.current().redundantExperts) == (2, 2, 0)
    assert w.status.operation is not None
    assert w.status.operation.phase == "Completed"


def test_an_moe_resize_that_leaves_the_fleet_unusable_is_a_recovery() -> None:
    w = new_world(make_ecs("m").replicas(2).max_replicas(4).expert_parallel().obj())
    w.frontend.experts = 4
    w.converge()
    w.set_spec(make_ecs("m").replicas(3).max_replicas(4).expert_parallel().obj().spec)
    w.step()
    w.step()
    op = w.frontend.running()[0]
    op.phase, op.error, op.intact = "Failed", "eep_ready/2 not set (the MoE fleet must be recreated)", False
    p = w.step()
    assert w.status.phase == "Recovering"
    assert "eep_ready/2 not set" in next(e.message for e in p.events if e.reason == "RankLost")
    w.converge()  # recreated at the committed 2 ranks, then resized in place to 3 again
    assert (w.status.replicas, w.status.fleetGeneration, w.status.recoveries) == (3, 2, 1)
    assert w.built_size["m-engine-0"] == 2


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


# ---- losses, backoff and the recovery budget ----------------------------------------------------
def step_until(w: World, done: Any, max_steps: int = 400, what: str = "") -> Plan:
    for _ in range(max_steps):
        p = w.step()
        if done(p):
            return p
    raise AssertionError(f"not reached in {max_steps} steps: {what}; phase {w.status.phase}, {w.status.recovery}")


def lost(p: Plan) -> bool:
    return any(e.reason == "RankLost" for e in p.events)


def test_a_crash_loop_backs_off_counts_every_incarnation_and_ends_failed() -> None:
    w = new_world(make_ecs("a").replicas(2).set("scaling.maxRecoveries", 3).expert_parallel().obj())
    w.converge()
    w.crash = {"a-engine-1"}  # e.g. a bad engine flag: every incarnation's rank 1 exits at start
    w.fail("a-engine-1", "container engine exited with 2 (Error)")

    waits = []
    for attempt in (1, 2, 3):
        p = step_until(w, lost, what=f"loss {attempt}")
        rec = w.status.recovery
        assert rec is not None
        assert (rec.attempt, w.status.recoveries, w.status.phase) == (attempt, attempt, "Recovering")
        assert "container engine exited with 2 (Error)" in rec.reason
        waits.append(seconds(rec.lostAt, rec.retryAt))
        message = next(e.message for e in p.events if e.reason == "RankLost")
        assert f"recovery {attempt} of 3" in message
        # Nothing is created before retryAt, and the fleet is looked at again then.
        if waits[-1]:
            assert p.requeue_after is not None
            assert p.requeue_after <= waits[-1]
            assert "after a backoff of" in message
    assert waits == [0, 10, 20]
    assert w.events("Recovering")  # the backoff's end, as an event

    p = step_until(w, lost, what="the loss past the budget")

    assert w.status.phase == "Failed"
    assert w.status.recoveries == 3
    assert [e.reason for e in p.events] == ["RankLost", "RecoveriesExhausted"]
    degraded = next(c for c in w.status.conditions if c.type == "Degraded")
    assert degraded.reason == "RecoveriesExhausted"
    assert "gave up after 3 recoveries in a row" in degraded.message
    assert "rank 1 (pod a-engine-1) failed: container engine exited with 2 (Error)" in degraded.message
    assert {a.name for a in p.actions if isinstance(a, Delete)} == {"a-coordinator", "a-frontend", "a-engine-0"}
    assert not [a for a in p.actions if isinstance(a, Apply)]
    assert p.requeue_after is None
    # Given up: nothing more is created however long it waits; the ended pod stays for its logs.
    for _ in range(30):
        w.step()
        w.clock += 60
    assert sorted(w.pods) == ["a-engine-1"]
    assert w.status.phase == "Failed"
    assert w.status.recoveries == 3
    assert w.log[-1].actions == ()
    assert w.log[-1].events == ()
    # A new spec starts a new streak.
    w.crash = set()
    w.set_spec(make_ecs("a").replicas(2).set("scaling.maxRecoveries", 3).expert_parallel().arg("--max-model-len=256")
               .obj().spec)
    p = w.step()
    assert w.current().phase == "Restarting"
    assert "a-engine-1" in {a.name for a in p.actions if isinstance(a, Delete)}
    w.converge()
    assert w.current().phase == "Running"
    assert w.status.recovery is None
    assert w.status.recoveries == 3


def seconds(start: str | None, end: str | None) -> float:
    assert start is not None
    assert end is not None
    fmt = "%Y-%m-%dT%H:%M:%SZ"
    return (datetime.datetime.strptime(end, fmt) - datetime.datetime.strptime(start, fmt)).total_seconds()


def test_the_backoff_doubles_to_five_minutes() -> None:
    from corefleet_operator.planner import backoff_seconds

    assert [backoff_seconds(n, scale=1.0) for n in range(1, 9)] == [0, 10, 20, 40, 80, 160, 300, 300]
    assert backoff_seconds(3, scale=0.1) == 2.0


def test_max_recoveries_zero_gives_up_at_the_first_loss() -> None:
    w = new_world(make_ecs("a").replicas(1).set("scaling.maxRecoveries", 0).obj())
    w.converge()
    w.fail("a-engine-0")
    p = w.step()
    assert w.status.phase == "Failed"
    assert w.status.recoveries == 0
    assert "RecoveriesExhausted" in [e.reason for e in p.events]


def test_the_streak_ends_after_ten_minutes_running() -> None:
    w = running(2)
    w.fail("a-engine-0")
    w.converge()
    w.fail("a-engine-0")
    w.step()
    assert w.status.recovery is not None
    assert w.status.recovery.attempt == 2
    w.converge(tick=10)
    assert w.status.recovery is not None  # Running, but not for long yet
    for _ in range(61):
        w.step()
        w.clock += 10
    assert w.current().recovery is None
    assert w.status.recoveries == 2

    w.fail("a-engine-1")
    w.step()

    assert w.status.recovery is not None
    assert w.status.recovery.attempt == 1  # a new streak: no backoff
    assert w.status.recovery.retryAt == w.status.recovery.lostAt
    assert w.status.recoveries == 3


def test_a_spec_change_during_a_backoff_starts_a_new_streak() -> None:
    w = running(2)
    w.crash = {"a-engine-0"}
    w.fail("a-engine-0")
    step_until(w, lost)
    step_until(w, lost)  # the new incarnation's rank 0 crashes too: recovery 2, 10 s backoff
    assert w.status.recovery is not None
    assert w.status.recovery.attempt == 2
    w.crash = set()
    w.set_spec(make_ecs("a").replicas(2).max_replicas(8).arg("--max-model-len=128").obj().spec)
    w.step()
    assert w.current().recovery is None
    w.converge()
    assert w.status.phase == "Running"


@pytest.mark.parametrize("phase", ["Starting", "Running", "ScalingUp", "ScalingDown", "Recovering", "Degraded"])
def test_a_member_lost_in_any_phase_is_one_recovery(phase: str) -> None:
    """Whole-fleet recovery: of an MoE fleet whatever it lost (a dense fleet that serves replaces lost ranks in place,
    `test_a_lost_dense_rank_is_replaced_in_place`), of a dense one while it starts or resizes."""
    ecs = make_ecs("a").replicas(2).max_replicas(8)
    w = new_world((ecs if phase in ("Starting", "ScalingUp", "ScalingDown") else ecs.expert_parallel()).obj())
    if phase == "Starting":
        w.step()
        w.step()  # bound, not started yet
        assert w.status.phase == "Starting"
        w.fail("a-engine-0")
    else:
        w.converge()
    if phase == "Running":
        w.fail("a-engine-0")
    elif phase in ("ScalingUp", "ScalingDown"):
        w.scale(3 if phase == "ScalingUp" else 1)
        w.step()
        w.step()
        assert w.status.phase == "Scaling"
        w.fail("a-engine-0")
    elif phase == "Recovering":
        w.fail("a-engine-1")
        w.step()
        w.step()
        w.step()
        assert w.status.phase == "Recovering"
        assert any(q.fleet_generation == 2 for q in w.pods.values())
        w.fail(next(n for n, q in w.pods.items() if q.fleet_generation == 2 and q.role == constants.ROLE_ENGINE))
    elif phase == "Degraded":
        w.unready("a-engine-1")
        w.step()
        assert w.status.phase == "Degraded"
        w.fail("a-engine-0")
    before = w.status.recoveries

    p = w.step()

    assert lost(p)
    assert w.status.phase == "Recovering"
    assert w.status.recoveries == before + 1
    assert w.status.recovery is not None
    assert w.status.recovery.attempt == before + 1
    w.converge(max_steps=200, tick=5)
    assert w.status.recoveries == before + 1
    assert w.status.replicas == w.fleet.spec.replicas


def test_a_pod_not_ready_within_ready_timeout_is_a_loss() -> None:
    w = new_world(make_ecs("a").replicas(2).set("scaling.readyTimeoutSeconds", 60).obj())
    w.hang = {"a-engine-1"}  # starts, never Ready (e.g. a model load that hangs)
    w.step()
    w.step()
    p = w.step()
    assert p.requeue_after is not None
    assert p.requeue_after <= 61  # woken for the pod's deadline

    p = step_until(w, lost, max_steps=80)

    assert w.clock >= 60
    message = next(e.message for e in p.events if e.reason == "RankLost")
    assert "rank 1 (pod a-engine-1) not ready 60s after it was scheduled (ReadyTimeout)" in message
    assert w.status.phase == "Recovering"
    assert w.status.recoveries == 1
    w.hang = set()
    w.converge(tick=5)
    assert w.current().phase == "Running"


def test_a_running_pod_unready_past_ready_timeout_is_a_loss_a_short_blip_is_not() -> None:
    w = new_world(make_ecs("a").replicas(2).set("scaling.readyTimeoutSeconds", 60).obj())
    w.converge()
    w.unready("a-engine-0")
    for _ in range(50):
        assert not lost(w.step())
    w.pods["a-engine-0"] = replace(w.pods["a-engine-0"], ready=True, unready_since="")
    w.step()
    assert w.status.phase == "Running"
    w.unready("a-engine-0")

    p = step_until(w, lost, max_steps=80)

    assert "ReadyTimeout" in next(e.message for e in p.events if e.reason == "RankLost")
    assert w.status.recoveries == 1


def test_a_rank_the_frontend_reports_dead_is_a_loss() -> None:
    w = running(2)
    assert w.fleet_asks > 0  # asked while the fleet runs
    w.rank_states[1] = RankObs(1, "Dead", message="no heartbeat for 30s")

    p = w.step()

    message = next(e.message for e in p.events if e.reason == "RankLost")
    assert "rank 1 (pod a-engine-1): the frontend reports it Dead: no heartbeat for 30s" in message
    assert w.status.recoveries == 1
    w.rank_states.clear()
    w.converge()


def test_a_rank_unresponsive_for_a_minute_is_a_loss_an_unknown_state_is_not() -> None:
    w = running(2)
    w.rank_states[0] = RankObs(0, "Sleeping")  # a state this operator does not know: not dead
    w.rank_states[1] = RankObs(1, "Unresponsive", since=w.epoch - 30)
    for _ in range(25):
        assert not lost(w.step())
    assert w.status.recoveries == 0

    p = step_until(w, lost, max_steps=20)

    assert w.epoch - 61 >= T0.timestamp() - 30 + 0  # past the grace
    message = next(e.message for e in p.events if e.reason == "RankLost")
    assert "rank 1 (pod a-engine-1): the frontend reports it Unresponsive for 6" in message
    assert "rank 0" not in message


def test_the_frontend_is_not_asked_while_a_resize_runs_nor_while_the_fleet_starts() -> None:
    w = new_world(make_ecs("a").replicas(2).max_replicas(8).obj())
    w.step()
    assert w.fleet_asks == 0
    w.converge()
    w.scale(3)
    w.step()
    asks = w.fleet_asks
    w.step()
    assert w.status.phase == "Scaling"
    assert w.fleet_asks == asks


def test_random_crash_loops_hangs_and_dead_ranks_keep_the_recovery_invariants() -> None:
    """Seeded: pods that crash at start, hang, fail, vanish; the frontend reporting ranks dead; resizes, lost
    statuses and time.
    The invariants (check_invariants, check_recovery_invariants) are checked at every step."""
    rng = random.Random(9)
    failed_runs = 0
    for trial in range(50):
        budget = rng.choice([0, 1, 2, 4])
        w = new_world(make_ecs("c").replicas(rng.randint(1, 3)).max_replicas(5)
                      .set("scaling.maxRecoveries", budget).set("scaling.readyTimeoutSeconds", 60).obj())
        for _ in range(rng.randint(10, 60)):
            roll = rng.random()
            live = [n for n, q in w.pods.items() if not q.terminating and q.phase == "Running"]
            names = ["c-coordinator", "c-frontend", *(f"c-engine-{r}" for r in range(4))]
            if roll < 0.06 and live:
                w.fail(rng.choice(live))
            elif roll < 0.1 and live:
                del w.pods[rng.choice(live)]
            elif roll < 0.14:
                w.crash ^= {rng.choice(names)}
            elif roll < 0.17:
                w.hang ^= {rng.choice(names)}
            elif roll < 0.2 and live:
                w.unready(rng.choice(live))
            elif roll < 0.24:
                r = rng.randint(0, 3)
                w.rank_states[r] = rng.choice([RankObs(r, "Dead"), RankObs(r, "Unresponsive", since=w.epoch),
                                               RankObs(r, "Whatever")])
            elif roll < 0.27:
                w.rank_states.clear()
            elif roll < 0.35:
                w.scale(rng.randint(0, 4))
            elif roll < 0.38:
                w.drop_actions = True
            elif roll < 0.40:
                w.status = EngineCoreSetStatus()  # lost (wiped, an etcd restore): the running pods are adopted
            w.step()
            w.clock += rng.choice([0, 1, 5, 30, 120])
        failed_runs += w.status.phase == "Failed"
        # Healed: the fleet converges, after a spec change if it was given up.
        w.crash, w.hang = set(), set()
        w.rank_states.clear()
        for name, q in w.pods.items():  # hung processes recover too
            if q.phase == "Running" and not q.ready and not q.terminating:
                w.pods[name] = replace(q, ready=True, unready_since="")
        for _ in range(3):  # a pod already past its deadline may still spend the budget: then change the spec
            w.step()
            w.clock += 1
        if w.status.phase == "Failed":
            w.set_spec(replace(w.fleet.spec, replicas=max(1, w.fleet.spec.replicas)))
        w.converge(max_steps=300, tick=10)
        assert w.status.replicas == w.fleet.spec.replicas, trial
    assert failed_runs > 0  # the sequences do reach the budget


def test_a_pods_readiness_deadline_starts_when_it_was_scheduled_or_last_became_unready() -> None:
    from corefleet_operator.observe import pod_obs

    meta = {"uid": "u", "creationTimestamp": "2026-11-29T11:59:00Z", "labels": {}}
    scheduled = {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-11-29T12:00:00Z"}

    def unready_since(spec: dict[str, Any], status: dict[str, Any]) -> str:
        return pod_obs("p", meta, spec, status).unready_since

    bound = {"nodeName": "gpu-node-0"}
    assert unready_since({}, {}) == ""  # not scheduled: no deadline of its own (the Unschedulable condition says why)
    assert unready_since(bound, {}) == "2026-11-29T11:59:00Z"  # no conditions yet: since its creation
    assert unready_since(bound, {"phase": "Pending", "conditions": [scheduled]}) == "2026-11-29T12:00:00Z"
    became_unready = {"type": "Ready", "status": "False", "lastTransitionTime": "2026-11-29T13:00:00Z"}
    assert unready_since(bound, {"phase": "Running", "conditions": [scheduled, became_unready]}) == \
        "2026-11-29T13:00:00Z"
    ready = {"type": "Ready", "status": "True", "lastTransitionTime": "2026-11-29T12:01:00Z"}
    assert unready_since(bound, {"phase": "Running", "conditions": [scheduled, ready]}) == ""
    assert unready_since(bound, {"phase": "Failed", "conditions": [scheduled, became_unready]}) == ""


# ---- a lost dense rank is replaced in place -----------------------------------------------------
def replaced(p: Plan) -> bool:
    return any(e.reason == "RankReplaced" for e in p.events)


LOSSES = ["failed", "vanished", "dead", "unresponsive", "unready"]


def lose(w: World, how: str, name: str) -> None:
    rank = int(name.rsplit("-", 1)[1])
    if how == "failed":
        w.fail(name)
    elif how == "vanished":
        del w.pods[name]
    elif how == "dead":  # its process is gone but the pod still runs (e.g. a sidecar keeps it)
        w.rank_states[rank] = RankObs(rank, "Dead", message="connection lost")
    elif how == "unresponsive":
        w.rank_states[rank] = RankObs(rank, "Unresponsive", since=w.epoch - 61)
    elif how == "unready":
        w.unready(name)
        w.clock += int(w.fleet.spec.scaling.readyTimeoutSeconds) + 1


@pytest.mark.parametrize("how", LOSSES)
def test_a_lost_dense_rank_is_replaced_in_place(how: str) -> None:
    w = running(3)
    uids = {n: q.uid for n, q in w.pods.items()}
    old = w.pods["a-engine-1"]

    lose(w, how, "a-engine-1")
    p = w.step()

    # One loss of the streak, counted; the same incarnation; only rank 1's pod goes.
    assert w.status.phase == "Degraded"
    assert (w.status.recoveries, w.status.fleetGeneration) == (1, 1)
    assert w.status.recovery is not None
    assert w.status.recovery.attempt == 1
    op = w.status.operation
    assert op is not None
    # Its old pod goes first (a vanished one is gone: its new pod is created at once).
    assert (op.replace, op.fromReplicas, op.toReplicas) == ((1,), 3, 3)
    assert op.phase == ("Preparing" if how == "vanished" else "Pending")
    message = next(e.message for e in p.events if e.reason == "RankLost")
    assert "replacing rank 1 in place" in message
    assert "recovery 1 of" in message
    deletes = [a for a in p.actions if isinstance(a, Delete)]
    assert [(a.name, a.uid) for a in deletes] == ([] if how == "vanished" else [("a-engine-1", old.uid)])
    created = [a.obj["metadata"]["name"] for a in p.actions if isinstance(a, Apply) and a.obj["kind"] == "Pod"]
    assert created == (["a-engine-1"] if how == "vanished" else [])
    conditions = {c.type: (c.status, c.reason) for c in w.status.conditions}
    assert conditions["Available"] == ("True", "RanksServing")  # the endpoint serves on the other ranks
    assert conditions["Degraded"] == ("True", "RankReplacing")
    assert conditions["Scaling"] == ("False", "Stable")
    w.rank_states.clear()

    p = step_until(w, replaced, max_steps=40, what="the replacement")

    assert "rank 1 replaced in place" in next(e.message for e in p.events if e.reason == "RankReplaced")
    w.converge()
    assert w.current().phase == "Running"
    assert (w.status.recoveries, w.status.fleetGeneration, w.status.replicas) == (1, 1, 3)
    assert w.status.operation is not None
    assert w.status.operation.phase == "Completed"
    assert w.frontend.started == 1  # asked once, of the frontend that served throughout
    assert w.frontend.uid == uids["a-frontend"]
    new = {n: q.uid for n, q in w.pods.items()}
    assert new["a-engine-1"] != uids["a-engine-1"]
    assert {n: u for n, u in new.items() if n != "a-engine-1"} == {n: u for n, u in uids.items() if n != "a-engine-1"}
    assert all(q.fleet_generation == 1 for q in w.pods.values())
    assert not w.events("Recovering")
    assert not w.events("ResizeStarted")


def test_the_replacement_is_asked_of_the_frontend_only_once_it_reports_the_rank_dead() -> None:
    w = running(2)
    w.rank_states[1] = RankObs(1, "Unresponsive", since=w.epoch - 61)  # hung: its process may still answer
    w.step()
    assert w.status.operation is not None
    assert w.status.operation.replace == (1,)
    for _ in range(5):  # the frontend still holds rank 1's connection (e.g. the process is stopped)
        p = w.step()
        assert not [a for a in p.actions if isinstance(a, StartResize)]
        seen = w.observed().frontend
        assert seen is not None
        assert seen.fleet is not None  # the frontend's view of the ranks comes with its answer
    assert "waiting for the frontend to report rank 1 Dead (rank 1 Unresponsive)" in w.status.operation.message
    assert w.status.phase == "Degraded"
    w.rank_states.clear()  # the connection is gone: Dead

    p = step_until(w, lambda p: any(isinstance(a, StartResize) for a in p.actions), max_steps=5)

    start = next(a for a in p.actions if isinstance(a, StartResize))
    assert (start.replace, start.replicas) == ((1,), 2)
    step_until(w, replaced, max_steps=20)


def operations_across_restarts(w: World, done: Callable[[Plan], object]) -> tuple[set[str], Plan]:
    """Reconcile until `done(plan)`, every other reconcile dying after its status write (an operator restart
    before its actions ran): the operation ids seen, and the last plan."""
    ids = set()
    p = w.log[-1]
    for _ in range(30):
        w.drop_actions = True
        w.step()
        p = w.step()
        assert w.status.operation is not None
        ids.add(w.status.operation.id)
        if done(p):
            break
    return ids, p


def test_an_operator_restart_mid_replacement_continues_the_same_operation() -> None:
    w = running(3)
    w.fail("a-engine-2")
    w.step()
    assert w.status.operation is not None
    first = w.status.operation.id
    ids, _ = operations_across_restarts(w, replaced)
    assert ids == {first}
    assert w.status.operation.phase == "Completed"
    assert w.frontend.started == 1
    assert w.status.recoveries == 1
    w.converge()
    assert w.status.fleetGeneration == 1


def test_a_failed_replacement_recreates_the_whole_fleet() -> None:
    w = running(2)
    w.frontend.join_steps = 5
    w.hang = {"a-engine-1"}  # the new engine starts and never joins
    w.fail("a-engine-1")
    w.step()
    assert w.status.phase == "Degraded"

    p = step_until(w, lost, max_steps=30, what="the failed replacement")

    assert w.current().phase == "Recovering"
    assert (w.status.recoveries, w.status.fleetGeneration) == (2, 2)
    assert w.status.operation is not None
    assert w.status.operation.phase == "Failed"
    message = next(e.message for e in p.events if e.reason == "RankLost")
    assert "the new engine did not join within the join timeout" in message
    assert "recreating the fleet at 2 ranks (incarnation 2), recovery 2 of" in message
    w.hang = set()
    w.converge(max_steps=100, tick=5)
    assert w.current().phase == "Running"


def test_a_rank_that_keeps_dying_is_replaced_after_the_backoff_and_spends_the_budget() -> None:
    w = new_world(make_ecs("a").replicas(2).set("scaling.maxRecoveries", 2).obj())
    w.converge()
    w.fail("a-engine-1")
    step_until(w, replaced, max_steps=20)  # recovery 1: at once
    w.converge()
    w.fail("a-engine-1")  # it dies again, soon after

    p = w.step()

    assert w.status.recovery is not None
    assert (w.status.recovery.attempt, w.status.recoveries) == (2, 2)
    assert seconds(w.status.recovery.lostAt, w.status.recovery.retryAt) == 10
    assert "after a backoff of 10s" in next(e.message for e in p.events if e.reason == "RankLost")
    created_at = None
    for _ in range(20):
        p = w.step()
        if any(isinstance(a, Apply) and a.obj["metadata"]["name"] == "a-engine-1" for a in p.actions):
            created_at = w.clock - 1
            break
        assert p.requeue_after is not None
        assert p.requeue_after <= 10
    assert created_at is not None
    assert created_at >= 10  # not before the backoff's end
    step_until(w, replaced, max_steps=20)
    w.converge()
    w.fail("a-engine-0")  # the third loss in a row: past maxRecoveries 2

    p = w.step()

    assert w.status.phase == "Failed"
    assert w.status.recoveries == 2
    assert [e.reason for e in p.events] == ["RankLost", "RecoveriesExhausted"]


@pytest.mark.parametrize("case", ["frontend and every rank", "coordinator unready", "every rank", "moe",
                                  "during a resize", "second loss during the replacement",
                                  "coordinator during the frontend's replacement", "moe frontend"])
def test_other_losses_recreate_the_whole_fleet(case: str) -> None:
    w = running(2, moe=case.startswith("moe"))
    if case == "frontend and every rank":
        w.fail("a-engine-0")
        w.fail("a-engine-1")
        w.fail("a-frontend", "container frontend exited with 1")
    elif case == "coordinator unready":
        w.unready("a-coordinator")
        w.fail("a-engine-1")
    elif case == "every rank":
        w.fail("a-engine-0")
        w.fail("a-engine-1")
    elif case == "moe":
        w.fail("a-engine-1")
    elif case == "during a resize":
        w.scale(3)
        w.step()
        w.step()
        assert w.status.phase == "Scaling"
        w.fail("a-engine-1")
    elif case == "second loss during the replacement":
        w.fail("a-engine-1")
        w.step()
        assert w.status.phase == "Degraded"
        w.fail("a-engine-0")
    elif case == "coordinator during the frontend's replacement":
        w.fail("a-frontend")
        w.step()
        assert w.status.phase == "Degraded"
        assert w.status.operation is not None
        assert w.status.operation.members == ("frontend",)
        w.fail("a-coordinator")
    else:
        w.fail("a-frontend")

    p = w.step()

    assert lost(p)
    assert w.status.phase == "Recovering"
    assert w.status.fleetGeneration == 2
    op = w.status.operation
    assert not op or not (op.replace or op.members) or op.phase == "Failed"
    assert not [e for e in p.events if e.reason == "MemberLost"]
    w.converge(max_steps=100, tick=5)
    assert w.current().phase == "Running"


def test_random_losses_of_dense_ranks_are_replaced_and_keep_the_invariants() -> None:
    """Seeded: ranks of dense and MoE fleets lost every way while they serve, resize and recover, the operator
    dying mid-reconcile, the frontend unreachable; the replacement invariants are checked at every step."""
    rng = random.Random(2026)
    started = completed = members = 0
    for trial in range(40):
        ecs = make_ecs("d").replicas(rng.randint(1, 4)).max_replicas(5).set("scaling.readyTimeoutSeconds", 60)
        w = new_world((ecs.expert_parallel() if rng.random() < 0.25 else ecs).obj())
        w.frontend.join_steps = rng.choice([3, 20])
        for _ in range(rng.randint(20, 70)):
            roll = rng.random()
            engines = [n for n, q in w.pods.items() if q.role == constants.ROLE_ENGINE and not q.terminating
                       and q.phase == "Running"]
            if roll < 0.12 and engines:
                lose(w, rng.choice(LOSSES), rng.choice(engines))
            elif roll < 0.15:
                live = [n for n, q in w.pods.items() if not q.terminating and q.phase == "Running"]
                if live:
                    w.fail(rng.choice(live))
            elif roll < 0.2:
                w.rank_states.clear()
            elif roll < 0.26:
                w.scale(rng.randint(1, 4))
            elif roll < 0.3:
                w.drop_actions = True
            elif roll < 0.33:
                w.frontend.reachable = not w.frontend.reachable
            elif roll < 0.35:
                w.crash ^= {f"d-engine-{rng.randint(0, 3)}"}
            p = w.step()
            started += any(e.reason == "RankLost" and "in place" in e.message for e in p.events)
            members += any(e.reason == "MemberLost" for e in p.events)
            completed += replaced(p)
            w.clock += rng.choice([0, 0, 1, 5, 30])
        w.frontend.reachable = True
        w.crash = set()
        w.rank_states.clear()
        if w.status.phase == "Failed":
            w.set_spec(replace(w.fleet.spec, replicas=max(1, w.fleet.spec.replicas)))
        for _ in range(400):
            completed += replaced(w.step())
            w.clock += 4
            if w.status.phase == "Running" and w.status.replicas == w.fleet.spec.replicas:
                break
        if w.status.phase == "Failed":
            w.set_spec(replace(w.fleet.spec, replicas=max(1, w.fleet.spec.replicas)))
        w.converge(max_steps=300, tick=10)
        assert w.status.replicas == w.fleet.spec.replicas, trial
    assert started > 10
    assert completed > 5
    assert members > 0  # a lost frontend or coordinator replaced in place (check_member_invariants)


# ---- a lost frontend or coordinator of a dense fleet is replaced in place ------------------------------
def member_replaced(p: Plan) -> bool:
    return any(e.reason in ("FrontendReplaced", "CoordinatorReplaced") for e in p.events)


def created_pods(w: World, since: int = 0) -> list[Mapping[str, Any]]:
    return [a.obj for p in w.log[since:] for a in p.actions if isinstance(a, Apply) and a.obj["kind"] == "Pod"]


def deleted_pods(w: World, since: int = 0) -> list[str]:
    return [a.name for p in w.log[since:] for a in p.actions if isinstance(a, Delete) and a.kind == "Pod"]


def lose_member(w: World, how: str, name: str) -> None:
    if how == "failed":
        w.fail(name, f"container {name} exited with 137 (OOMKilled)")
    elif how == "vanished":  # deleted by someone, gone at once
        del w.pods[name]
    elif how == "terminating":  # deleted by someone, with its grace period
        w.pods[name] = replace(w.pods[name], terminating=True)
    elif how == "unready":  # hung: ReadyTimeout
        w.unready(name)
        w.clock += int(w.fleet.spec.scaling.readyTimeoutSeconds) + 1


@pytest.mark.parametrize("how", ["failed", "vanished", "terminating", "unready"])
@pytest.mark.parametrize("role", [constants.ROLE_FRONTEND, constants.ROLE_COORDINATOR])
def test_a_lost_frontend_or_coordinator_of_a_dense_fleet_is_replaced_in_place(role: str, how: str) -> None:
    w = running(3)
    name = member("a", role)
    uids = {n: q.uid for n, q in w.pods.items()}
    mark = len(w.log)

    lose_member(w, how, name)
    p = w.step()

    # One loss of the streak, counted, without backoff; the same incarnation; only the lost pod goes.
    assert w.status.phase == "Degraded"
    assert (w.status.recoveries, w.status.fleetGeneration, w.status.replicas) == (1, 1, 3)
    assert w.status.recovery is not None
    assert w.status.recovery.attempt == 1
    assert w.status.recovery.retryAt == w.status.recovery.lostAt
    op = w.status.operation
    assert op is not None
    assert (op.members, op.replace, op.fromReplicas, op.toReplicas) == ((role,), (), 3, 3)
    assert op.id.startswith(f"replace-{role}-g1-")
    assert op.phase == ("Preparing" if how == "vanished" else "Pending")
    assert [e.reason for e in p.events] == ["MemberLost"]
    message = p.events[0].message
    assert f"replacing the {role} in place (new pod(s), the engines serve on), recovery 1 of" in message
    assert name in message
    deletes = [(a.name, a.uid) for a in p.actions if isinstance(a, Delete)]
    assert deletes == ([(name, uids[name])] if how in ("failed", "unready") else [])
    conditions = {c.type: (c.status, c.reason) for c in w.status.conditions}
    assert conditions["Degraded"] == ("True", "MemberReplacing")
    assert conditions["Progressing"] == ("True", "ReplacingMembers")
    assert conditions["Scaling"] == ("False", "Stable")

    p = step_until(w, member_replaced, max_steps=40, what="the member replacement")

    told = next(e for e in p.events if e.reason in ("FrontendReplaced", "CoordinatorReplaced"))
    assert told.reason == ("FrontendReplaced" if role == constants.ROLE_FRONTEND else "CoordinatorReplaced")
    assert f"the {role} replaced in place" in told.message
    assert "the engines served on, none restarted" in told.message
    w.converge()
    assert w.current().phase == "Running"
    assert (w.status.recoveries, w.status.fleetGeneration, w.status.replicas) == (1, 1, 3)
    assert w.status.operation is not None
    assert w.status.operation.phase == "Completed"
    # Only the lost pod was deleted and created again; the new frontend attaches to the running engines.
    assert set(deleted_pods(w, mark)) <= {name}
    created = created_pods(w, mark)
    assert [obj["metadata"]["name"] for obj in created] == [name]
    args = created[0]["spec"]["containers"][0]["args"]
    assert ("--attach" in args) is (role == constants.ROLE_FRONTEND)
    new = {n: q.uid for n, q in w.pods.items()}
    assert new[name] != uids[name]
    assert {n: u for n, u in new.items() if n != name} == {n: u for n, u in uids.items() if n != name}
    assert not w.events("RankLost")
    assert not w.events("Recovering")


def test_a_lost_frontend_and_coordinator_are_replaced_in_one_operation() -> None:
    w = running(2)
    uids = {n: q.uid for n, q in w.pods.items()}
    mark = len(w.log)
    w.fail("a-frontend", "container frontend exited with 1")
    del w.pods["a-coordinator"]

    p = w.step()

    op = w.status.operation
    assert op is not None
    assert op.members == ("coordinator", "frontend")
    assert op.id.startswith("replace-coordinator-frontend-g1-")
    assert [e.reason for e in p.events] == ["MemberLost"]
    assert "replacing the coordinator and the frontend in place" in p.events[0].message
    assert (w.status.recoveries, w.status.fleetGeneration) == (1, 1)
    p = step_until(w, member_replaced, max_steps=40)
    assert [e.reason for e in p.events if e.reason.endswith("Replaced")] == ["FrontendReplaced"]
    assert "the coordinator and the frontend replaced in place" in \
        next(e.message for e in p.events if e.reason == "FrontendReplaced")
    w.converge()
    assert sorted(obj["metadata"]["name"] for obj in created_pods(w, mark)) == ["a-coordinator", "a-frontend"]
    assert {n: q.uid for n, q in w.pods.items() if q.role == constants.ROLE_ENGINE} == \
        {n: u for n, u in uids.items() if "engine" in n}
    assert (w.status.recoveries, w.status.fleetGeneration) == (1, 1)


@pytest.mark.parametrize("first", ["a-frontend", "a-coordinator", "a-engine-0", "a-engine-1"])
def test_a_lost_nodes_pods_going_one_at_a_time_are_one_recovery(first: str) -> None:
    """The taint manager (or a drain) deletes a lost node's pods one at a time and each vanishes when it is
    force-deleted: whichever goes first, the fleet is recovered once (the frontend vanishing first while its engines
    are still being deleted is no member replacement that their end would then fail)."""
    w = running(2)
    names = [first, *sorted(n for n in w.pods if n != first)]
    w.stuck = set(names)
    for name in names:  # all deleted, stuck terminating on the lost node
        w.pods[name] = replace(w.pods[name], terminating=True)
    w.step()
    for name in names:  # force-deleted one at a time, a pass between
        w.stuck.discard(name)
        del w.pods[name]
        w.step()
    w.converge(max_steps=100, tick=5)
    assert w.current().phase == "Running"
    assert (w.status.recoveries, w.status.fleetGeneration) == (1, 2)
    assert not w.events("MemberLost")
    assert len(w.events("RankLost")) == 1


@pytest.mark.parametrize("first", ["a-frontend", "a-coordinator"])
def test_an_engine_deleted_while_a_member_replacement_waits_for_the_old_member_is_the_same_recovery(first: str) -> None:
    """`kubectl delete` (or the taint manager) deletes a lost node's pods one call at a time: the member's delete is
    seen first and starts a member replacement, which waits (Pending) for the stuck old pod; an engine's delete seen
    then recreates the fleet, as the same recovery (attempt 1: no backoff), not a second one."""
    w = running(2)
    names = [first, *sorted(n for n in w.pods if n != first)]
    w.stuck = set(names)
    w.pods[first] = replace(w.pods[first], terminating=True)
    w.step()
    assert w.status.operation is not None
    assert w.status.operation.phase == "Pending"
    assert w.status.recoveries == 1
    for name in names[1:]:
        w.pods[name] = replace(w.pods[name], terminating=True)
        w.step()
    for name in names:  # force-deleted one at a time
        w.stuck.discard(name)
        w.step()
    w.converge(max_steps=100, tick=5)
    assert w.current().phase == "Running"
    assert (w.status.recoveries, w.status.fleetGeneration) == (1, 2)
    assert w.status.recovery is not None
    assert w.status.recovery.attempt == 1
    lost = w.events("RankLost")  # (rank 0 first left out of the coordinator's replacement: rank 1 still served)
    assert [m for m in lost if "recreating" in m] == [lost[-1]]
    assert "recreating the fleet at 2 ranks (incarnation 2), recovery 1 of 5 now" in lost[-1]


@pytest.mark.parametrize("when", ["at once", "one at a time"])
@pytest.mark.parametrize("role", [constants.ROLE_FRONTEND, constants.ROLE_COORDINATOR])
def test_engine_ranks_lost_with_a_member_are_left_out_of_its_replacement_and_replaced_after(role: str,
                                                                                          when: str) -> None:
    """A member and an engine rank lost together (a node's pods: seen at once, or deleted one at a time while the
    member's replacement waits for its old pod): the member is replaced in place with the rank left out of the attach
    (a new frontend starts with it Dead), then the rank is replaced in place; one recovery, the same incarnation, the
    other ranks and member untouched."""
    w = running(3)
    name = member(w.fleet.name, role)
    other = member(w.fleet.name, constants.ROLE_COORDINATOR if role == constants.ROLE_FRONTEND
                   else constants.ROLE_FRONTEND)
    stays = {n: q.uid for n, q in w.pods.items() if n in ("a-engine-0", "a-engine-2", other)}
    mark = len(w.log)
    if when == "at once":
        w.fail(name, f"container {role} exited with 137")
        w.fail("a-engine-1")
        p = w.step()
        assert "rank 1 replaced in place after" in next(e.message for e in p.events if e.reason == "MemberLost")
    else:
        w.stuck = {name, "a-engine-1"}
        w.pods[name] = replace(w.pods[name], terminating=True)
        w.step()
        w.pods["a-engine-1"] = replace(w.pods["a-engine-1"], terminating=True)
        p = w.step()
        assert "rank 1 left out of replacement" in next(e.message for e in p.events if e.reason == "RankLost")
        w.stuck.clear()
    op = w.current().operation
    assert op is not None
    assert (op.members, op.detached, w.status.recoveries, w.status.fleetGeneration) == ((role,), (1,), 1, 1)
    step_until(w, member_replaced, max_steps=40, what="the member replaced")
    assert w.events("RankReplacementResumed")
    step_until(w, replaced, max_steps=40, what="rank 1 replaced")
    w.converge(max_steps=100)
    assert (w.status.replicas, w.status.fleetGeneration, w.status.recoveries) == (3, 1, 1)
    assert {n: q.uid for n, q in w.pods.items() if n in stays} == stays
    assert not w.events("Recovering")
    if role == constants.ROLE_FRONTEND:
        args = next(obj for obj in created_pods(w, mark)
                    if obj["metadata"]["name"] == name)["spec"]["containers"][0]["args"]
        assert args[args.index("--detached-ranks") + 1] == "1"


def test_an_engine_lost_while_the_coordinator_is_replaced_is_replaced_after_it_once_its_old_pod_is_gone() -> None:
    """The coordinator's new pod starts (Preparing) when engine 1 fails, and its failed pod's deletion lingers: rank 1
    is left out of the replacement, which does not end (nor rank 1's new pod come) before that pod is gone."""
    w = running(3)
    w.fail("a-coordinator", "container coordinator exited with 137")
    w.hang.add("a-coordinator")
    step_until(w, lambda p: w.pods.get("a-coordinator") is not None and w.pods["a-coordinator"].phase == "Running",
               max_steps=10, what="the new coordinator's pod running, not Ready")
    w.stuck.add("a-engine-1")
    w.fail("a-engine-1")
    p = w.step()
    assert "rank 1 left out of replacement" in next(e.message for e in p.events if e.reason == "RankLost")
    op = w.current().operation
    assert op is not None
    assert (op.members, op.phase, op.detached, w.status.recoveries) == (("coordinator",), "Preparing", (1,), 1)
    w.hang.discard("a-coordinator")
    w.pods["a-coordinator"] = replace(w.pods["a-coordinator"], ready=True, unready_since="")
    w.step()
    w.step()
    waiting = w.current().operation
    assert waiting is not None
    assert (waiting.id, waiting.phase) == (op.id, "Preparing")
    assert "waiting for the old pod(s) a-engine-1 to go" in waiting.message
    w.stuck.discard("a-engine-1")
    step_until(w, replaced, max_steps=40, what="rank 1 replaced")
    w.converge(max_steps=100)
    assert (w.status.replicas, w.status.fleetGeneration, w.status.recoveries) == (3, 1, 1)


def test_a_member_lost_while_an_engine_does_not_serve_recreates_the_fleet() -> None:
    """The new frontend could not re-attach to an engine that does not answer: no member replacement that would
    only time out, the fleet is recreated at once."""
    w = running(2)
    w.unready("a-engine-1")
    w.fail("a-frontend")
    p = w.step()
    assert not w.events("MemberLost")
    assert "recreating the fleet at 2 ranks (incarnation 2), recovery 1 of 5 now" in \
        next(e.message for e in p.events if e.reason == "RankLost")


def test_a_member_lost_while_the_other_is_being_deleted_replaces_both_in_one_operation() -> None:
    w = running(2)
    w.stuck = {"a-coordinator"}
    w.pods["a-coordinator"] = replace(w.pods["a-coordinator"], terminating=True)  # its node drained
    del w.pods["a-frontend"]

    p = w.step()

    op = w.status.operation
    assert op is not None
    assert (op.members, op.phase) == (("coordinator", "frontend"), "Pending")
    assert "replacing the coordinator and the frontend in place" in p.events[0].message
    w.stuck = set()
    step_until(w, member_replaced, max_steps=40)
    w.converge()
    assert (w.status.recoveries, w.status.fleetGeneration) == (1, 1)
    assert len(w.events("MemberLost")) == 1


def test_a_new_frontend_that_fails_recreates_the_fleet() -> None:
    w = running(2)
    w.crash = {"a-frontend"}  # the new frontend exits at start too (e.g. the engines do not re-attach)
    w.fail("a-frontend", "container frontend exited with 1")
    w.step()
    assert w.status.operation is not None
    assert w.status.operation.members == ("frontend",)

    p = step_until(w, lost, max_steps=20, what="the failed member replacement")

    assert w.current().phase == "Recovering"
    assert (w.status.recoveries, w.status.fleetGeneration) == (2, 2)
    assert w.status.operation is not None
    assert w.status.operation.phase == "Failed"
    message = next(e.message for e in p.events if e.reason == "RankLost")
    assert "the new frontend (pod a-frontend) failed" in message
    assert "recreating the fleet at 2 ranks (incarnation 2), recovery 2 of" in message
    assert "ResizeFailed" in [e.reason for e in p.events]
    w.crash = set()
    w.converge(max_steps=100, tick=5)
    assert w.current().phase == "Running"
    frontends = [obj for obj in created_pods(w) if obj["metadata"]["name"] == "a-frontend"]
    assert ["--attach" in obj["spec"]["containers"][0]["args"] for obj in frontends] == [False, True, False]


@pytest.mark.parametrize("rank_first", [False, True])
def test_a_third_member_loss_in_one_streak_recreates_the_fleet_with_its_backoff(rank_first: bool) -> None:
    """Two member losses of a streak are replaced in place, a third recreates the fleet; a rank's loss in the streak
    (CI's order: a rank, then the frontend, then the coordinator) does not count against them
    (`status.recovery.members`)."""
    w = running(2)
    if rank_first:
        w.fail("a-engine-1")
        w.step()
        step_until(w, replaced, max_steps=40, what="the rank replacement")
        w.converge()
        assert w.status.recovery is not None
        assert (w.status.recovery.attempt, w.status.recovery.members) == (1, 0)
    first = 2 if rank_first else 1
    for attempt, role in ((first, "frontend"), (first + 1, "coordinator")):
        w.fail(member("a", role))
        p = w.step()
        assert [e.reason for e in p.events] == ["MemberLost"], p.events
        assert f"recovery {attempt} of 5 now" in p.events[0].message
        step_until(w, member_replaced, max_steps=40)
        w.converge()
        assert w.status.recovery is not None
        assert (w.status.recovery.attempt, w.status.recovery.members) == (attempt, attempt - first + 1)
        assert (w.status.recoveries, w.status.fleetGeneration) == (attempt, 1)
    w.fail("a-frontend")

    p = w.step()

    third = first + 2
    assert w.status.phase == "Recovering"
    assert (w.status.recoveries, w.status.fleetGeneration) == (third, 2)
    assert w.status.recovery is not None
    assert (w.status.recovery.attempt, w.status.recovery.members) == (third, 2)
    wait = seconds(w.status.recovery.lostAt, w.status.recovery.retryAt)
    assert wait == (20 if third == 3 else 40)
    assert f"recreating the fleet at 2 ranks (incarnation 2), recovery {third} of 5 after a backoff of {wait:.0f}s" in \
        next(e.message for e in p.events if e.reason == "RankLost")
    w.converge(max_steps=100)
    assert w.current().phase == "Running"


def test_an_operator_restart_mid_member_replacement_continues_the_same_operation() -> None:
    w = running(2)
    uids = {n: q.uid for n, q in w.pods.items()}
    w.fail("a-frontend")
    w.step()
    assert w.status.operation is not None
    first = w.status.operation.id
    ids, p = operations_across_restarts(w, member_replaced)
    assert ids == {first}
    assert w.status.operation.phase == "Completed"
    assert member_replaced(p)
    assert w.status.recoveries == 1
    assert len(w.events("MemberLost")) == 1
    w.converge()
    assert (w.status.fleetGeneration, w.status.recoveries) == (1, 1)
    new = {n: q.uid for n, q in w.pods.items()}
    assert new["a-frontend"] != uids["a-frontend"]
    assert {n: u for n, u in new.items() if n != "a-frontend"} == {n: u for n, u in uids.items() if n != "a-frontend"}


def test_a_resize_waits_for_a_member_replacement() -> None:
    w = running(2)
    w.fail("a-coordinator")
    w.step()
    w.scale(3)
    while True:
        p = w.step()
        op = w.status.operation
        assert op is not None
        if op.done:
            break
        assert op.members == ("coordinator",)
        assert not [a for a in p.actions if isinstance(a, StartResize)]
        assert "a-engine-2" not in w.pods
        assert w.status.replicas == 2
        assert next(c for c in w.status.conditions if c.type == "Scaling").reason == "Waiting"
    assert op.phase == "Completed"
    w.converge()
    assert (w.status.replicas, w.status.fleetGeneration, w.status.recoveries) == (3, 1, 1)
    assert w.events("ResizeStarted")


# ---- a lost status (issue #9, defect 4) ---------------------------------------------------------
def test_a_wiped_status_adopts_the_newest_incarnations_pods_instead_of_deleting_them() -> None:
    w = running(3)
    w.fail("a-engine-1", "container engine exited with 1")
    w.converge()  # the rank is replaced in place: a later incarnation would do as well
    pods = {n: p.uid for n, p in w.pods.items()}
    generation = w.status.fleetGeneration
    w.status = EngineCoreSetStatus()  # wiped (kubectl patch --subresource=status, an etcd restore)

    p = w.step()

    assert not [a for a in p.actions if isinstance(a, Delete)]
    assert w.events("StatusLost") == [f"the status was empty while pods of incarnation {generation} run: "
                                      "adopted them (3 ranks) instead of recreating the fleet"]
    assert not w.events("Creating")[1:]  # only the first creation's
    assert (w.status.fleetGeneration, w.status.replicas) == (generation, 3)
    w.converge()
    assert w.status.phase == "Running"
    assert {n: p.uid for n, p in w.pods.items()} == pods


def test_a_wiped_status_with_an_incomplete_fleet_adopts_it_as_starting() -> None:
    w = running(2, moe=True)
    del w.pods["a-frontend"]
    w.status = EngineCoreSetStatus()

    w.step()

    assert (w.status.fleetGeneration, w.status.replicas) == (1, 2)
    assert w.events("StatusLost")[-1].endswith("adopted them (2 ranks, incomplete) instead of recreating the fleet")
    w.converge()
    assert w.status.phase == "Running"
    assert w.status.fleetGeneration == 1  # the frontend was created for the adopted incarnation


def status_lost_in_a_scale_down(drained_for: int) -> tuple[World, OperationStatus, dict[str, str]]:
    """A 4-rank fleet scaling down to 2 whose status is wiped while the frontend drains ranks 2..3, `drained_for`
    steps into the drain (it completes after 3); (the world, the resize, the pods that stay)."""
    w = running(4)
    survivors = {n: q.uid for n, q in w.pods.items() if n not in ("a-engine-2", "a-engine-3")}
    w.scale(2)
    w.step()
    w.step()
    op = w.status.operation
    assert op is not None
    assert w.frontend.ops[op.id].phase == "Draining"
    w.frontend.ops[op.id].age = drained_for
    w.status = EngineCoreSetStatus()
    return w, op, survivors


def test_a_status_lost_during_a_scale_down_follows_the_frontends_resize_to_its_end() -> None:
    w, op, survivors = status_lost_in_a_scale_down(-5)  # a long drain: requests still in flight on ranks 2..3

    w.step()  # adopted from the pods: the 4 ranks, serving
    assert w.events("StatusLost")[-1].endswith("adopted them (4 ranks) instead of recreating the fleet")
    p = w.step()  # the frontend's view of the fleet: its resize runs

    assert w.events("ResizeAdopted") == [f"resize {op.id} (4 -> 2) runs on the frontend and the status does not "
                                         "record it (lost?): followed as the operation in flight"]
    assert w.status.operation is not None
    assert (w.status.operation.id, w.status.phase, w.status.replicas) == (op.id, "Scaling", 4)
    assert not [a for a in p.actions if isinstance(a, StartResize | Delete)]  # rank 2 and 3's pods wait for it
    w.converge()
    assert w.events("ResizeCompleted")[-1].startswith(f"resize {op.id}: the fleet serves at 2 ranks")
    assert len(w.events("ResizeStarted")) == 1  # no second resize asked of the frontend (it would refuse it)
    assert (w.status.replicas, w.status.fleetGeneration, w.status.recoveries) == (2, 1, 0)
    assert {n: q.uid for n, q in w.pods.items()} == survivors


def test_a_status_lost_during_a_scale_up_follows_the_frontends_resize_from_the_size_it_started_at() -> None:
    w = running(1)
    w.hang |= {"a-engine-2"}  # its engine is slow to start: the resize waits for it
    w.scale(3)
    for _ in range(3):
        w.step()
    op = w.status.operation
    assert op is not None
    assert w.frontend.ops[op.id].phase == "Preparing"
    kept = {n: q.uid for n, q in w.pods.items()}
    w.status = EngineCoreSetStatus()

    w.step()
    w.step()

    assert w.events("ResizeAdopted") == [f"resize {op.id} (1 -> 3) runs on the frontend and the status does not "
                                         "record it (lost?): followed as the operation in flight"]
    assert w.status.operation is not None
    assert (w.status.operation.id, w.status.replicas) == (op.id, 1)  # committed: the size it started at
    w.hang.clear()
    w.pods["a-engine-2"] = replace(w.pods["a-engine-2"], ready=True, unready_since="")
    w.converge()
    assert w.events("ResizeCompleted")[-1].startswith(f"resize {op.id}: the fleet serves at 3 ranks")
    assert len(w.events("ResizeStarted")) == 1
    assert (w.status.replicas, w.status.fleetGeneration) == (3, 1)
    assert {n: q.uid for n, q in w.pods.items()} == kept  # the new ranks' pods were kept, not made again


def test_a_status_lost_after_the_frontend_completed_a_scale_down_takes_the_frontends_size() -> None:
    w, _, survivors = status_lost_in_a_scale_down(5)  # done draining: the frontend completes it on its next step

    w.step()  # adopted from the pods (4 ranks) as the frontend completes the resize
    assert w.frontend.size == 2
    p = w.step()

    assert w.events("ResizeAdopted") == ["the frontend serves 2 ranks and the status says 4 (lost?): ranks 2..3 "
                                         "retired on the frontend, their pods go"]
    assert sorted(a.name for a in p.actions if isinstance(a, Delete)) == ["a-engine-2", "a-engine-3"]
    assert not [a for a in p.actions if isinstance(a, StartResize)]
    w.converge()
    assert (w.status.replicas, w.status.fleetGeneration, w.status.recoveries) == (2, 1, 0)
    assert {n: q.uid for n, q in w.pods.items()} == survivors


def test_a_lost_status_is_adopted_up_to_the_highest_ranks_pod() -> None:
    w = running(3)
    del w.pods["a-engine-1"]  # its pod went (being replaced) when the status was lost
    w.status = EngineCoreSetStatus()

    p = w.step()

    assert (w.status.fleetGeneration, w.status.replicas) == (1, 3)
    assert w.events("StatusLost")[-1].endswith("adopted them (3 ranks, incomplete) instead of recreating the fleet")
    assert "a-engine-2" not in [a.name for a in p.actions if isinstance(a, Delete)]


# ---- several frontends (spec.frontend.replicas) ---------------------------------------------------------------
def running_frontends(replicas: int, frontends: int) -> World:
    w = new_world(make_ecs("a").replicas(replicas).max_replicas(8).set("frontend.replicas", frontends).obj())
    w.converge()
    assert w.status.phase == "Running"
    return w


def test_a_fleet_with_two_frontends_has_both_pods_and_status_says_which_serve() -> None:
    w = running_frontends(2, 2)
    assert sorted(n for n, q in w.pods.items() if q.role == constants.ROLE_FRONTEND) == ["a-frontend", "a-frontend-1"]
    assert [(f.pod, f.ready) for f in w.status.frontends] == [("a-frontend", True), ("a-frontend-1", True)]
    conditions = {c.type: c for c in w.status.conditions}
    assert conditions["Available"].message == "2/2 ranks serving through 2/2 frontends"
    w.unready("a-frontend-1")
    w.step()
    assert [(f.pod, f.ready) for f in w.status.frontends] == [("a-frontend", True), ("a-frontend-1", False)]
    assert {c.type: c for c in w.status.conditions}["Available"].status == "True"  # frontend 0 serves on


@pytest.mark.parametrize("how", ["failed", "vanished"])
def test_a_lost_second_frontend_is_replaced_in_place_attaching_with_its_index_and_frontend_0_untouched(
        how: str) -> None:
    w = running_frontends(2, 2)
    uids = {n: q.uid for n, q in w.pods.items()}
    mark = len(w.log)
    lose_member(w, how, "a-frontend-1")

    p = w.step()

    op = w.status.operation
    assert op is not None
    assert (op.members, op.fromReplicas, op.toReplicas) == (("frontend-1",), 2, 2)
    assert op.id.startswith("replace-frontend-1-g1-")
    assert "replacing the frontend-1 in place" in next(e.message for e in p.events if e.reason == "MemberLost")
    step_until(w, member_replaced, max_steps=40, what="frontend 1 replaced")
    w.converge()
    created = created_pods(w, mark)
    assert [obj["metadata"]["name"] for obj in created] == ["a-frontend-1"]
    args = created[0]["spec"]["containers"][0]["args"]
    assert "--attach" in args
    assert args[args.index("--client-index") + 1] == "1"
    assert {n: u for n, u in uids.items() if n != "a-frontend-1"} == \
        {n: q.uid for n, q in w.pods.items() if n != "a-frontend-1"}
    assert (w.status.recoveries, w.status.fleetGeneration) == (1, 1)


@pytest.mark.parametrize("direction", ["up", "down"])
def test_a_second_frontend_lost_during_a_resize_is_replaced_once_the_resize_ended(direction: str) -> None:
    """Frontend 0 runs the resize and passes over (or fails it for) a follower it cannot reach: the operator lets
    the resize end, without counting the follower's loss meanwhile or creating its pod, then replaces it in place
    at the size the resize left (attaching); no engine restarts."""
    w = running_frontends(2 if direction == "up" else 3, 2)
    w.scale(3 if direction == "up" else 2)
    step_until(w, lambda p: w.status.operation is not None and w.status.operation.phase in ("Preparing", "Draining"),
               max_steps=10, what="the resize under way")
    resize = w.status.operation
    assert resize is not None
    engines = {n: q.uid for n, q in w.pods.items() if n in ("a-engine-0", "a-engine-1")}
    mark = len(w.log)
    del w.pods["a-frontend-1"]

    w.step()

    assert w.status.recoveries == 0  # not a loss while the resize runs
    assert "a-frontend-1" not in [obj["metadata"]["name"] for obj in created_pods(w, mark)]
    step_until(w, lambda p: w.status.operation is not None and w.status.operation.id != resize.id, max_steps=60,
               what="the resize ended and frontend 1's replacement started")
    op = w.status.operation
    assert op is not None
    assert op.members == ("frontend-1",)
    step_until(w, member_replaced, max_steps=40, what="frontend 1 replaced")
    w.converge(max_steps=100)
    assert (w.status.replicas, w.status.fleetGeneration, w.status.recoveries) == (w.fleet.spec.replicas, 1, 1)
    assert {n: q.uid for n, q in w.pods.items() if n in engines} == engines
    args = next(obj for obj in created_pods(w, mark)
                if obj["metadata"]["name"] == "a-frontend-1")["spec"]["containers"][0]["args"]
    assert "--attach" in args


def test_a_lost_rank_of_a_fleet_with_two_frontends_is_replaced_in_place_through_frontend_0() -> None:
    """Frontend 0 takes the replacement and drives the other frontends through their part (the new engine's INIT
    names every frontend): the operator asks frontend 0 alone, as with one frontend; no other pod changes."""
    w = running_frontends(2, 2)
    uids = {n: q.uid for n, q in w.pods.items()}
    w.fail("a-engine-1", "container engine exited with 137 (OOMKilled)")
    p = w.step()
    assert "replacing rank 1 in place" in next(e.message for e in p.events if e.reason == "RankLost")
    op = w.status.operation
    assert op is not None
    assert op.replace == (1,)
    step_until(w, replaced, max_steps=40, what="the replacement")
    w.converge()
    assert (w.current().phase, w.status.fleetGeneration, w.status.recoveries) == ("Running", 1, 1)
    assert {n: q.uid for n, q in w.pods.items() if n != "a-engine-1"} == \
        {n: u for n, u in uids.items() if n != "a-engine-1"}
    assert w.frontend.started == 1


def test_a_second_frontend_lost_during_a_replacement_of_a_rank_is_replaced_once_it_ended() -> None:
    """Frontend 0 passes over a follower it cannot reach: the operator does not count its loss or create its pod
    while the replacement runs, then replaces it in place (attaching); the engines that served stay."""
    w = running_frontends(2, 2)
    w.fail("a-engine-1", "container engine exited with 137 (OOMKilled)")
    w.step()
    replacement = w.status.operation
    assert replacement is not None
    assert replacement.replace == (1,)
    engine0 = w.pods["a-engine-0"].uid
    mark = len(w.log)
    del w.pods["a-frontend-1"]

    w.step()

    assert w.status.recoveries == 1  # the rank's loss only
    assert "a-frontend-1" not in [obj["metadata"]["name"] for obj in created_pods(w, mark)]
    step_until(w, lambda p: w.status.operation is not None and w.status.operation.id != replacement.id,
               max_steps=60, what="the replacement ended and frontend 1's replacement started")
    op = w.status.operation
    assert op is not None
    assert op.members == ("frontend-1",)
    step_until(w, member_replaced, max_steps=40, what="frontend 1 replaced")
    w.converge(max_steps=100)
    assert (w.current().phase, w.status.fleetGeneration, w.status.recoveries) == ("Running", 1, 2)
    assert w.pods["a-engine-0"].uid == engine0
    args = next(obj for obj in created_pods(w, mark)
                if obj["metadata"]["name"] == "a-frontend-1")["spec"]["containers"][0]["args"]
    assert "--attach" in args


@pytest.mark.parametrize(("before", "after"), [(1, 2), (2, 1)])
def test_a_change_of_the_frontend_count_recreates_the_fleet_as_a_configuration_change(before: int, after: int) -> None:
    """The engines learn every frontend's sockets when they start: a change of spec.frontend.replicas recreates the
    fleet (Restarting), and the frontend a larger count adds is no pod that vanished (no recovery)."""
    w = running_frontends(2, before)
    w.fleet = make_ecs("a").replicas(2).max_replicas(8).set("frontend.replicas", after).obj()
    w.generation += 1
    p = w.step()
    assert [e.reason for e in p.events] == ["Restarting"]
    assert (w.status.phase, w.status.fleetGeneration, w.status.recoveries) == ("Restarting", 2, 0)
    w.converge(max_steps=100)
    assert w.current().phase == "Running"
    frontends = sorted(n for n, q in w.pods.items() if q.role == constants.ROLE_FRONTEND)
    assert frontends == constants.frontend_names("a", after)
    assert w.status.recoveries == 0


# ---- scale to zero in place (spec.idle) -----------------------------------------------------------
def running_idle(replicas: int = 2, after: int | None = None, wake_on_request: bool = True) -> World:
    idle: dict[str, Any] = {"wakeOnRequest": wake_on_request}
    if after is not None:
        idle["afterSeconds"] = after
    w = new_world(make_ecs("a").replicas(replicas).max_replicas(8).set("idle", idle).obj())
    w.converge()
    assert w.status.phase == "Running"
    return w


def until_phase(w: World, phase: str, max_steps: int = 60) -> None:
    step_until(w, lambda p: p.status.phase == phase, max_steps=max_steps, what=phase)


def engine_pods(w: World) -> list[str]:
    return sorted(n for n, q in w.pods.items() if q.role == constants.ROLE_ENGINE)


def members_uids(w: World) -> dict[str, str]:
    return {n: q.uid for n, q in w.pods.items() if q.role != constants.ROLE_ENGINE}


def condition(w: World, ctype: str) -> tuple[str, str, str]:
    c = next(c for c in w.current().conditions if c.type == ctype)
    return c.status, c.reason, c.message


def test_replicas_zero_with_idle_set_idles_in_place_and_replicas_back_wakes_it_in_place() -> None:
    w = running_idle(2)
    members = members_uids(w)
    w.scale(0)
    until_phase(w, "Idle")
    w.converge(phases=("Idle",))

    status = w.current()
    assert engine_pods(w) == []
    assert members_uids(w) == members
    assert status.replicas == 2
    assert status.readyReplicas == 0
    assert status.ranks == ()
    assert status.idle is not None
    assert status.idle.cause == "ReplicasZero"
    assert status.fleetGeneration == 1
    assert status.recoveries == 0
    assert condition(w, "Available")[:2] == ("False", "Idle")
    assert condition(w, "Degraded")[:2] == ("False", "AsExpected")
    assert w.frontend.idle == {0, 1}
    assert len(w.events("FleetIdling")) == 1
    assert len(w.events("FleetIdle")) == 1
    assert not w.events("Stopping")
    assert not w.events("RankLost")

    w.scale(2)
    until_phase(w, "Waking")
    w.converge()
    status = w.current()
    assert status.phase == "Running"
    assert status.idle is None
    assert status.readyReplicas == 2
    assert engine_pods(w) == ["a-engine-0", "a-engine-1"]
    assert members_uids(w) == members
    assert status.fleetGeneration == 1
    assert status.recoveries == 0
    assert w.frontend.idle == set()
    assert len(w.events("FleetWaking")) == 1
    assert len(w.events("FleetAwake")) == 1
    assert "replicas is 2" in w.events("FleetWaking")[0]
    assert not w.events("FleetReady")[1:]  # the fleet was ready once: at its creation


def test_a_quiet_fleet_idles_after_its_idle_period_and_a_held_request_wakes_it() -> None:
    w = running_idle(2, after=300)
    w.frontend.quiet = 299
    for _ in range(5):
        w.step()
    assert w.status.phase == "Running"
    assert not w.events("FleetIdling")

    w.frontend.quiet = 300
    until_phase(w, "Idle")
    idle = w.current().idle
    assert idle is not None
    assert idle.cause == "Quiet"
    asks = w.fleet_asks
    for _ in range(20):  # idle: its frontend is asked every pass whether requests wait
        p = w.step()
        assert p.status.phase == "Idle"
        assert not p.actions
        assert p.requeue_after is not None
        assert p.requeue_after <= 1.0
    assert w.fleet_asks == asks + 20
    assert engine_pods(w) == []

    w.frontend.waiting = 3
    p = w.step()
    assert p.status.phase == "Waking"
    assert "3 request(s) waiting" in w.events("FleetWaking")[0]
    assert sorted(a.obj["metadata"]["name"] for a in p.actions if isinstance(a, Apply)
                  and a.obj["kind"] == "Pod") == ["a-engine-0", "a-engine-1"]  # created in the same pass
    w.frontend.waiting = 0
    w.converge()
    assert w.status.phase == "Running"
    assert w.status.replicas == 2
    assert w.frontend.idle == set()


def test_without_wake_on_request_a_held_request_does_not_wake_the_fleet_but_replicas_does_then_resizes() -> None:
    w = running_idle(2, after=60, wake_on_request=False)
    w.frontend.quiet = 61
    until_phase(w, "Idle")
    w.frontend.waiting = 5
    for _ in range(10):
        assert w.step().status.phase == "Idle"
    assert "a request wakes it" not in condition(w, "Available")[2]

    w.scale(3)  # another size: it wakes at the size it idled at, then resizes in place
    until_phase(w, "Waking")
    w.frontend.quiet = 0
    w.converge(max_steps=80)
    assert w.status.replicas == 3
    assert w.status.phase == "Running"
    assert w.status.fleetGeneration == 1
    assert "replicas is 3 (it idled at 2)" in w.events("FleetWaking")[0]
    assert len(w.events("ResizeCompleted")) == 1
    assert w.status.recoveries == 0


def test_a_request_during_the_drain_to_idle_cancels_it_and_the_fleet_serves_on() -> None:
    w = running_idle(2)
    engines = {n: w.pods[n].uid for n in engine_pods(w)}
    w.frontend.interrupt_idle = True
    w.scale(0)
    step_until(w, lambda p: any(e.reason == "IdleCancelled" for e in p.events), what="IdleCancelled")
    assert w.status.phase == "Running"
    assert w.status.idle is None
    assert {n: w.pods[n].uid for n in engine_pods(w)} == engines  # nothing deleted, nothing lost
    assert "a request arrived" in w.events("IdleCancelled")[0]
    for _ in range(20):  # at replicas 0 it is tried again, not at once
        w.step()
    assert len(w.events("FleetIdling")) == 1
    w.frontend.interrupt_idle = False
    w.clock += int(RESIZE_RETRY_SECONDS)
    until_phase(w, "Idle")
    assert len(w.events("FleetIdling")) == 2
    assert engine_pods(w) == []


def test_a_wake_that_cannot_succeed_leaves_the_fleet_idle_says_why_and_retries_after_the_backoff() -> None:
    w = running_idle(2, after=60)
    members = members_uids(w)
    w.frontend.quiet = 61
    until_phase(w, "Idle")
    w.crash = {"a-engine-1"}  # its container exits as soon as it starts
    w.frontend.waiting = 4
    step_until(w, lambda p: any(e.reason == "WakeFailed" for e in p.events), what="WakeFailed")
    status = w.current()
    assert status.idle is not None
    assert status.idle.wakeFailures == 1
    assert "rank 1" in status.idle.message
    assert status.idle.retryAt is not None
    assert status.operation is not None
    assert status.operation.wake
    assert status.operation.phase == "Failed"
    assert condition(w, "Degraded")[:2] == ("True", "WakeFailed")
    assert w.frontend.ops[status.operation.id].phase == "Failed"  # cancelled at the frontend: its ranks stay Idle
    until_phase(w, "Idle")
    assert engine_pods(w) == []
    assert members_uids(w) == members
    assert w.status.fleetGeneration == 1
    assert w.status.recoveries == 0
    assert not w.events("RankLost")
    # the next wake waits for the backoff (10 s after the first failure)
    retry_at = status.idle.retryAt
    while w.now < retry_at:
        assert w.step().status.phase == "Idle"
    w.crash = set()
    w.converge()
    assert w.status.phase == "Running"
    assert w.status.idle is None
    assert len(w.events("FleetWaking")) == 2
    assert members_uids(w) == members


def test_wake_failures_back_off_longer_each_time() -> None:
    w = running_idle(1, after=60)
    w.frontend.quiet = 61
    until_phase(w, "Idle")
    w.crash = {"a-engine-0"}
    w.frontend.waiting = 1
    waits = []
    for failures in (1, 2, 3):
        step_until(w, lambda p: p.status.idle is not None and p.status.idle.wakeFailures == failures,  # noqa: B023
                   what=f"failure {failures}")
        idle = w.current().idle
        assert idle is not None
        waits.append(seconds(w.now, idle.retryAt) + 1)
    assert waits[0] < waits[1] < waits[2]


def test_an_operator_restart_at_any_step_of_going_idle_and_waking_changes_nothing() -> None:
    baseline = running_idle(2)
    baseline.scale(0)
    baseline.converge(phases=("Idle",))
    steps = len(baseline.log)
    for k in range(1, 25):
        w = running_idle(2)
        members = members_uids(w)
        start = len(w.log)
        w.scale(0)
        for i in range(80):
            w.drop_actions = i in (k, k + 1)  # the operator dies after writing its status, twice in a row
            if w.step().status.phase == "Idle" and not w.frontend.running():
                break
        w.converge(phases=("Idle",))
        assert (engine_pods(w), members_uids(w)) == ([], members), k
        w.scale(2)
        for i in range(80):
            w.drop_actions = i in (k, k + 3)
            w.step()
        w.converge()
        assert (w.status.phase, w.status.fleetGeneration, w.status.recoveries) == ("Running", 1, 0), k
        assert members_uids(w) == members, k
        assert len(w.log) - start < 200
    assert steps > 0


def test_a_lost_frontend_while_idle_recreates_the_fleet_awake() -> None:
    w = running_idle(2)
    w.scale(0)
    until_phase(w, "Idle")
    w.fail("a-frontend", "container frontend exited with 137 (OOMKilled)")
    step_until(w, lambda p: p.status.fleetGeneration == 2, what="incarnation 2")
    assert w.status.idle is None
    assert w.status.recoveries == 1
    w.scale(2)
    w.converge()
    assert w.status.phase == "Running"
    assert len(engine_pods(w)) == 2


def test_spec_idle_removed_while_idle_wakes_at_replicas_and_stops_at_zero() -> None:
    w = running_idle(2, after=60)
    w.frontend.quiet = 61
    until_phase(w, "Idle")
    w.set_spec(replace(w.fleet.spec, idle=None))
    w.converge()
    assert w.status.phase == "Running"
    assert "spec.idle was removed" in w.events("FleetWaking")[0]

    w = running_idle(2)
    w.scale(0)
    until_phase(w, "Idle")
    w.set_spec(replace(w.fleet.spec, idle=None))
    w.converge()
    assert w.status.phase == "Stopped"
    assert w.pods == {}


def test_random_idle_wake_resize_and_failure_sequences_keep_the_invariants_and_converge() -> None:
    rng = random.Random(20261205)
    for trial in range(60):
        w = running_idle(rng.randint(1, 3), after=rng.choice([None, 60]))
        for _ in range(rng.randint(10, 50)):
            roll = rng.random()
            live = [n for n, q in w.pods.items() if not q.terminating and q.phase == "Running"]
            if roll < 0.06 and live:
                w.fail(rng.choice(live))
            elif roll < 0.2:
                w.scale(rng.choice([0, 0, 1, 2, 3]))
            elif roll < 0.27:
                w.drop_actions = True
            elif roll < 0.32:
                w.frontend.reachable = not w.frontend.reachable
            elif roll < 0.4:
                w.frontend.quiet = rng.choice([0.0, 120.0])
                w.frontend.waiting = rng.choice([0, 0, 2])
            elif roll < 0.44:
                w.frontend.interrupt_idle = not w.frontend.interrupt_idle
            elif roll < 0.47:
                w.crash = {"a-engine-0"} if not w.crash else set()
            w.step()
            w.clock += rng.choice([0, 0, 5, 60])
        w.frontend.reachable, w.frontend.interrupt_idle, w.crash = True, False, set()
        w.frontend.quiet, w.frontend.waiting = 0.0, 0
        spec = w.fleet.spec
        w.clock += int(RESIZE_RETRY_SECONDS)
        w.converge(max_steps=300, tick=10, phases=("Idle", "Stopped") if spec.replicas == 0 else ("Running", "Idle"))
        if spec.replicas > 0 and w.status.phase == "Idle":  # idle after its quiet period: a request wakes it
            idle = w.current().idle
            assert idle is not None, trial
            assert (idle.cause, spec.idle is not None) == ("Quiet", True), trial
            w.frontend.waiting = 1
            until_phase(w, "Waking")
            w.frontend.waiting = 0
            w.converge(max_steps=300, tick=10)
        if spec.replicas == 0:
            assert w.status.idle is not None or w.status.phase == "Stopped", trial
            assert engine_pods(w) == [], trial
        else:
            assert (w.status.replicas, w.status.idle) == (spec.replicas, None), trial
            assert engine_pods(w) == [f"a-engine-{i}" for i in range(spec.replicas)], trial
        assert len(w.frontend.running()) == 0, trial
