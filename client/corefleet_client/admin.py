# SPDX-License-Identifier: Apache-2.0
"""The frontend's admin API contract: paths, authentication and the request/response types.

The frontend serves it (`corefleet_client.frontend`); the operator and the `corefleet` command call
it. This module uses only the standard library, so the operator can import it without vLLM,
torch or ZeroMQ (import-linter checks that the operator never imports those).

Every request carries `Authorization: Bearer <token>`; the token is the admin Secret's value,
mounted as a file in the frontend pod. A request without it, or with another token, gets 401.

    GET  /v1/fleet                    -> FleetStatus: the ranks, their states and counters, the resize in flight
    POST /v1/resizes                  ResizeRequest -> ResizeOperation
                                      202: started; 200: the same id and target exist already (idempotent);
                                      409: another resize runs, or the id names another target, or a
                                      replacement names a rank that is not Dead or another size;
                                      400: bad request (a replacement in an MoE fleet);
                                      503: the fleet cannot resize now (starting, a rank dead)
    GET  /v1/resizes                  -> {"operations": [ResizeOperation, ...]} (newest first, the last few)
    GET  /v1/resizes/<id>             -> ResizeOperation, or 404
    POST /v1/resizes/<id>/cancel      {"reason": "..."} -> ResizeOperation (Failed), or 409 once it committed
    POST /v1/resizes/<id>/commit      {} -> ResizeOperation: a follower's Prepared part goes on (frontend 0's
                                      commit; 409 before Prepared, 400 for frontend 0's own operation)
    POST /v1/resizes/<id>/orphan      {"reason": "..."} -> ResizeOperation: the frontend 0 that drove this
                                      follower's part is gone; the part decides now, as at the end of its commit
                                      grace (a scale-up's new ranks dropped, a scale-down or replacement
                                      committed); 400 for frontend 0's own operation
    GET  /healthz                     -> 200 once the admin server runs (no token: for probes)
    GET  /livez                       -> 200 while the frontend's event loop runs (no token: the pod's
                                      livenessProbe); 503 once it made no progress for LOOP_STALL_LIMIT_S

A resize is an operation with an id, carried out by the frontend in the background: the POST
returns at once and the caller polls the operation. At most one runs at a time. A replacement is a
resize that keeps the size and names Dead ranks (`replace`) to be given new engines in place (dense
fleets only: `corefleet_client.frontend.replace`).
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import json
import os
import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

API_PREFIX = "/v1"
FLEET_PATH = f"{API_PREFIX}/fleet"
RESIZES_PATH = f"{API_PREFIX}/resizes"
HEALTH_PATH = "/healthz"
LIVE_PATH = "/livez"  # the frontend's liveness: 503 once its event loop stalled past LOOP_STALL_LIMIT_S
# The engine launcher's pre-stop endpoint (its health port): the rank stops being ready and the call returns once the
# frontend released the engine (RELEASE_UTILITY), the frontend is gone, or `timeout` seconds passed.
DRAIN_PATH = "/drain"
# The utility call by which the frontend tells a drained engine that its pod may stop now (a vacating replacement).
RELEASE_UTILITY = "corefleet_release"
# The utility call by which a replacement frontend re-attaches to a running engine (frontend.attach): the engine
# aborts what the frontend's lost predecessor (same client index) left in flight, and announces itself again on
# the requests socket as it did at startup (enginecore.install_attach_support).
ATTACH_UTILITY = "corefleet_attach"
LOOP_STALL_LIMIT_S = 60.0

AUTH_HEADER = "Authorization"
BEARER = "Bearer "
# Where the frontend reads its token when no file is given (local mode, tests).
ENV_ADMIN_TOKEN = "COREFLEET_ADMIN_TOKEN"
ENV_ADMIN_TOKEN_FILE = "COREFLEET_ADMIN_TOKEN_FILE"

# A resize id: what the operator writes into status.operation.id (also a path segment).
RESIZE_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
MAX_REQUEST_BYTES = 64 * 1024


class RankState(enum.StrEnum):
    JOINING = "Joining"  # expected, has not completed the handshake
    SERVING = "Serving"  # handshake done, takes requests
    DRAINING = "Draining"  # leaving in a scale-down: takes no new requests, finishes its in-flight ones
    RETIRED = "Retired"  # left the fleet through a resize: its pod may be deleted
    FAILED = "Failed"  # was to join in a scale-up and did not: its pod may be deleted
    # Its liveness call is unanswered past the liveness timeout, but its connection is up (a stopped or
    # overloaded process): takes no new requests, its in-flight ones run on; Serving again once it answers.
    UNRESPONSIVE = "Unresponsive"
    DEAD = "Dead"  # its connection is lost (the process went away); takes no requests
    # The fleet is idle (scaled to zero, `ResizeRequest.idle`): its engine was drained, released and stopped; takes
    # no requests (they wait at the frontend: frontend.hold) until a replacement of it (the wake) gives it a new one.
    IDLE = "Idle"


class FleetState(enum.StrEnum):
    STARTING = "Starting"  # waiting for engines to join
    SERVING = "Serving"  # every rank serving
    # At least one rank Dead or Unresponsive; /health stays 200 while at least one rank serves.
    DEGRADED = "Degraded"
    IDLE = "Idle"  # every rank Idle: the endpoint answers, requests wait for the wake; idle, not broken


class ResizePhase(enum.StrEnum):
    PENDING = "Pending"  # accepted, not started yet
    PREPARING = "Preparing"  # scale-up: the new ranks handshake and load their model
    DRAINING = "Draining"  # scale-down: the leaving ranks get no new requests and finish their in-flight ones
    # One of several frontends (a follower, driven by frontend 0): its new ranks announced themselves to it, or its
    # leaving ranks drained; it waits for frontend 0's commit (k-frontends design).
    PREPARED = "Prepared"
    COMMITTING = "Committing"  # the membership changes (routing, stats, coordinator)
    COMPLETED = "Completed"  # the fleet serves at the new size
    FAILED = "Failed"  # the fleet is where it was (fleet_intact) or must be recreated (not fleet_intact)

    @property
    def terminal(self) -> bool:
        return self in (ResizePhase.COMPLETED, ResizePhase.FAILED)


class _Ranked:
    """What the operation and the fleet status share: their ranks by number, and JSON."""

    ranks: tuple[Any, ...]

    def rank(self, rank: int) -> Any:
        for r in self.ranks:
            if r.rank == rank:
                return r
        raise KeyError(rank)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = dataclasses.asdict(self)  # type: ignore[call-overload]  # a dataclass subclass
        return out


@dataclass(frozen=True)
class RankStatus:
    rank: int
    identity: str  # the engine's ZMQ identity as hex (rank as 2 little-endian bytes)
    state: RankState
    waiting: int = 0  # from the coordinator's last stats
    running: int = 0
    kv_cache_usage: float = 0.0
    in_flight: int = 0  # this frontend's unfinished requests on the rank
    requests_total: int = 0  # requests routed to the rank since the frontend started
    aborts_total: int = 0  # aborts routed to the rank
    failed_total: int = 0  # requests ended with an error because the rank died or was retired with them
    message: str = ""
    since: float | None = None  # when the rank entered its state (seconds since the epoch); None: unknown
    # Serving but Stalled (`frontend.progress`): no step ended within its stall bound; new requests avoid it until it
    # makes progress again, its in-flight ones wait for it. The message says why.
    stalled: bool = False
    stalled_since: float | None = None  # when it last turned Stalled
    stalls_total: int = 0  # times it turned Stalled since the frontend started
    moved_total: int = 0  # requests moved to other ranks while it was Stalled, before they started
    # Prefix-affinity routing (`frontend.affinity`): requests routed to the rank with a prefix new to the frontend,
    # because the rank holds their prefix, and as a spill (the rank holding it was over its load bound). The rest of
    # requests_total went by load (no full block, pinned, or least-loaded routing).
    new_prefix_total: int = 0
    affinity_total: int = 0
    spilled_total: int = 0

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankStatus:
        """Fields this version does not know (a newer frontend's) are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in data.items() if k in known}
        return cls(**{**fields, "state": RankState(data["state"])})


@dataclass(frozen=True)
class ResizeRank:
    """One rank a resize adds or removes, and where it is."""

    rank: int
    state: RankState
    message: str = ""


@dataclass(frozen=True)
class ResizeRequest:
    id: str
    replicas: int
    drain_timeout_s: float = 120.0  # a leaving rank's in-flight requests get this long, then fail
    join_timeout_s: float = 1800.0  # a new rank gets this long to load its model and handshake
    # A replacement: these Dead ranks get new engines in place; replicas is then the fleet's size.
    replace: tuple[int, ...] = ()
    # A replacement of ranks whose pods are being removed (a drain's eviction, a delete with a grace period):
    # ranks that still serve are drained first (no new request, in-flight ones finish within drain_timeout_s),
    # then released (their engine may exit) and replaced once their connection is gone.
    vacate: bool = False
    # Sent by frontend 0 to the fleet's other frontends (k-frontends design): this frontend's part of frontend 0's
    # resize or replacement with the same id. It stops at Prepared until frontend 0 commits it (POST .../commit).
    follower: bool = False
    # Idle the fleet (scale to zero, issue 28): every rank is drained (a request that arrives meanwhile waits, and
    # stops the idling: the fleet serves on), released, and Idle once its engine stopped; replicas is the fleet's
    # size. A replacement of the Idle ranks (`replace`) wakes it.
    idle: bool = False

    def validate(self) -> str | None:
        """Why the request is malformed, or None."""
        if not RESIZE_ID_PATTERN.match(self.id):
            return f"id {self.id!r} must match {RESIZE_ID_PATTERN.pattern}"
        if self.replicas < 1:
            return (f"replicas must be at least 1, not {self.replicas} (a fleet of 0 ranks has no frontend: "
                    "the operator stops it by deleting its pods)")
        if not 0 <= self.drain_timeout_s <= 86400:
            return f"drain_timeout_s must be in 0..86400, not {self.drain_timeout_s}"
        if not 0 < self.join_timeout_s <= 86400:
            return f"join_timeout_s must be in (0, 86400], not {self.join_timeout_s}"
        outside = sorted(r for r in set(self.replace) if not 0 <= r < self.replicas)
        if outside:
            return f"replace names rank(s) {outside} outside the fleet's ranks 0..{self.replicas - 1}"
        if len(set(self.replace)) != len(self.replace):
            return f"replace names a rank twice: {list(self.replace)}"
        if self.vacate and not self.replace:
            return "vacate needs the ranks it replaces (replace)"
        if self.idle and (self.replace or self.vacate or self.follower):
            return "idle takes every rank of the fleet: it goes with neither replace, vacate nor follower"
        if self.follower and self.vacate:
            return ("a follower's part of a replacement drains whatever of the ranks still serves on that frontend: "
                    "vacate is frontend 0's")
        return None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["replace"] = list(self.replace)
        if not self.replace:  # a plain resize reads as before (a frontend without replacements refuses the field)
            del out["replace"]
        if not self.vacate:  # likewise
            del out["vacate"]
        if not self.follower:  # likewise
            del out["follower"]
        if not self.idle:  # likewise
            del out["idle"]
        return out

    @classmethod
    def from_json(cls, data: Any) -> ResizeRequest:
        if not isinstance(data, dict):
            raise ValueError("a resize request is a JSON object")
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown field(s) {sorted(unknown)}")
        if not isinstance(data.get("id"), str):
            raise ValueError("id must be a string")
        replicas = data.get("replicas")
        if isinstance(replicas, bool) or not isinstance(replicas, int):
            raise ValueError("replicas must be an integer")
        timeouts = {}
        for name in ("drain_timeout_s", "join_timeout_s"):
            if name in data:
                v = data[name]
                if isinstance(v, bool) or not isinstance(v, int | float):
                    raise ValueError(f"{name} must be a number")
                timeouts[name] = float(v)
        replace = data.get("replace", [])
        if not isinstance(replace, list) or any(isinstance(r, bool) or not isinstance(r, int) for r in replace):
            raise ValueError("replace must be a list of rank numbers")
        flags = {}
        for name in ("vacate", "follower", "idle"):
            flags[name] = data.get(name, False)
            if not isinstance(flags[name], bool):
                raise ValueError(f"{name} must be a boolean")
        return cls(id=data["id"], replicas=replicas, **timeouts, replace=tuple(replace), vacate=flags["vacate"],
                   follower=flags["follower"], idle=flags["idle"])


@dataclass(frozen=True)
class ResizeOperation(_Ranked):
    id: str
    from_replicas: int
    to_replicas: int
    phase: ResizePhase
    ranks: tuple[ResizeRank, ...] = ()  # the ranks it adds, removes or replaces
    started_at: float = 0.0  # seconds since the epoch
    finished_at: float | None = None
    drain_timeout_s: float = 0.0
    join_timeout_s: float = 0.0
    message: str = ""  # what it is doing now, or how it ended
    error: str = ""  # why it failed
    fleet_intact: bool = True  # after a failure: the fleet still serves at from_replicas (else recreate it)
    replace: tuple[int, ...] = ()  # a replacement (from_replicas == to_replicas): the ranks it gives new engines
    # MoE (elastic EP): the fleet's redundant experts at to_replicas (vLLM's R'); a new rank's pod is started with
    # it in --eplb-config. None for dense fleets.
    num_redundant_experts: int | None = None
    follower: bool = False  # a follower's part of frontend 0's resize (ResizeRequest.follower)
    idle: bool = False  # the fleet goes idle (ResizeRequest.idle)

    @property
    def scale_up(self) -> bool:
        return self.to_replicas > self.from_replicas

    def rank(self, rank: int) -> ResizeRank:
        found: ResizeRank = super().rank(rank)
        return found

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ResizeOperation:
        ranks = tuple(ResizeRank(rank=int(r["rank"]), state=RankState(r["state"]), message=r.get("message", ""))
                      for r in data.get("ranks", ()))
        finished = data.get("finished_at")
        return cls(
            id=data["id"], from_replicas=int(data["from_replicas"]), to_replicas=int(data["to_replicas"]),
            phase=ResizePhase(data["phase"]), ranks=ranks, started_at=float(data.get("started_at", 0.0)),
            finished_at=None if finished is None else float(finished),
            drain_timeout_s=float(data.get("drain_timeout_s", 0.0)),
            join_timeout_s=float(data.get("join_timeout_s", 0.0)), message=data.get("message", ""),
            error=data.get("error", ""), fleet_intact=bool(data.get("fleet_intact", True)),
            replace=tuple(int(r) for r in data.get("replace", ())),
            num_redundant_experts=None if data.get("num_redundant_experts") is None
            else int(data["num_redundant_experts"]),
            follower=bool(data.get("follower", False)),
            idle=bool(data.get("idle", False)),
        )


@dataclass(frozen=True)
class FleetStatus(_Ranked):
    state: FleetState
    model: str
    data_parallel_size: int  # the committed size: the ranks requests are routed to once no resize runs
    vllm_version: str
    ranks: tuple[RankStatus, ...] = field(default_factory=tuple)
    message: str = ""
    resize: ResizeOperation | None = None  # the resize in flight, else the last one
    requests_waiting: int = 0  # requests held for a rank now (no rank takes requests: frontend.hold)
    # Seconds since a request was last in flight or waiting at this frontend (at the liveness interval's
    # granularity; 0 while any is): how long the fleet has been quiet, for idling it after a quiet period.
    quiet_s: float = 0.0

    def rank(self, rank: int) -> RankStatus:
        found: RankStatus = super().rank(rank)
        return found

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FleetStatus:
        ranks = tuple(RankStatus.from_json(r) for r in data.get("ranks", ()))
        resize = data.get("resize")
        return cls(
            state=FleetState(data["state"]),
            model=data["model"],
            data_parallel_size=int(data["data_parallel_size"]),
            vllm_version=data["vllm_version"],
            ranks=ranks,
            message=data.get("message", ""),
            resize=None if resize is None else ResizeOperation.from_json(resize),
            requests_waiting=int(data.get("requests_waiting", 0)),
            quiet_s=float(data.get("quiet_s", 0.0)),
        )


def read_token(token_file: str | None = None) -> str:
    """The admin token: from `token_file`, else $COREFLEET_ADMIN_TOKEN_FILE, else $COREFLEET_ADMIN_TOKEN."""
    path = token_file or os.environ.get(ENV_ADMIN_TOKEN_FILE)
    if path:
        token = Path(path).read_text().strip()
        source = path
    else:
        token = os.environ.get(ENV_ADMIN_TOKEN, "").strip()
        source = f"${ENV_ADMIN_TOKEN}"
    if not token:
        raise ValueError(f"no admin token: {source} is empty or unset (the admin API never runs without one)")
    return token


def authorized(header_value: str | None, token: str) -> bool:
    """Constant-time check of an Authorization header against the token."""
    if not header_value or not header_value.startswith(BEARER):
        return False
    return hmac.compare_digest(header_value[len(BEARER):].encode(), token.encode())


class AdminError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"admin API answered {status}: {message}")
        self.status = status
        self.body = message


class AdminClient:
    """A small blocking client (urllib) for the operator and the `corefleet` command."""

    def __init__(self, base_url: str, token: str, timeout: float = 5.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        headers = {AUTH_HEADER: BEARER + self.token}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                answer: dict[str, Any] = json.loads(resp.read())
                return int(resp.status), answer
        except urllib.error.HTTPError as e:
            raise AdminError(e.code, e.read().decode(errors="replace")) from None

    def _get(self, path: str) -> dict[str, Any]:
        return self._call("GET", path)[1]

    def fleet(self) -> FleetStatus:
        return FleetStatus.from_json(self.fleet_json())

    def fleet_json(self) -> dict[str, Any]:
        """`GET /v1/fleet` as JSON, for a reader that must take states it does not know (an older operator)."""
        return self._get(FLEET_PATH)

    def start_resize(self, request: ResizeRequest) -> tuple[bool, ResizeOperation]:
        """Start a resize; (True if this call started it, the operation). Raises AdminError (409, ...)."""
        status, body = self._call("POST", RESIZES_PATH, request.to_json())
        return status == 202, ResizeOperation.from_json(body)

    def resize(self, resize_id: str) -> ResizeOperation | None:
        """The operation with that id, or None if the frontend has none."""
        try:
            return ResizeOperation.from_json(self._get(f"{RESIZES_PATH}/{resize_id}"))
        except AdminError as e:
            if e.status == 404:
                return None
            raise

    def resizes(self) -> list[ResizeOperation]:
        return [ResizeOperation.from_json(o) for o in self._get(RESIZES_PATH).get("operations", ())]

    def cancel_resize(self, resize_id: str, reason: str) -> ResizeOperation:
        return ResizeOperation.from_json(self._call("POST", f"{RESIZES_PATH}/{resize_id}/cancel",
                                                    {"reason": reason})[1])

    def commit_resize(self, resize_id: str) -> ResizeOperation:
        """A follower's Prepared part of a resize goes on to its commit (frontend 0 calls it on every follower)."""
        return ResizeOperation.from_json(self._call("POST", f"{RESIZES_PATH}/{resize_id}/commit", {})[1])

    def orphan_resize(self, resize_id: str, reason: str) -> ResizeOperation:
        """A follower's part whose driving frontend 0 is gone decides now, as at the end of its commit grace (a
        restarted frontend 0 calls it on a part its predecessor left)."""
        return ResizeOperation.from_json(self._call("POST", f"{RESIZES_PATH}/{resize_id}/orphan",
                                                    {"reason": reason})[1])
