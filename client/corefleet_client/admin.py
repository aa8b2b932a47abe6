# SPDX-License-Identifier: Apache-2.0
"""The frontend's admin API contract: paths, authentication and the request/response types.

The frontend serves it (`corefleet_client.frontend`); the operator and `corefleet status` call
it. This module uses only the standard library, so the operator can import it without vLLM,
torch or ZeroMQ (import-linter checks that the operator never imports those).

Every request carries `Authorization: Bearer <token>`; the token is the admin Secret's value,
mounted as a file in the frontend pod. A request without it, or with another token, gets 401.

    GET /v1/fleet   -> FleetStatus (JSON)
    GET /healthz    -> 200 once the admin server runs (no token: for probes)
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

API_PREFIX = "/v1"
FLEET_PATH = f"{API_PREFIX}/fleet"
HEALTH_PATH = "/healthz"

AUTH_HEADER = "Authorization"
BEARER = "Bearer "
# Where the frontend reads its token when no file is given (local mode, tests).
ENV_ADMIN_TOKEN = "COREFLEET_ADMIN_TOKEN"
ENV_ADMIN_TOKEN_FILE = "COREFLEET_ADMIN_TOKEN_FILE"


class RankState(enum.StrEnum):
    JOINING = "Joining"  # expected, has not completed the handshake
    SERVING = "Serving"  # handshake done, takes requests
    DEAD = "Dead"  # its process went away or stopped answering; takes no requests


class FleetState(enum.StrEnum):
    STARTING = "Starting"  # waiting for engines to join
    SERVING = "Serving"  # every rank serving
    DEGRADED = "Degraded"  # at least one rank dead: /health is 503, the fleet must be recreated


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
    failed_total: int = 0  # requests ended with an error because the rank died
    message: str = ""


@dataclass(frozen=True)
class FleetStatus:
    state: FleetState
    model: str
    data_parallel_size: int
    vllm_version: str
    ranks: tuple[RankStatus, ...] = field(default_factory=tuple)
    message: str = ""

    def rank(self, rank: int) -> RankStatus:
        for r in self.ranks:
            if r.rank == rank:
                return r
        raise KeyError(rank)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FleetStatus:
        ranks = tuple(RankStatus(**{**r, "state": RankState(r["state"])}) for r in data.get("ranks", ()))
        return cls(
            state=FleetState(data["state"]),
            model=data["model"],
            data_parallel_size=int(data["data_parallel_size"]),
            vllm_version=data["vllm_version"],
            ranks=ranks,
            message=data.get("message", ""),
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


class AdminClient:
    """A small blocking client (urllib) for the operator and the `corefleet` command."""

    def __init__(self, base_url: str, token: str, timeout: float = 5.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def _get(self, path: str) -> dict[str, Any]:
        req = urllib.request.Request(self.base_url + path, headers={AUTH_HEADER: BEARER + self.token})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                data: dict[str, Any] = json.loads(resp.read())
                return data
        except urllib.error.HTTPError as e:
            raise AdminError(e.code, e.read().decode(errors="replace")) from None

    def fleet(self) -> FleetStatus:
        return FleetStatus.from_json(self._get(FLEET_PATH))
