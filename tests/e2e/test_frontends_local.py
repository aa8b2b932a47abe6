# SPDX-License-Identifier: Apache-2.0
"""Two frontends over the same real vLLM engines, in local mode (`corefleet up --frontends 2`).

Each frontend is one of vLLM's clients of every engine (its own sockets, its client index) and they share the
OpenAI API's port (`SO_REUSEPORT`: the kernel spreads connections over them), as K frontend pods share the
fleet's Service. On 2 real vLLM engines, frontend 1 SIGKILLed under load (the supervisor `corefleet up
--detach` leaves running replaces it in place, `--attach` with its client index): only requests that were on
it fail, the endpoint keeps answering through frontend 0, and the replacement takes traffic again; the
engines' processes are untouched. A killed engine is replaced in place through both frontends: frontend 0 runs
the new engine's handshake and drives frontend 1 through its part (it reads the new engine's ready response and
routes to it at frontend 0's commit); the other engine and both frontends keep their processes, and requests
pinned to the other rank never fail. Prefix-affinity routing without shared state: the turns of a conversation,
taken by either frontend, go to one rank and hit the prefix cache the previous turn built there, and a replaced
frontend, whose routing memory died with it, sends them there too.

Resizes with two frontends (frontend 0 drives every frontend through each) are tested through the operator
on the real node (tests/e2e/test_node_fleet.py), with the same client code. Heavy (real vLLM, 2 engines): on
shared machines run the e2e tier under `flock /tmp/corefleet-heavy.lock`.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from corefleet_client.admin import (
    AdminClient,
    AdminError,
    FleetState,
    RankState,
    RankStatus,
    ResizePhase,
    ResizeRequest,
)
from corefleet_harness import local
from corefleet_harness.support import http_get, wait_until
from corefleet_harness.tinymodel import write_tiny_model
from fleettest import Load
from localfleet import MODEL_NAME, Fleet, Held, engine_pids, flags, start, supervised

pytestmark = pytest.mark.e2e

REPLICAS = 2
FRONTENDS = 2
JOIN_TIMEOUT = 300.0  # a new real vLLM engine on 2 busy cores
CONTEXT = 1024
WORKERS = 4  # clients, each with one request at a time: enough connections for the kernel to use both frontends
# Each request's cached prompt tokens in its usage (vLLM's prompt_tokens_details): the prefix cache's answer to it.
FLAGS = (*flags(CONTEXT), "--enable-prompt-tokens-details")


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Held]:
    tmp = tmp_path_factory.mktemp("frontends")
    model = str(write_tiny_model(tmp / "tiny", context=CONTEXT))
    h = Held(tmp, REPLICAS, lambda d: start(d, local.ENGINE_VLLM, REPLICAS, model, FLAGS,
                                            max_tokens_long=CONTEXT - 64, token_delay_ms=None, ready_timeout=600,
                                            liveness_timeout=8, frontends=FRONTENDS))
    yield h
    h.close()


@pytest.fixture
def fleet(held: Held) -> Fleet:
    return held.get()


def admins(fleet: Fleet) -> list[AdminClient]:
    """Every frontend's admin API, by client index."""
    rec = fleet.rec
    token = Path(rec.token_file).read_text().strip()
    return [AdminClient(rec.frontend_admin_url(i), token, timeout=10) for i in range(rec.frontends)]


def served(admin: AdminClient) -> dict[int, int]:
    """Requests this frontend sent to each rank it knows."""
    return {r.rank: r.requests_total for r in admin.fleet().ranks}


def group_runs(pgid: int) -> bool:
    """Whether any thread of any process in the process group still runs (is neither a zombie nor dead)."""
    for st in local.all_procs():
        if st.pgrp != pgid:
            continue
        try:
            tids = os.listdir(f"/proc/{st.pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                stat = Path(f"/proc/{st.pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            if stat[stat.rindex(")") + 2:].split()[0] not in ("Z", "X"):
                return True
    return False


@dataclass(frozen=True)
class Turn:
    frontend: int  # the client index of the frontend that routed it
    rank: int
    decision: str  # the prefix-affinity decision counted for it: "new", "affinity" or "spill"
    prompt: int  # prompt tokens
    cached: int  # prompt tokens the rank's prefix cache served


@dataclass
class Chat:
    prompt: list[int]
    turns: list[Turn] = field(default_factory=list)


COUNTS = {"requests_total": "", "new_prefix_total": "new", "affinity_total": "affinity", "spilled_total": "spill"}
KEY_BLOCKS = 2  # the routing key: --routing-prefix-tokens (256) in vLLM's CPU blocks of 128
QUESTION = 30  # tokens each turn adds after the reply's 4: up to 20 turns fit the context


def routing_counts(admin: AdminClient) -> dict[tuple[int, str], int]:
    return {(r.rank, name): getattr(r, name) for r in admin.fleet().ranks for name in COUNTS}


class Chats:
    """Multi-turn conversations through the fleet's shared port, one request at a time, each over a new
    connection (the kernel picks the frontend): each turn's prompt is the whole conversation so far (the prompt,
    the reply's tokens, a new question). Which frontend routed a turn, to which rank and why, is read from the
    frontends' counters around it; the cached tokens from its usage."""

    def __init__(self, fleet: Fleet, admins: list[AdminClient]) -> None:
        self.fleet, self.admins = fleet, admins
        status, body = http_get(f"{fleet.url}/metrics", timeout=30)
        found = re.search(r'vllm:cache_config_info{[^}]*block_size="(\d+)"', body.decode())
        assert status == 200
        assert found is not None, body[:2000]
        self.block = int(found.group(1))
        self.rng = random.Random(time.time_ns())  # openings no earlier request had
        self.chats: list[Chat] = []

    def new(self) -> Chat:
        """A conversation: every other one opens shorter than the routing key (one block and a bit, the key covered
        from its third turn on), the others longer."""
        short = len(self.chats) % 2 == 1
        chat = Chat([self.rng.randrange(3, 512) for _ in range(
            self.block + 60 if short else KEY_BLOCKS * self.block + 40)])
        self.chats.append(chat)
        return chat

    def quiet(self) -> None:
        """Until no frontend counts any load on any rank (the coordinator's counts caught up): a new prefix then goes
        to its key's first rank on every frontend, so where a turn goes depends on its prompt alone."""
        def idle(r: RankStatus) -> bool:
            return r.waiting == r.running == r.in_flight == 0

        wait_until(lambda: all(idle(r) for a in self.admins for r in a.fleet().ranks), 30, "no load on any rank",
                   interval=0.02)

    def turn(self, chat: Chat) -> Turn:
        assert len(chat.prompt) + 4 <= CONTEXT, chat.turns
        self.quiet()
        before = [routing_counts(a) for a in self.admins]
        body = {"model": MODEL_NAME, "prompt": chat.prompt, "max_tokens": 4, "ignore_eos": True,
                "return_token_ids": True}
        req = urllib.request.Request(f"{self.fleet.url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            out: dict[str, Any] = json.loads(r.read())
        moved = [(i, rank, name) for i, a in enumerate(self.admins) for (rank, name), n in routing_counts(a).items()
                 if n != before[i][(rank, name)]]
        [(frontend, rank, _)] = [m for m in moved if m[2] == "requests_total"]
        [decision] = [COUNTS[name] for i, r, name in moved if name != "requests_total"]
        assert all((i, r) == (frontend, rank) for i, r, _ in moved), moved
        usage = out["usage"]
        done = Turn(frontend, rank, decision, usage["prompt_tokens"],
                    (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        chat.turns.append(done)
        reply: list[int] = out["choices"][0]["token_ids"]
        chat.prompt = [*chat.prompt, *reply, *(self.rng.randrange(3, 512) for _ in range(QUESTION))]
        return done

    def keyed(self, chat: Chat) -> list[Turn]:
        """The conversation's turns whose prompt covers the routing key."""
        return [t for t in chat.turns if t.prompt >= KEY_BLOCKS * self.block]

    def check(self, chat: Chat) -> None:
        """The turns shorter than the key on one rank, and those that cover it on one rank, whichever frontend took
        each; a turn on the rank of the one before got at least that one's full blocks from the prefix cache."""
        keyed = self.keyed(chat)
        short = chat.turns[:len(chat.turns) - len(keyed)]
        assert len({t.rank for t in short}) <= 1, chat.turns
        assert len({t.rank for t in keyed}) <= 1, chat.turns
        for before, now in itertools.pairwise(chat.turns):
            if before.rank == now.rank:
                assert now.cached >= before.prompt // self.block * self.block, chat.turns

    def describe(self) -> str:
        return "; ".join(" ".join(f"f{t.frontend}>r{t.rank}:{t.decision}:{t.cached}/{t.prompt}" for t in c.turns)
                         for c in self.chats)


def test_either_frontend_sends_a_conversations_turns_to_one_rank_whose_prefix_cache_serves_them(fleet: Fleet) -> None:
    """Prefix affinity with two frontends and no shared state: each turn of a conversation reaches whichever frontend
    the kernel gives its connection. Every turn that covers the routing key goes to one rank, taken by both
    frontends, and that rank's prefix cache serves the previous turn (a conversation that opens shorter than the key
    is placed by the key once it covers it: one turn's miss)."""
    chats = Chats(fleet, admins(fleet))
    mixed = 0  # conversations whose keyed turns both frontends took
    while mixed < 3:
        assert len(chats.chats) < 10, f"the kernel gave most conversations' turns to one frontend: {chats.describe()}"
        chat = chats.new()
        for _ in range(6):
            chats.turn(chat)
        chats.check(chat)
        # A frontend that had not routed the conversation placed it as a new prefix by its key, one that had continued
        # it from memory: both reached the same rank.
        assert {t.decision for t in chat.turns} <= {"new", "affinity"}, chat.turns
        mixed += {t.frontend for t in chats.keyed(chat)} == {0, 1}
    assert any(len(chats.keyed(c)) < len(c.turns) for c in chats.chats)  # a short opening crossed the key
    print(f"conversations through 2 frontends: {chats.describe()}")


def test_a_killed_frontend_fails_only_its_requests_and_its_replacement_takes_traffic_again(fleet: Fleet) -> None:
    state = Path(fleet.rec.state_dir)
    engines = engine_pids(state)
    lead, follower = admins(fleet)
    # Conversations placed before the kill (two turns each): the replacement's routing memory starts empty.
    chats = Chats(fleet, [lead, follower])
    for _ in range(2):
        chat = chats.new()
        chats.turn(chat)
        chats.turn(chat)
    with supervised(fleet):
        victim = next(p for p in fleet.rec.processes if p.role == local.ROLE_FRONTEND and p.rank == 1)
        load = Load(fleet.url, MODEL_NAME, workers=WORKERS, max_tokens=32, pause_s=0.05).start()
        try:
            wait_until(lambda: sum(served(follower).values()) > 0 and len([o for o in load.outcomes if o.ok]) >= 8,
                       120, "frontend 1 taking traffic")
            os.kill(victim.pid, signal.SIGKILL)
            # Gone once no thread of its process group runs: a killed process's main thread turns zombie before its
            # other threads exit, and the last one closes its files; until then its listening socket stays in the
            # kernel's SO_REUSEPORT group of the shared port, and the connections the kernel gives it are reset.
            wait_until(lambda: not group_runs(victim.pid), 30, "frontend 1's threads gone", interval=0.005)
            dead_at = time.monotonic()
            lead_before = sum(served(lead).values())

            def replaced() -> bool:
                latest = local.load_record(state)
                assert latest is not None
                new = next(p for p in latest.processes if p.role == local.ROLE_FRONTEND and p.rank == 1)
                if new.pid == victim.pid or not local.owns(latest, new):
                    return False
                try:
                    status = follower.fleet()
                except (OSError, AdminError, ValueError):
                    return False
                return status.state == FleetState.SERVING and [(r.rank, r.state) for r in status.ranks] == [
                    (r, RankState.SERVING) for r in range(REPLICAS)]

            wait_until(replaced, 300, "frontend 1 replaced and serving", interval=0.2)
            back = time.monotonic()
            # The endpoint answered through frontend 0 meanwhile, and the replacement takes traffic again.
            assert sum(served(lead).values()) > lead_before
            assert len([o for o in load.outcomes if o.ok and dead_at < o.started < back]) > 0, load.summary()
            wait_until(lambda: sum(served(follower).values()) >= 4, 120,
                       "the replacement frontend 1 serving requests")
        finally:
            load.stop()
    # Only what was on frontend 1 when it died failed: at most one request per client, each sent before it died.
    failed = load.failures()
    assert len(failed) <= WORKERS, load.summary()
    assert all(o.started < dead_at for o in failed), [(o.started - dead_at, o.detail) for o in failed]
    assert engine_pids(state) == engines
    for r in range(REPLICAS):  # each engine re-announced itself to frontend 1 and aborted what it had left
        log = (state / local.LOG_DIR / f"engine-{r}.log").read_text(errors="replace")
        assert "Frontend 1 re-attached: aborted the" in log, log[-3000:]
    # The new frontend 1 knows none of the conversations, yet sends their next turns where they were, and the prefix
    # cache there serves them.
    for chat in chats.chats:
        before = len(chat.turns)
        while not [t for t in chat.turns[before:] if t.frontend == 1]:
            assert len(chat.turns) < 20, f"the kernel gave every turn to frontend 0: {chats.describe()}"
            chats.turn(chat)
        chats.check(chat)
        assert next(t for t in chat.turns[before:] if t.frontend == 1).decision == "new", chats.describe()
    print(f"conversations before and after frontend 1's replacement: {chats.describe()}")
    print(f"frontend 1 killed: serving again after {back - dead_at:.1f} s; {load.summary()}")


def test_a_killed_engine_is_replaced_in_place_through_both_frontends(fleet: Fleet) -> None:
    frontends = {i: fleet.pid(local.ROLE_FRONTEND, i if i else None) for i in range(FRONTENDS)}
    engine0 = fleet.engine_pid(0)
    lead, follower = admins(fleet)
    pinned = Load(fleet.url, MODEL_NAME, workers=WORKERS, max_tokens=16, pause_s=0.05,
                  headers={"X-data-parallel-rank": "0"}).start()
    try:
        wait_until(lambda: len([o for o in pinned.outcomes if o.ok]) >= 8, 120, "rank 0's load to get going")
        fleet.kill_engine(1)
        wait_until(lambda: all(a.fleet().rank(1).state == RankState.DEAD for a in (lead, follower)), 30,
                   "rank 1 Dead on both frontends", interval=0.1)
        new_pid = fleet.restart_engine(1)
        started, op = lead.start_resize(ResizeRequest(id="replace-1", replicas=REPLICAS, replace=(1,),
                                                      join_timeout_s=JOIN_TIMEOUT))
        assert started
        assert op.replace == (1,)
        done = wait_until(lambda: (o := lead.resize("replace-1")) is not None and o.phase.terminal and o,
                          JOIN_TIMEOUT + 60, "the replacement to end", interval=0.2)
        assert (done.phase, done.error) == (ResizePhase.COMPLETED, ""), done
        part = follower.resize("replace-1")
        assert part is not None
        assert (part.follower, part.replace, part.phase) == (True, (1,), ResizePhase.COMPLETED), part
    finally:
        pinned.stop()
    assert not pinned.failures(), pinned.summary()  # rank 0 served throughout, through both frontends
    for admin in (lead, follower):
        status = admin.fleet()
        assert (status.state, [r.state for r in status.ranks]) == (FleetState.SERVING, [RankState.SERVING] * 2)
    # Both frontends route to the new engine: requests pinned to rank 1 over new connections (the kernel spreads
    # them over both frontends) until each frontend sent some.
    before = {i: served(a).get(1, 0) for i, a in enumerate((lead, follower))}
    on_new = Load(fleet.url, MODEL_NAME, workers=WORKERS, max_tokens=8, pause_s=0.05,
                  headers={"X-data-parallel-rank": "1"}).start()
    try:
        wait_until(lambda: all(served(a).get(1, 0) > before[i] for i, a in enumerate((lead, follower))), 120,
                   "both frontends sending requests to the new rank 1")
    finally:
        on_new.stop()
    assert not on_new.failures(), on_new.summary()
    assert fleet.engine_pid(0) == engine0
    assert fleet.engine_pid(1) == new_pid
    assert {i: fleet.pid(local.ROLE_FRONTEND, i if i else None) for i in range(FRONTENDS)} == frontends
    print(f"rank 1 replaced in place through 2 frontends; rank 0's load: {pinned.summary()}; "
          f"rank 1's after: {on_new.summary()}")
