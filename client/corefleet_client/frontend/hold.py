# SPDX-License-Identifier: Apache-2.0
"""Requests held while no rank of the fleet takes requests (`Hold`), instead of failing at once.

No rank takes requests while every rank is Dead, Unresponsive or leaving: a one-rank fleet whose engine is being
replaced in place, say. Before, every request then failed at once (503, "no rank of the fleet takes requests"). Now an
inference request (an HTTP POST to vLLM's API, except the tokenizer's routes, which need no engine) waits, before vLLM
reads it, until a rank takes requests again, and then goes on as any other:

* at most `HoldSettings.max_requests` wait at once; one more is answered at once;
* each waits at most `HoldSettings.timeout_s`;
* a request that cannot wait gets 503 with `Retry-After` and a message that says why no rank takes requests, in
  vLLM's error format (`refusal_body`): nothing is dropped silently.

It runs on vLLM's event loop (vllm_compat change 8 puts it in front of vLLM's app), and costs a request nothing more
than one check while some rank takes requests. `max_requests` 0 holds nothing (the request fails at once, as before).
The number waiting is exported (`corefleet_frontend_requests_waiting`): the signal an autoscaler can wake a fleet on.
"""

from __future__ import annotations

import asyncio
import enum
import json
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

DEFAULT_HOLD_REQUESTS = 256
DEFAULT_HOLD_TIMEOUT_S = 30.0
# How often a held request looks again whether a rank takes requests (ranks come back through several paths: a
# replacement's commit, a scale-up's, a rank answering again): a poll, only while requests wait.
POLL_S = 0.05
# vLLM's routes that need no engine: never held.
UNHELD_PATHS = frozenset({"/tokenize", "/detokenize"})


@dataclass(frozen=True)
class HoldSettings:
    """`--hold-requests`, `--hold-timeout`: see the module docstring."""

    max_requests: int = DEFAULT_HOLD_REQUESTS
    timeout_s: float = DEFAULT_HOLD_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_requests < 0:
            raise ValueError(f"the requests held cannot be negative, not {self.max_requests}")
        if self.timeout_s < 0:
            raise ValueError(f"the hold timeout cannot be negative, not {self.timeout_s}")

    @property
    def retry_after_s(self) -> int:
        """What a refused request's `Retry-After` says: a held request's whole wait (at least a second)."""
        return max(1, math.ceil(self.timeout_s))


class Refused(enum.StrEnum):
    """Why a request that found no rank taking requests was answered 503."""

    FULL = "full"  # `max_requests` were waiting already
    TIMEOUT = "timeout"  # no rank took requests within `timeout_s`


@dataclass(frozen=True)
class Refusal:
    reason: Refused
    message: str
    retry_after_s: int


@dataclass
class HoldCounts:
    waiting: int = 0
    held_total: int = 0  # requests that had to wait (served or refused)
    refused_total: dict[Refused, int] = field(default_factory=lambda: {r: 0 for r in Refused})


class Hold:
    """See the module docstring. `closed()`: None while some rank takes requests, else why none does."""

    def __init__(self, settings: HoldSettings, closed: Callable[[], str | None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.closed = closed
        self._clock = clock
        self.counts = HoldCounts()

    async def admit(self) -> Refusal | None:
        """None once a rank takes requests (at once, in the common case); the refusal where the request cannot
        wait for one."""
        why = self.closed()
        if why is None:
            return None
        counts, settings = self.counts, self.settings
        if settings.max_requests == 0:
            return self._refuse(Refused.FULL, f"no rank of the fleet takes requests: {why}")
        if counts.waiting >= settings.max_requests:
            return self._refuse(Refused.FULL, f"no rank of the fleet takes requests ({why}), and "
                                f"{counts.waiting} request(s) already wait for one, the limit")
        counts.waiting += 1
        counts.held_total += 1
        deadline = self._clock() + settings.timeout_s
        try:
            while True:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return self._refuse(Refused.TIMEOUT, f"no rank of the fleet took requests within "
                                        f"{settings.timeout_s:g}s ({why})")
                await asyncio.sleep(min(POLL_S, remaining))
                now_why = self.closed()
                if now_why is None:
                    return None
                why = now_why
        finally:
            counts.waiting -= 1

    def _refuse(self, reason: Refused, message: str) -> Refusal:
        self.counts.refused_total[reason] += 1
        return Refusal(reason, message, self.settings.retry_after_s)


def held_request(method: str, path: str) -> bool:
    """Whether an HTTP request to vLLM's API is one a closed fleet holds: one that needs an engine."""
    return method == "POST" and path not in UNHELD_PATHS


def refusal_body(refusal: Refusal) -> bytes:
    """The 503's body, in vLLM's error format (`ErrorResponse`: message, type, param, code)."""
    status = HTTPStatus.SERVICE_UNAVAILABLE
    return json.dumps({"error": {"message": refusal.message, "type": status.phrase, "param": None,
                                 "code": status.value}}).encode()


Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class HoldMiddleware:
    """The hold in front of vLLM's app (an ASGI middleware, around the app's middleware stack: `serve.hold_requests`).
    A request it admits reaches the app untouched (its body is not read here)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], hold: Hold) -> None:
        self.app = app
        self.hold = hold

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The common case costs one check: some rank takes requests.
        if scope["type"] == "http" and self.hold.closed() is not None and held_request(scope["method"], scope["path"]):
            refusal = await self.hold.admit()
            if refusal is not None:
                body = refusal_body(refusal)
                await send({"type": "http.response.start", "status": HTTPStatus.SERVICE_UNAVAILABLE.value,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode()),
                                        (b"retry-after", str(refusal.retry_after_s).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
