# SPDX-License-Identifier: Apache-2.0
"""The planner's third phase: the next step for the fleet, from its losses and its new size.

After losses (`after_losses`), in this order:

* a fleet given up whose spec changed is recreated at the new spec (Restarting, a new streak);
* losses are a recovery (`planner.recovery`): the operation in flight fails with them; past the
  budget the fleet is given up; else the lost dense ranks are replaced in place when they can be
  (`planner.replace.in_place`), a lost frontend and/or coordinator of a dense fleet too, as attempt 1
  or 2 of its streak (`planner.members.members_in_place`: new pods, the engines serve on, no backoff),
  and otherwise the fleet is recreated at the committed size (Recovering);
* a configuration change recreates the fleet at the new spec (Restarting; an operation in flight is
  superseded).

Recreation is one incarnation up: every pod of an older incarnation is deleted (by name and UID), and
the new incarnation's pods are created only once the old ones are gone (`planner.children`).

Then a new size (`new_size`): `spec.replicas` differing from the committed size, while nothing else is
decided and no operation runs. 0 stops the fleet; a stopped fleet starts at the new size; a fleet that
never served (Pending, Starting, Restarting) is recreated at it; a Running one is resized in place
(`planner.resize`), or waits for a failed resize's retry; any other waits until it runs.

Pure module: no kopf, no Kubernetes client, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from corefleet_operator import builders, constants
from corefleet_operator.actions import Action, Event
from corefleet_operator.models import FleetPhase, FleetRef, IdleStatus, OperationStatus, RecoveryStatus
from corefleet_operator.observe import Observed
from corefleet_operator.planner import recovery as rec
from corefleet_operator.planner.basis import Basis
from corefleet_operator.planner.common import Plan, PlanSettings, listed
from corefleet_operator.planner.follow import Flight
from corefleet_operator.planner.idle import IdleStep, idle_cause, start_idle, start_wake, wake_reason, wake_wait
from corefleet_operator.planner.losses import Losses
from corefleet_operator.planner.members import (
    MAX_MEMBER_REPLACEMENTS,
    continue_members,
    end_interrupted_replacement,
    frontend_index,
    interrupted_replacement,
    interrupted_resize,
    listed_members,
    members_in_place,
    members_to_replace,
    ranks_with_members,
    start_members,
)
from corefleet_operator.planner.replace import (
    ReplaceStep,
    continue_replace,
    in_place,
    removed_while_serving,
    start_replace,
)
from corefleet_operator.planner.resize import RESIZE_RETRY_SECONDS, ResizeStep, retry_wait, start_resize


@dataclass(frozen=True)
class Step:
    """The fleet after this pass's decisions: its incarnation and committed size, the operation, the recovery."""

    generation: int  # the incarnation (one up when the fleet is recreated)
    committed: int  # the committed size
    phase: FleetPhase  # the phase decided so far (`planner.phase` settles it from what stands)
    new_incarnation: bool  # the fleet is (re)created this pass
    operation: OperationStatus | None  # the status's operation
    recovery: RecoveryStatus | None  # the recovery streak
    recoveries: int  # recoveries in all
    resize: ResizeStep | None = None  # a resize followed or started this pass
    replacing: ReplaceStep | None = None  # a replacement (of ranks, or of members) followed or started this pass
    events: tuple[Event, ...] = ()  # what the pass has told so far
    retry_in: float | None = None  # a failed resize to this size is tried again in this many seconds
    idling: IdleStep | None = None  # going idle, followed or started this pass
    idle: IdleStatus | None = None  # the fleet is idle (`status.idle`): no engine pod unless it wakes
    idle_actions: tuple[Action, ...] = ()  # going idle's request to the frontend, a failed wake's cancel

    @property
    def idling_now(self) -> bool:
        """The fleet goes idle after this pass (its ranks drain; not once a loss ended the idling)."""
        op = self.operation
        return self.idling is not None and not self.new_incarnation and op is not None and not op.done \
            and op.id == self.idling.operation.id

    @property
    def waking(self) -> bool:
        """An idle fleet wakes after this pass (its new engine pods join)."""
        return self.replacing_now and self.replacing is not None and self.replacing.operation.wake

    @property
    def resting(self) -> bool:
        """The fleet is idle after this pass, not waking: it keeps no engine pod."""
        return self.idle is not None and not self.new_incarnation and self.committed > 0 and not self.waking

    @property
    def in_flight(self) -> bool:
        """A resize runs after this pass."""
        return self.resize is not None and not self.resize.operation.done

    @property
    def replacing_now(self) -> bool:
        """A replacement (of ranks, or of the frontend and/or coordinator) runs after this pass (in the same
        incarnation)."""
        return self.replacing is not None and not self.replacing.operation.done and not self.new_incarnation

    @property
    def attaching(self) -> frozenset[int]:
        """The frontends (by index) a replacement in place gives new pods after this pass: they attach to the running
        engines."""
        if not self.replacing_now or self.replacing is None:
            return frozenset()
        return frozenset(i for member in self.replacing.operation.members
                         if (i := frontend_index(member)) is not None)

    @property
    def detached(self) -> frozenset[int]:
        """The ranks the attaching frontends leave out (their replacement was interrupted): their pods wait."""
        if not self.replacing_now or self.replacing is None or not self.replacing.operation.members:
            return frozenset()
        return frozenset(self.replacing.operation.detached)

    @property
    def joining(self) -> frozenset[int]:
        """New ranks of a resize in flight: their pods are kept and created."""
        if self.resize is None or self.new_incarnation or not self.in_flight:
            return frozenset()
        return self.resize.joining

    @property
    def leaving(self) -> frozenset[int]:
        """Ranks a resize in flight removes that the frontend has not retired yet: their pods are kept."""
        if self.resize is None or self.new_incarnation or not self.in_flight:
            return frozenset()
        return self.resize.leaving - self.resize.retired

    @property
    def keep_ranks(self) -> frozenset[int]:
        """The engine ranks whose pods the fleet keeps (none while it rests idle)."""
        if self.resting:
            return frozenset()
        return frozenset(range(self.committed)) | self.joining | self.leaving


def first_step(basis: Basis, flight: Flight) -> Step:
    """The step before anything is decided: the fleet as it stands, the operation as followed."""
    return Step(generation=basis.generation, committed=flight.committed, phase=basis.old.phase,
                new_incarnation=basis.fresh, operation=flight.operation, recovery=basis.streak,
                recoveries=basis.old.recoveries, resize=flight.resize, replacing=flight.replacing,
                events=basis.events + flight.events, idling=flight.idling, idle=flight.idle,
                idle_actions=flight.idle_actions)


def next_step(fleet: FleetRef, observed: Observed, basis: Basis, flight: Flight, losses: Losses,
              settings: PlanSettings, now: str) -> Step | Plan:
    """The next step: recreate, replace, resize or wait (a whole Plan when the fleet is given up)."""
    step = after_losses(fleet, observed, basis, losses, first_step(basis, flight), settings, now)
    if isinstance(step, Plan):
        return step
    return new_size(fleet, basis, idle_or_wake(fleet, observed, basis, step, now), now)


def idle_or_wake(fleet: FleetRef, observed: Observed, basis: Basis, step: Step, now: str) -> Step:
    """With nothing in flight: an idle fleet wakes when it should, a Running one goes idle when it should
    (`planner.idle`)."""
    spec = fleet.spec
    if step.new_incarnation or step.in_flight or step.replacing_now or step.idling is not None:
        return step  # (an idling that ended this pass: one operation a pass, the next one after its status is written)
    if step.idle is not None:
        reason = wake_reason(spec, step.idle, observed.fleet, step.committed)
        if not reason:
            return step
        wait = wake_wait(step.idle, now)
        if wait:
            return replace(step, retry_in=wait)
        op, event = start_wake(step.committed, step.generation, reason, now)
        replacing = continue_replace(fleet, observed, op, basis.current, None, now)
        return replace(step, operation=replacing.operation, replacing=replacing,
                       events=(*step.events, event, *replacing.events))
    if basis.old.phase != "Running" or basis.old.fleetGeneration != step.generation or step.phase != "Running":
        return step
    cause = idle_cause(spec, observed.fleet, step.committed, step.operation, RESIZE_RETRY_SECONDS, now)
    if cause is None:
        return step
    seen = observed.fleet
    idling = start_idle(spec, step.committed, step.generation, cause, seen.quiet_s if seen is not None else None, now)
    return replace(step, operation=idling.operation, idling=idling, idle_actions=idling.actions,
                   events=(*step.events, *idling.events))


def after_losses(fleet: FleetRef, observed: Observed, basis: Basis, losses: Losses, step: Step,
                 settings: PlanSettings, now: str) -> Step | Plan:
    """A new incarnation, a replacement in place, or the fleet given up, for what this pass found."""
    if basis.given_up:
        return _recreate(step, "Restarting", fleet.spec.replicas, recovery=None, event=Event(
            "Normal", "Restarting", f"spec changed after the fleet was given up: recreating all ranks at "
                                    f"{fleet.spec.replicas} (incarnation {step.generation + 1})"))
    if losses.lost:
        return _recover(fleet, observed, basis, losses, step, settings, now)
    if losses.changed:
        return _restart_changed(fleet, basis, step, now)
    return step


def _recreate(step: Step, phase: FleetPhase, committed: int, recovery: RecoveryStatus | None,
              event: Event) -> Step:
    """One incarnation up, at `committed` ranks (its pods wait until the old incarnation's are gone)."""
    return replace(step, generation=step.generation + 1, new_incarnation=True, phase=phase, committed=committed,
                   recovery=recovery, events=(*step.events, event))


def _fail_running(running: OperationStatus | None, step: Step, message: str, kind: str, now: str) -> Step:
    """The operation in flight fails with the incarnation (event ResizeFailed)."""
    if running is None:
        return step
    failed = replace(running, phase="Failed", finishedAt=now, message=message)
    return replace(step, operation=failed, events=(
        *step.events, Event("Warning", "ResizeFailed", f"{kind} {running.id}: {failed.message}")))


def _recover(fleet: FleetRef, observed: Observed, basis: Basis, losses: Losses, step: Step,
             settings: PlanSettings, now: str) -> Step | Plan:
    """Losses: one recovery of the streak (or the fleet given up), by replacement in place or a new incarnation."""
    reason = losses.reason
    running = basis.running
    if removed(observed, basis, losses) and in_place(fleet, basis, losses.lost, losses.changed):
        ranks = losses.ranks
        replacing = start_replace(fleet, observed, ranks, step.committed, step.generation, basis.current,
                                  basis.streak or RecoveryStatus(), now)
        told = Event("Normal", "RankRemoved", f"the pod(s) of {listed(ranks)} are being removed (a drain's eviction, "
                                              "a delete): draining them, then replacing them in place (new pod(s), "
                                              "the other ranks serve on); not a recovery")
        return replace(step, operation=replacing.operation, replacing=replacing,
                       events=(*step.events, told, *replacing.events))
    kind = "replacement" if running is not None and (running.replace or running.members) else "resize"
    again = folded(running, basis)  # the same event as the member loss (a node's pods going one at a time)
    left_out = () if losses.changed else ranks_with_members(fleet, basis, losses.lost)
    if left_out:
        return _leave_out(fleet, observed, basis, losses, step, left_out, now)
    attempt = rec.next_attempt(basis.streak, fleet.spec.scaling.maxRecoveries, settings, again=again)
    # The streak's member losses replaced in place, this one included (a folded loss is the same event's).
    replaced = basis.streak.members if basis.streak is not None else 0
    member_count = replaced + (0 if again else 1)
    members = not attempt.exhausted and member_count <= MAX_MEMBER_REPLACEMENTS \
        and members_in_place(fleet, basis, losses.lost, losses.members, losses.changed)
    interrupted = interrupted_resize(fleet, basis, losses.members) if members else None
    replacement = interrupted_replacement(fleet, basis, losses.members) if members else None
    if interrupted is not None:
        step = _end_interrupted_resize(interrupted, step, reason, now)
    elif replacement is not None:
        ended = end_interrupted_replacement(replacement, reason, now, losses.members)
        what = f"replacement {replacement.id} of {listed(replacement.replace)}"
        step = replace(step, operation=ended,
                       events=(*step.events, Event("Warning", "ResizeFailed", f"{what} {ended.message}")))
    else:
        step = _fail_running(running, step, f"the fleet was lost during the {kind}: {reason}", kind, now)
    if attempt.exhausted:
        return rec.give_up(fleet, observed, basis.old, step.operation, attempt, reason, step.recoveries,
                           step.events, now)
    recovery = rec.recovery_for(attempt, reason, observed.generation, now,
                                members=member_count if members else replaced)
    step = replace(step, recovery=recovery, recoveries=step.recoveries + (0 if again else 1))
    count = f"recovery {attempt.number} of {attempt.budget} {rec.when(attempt, recovery)}"
    if in_place(fleet, basis, losses.lost, losses.changed):
        ranks = losses.ranks
        replacing = start_replace(fleet, observed, ranks, step.committed, step.generation, basis.current, recovery,
                                  now)
        told = Event("Warning", "RankLost", f"{reason}: replacing {listed(ranks)} in place (new pod(s), the other "
                                            f"ranks serve on), {count}")
        return replace(step, operation=replacing.operation, replacing=replacing,
                       events=(*step.events, told, *replacing.events))
    if members:
        return _replace_members(fleet, observed, basis, losses, replace(step, recovery=replace(
            recovery, retryAt=recovery.lostAt)), f"recovery {attempt.number} of {attempt.budget} now", now,
            interrupted=replacement)
    committed = basis.old.replicas if step.committed == 0 else step.committed
    step = _recreate(step, "Recovering", committed, recovery, Event(
        "Warning", "RankLost", f"{reason}: recreating the fleet at {committed} ranks (incarnation "
                               f"{step.generation + 1}), {count}"))
    return replace(step, resize=None)  # the resize in flight, if any, failed with the incarnation


def _end_interrupted_resize(op: OperationStatus, step: Step, reason: str, now: str) -> Step:
    """A dense resize whose frontend was lost ends with it, without touching an engine that stays: a scale-up is
    rolled back (its new ranks' pods go; it is tried again once the frontend is replaced, as `replicas` still asks),
    a scale-down is finished (its leaving ranks' pods go: their requests were the lost frontend's)."""
    size = min(op.fromReplicas, op.toReplicas)
    if op.scale_up:
        message = (f"rolled back to {size} ranks: {reason} (the new ranks' pods go; tried again once the frontend "
                   "is replaced)")
        ended = replace(op, phase="Failed", finishedAt=now, message=message)
        event = Event("Warning", "ResizeFailed", f"resize {op.id} ({op.fromReplicas} -> {op.toReplicas}) "
                                                 f"{message}")
    else:
        message = (f"finished at {size} ranks: {reason} (the leaving ranks' pods go; what they ran was the lost "
                   "frontend's)")
        ended = replace(op, phase="Completed", finishedAt=now, message=message)
        event = Event("Normal", "ResizeCompleted", f"resize {op.id} ({op.fromReplicas} -> {op.toReplicas}) "
                                                   f"{message}")
    return replace(step, committed=size, operation=ended, resize=None, events=(*step.events, event))


def folded(running: OperationStatus | None, basis: Basis) -> bool:
    """A loss while a member replacement still waits for its old pods to go (Pending: nothing new created yet) is
    the same event as the member's loss (a lost or drained node's pods are deleted one at a time): the fleet is
    recreated as that loss's attempt of the streak, not counted again."""
    return running is not None and bool(running.members) and running.phase == "Pending" and basis.streak is not None


def _replace_members(fleet: FleetRef, observed: Observed, basis: Basis, losses: Losses, step: Step, count: str,
                     now: str, interrupted: OperationStatus | None = None) -> Step:
    """The lost frontend and/or coordinator replaced in place (`planner.members`): a recovery, without backoff. Left
    out of the attach and replaced after: the engine ranks lost with them, and those of the replacement of ranks they
    interrupted (`interrupted`), which frontend 0 is told to cancel where it lives on."""
    roles = members_to_replace(fleet, basis, losses.members)
    detached = tuple(sorted(set(interrupted.replace if interrupted is not None else ()) | set(losses.ranks)))
    cancelling = interrupted.id if interrupted is not None and constants.ROLE_FRONTEND not in roles else ""
    replacing = start_members(fleet, observed, roles, step.committed, step.generation, basis.current, now,
                              detached_ranks=detached, cancelling=cancelling)
    what = listed_members(roles)
    after = f"; {listed(detached)} replaced in place after" if detached else ""
    told = Event("Warning", "MemberLost", f"{losses.reason}: replacing {what} in place (new pod(s), the engines "
                                          f"serve on){after}, {count}")
    return replace(step, operation=replacing.operation, replacing=replacing,
                   events=(*step.events, told, *replacing.events))


def _leave_out(fleet: FleetRef, observed: Observed, basis: Basis, losses: Losses, step: Step,
               left_out: tuple[int, ...], now: str) -> Step:
    """Engine ranks lost while a member replacement runs (the same event: a node's pods deleted one at a time; while it
    waits for its old pods to go, or replaces the coordinator alone): left out of its attach too, and replaced after
    it (`planner.members.ranks_with_members`); not another recovery."""
    running = basis.running
    assert running is not None
    ranks = tuple(r for r in left_out if r not in running.detached)
    op = replace(running, detached=left_out)
    replacing = continue_members(fleet, observed, op, basis.current, now)
    told = Event("Warning", "RankLost", f"{losses.reason}: {listed(ranks)} left out of replacement {op.id} of "
                                        f"{listed_members(op.members)} (its old pods still going) and replaced in "
                                        "place after it, as the same recovery")
    return replace(step, operation=replacing.operation, replacing=replacing,
                   events=(*step.events, told, *replacing.events))


def removed(observed: Observed, basis: Basis, losses: Losses) -> bool:
    """Whether every loss is an engine rank whose pod is being removed voluntarily (an eviction, a delete with its
    grace period: the pod still runs) while the frontend reports it Serving: not a failure, so not a recovery (no
    attempt of the streak, no backoff); the replacement drains it first (`planner.replace`)."""
    ranks = [rank for rank, _ in losses.lost]
    return bool(ranks) and None not in ranks and set(ranks) <= set(removed_while_serving(basis.terminating,
                                                                                         observed.fleet))


def _restart_changed(fleet: FleetRef, basis: Basis, step: Step, now: str) -> Step:
    """A configuration change: the fleet is recreated at the new spec, superseding any operation in flight."""
    desired = fleet.spec.replicas
    changed = sorted({section for p in basis.current.values() if p.spec_hash != basis.config_hash
                      for section in builders.changed_sections(fleet.spec, builders.parse_sections(p.config_sections))})
    what = ", ".join(changed) if changed else "configuration"
    step = _recreate(step, "Restarting", desired, step.recovery, Event(
        "Normal", "Restarting", f"spec changed ({what}): recreating all ranks at {desired} (incarnation "
                                f"{step.generation + 1}): running pods cannot change it in place"))
    step = _fail_running(basis.running, step, "superseded by a configuration change (the fleet is recreated)",
                         "resize", now)
    return replace(step, resize=None)


def new_size(fleet: FleetRef, basis: Basis, step: Step, now: str) -> Step:
    """`spec.replicas` differing from the committed size, with nothing else decided and no operation running."""
    spec = fleet.spec
    desired = spec.replicas
    if step.new_incarnation or step.in_flight or step.replacing_now or step.idling_now or desired == step.committed:
        return step
    old = basis.old
    if step.idle is not None and (desired > 0 or spec.idle is not None):
        return step  # it wakes first (`idle_or_wake`), then resizes
    if desired == 0 and spec.idle is not None:
        return step  # it goes idle once it runs (`idle_or_wake`)
    if desired == 0:
        return replace(step, committed=0, events=(*step.events, Event(
            "Normal", "Stopping", f"replicas is 0: deleting the fleet's {step.committed} ranks")))
    if step.committed == 0:
        return _recreate(step, "Starting", desired, step.recovery, Event(
            "Normal", "Creating", f"creating a fleet of {desired} ranks of {spec.model}"))
    if old.phase in ("Starting", "Restarting", "Pending"):  # it never served: nothing to keep
        return _recreate(step, "Restarting", desired, step.recovery, Event(
            "Normal", "Restarting", f"replicas {step.committed} -> {desired}: the fleet was not serving yet: "
                                    f"recreating all ranks (incarnation {step.generation + 1})"))
    if old.phase != "Running":
        return step  # it resizes once it runs
    wait = retry_wait(old, desired, now)
    if wait:
        return replace(step, retry_in=wait)
    resize = start_resize(fleet, step.committed, step.generation, now)
    return replace(step, resize=resize, operation=resize.operation, events=(*step.events, *resize.events))
