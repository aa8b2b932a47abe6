# SPDX-License-Identifier: Apache-2.0
"""The planner's fourth phase: the fleet's children to apply and delete, from the step decided.

* Pods: every live pod of another incarnation, another configuration, or no longer wanted (not a
  member, a joining rank, or a leaving rank not yet retired) is deleted by name and UID. New pods are
  created only once no older pod is left (pod names are fixed per rank), none is terminating, and a
  recovery's backoff is over; a replaced rank's, frontend's or coordinator's new pod waits until its
  old pod is gone (`ReplaceStep.create`), and an MoE scale-up's new pods wait for R' from the frontend.
  A frontend created by a replacement of the frontend in place attaches to the running engines
  (`Step.attaching`: `--attach`); any other (a fresh or recreated incarnation's) does not.
* Services, the admin Secret, the PodDisruptionBudget and the NetworkPolicy are applied whenever they
  are missing or differ from what the builders produce, so drift is repaired (event Repaired; the
  budget following the committed size is no repair); nothing is written when nothing changed. Children
  the spec switched off (`OPTIONAL_KINDS`) are deleted. A stopped fleet keeps its endpoint, Secret and
  policy, and has no pods.
* The operation's own requests to the frontend (`StartResize`, `CancelResize`; going idle's, a failed
  wake's cancel) and a replacement's deletes of the old pods come first. An idle fleet keeps no engine
  pod (`Step.resting`): they are deleted once the frontend has released them.

Pure module: no kopf, no Kubernetes client, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from corefleet_operator import builders, constants
from corefleet_operator.actions import Action, Apply, CancelResize, Delete, Event, StartResize
from corefleet_operator.models import JSON, FleetRef
from corefleet_operator.observe import Observed, PodObs
from corefleet_operator.planner.basis import Basis
from corefleet_operator.planner.common import delete_pod, desired_pod_names
from corefleet_operator.planner.follow import Flight
from corefleet_operator.planner.members import after_replacement, after_resize, member_name
from corefleet_operator.planner.step import Step

# Children the spec may switch off: deleted when observed but no longer desired (kind -> apiVersion).
OPTIONAL_KINDS = {"NetworkPolicy": "networking.k8s.io/v1"}


@dataclass(frozen=True)
class Children:
    """What this pass does to the fleet's children, and what stands after it."""

    actions: tuple[Action, ...]  # the plan's actions, in order
    events: tuple[Event, ...]  # RankRetired, Repaired, Recovering
    created: tuple[str, ...]  # the pods created
    standing: tuple[PodObs, ...]  # the live pods that stay (not deleted this pass)
    redundant_experts: int | None  # MoE: R at the committed size (`status.redundantExperts`)
    awaiting_experts: bool  # an MoE scale-up's new pods wait for R' from the frontend


def is_subset(want: Any, have: Any) -> bool:
    """True if every field in `want` is in `have` with the same value (server defaults may add more)."""
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(k in have and is_subset(v, have[k]) for k, v in want.items())
    if isinstance(want, list):
        return (isinstance(have, list) and len(want) == len(have)
                and all(is_subset(a, b) for a, b in zip(want, have, strict=True)))
    return bool(want == have)


def child_actions(fleet: FleetRef, observed: Observed, basis: Basis, flight: Flight, step: Step,
                  backoff: float) -> Children:
    """The children to apply and delete (`backoff`: seconds a recovery's new pods still wait)."""
    spec = fleet.spec
    wanted = wanted_pods(fleet, step)
    stale = tuple(p for p in basis.live if p.fleet_generation != step.generation
                  or p.spec_hash != basis.config_hash or p.name not in wanted)
    redundant = step.resize.redundant_experts if step.resize is not None else None
    awaiting = spec.expertParallel and redundant is None and bool(step.joining)
    fleet_redundant = flight.redundant_experts if step.committed == flight.redundant_size and spec.expertParallel \
        else None
    # New pods only once no older pod is left (pod names are fixed per rank) and the backoff is over.
    creatable: frozenset[str] = frozenset() if stale or basis.terminating or backoff else \
        wanted.difference(basis.live_by_name, held_pods(fleet, step, awaiting))
    objects = desired_objects(fleet, observed, step, redundant, fleet_redundant)
    applies, created, repaired = _apply(observed, objects, creatable, basis.fresh)
    actions = (*operation_actions(step), *step.idle_actions, *(delete_pod(p) for p in stale),
               *(step.replacing.actions if step.replacing_now and step.replacing is not None else ()),
               *applies, *_switched_off(observed, objects))
    events = (*_retired_events(step, stale), *repaired, *_recovering_event(fleet, observed, step, created))
    return Children(actions=actions, events=events, created=created,
                    standing=tuple(p for p in basis.live if p not in stale), redundant_experts=fleet_redundant,
                    awaiting_experts=awaiting)


def wanted_pods(fleet: FleetRef, step: Step) -> frozenset[str]:
    """The pods the fleet keeps: its members at the committed size and the engines of the ranks it keeps."""
    if not step.committed:
        return frozenset()
    return frozenset(desired_pod_names(fleet, step.committed, idle=step.resting)) \
        | {constants.engine_name(fleet.name, r) for r in step.keep_ranks}


def held_pods(fleet: FleetRef, step: Step, awaiting_experts: bool) -> frozenset[str]:
    """Wanted pods not created this pass: a replaced rank's, until its old pod is gone (and the backoff over), a
    replaced frontend's or coordinator's, until the old pod is gone, and an MoE scale-up's, until the frontend
    names R'."""
    held: set[str] = set()
    if step.replacing_now and step.replacing is not None and not step.replacing.create:
        op = step.replacing.operation
        held = {constants.engine_name(fleet.name, rank) for rank in op.replace}
        held |= {member_name(fleet.name, role) for role in op.members}
    # Ranks left out of the new frontends' attach wait until the members serve (their replacement comes after).
    held |= {constants.engine_name(fleet.name, rank) for rank in step.detached}
    if awaiting_experts:
        held |= {constants.engine_name(fleet.name, rank) for rank in step.joining}
    ranks_replaced = step.replacing is not None and bool(step.replacing.operation.replace)
    if not step.new_incarnation:
        # A frontend other than frontend 0 lost during a resize or a replacement of ranks (ending this pass or not)
        # is replaced in place, attaching, once it ended; so is a dense fleet's coordinator lost during a resize
        # (`planner.follow`).
        if step.resize is not None:
            held |= after_resize(fleet)
        elif ranks_replaced and step.replacing is not None:
            held |= after_replacement(fleet, step.replacing.operation)
    return frozenset(held)


def operation_actions(step: Step) -> tuple[Action, ...]:
    """The resize's requests to the frontend (none once the fleet is recreated)."""
    if step.resize is None or step.new_incarnation:
        return ()
    return tuple(a for a in step.resize.actions if isinstance(a, StartResize | CancelResize))


def desired_objects(fleet: FleetRef, observed: Observed, step: Step, redundant: int | None,
                    fleet_redundant: int | None) -> list[JSON]:
    """Every child the builders produce for the step: at the committed size, plus a scale-up's new ranks
    (built for the new size; MoE: with R', `redundant`)."""
    if step.committed <= 0:  # a stopped fleet keeps its endpoint, Secret and policy, and has no pods
        return builders.fleet_objects(fleet, admin_token=observed.admin_token)
    spec = fleet.spec
    # A drain may remove one engine rank at a time, never while a resize or a replacement runs.
    disruptions = 0 if step.in_flight or step.replacing_now or step.idling_now else 1
    children = builders.fleet_children(fleet, dp_size=step.committed, admin_token=observed.admin_token,
                                       fleet_generation=step.generation, num_redundant_experts=fleet_redundant,
                                       engine_disruptions=disruptions, frontend_attach=step.attaching,
                                       detached=step.detached)
    frontend_address = constants.pod_dns(fleet.name, constants.frontend_name(fleet.name), fleet.namespace)
    to = step.operation.toReplicas if step.operation is not None else step.committed
    return children + [builders.engine_pod(fleet, rank, dp_size=to, frontend_address=frontend_address,
                                           scale_up=spec.expertParallel, fleet_generation=step.generation,
                                           num_redundant_experts=redundant if spec.expertParallel else None)
                       for rank in sorted(step.joining)]


def _apply(observed: Observed, objects: list[JSON], creatable: frozenset[str],
           fresh: bool) -> tuple[tuple[Action, ...], tuple[str, ...], tuple[Event, ...]]:
    """Apply the pods that may be created, and every other child missing or drifted (told, unless the fleet is
    new or only the budget's size follows the committed size)."""
    actions: list[Action] = []
    created: list[str] = []
    events: list[Event] = []
    for obj in objects:
        kind, name = obj["kind"], obj["metadata"]["name"]
        if kind == "Pod":
            if name in creatable:
                actions.append(Apply(obj))
                created.append(name)
            continue
        have = observed.objects.get((kind, name))
        if have is None or not is_subset(obj, have):
            actions.append(Apply(obj))
            follows_size = have is not None and kind == "PodDisruptionBudget" and _same_but_size(obj, have)
            if not fresh and not follows_size:
                state = "missing" if have is None else "changed"
                events.append(Event("Normal", "Repaired", f"{kind} {name} was {state}: applied the spec"))
    return tuple(actions), tuple(created), tuple(events)


def _same_but_size(pdb: Mapping[str, Any], have: Mapping[str, Any]) -> bool:
    """Whether the observed PodDisruptionBudget differs from the wanted one only in minAvailable."""
    want = {**pdb, "spec": {k: v for k, v in pdb["spec"].items() if k != "minAvailable"}}
    return is_subset(want, have)


def _switched_off(observed: Observed, objects: list[JSON]) -> tuple[Delete, ...]:
    """Observed children of an optional kind the spec no longer asks for."""
    desired = {(o["kind"], o["metadata"]["name"]) for o in objects}
    return tuple(Delete(OPTIONAL_KINDS[kind], kind, name, str(body.get("metadata", {}).get("uid", "")))
                 for (kind, name), body in observed.objects.items()
                 if (kind, name) not in desired and kind in OPTIONAL_KINDS)


def _retired_events(step: Step, stale: tuple[PodObs, ...]) -> tuple[Event, ...]:
    """A leaving rank retired before its resize ends: its pod is deleted now."""
    if not step.in_flight or step.resize is None:
        return ()
    op = step.resize.operation
    return tuple(Event("Normal", "RankRetired", f"rank {p.rank} retired by resize {op.id}: deleting pod {p.name}")
                 for p in stale if p.rank in step.resize.retired and p.fleet_generation == step.generation)


def _recovering_event(fleet: FleetRef, observed: Observed, step: Step, created: tuple[str, ...]) -> tuple[Event, ...]:
    """A recovery's new incarnation's first pods, created once its backoff is over."""
    recovery = step.recovery
    if not created or step.phase != "Recovering" or recovery is None or recovery.retryAt == recovery.lostAt \
            or any(p.fleet_generation == step.generation for p in observed.pods):
        return ()
    return (Event("Normal", "Recovering", f"backoff until {recovery.retryAt} over: creating incarnation "
                                          f"{step.generation} (recovery {recovery.attempt} of "
                                          f"{fleet.spec.scaling.maxRecoveries})"),)
