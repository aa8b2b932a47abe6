# SPDX-License-Identifier: Apache-2.0
"""The pure planner: from the spec and what is observed, the next step for one fleet.

`plan(fleet, observed, now)` works out where the fleet is from what it sees (its pods, its other
children, the status it last wrote and, while a resize runs, the frontend's account of it), and
returns the actions that move it one step closer to the spec, the status to write, the events to
emit and when to look again. It keeps no state between calls: the status it returns is the only
memory, and everything else is observed again on every call.

The rules:

* A fleet has an incarnation, `status.fleetGeneration`, and every pod carries the incarnation and
  the hash of the fleet-wide configuration it was built from. vLLM ranks must run identical
  configuration and an engine that restarts cannot rejoin, so pods are never updated in place.
* `status.replicas` is the committed size: the ranks 0..replicas-1 are the fleet's members.
* A member pod (coordinator, frontend, engine below the committed size) of the current incarnation
  that failed, one that vanished from a fleet that was complete, one bound but not Ready for
  `readyTimeoutSeconds` (since it was scheduled or last became unready: ReadyTimeout), and, while
  the fleet serves, a rank the frontend's admin API reports Dead, or Unresponsive for longer than
  `UNRESPONSIVE_SECONDS`, while its pod runs (`Observed.fleet`, read every `FRONTEND_POLL_SECONDS`)
  is a lost rank: the fleet is recreated at the committed size (Recovering); a resize in flight
  fails with it. Except:
* A dense fleet (not `expertParallel`) loses ranks, not the endpoint: when it serves (Running or
  Degraded, no operation in flight) and the only losses are engine ranks below the committed size
  (not all of them), with its frontend and coordinator pods Ready, the lost ranks are replaced in
  place, in the same incarnation, as an operation (`status.operation` with `replace` = the ranks,
  fromReplicas == toReplicas; `_continue_replace`): each lost rank's old pod is deleted (Pending);
  once it is gone and the recovery's backoff is over, the new pod of the same name is created
  (Preparing, written first: a pod of the rank seen while Pending is the old one); once the frontend
  reports the ranks Dead (its view comes with `FrontendObs.fleet` while it does not know the
  operation), `StartResize` with `replace` asks it to take the new engines through vLLM's handshake;
  Completed once it serves on them and their pods are Ready (event RankReplaced). The fleet is
  Degraded meanwhile, the other ranks serve on, and a restarted operator carries the same operation
  on. A replacement is a loss like any other for the streak (attempt, backoff, budget, `recoveries`).
  A replacement that fails (the frontend's operation Failed or refused, a new pod that fails, no end
  within readyTimeoutSeconds + FRONTEND_GRACE_SECONDS), any other loss during it, a lost frontend or
  coordinator, and an MoE fleet's lost rank (its collectives cannot lose a member) recreate the fleet.
* Every lost incarnation is one recovery (`recoveries`, the total) and one attempt of the current
  streak (`status.recovery`: attempt, lostAt, reason, retryAt). Recovery n of a streak waits
  `backoff_seconds(n)` (0, then 10 s doubling to 300 s) before the new incarnation's pods are
  created (`retryAt`; the plan's `requeue_after` wakes the reconciler then). A loss past
  `spec.scaling.maxRecoveries` in a streak gives the fleet up: phase Failed (condition
  RecoveriesExhausted with the last loss's reason), its running pods deleted, the pods that ended
  kept for their logs, nothing created until the spec changes. A streak ends after
  `STREAK_RESET_SECONDS` Running, or with a new spec generation. `PlanSettings.backoff_scale` scales
  every backoff (tests only; the operator reads it from `COREFLEET_RECOVERY_BACKOFF_SCALE`).
* A pod whose configuration hash differs from the spec's means the spec changed (image, model,
  engine args, ...; not `replicas`): the fleet is recreated at the new spec (Restarting).
* Recreation is one incarnation up: every pod of an older incarnation is deleted (by name and
  UID), and the new incarnation's pods are created only once the old ones are gone.
* `replicas` differing from the committed size is a resize, carried out in place by the frontend
  as an operation with an id (`status.operation`), at most one at a time:
  - it starts only while the fleet is Running (every member ready); meanwhile, and while another
    resize runs, the change waits (the latest `replicas` wins);
  - scale-up N -> M: the operation is started on the frontend (`StartResize`) and exactly the pods
    of ranks N..M-1 are created; once the frontend reports it Completed, the committed size is M.
    A new rank's pod that fails makes the operator cancel the operation (`CancelResize`);
  - scale-down M -> N: the operation is started; each leaving rank's pod is deleted only once the
    frontend reports that rank Retired; once Completed, the committed size is N;
  - a Failed operation after which the frontend still serves at the old size (`fleet_intact`)
    leaves the fleet as it was (pods of ranks that did not join are deleted) and is retried after
    `RESIZE_RETRY_SECONDS` unless `replicas` changes; one after which it cannot is a recovery;
  - the operation is followed by asking the frontend on every reconcile (`requeue_after`); a
    frontend that stops answering past the operation's own timeouts is a recovery;
  - MoE fleets (`expertParallel`) resize through the same operation (the frontend runs vLLM's
    elastic-EP protocol); a new rank's pod carries the new size, `VLLM_ELASTIC_EP_SCALE_UP_LAUNCH=1`
    and the fleet's redundant experts at the new size (R' in `--eplb-config`), which only the
    frontend can compute (it knows the model's experts): the pods are created once the frontend's
    account of the operation names R'. Once it completes, R' is `status.redundantExperts`: a fleet
    recreated at that size starts every pod with it (elastic EP keeps the physical experts per rank,
    so a fleet recreated without them could not shrink back). An MoE resize that fails after its
    ranks were told to reconfigure leaves the fleet unusable (`fleet_intact` false): a recovery;
  - a fleet that never served (Starting, or Restarting) is recreated at the new size instead, a
    stopped fleet (0) starts at the new size, and 0 stops a fleet (once no resize runs).
* Services, the admin Secret and the NetworkPolicy are applied whenever they are missing or differ
  from what the builders produce, so drift is repaired; nothing is written when nothing changed.

Pure module: no kopf, no Kubernetes client, no I/O, no environment (the knobs come in `PlanSettings`).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from corefleet_operator import builders, constants
from corefleet_operator.actions import Action, Apply, CancelResize, Delete, Event, StartResize
from corefleet_operator.models import (
    EngineCoreSetStatus,
    FleetPhase,
    FleetRef,
    OperationPhase,
    OperationStatus,
    RankPhase,
    RankStatus,
    RecoveryStatus,
    SpecError,
)
from corefleet_operator.observe import FleetObs, Observed, PodObs, ResizeObs
from corefleet_operator.status import (
    POD_TERMINAL,
    Decision,
    compute_status,
    exhausted_message,
    invalid_spec_status,
    rank_phase,
)

# Children the spec may switch off: deleted when observed but no longer desired (kind -> apiVersion).
OPTIONAL_KINDS = {"NetworkPolicy": "networking.k8s.io/v1"}

RESIZE_POLL_SECONDS = 1.0  # while a resize runs: its progress on the frontend is no Kubernetes event
REDUNDANT_EXPERTS_POLL_SECONDS = 0.2  # an MoE scale-up's new pods wait for R' from the frontend (its first answer)
RESIZE_RETRY_SECONDS = 300.0  # a resize that failed is retried after this long (sooner if replicas changes)
FRONTEND_GRACE_SECONDS = 120.0  # a resize unanswered this long past its own timeouts is lost
OPERATION_PHASES: tuple[OperationPhase, ...] = ("Pending", "Preparing", "Draining", "Committing")

# Recovery: the backoff before recovery n of a streak is 0 for the first, then 10 s, 20 s, 40 s, ... capped
# at 300 s; a streak ends after STREAK_RESET_SECONDS Running, or when the spec changes.
BACKOFF_FIRST_SECONDS = 10.0
BACKOFF_MAX_SECONDS = 300.0
STREAK_RESET_SECONDS = 600.0


@dataclass(frozen=True)
class PlanSettings:
    """The planner's knobs, passed in by the operator (read at its edge, never by the planner).

    backoff_scale: every recovery backoff is multiplied by this (tests: e.g. 0.1 gives 0, 1 s, 2 s, ..., so a
    crash loop runs through its budget in seconds)."""

    backoff_scale: float = 1.0
# The frontend's view of the ranks is read this often while the fleet serves; a rank it reports
# Unresponsive for longer than UNRESPONSIVE_SECONDS (or Dead) while its pod runs is lost.
FRONTEND_POLL_SECONDS = 15.0
UNRESPONSIVE_SECONDS = 60.0




@dataclass(frozen=True)
class Plan:
    status: EngineCoreSetStatus
    actions: tuple[Action, ...] = ()
    events: tuple[Event, ...] = ()
    requeue_after: float | None = None  # reconcile again within this many seconds even if nothing changes


# ---- helpers ----------------------------------------------------------------------------------
def is_subset(want: Any, have: Any) -> bool:
    """True if every field in `want` is in `have` with the same value (server defaults may add more)."""
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(k in have and is_subset(v, have[k]) for k, v in want.items())
    if isinstance(want, list):
        return (isinstance(have, list) and len(want) == len(have)
                and all(is_subset(a, b) for a, b in zip(want, have, strict=True)))
    return bool(want == have)


def desired_pod_names(fleet: FleetRef, replicas: int) -> list[str]:
    """The member pods of a fleet of `replicas` ranks (none for a stopped fleet)."""
    if replicas == 0:
        return []
    return [constants.coordinator_name(fleet.name), constants.frontend_name(fleet.name),
            *(constants.engine_name(fleet.name, r) for r in range(replicas))]


def _what(pod: PodObs) -> str:
    return f"rank {pod.rank}" if pod.role == constants.ROLE_ENGINE else pod.role


def _lost_rank(fleet: FleetRef, pod: PodObs | str) -> int | None:
    """The engine rank a lost pod (or the name of a vanished one) served; None for the frontend or coordinator."""
    if isinstance(pod, PodObs):
        return pod.rank if pod.role == constants.ROLE_ENGINE else None
    prefix = constants.engine_name(fleet.name, 0)[:-1]
    tail = pod[len(prefix):] if pod.startswith(prefix) else ""
    return int(tail) if tail.isdigit() else None


def _describe_loss(pod: PodObs | str) -> str:
    if isinstance(pod, str):
        return f"pod {pod} disappeared"
    why = f": {pod.message}" if pod.message else ""
    return f"{_what(pod)} (pod {pod.name}) {pod.phase.lower()}{why}"


def _ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}..{ranks[-1]}"


def _listed(ranks: Iterable[int]) -> str:
    """Ranks that need not be contiguous (those a replacement gives new pods)."""
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def parse_time(value: str | None) -> datetime.datetime | None:
    if not value:
        return None
    return datetime.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)


def seconds_between(start: str | None, end: str) -> float:
    begin, finish = parse_time(start), parse_time(end)
    if begin is None or finish is None:
        return 0.0
    return (finish - begin).total_seconds()


def resize_id(frm: int, to: int, fleet_generation: int, now: str) -> str:
    """A resize's id: readable, and unique per incarnation and second (`2to3-g1-20261201t101500z`)."""
    stamp = now.replace("-", "").replace(":", "").lower()
    return f"{frm}to{to}-g{fleet_generation}-{stamp}"


@dataclass
class _Resize:
    """The resize part of one plan (built up by `_continue_resize` / `_start_resize`)."""

    operation: OperationStatus | None
    actions: list[Action] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    committed: int = 0
    lost: str = ""  # the resize left the fleet unusable: recover, with this reason
    joining: frozenset[int] = frozenset()  # new ranks whose pods the fleet keeps (and creates)
    leaving: frozenset[int] = frozenset()  # ranks being removed, whose pods stay until retired
    retired: frozenset[int] = frozenset()  # ranks whose pods may go now
    rank_states: dict[int, tuple[RankPhase, str]] = field(default_factory=dict)
    redundant_experts: int | None = None  # MoE: R' as the frontend computed it (new ranks' pods need it)


def _ready(pod: PodObs | None) -> bool:
    return pod is not None and pod.ready and pod.phase == "Running" and not pod.terminating


def _op_timeout(op: OperationStatus, spec_join: float, spec_drain: float) -> float:
    budget = spec_join if op.scale_up else spec_drain
    return budget + FRONTEND_GRACE_SECONDS


def _continue_resize(fleet: FleetRef, observed: Observed, op: OperationStatus, committed: int,
                     current: Mapping[str, PodObs], now: str) -> _Resize:
    """Follow a resize in flight from the frontend's account of it."""
    spec = fleet.spec
    r = _Resize(operation=op, committed=committed)
    up = op.scale_up
    if up:
        r.joining = frozenset(range(op.fromReplicas, op.toReplicas))
    else:
        r.leaving = frozenset(range(op.toReplicas, op.fromReplicas))
    frontend = observed.frontend
    elapsed = seconds_between(op.startedAt, now)
    timeout = _op_timeout(op, spec.scaling.readyTimeoutSeconds, spec.scaling.drainTimeoutSeconds)
    seen: ResizeObs | None = None
    if frontend is None or not frontend.reachable:
        why = frontend.error if frontend is not None else "the frontend has no address"
        if elapsed > timeout:
            r.lost = f"resize {op.id}: no answer from the frontend for {elapsed:.0f}s ({why})"
            return r
        r.operation = replace(op, message=f"waiting for the frontend's admin API: {why}")
    elif frontend.resize is None and frontend.refused:
        r.operation = replace(op, phase="Failed", finishedAt=now, message=frontend.refused)
        r.retired = r.joining
        r.events.append(Event("Warning", "ResizeFailed", f"resize {op.id} ({op.fromReplicas} -> {op.toReplicas}): "
                                                         f"{frontend.refused}; retrying in {RESIZE_RETRY_SECONDS:.0f}s "
                                                         "unless replicas changes"))
        return r
    elif frontend.resize is None:
        if op.phase != "Pending":
            r.lost = f"resize {op.id}: the frontend no longer knows it (it restarted?)"
            return r
        r.actions.append(StartResize(op.id, op.toReplicas, float(spec.scaling.drainTimeoutSeconds),
                                     float(spec.scaling.readyTimeoutSeconds)))
    else:
        seen = frontend.resize
        r.redundant_experts = seen.num_redundant_experts
        for rank, (state, message) in seen.ranks.items():
            if state in ("Joining", "Serving", "Draining", "Retired", "Failed"):
                r.rank_states[rank] = (state, message)  # type: ignore[assignment]
        unready = sorted(rank for rank in r.joining if not _ready(current.get(constants.engine_name(fleet.name, rank))))
        if seen.phase == "Completed" and unready and elapsed <= timeout:
            # The frontend serves on the new ranks; the resize is done once Kubernetes sees their pods Ready
            # too (the kubelet's readiness probe lags the handshake by up to its period).
            r.operation = replace(op, phase="Committing",
                                  message=f"the frontend serves on {_ranks(r.joining)}; waiting for the pod(s) of "
                                          f"{_ranks(unready)} to be Ready")
            if op.phase != "Committing":
                r.events.append(Event("Normal", "ResizeCommitting", f"resize {op.id}: {r.operation.message}"))
            return r
        if seen.phase == "Completed":
            r.committed = op.toReplicas
            r.operation = replace(op, phase="Completed", finishedAt=now, message=seen.message)
            r.retired = r.leaving
            r.events += [Event("Normal", "RankRetired", f"rank {rank} retired by resize {op.id}: deleting pod "
                                                        f"{constants.engine_name(fleet.name, rank)}")
                         for rank in sorted(r.leaving)]
            r.events.append(Event("Normal", "ResizeCompleted",
                                  f"resize {op.id}: the fleet serves at {op.toReplicas} ranks "
                                  f"({op.fromReplicas} -> {op.toReplicas} in {elapsed:.0f}s)"))
            return r
        if seen.phase == "Failed":
            r.operation = replace(op, phase="Failed", finishedAt=now, message=seen.error or seen.message)
            if not seen.fleet_intact:
                r.lost = f"resize {op.id} failed and left the fleet unusable: {seen.error}"
                return r
            r.retired = r.joining  # never committed: their pods go
            r.events.append(Event("Warning", "ResizeFailed",
                                  f"resize {op.id} ({op.fromReplicas} -> {op.toReplicas}) failed: {seen.error}; "
                                  f"the fleet serves on at {op.fromReplicas} ranks; retrying in "
                                  f"{RESIZE_RETRY_SECONDS:.0f}s unless replicas changes"))
            return r
        phase: OperationPhase = seen.phase if seen.phase in OPERATION_PHASES else op.phase
        r.operation = replace(op, phase=phase, message=seen.message)
        if phase != op.phase:
            r.events.append(Event("Normal", f"Resize{phase}", f"resize {op.id}: {seen.message}"))
        r.retired = frozenset(rank for rank, (state, _) in seen.ranks.items()
                              if state in ("Retired", "Failed") and rank in r.leaving)
    # New ranks: their pods are created (again, if one vanished) while the frontend waits for them;
    # one that failed will never join, so the frontend is told to give up.
    if up and r.operation is not None and r.operation.phase in ("Pending", "Preparing"):
        for rank in sorted(r.joining):
            pod = current.get(constants.engine_name(fleet.name, rank))
            if pod is not None and pod.phase in POD_TERMINAL:
                reason = f"pod {pod.name} of rank {rank} {pod.phase.lower()}" + (f": {pod.message}" if pod.message
                                                                                    else "")
                r.actions.append(CancelResize(op.id, reason))
                if not op.message.startswith("cancelling"):
                    r.events.append(Event("Warning", "ResizeCancelling", f"resize {op.id}: {reason}: cancelling it"))
                r.operation = replace(r.operation, message=f"cancelling: {reason}")
                break
    if r.operation is not None and elapsed > timeout and seen is not None:
        r.actions.append(CancelResize(op.id, f"it ran {elapsed:.0f}s, past its timeout of {timeout:.0f}s"))
    return r


def _start_resize(fleet: FleetRef, committed: int, generation: int, now: str) -> _Resize:
    spec = fleet.spec
    to = spec.replicas
    op = OperationStatus(id=resize_id(committed, to, generation, now), fromReplicas=committed, toReplicas=to,
                         phase="Pending", startedAt=now, message="asking the frontend", fleetGeneration=generation)
    r = _Resize(operation=op, committed=committed)
    r.actions.append(StartResize(op.id, to, float(spec.scaling.drainTimeoutSeconds),
                                 float(spec.scaling.readyTimeoutSeconds)))
    if to > committed:
        r.joining = frozenset(range(committed, to))
        what = f"adding {_ranks(r.joining)} (new pods)"
    else:
        r.leaving = frozenset(range(to, committed))
        what = f"draining and retiring {_ranks(r.leaving)}"
    r.events.append(Event("Normal", "ResizeStarted", f"resize {op.id}: {committed} -> {to} ranks in place: {what}"))
    return r


def replace_id(ranks: Iterable[int], fleet_generation: int, now: str) -> str:
    """A replacement's id: readable, unique per incarnation and second (`replace-r1-g1-20261201t101500z`)."""
    stamp = now.replace("-", "").replace(":", "").lower()
    return f"replace-r{'-'.join(str(r) for r in sorted(ranks))}-g{fleet_generation}-{stamp}"


@dataclass
class _Replace:
    """The replacement part of one plan (`_continue_replace`)."""

    operation: OperationStatus
    actions: list[Action] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    lost: str = ""  # the replacement failed: recover the whole fleet, with this reason
    create: bool = False  # the replaced ranks' new pods may be created (again, if one vanished) this pass
    wait: float | None = None  # look again within this many seconds (the backoff's end)


def _continue_replace(fleet: FleetRef, observed: Observed, op: OperationStatus, current: Mapping[str, PodObs],
                      recovery: RecoveryStatus | None, now: str) -> _Replace:
    """Follow a replacement of lost dense ranks in place (`op.replace`), one step:

    Pending: each replaced rank's old pod is deleted (by name and UID); once no pod of that name is left and the
    recovery's backoff is over, the operation is Preparing (written before the new pods are created: a pod
    of the rank seen while Pending is always the old one, one seen while Preparing the new one).
    Preparing: the new pods are created (again, if one vanished); once the frontend reports every replaced rank
    Dead, the replacement is asked of it (`StartResize` with `replace`, idempotent by id); the frontend's
    operation is followed until Completed and the new pods Ready (Committing meanwhile), then Completed
    (event RankReplaced). A new pod that fails, a Failed or refused operation, or no end within
    readyTimeoutSeconds + FRONTEND_GRACE_SECONDS after the new pods could be created is `lost`: the
    whole fleet is then recovered."""
    spec = fleet.spec
    r = _Replace(operation=op)
    names = {rank: constants.engine_name(fleet.name, rank) for rank in op.replace}
    what = _listed(op.replace)
    retry_at = recovery.retryAt if recovery is not None and recovery.lostAt == op.startedAt else None
    backoff = max(0.0, seconds_between(now, retry_at)) if retry_at else 0.0
    if op.phase == "Pending":
        there = [p for p in observed.pods if p.name in names.values()]
        for p in there:
            if not p.terminating:
                r.actions.append(Delete("v1", "Pod", p.name, p.uid))
        if there:
            r.operation = replace(op, message=f"deleting the old pod(s) of {what}")
            return r
        if backoff > 0:
            r.operation = replace(op, message=f"backoff until {retry_at} before the new pod(s) of {what}")
            r.wait = backoff
            return r
        op = r.operation = replace(op, phase="Preparing", message=f"creating the new pod(s) of {what}")
    r.create = True
    timeout = float(spec.scaling.readyTimeoutSeconds) + FRONTEND_GRACE_SECONDS
    elapsed = seconds_between(retry_at or op.startedAt, now)
    for rank, name in sorted(names.items()):
        pod = current.get(name)
        if pod is not None and pod.phase in POD_TERMINAL:
            why = f": {pod.message}" if pod.message else ""
            r.lost = f"replacement {op.id}: the new pod of rank {rank} ({name}) {pod.phase.lower()}{why}"
            return r
    frontend = observed.frontend
    if frontend is None or not frontend.reachable:
        why = frontend.error if frontend is not None else "the frontend has no address"
        r.operation = replace(op, message=f"waiting for the frontend's admin API: {why}")
    elif frontend.resize is None and frontend.refused:
        r.lost = f"replacement {op.id} of {what}: {frontend.refused}"
        return r
    elif frontend.resize is None:
        seen = frontend.fleet if frontend.fleet is not None else observed.fleet
        states = {rank: (seen.ranks[rank].state if seen is not None and rank in seen.ranks else "unknown")
                  for rank in op.replace}
        if seen is not None and seen.reachable and all(state == "Dead" for state in states.values()):
            r.actions.append(StartResize(op.id, op.toReplicas, float(spec.scaling.drainTimeoutSeconds),
                                         float(spec.scaling.readyTimeoutSeconds), replace=tuple(op.replace)))
            r.operation = replace(op, message=f"asking the frontend to replace {what}")
        else:
            shown = ", ".join(f"rank {rank} {state}" for rank, state in sorted(states.items()))
            r.operation = replace(op, message=f"waiting for the frontend to report {what} Dead ({shown})")
    elif frontend.resize.phase == "Failed":
        seen_op = frontend.resize
        r.lost = f"replacement {op.id} of {what} failed: {seen_op.error or seen_op.message}"
        return r
    elif frontend.resize.phase == "Completed":
        unready = sorted(rank for rank, name in names.items() if not _ready(current.get(name)))
        if unready:
            r.operation = replace(op, phase="Committing",
                                  message=f"the frontend serves on {what} again; waiting for the pod(s) of "
                                          f"{_listed(unready)} to be Ready")
        else:
            took = seconds_between(op.startedAt, now)
            r.operation = replace(op, phase="Completed", finishedAt=now,
                                  message=f"{what} replaced in place in {took:.0f}s")
            r.events.append(Event("Normal", "RankReplaced", f"replacement {op.id}: {what} replaced in place (new "
                                                            f"pod(s), same rank), serving again after {took:.0f}s; "
                                                            "the other ranks served throughout"))
            return r
    else:
        r.operation = replace(op, phase="Preparing", message=frontend.resize.message or op.message)
    if elapsed > timeout:
        r.lost = (f"replacement {op.id} of {what}: not done {elapsed:.0f}s after its new pod(s) could start "
                  f"(readyTimeoutSeconds {spec.scaling.readyTimeoutSeconds} + {FRONTEND_GRACE_SECONDS:.0f}s): "
                  f"{r.operation.message}")
    return r


def backoff_seconds(attempt: int, scale: float = 1.0) -> float:
    """The wait before recovery `attempt` (1-based) of a streak: 0, then 10 s doubling up to 300 s (times the scale)."""
    if attempt <= 1:
        return 0.0
    wait = min(BACKOFF_MAX_SECONDS, BACKOFF_FIRST_SECONDS * 2.0 ** (attempt - 2))
    return wait * scale


def format_time(when: datetime.datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def _later(now: str, seconds: float) -> str:
    start = parse_time(now)
    assert start is not None
    return format_time(start + datetime.timedelta(seconds=seconds))


def _running_since(old: EngineCoreSetStatus) -> str | None:
    """Since when the fleet has been complete (Progressing False), if it is."""
    return next((c.lastTransitionTime for c in old.conditions if c.type == "Progressing" and c.status == "False"),
                None)


def _streak(old: EngineCoreSetStatus, generation: int, now: str) -> RecoveryStatus | None:
    """The recovery streak the fleet is in, or None: a streak ends when the spec changes (a new generation) and
    after STREAK_RESET_SECONDS Running since its last loss."""
    rec = old.recovery
    if rec is None or rec.observedGeneration != generation:
        return None
    if old.phase == "Running" and seconds_between(_running_since(old), now) >= STREAK_RESET_SECONDS \
            and seconds_between(rec.lostAt, now) >= STREAK_RESET_SECONDS:
        return None
    return rec


def exhausted(old: EngineCoreSetStatus) -> bool:
    """The fleet was given up after its recovery budget (phase Failed with a recovery streak)."""
    return old.phase == "Failed" and old.recovery is not None and old.fleetGeneration > 0


def _unready_too_long(pod: PodObs, timeout: float, now: str) -> bool:
    """A bound pod that has not been Ready for `timeout` seconds (since it was scheduled, or became unready)."""
    return (bool(pod.node) and bool(pod.unready_since) and not pod.ready and not pod.terminating
            and pod.phase not in POD_TERMINAL and seconds_between(pod.unready_since, now) > timeout)


def _frontend_losses(fleet: FleetRef, seen: FleetObs | None, current: Mapping[str, PodObs], committed: int,
                     now: str) -> list[tuple[int, str]]:
    """Ranks the frontend reports Dead, or Unresponsive for longer than UNRESPONSIVE_SECONDS, while their pods run.
    A state the operator does not know is read as not serving but not dead."""
    if seen is None or not seen.reachable:
        return []
    clock = parse_time(now)
    assert clock is not None
    out = []
    for rank, r in sorted(seen.ranks.items()):
        pod = current.get(constants.engine_name(fleet.name, rank))
        if rank >= committed or pod is None or pod.terminating or pod.phase != "Running":
            continue  # no pod, or one that ended: its own state decides
        why = f": {r.message}" if r.message else ""
        if r.state == "Dead":
            out.append((rank, f"rank {rank} (pod {pod.name}): the frontend reports it Dead{why}"))
        elif r.state == "Unresponsive" and r.since is not None \
                and (quiet := clock.timestamp() - r.since) > UNRESPONSIVE_SECONDS:
            out.append((rank, f"rank {rank} (pod {pod.name}): the frontend reports it Unresponsive for {quiet:.0f}s "
                              f"(over {UNRESPONSIVE_SECONDS:.0f}s){why}"))
    return out


def _retry_wait(old: EngineCoreSetStatus, to: int, now: str) -> float:
    """Seconds until a resize to `to` may be tried again (0: now)."""
    last = old.operation
    if last is None or last.phase != "Failed" or last.toReplicas != to or last.fromReplicas != old.replicas \
            or last.fleetGeneration != old.fleetGeneration:
        return 0.0
    return max(0.0, RESIZE_RETRY_SECONDS - seconds_between(last.finishedAt, now))


def _same_but_size(pdb: Mapping[str, Any], have: Mapping[str, Any]) -> bool:
    """Whether the observed PodDisruptionBudget differs from the wanted one only in minAvailable."""
    want = {**pdb, "spec": {k: v for k, v in pdb["spec"].items() if k != "minAvailable"}}
    return is_subset(want, have)


def _adopt(fleet: FleetRef, observed: Observed) -> tuple[EngineCoreSetStatus, Event] | None:
    """An empty status while the fleet's pods run (the status was wiped, or lost with a restore of
    etcd): the newest incarnation's pods are adopted, not taken for strangers and deleted. Its size
    is the engine pods it has; Degraded if its members all stand (Running once they are ready),
    else Starting."""
    old = observed.status
    if old.fleetGeneration != 0:
        return None
    pods = [p for p in observed.pods if not p.terminating and p.fleet_generation > 0]
    if not pods:
        return None
    generation = max(p.fleet_generation for p in pods)
    mine = {p.name for p in pods if p.fleet_generation == generation}
    size = sum(1 for p in pods if p.fleet_generation == generation and p.role == constants.ROLE_ENGINE)
    complete = size > 0 and set(desired_pod_names(fleet, size)) <= mine
    status = replace(old, fleetGeneration=generation, replicas=size, phase="Degraded" if complete else "Starting")
    return status, Event("Warning", "StatusLost",
                         f"the status was empty while pods of incarnation {generation} run: adopted them "
                         f"({size} ranks{'' if complete else ', incomplete'}) instead of recreating the fleet")


# ---- the planner ------------------------------------------------------------------------------
def plan(fleet: FleetRef, observed: Observed, now: str, settings: PlanSettings = PlanSettings()) -> Plan:
    spec = fleet.spec
    old = observed.status
    desired = spec.replicas
    want_hash = builders.fleet_config_hash(spec)
    events: list[Event] = []
    adopted = _adopt(fleet, observed)
    if adopted is not None:
        old, event = adopted
        events.append(event)

    generation = old.fleetGeneration
    phase: FleetPhase = old.phase
    recoveries = old.recoveries
    committed = old.replicas
    operation = old.operation
    running = operation if operation is not None and not operation.done else None
    fresh = generation == 0
    if fresh:
        generation, committed = 1, desired
        events.append(Event("Normal", "Creating", f"creating a fleet of {desired} ranks of {spec.model}"))

    if exhausted(old) and not fresh and old.recovery is not None \
            and old.recovery.observedGeneration == observed.generation:
        return _plan_failed(fleet, observed, old.recovery, recoveries, [], now)
    streak = _streak(old, observed.generation, now)
    recovery = streak

    live = [p for p in observed.pods if not p.terminating]
    terminating = [p for p in observed.pods if p.terminating]
    live_by_name = {p.name: p for p in live}
    current = {p.name: p for p in live if p.fleet_generation == generation}
    members = set(desired_pod_names(fleet, committed))

    # 1. A resize in flight: what the frontend says of it.
    #    A replacement of lost dense ranks in place: its own steps (`_continue_replace`).
    resize: _Resize | None = None
    replacing: _Replace | None = None
    if running is not None and running.replace and not fresh:
        replacing = _continue_replace(fleet, observed, running, current, streak, now)
        events += replacing.events
        operation = replacing.operation
    elif running is not None and not fresh:
        resize = _continue_resize(fleet, observed, running, committed, current, now)
        events += resize.events
        operation, committed = resize.operation, resize.committed
    # MoE: the redundant experts belong to the committed size they were reported for (status.redundantExperts).
    redundant_size, redundant_now = old.replicas, old.redundantExperts
    if resize is not None and resize.operation is not None and resize.operation.phase == "Completed" \
            and committed != old.replicas:
        redundant_size, redundant_now = committed, resize.redundant_experts
    moving = resize.joining | resize.leaving if resize is not None else frozenset()
    if replacing is not None:
        moving = frozenset(running.replace) if running is not None else frozenset()

    # 2. Losses and configuration changes in the current incarnation start a new one: a member pod that
    #    ended or vanished, one not Ready within readyTimeoutSeconds, a rank the frontend reports dead, a
    #    resize that left the fleet unusable. Each loss is one recovery of the streak, after its backoff;
    #    past spec.scaling.maxRecoveries the fleet is given up (Failed) until the spec changes.
    restart_failed = exhausted(old) and not fresh
    failed = [p for name, p in current.items()
              if name in members and p.phase in POD_TERMINAL and p.rank not in moving]
    was_complete = old.phase in ("Running", "Degraded", "Scaling") and old.fleetGeneration == generation
    vanished = [name for name in sorted(members) if was_complete and name not in live_by_name
                and not any(name == constants.engine_name(fleet.name, rank) for rank in moving)]
    timeout = float(spec.scaling.readyTimeoutSeconds)
    slow = [p for name, p in current.items() if name in members and p.rank not in moving
            and _unready_too_long(p, timeout, now)]
    dead = (_frontend_losses(fleet, observed.fleet, current, committed, now)
            if old.phase in ("Running", "Degraded") and running is None and not fresh else [])
    changed = [p for p in current.values() if p.spec_hash != want_hash]
    new_incarnation = fresh
    # Each loss, with the rank it is (None: the frontend, the coordinator, a resize or a replacement).
    lost: list[tuple[int | None, str]] = [(_lost_rank(fleet, p), _describe_loss(p)) for p in failed + vanished]
    lost += [(_lost_rank(fleet, p), f"{_what(p)} (pod {p.name}) not ready {timeout:.0f}s after it was scheduled "
                                    "(ReadyTimeout)") for p in slow]
    lost += [(rank, why) for rank, why in dead]
    if resize is not None and resize.lost:
        lost.append((None, resize.lost))
    if replacing is not None and replacing.lost:
        lost.append((None, replacing.lost))
    losses = [why for _, why in lost]
    # A dense fleet that serves loses ranks, not the endpoint: when only engine ranks are lost (some rank
    # left), with its frontend and coordinator Ready and nothing else in flight, the lost ranks are
    # replaced in place (`_continue_replace`); every other loss recreates the whole fleet.
    lost_ranks = sorted({rank for rank, _ in lost if rank is not None})
    in_place = (bool(lost) and all(rank is not None for rank, _ in lost) and not spec.expertParallel
                and not fresh and not restart_failed and not changed and running is None
                and old.phase in ("Running", "Degraded") and old.fleetGeneration == generation
                and all(0 <= rank < committed for rank in lost_ranks) and len(lost_ranks) < committed
                and _ready(current.get(constants.frontend_name(fleet.name)))
                and _ready(current.get(constants.coordinator_name(fleet.name))))
    if restart_failed:
        generation += 1
        new_incarnation = True
        phase = "Restarting"
        committed = desired
        recovery = None
        events.append(Event("Normal", "Restarting", f"spec changed after the fleet was given up: recreating all ranks "
                                                    f"at {desired} (incarnation {generation})"))
    elif losses:
        attempt = (streak.attempt if streak is not None else 0) + 1
        reason = "; ".join(losses)
        budget = spec.scaling.maxRecoveries
        if running is not None:
            kind = "replacement" if running.replace else "resize"
            operation = replace(running, phase="Failed", finishedAt=now,
                                message=f"the fleet was lost during the {kind}: {reason}")
            events.append(Event("Warning", "ResizeFailed", f"{kind} {running.id}: {operation.message}"))
        if attempt > budget:
            given_up = RecoveryStatus(attempt=attempt - 1, lostAt=now, reason=reason, retryAt=None,
                                      observedGeneration=observed.generation)
            events.append(Event("Warning", "RankLost", f"{reason}: recovery budget spent ({attempt - 1} of {budget} "
                                                       "in a row): giving the fleet up"))
            events.append(Event("Warning", "RecoveriesExhausted", exhausted_message(given_up, budget)))
            return _plan_failed(fleet, replace(observed, status=replace(old, operation=operation)), given_up,
                                recoveries, events, now)
        wait = backoff_seconds(attempt, settings.backoff_scale)
        recovery = RecoveryStatus(attempt=attempt, lostAt=now, reason=reason, retryAt=_later(now, wait),
                                  observedGeneration=observed.generation)
        recoveries += 1
        when = f"after a backoff of {wait:.0f}s (at {recovery.retryAt})" if wait else "now"
    if losses and not restart_failed and in_place and recovery is not None:
        what = _listed(lost_ranks)
        operation = OperationStatus(id=replace_id(lost_ranks, generation, now), fromReplicas=committed,
                                    toReplicas=committed, phase="Pending", startedAt=now,
                                    message=f"replacing {what} in place", fleetGeneration=generation,
                                    replace=tuple(lost_ranks))
        events.append(Event("Warning", "RankLost", f"{reason}: replacing {what} in place (new pod(s), the other "
                                                   f"ranks serve on), recovery {attempt} of {budget} {when}"))
        replacing = _continue_replace(fleet, observed, operation, current, recovery, now)
        events += replacing.events
        operation = replacing.operation
        moving = frozenset(lost_ranks)
    elif losses and not restart_failed:
        generation += 1
        new_incarnation = True
        phase = "Recovering"
        committed = old.replicas if committed == 0 else committed
        events.append(Event("Warning", "RankLost", f"{reason}: recreating the fleet at {committed} ranks "
                                                   f"(incarnation {generation}), recovery {attempt} of {budget} "
                                                   f"{when}"))
        resize = None
    elif changed and not losses and not restart_failed:
        generation += 1
        new_incarnation = True
        phase = "Restarting"
        events.append(Event("Normal", "Restarting", f"spec changed (configuration): recreating all ranks at "
                                                    f"{desired} (incarnation {generation})"))
        if running is not None:
            operation = replace(running, phase="Failed", finishedAt=now,
                                message="superseded by a configuration change (the fleet is recreated)")
            events.append(Event("Warning", "ResizeFailed", f"resize {running.id}: {operation.message}"))
        committed = desired
        resize = None

    # 3. A new size: resize in place, or (for fleets that do not serve yet) recreate.
    requeue: float | None = None
    in_flight = resize is not None and resize.operation is not None and not resize.operation.done
    replacing_now = replacing is not None and not replacing.operation.done and not new_incarnation
    if not new_incarnation and not in_flight and not replacing_now and desired != committed:
        never_served = old.phase in ("Starting", "Restarting", "Pending")
        if desired == 0:
            events.append(Event("Normal", "Stopping", f"replicas is 0: deleting the fleet's {committed} ranks"))
            committed = 0
        elif committed == 0:
            generation += 1
            new_incarnation = True
            phase = "Starting"
            committed = desired
            events.append(Event("Normal", "Creating", f"creating a fleet of {desired} ranks of {spec.model}"))
        elif never_served:
            generation += 1
            new_incarnation = True
            phase = "Restarting"
            events.append(Event("Normal", "Restarting", f"replicas {committed} -> {desired}: the fleet was not "
                                                        f"serving yet: recreating all ranks "
                                                        f"(incarnation {generation})"))
            committed = desired
        elif old.phase == "Running" and (wait := _retry_wait(old, desired, now)) == 0:
            resize = _start_resize(fleet, committed, generation, now)
            events += resize.events
            operation = resize.operation
        elif old.phase == "Running":
            requeue = wait
    in_flight = resize is not None and resize.operation is not None and not resize.operation.done
    if in_flight:
        requeue = RESIZE_POLL_SECONDS
    if replacing_now and replacing is not None:  # the frontend is followed, or the backoff's end awaited
        requeue = replacing.wait if replacing.wait else RESIZE_POLL_SECONDS
    # A recovery's backoff: the new incarnation's pods wait until recovery.retryAt (looked at again then).
    backoff_left = 0.0
    if phase == "Recovering" and recovery is not None and recovery.retryAt and committed > 0:
        backoff_left = max(0.0, seconds_between(now, recovery.retryAt))
        if backoff_left > 0:
            requeue = _sooner(requeue, backoff_left)

    # 4. The pods the fleet keeps, creates and deletes.
    keep_ranks = set(range(committed))
    joining = leaving = frozenset[int]()
    if resize is not None and not new_incarnation:
        joining = resize.joining if in_flight else frozenset()
        leaving = resize.leaving - resize.retired if in_flight else frozenset()
        keep_ranks |= joining | leaving
    engine_names = {constants.engine_name(fleet.name, r) for r in keep_ranks}
    wanted = set(desired_pod_names(fleet, committed)) | engine_names if committed else set()
    stale = [p for p in live if p.fleet_generation != generation or p.spec_hash != want_hash or p.name not in wanted]
    actions: list[Action] = [a for a in (resize.actions if resize is not None and not new_incarnation else [])
                             if isinstance(a, StartResize | CancelResize)]
    actions += [Delete("v1", "Pod", p.name, p.uid) for p in stale]
    held: set[str] = set()  # pods not created this pass: a replaced rank's, until its old pod is gone
    if replacing_now and replacing is not None:
        actions += replacing.actions
        if not replacing.create:
            held = {constants.engine_name(fleet.name, rank) for rank in replacing.operation.replace}
    redundant = resize.redundant_experts if resize is not None else None
    if spec.expertParallel and redundant is None and joining:  # an MoE scale-up's pods need R' from the frontend
        held |= {constants.engine_name(fleet.name, rank) for rank in joining}
        requeue = _sooner(requeue, REDUNDANT_EXPERTS_POLL_SECONDS)  # it answers at once: the pods start sooner
    if in_flight and resize is not None and resize.operation is not None:  # retired before the resize ends
        events += [Event("Normal", "RankRetired", f"rank {p.rank} retired by resize {resize.operation.id}: "
                                                  f"deleting pod {p.name}")
                   for p in stale if p.rank in resize.retired and p.fleet_generation == generation]

    created_pods: list[str] = []
    fleet_redundant = redundant_now if committed == redundant_size and spec.expertParallel else None
    if committed > 0:
        children = builders.fleet_children(fleet, dp_size=committed, admin_token=observed.admin_token,
                                           fleet_generation=generation, num_redundant_experts=fleet_redundant)
        ns = fleet.namespace
        frontend_address = constants.pod_dns(fleet.name, constants.frontend_name(fleet.name), ns)
        to = operation.toReplicas if operation is not None else committed
        children += [builders.engine_pod(fleet, rank, dp_size=to, frontend_address=frontend_address,
                                         scale_up=spec.expertParallel, fleet_generation=generation,
                                         num_redundant_experts=redundant if spec.expertParallel else None)
                     for rank in sorted(joining)]
    else:  # a stopped fleet keeps its endpoint, Secret and policy, and has no pods
        children = builders.fleet_objects(fleet, admin_token=observed.admin_token)
    for obj in children:
        kind, name = obj["kind"], obj["metadata"]["name"]
        if kind == "Pod":
            # New pods only once no older pod is left (pod names are fixed per rank).
            if name in wanted and not stale and not terminating and name not in live_by_name and not backoff_left \
                    and name not in held:
                actions.append(Apply(obj))
                created_pods.append(name)
        else:
            have = observed.objects.get((kind, name))
            if have is None or not is_subset(obj, have):
                actions.append(Apply(obj))
                # The budget follows the committed size: rewriting it after a resize is no repair.
                follows_size = have is not None and kind == "PodDisruptionBudget" and _same_but_size(obj, have)
                if not fresh and not follows_size:
                    state = "missing" if have is None else "changed"
                    events.append(Event("Normal", "Repaired", f"{kind} {name} was {state}: applied the spec"))
    desired_kinds = {(o["kind"], o["metadata"]["name"]) for o in children}
    for (kind, name), body in observed.objects.items():
        if (kind, name) not in desired_kinds and kind in OPTIONAL_KINDS:
            meta = body.get("metadata", {})
            actions.append(Delete(OPTIONAL_KINDS[kind], kind, name, str(meta.get("uid", ""))))

    if created_pods and phase == "Recovering" and recovery is not None and recovery.retryAt != recovery.lostAt \
            and not any(p.fleet_generation == generation for p in observed.pods):
        events.append(Event("Normal", "Recovering", f"backoff until {recovery.retryAt} over: creating incarnation "
                                                    f"{generation} (recovery {recovery.attempt} of "
                                                    f"{spec.scaling.maxRecoveries})"))

    # 5. The fleet's phase, from what now stands.
    pods_now = tuple(p for p in live if p not in stale)
    remaining = {p.name: p for p in pods_now}
    member_names = desired_pod_names(fleet, committed)
    all_ready = bool(member_names) and all(
        name in remaining and remaining[name].ready and remaining[name].phase == "Running" for name in member_names)
    if committed == 0 and not remaining and not terminating:
        new_phase: FleetPhase = "Stopped"
    elif replacing_now:
        new_phase = "Degraded"  # the other ranks serve on while the lost ones are replaced
    elif in_flight:
        new_phase = "Scaling"
    elif phase in ("Recovering", "Restarting", "Starting") and new_incarnation:
        new_phase = phase
    elif all_ready:
        new_phase = "Running"
    elif phase in ("Recovering", "Restarting"):
        new_phase = phase
    elif old.phase in ("Running", "Degraded", "Scaling") and not created_pods and old.fleetGeneration == generation:
        new_phase = "Degraded"  # all pods there, some not ready
    else:
        new_phase = "Starting"
    if new_phase == "Running" and old.phase not in ("Running", "Scaling"):
        events.append(Event("Normal", "FleetReady", f"all {committed} ranks serving {spec.model}"))
    if new_phase == "Stopped" and old.phase != "Stopped":
        events.append(Event("Normal", "Stopped", "replicas is 0: the fleet has no pods"))
    if in_flight and operation is not None and desired != operation.toReplicas \
            and observed.generation != old.observedGeneration:
        events.append(Event("Normal", "ResizeQueued", f"replicas is now {desired}: queued until resize {operation.id} "
                                                      f"({operation.fromReplicas} -> {operation.toReplicas}) ends"))

    # 6. Per-rank status: pods, and the frontend's view of the ranks a resize moves.
    states = resize.rank_states if resize is not None and not new_incarnation else {}
    by_name = {p.name: p for p in pods_now if p.fleet_generation == generation}
    ranks = []
    for rank in sorted(keep_ranks | (set(resize.retired) if resize is not None and in_flight else set())):
        name = constants.engine_name(fleet.name, rank)
        pod = by_name.get(name)
        rank_state: RankPhase = rank_phase(pod)
        message = pod.message if pod is not None else ""
        if rank in states and rank_state != "Failed":
            frontend_state, frontend_message = states[rank]
            if not (frontend_state == "Joining" and rank_state == "Pending"):
                rank_state, message = frontend_state, frontend_message
        if replacing_now and replacing is not None and rank in replacing.operation.replace:
            op_now = replacing.operation
            rank_state = "Pending" if op_now.phase == "Pending" or pod is None else rank_phase(pod)
            rank_state = "Joining" if rank_state == "Serving" and op_now.phase != "Completed" else rank_state
            message = f"being replaced in place ({op_now.id}): {op_now.message}"
        ranks.append(RankStatus(rank=rank, pod=name, phase=rank_state, message=message))

    decision = Decision(
        phase=new_phase, fleet_generation=generation, recoveries=recoveries, replicas=committed,
        ranks=tuple(ranks), operation=operation, new_incarnation=new_incarnation and not fresh,
        desired=desired, retry_in=requeue if not in_flight and not backoff_left else None, recovery=recovery,
        max_recoveries=spec.scaling.maxRecoveries, redundant_experts=fleet_redundant,
    )
    status = compute_status(fleet, observed.generation, old, pods_now, decision, now)
    deadline_event = _ready_timeout_event(old, status)
    if deadline_event is not None:
        events.append(deadline_event)
    if status.phase in ("Starting", "Restarting", "Recovering") and requeue is None:
        requeue = float(spec.scaling.readyTimeoutSeconds)  # the readiness deadline is checked on time
    for p in pods_now:  # each pod's own readiness deadline (a loss when it passes) is checked on time
        if p.fleet_generation == generation and p.unready_since and not p.ready and p.phase not in POD_TERMINAL:
            requeue = _sooner(requeue, max(1.0, timeout - seconds_between(p.unready_since, now) + 1))
    if status.phase in ("Running", "Degraded") and not in_flight:
        requeue = _sooner(requeue, FRONTEND_POLL_SECONDS)  # the frontend's view of the ranks is read this often
    return Plan(status=status, actions=tuple(actions), events=tuple(events), requeue_after=requeue)


def _sooner(a: float | None, b: float) -> float:
    return b if a is None else min(a, b)


def _plan_failed(fleet: FleetRef, observed: Observed, recovery: RecoveryStatus, recoveries: int,
                 events: list[Event], now: str) -> Plan:
    """A fleet given up after its recovery budget: its running pods are deleted, the pods that ended are kept
    (their logs tell why), and nothing is created until the spec changes."""
    old = observed.status
    committed = old.replicas or fleet.spec.replicas
    live = [p for p in observed.pods if not p.terminating]
    actions: list[Action] = [Delete("v1", "Pod", p.name, p.uid) for p in live if p.phase not in POD_TERMINAL]
    kept = tuple(p for p in live if p.phase in POD_TERMINAL)
    by_name = {p.name: p for p in kept}
    ranks = []
    for rank in range(committed):
        name = constants.engine_name(fleet.name, rank)
        pod = by_name.get(name)
        message = pod.message if pod is not None and pod.message else "stopped: the fleet was given up"
        ranks.append(RankStatus(rank=rank, pod=name, phase="Failed", message=message))
    operation = old.operation
    if operation is not None and not operation.done:
        operation = replace(operation, phase="Failed", finishedAt=now, message="the fleet was given up")
    decision = Decision(phase="Failed", fleet_generation=old.fleetGeneration, recoveries=recoveries,
                        replicas=committed, ranks=tuple(ranks), operation=operation, desired=fleet.spec.replicas,
                        recovery=recovery, max_recoveries=fleet.spec.scaling.maxRecoveries,
                        redundant_experts=old.redundantExperts)
    status = compute_status(fleet, observed.generation, old, kept, decision, now)
    return Plan(status=status, actions=tuple(actions), events=tuple(events))


def _ready_timeout_event(old: EngineCoreSetStatus, new: EngineCoreSetStatus) -> Event | None:
    """A Warning once, when the readiness deadline passes (the Degraded condition says it from then on)."""
    def reason(status: EngineCoreSetStatus) -> str:
        return next((c.reason for c in status.conditions if c.type == "Degraded" and c.status == "True"), "")

    if reason(new) == "ReadyTimeout" and reason(old) != "ReadyTimeout":
        message = next(c.message for c in new.conditions if c.type == "Degraded")
        return Event("Warning", "ReadyTimeout", message)
    return None


def plan_invalid(error: SpecError, observed: Observed, now: str) -> Plan:
    """A spec corefleet cannot run: nothing is touched, the status says why (once)."""
    status = invalid_spec_status(observed.generation, observed.status, error, now)
    already = any(c.type == "Degraded" and c.reason == "InvalidSpec" and c.message == str(error)
                  for c in observed.status.conditions)
    events = () if already else (Event("Warning", "InvalidSpec", str(error)),)
    return Plan(status=status, events=events)
