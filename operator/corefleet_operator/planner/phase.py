# SPDX-License-Identifier: Apache-2.0
"""The planner's fifth phase: the fleet's phase, from what stands after this pass's actions.

In order: Stopped (no ranks, no pods left); Waking, Idle, and Scaling while going idle (`planner.idle`);
Degraded while lost ranks are replaced in place (the other
ranks serve on), or a lost frontend and/or coordinator (the engines run on); Scaling while a resize
runs; a fleet recreated this pass stays Recovering, Restarting or Starting; Running once every member
pod is Ready; still Recovering or Restarting until then; Degraded when a fleet that served has all its
pods but not all ready; else Starting.

Pure module: no kopf, no Kubernetes client, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

from corefleet_operator.actions import Event
from corefleet_operator.models import EngineCoreSetStatus, FleetPhase, FleetRef
from corefleet_operator.observe import Observed, PodObs
from corefleet_operator.planner.basis import Basis
from corefleet_operator.planner.children import Children
from corefleet_operator.planner.common import desired_pod_names
from corefleet_operator.planner.step import Step


def fleet_phase(fleet: FleetRef, basis: Basis, step: Step, children: Children) -> FleetPhase:
    """The fleet's phase after this pass (see the module)."""
    standing = {p.name: p for p in children.standing}
    old = basis.old
    if step.committed == 0 and not standing and not basis.terminating:
        return "Stopped"
    if step.waking:
        return "Waking"
    if step.resting:
        return "Idle"
    if step.idling_now:
        return "Scaling"
    if step.replacing_now:
        return "Degraded"  # the other ranks (the engines) serve on while the lost ones (members) are replaced
    if step.in_flight:
        return "Scaling"
    if step.phase in ("Recovering", "Restarting", "Starting") and step.new_incarnation:
        return step.phase
    if all_ready(fleet, step.committed, standing):
        return "Running"
    if step.phase in ("Recovering", "Restarting"):
        return step.phase
    if old.phase in ("Running", "Degraded", "Scaling") and not children.created \
            and old.fleetGeneration == step.generation:
        return "Degraded"  # all pods there, some not ready
    return "Starting"


def all_ready(fleet: FleetRef, committed: int, standing: Mapping[str, PodObs]) -> bool:
    """Every member pod at the committed size stands Running and Ready (a stopped fleet has none)."""
    members = desired_pod_names(fleet, committed)
    return bool(members) and all(name in standing and standing[name].ready and standing[name].phase == "Running"
                                 for name in members)


def phase_events(fleet: FleetRef, observed: Observed, basis: Basis, step: Step,
                 phase: FleetPhase) -> tuple[Event, ...]:
    """FleetReady, Stopped, and ResizeQueued (a new `replicas` while a resize runs), each told once."""
    old = basis.old
    events = []
    if phase == "Running" and old.phase not in ("Running", "Scaling", "Waking"):
        events.append(Event("Normal", "FleetReady", f"all {step.committed} ranks serving {fleet.spec.model}"))
    if phase == "Stopped" and old.phase != "Stopped":
        events.append(Event("Normal", "Stopped", "replicas is 0: the fleet has no pods"))
    op = step.operation
    if step.in_flight and op is not None and fleet.spec.replicas != op.toReplicas \
            and observed.generation != old.observedGeneration:
        events.append(Event("Normal", "ResizeQueued", f"replicas is now {fleet.spec.replicas}: queued until resize "
                                                      f"{op.id} ({op.fromReplicas} -> {op.toReplicas}) ends"))
    return tuple(events)


def ready_timeout_event(old: EngineCoreSetStatus, new: EngineCoreSetStatus) -> tuple[Event, ...]:
    """A Warning once, when the readiness deadline passes (the Degraded condition says it from then on)."""
    def reason(status: EngineCoreSetStatus) -> str:
        return next((c.reason for c in status.conditions if c.type == "Degraded" and c.status == "True"), "")

    if reason(new) == "ReadyTimeout" and reason(old) != "ReadyTimeout":
        message = next(c.message for c in new.conditions if c.type == "Degraded")
        return (Event("Warning", "ReadyTimeout", message),)
    return ()
