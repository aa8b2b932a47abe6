# SPDX-License-Identifier: Apache-2.0
"""The planner's sixth phase: the status of each rank the fleet keeps (`status.ranks`).

A rank's phase is its pod's (`status.rank_phase`: Pending, Joining, Serving, Failed). While a resize
moves it, the frontend's account wins (Joining, Serving, Draining, Retired), unless the pod failed, or
the frontend waits for a new rank whose pod is not even scheduled (Pending says more). Ranks retired
during this pass are shown until the resize ends. A rank being replaced in place is Pending until its
new pod exists, and Joining until the replacement completes.

Pure module: no kopf, no Kubernetes client, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

from corefleet_operator import constants
from corefleet_operator.models import FleetRef, OperationStatus, RankPhase, RankStatus
from corefleet_operator.observe import PodObs
from corefleet_operator.planner.children import Children
from corefleet_operator.planner.step import Step
from corefleet_operator.status import rank_phase


def rank_statuses(fleet: FleetRef, step: Step, children: Children) -> tuple[RankStatus, ...]:
    """Per-rank status: the pods of this incarnation, and the frontend's view of the ranks a resize moves."""
    resize = step.resize
    states = resize.rank_states if resize is not None and not step.new_incarnation else {}
    retired = resize.retired if resize is not None and step.in_flight else frozenset()
    replaced = step.replacing.operation if step.replacing_now and step.replacing is not None else None
    by_name = {p.name: p for p in children.standing if p.fleet_generation == step.generation}
    out = []
    for rank in sorted(step.keep_ranks | retired):
        name = constants.engine_name(fleet.name, rank)
        pod = by_name.get(name)
        phase, message = _from_frontend(rank, pod, states)
        if replaced is not None and rank in replaced.replace:
            phase, message = _replaced(pod, replaced)
        out.append(RankStatus(rank=rank, pod=name, phase=phase, message=message))
    return tuple(out)


def _from_frontend(rank: int, pod: PodObs | None,
                   states: Mapping[int, tuple[RankPhase, str]]) -> tuple[RankPhase, str]:
    """The pod's phase, or the frontend's account of the rank while a resize moves it."""
    phase = rank_phase(pod)
    message = pod.message if pod is not None else ""
    if rank in states and phase != "Failed":
        frontend_phase, frontend_message = states[rank]
        if not (frontend_phase == "Joining" and phase == "Pending"):
            return frontend_phase, frontend_message
    return phase, message


def _replaced(pod: PodObs | None, op: OperationStatus) -> tuple[RankPhase, str]:
    """A rank replaced in place: Pending until its new pod exists, Joining until the replacement completes."""
    phase: RankPhase = "Pending" if op.phase == "Pending" or pod is None else rank_phase(pod)
    if phase == "Serving" and op.phase != "Completed":
        phase = "Joining"
    return phase, f"being replaced in place ({op.id}): {op.message}"
