# SPDX-License-Identifier: Apache-2.0
"""Where the fleet stands before the planner decides anything (`begin`).

The planner keeps no state between calls: the status it last wrote is its only memory, and
everything else is observed again on every call. A fleet has an incarnation, `status.fleetGeneration`,
and every pod carries the incarnation and the hash of the fleet-wide configuration it was built from
(vLLM ranks must run identical configuration and an engine that restarts cannot rejoin, so pods are
never updated in place). `status.replicas` is the committed size: the ranks 0..replicas-1 are the
fleet's members. A fleet never created (incarnation 0) starts as incarnation 1 at `spec.replicas`.

An empty status while the fleet's pods run (the status was wiped, or lost with a restore of etcd) is
rebuilt from the newest incarnation's pods (`adopt`), which are not taken for strangers and deleted.

Pure module: no kopf, no Kubernetes client, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from corefleet_operator import builders, constants
from corefleet_operator.actions import Event
from corefleet_operator.models import EngineCoreSetStatus, FleetRef, OperationStatus, RecoveryStatus
from corefleet_operator.observe import Observed, PodObs
from corefleet_operator.planner.common import desired_pod_names
from corefleet_operator.planner.recovery import exhausted, streak


@dataclass(frozen=True)
class Basis:
    """The fleet as this pass finds it: the status it last wrote (or adopted), and its pods."""

    old: EngineCoreSetStatus  # the status as stored (or as adopted from the pods)
    fresh: bool  # the fleet was never created: it is created now
    generation: int  # its incarnation (1 for a fresh fleet)
    committed: int  # its committed size (spec.replicas for a fresh fleet)
    config_hash: str  # the hash of the spec's fleet-wide configuration (what every pod must carry)
    running: OperationStatus | None  # the operation in flight, if any (a resize or a replacement)
    streak: RecoveryStatus | None  # the recovery streak the fleet is in, if any
    live: tuple[PodObs, ...]  # pods not being deleted
    terminating: tuple[PodObs, ...]  # pods being deleted
    live_by_name: Mapping[str, PodObs]
    current: Mapping[str, PodObs]  # live pods of the current incarnation, by name
    members: frozenset[str]  # the member pods at the committed size (coordinator, frontend, engines; no engine
    #                          while the fleet is idle: `planner.idle`)
    events: tuple[Event, ...] = ()  # StatusLost (adopted), Creating (fresh)

    @property
    def given_up(self) -> bool:
        """The fleet was given up after its recovery budget (past `still_given_up`: its spec has changed since)."""
        return exhausted(self.old) and not self.fresh


def begin(fleet: FleetRef, observed: Observed, now: str) -> Basis:
    """The basis of this pass: the stored status (adopted from the pods if it was lost), the incarnation and
    committed size (a fresh fleet's first), the operation in flight and the recovery streak."""
    spec = fleet.spec
    old = observed.status
    events: tuple[Event, ...] = ()
    adopted = adopt(fleet, observed)
    if adopted is not None:
        old, event = adopted
        events = (event,)
    fresh = old.fleetGeneration == 0
    generation, committed = (1, spec.replicas) if fresh else (old.fleetGeneration, old.replicas)
    if fresh:
        events = (*events, Event("Normal", "Creating", f"creating a fleet of {spec.replicas} ranks of {spec.model}"))
    live = tuple(p for p in observed.pods if not p.terminating)
    running = old.operation if old.operation is not None and not old.operation.done else None
    return Basis(old=old, fresh=fresh, generation=generation, committed=committed,
                 config_hash=builders.fleet_config_hash(spec), running=running,
                 streak=streak(old, observed.generation, now), live=live,
                 terminating=tuple(p for p in observed.pods if p.terminating),
                 live_by_name={p.name: p for p in live},
                 current={p.name: p for p in live if p.fleet_generation == generation},
                 members=frozenset(desired_pod_names(fleet, committed, idle=old.idle is not None and not fresh)),
                 events=events)


def adopt(fleet: FleetRef, observed: Observed) -> tuple[EngineCoreSetStatus, Event] | None:
    """An empty status while the fleet's pods run: the newest incarnation's pods are adopted. Its size is the
    ranks up to its highest engine pod's; Degraded if its members all stand (Running once they are ready), else
    Starting. What the frontend says it runs is taken next (`planner.resize.frontends_resize`)."""
    old = observed.status
    if old.fleetGeneration != 0:
        return None
    pods = [p for p in observed.pods if not p.terminating and p.fleet_generation > 0]
    if not pods:
        return None
    generation = max(p.fleet_generation for p in pods)
    mine = {p.name for p in pods if p.fleet_generation == generation}
    # Its ranks up to the highest one with a pod: a rank whose pod is missing (one being replaced) is not the last
    # rank's to lose.
    size = 1 + max((p.rank for p in pods if p.fleet_generation == generation and p.role == constants.ROLE_ENGINE
                    and p.rank is not None), default=-1)
    complete = size > 0 and set(desired_pod_names(fleet, size)) <= mine
    status = replace(old, fleetGeneration=generation, replicas=size, phase="Degraded" if complete else "Starting")
    return status, Event("Warning", "StatusLost",
                         f"the status was empty while pods of incarnation {generation} run: adopted them "
                         f"({size} ranks{'' if complete else ', incomplete'}) instead of recreating the fleet")
