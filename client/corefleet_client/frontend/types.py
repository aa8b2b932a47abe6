# SPDX-License-Identifier: Apache-2.0
"""What the frontend's modules share: its options, its errors, the resize cancels and the view of vLLM's client.

A leaf: it imports no other frontend module (an import-linter contract), and neither vLLM nor
ZeroMQ, so the fleet registry (`frontend.fleet`) and the admin server (`frontend.adminserver`),
which are tested without vLLM, can use it too. Each error says who raises it and who reads it:

* `ResizeRefused`: a resize request the fleet will not carry out (`Fleet.start_resize` and
  `Fleet.cancel_resize` raise it in the admin server's threads; the admin server answers with its
  HTTP status).
* `ResizeFailed`: a running resize operation that stopped (raised by the resize components on
  vLLM's event loop; `operations.ResizeOperations` records it as the operation's error, with
  `fleet_intact` telling the operator whether the fleet serves on or must be recreated).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Protocol

from corefleet_client.admin import ResizeOperation

logger = logging.getLogger("corefleet.frontend")

# Several frontends (frontend.followers): how long a follower's Prepared part of a resize waits for frontend 0's commit
# (beyond a scale-down's drain timeout) before it decides by itself, and how long frontend 0 waits for the followers.
COMMIT_GRACE_S = 60.0

# A score no live rank reaches: vLLM's router picks the lowest (waiting, running) load.
UNROUTABLE = 1 << 60
# The load a Stalled rank shows the router: more than any working rank's, less than UNROUTABLE.
STALLED_LOAD = 1 << 40


DEFAULT_STALL_TIMEOUT_S = 1.0
DEFAULT_STALL_STEP_FACTOR = 10.0


@dataclass(frozen=True)
class StallPolicy:
    """The frontend's stall settings (`--stall-timeout`, `--stall-step-factor`): see `frontend.progress`."""

    floor_s: float = DEFAULT_STALL_TIMEOUT_S  # 0: no rank is ever Stalled
    step_factor: float = DEFAULT_STALL_STEP_FACTOR

    @property
    def enabled(self) -> bool:
        return self.floor_s > 0


class RoutingPolicy(enum.StrEnum):
    """How the frontend picks a rank for a request not pinned to one (`--routing`)."""

    LEAST_LOADED = "least-loaded"  # vLLM's own router: the least loaded rank, ties rotated
    PREFIX_AFFINITY = "prefix-affinity"  # the rank holding the prompt's prefix, bounded by load (`frontend.affinity`)


DEFAULT_ROUTING = RoutingPolicy.PREFIX_AFFINITY  # bench/bench_routing.py: better or even on every workload
ENV_ROUTING = "COREFLEET_ROUTING"  # the default of the frontend's --routing (local fleets: `corefleet up --routing`)
DEFAULT_ROUTING_PREFIX_TOKENS = 256
DEFAULT_ROUTING_BALANCE = 1.25
DEFAULT_ROUTING_MEMORY = 65536  # prefixes remembered (an 8-byte hash and a rank each)


class Decision(enum.StrEnum):
    """Why prefix-affinity routing sent a request to its rank."""

    NEW = "new"  # a prefix the frontend had not routed: its first rank near the least loaded, which then holds it
    AFFINITY = "affinity"  # the rank holding the prompt's prefix (where its longest routed prefix went)
    SPILL = "spill"  # that rank was over its load bound: the prefix's next rank (rendezvous order) that had room


@dataclass(frozen=True)
class AffinitySettings:
    """`--routing-prefix-tokens`, `--routing-balance`: see `frontend.affinity`."""

    prefix_tokens: int = DEFAULT_ROUTING_PREFIX_TOKENS
    balance: float = DEFAULT_ROUTING_BALANCE
    memory: int = DEFAULT_ROUTING_MEMORY

    def __post_init__(self) -> None:
        if self.prefix_tokens < 1:
            raise ValueError(f"the routing prefix must be at least one token, not {self.prefix_tokens}")
        if self.balance < 1.0:
            raise ValueError(f"the routing balance must be at least 1.0 (the mean load), not {self.balance}")
        if self.memory < 0:
            raise ValueError(f"the routing memory cannot be negative, not {self.memory}")


@dataclass(frozen=True)
class FleetOptions:
    """What the frontend knows about its fleet beyond vLLM's own flags (from the entrypoint's command line)."""

    coordinator_address: str
    coordinator_front_publish_port: int
    coordinator_back_output_port: int
    coordinator_back_publish_port: int
    engine0_address: str | None = None  # MoE: where engine rank 0 binds its DP group port
    coord_store_port: int | None = None  # elastic EP: the startup's coordination store, beside engine 0
    liveness_interval_s: float = 1.0
    liveness_timeout_s: float = 30.0
    stall: StallPolicy = field(default_factory=StallPolicy)  # when a rank that ends no step is Stalled (`.progress`)
    routing: RoutingPolicy = DEFAULT_ROUTING
    affinity: AffinitySettings = field(default_factory=AffinitySettings)  # with routing prefix-affinity
    engine_input_port: int | None = None  # fixed ports of the engines' sockets (None: ephemeral)
    engine_output_port: int | None = None
    advertise_address: str | None = None  # what the engines connect to (None: --data-parallel-address)
    attach: bool = False  # re-attach to running engines (a replaced frontend) instead of the startup handshake
    attach_timeout_s: float = 60.0
    # Attaching: ranks left out (their replacement was in flight when the lost frontend went; the operator deleted
    # their new engines): they start Dead, ready for a replacement.
    detached: tuple[int, ...] = ()
    # K frontends (k-frontends design): the advertised host of every frontend by client index (empty: this one alone),
    # and this frontend's index. Frontend 0 runs the engines' handshake and advertises all K in INIT.
    frontend_addresses: tuple[str, ...] = ()
    client_index: int = 0

    @property
    def client_count(self) -> int:
        """How many frontends are vLLM's clients of every engine (1 unless `frontend_addresses` names more)."""
        return max(1, len(self.frontend_addresses))

    @property
    def follower(self) -> bool:
        """One of several frontends, not the first: it runs no handshake; engines announce themselves to it."""
        return self.client_index > 0


class ResizeRefused(Exception):
    """A resize request the fleet will not carry out: the HTTP status, why, and the operation in the way."""

    def __init__(self, status: HTTPStatus, message: str, operation: ResizeOperation | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.operation = operation


class ResizeFailed(Exception):
    """A resize operation stopped; `fleet_intact`: the fleet serves on as before (else it must be recreated)."""

    def __init__(self, message: str, *, fleet_intact: bool = True) -> None:
        super().__init__(message)
        self.fleet_intact = fleet_intact


class FollowerLost(Exception):
    """A follower did not carry out its part: its admin API did not answer (`reachable` False: it is gone, and its
    replacement attaches to the engines that run then), or it refused or failed its part (`reachable`)."""

    def __init__(self, message: str, *, reachable: bool = True) -> None:
        super().__init__(message)
        self.reachable = reachable


def pass_over(op: ResizeOperation, lost: dict[int, FollowerLost], refused: str, attaches: str) -> None:
    """Followers that cannot be reached are passed over: logged as lost (their replacements attach `attaches`); one
    that refused or failed its part stops the operation: ResizeFailed("`refused`: why")."""
    failed = [str(e) for e in lost.values() if e.reachable]
    if failed:
        raise ResizeFailed(f"{refused}: " + "; ".join(failed))
    for index, why in lost.items():
        logger.warning("Resize %s: frontend %d is passed over (%s): it is lost, and its replacement attaches %s",
                       op.id, index, why, attaches)


class Cancels:
    """The cancel requests of resize operations, by id: set from the admin API (through the event loop), read
    by the running operation at each of its checkpoints (`check`), dropped when it ends."""

    def __init__(self) -> None:
        self._reasons: dict[str, str] = {}

    def request(self, resize_id: str, reason: str) -> None:
        self._reasons.setdefault(resize_id, reason)

    def check(self, op: ResizeOperation) -> None:
        """Raise ResizeFailed if `op` was asked to stop."""
        reason = self._reasons.get(op.id)
        if reason is not None:
            raise ResizeFailed(f"cancelled: {reason}")

    def forget(self, resize_id: str) -> None:
        self._reasons.pop(resize_id, None)


class EngineClient(Protocol):
    """What the frontend's components read and change of vLLM's DPLB client: corefleet's subclass of it
    (`frontend.client.KubeDPLBClient`), as vLLM 0.32.0 defines these attributes (pinned by
    tests/e2e/test_vllm_pins.py). The routing tables are changed only through `membership.Membership`."""

    vllm_config: Any
    core_engines: list[bytes]  # the identities the router picks from (the fleet's ranks)
    lb_engines: list[list[int | float]]  # the coordinator's (waiting, running, kv) per rank, as the router reads it
    engine_ranks_managed: list[int]  # the ranks vLLM's stats task takes counts for
    engine_inflight: Any  # Counter: this client's unfinished requests per identity
    reqs_in_flight: dict[str, bytes]  # request id -> the identity it was sent to
    utility_results: dict[int, Any]  # call id -> the future vLLM's output task resolves with the answer
    outputs_queue: asyncio.Queue[Any]
    input_socket: Any  # the requests ROUTER
    first_req_send_socket: Any  # to vLLM's stats task
    encoder: Any
    client_index: int
    client_count: int  # vLLM's clients of every engine (the fleet's frontends)

    def _ensure_stats_update_task(self) -> None: ...

    def _ensure_output_queue_task(self) -> None: ...

    def _apply_ready_response(self, payload: bytes) -> None: ...
