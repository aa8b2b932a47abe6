# SPDX-License-Identifier: Apache-2.0
"""The EngineCoreSet's status, computed whole by pure functions.

Conditions follow metav1.Condition: CamelCase reasons, `observedGeneration`, and a
`lastTransitionTime` that changes only when a condition's status flips. The handler writes the
result once per reconcile, and only if it differs from what is stored (`status_patch`).

Pure module: no kopf, no Kubernetes client, no I/O.
"""

from __future__ import annotations

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
    RankPhase,
    RankStatus,
    SpecError,
    to_json,
)
from corefleet_operator.observe import PodObs

AVAILABLE = "Available"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
POD_TERMINAL = ("Failed", "Succeeded")  # pod phases after its containers exited


@dataclass(frozen=True)
class Decision:
    """What the planner decided about the fleet as a whole."""

    phase: FleetPhase
    fleet_generation: int
    recoveries: int
    replicas: int  # the committed data-parallel size


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


def compute_status(fleet: FleetRef, generation: int, old: EngineCoreSetStatus, pods: Iterable[PodObs],
                   decision: Decision, now: str) -> EngineCoreSetStatus:
    """The whole status for the pods that belong to the fleet's current incarnation."""
    n = fleet.spec.replicas
    by_name = {p.name: p for p in pods if p.fleet_generation == decision.fleet_generation}
    ranks = []
    for r in range(n):
        name = constants.engine_name(fleet.name, r)
        pod = by_name.get(name)
        ranks.append(RankStatus(rank=r, pod=name, phase=rank_phase(pod),
                                message=(pod.message if pod is not None else "")))
    ready = sum(1 for rk in ranks if rk.phase == "Serving")
    frontend = by_name.get(constants.frontend_name(fleet.name))
    frontend_ready = frontend is not None and frontend.ready and frontend.phase == "Running"
    unschedulable = sorted(p.name for p in by_name.values() if not p.node and p.message)

    conditions = old.conditions
    phase = decision.phase
    # Available: the endpoint answers with at least one rank behind it.
    if phase == "Stopped":
        available = _cond(AVAILABLE, False, "Stopped", "replicas is 0", generation, now)
    elif frontend_ready and ready > 0:
        available = _cond(AVAILABLE, True, "RanksServing", f"{ready}/{n} ranks serving", generation, now)
    elif not frontend_ready:
        available = _cond(AVAILABLE, False, "FrontendNotReady", "the frontend is not ready", generation, now)
    else:
        available = _cond(AVAILABLE, False, "NoRanksServing", f"0/{n} ranks serving", generation, now)
    # Progressing: the fleet is moving towards the spec.
    if phase in ("Running", "Stopped", "Degraded"):
        progressing = _cond(PROGRESSING, False, "Complete", f"fleet at {n} ranks", generation, now)
    else:
        reason = {"Recovering": "Recovering", "Restarting": "Restarting"}.get(phase, "CreatingPods")
        progressing = _cond(PROGRESSING, True, reason,
                            f"incarnation {decision.fleet_generation}: {ready}/{n} ranks serving",
                            generation, now)
    # Degraded: something needs attention.
    failed = [rk for rk in ranks if rk.phase == "Failed"]
    if phase == "Recovering":
        degraded = _cond(DEGRADED, True, "RankLost",
                         f"recreating the fleet after losing a rank (recovery {decision.recoveries})",
                         generation, now)
    elif failed:
        degraded = _cond(DEGRADED, True, "RankFailed",
                         "; ".join(f"rank {rk.rank}: {rk.message or 'failed'}" for rk in failed), generation, now)
    elif unschedulable:
        degraded = _cond(DEGRADED, True, "Unschedulable",
                         "; ".join(f"{name}: {by_name[name].message}" for name in unschedulable), generation, now)
    elif phase == "Degraded":
        degraded = _cond(DEGRADED, True, "RankNotReady", f"{ready}/{n} ranks serving", generation, now)
    else:
        degraded = _cond(DEGRADED, False, "AsExpected", "", generation, now)
    for c in (available, progressing, degraded):
        conditions = set_condition(conditions, c)

    return EngineCoreSetStatus(
        observedGeneration=generation,
        replicas=decision.replicas,
        readyReplicas=ready,
        selector=constants.engine_selector(fleet.name),
        phase=phase,
        conditions=conditions,
        ranks=tuple(ranks),
        operation=old.operation,
        recoveries=decision.recoveries,
        fleetGeneration=decision.fleet_generation,
        endpoint=endpoint(fleet),
    )


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
