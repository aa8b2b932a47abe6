# SPDX-License-Identifier: Apache-2.0
"""The planner's first phase: the operation in flight (`status.operation` not done), followed one step.

A resize (`planner.resize`) is followed from the frontend's account of it, a replacement of lost dense
ranks in place (`planner.replace`) and one of the frontend and/or coordinator (`planner.members`)
through their own steps; so are going idle and a wake (a replacement of every rank), whose failure leaves
the fleet idle rather than losing it (`planner.idle`). The ranks and member pods an operation moves are
its business: their pods' ends are not losses (`planner.losses`). A fresh fleet has no operation to follow.

MoE: the redundant experts belong to the committed size they were reported for
(`status.redundantExperts` at `status.replicas`; after a resize that completes now, R' at the new size).
A fleet recreated at that size starts every pod with them (`planner.children`): elastic EP keeps the
physical experts per rank, so a fleet recreated without them could not shrink back.

Pure module: no kopf, no Kubernetes client, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from corefleet_operator.actions import Action, Event
from corefleet_operator.models import FleetRef, IdleStatus, OperationStatus
from corefleet_operator.observe import Observed
from corefleet_operator.planner.basis import Basis
from corefleet_operator.planner.common import PlanSettings
from corefleet_operator.planner.idle import IdleStep, continue_idle, wake_failed
from corefleet_operator.planner.members import (
    after_replacement,
    after_resize,
    continue_members,
    member_name,
)
from corefleet_operator.planner.replace import ReplaceStep, continue_replace
from corefleet_operator.planner.resize import ResizeStep, continue_resize

DEFAULT_SETTINGS = PlanSettings()


@dataclass(frozen=True)
class Flight:
    """The operation in flight after this pass followed it (or the stored one, if none runs)."""

    operation: OperationStatus | None  # the status's operation: the one in flight as it now stands, or the last
    committed: int  # the committed size (a resize that completes now commits its new size)
    resize: ResizeStep | None = None
    replacing: ReplaceStep | None = None
    moving: frozenset[int] = frozenset()  # ranks the operation adds, removes or replaces
    moving_members: frozenset[str] = frozenset()  # the frontend and/or coordinator pods the operation replaces
    redundant_size: int = 0  # MoE: the committed size `redundant_experts` is for
    redundant_experts: int | None = None
    idling: IdleStep | None = None  # going idle, followed this pass
    idle: IdleStatus | None = None  # the fleet's idleness after this pass (`status.idle`)
    idle_actions: tuple[Action, ...] = ()  # going idle's request to the frontend, a failed wake's cancel
    idle_events: tuple[Event, ...] = ()  # a failed wake's

    @property
    def events(self) -> tuple[Event, ...]:
        return (self.resize.events if self.resize is not None else ()) \
            + (self.replacing.events if self.replacing is not None else ()) \
            + (self.idling.events if self.idling is not None else ()) + self.idle_events

    @property
    def lost(self) -> tuple[str, ...]:
        """Why the operation lost the fleet, if it did (a recovery)."""
        return tuple(why for why in (self.resize.lost if self.resize is not None else "",
                                     self.replacing.lost if self.replacing is not None else "") if why)


def follow_operation(fleet: FleetRef, observed: Observed, basis: Basis, now: str,
                     settings: PlanSettings = DEFAULT_SETTINGS) -> Flight:
    """Follow the operation in flight, if any, one step."""
    old, running = basis.old, basis.running
    still = Flight(operation=old.operation, committed=basis.committed, redundant_size=old.replicas,
                   redundant_experts=old.redundantExperts, idle=None if basis.fresh else old.idle)
    if running is None or basis.fresh:
        return still
    if running.idle:
        idling = continue_idle(fleet, observed, running, now)
        return replace(still, operation=idling.operation, idling=idling, moving=frozenset(range(basis.committed)),
                       idle=idling.idle or still.idle, idle_actions=idling.actions)
    if running.wake:
        return _follow_wake(fleet, observed, basis, running, still, settings, now)
    if running.members:
        replacing = continue_members(fleet, observed, running, basis.current, now)
        return replace(still, operation=replacing.operation, replacing=replacing, moving=frozenset(running.detached),
                       moving_members=frozenset(member_name(fleet.name, role) for role in running.members))
    if running.replace:
        replacing = continue_replace(fleet, observed, running, basis.current, basis.streak, now)
        # Several frontends: frontend 0 passes over one it cannot reach (as in a resize, below); a coordinator lost
        # once frontend 0 serves on the new engines is replaced after (`planner.members.after_replacement`).
        return replace(still, operation=replacing.operation, replacing=replacing, moving=frozenset(running.replace),
                       moving_members=after_replacement(fleet, replacing.operation))
    resize = continue_resize(fleet, observed, running, basis.committed, basis.current, now)
    # Several frontends: one other than frontend 0 lost during the resize is frontend 0's to pass over or fail the
    # resize for; a dense fleet's coordinator lost meanwhile is not needed to finish it (a scale-up is cancelled);
    # their loss is seen (and they are replaced in place) once the resize ended.
    flight = replace(still, operation=resize.operation, committed=resize.committed, resize=resize,
                     moving=resize.joining | resize.leaving, moving_members=after_resize(fleet))
    if resize.operation.phase == "Completed" and resize.committed != old.replicas:
        flight = replace(flight, redundant_size=resize.committed, redundant_experts=resize.redundant_experts)
    return flight


def _follow_wake(fleet: FleetRef, observed: Observed, basis: Basis, running: OperationStatus, still: Flight,
                 settings: PlanSettings, now: str) -> Flight:
    """A wake is a replacement of every rank (`planner.replace`); one that fails leaves the fleet idle (not a loss)."""
    replacing = continue_replace(fleet, observed, running, basis.current, None, now)
    flight = replace(still, operation=replacing.operation, replacing=replacing, moving=frozenset(running.replace))
    if replacing.lost:
        idle = still.idle or IdleStatus(since=now)
        failed, idle, actions, event = wake_failed(fleet.spec, idle, running, replacing.lost, settings.backoff_scale,
                                                   now)
        return replace(flight, operation=failed, replacing=replace(replacing, operation=failed, lost="", actions=()),
                       idle=idle, idle_actions=actions, idle_events=(event,))
    if replacing.operation.phase == "Completed":
        return replace(flight, idle=None)
    return flight
