# SPDX-License-Identifier: Apache-2.0
"""Recovery: the streak, its backoff and its budget.

Every lost incarnation (and every replacement of lost ranks in place) is one recovery (`recoveries`,
the total) and one attempt of the current streak (`status.recovery`: attempt, lostAt, reason,
retryAt). Recovery n of a streak waits `backoff_seconds(n)` (0, then 10 s doubling to 300 s) before the
new pods are created (`retryAt`: `backoff_left`; the plan's `requeue_after` wakes the reconciler then).
A loss past `spec.scaling.maxRecoveries` in a streak gives the fleet up (`give_up`): phase Failed
(condition RecoveriesExhausted with the last loss's reason), its running pods deleted, the pods that
ended kept for their logs, nothing created until the spec changes (`still_given_up`). A streak ends
after `STREAK_RESET_SECONDS` Running, or with a new spec generation (`streak`).
`PlanSettings.backoff_scale` scales every backoff (tests only; the operator reads it from
`COREFLEET_RECOVERY_BACKOFF_SCALE` at its edge).

Pure module: no kopf, no Kubernetes client, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from corefleet_operator import constants
from corefleet_operator.actions import Action, Event
from corefleet_operator.models import (
    EngineCoreSetStatus,
    FleetPhase,
    FleetRef,
    OperationStatus,
    RankStatus,
    RecoveryStatus,
)
from corefleet_operator.observe import Observed, PodObs
from corefleet_operator.planner.common import Plan, PlanSettings, delete_pod, later, seconds_between
from corefleet_operator.status import POD_TERMINAL, Decision, compute_status, exhausted_message

# The backoff before recovery n of a streak is 0 for the first, then 10 s, 20 s, 40 s, ... capped at 300 s;
# a streak ends after STREAK_RESET_SECONDS Running, or when the spec changes.
BACKOFF_FIRST_SECONDS = 10.0
BACKOFF_MAX_SECONDS = 300.0
STREAK_RESET_SECONDS = 600.0


@dataclass(frozen=True)
class Attempt:
    """A loss's place in the recovery streak: its number, the budget, and the backoff before its new pods."""

    number: int  # 1-based within the streak
    budget: int  # spec.scaling.maxRecoveries
    wait: float  # seconds

    @property
    def exhausted(self) -> bool:
        """Past the budget: the fleet is given up instead."""
        return self.number > self.budget


def backoff_seconds(attempt: int, scale: float = 1.0) -> float:
    """The wait before recovery `attempt` (1-based) of a streak: 0, then 10 s doubling up to 300 s (times the scale)."""
    if attempt <= 1:
        return 0.0
    wait = min(BACKOFF_MAX_SECONDS, BACKOFF_FIRST_SECONDS * 2.0 ** (attempt - 2))
    return wait * scale


def exhausted(old: EngineCoreSetStatus) -> bool:
    """The fleet was given up after its recovery budget (phase Failed with a recovery streak)."""
    return old.phase == "Failed" and old.recovery is not None and old.fleetGeneration > 0


def still_given_up(old: EngineCoreSetStatus, fresh: bool, spec_generation: int) -> RecoveryStatus | None:
    """The streak of a fleet given up whose spec has not changed since (it stays given up), else None."""
    if exhausted(old) and not fresh and old.recovery is not None \
            and old.recovery.observedGeneration == spec_generation:
        return old.recovery
    return None


def streak(old: EngineCoreSetStatus, spec_generation: int, now: str) -> RecoveryStatus | None:
    """The recovery streak the fleet is in, or None: a streak ends when the spec changes (a new generation) and
    after STREAK_RESET_SECONDS Running since its last loss."""
    rec = old.recovery
    if rec is None or rec.observedGeneration != spec_generation:
        return None
    if old.phase == "Running" and seconds_between(_running_since(old), now) >= STREAK_RESET_SECONDS \
            and seconds_between(rec.lostAt, now) >= STREAK_RESET_SECONDS:
        return None
    return rec


def _running_since(old: EngineCoreSetStatus) -> str | None:
    """Since when the fleet has been complete (Progressing False), if it is."""
    return next((c.lastTransitionTime for c in old.conditions if c.type == "Progressing" and c.status == "False"),
                None)


def next_attempt(current: RecoveryStatus | None, budget: int, settings: PlanSettings, again: bool = False) -> Attempt:
    """The attempt a new loss is in the streak `current` (None: it starts one); `again`: the attempt of the streak's
    last loss once more (a further loss of the same event: `planner.step.folded`)."""
    number = max(1, (current.attempt if current is not None else 0) + (0 if again else 1))
    return Attempt(number=number, budget=budget, wait=backoff_seconds(number, settings.backoff_scale))


def recovery_for(attempt: Attempt, reason: str, spec_generation: int, now: str, members: int = 0) -> RecoveryStatus:
    """The streak's record of a loss now (`status.recovery`): its new pods wait until retryAt; `members`: the
    streak's member losses replaced in place so far, this one included."""
    return RecoveryStatus(attempt=attempt.number, lostAt=now, reason=reason, retryAt=later(now, attempt.wait),
                          observedGeneration=spec_generation, members=members)


def when(attempt: Attempt, recovery: RecoveryStatus) -> str:
    """When the recovery's new pods start, for its event."""
    return f"after a backoff of {attempt.wait:.0f}s (at {recovery.retryAt})" if attempt.wait else "now"


def backoff_left(phase: FleetPhase, recovery: RecoveryStatus | None, committed: int, now: str) -> float:
    """Seconds until a recovering fleet's new incarnation's pods may be created (0: now)."""
    if phase == "Recovering" and recovery is not None and recovery.retryAt and committed > 0:
        return max(0.0, seconds_between(now, recovery.retryAt))
    return 0.0


def give_up(fleet: FleetRef, observed: Observed, old: EngineCoreSetStatus, operation: OperationStatus | None,
            attempt: Attempt, reason: str, recoveries: int, events: tuple[Event, ...], now: str) -> Plan:
    """A loss past the budget: the fleet is given up (the operation in flight, if any, already failed)."""
    given_up = RecoveryStatus(attempt=attempt.number - 1, lostAt=now, reason=reason, retryAt=None,
                              observedGeneration=observed.generation)
    events = (*events,
              Event("Warning", "RankLost", f"{reason}: recovery budget spent ({attempt.number - 1} of "
                                           f"{attempt.budget} in a row): giving the fleet up"),
              Event("Warning", "RecoveriesExhausted", exhausted_message(given_up, attempt.budget)))
    return plan_given_up(fleet, replace(observed, status=replace(old, operation=operation)), given_up, recoveries,
                         events, now)


def plan_given_up(fleet: FleetRef, observed: Observed, recovery: RecoveryStatus, recoveries: int,
                  events: tuple[Event, ...], now: str) -> Plan:
    """A fleet given up after its recovery budget: its running pods are deleted, the pods that ended are kept
    (their logs tell why), and nothing is created until the spec changes."""
    old = observed.status
    committed = old.replicas or fleet.spec.replicas
    live = [p for p in observed.pods if not p.terminating]
    actions: tuple[Action, ...] = tuple(delete_pod(p) for p in live
                                        if p.phase not in POD_TERMINAL)
    kept = tuple(p for p in live if p.phase in POD_TERMINAL)
    operation = old.operation
    if operation is not None and not operation.done:
        operation = replace(operation, phase="Failed", finishedAt=now, message="the fleet was given up")
    decision = Decision(phase="Failed", fleet_generation=old.fleetGeneration, recoveries=recoveries,
                        replicas=committed, ranks=_given_up_ranks(fleet, committed, kept), operation=operation,
                        desired=fleet.spec.replicas, recovery=recovery, max_recoveries=fleet.spec.scaling.maxRecoveries,
                        redundant_experts=old.redundantExperts)
    status = compute_status(fleet, observed.generation, old, kept, decision, now)
    return Plan(status=status, actions=actions, events=events)


def _given_up_ranks(fleet: FleetRef, committed: int, kept: tuple[PodObs, ...]) -> tuple[RankStatus, ...]:
    """Every rank of a fleet given up is Failed, with its ended pod's message if it has one."""
    by_name = {p.name: p for p in kept}
    ranks = []
    for rank in range(committed):
        name = constants.engine_name(fleet.name, rank)
        pod = by_name.get(name)
        message = pod.message if pod is not None and pod.message else "stopped: the fleet was given up"
        ranks.append(RankStatus(rank=rank, pod=name, phase="Failed", message=message))
    return tuple(ranks)
