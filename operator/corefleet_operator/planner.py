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
  that failed, or one that vanished from a fleet that was complete, is a lost rank: the fleet is
  recreated at the committed size (Recovering, recoveries + 1); a resize in flight fails with it.
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
  - a fleet that never served (Starting, or Restarting) is recreated at the new size instead, a
    stopped fleet (0) starts at the new size, and 0 stops a fleet (once no resize runs). MoE fleets
    (`expertParallel`) are recreated at the new size: their in-place resize (vLLM's elastic-EP
    protocol) is not built yet.
* Services, the admin Secret and the NetworkPolicy are applied whenever they are missing or differ
  from what the builders produce, so drift is repaired; nothing is written when nothing changed.

Pure module: no kopf, no Kubernetes client, no I/O.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from corefleet_operator import builders, constants
from corefleet_operator.models import (
    EngineCoreSetStatus,
    FleetPhase,
    FleetRef,
    OperationPhase,
    OperationStatus,
    RankPhase,
    RankStatus,
    SpecError,
)
from corefleet_operator.observe import Observed, PodObs, ResizeObs
from corefleet_operator.status import POD_TERMINAL, Decision, compute_status, invalid_spec_status, rank_phase

# Children the spec may switch off: deleted when observed but no longer desired (kind -> apiVersion).
OPTIONAL_KINDS = {"NetworkPolicy": "networking.k8s.io/v1"}

RESIZE_POLL_SECONDS = 1.0  # while a resize runs: its progress on the frontend is no Kubernetes event
RESIZE_RETRY_SECONDS = 300.0  # a resize that failed is retried after this long (sooner if replicas changes)
FRONTEND_GRACE_SECONDS = 120.0  # a resize unanswered this long past its own timeouts is lost
OPERATION_PHASES: tuple[OperationPhase, ...] = ("Pending", "Preparing", "Draining", "Committing")


@dataclass(frozen=True)
class Apply:
    """Server-side apply of a whole object (create or converge)."""

    obj: Mapping[str, Any]

    @property
    def key(self) -> tuple[str, str]:
        return str(self.obj["kind"]), str(self.obj["metadata"]["name"])


@dataclass(frozen=True)
class Delete:
    """Delete exactly this object: by name, with its UID as a precondition."""

    api_version: str
    kind: str
    name: str
    uid: str


@dataclass(frozen=True)
class StartResize:
    """Ask the frontend's admin API to start (or, same id and target, confirm) a resize."""

    resize_id: str
    replicas: int
    drain_timeout_s: float
    join_timeout_s: float


@dataclass(frozen=True)
class CancelResize:
    """Ask the frontend to give a resize up (a new rank's pod failed: it will never join)."""

    resize_id: str
    reason: str


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


Action = Apply | Delete | StartResize | CancelResize


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


def _describe_loss(pod: PodObs | str) -> str:
    if isinstance(pod, str):
        return f"pod {pod} disappeared"
    what = f"rank {pod.rank}" if pod.role == constants.ROLE_ENGINE else pod.role
    why = f": {pod.message}" if pod.message else ""
    return f"{what} (pod {pod.name}) {pod.phase.lower()}{why}"


def _ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}..{ranks[-1]}"


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


def _retry_wait(old: EngineCoreSetStatus, to: int, now: str) -> float:
    """Seconds until a resize to `to` may be tried again (0: now)."""
    last = old.operation
    if last is None or last.phase != "Failed" or last.toReplicas != to or last.fromReplicas != old.replicas \
            or last.fleetGeneration != old.fleetGeneration:
        return 0.0
    return max(0.0, RESIZE_RETRY_SECONDS - seconds_between(last.finishedAt, now))


# ---- the planner ------------------------------------------------------------------------------
def plan(fleet: FleetRef, observed: Observed, now: str) -> Plan:
    spec = fleet.spec
    old = observed.status
    desired = spec.replicas
    want_hash = builders.fleet_config_hash(spec)
    events: list[Event] = []

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

    live = [p for p in observed.pods if not p.terminating]
    terminating = [p for p in observed.pods if p.terminating]
    live_by_name = {p.name: p for p in live}
    current = {p.name: p for p in live if p.fleet_generation == generation}
    members = set(desired_pod_names(fleet, committed))

    # 1. A resize in flight: what the frontend says of it.
    resize: _Resize | None = None
    if running is not None and not fresh:
        resize = _continue_resize(fleet, observed, running, committed, current, now)
        events += resize.events
        operation, committed = resize.operation, resize.committed
    moving = resize.joining | resize.leaving if resize is not None else frozenset()

    # 2. Losses and configuration changes in the current incarnation start a new one.
    failed = [p for name, p in current.items()
              if name in members and p.phase in POD_TERMINAL and p.rank not in moving]
    was_complete = old.phase in ("Running", "Degraded", "Scaling") and old.fleetGeneration == generation
    vanished = [name for name in sorted(members) if was_complete and name not in live_by_name
                and not any(name == constants.engine_name(fleet.name, rank) for rank in moving)]
    changed = [p for p in current.values() if p.spec_hash != want_hash]
    new_incarnation = fresh
    if failed or vanished or (resize is not None and resize.lost):
        losses = [_describe_loss(p) for p in failed] + [_describe_loss(v) for v in vanished]
        if resize is not None and resize.lost:
            losses.append(resize.lost)
        if old.phase != "Recovering":
            recoveries += 1
        generation += 1
        new_incarnation = True
        phase = "Recovering"
        committed = old.replicas if committed == 0 else committed
        events.append(Event("Warning", "RankLost", f"{'; '.join(losses)}: recreating the fleet at {committed} ranks "
                                                   f"(incarnation {generation})"))
        if running is not None:
            operation = replace(running, phase="Failed", finishedAt=now,
                                message=f"the fleet was lost during the resize: {'; '.join(losses)}")
            events.append(Event("Warning", "ResizeFailed", f"resize {running.id}: {operation.message}"))
        resize = None
    elif changed:
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
    if not new_incarnation and not in_flight and desired != committed:
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
        elif never_served or spec.expertParallel:
            generation += 1
            new_incarnation = True
            phase = "Restarting"
            why = ("MoE fleets are resized by recreating them (in-place elastic EP is not built yet)"
                   if spec.expertParallel else "the fleet was not serving yet")
            events.append(Event("Normal", "Restarting", f"replicas {committed} -> {desired}: {why}: recreating all "
                                                        f"ranks (incarnation {generation})"))
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
    if in_flight and resize is not None and resize.operation is not None:  # retired before the resize ends
        events += [Event("Normal", "RankRetired", f"rank {p.rank} retired by resize {resize.operation.id}: "
                                                  f"deleting pod {p.name}")
                   for p in stale if p.rank in resize.retired and p.fleet_generation == generation]

    created_pods: list[str] = []
    if committed > 0:
        children = builders.fleet_children(fleet, dp_size=committed, admin_token=observed.admin_token,
                                           fleet_generation=generation)
        ns = fleet.namespace
        frontend_address = constants.pod_dns(fleet.name, constants.frontend_name(fleet.name), ns)
        to = operation.toReplicas if operation is not None else committed
        children += [builders.engine_pod(fleet, rank, dp_size=to, frontend_address=frontend_address,
                                         scale_up=spec.expertParallel, fleet_generation=generation)
                     for rank in sorted(joining)]
    else:  # a stopped fleet keeps its endpoint, Secret and policy, and has no pods
        children = builders.fleet_objects(fleet, admin_token=observed.admin_token)
    for obj in children:
        kind, name = obj["kind"], obj["metadata"]["name"]
        if kind == "Pod":
            # New pods only once no older pod is left (pod names are fixed per rank).
            if name in wanted and not stale and not terminating and name not in live_by_name:
                actions.append(Apply(obj))
                created_pods.append(name)
        else:
            have = observed.objects.get((kind, name))
            if have is None or not is_subset(obj, have):
                actions.append(Apply(obj))
                if not fresh:
                    state = "missing" if have is None else "changed"
                    events.append(Event("Normal", "Repaired", f"{kind} {name} was {state}: applied the spec"))
    desired_kinds = {(o["kind"], o["metadata"]["name"]) for o in children}
    for (kind, name), body in observed.objects.items():
        if (kind, name) not in desired_kinds and kind in OPTIONAL_KINDS:
            meta = body.get("metadata", {})
            actions.append(Delete(OPTIONAL_KINDS[kind], kind, name, str(meta.get("uid", ""))))

    # 5. The fleet's phase, from what now stands.
    pods_now = tuple(p for p in live if p not in stale)
    remaining = {p.name: p for p in pods_now}
    member_names = desired_pod_names(fleet, committed)
    all_ready = bool(member_names) and all(
        name in remaining and remaining[name].ready and remaining[name].phase == "Running" for name in member_names)
    if committed == 0 and not remaining and not terminating:
        new_phase: FleetPhase = "Stopped"
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
        ranks.append(RankStatus(rank=rank, pod=name, phase=rank_state, message=message))

    decision = Decision(
        phase=new_phase, fleet_generation=generation, recoveries=recoveries, replicas=committed,
        ranks=tuple(ranks), operation=operation, new_incarnation=new_incarnation and not fresh,
        desired=desired, retry_in=requeue if not in_flight else None,
    )
    status = compute_status(fleet, observed.generation, old, pods_now, decision, now)
    deadline_event = _ready_timeout_event(old, status)
    if deadline_event is not None:
        events.append(deadline_event)
    if status.phase in ("Starting", "Restarting", "Recovering") and requeue is None:
        requeue = float(spec.scaling.readyTimeoutSeconds)  # the readiness deadline is checked on time
    return Plan(status=status, actions=tuple(actions), events=tuple(events), requeue_after=requeue)


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
