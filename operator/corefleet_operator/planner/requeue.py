# SPDX-License-Identifier: Apache-2.0
"""The planner's last phase: when to look again even if Kubernetes reports nothing (`Plan.requeue_after`).

What changes without a Kubernetes event is looked at on time: an operation's progress on the frontend
(`RESIZE_POLL_SECONDS`; a replacement's backoff end), a failed resize's retry, a recovery's backoff
end, an MoE scale-up's R' (`REDUNDANT_EXPERTS_POLL_SECONDS`), the readiness deadlines (the fleet's, and
each pod's), and the frontend's view of the ranks of a fleet that serves (`FRONTEND_POLL_SECONDS`) or is
idle (`IDLE_POLL_SECONDS`: whether requests wait for it to wake).

Pure module: no kopf, no Kubernetes client, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from corefleet_operator.models import EngineCoreSetStatus, FleetRef
from corefleet_operator.observe import PodObs
from corefleet_operator.planner.common import seconds_between, sooner
from corefleet_operator.planner.idle import IDLE_POLL_SECONDS
from corefleet_operator.planner.losses import FRONTEND_POLL_SECONDS
from corefleet_operator.planner.resize import REDUNDANT_EXPERTS_POLL_SECONDS, RESIZE_POLL_SECONDS
from corefleet_operator.planner.step import Step
from corefleet_operator.status import POD_TERMINAL


def operation_wake(step: Step, backoff: float, awaiting_experts: bool) -> float | None:
    """When the step's own clock runs out: a failed resize's retry, the operation in flight's next poll (a
    replacement's backoff end), a recovery's backoff end (`backoff`), an MoE scale-up's R'."""
    wake = step.retry_in
    if step.in_flight or step.idling_now:
        wake = RESIZE_POLL_SECONDS
    if step.replacing_now and step.replacing is not None:  # the frontend is followed, or the backoff's end awaited
        wake = step.replacing.wait if step.replacing.wait else RESIZE_POLL_SECONDS
    if backoff > 0:
        wake = sooner(wake, backoff)
    if awaiting_experts:
        wake = sooner(wake, REDUNDANT_EXPERTS_POLL_SECONDS)  # the frontend answers at once: the pods start sooner
    return wake


def requeue_after(fleet: FleetRef, step: Step, status: EngineCoreSetStatus, standing: Iterable[PodObs],
                  wake: float | None, now: str) -> float | None:
    """The plan's requeue: the step's wake-up, the readiness deadlines, the frontend's view of the ranks."""
    timeout = float(fleet.spec.scaling.readyTimeoutSeconds)
    requeue = wake
    if status.phase in ("Starting", "Restarting", "Recovering") and requeue is None:
        requeue = timeout  # the readiness deadline is checked on time
    for p in standing:  # each pod's own readiness deadline (a loss when it passes) is checked on time
        if p.fleet_generation == step.generation and p.unready_since and not p.ready and p.phase not in POD_TERMINAL:
            requeue = sooner(requeue, max(1.0, timeout - seconds_between(p.unready_since, now) + 1))
    if status.phase in ("Running", "Degraded") and not step.in_flight:
        requeue = sooner(requeue, FRONTEND_POLL_SECONDS)  # the frontend's view of the ranks is read this often
    if status.phase == "Idle":
        requeue = sooner(requeue, IDLE_POLL_SECONDS)  # whether requests wait for the fleet to wake
    return requeue
