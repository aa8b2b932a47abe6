# SPDX-License-Identifier: Apache-2.0
"""The pure planner: from the spec and what is observed, the next step for one fleet.

`plan(fleet, observed, now)` works out where the fleet is from what it sees (its pods, its other
children, and the status it last wrote), and returns the actions that move it one step closer to
the spec, the status to write, and the events to emit. It keeps no state between calls: the
status it returns is the only memory, and it is derived again from observation on every call.

The rules for a fleet of fixed size (the elastic resize replaces the restart for `replicas`):

* A fleet has an incarnation, `status.fleetGeneration`, and every pod carries the incarnation and
  the hash of the fleet-wide configuration it was built from. vLLM ranks must run identical
  configuration and an engine that restarts cannot rejoin, so pods are never updated in place.
* A pod of the current incarnation that failed, or one that vanished from a fleet that was
  Running, is a lost rank: the fleet is recreated at the same size (Recovering, recoveries + 1).
* A pod whose configuration hash differs from the spec's means the spec changed (image, model,
  engine args, replicas, ...): the fleet is recreated at the new spec (Restarting).
* Recreation is one incarnation up: every pod of an older incarnation is deleted (by name and
  UID), and the new incarnation's pods are created only once the old ones are gone.
* Services, the admin Secret and the NetworkPolicy are applied whenever they are missing or differ
  from what the builders produce, so drift is repaired; nothing is written when nothing changed.

Pure module: no kopf, no Kubernetes client, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from corefleet_operator import builders, constants
from corefleet_operator.models import EngineCoreSetStatus, FleetPhase, FleetRef, SpecError
from corefleet_operator.observe import Observed, PodObs
from corefleet_operator.status import POD_TERMINAL, Decision, compute_status, invalid_spec_status

# Children the spec may switch off: deleted when observed but no longer desired (kind -> apiVersion).
OPTIONAL_KINDS = {"NetworkPolicy": "networking.k8s.io/v1"}


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
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


Action = Apply | Delete


@dataclass(frozen=True)
class Plan:
    status: EngineCoreSetStatus
    actions: tuple[Action, ...] = ()
    events: tuple[Event, ...] = ()


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


# ---- the planner ------------------------------------------------------------------------------
def plan(fleet: FleetRef, observed: Observed, now: str) -> Plan:
    spec = fleet.spec
    old = observed.status
    n = spec.replicas
    want_hash = builders.fleet_config_hash(spec, n)
    events: list[Event] = []

    generation = old.fleetGeneration
    phase: FleetPhase = old.phase
    recoveries = old.recoveries
    fresh = generation == 0
    if fresh:
        generation = 1
        events.append(Event("Normal", "Creating", f"creating a fleet of {n} ranks of {spec.model}"))

    live = [p for p in observed.pods if not p.terminating]
    terminating = [p for p in observed.pods if p.terminating]
    live_by_name = {p.name: p for p in live}
    wanted = desired_pod_names(fleet, n)

    # 1. Losses and configuration changes in the current incarnation start a new one.
    current = [p for p in live if p.fleet_generation == generation]
    failed = [p for p in current if p.phase in POD_TERMINAL]
    was_complete = old.phase in ("Running", "Degraded") and old.fleetGeneration == generation
    # Pods the fleet had when it last was complete (its committed size), now gone.
    had = desired_pod_names(fleet, old.replicas) if was_complete else []
    vanished = [name for name in had if name not in live_by_name]
    changed = [p for p in current if p.spec_hash != want_hash or p.name not in wanted]
    if failed or vanished:
        losses = [_describe_loss(p) for p in failed] + [_describe_loss(v) for v in vanished]
        if old.phase != "Recovering":
            recoveries += 1
        generation += 1
        phase = "Recovering"
        events.append(Event("Warning", "RankLost",
                            f"{'; '.join(losses)}: recreating the fleet at {n} ranks (incarnation {generation})"))
    elif changed:
        generation += 1
        phase = "Restarting"
        detail = f"replicas {old.replicas} -> {n}" if old.replicas != n and old.replicas else "configuration"
        events.append(Event("Normal", "Restarting",
                            f"spec changed ({detail}): recreating all ranks (incarnation {generation})"))

    # 2. Pods of older incarnations or another configuration go, by name and UID.
    actions: list[Action] = []
    stale = [p for p in live
             if p.fleet_generation != generation or p.spec_hash != want_hash or p.name not in wanted]
    actions += [Delete("v1", "Pod", p.name, p.uid) for p in stale]

    # 3. Everything else the spec asks for: applied when missing or drifted.
    if n > 0:
        children = builders.fleet_children(fleet, dp_size=n, admin_token=observed.admin_token,
                                           fleet_generation=generation)
    else:  # a stopped fleet keeps its endpoint, Secret and policy, and has no pods
        children = builders.fleet_objects(fleet, admin_token=observed.admin_token)
    created_pods = []
    for obj in children:
        kind, name = obj["kind"], obj["metadata"]["name"]
        if kind == "Pod":
            # New pods only once no older pod is left (pod names are fixed per rank).
            if not stale and not terminating and name not in live_by_name:
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

    # 4. The fleet's phase, from what now stands.
    pods_now = tuple(p for p in live if p not in stale)
    remaining = {p.name: p for p in pods_now}
    all_ready = bool(wanted) and all(
        name in remaining and remaining[name].ready and remaining[name].phase == "Running" for name in wanted)
    if n == 0 and not remaining and not terminating:
        new_phase: FleetPhase = "Stopped"
    elif all_ready:
        new_phase = "Running"
    elif phase in ("Recovering", "Restarting"):
        new_phase = phase
    elif old.phase in ("Running", "Degraded") and not created_pods:
        new_phase = "Degraded"  # all pods there, some not ready
    else:
        new_phase = "Starting"
    if new_phase == "Running" and old.phase != "Running":
        events.append(Event("Normal", "FleetReady", f"all {n} ranks serving {spec.model}"))
    if new_phase == "Stopped" and old.phase != "Stopped":
        events.append(Event("Normal", "Stopped", "replicas is 0: the fleet has no pods"))

    decision = Decision(
        phase=new_phase,
        fleet_generation=generation,
        recoveries=recoveries,
        replicas=n if new_phase in ("Running", "Degraded", "Stopped") else old.replicas,
    )
    status = compute_status(fleet, observed.generation, old, pods_now, decision, now)
    return Plan(status=status, actions=tuple(actions), events=tuple(events))


def plan_invalid(error: SpecError, observed: Observed, now: str) -> Plan:
    """A spec corefleet cannot run: nothing is touched, the status says why (once)."""
    status = invalid_spec_status(observed.generation, observed.status, error, now)
    already = any(c.type == "Degraded" and c.reason == "InvalidSpec" and c.message == str(error)
                  for c in observed.status.conditions)
    events = () if already else (Event("Warning", "InvalidSpec", str(error)),)
    return Plan(status=status, events=events)
