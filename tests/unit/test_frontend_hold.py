# SPDX-License-Identifier: Apache-2.0
"""Requests held while no rank takes requests (`frontend.hold`): admitted at once while a rank takes requests, held
until one does, refused with 503 + Retry-After past the wait limit or the timeout, and the ASGI middleware that puts
the hold in front of vLLM's app."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from corefleet_client.frontend.hold import (
    Hold,
    HoldMiddleware,
    HoldSettings,
    Refused,
    held_request,
)
from corefleet_client.frontend.metrics import hold_families

DEAD = "rank 0 is Dead: its engine exited"


class Gate:
    """`closed()` for the hold: closed (with DEAD) until `open_after` calls, then open."""

    def __init__(self, open_after: int | None) -> None:
        self.open_after = open_after
        self.calls = 0

    def __call__(self) -> str | None:
        self.calls += 1
        return None if self.open_after is not None and self.calls > self.open_after else DEAD


def test_a_request_is_admitted_at_once_while_a_rank_takes_requests() -> None:
    gate = Gate(open_after=0)
    hold = Hold(HoldSettings(max_requests=1, timeout_s=0.0), gate)
    assert asyncio.run(hold.admit()) is None
    assert gate.calls == 1
    assert (hold.counts.waiting, hold.counts.held_total) == (0, 0)


def test_a_held_request_goes_on_once_a_rank_takes_requests() -> None:
    gate = Gate(open_after=3)
    hold = Hold(HoldSettings(max_requests=4, timeout_s=30.0), gate)

    async def run() -> Any:
        admitted = asyncio.create_task(hold.admit())
        await asyncio.sleep(0)
        assert hold.counts.waiting == 1  # counted while it waits
        return await admitted

    assert asyncio.run(run()) is None
    assert gate.calls == 4
    assert (hold.counts.waiting, hold.counts.held_total) == (0, 1)
    assert hold.counts.refused_total == {Refused.FULL: 0, Refused.TIMEOUT: 0}


def test_a_request_held_past_the_timeout_is_refused_with_the_reason_and_retry_after() -> None:
    hold = Hold(HoldSettings(max_requests=4, timeout_s=0.12), Gate(open_after=None))
    refusal = asyncio.run(hold.admit())
    assert refusal is not None
    assert refusal.reason == Refused.TIMEOUT
    assert refusal.message == f"no rank of the fleet took requests within 0.12s ({DEAD})"
    assert refusal.retry_after_s == 1  # at least a second
    assert (hold.counts.waiting, hold.counts.held_total) == (0, 1)
    assert hold.counts.refused_total[Refused.TIMEOUT] == 1


def test_past_the_limit_a_request_is_refused_at_once_and_the_ones_waiting_stay() -> None:
    gate = Gate(open_after=None)
    hold = Hold(HoldSettings(max_requests=2, timeout_s=30.0), gate)

    async def run() -> tuple[Any, list[Any]]:
        waiting = [asyncio.create_task(hold.admit()) for _ in range(2)]
        await asyncio.sleep(0)
        assert hold.counts.waiting == 2
        refused = await hold.admit()
        gate.open_after = gate.calls  # a rank takes requests again: the two waiting go on
        return refused, await asyncio.gather(*waiting)

    refused, admitted = asyncio.run(run())
    assert refused is not None
    assert refused.reason == Refused.FULL
    assert refused.message == f"no rank of the fleet takes requests ({DEAD}), and 2 request(s) already wait for " \
                              "one, the limit"
    assert refused.retry_after_s == 30
    assert admitted == [None, None]
    assert (hold.counts.waiting, hold.counts.held_total) == (0, 2)
    assert hold.counts.refused_total == {Refused.FULL: 1, Refused.TIMEOUT: 0}


def test_with_no_hold_a_request_fails_at_once_as_before() -> None:
    refusal = asyncio.run(Hold(HoldSettings(max_requests=0), Gate(open_after=None)).admit())
    assert refusal is not None
    assert (refusal.reason, refusal.message) == (Refused.FULL, f"no rank of the fleet takes requests: {DEAD}")


@pytest.mark.parametrize("settings", [dict(max_requests=-1), dict(timeout_s=-0.5)])
def test_negative_settings_are_refused(settings: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="cannot be negative"):
        HoldSettings(**settings)


def test_only_requests_that_need_an_engine_are_held() -> None:
    assert held_request("POST", "/v1/completions")
    assert held_request("POST", "/v1/chat/completions")
    assert not held_request("GET", "/v1/models")
    assert not held_request("GET", "/health")
    assert not held_request("POST", "/tokenize")
    assert not held_request("POST", "/detokenize")


class App:
    """vLLM's app, as the middleware sees it: records what reached it."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def call(middleware: HoldMiddleware, method: str, path: str) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        raise AssertionError("the middleware never reads a request's body")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(middleware({"type": "http", "method": method, "path": path}, receive, send))
    return sent


def test_the_middleware_answers_a_refused_request_with_503_retry_after_and_vllms_error_format() -> None:
    app = App()
    middleware = HoldMiddleware(app, Hold(HoldSettings(max_requests=0, timeout_s=7.5), Gate(open_after=None)))
    start, body = call(middleware, "POST", "/v1/chat/completions")
    assert app.seen == []
    assert start["status"] == 503
    headers = dict(start["headers"])
    assert headers[b"retry-after"] == b"8"
    assert headers[b"content-type"] == b"application/json"
    assert int(headers[b"content-length"]) == len(body["body"])
    assert json.loads(body["body"]) == {"error": {"message": f"no rank of the fleet takes requests: {DEAD}",
                                                  "type": "Service Unavailable", "param": None, "code": 503}}
    # What needs no engine reaches the app while the fleet is closed.
    assert call(middleware, "GET", "/v1/models")[0]["status"] == 200
    assert call(middleware, "POST", "/tokenize")[0]["status"] == 200
    assert app.seen == ["/v1/models", "/tokenize"]


def test_the_middleware_hands_an_admitted_request_to_the_app_untouched() -> None:
    app = App()
    gate = Gate(open_after=0)
    sent = call(HoldMiddleware(app, Hold(HoldSettings(), gate)), "POST", "/v1/completions")
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 200
    assert app.seen == ["/v1/completions"]


def test_the_hold_is_exported_waiting_held_and_refused_by_reason() -> None:
    hold = Hold(HoldSettings(max_requests=0), Gate(open_after=None))
    asyncio.run(hold.admit())
    hold.counts.waiting, hold.counts.held_total = 3, 5
    samples = {(s.name, tuple(s.labels.items())): s.value for family in hold_families(hold.counts)
               for s in family.samples}
    assert samples == {
        ("corefleet_frontend_requests_waiting", ()): 3,
        ("corefleet_frontend_requests_held_total", ()): 5,
        ("corefleet_frontend_requests_hold_refused_total", (("reason", "full"),)): 1,
        ("corefleet_frontend_requests_hold_refused_total", (("reason", "timeout"),)): 0,
    }


@pytest.mark.parametrize(("serving", "idle", "healthy"), [(True, False, True), (False, True, True),
                                                           (False, False, False)])
def test_health_is_503_while_no_rank_serves_unless_ranks_are_on_their_way(serving: bool, idle: bool,
                                                                           healthy: bool) -> None:
    """An idle fleet's endpoint answers (requests wait at the hold for its wake): idle, not broken; so does one whose
    ranks a replacement gives new engines (`Fleet.awaits_ranks`)."""
    from types import SimpleNamespace

    from vllm.v1.engine.exceptions import EngineDeadError

    from corefleet_client.frontend.client import KubeDPLBClient

    client = SimpleNamespace(_members=SimpleNamespace(any_serving=lambda: serving,
                                                      fleet=SimpleNamespace(awaits_ranks=lambda: idle)))
    if healthy:
        KubeDPLBClient.check_fleet_health(client)  # type: ignore[arg-type]
    else:
        with pytest.raises(EngineDeadError):
            KubeDPLBClient.check_fleet_health(client)  # type: ignore[arg-type]

