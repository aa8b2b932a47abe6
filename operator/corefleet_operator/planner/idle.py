# SPDX-License-Identifier: Apache-2.0
"""Scale to zero in place (`spec.idle`): a dense fleet goes idle, keeps its endpoint, and wakes on demand.

Going idle (`idle_cause`, `start_idle`, `continue_idle`), with nothing in flight while the fleet is Running:

* when `spec.replicas` is 0 (an autoscaler at its minimum of 0; cause ReplicasZero), or after
  `spec.idle.afterSeconds` with no request in flight or waiting at the frontend (its `quiet_s` and
  `requests_waiting`, read with its view of the ranks) and no operation (cause Quiet);
* an operation (`status.operation.idle`, fromReplicas == toReplicas) asks the frontend to go idle
  (`StartResize.idle`, idempotent by id): it stops routing to every rank, lets the requests in flight
  finish (drainTimeoutSeconds), releases every engine and holds new requests. A request that arrives
  during the drain makes the frontend fail the operation with the fleet intact: it serves on
  (event IdleCancelled; at replicas 0 the idling is tried again after RESIZE_RETRY_SECONDS).
* Completed: `status.idle` is set (since, cause) and the engine pods are deleted (`planner.children`):
  phase Idle, no GPU requested, the frontend and coordinator stay (event FleetIdle).

Waking (`wake_reason`, `start_wake`), while idle with nothing in flight: when `spec.replicas` > 0 and
it was idled at replicas 0 (an autoscaler raised it), `spec.idle` was removed, `replicas` differs from
the idle size, or a request waits at the frontend (`spec.idle.wakeOnRequest`). A wake is a replacement
of every rank in place (`planner.replace`, `OperationStatus.wake`): new engine pods at the idle size,
taken by the frontend in its Idle ranks' place; phase Waking (event FleetWaking), then Running
(event FleetAwake). A different `replicas` is a resize after the wake. A wake that fails (a new pod
fails, or no end within readyTimeoutSeconds + FRONTEND_GRACE_SECONDS) leaves the fleet idle: the
frontend is told to cancel it, the new pods go, `status.idle` counts the failure and the next wake
waits for the recovery backoff (`retryAt`; event WakeFailed). Requests held meanwhile get the
frontend's 503 with Retry-After at its hold timeout.

A lost frontend or coordinator while idle recreates the fleet (awake: an idle frontend has no
engine to attach to); a configuration change recreates it too.

Pure module: no kopf, no Kubernetes client, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from corefleet_operator.actions import Action, CancelResize, Event, StartResize
from corefleet_operator.models import (
    EngineCoreSetSpec,
    FleetRef,
    IdleCause,
    IdleStatus,
    OperationPhase,
    OperationStatus,
)
from corefleet_operator.observe import FleetObs, Observed
from corefleet_operator.planner.common import FRONTEND_GRACE_SECONDS, id_stamp, later, seconds_between
from corefleet_operator.planner.recovery import backoff_seconds

# While idle, the frontend is asked this often whether requests wait (the wake's latency, before the engines').
IDLE_POLL_SECONDS = 1.0


@dataclass(frozen=True)
class IdleStep:
    """One step of going idle: the operation as it now stands, and what the plan does about it."""

    operation: OperationStatus
    actions: tuple[Action, ...] = ()
    events: tuple[Event, ...] = ()
    idle: IdleStatus | None = None  # set once the fleet is idle (the operation Completed)


def idle_id(kind: str, fleet_generation: int, now: str) -> str:
    """An idling's or a wake's id: readable, unique per incarnation and second (`idle-g1-20261201t101500z`)."""
    stamp = id_stamp(now)
    return f"{kind}-g{fleet_generation}-{stamp}"


def idle_cause(spec: EngineCoreSetSpec, seen: FleetObs | None, committed: int,
               last: OperationStatus | None, retry_s: float, now: str) -> IdleCause | None:
    """Why a Running dense fleet with nothing in flight goes idle now, if it does: replicas 0 (not again within
    `retry_s` of an idling that failed), or quiet for `spec.idle.afterSeconds` (per the frontend's view `seen`), or
    the frontend reports every rank Idle already."""
    if spec.expertParallel or committed == 0:
        return None
    if seen is not None and seen.reachable and seen.ranks and all(r.state == "Idle" for r in seen.ranks.values()):
        # The frontend idled it already (an idling given up here while the frontend finished it): asked again, the
        # frontend completes it at once, and the fleet is idle here too (and wakes as it should).
        return "ReplicasZero" if spec.replicas == 0 else "Quiet"
    if spec.idle is None:
        return None
    if spec.replicas == 0:
        failed_lately = last is not None and last.idle and last.phase == "Failed" \
            and seconds_between(last.finishedAt, now) < retry_s
        return None if failed_lately else "ReplicasZero"
    after = spec.idle.afterSeconds
    if after is None or spec.replicas != committed or seen is None or not seen.reachable or seen.quiet_s is None:
        return None
    # A whole idle period after the last operation too: a fleet woken or resized without a request is not idled at
    # once by a quiet that began before.
    settled = last is None or seconds_between(last.finishedAt or last.startedAt, now) >= after
    return "Quiet" if settled and seen.requests_waiting == 0 and seen.quiet_s >= after else None


def start_idle(spec: EngineCoreSetSpec, committed: int, generation: int, cause: IdleCause, quiet_s: float | None,
               now: str) -> IdleStep:
    """A new idling of the whole fleet: asked of the frontend at once."""
    why = "replicas is 0" if cause == "ReplicasZero" else f"no request for {quiet_s or 0:.0f}s"
    op = OperationStatus(id=idle_id("idle", generation, now), fromReplicas=committed, toReplicas=committed,
                         phase="Pending", startedAt=now, fleetGeneration=generation, idle=True,
                         message=f"going idle ({why}): draining every rank, then releasing the engines")
    return IdleStep(operation=op, actions=(_ask(spec, op),), events=(Event(
        "Normal", "FleetIdling", f"{why}: draining the fleet's {committed} ranks, then deleting their pods (the "
                                 "frontend and coordinator stay; requests wait there and wake it)"),))


def continue_idle(fleet: FleetRef, observed: Observed, op: OperationStatus, now: str) -> IdleStep:
    """Follow an idling one step from the frontend's account of it."""
    spec = fleet.spec
    frontend = observed.frontend
    step = IdleStep(operation=op)
    limit = float(spec.scaling.drainTimeoutSeconds) + FRONTEND_GRACE_SECONDS
    if frontend is None or not frontend.reachable:
        why = frontend.error if frontend is not None else "the frontend has no address"
        if seconds_between(op.startedAt, now) > limit:
            return _failed(step, f"the frontend's admin API did not answer for {limit:.0f}s: {why}", now)
        return replace(step, operation=replace(op, message=f"waiting for the frontend's admin API: {why}"))
    seen = frontend.resize
    if seen is None and frontend.refused:
        return _failed(step, frontend.refused, now)
    if seen is None:
        return replace(step, actions=(_ask(spec, op),))
    if seen.phase == "Failed":
        return _failed(step, seen.error or seen.message, now)
    if seen.phase == "Completed":
        cause: IdleCause = "ReplicasZero" if spec.replicas == 0 else "Quiet"
        took = seconds_between(op.startedAt, now)
        done = replace(op, phase="Completed", finishedAt=now, message=f"idle after a drain of {took:.0f}s")
        return IdleStep(operation=done, idle=IdleStatus(since=now, cause=cause), events=(Event(
            "Normal", "FleetIdle", f"idle: the {op.toReplicas} ranks drained and released (their pods go); the "
                                   "endpoint stays, requests wait at the frontend"
                                   + (" and wake the fleet" if cause == "Quiet" and spec.idle is not None
                                      and spec.idle.wakeOnRequest else "")),))
    return replace(step, operation=replace(op, phase=_phase(seen.phase), message=seen.message or op.message))


def _phase(frontend_phase: str) -> OperationPhase:
    phases: tuple[OperationPhase, ...] = ("Pending", "Preparing", "Draining", "Committing")
    return next((p for p in phases if p == frontend_phase), "Draining")


def _failed(step: IdleStep, why: str, now: str) -> IdleStep:
    """The idling ended without the fleet idle: it serves on."""
    op = replace(step.operation, phase="Failed", finishedAt=now, message=f"not idle: {why}; the fleet serves on")
    return IdleStep(operation=op, events=(Event("Normal", "IdleCancelled", f"{op.id}: {op.message}"),))


def _ask(spec: EngineCoreSetSpec, op: OperationStatus) -> StartResize:
    return StartResize(op.id, op.toReplicas, float(spec.scaling.drainTimeoutSeconds),
                       float(spec.scaling.readyTimeoutSeconds), idle=True)


def wake_reason(spec: EngineCoreSetSpec, idle: IdleStatus, seen: FleetObs | None, committed: int) -> str:
    """Why an idle fleet wakes now ("": it stays idle)."""
    if spec.replicas == 0:
        return ""
    if spec.idle is None:
        return "spec.idle was removed"
    if idle.cause == "ReplicasZero":
        return f"replicas is {spec.replicas}"
    if spec.replicas != committed:
        return f"replicas is {spec.replicas} (it idled at {committed})"
    if spec.idle.wakeOnRequest and seen is not None and seen.reachable and seen.requests_waiting > 0:
        return f"{seen.requests_waiting} request(s) waiting at the frontend"
    return ""


def wake_wait(idle: IdleStatus, now: str) -> float:
    """Seconds a wake still waits for the backoff after a failed one."""
    return max(0.0, seconds_between(now, idle.retryAt)) if idle.retryAt else 0.0


def start_wake(committed: int, generation: int, reason: str, now: str) -> tuple[OperationStatus, Event]:
    """A wake: every rank replaced in place (`planner.replace` follows it)."""
    op = OperationStatus(id=idle_id("wake", generation, now), fromReplicas=committed, toReplicas=committed,
                         phase="Pending", startedAt=now, fleetGeneration=generation, replace=tuple(range(committed)),
                         wake=True, message=f"waking ({reason}): creating the {committed} engine pod(s)")
    return op, Event("Normal", "FleetWaking", f"{reason}: waking the fleet at {committed} ranks (new engine pods join "
                                              "in place; held requests are served once one does)")


def wake_failed(spec: EngineCoreSetSpec, idle: IdleStatus, op: OperationStatus, why: str, backoff_scale: float,
                now: str) -> tuple[OperationStatus, IdleStatus, tuple[Action, ...], Event]:
    """A wake that cannot succeed: it fails, the frontend cancels it (its ranks stay Idle), the fleet stays idle and
    the next wake waits for the recovery backoff."""
    failures = idle.wakeFailures + 1
    wait = backoff_seconds(failures + 1, backoff_scale)
    failed = replace(op, phase="Failed", finishedAt=now, message=f"{why}; the fleet stays idle")
    idle = replace(idle, wakeFailures=failures, retryAt=later(now, wait), message=why)
    return failed, idle, (CancelResize(op.id, why),), Event(
        "Warning", "WakeFailed", f"{op.id} ({failures} in a row): {why}; the fleet stays idle, held requests get 503 "
                                 f"at the frontend's hold timeout ({spec.frontend.hold.timeoutSeconds}s); next wake "
                                 f"no sooner than {idle.retryAt}")
