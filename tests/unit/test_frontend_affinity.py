# SPDX-License-Identifier: Apache-2.0
"""Prefix-affinity routing (`frontend.affinity`): the key, rendezvous order, bounded loads, continuations."""

from __future__ import annotations

import random

import pytest

from corefleet_client.frontend.affinity import PrefixAffinity, block_hashes, capacity, rendezvous
from corefleet_client.frontend.types import AffinitySettings, Decision

BLOCK = 4


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(length)]


def router(prefix_tokens: int = 8, balance: float = 1.25) -> PrefixAffinity:
    return PrefixAffinity(AffinitySettings(prefix_tokens=prefix_tokens, balance=balance), BLOCK)


IDLE = {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}


def test_block_hashes_cover_full_blocks_only_and_chain() -> None:
    tokens = prompt(1, 10)
    hashes = block_hashes(tokens, BLOCK)
    assert len(hashes) == 2
    assert block_hashes(tokens[:8], BLOCK) == hashes
    assert block_hashes(tokens[:4] + [t + 1 for t in tokens[4:8]], BLOCK)[0] == hashes[0]
    assert block_hashes(tokens[:4] + [t + 1 for t in tokens[4:8]], BLOCK)[1] != hashes[1]
    assert block_hashes([1, *tokens[1:8]], BLOCK)[1] != hashes[1]  # chained: the second covers the first
    assert block_hashes(tokens[:3], BLOCK) == []


def test_a_prompt_without_a_full_block_is_left_to_the_load_balancer() -> None:
    assert router().choose(prompt(1, BLOCK - 1), IDLE) is None
    assert router().choose(None, IDLE) is None
    assert router().choose(prompt(1, 20), {}) is None


def test_prompts_sharing_the_key_prefix_go_to_one_rank_on_every_frontend() -> None:
    one, two = router(), router()  # two frontends: no shared state
    system = prompt(7, 8)  # the key: the first 8 tokens (2 blocks)
    first = rendezvous(block_hashes(system, BLOCK)[-1], IDLE)[0]
    assert one.choose(system + prompt(0, 30), IDLE) == (first, Decision.NEW)
    assert {one.choose(system + prompt(q, 30), IDLE) for q in range(1, 20)} == {(first, Decision.AFFINITY)}
    assert two.choose(system + prompt(100, 5), IDLE) == (first, Decision.NEW)  # the other frontend agrees


def test_a_new_prefix_goes_to_its_first_rank_unless_that_has_more_than_one_request_over_the_least_loaded() -> None:
    tokens = prompt(4, 12)
    first, second, _, _ = rendezvous(block_hashes(tokens, BLOCK)[1], IDLE)
    loads = dict.fromkeys(IDLE, 1.0)
    assert router().choose(tokens, {**loads, first: 2.0}) == (first, Decision.NEW)
    assert router().choose(tokens, {**loads, first: 3.0}) == (second, Decision.NEW)
    # With two frontends a request counts twice until the coordinator's next counts: one request of slack is two.
    assert router().choose(tokens, {**loads, first: 3.0}, slack=2.0) == (first, Decision.NEW)
    assert router().choose(tokens, {**loads, first: 4.0}, slack=2.0) == (second, Decision.NEW)
    # Random prompts: spread as by load, within one request of it.
    r = router()
    loads = dict.fromkeys(IDLE, 0.0)
    for seed in range(200):
        choice = r.choose(prompt(1000 + seed, 12), loads)
        assert choice is not None
        assert choice[1] == Decision.NEW
        loads[choice[0]] += 1
        assert max(loads.values()) - min(loads.values()) <= 2


def test_different_prefixes_spread_over_the_ranks() -> None:
    counts = {rank: 0 for rank in IDLE}
    for seed in range(400):
        choice = router().choose(prompt(seed, 12), IDLE)
        assert choice is not None
        counts[choice[0]] += 1
    assert all(60 <= n <= 140 for n in counts.values()), counts


def test_a_rank_joining_takes_only_its_share_of_keys_and_one_leaving_gives_only_its_own() -> None:
    keys = [block_hashes(prompt(seed, 8), BLOCK)[-1] for seed in range(1000)]
    before = {key: rendezvous(key, range(4))[0] for key in keys}
    grown = {key: rendezvous(key, range(5))[0] for key in keys}
    moved = [key for key in keys if grown[key] != before[key]]
    assert all(grown[key] == 4 for key in moved)
    assert 130 <= len(moved) <= 270  # about 1/5
    shrunk = {key: rendezvous(key, [0, 1, 3])[0] for key in keys}
    assert all(shrunk[key] == before[key] for key in keys if before[key] != 2)


def test_a_rank_over_the_load_bound_spills_in_the_prefixs_order() -> None:
    tokens = prompt(3, 16)
    key = block_hashes(tokens, BLOCK)[1]
    first, second, third, _ = rendezvous(key, IDLE)

    def held() -> PrefixAffinity:  # a frontend that routed the prefix to its first rank
        r = router(balance=balance)
        assert r.choose(tokens, IDLE) == (first, Decision.NEW)
        return r

    balance = 1.25
    loads = {rank: 1.0 for rank in IDLE}
    loads[first] = 2.0  # total 5: the bound is ceil(1.25 * 6 / 4) = 2, so the first choice is full
    assert capacity(loads, 1.25) == 2
    assert held().choose(tokens, loads) == (second, Decision.SPILL)
    # Total 8: the bound is ceil(1.25 * 9 / 4) = 3; the first two are full.
    assert held().choose(tokens, {**loads, first: 3.0, second: 3.0}) == (third, Decision.SPILL)
    # A higher balance keeps it on its rank.
    balance = 2.0
    assert held().choose(tokens, loads) == (first, Decision.AFFINITY)


def test_a_hot_prefix_spreads_as_its_load_needs_and_no_rank_runs_past_the_bound() -> None:
    hot = prompt(5, 16)  # every request shares one prefix
    r = router()
    loads = dict.fromkeys(IDLE, 0.0)
    for n in range(200):
        choice = r.choose(hot + prompt(n, 4), loads)
        assert choice is not None
        loads[choice[0]] += 1
        assert max(loads.values()) <= 1.25 * sum(loads.values()) / len(loads) + 1
    assert min(loads.values()) > 0  # every rank took some: 1.25 x the mean on three leaves the rest to the fourth


def test_the_next_turn_of_a_conversation_goes_where_the_last_went_even_past_a_shared_system_prompt() -> None:
    system = prompt(9, 8)  # shared by every conversation: the key of them all
    r = router()
    loads = dict.fromkeys(IDLE, 0.0)
    turns: dict[int, list[int]] = {}
    first_ranks: dict[int, int] = {}
    for conv in range(12):  # concurrent conversations fill the key's first rank: later ones spill
        turns[conv] = system + prompt(1000 + conv, 6)
        choice = r.choose(turns[conv], loads)
        assert choice is not None
        first_ranks[conv] = choice[0]
        loads[choice[0]] += 1
    assert len(set(first_ranks.values())) > 1  # they spread over the ranks
    for conv in range(12):  # each conversation's next turn: the whole conversation so far plus more
        loads[first_ranks[conv]] -= 1  # its last turn finished
        turns[conv] = turns[conv] + prompt(2000 + conv, 9)
        choice = r.choose(turns[conv], loads)
        assert choice == (first_ranks[conv], Decision.AFFINITY)
        loads[choice[0]] += 1


def conversations(count: int, turns: int) -> list[list[list[int]]]:
    """Each conversation's prompts, turn by turn (each the whole conversation so far): half of them open with a
    prompt of one block, shorter than the key (2 blocks), the other half with one longer than the key."""
    out = []
    for conv in range(count):
        prompts = [prompt(3000 + conv, BLOCK + 2 if conv % 2 else 3 * BLOCK)]
        for turn in range(1, turns):
            prompts.append(prompts[-1] + prompt(4000 + 100 * conv + turn, 5))
        out.append(prompts)
    return out


def test_two_frontends_taking_turns_keep_each_conversation_on_one_rank_from_its_second_turn() -> None:
    """Without shared state: turns alternate between two frontends (the Service spreads connections). A first turn
    shorter than the key goes by its own blocks; from the second turn on, every turn of a conversation goes to one
    rank on both frontends (the second turn is placed by the whole key, not held by the shorter first turn)."""
    frontends = (router(), router())
    moved_after_first = 0
    for conv, prompts in enumerate(conversations(40, 6)):
        ranks = []
        for turn, tokens in enumerate(prompts):
            choice = frontends[(conv + turn) % 2].choose(tokens, IDLE)
            assert choice is not None
            ranks.append(choice[0])
        assert set(ranks[1:]) == {ranks[1]}, (conv, ranks)
        if len(prompts[0]) >= 2 * BLOCK:  # a first turn that covers the key is where the rest go
            assert ranks[0] == ranks[1], (conv, ranks)
        moved_after_first += ranks[0] != ranks[1]
    assert moved_after_first > 0  # some short first turns' own blocks chose another rank than their key


def test_a_replaced_frontend_sends_each_conversation_where_its_predecessor_did() -> None:
    """A frontend's memory is lost with it; its replacement places every conversation it had routed (with no load to
    move it) on the rank the lost one used, as new prefixes by their key."""
    lost, replacement = router(), router()
    placed = {}
    for conv, prompts in enumerate(conversations(40, 4)):
        choices = [lost.choose(tokens, IDLE) for tokens in prompts[:3]]
        assert choices[-1] is not None
        placed[conv] = choices[-1][0]
        assert replacement.choose(prompts[3], IDLE) == (placed[conv], Decision.NEW), conv
    assert len(set(placed.values())) == len(IDLE)


def test_a_rank_that_left_is_no_longer_continued_and_the_memory_is_bounded() -> None:
    r = PrefixAffinity(AffinitySettings(prefix_tokens=8, memory=3), BLOCK)
    conv = prompt(11, 12)
    rank, _ = r.choose(conv, IDLE) or (None, None)
    assert rank is not None
    # Only the continuation memory knows this turn: its key (the first 8 tokens) differs from the first turn's own.
    assert r.choose(conv + prompt(12, 8), IDLE) == (rank, Decision.AFFINITY)
    r.forget(rank)
    others = {k: v for k, v in IDLE.items() if k != rank}
    follow = r.choose(conv + prompt(13, 8), others)
    assert follow is not None
    assert follow[0] != rank
    for seed in range(10):
        r.choose(prompt(seed + 50, 8), IDLE)
    assert len(r._routed) == 3


@pytest.mark.parametrize(("prefix_tokens", "balance", "error"),
                         [(0, 1.25, "at least one token"), (8, 0.9, "at least 1.0")])
def test_settings_are_checked(prefix_tokens: int, balance: float, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        AffinitySettings(prefix_tokens=prefix_tokens, balance=balance)
