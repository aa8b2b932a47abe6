# SPDX-License-Identifier: Apache-2.0
"""The pure planner: from the spec and what is observed, the next step for one fleet.

`plan(fleet, observed, now)` works out where the fleet is from what it sees (its pods, its other
children, the status it last wrote and, while an operation runs, the frontend's account of it), and
returns the actions that move it one step closer to the spec, the status to write, the events to emit
and when to look again. It keeps no state between calls: the status it returns is the only memory.

It runs as a sequence of pure phases, each taking and returning a small frozen value; each module
states the rules it implements:

1. `basis`: where the fleet stands (incarnation, committed size, the operation in flight, the recovery
   streak; a lost status adopted from the pods). A fleet given up stays so until its spec changes
   (`recovery`).
2. `follow`: the operation in flight followed one step: a resize in place (`resize`), a replacement
   of lost dense ranks in place (`replace`), one of a dense fleet's lost frontend and/or
   coordinator in place, the engines serving on (`members`), or going idle or waking (`idle`).
3. `losses`: what the current incarnation lost, and whether its configuration changed.
4. `step`: the next step: recreate, replace ranks or members in place, or give up (`recovery`:
   streak, backoff, budget); then go idle or wake (`idle`); then a new size: resize, recreate, stop or
   wait.
5. `children`: the pods and other children to apply and delete.
6. `phase` and `ranks`: the fleet's phase and the rank statuses, for `status.compute_status`.
7. `requeue`: when to look again.

Pure package: no kopf, no Kubernetes client, no I/O, no environment (the knobs come in `PlanSettings`).
"""

from __future__ import annotations

from corefleet_operator.actions import Action, Apply, CancelResize, Delete, Event, StartResize
from corefleet_operator.models import FleetPhase, FleetRef, SpecError
from corefleet_operator.observe import Observed
from corefleet_operator.planner.basis import Basis, begin
from corefleet_operator.planner.children import OPTIONAL_KINDS, Children, child_actions, is_subset
from corefleet_operator.planner.common import (
    FRONTEND_GRACE_SECONDS,
    Plan,
    PlanSettings,
    desired_pod_names,
    format_time,
    parse_time,
    seconds_between,
)
from corefleet_operator.planner.follow import follow_operation
from corefleet_operator.planner.idle import IDLE_POLL_SECONDS
from corefleet_operator.planner.losses import FRONTEND_POLL_SECONDS, UNRESPONSIVE_SECONDS, find_losses
from corefleet_operator.planner.phase import fleet_phase, phase_events, ready_timeout_event
from corefleet_operator.planner.ranks import rank_statuses
from corefleet_operator.planner.recovery import (
    BACKOFF_FIRST_SECONDS,
    BACKOFF_MAX_SECONDS,
    STREAK_RESET_SECONDS,
    backoff_left,
    backoff_seconds,
    exhausted,
    plan_given_up,
    still_given_up,
)
from corefleet_operator.planner.replace import replace_id
from corefleet_operator.planner.requeue import operation_wake, requeue_after
from corefleet_operator.planner.resize import (
    OPERATION_PHASES,
    REDUNDANT_EXPERTS_POLL_SECONDS,
    RESIZE_POLL_SECONDS,
    RESIZE_RETRY_SECONDS,
    frontends_resize,
    resize_id,
)
from corefleet_operator.planner.step import Step, next_step
from corefleet_operator.status import Decision, compute_status, invalid_spec_status

__all__ = [
    "BACKOFF_FIRST_SECONDS",
    "BACKOFF_MAX_SECONDS",
    "FRONTEND_GRACE_SECONDS",
    "FRONTEND_POLL_SECONDS",
    "IDLE_POLL_SECONDS",
    "OPERATION_PHASES",
    "OPTIONAL_KINDS",
    "REDUNDANT_EXPERTS_POLL_SECONDS",
    "RESIZE_POLL_SECONDS",
    "RESIZE_RETRY_SECONDS",
    "STREAK_RESET_SECONDS",
    "UNRESPONSIVE_SECONDS",
    "Action",
    "Apply",
    "CancelResize",
    "Delete",
    "Event",
    "Plan",
    "PlanSettings",
    "StartResize",
    "backoff_seconds",
    "desired_pod_names",
    "exhausted",
    "format_time",
    "is_subset",
    "parse_time",
    "plan",
    "plan_invalid",
    "replace_id",
    "resize_id",
    "seconds_between",
]


DEFAULT_SETTINGS = PlanSettings()


def plan(fleet: FleetRef, observed: Observed, now: str, settings: PlanSettings = DEFAULT_SETTINGS) -> Plan:
    """The next step for one fleet (see the package's phases)."""
    basis = begin(fleet, observed, now)
    given_up = still_given_up(basis.old, basis.fresh, observed.generation)
    if given_up is not None:
        return plan_given_up(fleet, observed, given_up, basis.old.recoveries, (), now)
    observed, basis = frontends_resize(fleet, observed, basis, now)
    flight = follow_operation(fleet, observed, basis, now, settings)
    losses = find_losses(fleet, observed, basis, flight, now)
    step = next_step(fleet, observed, basis, flight, losses, settings, now)
    if isinstance(step, Plan):
        return step  # the recovery budget is spent: the fleet is given up
    backoff = backoff_left(step.phase, step.recovery, step.committed, now)
    children = child_actions(fleet, observed, basis, flight, step, backoff)
    wake = operation_wake(step, backoff, children.awaiting_experts)
    phase = fleet_phase(fleet, basis, step, children)
    decision = decide(fleet, basis, step, children, phase, retry_in=None if step.in_flight or backoff else wake)
    status = compute_status(fleet, observed.generation, basis.old, children.standing, decision, now)
    events = (*step.events, *children.events, *phase_events(fleet, observed, basis, step, phase),
              *ready_timeout_event(basis.old, status))
    return Plan(status=status, actions=children.actions, events=events,
                requeue_after=requeue_after(fleet, step, status, children.standing, wake, now))


def decide(fleet: FleetRef, basis: Basis, step: Step, children: Children, phase: FleetPhase,
           retry_in: float | None) -> Decision:
    """What the status says of the fleet as a whole (`status.compute_status` adds the conditions)."""
    return Decision(phase=phase, fleet_generation=step.generation, recoveries=step.recoveries,
                    replicas=step.committed, ranks=rank_statuses(fleet, step, children), operation=step.operation,
                    new_incarnation=step.new_incarnation and not basis.fresh, desired=fleet.spec.replicas,
                    retry_in=retry_in, recovery=step.recovery, max_recoveries=fleet.spec.scaling.maxRecoveries,
                    redundant_experts=children.redundant_experts,
                    idle=step.idle if step.committed > 0 and not step.new_incarnation else None)


def plan_invalid(error: SpecError, observed: Observed, now: str) -> Plan:
    """A spec corefleet cannot run: nothing is touched, the status says why (once)."""
    status = invalid_spec_status(observed.generation, observed.status, error, now)
    already = any(c.type == "Degraded" and c.reason == "InvalidSpec" and c.message == str(error)
                  for c in observed.status.conditions)
    events = () if already else (Event("Warning", "InvalidSpec", str(error)),)
    return Plan(status=status, events=events)
