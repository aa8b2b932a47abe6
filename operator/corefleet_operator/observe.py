# SPDX-License-Identifier: Apache-2.0
"""What the operator observes of a fleet, as plain immutable values, and the pure code that makes them.

The kopf handlers (`corefleet_operator.handlers.fleet`) keep compact copies of a fleet's children
in kopf indexes keyed by `ChildKey` (its controller's UID included: `controller_uid`): one `PodObs`
per pod (`pod_obs`), one `Terminating` per pod being deleted, and the other children's bodies.
Before each reconcile, `observe` gathers them with the EngineCoreSet's generation, its stored status
and the admin token into one `Observed`, which the planner (`corefleet_operator.planner`) and the
status (`corefleet_operator.status`) read. The reconciler (`corefleet_operator.reconciler`) adds what
the frontend's admin API says: of a resize in flight (`FrontendObs`) and, while the fleet serves
(`fleet_view_due`), of its ranks (`FleetObs`).

Pure module: no kopf, no Kubernetes client, no I/O.
"""

from __future__ import annotations

import base64
import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from corefleet_operator import constants
from corefleet_operator.models import EngineCoreSetStatus


@dataclass(frozen=True)
class PodObs:
    """What the planner needs to know of one fleet pod (a compact copy of the watched object)."""

    name: str
    uid: str
    role: str
    rank: int | None = None
    phase: str = "Pending"
    ready: bool = False
    terminating: bool = False
    spec_hash: str = ""
    config_sections: str = ""  # ANNOTATION_CONFIG_SECTIONS: the spec hash's parts (builders.format_sections)
    fleet_generation: int = 0
    node: str = ""
    ip: str = ""
    message: str = ""  # why it failed, or why it is not scheduled
    unready_since: str = ""  # since when a bound, unready pod has been waiting (its readiness deadline's start)


@dataclass(frozen=True)
class ResizeObs:
    """A resize as the frontend reports it (its admin API's ResizeOperation, reduced to what the planner reads)."""

    id: str
    phase: str  # Pending, Preparing, Draining, Committing, Completed, Failed
    ranks: Mapping[int, tuple[str, str]] = field(default_factory=dict)  # rank -> (state, message)
    message: str = ""
    error: str = ""
    fleet_intact: bool = True  # after a failure: the fleet still serves at the size before
    num_redundant_experts: int | None = None  # MoE: R' at the new size (new ranks' --eplb-config); None if dense


@dataclass(frozen=True)
class RankObs:
    """One rank as the frontend's admin API reports it (`GET /v1/fleet`)."""

    rank: int
    state: str  # Joining, Serving, Draining, Retired, Failed, Dead, Unresponsive, or a state this operator
    #            does not know (read as not serving, not dead)
    since: float | None = None  # when it entered that state (seconds since the epoch), if the frontend says
    message: str = ""


@dataclass(frozen=True)
class FrontendResize:
    """A resize the frontend runs (not Completed or Failed), as its view of the fleet reports it: the status may not
    record it (`planner.resize.frontends_resize`)."""

    from_replicas: int
    to_replicas: int
    replace: tuple[int, ...]  # a replacement in place: the ranks it gives new engines
    account: ResizeObs


@dataclass(frozen=True)
class FleetObs:
    """What the frontend's admin API said of the fleet's ranks this reconcile (asked while the fleet runs)."""

    reachable: bool
    error: str = ""  # why it could not be asked
    ranks: Mapping[int, RankObs] = field(default_factory=dict)
    size: int | None = None  # the frontend's committed size (`data_parallel_size`), if it said
    resize: FrontendResize | None = None  # the resize it runs, if one does
    requests_waiting: int = 0  # requests held at the frontend, waiting for a rank that takes requests
    quiet_s: float | None = None  # seconds since a request was last in flight or held there (None: not said)


@dataclass(frozen=True)
class FrontendObs:
    """What the frontend's admin API said this reconcile about the resize in status.operation."""

    reachable: bool
    error: str = ""  # why it could not be asked
    resize: ResizeObs | None = None  # None while reachable: the frontend knows no resize of that id
    refused: str = ""  # the frontend knows none because it refused to start it: why
    # While the frontend knows no operation of that id: its view of the ranks, read along (a replacement of lost
    # ranks in place is asked of it only once it reports them Dead).
    fleet: FleetObs | None = None


@dataclass(frozen=True)
class Observed:
    """Everything one reconcile of a fleet sees."""

    generation: int  # the EngineCoreSet's metadata.generation
    status: EngineCoreSetStatus
    pods: tuple[PodObs, ...] = ()
    objects: Mapping[tuple[str, str], Mapping[str, Any]] = field(default_factory=dict)  # (kind, name) -> body
    admin_token: str = ""
    frontend: FrontendObs | None = None  # asked only while a resize is in flight
    fleet: FleetObs | None = None  # the frontend's view of the ranks, asked while the fleet runs (`fleet_view_due`)


@dataclass(frozen=True)
class Terminating:
    """A fleet pod being deleted: when its grace period ends (`deletionTimestamp`) and where it runs."""

    name: str
    uid: str
    deadline: str  # metadata.deletionTimestamp: the deletion request plus the grace period
    node: str


# The key of a fleet's children in the kopf indexes: (namespace, fleet label, controlling EngineCoreSet's
# UID). A fleet reads its own UID's entries only: labels alone would let a user's object, or the children
# of a deleted EngineCoreSet of the same name still being garbage-collected, pass for the fleet's own.
ChildKey = tuple[str, str, str]


def controller_uid(meta: Mapping[str, Any]) -> str:
    """The UID of the EngineCoreSet that controls an object (its controller ownerReference), else ""."""
    for ref in meta.get("ownerReferences") or ():
        if ref.get("controller") and ref.get("kind") == constants.KIND and \
                str(ref.get("apiVersion", "")).startswith(f"{constants.GROUP}/"):
            return str(ref.get("uid") or "")
    return ""


def pod_obs(name: str, meta: Mapping[str, Any], spec: Mapping[str, Any], status: Mapping[str, Any]) -> PodObs:
    """The planner's view of one pod (a kopf index value: small, immutable)."""
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    ready = (conditions.get("Ready") or {}).get("status") == "True"
    message = ""
    phase = status.get("phase") or "Pending"
    if phase in ("Failed", "Succeeded"):
        for cs in status.get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated")
            if term:
                message = f"container {cs.get('name')} exited with {term.get('exitCode')}"
                if term.get("reason"):
                    message += f" ({term['reason']})"
                break
        message = message or status.get("message") or status.get("reason") or ""
    elif not spec.get("nodeName"):
        scheduled = conditions.get("PodScheduled") or {}
        if scheduled.get("status") == "False":
            message = scheduled.get("message") or scheduled.get("reason") or ""
    unready_since = ""
    if spec.get("nodeName") and not ready and phase not in ("Failed", "Succeeded"):
        # Its readiness deadline runs from the later of when it was scheduled and when it last became unready
        # (a pod that served and stopped answering its probe starts a new deadline), else from its creation.
        scheduled, readiness = conditions.get("PodScheduled") or {}, conditions.get("Ready") or {}
        times = [str(c["lastTransitionTime"]) for c in (scheduled, readiness) if c.get("lastTransitionTime")
                 and (c is readiness or c.get("status") == "True")]
        unready_since = max(times) if times else str(meta.get("creationTimestamp") or "")
    rank = labels.get(constants.LABEL_RANK)
    try:
        generation = int(annotations.get(constants.ANNOTATION_GENERATION, "0"))
    except ValueError:
        generation = 0
    return PodObs(
        name=name,
        uid=str(meta.get("uid", "")),
        role=str(labels.get(constants.LABEL_ROLE, "")),
        rank=int(rank) if rank is not None and str(rank).isdigit() else None,
        phase=phase,
        ready=ready,
        terminating=bool(meta.get("deletionTimestamp")),
        spec_hash=str(annotations.get(constants.ANNOTATION_SPEC_HASH, "")),
        config_sections=str(annotations.get(constants.ANNOTATION_CONFIG_SECTIONS, "")),
        fleet_generation=generation,
        node=str(spec.get("nodeName") or ""),
        ip=str(status.get("podIP") or ""),
        message=message,
        unready_since=unready_since,
    )


def admin_token(objects: Mapping[tuple[str, str], Mapping[str, Any]], fleet: str, fallback: str) -> str:
    """The admin API's token from the fleet's observed admin Secret, else `fallback`."""
    secret = objects.get(("Secret", constants.admin_secret_name(fleet)))
    encoded = ((secret or {}).get("data") or {}).get(constants.ADMIN_TOKEN_KEY)
    if encoded:
        return base64.b64decode(encoded).decode()
    return fallback


def observe(body: Mapping[str, Any], status: EngineCoreSetStatus, pods: Iterable[PodObs],
            objects: Iterable[tuple[str, str, dict[str, Any]]], token: str) -> Observed:
    """One reconcile's view of a fleet: the EngineCoreSet `body` with its stored `status` (parsed), its pods
    (sorted by name), its other children as (kind, name, body), and the admin token (`token` until
    the Secret is observed). The frontend's answer is added by `with_frontend`."""
    by_key = {(kind, name): obj for kind, name, obj in objects}
    return Observed(
        generation=int(body["metadata"].get("generation") or 0),
        status=status,
        pods=tuple(sorted(pods, key=lambda p: p.name)),
        objects=by_key,
        admin_token=admin_token(by_key, str(body["metadata"]["name"]), token),
    )


def resize_in_flight(observed: Observed) -> str | None:
    """The id of the resize the stored status says is running (the frontend is asked about it), or None. A
    replacement of the frontend and/or coordinator (`members`) is none: it is the operator's alone."""
    op = observed.status.operation
    return op.id if op is not None and not op.done and not op.members else None


def frontend_pod(observed: Observed, fleet: str) -> PodObs | None:
    """The current incarnation's frontend pod, if it has an address (where its admin API is reached)."""
    name = constants.frontend_name(fleet)
    for p in observed.pods:
        if (p.name == name and not p.terminating and p.ip and p.phase == "Running"
                and p.fleet_generation == observed.status.fleetGeneration):
            return p
    return None


def fleet_view_due(observed: Observed) -> bool:
    """Whether this reconcile asks the frontend for its view of the ranks (`GET /v1/fleet`): while the fleet
    serves at its committed size (Running, or Degraded: a dead rank makes the frontend unready) or is Idle (whether
    requests wait for it to wake), and no resize
    runs (a resize is followed through its own operation; `FrontendObs.fleet` has the view while the frontend
    does not know the operation yet)."""
    return observed.status.phase in ("Running", "Degraded", "Idle") and resize_in_flight(observed) is None


def _epoch(value: Any) -> float | None:
    """A time from the admin API: seconds since the epoch, or an RFC 3339 string; None if neither."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    try:
        parsed = datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.UTC)
    return parsed.timestamp()


SINCE_KEYS = ("since", "state_since", "unresponsive_since")  # where a rank's state time may be given


def fleet_obs(fleet: Mapping[str, Any]) -> FleetObs:
    """The planner's view of an admin API FleetStatus (as JSON). Read leniently: a state this operator does not
    know is kept as it is (the planner reads it as not serving, not dead), and a rank entry without a number
    is skipped."""
    ranks: dict[int, RankObs] = {}
    for r in fleet.get("ranks") or ():
        if not isinstance(r, Mapping) or isinstance(r.get("rank"), bool) or not isinstance(r.get("rank"), int):
            continue
        since = next((t for key in SINCE_KEYS if (t := _epoch(r.get(key))) is not None), None)
        ranks[int(r["rank"])] = RankObs(rank=int(r["rank"]), state=str(r.get("state", "")), since=since,
                                        message=str(r.get("message") or ""))
    size = fleet.get("data_parallel_size")
    waiting, quiet = fleet.get("requests_waiting"), fleet.get("quiet_s")
    return FleetObs(reachable=True, ranks=ranks, size=size if isinstance(size, int) and not isinstance(size, bool)
                    else None, resize=_running_resize(fleet.get("resize")),
                    requests_waiting=waiting if isinstance(waiting, int) and not isinstance(waiting, bool) else 0,
                    quiet_s=float(quiet) if isinstance(quiet, int | float) and not isinstance(quiet, bool) else None)


def _running_resize(operation: Any) -> FrontendResize | None:
    """The fleet view's resize (the one in flight, else the last one), if it runs; None if it ended or is unreadable."""
    if not isinstance(operation, Mapping) or operation.get("phase") in ("Completed", "Failed"):
        return None
    try:
        return FrontendResize(from_replicas=int(operation["from_replicas"]), to_replicas=int(operation["to_replicas"]),
                              replace=tuple(int(r) for r in operation.get("replace") or ()),
                              account=resize_obs(operation))
    except (KeyError, TypeError, ValueError):
        return None


def resize_obs(operation: Mapping[str, Any]) -> ResizeObs:
    """The planner's view of an admin API ResizeOperation (as JSON)."""
    return ResizeObs(
        id=str(operation["id"]),
        phase=str(operation["phase"]),
        ranks={int(r["rank"]): (str(r["state"]), str(r.get("message", ""))) for r in operation.get("ranks", ())},
        message=str(operation.get("message", "")),
        error=str(operation.get("error", "")),
        fleet_intact=bool(operation.get("fleet_intact", True)),
        num_redundant_experts=None if operation.get("num_redundant_experts") is None
        else int(operation["num_redundant_experts"]),
    )
