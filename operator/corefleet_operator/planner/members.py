# SPDX-License-Identifier: Apache-2.0
"""A replacement in place of a dense fleet's frontend and/or coordinator: the engines serve on.

When a dense fleet (not `expertParallel`) serves in its current incarnation and configuration (Running
or Degraded, no operation in flight; or Scaling, with a resize that the lost frontend ran and that ends with it:
`interrupted_resize`, a scale-up rolled back, a scale-down finished, `size_after`; or a replacement of ranks that
frontend 0 ran: `interrupted_replacement`), every engine pod that stays serves (`engines_serve`), and the only
losses are its
frontend and/or coordinator pods (failed, vanished, or not ready in time: `Losses.members`), they are replaced in
place, in the same incarnation, as an operation (`members_in_place`; the other member too if its pod is being
deleted meanwhile: `members_to_replace`): `status.operation` with `members` = their roles,
fromReplicas == toReplicas (`start_members`, then `continue_members` on every reconcile, also after
an operator restart):

* Pending: the old pods still there are deleted (by name and UID); once none of them exists, the
  operation is Preparing (written before the new pods are created: a member pod seen while Pending is
  the old one, one seen while Preparing the new one).
* Preparing: the missing member pods are created (again, if one vanished: `ReplaceStep.create`). A new
  frontend is built with `--attach` (`builders.frontend_pod`): it binds the same fixed engine ports
  under the same DNS name, the running engines reconnect to it, and it re-attaches to them instead of
  vLLM's startup handshake. A new coordinator is found by the frontend and engines at its fixed ports.
* Completed once every new pod is Ready (events FrontendReplaced or CoordinatorReplaced).

A replacement of ranks whose frontend 0 is lost (it ran that replacement, which ends with it), or whose
coordinator is lost before frontend 0 serves on the new engines (they wait for the coordinator's READY before their
handshake ends), is rolled back (`end_interrupted_replacement`) and its ranks are `detached` in the members'
operation: vLLM's client waits at its start for a ready response from every engine, and whether the new engines'
handshake with the lost frontend went far enough for them to answer the new one is not known. So in Pending their
new pods are deleted too; in Preparing every new frontend is built with `--attach --detached-ranks` (it starts with
them Dead), their pods are not created; and once the members are Ready the operation goes on as a new replacement of
those ranks, Preparing (`planner.replace`: their pods created, the frontend asked once it reports them Dead), without
another loss of the streak. A frontend 0 that lives on (the coordinator lost) is told to cancel its part on every
pass until the members serve (`cancelling`: the interrupted replacement's id), so that it reports the ranks Dead
again before they are replaced again. A coordinator lost once frontend 0 serves on the new engines (Committing) is
replaced after the replacement completes (`after_replacement`); one lost during a dense resize, after the resize
ended (`after_resize`).

It is a recovery like any other (an attempt of the streak, `recoveries`), but its new pods are not held
by the streak's backoff (the engines are fine and the endpoint is down meanwhile): only the first two member
losses of a streak are replaced in place (`MAX_MEMBER_REPLACEMENTS`, counted in `status.recovery.members`; the
streak's other losses, a rank's, do not count), so a crash loop of the frontend or coordinator still ends in a
recreated fleet, with its backoff, and in the budget. A new pod that ends,
or no end within readyTimeoutSeconds + FRONTEND_GRACE_SECONDS after the operation began, is `lost`:
the whole fleet is recreated; so is a fleet that loses anything else meanwhile (an engine, the other
member); a loss seen while the operation is still Pending is the same event as the member's (a lost node's pods
are deleted one at a time) and the recreation is that loss's attempt (`planner.step.folded`), not another
recovery. The fleet is Degraded meanwhile, and a new `replicas` waits for the end.

MoE fleets (`expertParallel`) recreate the fleet instead: elastic EP's coordinator holds the wave
state, and the frontend the EPLB state, that a new process could not take over.

Pure module: no kopf, no Kubernetes client, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from corefleet_operator import constants
from corefleet_operator.actions import CancelResize, Event
from corefleet_operator.models import FleetRef, MemberRole, OperationStatus
from corefleet_operator.observe import Observed, PodObs
from corefleet_operator.planner.basis import Basis
from corefleet_operator.planner.common import (
    FRONTEND_GRACE_SECONDS,
    delete_pod,
    id_stamp,
    listed,
    pod_ready,
    seconds_between,
)
from corefleet_operator.planner.replace import ReplaceStep, replace_id
from corefleet_operator.status import POD_TERMINAL

# The first two member losses of a streak are replaced in place; a third recreates the fleet.
MAX_MEMBER_REPLACEMENTS = 2


def member_name(fleet: str, member: MemberRole) -> str:
    """The pod of a member (`coordinator`, `frontend`, `frontend-1`, ...: its pod's name after the fleet's)."""
    return f"{fleet}-{member}"


def frontend_index(member: MemberRole) -> int | None:
    """The index of a frontend member (`frontend`: 0, `frontend-2`: 2); None for the coordinator."""
    if member == constants.ROLE_FRONTEND:
        return 0
    prefix = constants.ROLE_FRONTEND + "-"
    tail = member[len(prefix):] if member.startswith(prefix) else ""
    return int(tail) if tail.isdigit() and 0 < int(tail) < constants.MAX_FRONTENDS else None


def fleet_members(fleet: FleetRef) -> tuple[MemberRole, ...]:
    """The fleet's members: the coordinator and each of its `spec.frontend.replicas` frontends."""
    return (constants.ROLE_COORDINATOR,
            *(constants.frontend_member(i) for i in range(fleet.spec.frontend.replicas)))


def followers(fleet: FleetRef) -> frozenset[str]:
    """The pods of the frontends other than frontend 0 (several frontends: frontend 0 drives their resizes)."""
    return frozenset(constants.frontend_names(fleet.name, fleet.spec.frontend.replicas)[1:])


def after_resize(fleet: FleetRef) -> frozenset[str]:
    """The member pods whose loss during a resize is seen (and that are replaced in place) only once it ended: the
    frontends other than frontend 0 (it passes over them, or fails the resize for them), and a dense fleet's
    coordinator (the frontend's resize runs without it; a scale-up, whose new engines wait for its READY, is
    cancelled: `planner.resize`). An MoE fleet's coordinator holds the elastic-EP wave: its loss is a recovery."""
    coordinator = frozenset() if fleet.spec.expertParallel else {constants.coordinator_name(fleet.name)}
    return followers(fleet) | coordinator


def after_replacement(fleet: FleetRef, op: OperationStatus) -> frozenset[str]:
    """The member pods whose loss during a replacement of ranks (`op`, as followed this pass) is seen only once it
    ended: the frontends other than frontend 0 (as in a resize), and a dense fleet's coordinator once frontend 0
    serves on the new engines (Committing: they have had its READY; rolling it back would only replace them again)."""
    committing = op.phase in ("Committing", "Completed") and not fleet.spec.expertParallel
    return followers(fleet) | ({constants.coordinator_name(fleet.name)} if committing else frozenset())


def member_role(fleet: str, name: str) -> MemberRole | None:
    """The member whose pod `name` is (None: an engine's, or another pod's)."""
    prefix = f"{fleet}-"
    member = name[len(prefix):] if name.startswith(prefix) else ""
    return member if member == constants.ROLE_COORDINATOR or frontend_index(member) is not None else None


def members_id(roles: Iterable[MemberRole], fleet_generation: int, now: str) -> str:
    """A member replacement's id: readable, unique per incarnation and second
    (`replace-frontend-g3-20261204t101500z`, `replace-coordinator-frontend-g3-...`)."""
    stamp = id_stamp(now)
    return f"replace-{'-'.join(sorted(set(roles)))}-g{fleet_generation}-{stamp}"


def listed_members(roles: Iterable[MemberRole]) -> str:
    """`the frontend`, `the coordinator and the frontend`."""
    return " and ".join(f"the {role}" for role in sorted(set(roles)))


def members_in_place(fleet: FleetRef, basis: Basis, lost: Iterable[tuple[int | None, str]],
                     roles: Iterable[MemberRole], changed: bool) -> bool:
    """Whether this pass's losses are replaced in place as members: the frontend and/or coordinator pods (`roles`, one
    loss each), lost from a dense fleet that serves in its current incarnation and configuration with nothing in
    flight, and maybe some of its engine ranks with them (a node's pods: `lost_ranks`; not every rank, and not while a
    resize runs), which are left out of the members' attach and replaced after them, as an interrupted replacement's
    are (`detached`). (The streak's count of them is `planner.step`'s to check: `MAX_MEMBER_REPLACEMENTS`.)"""
    losses = list(lost)
    roles = set(roles)
    old = basis.old
    resize = interrupted_resize(fleet, basis, roles)
    interrupted = resize is not None or interrupted_replacement(fleet, basis, roles) is not None
    ranks = lost_ranks(losses)
    size = size_after(basis)
    left_out = set(detached(basis)) | ranks
    return (bool(roles) and len([rank for rank, _ in losses if rank is None]) == len(roles)
            and (not ranks or (resize is None and ranks <= set(range(size)) and len(left_out) < size))
            and not fleet.spec.expertParallel and not basis.fresh and not basis.given_up and not changed
            and (basis.running is None or interrupted) and old.phase in ("Running", "Degraded", "Scaling")
            and old.fleetGeneration == basis.generation and basis.committed > 0
            and engines_serve(fleet, basis, size, left_out))


def lost_ranks(lost: Iterable[tuple[int | None, str]]) -> set[int]:
    """The engine ranks among losses."""
    return {rank for rank, _ in lost if rank is not None}


def ranks_with_members(fleet: FleetRef, basis: Basis, lost: Iterable[tuple[int | None, str]]) -> tuple[int, ...]:
    """A member replacement runs and some engine ranks are lost now (their pods deleted one at a time, as a lost or
    drained node's are): the ranks to leave out of its attach too, with those it already leaves out, and replace after
    it, as the same recovery. Only while no new frontend can have been built without them (Pending: nothing new
    created yet; or the coordinator alone replaced, whose pod knows no rank); () where it cannot (an MoE fleet,
    another loss, every rank, a rank that does not serve)."""
    running, losses = basis.running, list(lost)
    ranks = lost_ranks(losses)
    early = running is not None and (running.phase == "Pending" or (running.phase == "Preparing" and tuple(
        running.members) == (constants.ROLE_COORDINATOR,)))
    if running is None or not running.members or not early or fleet.spec.expertParallel \
            or not ranks or len(ranks) != len(losses) or not ranks <= set(range(running.toReplicas)):
        return ()
    left_out = set(running.detached) | ranks
    if len(left_out) >= running.toReplicas or not engines_serve(fleet, basis, running.toReplicas, left_out):
        return ()
    return tuple(sorted(left_out))


def interrupted_resize(fleet: FleetRef, basis: Basis, roles: Iterable[MemberRole]) -> OperationStatus | None:
    """A dense resize in flight that the lost frontend was running (it lives in the frontend process, so it ends with
    it): a scale-up is rolled back to its old size, a scale-down finished at its new one (`size_after`)."""
    running = basis.running
    if running is None or running.members or running.replace or running.idle or fleet.spec.expertParallel \
            or constants.ROLE_FRONTEND not in set(roles):
        return None  # (going idle: the fleet is recreated, awake)
    return running


def interrupted_replacement(fleet: FleetRef, basis: Basis, roles: Iterable[MemberRole]) -> OperationStatus | None:
    """A replacement of dense ranks in flight that the lost frontend 0 was running (it ends with it), or whose new
    engines wait for the lost coordinator's READY: rolled back, its ranks replaced again once the members are (the
    module's `detached`; a frontend that lives on is told to cancel its part: `cancelling`)."""
    running = basis.running
    lost = set(roles)
    if running is None or running.members or not running.replace or running.wake or fleet.spec.expertParallel \
            or not lost & {constants.ROLE_FRONTEND, constants.ROLE_COORDINATOR}:
        return None  # (a wake: the fleet is recreated, awake)
    return running


def detached(basis: Basis) -> tuple[int, ...]:
    """The ranks of a replacement in flight (interrupted if the members are replaced now): left out of the attach."""
    running = basis.running
    return tuple(running.replace) if running is not None and not running.members else ()


def end_interrupted_replacement(op: OperationStatus, reason: str, now: str,
                                roles: Iterable[MemberRole] = (constants.ROLE_FRONTEND,)) -> OperationStatus:
    """A replacement of ranks whose frontend 0 or coordinator was lost (`roles`), rolled back: its new pods go, and its
    ranks are replaced again once the lost members are."""
    return replace(op, phase="Failed", finishedAt=now,
                   message=f"rolled back: {reason} (the new pod(s) of {listed(op.replace)} go; replaced again once "
                           f"{listed_members(roles)} {'are' if len(set(roles)) > 1 else 'is'})")


def size_after(basis: Basis) -> int:
    """The committed size once the members are replaced: the smaller of a resize's two sizes (its old ranks after a
    scale-up rolled back, the staying ones after a scale-down finished), else the committed size."""
    running = basis.running
    if running is None or running.members or running.replace:
        return basis.committed
    return min(running.fromReplicas, running.toReplicas)


def engines_serve(fleet: FleetRef, basis: Basis, size: int, detached: Iterable[int] = ()) -> bool:
    """Every engine pod of ranks 0..size-1 (but those `detached`) is there, Running, Ready and not being deleted:
    only then are the engines worth keeping. (A lost node's pods go one at a time: its frontend may vanish while its
    engines are still being deleted; replacing the frontend in place then would only be a second recovery once they
    go.)"""
    left_out = set(detached)
    return all(pod_ready(basis.current.get(constants.engine_name(fleet.name, rank)))
               for rank in range(size) if rank not in left_out)


def members_to_replace(fleet: FleetRef, basis: Basis, roles: Iterable[MemberRole]) -> tuple[MemberRole, ...]:
    """The lost members `roles` and the other member too if its pod of this incarnation is being deleted (it goes
    with them, e.g. a drained or lost node's): replaced in one operation rather than lost during it."""
    leaving = {p.name for p in basis.terminating if p.fleet_generation == basis.generation}
    return tuple(sorted(set(roles) | {m for m in fleet_members(fleet) if member_name(fleet.name, m) in leaving}))


def start_members(fleet: FleetRef, observed: Observed, roles: Iterable[MemberRole], committed: int,
                  generation: int, current: Mapping[str, PodObs], now: str,
                  detached_ranks: Iterable[int] = (), cancelling: str = "") -> ReplaceStep:
    """A new replacement of the lost members `roles` (leaving out of the attach the ranks `detached_ranks`, whose
    replacement it interrupts; `cancelling`: that replacement's id, where the frontend that runs it lives on), and its
    first step (the old pods' deletes)."""
    shown = tuple(sorted(set(roles)))
    left_out = tuple(sorted(set(detached_ranks)))
    also = f"; {listed(left_out)} replaced again after" if left_out else ""
    op = OperationStatus(id=members_id(shown, generation, now), fromReplicas=committed, toReplicas=committed,
                         phase="Pending", startedAt=now, message=f"replacing {listed_members(shown)} in place{also}",
                         fleetGeneration=generation, members=shown, detached=left_out, cancelling=cancelling)
    return continue_members(fleet, observed, op, current, now)


def continue_members(fleet: FleetRef, observed: Observed, op: OperationStatus, current: Mapping[str, PodObs],
                     now: str) -> ReplaceStep:
    """Follow a replacement of the frontend and/or coordinator in place (`op.members`) one step (see the module)."""
    names = {role: member_name(fleet.name, role) for role in op.members}
    engines = {constants.engine_name(fleet.name, rank) for rank in op.detached}
    what = listed_members(op.members)
    # The frontend that lives on gives its part of the interrupted replacement up (asked on every pass until the
    # members serve: idempotent, and an operator restart loses nothing): the new replacement of those ranks is asked
    # of it only once it reports them Dead again.
    cancel = (CancelResize(op.cancelling, f"the replacement was interrupted by the loss of {what}: rolled back, "
                                          "replaced again once a new one serves"),) if op.cancelling else ()
    if op.phase == "Pending":
        there = [p for p in observed.pods if p.name in names.values() or p.name in engines]
        if there:
            deletes = tuple(delete_pod(p) for p in there if not p.terminating)
            return ReplaceStep(operation=replace(op, message=f"deleting the old pod(s) of {what}"),
                               actions=(*cancel, *deletes))
        op = replace(op, phase="Preparing", message=f"creating the new pod(s) of {what}")
    # A rank left out once Preparing (`ranks_with_members`): its old pod goes too (the ranks' new pods come after).
    gone = tuple(delete_pod(p) for p in observed.pods if p.name in engines and not p.terminating)
    step = ReplaceStep(operation=op, create=True, actions=(*cancel, *gone))
    for role, name in sorted(names.items()):
        pod = current.get(name)
        if pod is not None and pod.phase in POD_TERMINAL:
            why = f": {pod.message}" if pod.message else ""
            return replace(step, lost=f"replacement {op.id}: the new {role} (pod {name}) {pod.phase.lower()}{why}")
    took = seconds_between(op.startedAt, now)
    # The left-out ranks' new pods come after their old ones are gone (one left out once Preparing may still go).
    lingering = sorted(p.name for p in observed.pods if p.name in engines)
    if all(pod_ready(current.get(name)) for name in names.values()) and not lingering:
        frontends = any(frontend_index(m) is not None for m in op.members)
        reason = "FrontendReplaced" if frontends else "CoordinatorReplaced"
        done = replace(op, phase="Completed", finishedAt=now, message=f"{what} replaced in place in {took:.0f}s")
        told = Event("Normal", reason, f"replacement {op.id}: {what} replaced in place (new pod(s)) after {took:.0f}s; "
                                       "the engines served on, none restarted")
        if op.detached:
            return _replace_detached(step, op, told, now)
        return replace(step, operation=done, events=(told,))
    timeout = float(fleet.spec.scaling.readyTimeoutSeconds) + FRONTEND_GRACE_SECONDS
    unready = [name for name in names.values() if not pod_ready(current.get(name))]
    message = f"waiting for the new pod(s) {', '.join(sorted(unready))} to be Ready" if unready else \
        f"waiting for the old pod(s) {', '.join(lingering)} to go"
    if took > timeout:
        return replace(step, lost=(f"replacement {op.id} of {what}: not done {took:.0f}s after it began "
                                   f"(readyTimeoutSeconds {fleet.spec.scaling.readyTimeoutSeconds} + "
                                   f"{FRONTEND_GRACE_SECONDS:.0f}s): {message}"))
    return replace(step, operation=replace(op, message=message))


def _replace_detached(step: ReplaceStep, op: OperationStatus, told: Event, now: str) -> ReplaceStep:
    """The members serve again, without the ranks left out of their attach: the operation goes on as a new
    replacement of those ranks, Preparing (their old pods are gone: `planner.replace` creates the new ones and asks
    the frontend once it reports them Dead). A new id: the frontends' parts of the interrupted one may still be
    known to them."""
    ranks = tuple(op.detached)
    again = OperationStatus(id=replace_id(ranks, op.fleetGeneration, now), fromReplicas=op.toReplicas,
                            toReplicas=op.toReplicas, phase="Preparing", startedAt=now,
                            message=f"creating the new pod(s) of {listed(ranks)}", fleetGeneration=op.fleetGeneration,
                            replace=ranks)
    resumed = Event("Normal", "RankReplacementResumed",
                    f"replacement {again.id}: replacing {listed(ranks)} in place again, after replacement {op.id} of "
                    f"{listed_members(op.members)}, whose loss interrupted the last one")
    return replace(step, operation=again, events=(told, resumed), create=True)
