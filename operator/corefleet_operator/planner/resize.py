# SPDX-License-Identifier: Apache-2.0
"""A resize in place: `replicas` differing from the committed size (`status.replicas`), carried out by the
frontend as an operation with an id (`status.operation`), at most one at a time.

* It starts only while the fleet is Running (every member ready); meanwhile, and while another
  operation runs, the change waits (the latest `replicas` wins). When it starts, and for fleets that
  cannot resize in place, is decided by the next step (`planner.step.new_size`).
* Scale-up N -> M: the operation is started on the frontend (`StartResize`) and exactly the pods of
  ranks N..M-1 are created; once the frontend reports it Completed, and the new pods are Ready
  (Committing meanwhile: the kubelet's readiness probe lags the handshake; a new pod that fails meanwhile
  ends the wait, and its rank is lost at the new size), the committed size is M.
  A new rank's pod that fails makes the operator cancel the operation (`CancelResize`); so does a dense fleet's
  coordinator pod that failed, went or is going while the new ranks join (`_cancel_joining`: a new
  engine waits for the coordinator's READY before it completes its handshake, so it could not join before the
  resize's timeout). The coordinator is replaced in place once the resize ended (`planner.follow`), and the
  resize runs again then, as `replicas` still asks.
* Scale-down M -> N: the operation is started; each leaving rank's pod is deleted only once the
  frontend reports that rank Retired; once Completed, the committed size is N.
* A Failed (or refused) operation after which the frontend still serves at the old size
  (`fleet_intact`) leaves the fleet as it was (pods of ranks that did not join are deleted) and is
  retried after `RESIZE_RETRY_SECONDS` unless `replicas` changes; one after which it cannot is `lost`:
  a recovery.
* The operation is followed by asking the frontend on every reconcile (`RESIZE_POLL_SECONDS`); a
  frontend that stops answering past the operation's own timeouts (+ `FRONTEND_GRACE_SECONDS`), or
  that no longer knows it, is `lost`; one that answers but runs past them is told to cancel it.
* MoE fleets (`expertParallel`) resize through the same operation (the frontend runs vLLM's
  elastic-EP protocol); a new rank's pod carries the new size, `VLLM_ELASTIC_EP_SCALE_UP_LAUNCH=1`
  and the redundant experts at the new size (R' in `--eplb-config`), which only the frontend can
  compute: `ResizeStep.redundant_experts` is R' once its account names it (the pods wait for it;
  `planner.children`). An MoE resize that fails after its ranks were told to reconfigure leaves the
  fleet unusable (`fleet_intact` false): `lost`.

Pure module: no kopf, no Kubernetes client, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import cast

from corefleet_operator import constants
from corefleet_operator.actions import Action, CancelResize, Event, StartResize
from corefleet_operator.models import (
    EngineCoreSetSpec,
    EngineCoreSetStatus,
    FleetRef,
    OperationPhase,
    OperationStatus,
    RankPhase,
)
from corefleet_operator.observe import FrontendObs, Observed, PodObs, ResizeObs
from corefleet_operator.planner.basis import Basis
from corefleet_operator.planner.common import (
    FRONTEND_GRACE_SECONDS,
    desired_pod_names,
    id_stamp,
    pod_ready,
    seconds_between,
    span,
)
from corefleet_operator.status import POD_TERMINAL

RESIZE_POLL_SECONDS = 1.0  # while a resize runs: its progress on the frontend is no Kubernetes event
REDUNDANT_EXPERTS_POLL_SECONDS = 0.2  # an MoE scale-up's new pods wait for R' from the frontend (its first answer)
RESIZE_RETRY_SECONDS = 300.0  # a resize that failed is retried after this long (sooner if replicas changes)
OPERATION_PHASES: tuple[OperationPhase, ...] = ("Pending", "Preparing", "Draining", "Committing")
# The frontend's per-rank states the rank statuses show while a resize moves those ranks.
SHOWN_RANK_STATES = ("Joining", "Serving", "Draining", "Retired", "Failed")


@dataclass(frozen=True)
class ResizeStep:
    """One step of a resize: the operation as it now stands, and what the plan does about it."""

    operation: OperationStatus
    committed: int  # the committed size after this step (the new size once Completed)
    actions: tuple[Action, ...] = ()  # StartResize / CancelResize
    events: tuple[Event, ...] = ()
    lost: str = ""  # the resize left the fleet unusable: recover, with this reason
    joining: frozenset[int] = frozenset()  # new ranks whose pods the fleet keeps (and creates)
    leaving: frozenset[int] = frozenset()  # ranks being removed, whose pods stay until retired
    retired: frozenset[int] = frozenset()  # ranks whose pods may go now
    rank_states: Mapping[int, tuple[RankPhase, str]] = field(default_factory=dict)  # the frontend's view
    redundant_experts: int | None = None  # MoE: R' as the frontend computed it (new ranks' pods need it)


def frontends_resize(fleet: FleetRef, observed: Observed, basis: Basis, now: str) -> tuple[Observed, Basis]:
    """What the frontend's view of the fleet (`observed.fleet`) says and the status does not, where no operation is in
    flight: the status was lost while a resize ran (or its write after the resize started).

    * A resize the frontend runs is followed from now on as the operation in flight, from the size it started at,
      instead of another being started (the frontend would refuse it: one resize runs at a time).
    * With none running, a committed size smaller than the status's is the frontend's (a scale-down it completed
      before the status said so): the ranks past it are retired, their pods go.

    A replacement of ranks in place that the status does not record is not taken over yet: an operation the planner
    asks for meanwhile is refused by the frontend (409) while it runs."""
    view = observed.fleet
    if view is None or not view.reachable or basis.running is not None or basis.fresh:
        return observed, basis
    running = view.resize
    if running is not None and not running.replace and running.account.phase in OPERATION_PHASES:
        seen = running.account
        op = OperationStatus(id=seen.id, fromReplicas=running.from_replicas, toReplicas=running.to_replicas,
                             phase=cast(OperationPhase, seen.phase), startedAt=now, message=seen.message,
                             fleetGeneration=basis.generation)
        adopted = Event("Warning", "ResizeAdopted",
                        f"resize {op.id} ({op.fromReplicas} -> {op.toReplicas}) runs on the frontend and the status "
                        "does not record it (lost?): followed as the operation in flight")
        return replace(observed, frontend=FrontendObs(reachable=True, resize=seen)), replace(
            basis, running=op, committed=op.fromReplicas, members=frozenset(desired_pod_names(fleet, op.fromReplicas)),
            events=(*basis.events, adopted))
    if running is None and view.size is not None and 0 < view.size < basis.committed:
        adopted = Event("Warning", "ResizeAdopted",
                        f"the frontend serves {view.size} ranks and the status says {basis.committed} (lost?): "
                        f"{span(range(view.size, basis.committed))} retired on the frontend, their pods go")
        return observed, replace(basis, committed=view.size, members=frozenset(desired_pod_names(fleet, view.size)),
                                 events=(*basis.events, adopted))
    return observed, basis


def resize_id(frm: int, to: int, fleet_generation: int, now: str) -> str:
    """A resize's id: readable, and unique per incarnation and second (`2to3-g1-20261201t101500z`)."""
    stamp = id_stamp(now)
    return f"{frm}to{to}-g{fleet_generation}-{stamp}"


def retry_wait(old: EngineCoreSetStatus, to: int, now: str) -> float:
    """Seconds until a resize to `to` may be tried again (0: now): a resize that failed at this size and
    incarnation is retried after RESIZE_RETRY_SECONDS."""
    last = old.operation
    if last is None or last.phase != "Failed" or last.toReplicas != to or last.fromReplicas != old.replicas \
            or last.fleetGeneration != old.fleetGeneration:
        return 0.0
    return max(0.0, RESIZE_RETRY_SECONDS - seconds_between(last.finishedAt, now))


def start_resize(fleet: FleetRef, committed: int, generation: int, now: str) -> ResizeStep:
    """A new resize from the committed size to `spec.replicas`, asked of the frontend."""
    spec = fleet.spec
    to = spec.replicas
    op = OperationStatus(id=resize_id(committed, to, generation, now), fromReplicas=committed, toReplicas=to,
                         phase="Pending", startedAt=now, message="asking the frontend", fleetGeneration=generation)
    step = _moving(op, committed)
    what = (f"adding {span(step.joining)} (new pods)" if step.joining
            else f"draining and retiring {span(step.leaving)}")
    return replace(step, actions=(_start(spec, op),), events=(
        Event("Normal", "ResizeStarted", f"resize {op.id}: {committed} -> {to} ranks in place: {what}"),))


def continue_resize(fleet: FleetRef, observed: Observed, op: OperationStatus, committed: int,
                    current: Mapping[str, PodObs], now: str) -> ResizeStep:
    """Follow a resize in flight one step, from the frontend's account of it (`observed.frontend`)."""
    spec = fleet.spec
    step = _moving(op, committed)
    elapsed = seconds_between(op.startedAt, now)
    timeout = op_timeout(op, spec)
    frontend = observed.frontend
    seen = frontend.resize if frontend is not None and frontend.reachable else None
    no_coordinator = coordinator_gone(fleet, current)
    if seen is None:
        step = _without_account(spec, step, frontend, elapsed, timeout, now)
        if step.lost or step.operation.done:
            return step
    else:
        step = _with_account(fleet, step, seen, current, elapsed, timeout, now, no_coordinator)
        if seen.phase in ("Completed", "Failed"):
            return step
    step = _cancel_joining(fleet, step, op, current, no_coordinator if seen is not None else "")
    if seen is not None and elapsed > timeout:
        cancel = CancelResize(op.id, f"it ran {elapsed:.0f}s, past its timeout of {timeout:.0f}s")
        step = replace(step, actions=(*step.actions, cancel))
    return step


def op_timeout(op: OperationStatus, spec: EngineCoreSetSpec) -> float:
    """How long a resize may run: its own timeout (joining, or draining) plus the frontend's grace."""
    budget = spec.scaling.readyTimeoutSeconds if op.scale_up else spec.scaling.drainTimeoutSeconds
    return budget + FRONTEND_GRACE_SECONDS


def _moving(op: OperationStatus, committed: int) -> ResizeStep:
    """The step before anything is known of the operation: the ranks it adds, or removes."""
    if op.scale_up:
        return ResizeStep(operation=op, committed=committed, joining=frozenset(range(op.fromReplicas, op.toReplicas)))
    return ResizeStep(operation=op, committed=committed, leaving=frozenset(range(op.toReplicas, op.fromReplicas)))


def _start(spec: EngineCoreSetSpec, op: OperationStatus) -> StartResize:
    return StartResize(op.id, op.toReplicas, float(spec.scaling.drainTimeoutSeconds),
                       float(spec.scaling.readyTimeoutSeconds))


def _without_account(spec: EngineCoreSetSpec, step: ResizeStep, frontend: FrontendObs | None, elapsed: float,
                     timeout: float, now: str) -> ResizeStep:
    """The frontend says nothing of the operation: it cannot be asked, it refused it, or it does not know it
    (yet: a Pending operation is asked of it, again, idempotent by id)."""
    op = step.operation
    if frontend is None or not frontend.reachable:
        why = frontend.error if frontend is not None else "the frontend has no address"
        if elapsed > timeout:
            return replace(step, lost=f"resize {op.id}: no answer from the frontend for {elapsed:.0f}s ({why})")
        return replace(step, operation=replace(op, message=f"waiting for the frontend's admin API: {why}"))
    if frontend.refused:
        return replace(step, operation=replace(op, phase="Failed", finishedAt=now, message=frontend.refused),
                       retired=step.joining, events=(Event(
                           "Warning", "ResizeFailed", f"resize {op.id} ({op.fromReplicas} -> {op.toReplicas}): "
                                                      f"{frontend.refused}; retrying in {RESIZE_RETRY_SECONDS:.0f}s "
                                                      "unless replicas changes"),))
    if op.phase != "Pending":
        return replace(step, lost=f"resize {op.id}: the frontend no longer knows it (it restarted?)")
    return replace(step, actions=(_start(spec, op),))


def _with_account(fleet: FleetRef, step: ResizeStep, seen: ResizeObs, current: Mapping[str, PodObs],
                  elapsed: float, timeout: float, now: str, no_coordinator: str = "") -> ResizeStep:
    """The frontend's account of the operation: Completed (Committing until the new pods are Ready, unless
    past the timeout), Failed, or still on its way (its phase, and the leaving ranks it has retired).
    `no_coordinator`: why the dense fleet's coordinator is gone (a failed resize is retried once it is replaced)."""
    op = step.operation
    states = {rank: (cast(RankPhase, state), message) for rank, (state, message) in seen.ranks.items()
              if state in SHOWN_RANK_STATES}
    step = replace(step, redundant_experts=seen.num_redundant_experts, rank_states=states)
    if seen.phase == "Completed":
        pods = {rank: current.get(constants.engine_name(fleet.name, rank)) for rank in step.joining}
        unready = sorted(rank for rank, pod in pods.items() if not pod_ready(pod))
        # A new rank's pod that ended will not turn Ready: the resize ends now, and the rank is a loss of the fleet at
        # its new size (replaced in place), not after the resize's timeout.
        ended = any(pod is not None and pod.phase in POD_TERMINAL for pod in pods.values())
        if unready and elapsed <= timeout and not ended:
            return _committing(step, unready)
        return _completed(fleet, step, seen, elapsed, now)
    if seen.phase == "Failed":
        return _failed(step, seen, now, no_coordinator)
    phase: OperationPhase = seen.phase if seen.phase in OPERATION_PHASES else op.phase
    events = (Event("Normal", f"Resize{phase}", f"resize {op.id}: {seen.message}"),) if phase != op.phase else ()
    retired = frozenset(rank for rank, (state, _) in seen.ranks.items()
                        if state in ("Retired", "Failed") and rank in step.leaving)
    return replace(step, operation=replace(op, phase=phase, message=seen.message), events=events, retired=retired)


def _committing(step: ResizeStep, unready: list[int]) -> ResizeStep:
    """The frontend serves on the new ranks; the resize is done once Kubernetes sees their pods Ready too
    (the kubelet's readiness probe lags the handshake by up to its period)."""
    op = step.operation
    now_op = replace(op, phase="Committing", message=f"the frontend serves on {span(step.joining)}; waiting for the "
                                                     f"pod(s) of {span(unready)} to be Ready")
    events = (Event("Normal", "ResizeCommitting", f"resize {op.id}: {now_op.message}"),) \
        if op.phase != "Committing" else ()
    return replace(step, operation=now_op, events=events)


def _completed(fleet: FleetRef, step: ResizeStep, seen: ResizeObs, elapsed: float, now: str) -> ResizeStep:
    """The new size is committed; the leaving ranks' pods go."""
    op = step.operation
    retired = [Event("Normal", "RankRetired", f"rank {rank} retired by resize {op.id}: deleting pod "
                                              f"{constants.engine_name(fleet.name, rank)}")
               for rank in sorted(step.leaving)]
    done = Event("Normal", "ResizeCompleted", f"resize {op.id}: the fleet serves at {op.toReplicas} ranks "
                                              f"({op.fromReplicas} -> {op.toReplicas} in {elapsed:.0f}s)")
    return replace(step, committed=op.toReplicas, retired=step.leaving, events=(*retired, done),
                   operation=replace(op, phase="Completed", finishedAt=now, message=seen.message))


def _failed(step: ResizeStep, seen: ResizeObs, now: str, no_coordinator: str = "") -> ResizeStep:
    """A failed resize: the fleet serves on at the old size (the new ranks' pods go, it is retried later: once the
    coordinator is replaced, where it is gone), or, when the frontend says it cannot (`fleet_intact` false), the
    fleet is lost."""
    op = step.operation
    step = replace(step, operation=replace(op, phase="Failed", finishedAt=now, message=seen.error or seen.message))
    if not seen.fleet_intact:
        return replace(step, lost=f"resize {op.id} failed and left the fleet unusable: {seen.error}")
    retry = "retried once the coordinator is replaced in place" if no_coordinator else \
        f"retrying in {RESIZE_RETRY_SECONDS:.0f}s unless replicas changes"
    return replace(step, retired=step.joining, events=(Event(
        "Warning", "ResizeFailed", f"resize {op.id} ({op.fromReplicas} -> {op.toReplicas}) failed: {seen.error}; "
                                   f"the fleet serves on at {op.fromReplicas} ranks; {retry}"),))


def _cancel_joining(fleet: FleetRef, step: ResizeStep, op: OperationStatus, current: Mapping[str, PodObs],
                    no_coordinator: str) -> ResizeStep:
    """New ranks' pods are created (again, if one vanished) while the frontend waits for them; one that failed will
    never join, nor will any while the coordinator is gone (`no_coordinator`: a new engine waits for its READY; a
    scale-down needs none to finish and runs on), so the frontend is told to give the resize up: asked on every pass
    until it reports the resize ended, told once (the stored operation's message)."""
    if not op.scale_up or step.operation.phase not in ("Pending", "Preparing"):
        return step
    failed = [pod for rank in sorted(step.joining)
              if (pod := current.get(constants.engine_name(fleet.name, rank))) is not None
              and pod.phase in POD_TERMINAL]
    if failed:
        pod = failed[0]
        reason = f"pod {pod.name} of rank {pod.rank} {pod.phase.lower()}" + (f": {pod.message}" if pod.message else "")
    elif no_coordinator:
        reason = f"{no_coordinator}: a new rank cannot join without it (it is replaced in place once the resize ended)"
    else:
        return step
    events = () if op.message.startswith("cancelling") else (
        Event("Warning", "ResizeCancelling", f"resize {op.id}: {reason}: cancelling it"),)
    return replace(step, actions=(*step.actions, CancelResize(op.id, reason)), events=(*step.events, *events),
                   operation=replace(step.operation, message=f"cancelling: {reason}"))


def coordinator_gone(fleet: FleetRef, current: Mapping[str, PodObs]) -> str:
    """Why a dense fleet's coordinator pod (of the current incarnation) is gone: failed, or vanished or being deleted
    (`current` holds no pod being deleted); "" while it runs (or for an MoE fleet, whose resize needs it: its loss is
    a recovery)."""
    if fleet.spec.expertParallel:
        return ""
    name = constants.coordinator_name(fleet.name)
    pod = current.get(name)
    if pod is None:
        return f"the coordinator's pod {name} is gone"
    if pod.phase in POD_TERMINAL:
        return f"the coordinator's pod {name} {pod.phase.lower()}" + (f": {pod.message}" if pod.message else "")
    return ""
