# SPDX-License-Identifier: Apache-2.0
"""What every phase of the planner shares: its input knobs and output type, the clock arithmetic on
the status's timestamps, and how pods and ranks are named in messages.

Pure module: no kopf, no Kubernetes client, no I/O, no environment.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass

from corefleet_operator import constants
from corefleet_operator.actions import Action, Delete, Event
from corefleet_operator.models import EngineCoreSetStatus, FleetRef
from corefleet_operator.observe import PodObs

# An operation (a resize or a replacement) that the frontend has not ended this long past its own
# timeouts is lost: the fleet is recovered.
FRONTEND_GRACE_SECONDS = 120.0


@dataclass(frozen=True)
class PlanSettings:
    """The planner's knobs, passed in by the operator (read at its edge, never by the planner).

    backoff_scale: every recovery backoff is multiplied by this (tests: e.g. 0.1 gives 0, 1 s, 2 s, ..., so a
    crash loop runs through its budget in seconds)."""

    backoff_scale: float = 1.0


@dataclass(frozen=True)
class Plan:
    """One reconcile's outcome: the status to write (the planner's only memory), what to do, what to tell."""

    status: EngineCoreSetStatus
    actions: tuple[Action, ...] = ()
    events: tuple[Event, ...] = ()
    requeue_after: float | None = None  # reconcile again within this many seconds even if nothing changes


# ---- time: the status's timestamps are whole seconds in UTC (`2026-12-01T10:15:00Z`) ---------------
def parse_time(value: str | None) -> datetime.datetime | None:
    if not value:
        return None
    return datetime.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)


def format_time(when: datetime.datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def seconds_between(start: str | None, end: str) -> float:
    """Seconds from `start` to `end` (0 when either is unset)."""
    begin, finish = parse_time(start), parse_time(end)
    if begin is None or finish is None:
        return 0.0
    return (finish - begin).total_seconds()


def id_stamp(now: str) -> str:
    """The timestamp in an operation's id: `2026-12-01T10:15:00Z` -> `20261201t101500z`."""
    return now.replace("-", "").replace(":", "").lower()


def later(now: str, seconds: float) -> str:
    """The timestamp `seconds` after `now`."""
    start = parse_time(now)
    assert start is not None
    return format_time(start + datetime.timedelta(seconds=seconds))


def sooner(a: float | None, b: float) -> float:
    """The earlier of two wake-ups (None: none yet)."""
    return b if a is None else min(a, b)


# ---- pods -----------------------------------------------------------------------------------------
def desired_pod_names(fleet: FleetRef, replicas: int, idle: bool = False) -> list[str]:
    """The member pods of a fleet of `replicas` ranks (none for a stopped fleet; no engine for an idle one)."""
    if replicas == 0:
        return []
    return [constants.coordinator_name(fleet.name), *constants.frontend_names(fleet.name, fleet.spec.frontend.replicas),
            *(constants.engine_name(fleet.name, r) for r in range(0 if idle else replicas))]


def pod_ready(pod: PodObs | None) -> bool:
    """A pod that serves: Running, Ready and not being deleted."""
    return pod is not None and pod.ready and pod.phase == "Running" and not pod.terminating


# ---- words ----------------------------------------------------------------------------------------
def what(pod: PodObs) -> str:
    """A pod's part in the fleet, for messages (`rank 2`, `frontend`)."""
    return f"rank {pod.rank}" if pod.role == constants.ROLE_ENGINE else pod.role


def span(ranks: Iterable[int]) -> str:
    """Contiguous ranks (those a resize adds or retires): `rank 3`, `ranks 3..5`."""
    shown = sorted(ranks)
    return f"rank {shown[0]}" if len(shown) == 1 else f"ranks {shown[0]}..{shown[-1]}"


def listed(ranks: Iterable[int]) -> str:
    """Ranks that need not be contiguous (those a replacement gives new pods): `rank 1`, `ranks 1, 3`."""
    shown = sorted(ranks)
    return f"rank {shown[0]}" if len(shown) == 1 else "ranks " + ", ".join(str(r) for r in shown)


def delete_pod(pod: PodObs) -> Delete:
    """The operator's delete of a fleet pod: an engine's with a short grace period (its pre-stop hook waits for a
    release that only a vacating replacement sends: constants.ENGINE_DELETE_GRACE_SECONDS)."""
    grace = constants.ENGINE_DELETE_GRACE_SECONDS if pod.role == constants.ROLE_ENGINE else None
    return Delete("v1", "Pod", pod.name, pod.uid, grace_seconds=grace)
