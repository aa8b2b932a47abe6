# SPDX-License-Identifier: Apache-2.0
"""The EngineCoreSet's status, computed whole by pure functions.

Conditions follow metav1.Condition: CamelCase reasons, `observedGeneration`, and a
`lastTransitionTime` that changes only when a condition's status flips. The handler writes the
result once per reconcile, and only if it differs from what is stored (`status_patch`).

Pure module: no kopf, no Kubernetes client, no I/O.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from corefleet_operator import constants
from corefleet_operator.models import (
    JSON,
    Condition,
    EngineCoreSetStatus,
    FleetPhase,
    FleetRef,
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


def compute_status(fleet: FleetRef, generation: int, old: EngineCoreSetStatus, pods: Iterable[PodObs],
                   decision: Decision, now: str) -> EngineCoreSetStatus:
    """The whole status for the pods that belong to the fleet's current incarnation."""
    n = decision.replicas
    by_name = {p.name: p for p in pods if p.fleet_generation == decision.fleet_generation}
    ranks = decision.ranks
    ready = sum(1 for rk in ranks if rk.phase == "Serving" and rk.rank < n)
    frontend = by_name.get(constants.frontend_name(fleet.name))
    frontend_ready = frontend is not None and frontend.ready and frontend.phase == "Running"
    unschedulable = sorted(p.name for p in by_name.values() if not p.node and p.message)
    op = decision.operation
    replacing = op is not None and not op.done and bool(op.replace)  # lost dense ranks replaced in place
    in_flight = op is not None and not op.done and not replacing  # a resize

    conditions = old.conditions
    phase = decision.phase
    recovery = decision.recovery
    given_up = phase == "Failed" and recovery is not None
    # Available: the endpoint answers with at least one rank behind it.
    if given_up and recovery is not None:
        available = _cond(AVAILABLE, False, "RecoveriesExhausted", "the fleet was given up", generation, now)
    elif phase == "Stopped":
        available = _cond(AVAILABLE, False, "Stopped", "replicas is 0", generation, now)
    elif frontend_ready and ready > 0:
        available = _cond(AVAILABLE, True, "RanksServing", f"{ready}/{n} ranks serving", generation, now)
    elif not frontend_ready:
        available = _cond(AVAILABLE, False, "FrontendNotReady", "the frontend is not ready", generation, now)
    else:
        available = _cond(AVAILABLE, False, "NoRanksServing", f"0/{n} ranks serving", generation, now)
    # Progressing: the fleet is moving towards the spec (its incarnation, or a resize).
    if given_up:
        progressing = _cond(PROGRESSING, False, "RecoveriesExhausted", "the fleet was given up; nothing is created "
                            "until its spec changes", generation, now)
    elif replacing and op is not None:
        progressing = _cond(PROGRESSING, True, "ReplacingRanks", f"{op.id}: {_ranks(op.replace)} replaced in place "
                            f"({op.phase})", generation, now)
    elif phase in ("Running", "Stopped", "Degraded"):
        progressing = _cond(PROGRESSING, False, "Complete", f"fleet at {n} ranks", generation, now)
    elif phase == "Scaling" and op is not None:
        progressing = _cond(PROGRESSING, True, "Resizing", f"resize {op.id}: {op.fromReplicas} -> {op.toReplicas}",
                            generation, now)
    else:
        reason = {"Recovering": "Recovering", "Restarting": "Restarting"}.get(phase, "CreatingPods")
        progressing = _cond(PROGRESSING, True, reason,
                            f"incarnation {decision.fleet_generation}: {ready}/{n} ranks serving",
                            generation, now)
    if decision.new_incarnation:  # a new incarnation's readiness deadline starts now
        conditions = tuple(c for c in conditions if c.type != PROGRESSING)
    # Scaling: a resize in place runs, or why none does.
    if in_flight and op is not None:
        direction = "ScalingUp" if op.scale_up else "ScalingDown"
        scaling = _cond(SCALING, True, direction, f"resize {op.id} ({op.fromReplicas} -> {op.toReplicas}) "
                                                  f"{op.phase}: {op.message}", generation, now)
    elif op is not None and op.phase == "Failed" and decision.desired != n and decision.retry_in is not None:
        scaling = _cond(SCALING, False, "ResizeFailed", f"resize {op.id} ({op.fromReplicas} -> {op.toReplicas}) "
                                                        f"failed: {op.message}; retrying in {decision.retry_in:.0f}s",
                        generation, now)
    elif decision.desired != n and phase != "Stopped":
        scaling = _cond(SCALING, False, "Waiting", f"replicas is {decision.desired}: the fleet resizes once it runs "
                                                   f"at {n} ranks ({phase})", generation, now)
    else:
        scaling = _cond(SCALING, False, "Stable", f"fleet at {n} ranks", generation, now)
    # Degraded: something needs attention.
    failed = [rk for rk in ranks if rk.phase == "Failed" and rk.rank < n]
    started = next((c.lastTransitionTime for c in conditions if c.type == PROGRESSING and c.status == "True"), now)
    timeout = fleet.spec.scaling.readyTimeoutSeconds
    waited = _seconds(started, now)
    if given_up and recovery is not None:
        degraded = _cond(DEGRADED, True, "RecoveriesExhausted", exhausted_message(recovery, decision.max_recoveries),
                         generation, now)
    elif replacing and op is not None:
        degraded = _cond(DEGRADED, True, "RankReplacing",
                         f"{_ranks(op.replace)} lost: replaced in place ({op.phase}: {op.message}); {ready}/{n} ranks "
                         "serving", generation, now)
    elif phase == "Recovering" and waited <= timeout:
        detail = f"recovery {decision.recoveries}"
        if recovery is not None:
            detail = f"recovery {recovery.attempt} of {decision.max_recoveries} in a row, {decision.recoveries} in all"
            if recovery.retryAt and _seconds(now, recovery.retryAt) > 0:
                detail += f"; backoff until {recovery.retryAt}"
        why = f": {recovery.reason}" if recovery is not None else ""
        degraded = _cond(DEGRADED, True, "RankLost", f"recreating the fleet after losing a rank ({detail}){why}",
                         generation, now)
    elif failed:
        degraded = _cond(DEGRADED, True, "RankFailed",
                         "; ".join(f"rank {rk.rank}: {rk.message or 'failed'}" for rk in failed), generation, now)
    elif phase in ("Starting", "Restarting", "Recovering") and waited > timeout:
        unready = [name for name in _members(fleet, n) if not (by_name.get(name) and by_name[name].ready)]
        detail = "; ".join(f"{name}: {_pod_state(by_name.get(name))}" for name in unready) or "no pod is unready"
        degraded = _cond(DEGRADED, True, "ReadyTimeout",
                         f"not ready {waited:.0f}s after incarnation {decision.fleet_generation} started "
                         f"(readyTimeoutSeconds {timeout}): {detail}", generation, now)
    elif unschedulable:
        degraded = _cond(DEGRADED, True, "Unschedulable",
                         "; ".join(f"{name}: {by_name[name].message}" for name in unschedulable), generation, now)
    elif phase == "Degraded":
        degraded = _cond(DEGRADED, True, "RankNotReady", f"{ready}/{n} ranks serving", generation, now)
    else:
        degraded = _cond(DEGRADED, False, "AsExpected", "", generation, now)
    for c in (available, progressing, scaling, degraded):
        conditions = set_condition(conditions, c)

    return EngineCoreSetStatus(
        observedGeneration=generation,
        replicas=n,
        readyReplicas=ready,
        selector=constants.engine_selector(fleet.name),
        phase=phase,
        conditions=conditions,
        ranks=tuple(ranks),
        operation=op,
        recoveries=decision.recoveries,
        recovery=decision.recovery,
        fleetGeneration=decision.fleet_generation,
        endpoint=endpoint(fleet),
        redundantExperts=decision.redundant_experts,
    )


def _ranks(ranks: Iterable[int]) -> str:
    shown = sorted(ranks)
    return f"rank {shown[0]}" if len(shown) == 1 else "ranks " + ", ".join(str(r) for r in shown)


def _members(fleet: FleetRef, replicas: int) -> list[str]:
    if replicas == 0:
        return []
    return [constants.coordinator_name(fleet.name), constants.frontend_name(fleet.name),
            *(constants.engine_name(fleet.name, r) for r in range(replicas))]


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
