# SPDX-License-Identifier: Apache-2.0
"""The EngineCoreSet's status, computed whole by pure functions.

Conditions follow metav1.Condition: CamelCase reasons, `observedGeneration`, and a
`lastTransitionTime` that changes only when a condition's status flips. The handler writes the
result once per reconcile, and only if it differs from what is stored (`status_patch`).

Pure module: no kopf, no Kubernetes client, no I/O.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from corefleet_operator import constants
from corefleet_operator.models import (
    JSON,
    Condition,
    EngineCoreSetStatus,
    FleetPhase,
    FleetRef,
    FrontendStatus,
    IdleStatus,
    OperationStatus,
    RankPhase,
    RankStatus,
    RecoveryStatus,
    SpecError,
    to_json,
)
from corefleet_operator.observe import PodObs

AVAILABLE = "Available"
PROGRESSING = "Progressing"
SCALING = "Scaling"
DEGRADED = "Degraded"
POD_TERMINAL = ("Failed", "Succeeded")  # pod phases after its containers exited


@dataclass(frozen=True)
class Decision:
    """What the planner decided about the fleet as a whole."""

    phase: FleetPhase
    fleet_generation: int
    recoveries: int
    replicas: int  # the committed data-parallel size
    ranks: tuple[RankStatus, ...] = ()
    operation: OperationStatus | None = None  # the resize in flight, else the last one
    new_incarnation: bool = False  # the fleet is recreated now (its readiness deadline starts again)
    desired: int = 0  # spec.replicas
    retry_in: float | None = None  # a failed resize to `desired` is tried again in this many seconds
    recovery: RecoveryStatus | None = None  # the recovery streak the fleet is in
    max_recoveries: int = 0  # spec.scaling.maxRecoveries
    redundant_experts: int | None = None  # MoE: R at `replicas` after the last in-place resize
    idle: IdleStatus | None = None  # the fleet is idle (`planner.idle`)


def exhausted_message(recovery: RecoveryStatus, budget: int) -> str:
    """Why a fleet was given up (condition RecoveriesExhausted, and its event)."""
    return (f"gave up after {recovery.attempt} recoveries in a row (maxRecoveries {budget}); the last loss, at "
            f"{recovery.lostAt}: {recovery.reason}; pods that ended are kept for their logs; change the spec to "
            "start again")


def set_condition(conditions: Sequence[Condition], new: Condition) -> tuple[Condition, ...]:
    """Replace the condition of `new.type`, keeping lastTransitionTime unless the status flips."""
    out = []
    found = False
    for c in conditions:
        if c.type == new.type:
            found = True
            if c.status == new.status and c.lastTransitionTime:
                new = replace(new, lastTransitionTime=c.lastTransitionTime)
            out.append(new)
        else:
            out.append(c)
    if not found:
        out.append(new)
    return tuple(out)


def _cond(ctype: str, ok: bool, reason: str, message: str, generation: int, now: str) -> Condition:
    status: Literal["True", "False"] = "True" if ok else "False"
    return Condition(type=ctype, status=status, reason=reason, message=message,
                     lastTransitionTime=now, observedGeneration=generation)


def rank_phase(pod: PodObs | None) -> RankPhase:
    if pod is None or not pod.node:
        return "Pending"
    if pod.phase in POD_TERMINAL:
        return "Failed"
    if pod.phase == "Running" and pod.ready:
        return "Serving"
    return "Joining"


def endpoint(fleet: FleetRef) -> str:
    return (f"http://{constants.service_name(fleet.name)}.{fleet.namespace}.svc:"
            f"{fleet.spec.frontend.port}/v1")


def _seconds(start: str, end: str) -> float:
    fmt = "%Y-%m-%dT%H:%M:%SZ"
    try:
        return (datetime.datetime.strptime(end, fmt) - datetime.datetime.strptime(start, fmt)).total_seconds()
    except ValueError:
        return 0.0


@dataclass(frozen=True)
class _Facts:
    """What the conditions are computed from: the decision, and what its pods say of the fleet."""

    fleet: FleetRef
    decision: Decision
    generation: int  # the spec generation the conditions are computed for
    now: str
    by_name: Mapping[str, PodObs]  # the pods of the decided incarnation
    ready: int  # ranks serving, below the committed size
    frontend_ready: bool  # at least one frontend serves the Service
    frontends_ready: int = 0

    @property
    def n(self) -> int:
        return self.decision.replicas

    @property
    def op(self) -> OperationStatus | None:
        return self.decision.operation

    @property
    def replacing(self) -> bool:
        """Lost dense ranks, or the frontend and/or coordinator, are replaced in place."""
        return self.op is not None and not self.op.done and bool(self.op.replace or self.op.members)

    @property
    def resizing(self) -> bool:
        """A resize in place runs."""
        return self.op is not None and not self.op.done and not self.replacing

    @property
    def given_up(self) -> bool:
        return self.decision.phase == "Failed" and self.decision.recovery is not None

    def cond(self, ctype: str, ok: bool, reason: str, message: str) -> Condition:
        return _cond(ctype, ok, reason, message, self.generation, self.now)


def compute_status(fleet: FleetRef, generation: int, old: EngineCoreSetStatus, pods: Iterable[PodObs],
                   decision: Decision, now: str) -> EngineCoreSetStatus:
    """The whole status for the pods that belong to the fleet's current incarnation."""
    by_name = {p.name: p for p in pods if p.fleet_generation == decision.fleet_generation}
    frontends = tuple(FrontendStatus(pod=name, ready=_serving(by_name.get(name)))
                      for name in constants.frontend_names(fleet.name, fleet.spec.frontend.replicas)) \
        if decision.replicas > 0 else ()
    facts = _Facts(fleet=fleet, decision=decision, generation=generation, now=now, by_name=by_name,
                   ready=sum(1 for rk in decision.ranks if rk.phase == "Serving" and rk.rank < decision.replicas),
                   frontend_ready=any(f.ready for f in frontends),
                   frontends_ready=sum(1 for f in frontends if f.ready))
    conditions = old.conditions
    if decision.new_incarnation:  # a new incarnation's readiness deadline starts now
        conditions = tuple(c for c in conditions if c.type != PROGRESSING)
    started = next((c.lastTransitionTime for c in conditions if c.type == PROGRESSING and c.status == "True"), now)
    for c in (_available(facts), _progressing(facts), _scaling(facts), _degraded(facts, started)):
        conditions = set_condition(conditions, c)
    return EngineCoreSetStatus(
        observedGeneration=generation,
        replicas=decision.replicas,
        readyReplicas=facts.ready,
        selector=constants.engine_selector(fleet.name),
        phase=decision.phase,
        conditions=conditions,
        ranks=tuple(decision.ranks),
        operation=decision.operation,
        recoveries=decision.recoveries,
        recovery=decision.recovery,
        fleetGeneration=decision.fleet_generation,
        endpoint=endpoint(fleet),
        frontends=frontends,
        redundantExperts=decision.redundant_experts,
        idle=decision.idle,
    )


def _available(f: _Facts) -> Condition:
    """Available: the endpoint answers with at least one rank behind it."""
    if f.given_up:
        return f.cond(AVAILABLE, False, "RecoveriesExhausted", "the fleet was given up")
    if f.decision.phase == "Stopped":
        return f.cond(AVAILABLE, False, "Stopped", "replicas is 0")
    if f.decision.phase in ("Idle", "Waking") and f.decision.idle is not None:
        return f.cond(AVAILABLE, False, f.decision.phase, _idle_message(f))
    if f.frontend_ready and f.ready > 0:
        count = f.fleet.spec.frontend.replicas
        through = f" through {f.frontends_ready}/{count} frontends" if count > 1 else ""
        return f.cond(AVAILABLE, True, "RanksServing", f"{f.ready}/{f.n} ranks serving{through}")
    if not f.frontend_ready:
        return f.cond(AVAILABLE, False, "FrontendNotReady", "the frontend is not ready")
    return f.cond(AVAILABLE, False, "NoRanksServing", f"0/{f.n} ranks serving")


def _progressing(f: _Facts) -> Condition:
    """Progressing: the fleet is moving towards the spec (its incarnation, a replacement, or a resize)."""
    phase, op = f.decision.phase, f.op
    if f.given_up:
        return f.cond(PROGRESSING, False, "RecoveriesExhausted",
                      "the fleet was given up; nothing is created until its spec changes")
    if f.replacing and op is not None and op.members:
        return f.cond(PROGRESSING, True, "ReplacingMembers", f"{op.id}: {_members_of(op)} replaced in place "
                                                             f"({op.phase})")
    if f.replacing and op is not None:
        return f.cond(PROGRESSING, True, "ReplacingRanks", f"{op.id}: {_ranks(op.replace)} replaced in place "
                                                           f"({op.phase})")
    if phase == "Waking" and op is not None:
        return f.cond(PROGRESSING, True, "Waking", f"{op.id}: {op.message} ({op.phase})")
    if phase == "Idle":
        return f.cond(PROGRESSING, False, "Idle", _idle_message(f))
    if phase in ("Running", "Stopped", "Degraded"):
        return f.cond(PROGRESSING, False, "Complete", f"fleet at {f.n} ranks")
    if phase == "Scaling" and op is not None:
        return f.cond(PROGRESSING, True, "Resizing", f"resize {op.id}: {op.fromReplicas} -> {op.toReplicas}")
    reason = {"Recovering": "Recovering", "Restarting": "Restarting"}.get(phase, "CreatingPods")
    return f.cond(PROGRESSING, True, reason,
                  f"incarnation {f.decision.fleet_generation}: {f.ready}/{f.n} ranks serving")


def _scaling(f: _Facts) -> Condition:
    """Scaling: a resize in place runs, or why none does."""
    op, desired, n = f.op, f.decision.desired, f.n
    if f.resizing and op is not None and op.idle:
        return f.cond(SCALING, True, "GoingIdle", f"{op.id} {op.phase}: {op.message}")
    if f.decision.phase in ("Idle", "Waking"):
        return f.cond(SCALING, False, f.decision.phase, _idle_message(f))
    if f.resizing and op is not None:
        direction = "ScalingUp" if op.scale_up else "ScalingDown"
        return f.cond(SCALING, True, direction, f"resize {op.id} ({op.fromReplicas} -> {op.toReplicas}) "
                                                f"{op.phase}: {op.message}")
    if op is not None and op.phase == "Failed" and desired != n and f.decision.retry_in is not None:
        return f.cond(SCALING, False, "ResizeFailed", f"resize {op.id} ({op.fromReplicas} -> {op.toReplicas}) "
                                                      f"failed: {op.message}; retrying in "
                                                      f"{f.decision.retry_in:.0f}s")
    if desired != n and f.decision.phase != "Stopped":
        return f.cond(SCALING, False, "Waiting", f"replicas is {desired}: the fleet resizes once it runs at {n} "
                                                 f"ranks ({f.decision.phase})")
    return f.cond(SCALING, False, "Stable", f"fleet at {n} ranks")


def _degraded(f: _Facts, started: str) -> Condition:
    """Degraded: something needs attention (`started`: since when the fleet has been progressing)."""
    d, op, n = f.decision, f.op, f.n
    timeout = f.fleet.spec.scaling.readyTimeoutSeconds
    waited = _seconds(started, f.now)
    failed = [rk for rk in d.ranks if rk.phase == "Failed" and rk.rank < n]
    unschedulable = sorted(p.name for p in f.by_name.values() if not p.node and p.message)
    if f.given_up and d.recovery is not None:
        return f.cond(DEGRADED, True, "RecoveriesExhausted", exhausted_message(d.recovery, d.max_recoveries))
    if d.idle is not None and d.idle.wakeFailures and d.phase in ("Idle", "Waking"):
        return f.cond(DEGRADED, True, "WakeFailed", f"{d.idle.wakeFailures} wake(s) failed in a row, the last: "
                                                    f"{d.idle.message}; next try no sooner than {d.idle.retryAt}")
    if f.replacing and op is not None and op.wake:
        return f.cond(DEGRADED, False, "AsExpected", "")
    if f.replacing and op is not None and op.members:
        return f.cond(DEGRADED, True, "MemberReplacing", f"{_members_of(op)} lost: replaced in place ({op.phase}: "
                                                         f"{op.message}); the engines run on")
    if f.replacing and op is not None:
        return f.cond(DEGRADED, True, "RankReplacing", f"{_ranks(op.replace)} lost: replaced in place ({op.phase}: "
                                                       f"{op.message}); {f.ready}/{n} ranks serving")
    if d.phase == "Recovering" and waited <= timeout:
        return f.cond(DEGRADED, True, "RankLost", _recovering_message(f))
    if failed:
        return f.cond(DEGRADED, True, "RankFailed",
                      "; ".join(f"rank {rk.rank}: {rk.message or 'failed'}" for rk in failed))
    if d.phase in ("Starting", "Restarting", "Recovering") and waited > timeout:
        unready = [name for name in _members(f.fleet, n) if not (f.by_name.get(name) and f.by_name[name].ready)]
        detail = "; ".join(f"{name}: {_pod_state(f.by_name.get(name))}" for name in unready) or "no pod is unready"
        return f.cond(DEGRADED, True, "ReadyTimeout", f"not ready {waited:.0f}s after incarnation "
                                                      f"{d.fleet_generation} started (readyTimeoutSeconds {timeout}): "
                                                      f"{detail}")
    if unschedulable:
        return f.cond(DEGRADED, True, "Unschedulable",
                      "; ".join(f"{name}: {f.by_name[name].message}" for name in unschedulable))
    if d.phase == "Degraded":
        return f.cond(DEGRADED, True, "RankNotReady", f"{f.ready}/{n} ranks serving")
    return f.cond(DEGRADED, False, "AsExpected", "")


def _idle_message(f: _Facts) -> str:
    """What an idle (or waking) fleet's conditions say."""
    idle = f.decision.idle
    assert idle is not None
    if f.decision.phase == "Waking":
        return f"waking at {f.n} ranks (idle since {idle.since}): requests wait at the frontend until a rank serves"
    wakes = ("replicas > 0 wakes it" if idle.cause == "ReplicasZero" or f.fleet.spec.idle is None
             or not f.fleet.spec.idle.wakeOnRequest else "a request wakes it")
    return (f"idle since {idle.since} ({'replicas is 0' if idle.cause == 'ReplicasZero' else 'no requests'}): no "
            f"engine pod; the endpoint answers, requests wait at the frontend; {wakes} (at {f.n} ranks)")


def _recovering_message(f: _Facts) -> str:
    """Why a recovering fleet is degraded: the streak, its backoff, and the last loss."""
    d, recovery = f.decision, f.decision.recovery
    detail = f"recovery {d.recoveries}"
    if recovery is not None:
        detail = f"recovery {recovery.attempt} of {d.max_recoveries} in a row, {d.recoveries} in all"
        if recovery.retryAt and _seconds(f.now, recovery.retryAt) > 0:
            detail += f"; backoff until {recovery.retryAt}"
    why = f": {recovery.reason}" if recovery is not None else ""
    return f"recreating the fleet after losing a rank ({detail}){why}"


def _ranks(ranks: Iterable[int]) -> str:
    shown = sorted(ranks)
    return f"rank {shown[0]}" if len(shown) == 1 else "ranks " + ", ".join(str(r) for r in shown)


def _members_of(op: OperationStatus) -> str:
    """The members a replacement gives new pods: `the frontend`, `the coordinator and the frontend`."""
    return " and ".join(f"the {role}" for role in sorted(op.members))


def _members(fleet: FleetRef, replicas: int) -> list[str]:
    if replicas == 0:
        return []
    return [constants.coordinator_name(fleet.name), *constants.frontend_names(fleet.name, fleet.spec.frontend.replicas),
            *(constants.engine_name(fleet.name, r) for r in range(replicas))]


def _serving(pod: PodObs | None) -> bool:
    """A frontend pod in the Service's endpoints: Running and Ready."""
    return pod is not None and pod.ready and pod.phase == "Running"


def _pod_state(pod: PodObs | None) -> str:
    if pod is None:
        return "not created"
    if not pod.node:
        return f"not scheduled ({pod.message})" if pod.message else "not scheduled"
    return f"{pod.phase}, not ready" + (f" ({pod.message})" if pod.message else "")


def invalid_spec_status(generation: int, old: EngineCoreSetStatus, error: SpecError,
                        now: str) -> EngineCoreSetStatus:
    """The stored status with Degraded/InvalidSpec; a fleet that never ran is Failed."""
    conditions = set_condition(old.conditions, _cond(DEGRADED, True, "InvalidSpec", str(error), generation, now))
    if old.fleetGeneration == 0:
        conditions = set_condition(conditions, _cond(AVAILABLE, False, "InvalidSpec", str(error), generation, now))
    phase: FleetPhase = "Failed" if old.fleetGeneration == 0 else old.phase
    return replace(old, observedGeneration=generation, conditions=conditions, phase=phase)


def status_patch(old: JSON | None, new: EngineCoreSetStatus) -> JSON | None:
    """A JSON merge patch from the stored status to `new`, or None when nothing changed."""
    want = to_json(new)
    have = old or {}
    if want == have:
        return None
    patch: dict[str, Any] = dict(want)
    for key in have:
        if key not in want:
            patch[key] = None  # merge patch: remove
    return patch
