# SPDX-License-Identifier: Apache-2.0
"""A replacement in place: a dense fleet loses ranks, not the endpoint.

When a dense fleet (not `expertParallel`) serves (Running or Degraded, no operation in flight) and the
only losses are engine ranks below the committed size (not all of them), with its frontend and
coordinator pods Ready, the lost ranks are replaced in place, in the same incarnation (`in_place`), as
an operation: `status.operation` with `replace` = the ranks, fromReplicas == toReplicas
(`start_replace`, then `continue_replace` on every reconcile, also after an operator restart):

* Pending: each lost rank's old pod is deleted (by name and UID); once it is gone and the recovery's
  backoff is over, the operation is Preparing (written before the new pods are created: a pod of the
  rank seen while Pending is the old one, one seen while Preparing the new one).
* Preparing: the new pod of the same name is created (again, if one vanished); once the frontend
  reports the ranks Dead (its view comes with `FrontendObs.fleet` while it does not know the
  operation), `StartResize` with `replace` asks it to take the new engines through vLLM's handshake
  (idempotent by id).
* Completed once it serves on them and their pods are Ready (Committing meanwhile; event RankReplaced).

The fleet is Degraded meanwhile and the other ranks serve on. A replacement is a loss like any other
for the recovery streak (attempt, backoff, budget, `recoveries`: `planner.recovery`). A replacement that
fails (the frontend's operation Failed or refused, a new pod that fails, no end within
readyTimeoutSeconds + FRONTEND_GRACE_SECONDS after the new pods could start) is `lost`: the whole fleet
is recreated. So is a fleet that loses another engine during it, or an MoE fleet that loses a rank (its
collectives cannot lose a member); a lost frontend 0 or coordinator rolls it back, is replaced in place, and the
ranks are replaced again after (`planner.members`). A dense fleet that loses only its
frontend and/or coordinator, with nothing in flight, replaces them in place too (`planner.members`).

Pure module: no kopf, no Kubernetes client, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from corefleet_operator import constants
from corefleet_operator.actions import Action, Event, StartResize
from corefleet_operator.models import EngineCoreSetSpec, FleetRef, OperationStatus, RecoveryStatus
from corefleet_operator.observe import FleetObs, FrontendObs, Observed, PodObs
from corefleet_operator.planner.basis import Basis
from corefleet_operator.planner.common import (
    FRONTEND_GRACE_SECONDS,
    delete_pod,
    id_stamp,
    listed,
    pod_ready,
    seconds_between,
)
from corefleet_operator.status import POD_TERMINAL


@dataclass(frozen=True)
class ReplaceStep:
    """One step of a replacement: the operation as it now stands, and what the plan does about it."""

    operation: OperationStatus
    actions: tuple[Action, ...] = ()  # the old pods' deletes, StartResize with `replace`
    events: tuple[Event, ...] = ()
    lost: str = ""  # the replacement failed: recover the whole fleet, with this reason
    create: bool = False  # the replaced ranks' new pods may be created (again, if one vanished) this pass
    wait: float | None = None  # look again within this many seconds (the backoff's end)


def replace_id(ranks: Iterable[int], fleet_generation: int, now: str) -> str:
    """A replacement's id: readable, unique per incarnation and second (`replace-r1-g1-20261201t101500z`)."""
    stamp = id_stamp(now)
    return f"replace-r{'-'.join(str(r) for r in sorted(ranks))}-g{fleet_generation}-{stamp}"


def in_place(fleet: FleetRef, basis: Basis, lost: Sequence[tuple[int | None, str]], changed: bool) -> bool:
    """Whether this pass's losses (each with the engine rank it is, None for anything else) are replaced in
    place rather than by recreating the fleet: only engine ranks below the committed size, not all of them,
    lost from a dense fleet that serves in its current incarnation and configuration with nothing in flight,
    its frontend and coordinator Ready."""
    old = basis.old
    ranks = {rank for rank, _ in lost if rank is not None}
    return (bool(lost) and all(rank is not None for rank, _ in lost) and not fleet.spec.expertParallel
            and not basis.fresh and not basis.given_up and not changed and basis.running is None
            and old.phase in ("Running", "Degraded") and old.fleetGeneration == basis.generation
            and all(0 <= rank < basis.committed for rank in ranks) and len(ranks) < basis.committed
            and pod_ready(basis.current.get(constants.frontend_name(fleet.name)))
            and pod_ready(basis.current.get(constants.coordinator_name(fleet.name))))


def start_replace(fleet: FleetRef, observed: Observed, ranks: Sequence[int], committed: int, generation: int,
                  current: Mapping[str, PodObs], recovery: RecoveryStatus, now: str) -> ReplaceStep:
    """A new replacement of the lost `ranks`, and its first step (the old pods' deletes)."""
    op = OperationStatus(id=replace_id(ranks, generation, now), fromReplicas=committed, toReplicas=committed,
                         phase="Pending", startedAt=now, message=f"replacing {listed(ranks)} in place",
                         fleetGeneration=generation, replace=tuple(ranks))
    return continue_replace(fleet, observed, op, current, recovery, now)


def continue_replace(fleet: FleetRef, observed: Observed, op: OperationStatus, current: Mapping[str, PodObs],
                     recovery: RecoveryStatus | None, now: str) -> ReplaceStep:
    """Follow a replacement of lost dense ranks in place (`op.replace`) one step (see the module)."""
    spec = fleet.spec
    names = {rank: constants.engine_name(fleet.name, rank) for rank in op.replace}
    retry_at = recovery.retryAt if recovery is not None and recovery.lostAt == op.startedAt else None
    if op.phase == "Pending":
        step = _pending(spec, observed, op, names, retry_at, now)
        if step.operation.phase == "Pending":
            return step
        op = step.operation
    step = ReplaceStep(operation=op, create=True)
    failed = _failed_new_pod(op, names, current)
    if failed:
        return replace(step, lost=failed)
    step = _with_frontend(spec, observed, step, names, current, now)
    if step.lost or step.operation.done:
        return step
    timeout = float(spec.scaling.readyTimeoutSeconds) + FRONTEND_GRACE_SECONDS
    elapsed = seconds_between(retry_at or op.startedAt, now)
    if elapsed > timeout:
        return replace(step, lost=(f"replacement {op.id} of {listed(op.replace)}: not done {elapsed:.0f}s after "
                                   f"its new pod(s) could start (readyTimeoutSeconds "
                                   f"{spec.scaling.readyTimeoutSeconds} + {FRONTEND_GRACE_SECONDS:.0f}s): "
                                   f"{step.operation.message}"))
    return step


def _pending(spec: EngineCoreSetSpec, observed: Observed, op: OperationStatus, names: Mapping[int, str],
             retry_at: str | None, now: str) -> ReplaceStep:
    """Pending: the old pods are deleted (or vacated: `_vacate`), then the recovery's backoff awaited; after both,
    Preparing."""
    what = listed(op.replace)
    there = [p for p in observed.pods if p.name in names.values()]
    if there:
        deletes = tuple(delete_pod(p) for p in there if not p.terminating)
        step = ReplaceStep(operation=replace(op, message=f"deleting the old pod(s) of {what}"), actions=deletes)
        return _vacate(spec, observed, step, there)
    backoff = max(0.0, seconds_between(now, retry_at)) if retry_at else 0.0
    if backoff > 0:
        return ReplaceStep(operation=replace(op, message=f"backoff until {retry_at} before the new pod(s) of {what}"),
                           wait=backoff)
    return ReplaceStep(operation=replace(op, phase="Preparing", message=f"creating the new pod(s) of {what}"))


def _vacate(spec: EngineCoreSetSpec, observed: Observed, step: ReplaceStep, there: Sequence[PodObs]) -> ReplaceStep:
    """A rank whose pod is being removed while its engine still serves (an eviction, a delete with the pod's grace
    period: not the operator's own) is drained first: the frontend is asked for the replacement at once, as a
    vacating one (`StartResize.vacate`): it stops routing to the rank, lets its requests finish, releases the engine
    (whose pod's pre-stop hook waits for that) and takes the new engine once the old one's connection is gone."""
    op = step.operation
    frontend = observed.frontend
    if frontend is None or not frontend.reachable:
        return step
    if frontend.resize is not None:
        return replace(step, operation=replace(op, message=f"{frontend.resize.message or op.message} (the old "
                                                           "pod(s) stop once drained)"))
    if frontend.refused:
        return step  # asked once and refused: the pods stop at the end of their grace period
    serving = removed_while_serving(there, frontend.fleet if frontend.fleet is not None else observed.fleet)
    if not serving:
        return step
    return replace(step, actions=(*step.actions, _ask(spec, op, vacate=True)),
                   operation=replace(op, message=f"the pod(s) of {listed(serving)} are being removed: asking the "
                                                 "frontend to drain them first"))


def removed_while_serving(pods: Iterable[PodObs], seen: FleetObs | None) -> list[int]:
    """The engine ranks among `pods` whose pod is being removed (terminating) while it still runs and the frontend
    (`seen`) reports the rank Serving: a voluntary removal to drain, not a loss."""
    if seen is None or not seen.reachable:
        return []
    return sorted(p.rank for p in pods if p.terminating and p.phase == "Running" and p.rank is not None
                  and p.rank in seen.ranks and seen.ranks[p.rank].state == "Serving")


def _ask(spec: EngineCoreSetSpec, op: OperationStatus, vacate: bool = False) -> StartResize:
    """The frontend's replacement of `op.replace` (vacating: the ranks still serve and are drained first)."""
    return StartResize(op.id, op.toReplicas, float(spec.scaling.drainTimeoutSeconds),
                       float(spec.scaling.readyTimeoutSeconds), replace=tuple(op.replace), vacate=vacate)


def _failed_new_pod(op: OperationStatus, names: Mapping[int, str], current: Mapping[str, PodObs]) -> str:
    """Why the replacement is lost because a new pod ended (empty: none did)."""
    for rank, name in sorted(names.items()):
        pod = current.get(name)
        if pod is not None and pod.phase in POD_TERMINAL:
            why = f": {pod.message}" if pod.message else ""
            return f"replacement {op.id}: the new pod of rank {rank} ({name}) {pod.phase.lower()}{why}"
    return ""


def _with_frontend(spec: EngineCoreSetSpec, observed: Observed, step: ReplaceStep, names: Mapping[int, str],
                   current: Mapping[str, PodObs], now: str) -> ReplaceStep:
    """Preparing: what the frontend says decides the step (it cannot be asked, refused the operation, does
    not know it yet, failed it, completed it, or runs it)."""
    op = step.operation
    what = listed(op.replace)
    frontend = observed.frontend
    if frontend is None or not frontend.reachable:
        why = frontend.error if frontend is not None else "the frontend has no address"
        return replace(step, operation=replace(op, message=f"waiting for the frontend's admin API: {why}"))
    seen = frontend.resize
    if seen is None and frontend.refused:
        return replace(step, lost=f"replacement {op.id} of {what}: {frontend.refused}")
    if seen is None:
        return _ask_once_dead(spec, observed, frontend, step)
    if seen.phase == "Failed":
        return replace(step, lost=f"replacement {op.id} of {what} failed: {seen.error or seen.message}")
    if seen.phase == "Completed":
        return _completed(step, names, current, now)
    return replace(step, operation=replace(op, phase="Preparing", message=seen.message or op.message))


def _ask_once_dead(spec: EngineCoreSetSpec, observed: Observed, frontend: FrontendObs,
                   step: ReplaceStep) -> ReplaceStep:
    """The frontend does not know the operation: it is asked once it reports every replaced rank Dead (vLLM
    takes a new engine only in a dead one's place)."""
    op = step.operation
    what = listed(op.replace)
    seen = frontend.fleet if frontend.fleet is not None else observed.fleet
    states = {rank: (seen.ranks[rank].state if seen is not None and rank in seen.ranks else "unknown")
              for rank in op.replace}
    ready = ("Dead", "Idle") if op.wake else ("Dead",)  # a wake takes the new engines in Idle ranks' place
    if seen is not None and seen.reachable and all(state in ready for state in states.values()):
        return replace(step, actions=(*step.actions, _ask(spec, op)),
                       operation=replace(op, message=f"asking the frontend to replace {what}"))
    shown = ", ".join(f"rank {rank} {state}" for rank, state in sorted(states.items()))
    return replace(step, operation=replace(op, message=f"waiting for the frontend to report {what} Dead ({shown})"))


def _completed(step: ReplaceStep, names: Mapping[int, str], current: Mapping[str, PodObs], now: str) -> ReplaceStep:
    """The frontend serves on the new engines: Completed once their pods are Ready too (Committing until)."""
    op = step.operation
    what = listed(op.replace)
    unready = sorted(rank for rank, name in names.items() if not pod_ready(current.get(name)))
    if unready:
        return replace(step, operation=replace(op, phase="Committing",
                                               message=f"the frontend serves on {what} again; waiting for the "
                                                       f"pod(s) of {listed(unready)} to be Ready"))
    took = seconds_between(op.startedAt, now)
    if op.wake:
        return replace(step, operation=replace(op, phase="Completed", finishedAt=now,
                                               message=f"awake: {what} serving {took:.0f}s after the wake began"),
                       events=(Event("Normal", "FleetAwake", f"{op.id}: the fleet is awake, {what} serving again "
                                                             f"{took:.0f}s after the wake began (new pods joined "
                                                             "in place; held requests are served)"),))
    return replace(step, operation=replace(op, phase="Completed", finishedAt=now,
                                           message=f"{what} replaced in place in {took:.0f}s"),
                   events=(Event("Normal", "RankReplaced", f"replacement {op.id}: {what} replaced in place (new "
                                                           f"pod(s), same rank), serving again after {took:.0f}s; "
                                                           "the other ranks served throughout"),))
