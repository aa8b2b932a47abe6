# SPDX-License-Identifier: Apache-2.0
"""Prefix-affinity routing: requests that share a prompt prefix go to the rank whose prefix cache holds it.

vLLM's DP load balancer picks the least loaded rank and breaks ties by a rotating index, so the turns
of one conversation, and the requests behind one long system prompt, land on different ranks and each
misses the cache the previous one built. This router keeps them together, bounded by load:

* **The key.** The prompt's leading full blocks (the engines' KV block size), at most `prefix_tokens`
  tokens, hashed (BLAKE2b, so every frontend and every process computes the same key). A prompt
  shorter than one block has no useful prefix: the request goes by load (vLLM's own router).
* **Where a prefix goes first**: the first rank in the key's rendezvous (highest-random-weight) order
  over the ranks that take requests, unless that rank has more than one request more than the least
  loaded one; then the next in that order that has not. The order is a function of the key and the
  ranks alone, so frontends agree without sharing state, and a rank that joins is first for only the
  keys it now wins (about 1/N), a rank that leaves gives away only its own. Prompts that share nothing
  are spread as by load (within one request of it).
* **Then it stays there.** Each routed prompt's hash over all its full blocks, and a new prefix's key,
  are remembered with their rank (a bounded LRU), and a request's block-aligned prefixes that cover its
  key are looked up, longest first: the next turn of a conversation (whose prompt is the whole
  conversation so far) goes where the last turn went, and a shared system prompt to where it went first,
  even where the key's order would now pick another rank. A remembered prefix shorter than the request's
  key does not hold it: a conversation that opens shorter than the key is placed by its whole key at the
  first turn that covers it, as every other frontend would place it, at the cost of the shorter turns'
  cache (fewer than `prefix_tokens` tokens) once.
* **Bounded loads** (consistent hashing with bounded loads): that rank takes the request only while its
  load stays within `balance` times the mean load after it; otherwise the request spills to the key's
  next rank in rendezvous order that has room, which then holds the prompt too. A hot prefix spreads
  over as many ranks as its load needs, and no rank runs past the bound while another has room.

Loads are the client's (`Membership.routing_loads`: its exact in-flight count per rank when it is the
fleet's only frontend, else vLLM's measure, in which each request a frontend routes counts once per
frontend until the coordinator's next counts: "within one request" is then within `slack`, the number of
frontends). The memory is per frontend: with several frontends, or after a frontend is replaced, a
request that reaches a frontend which has not routed its key goes where a new prefix goes: the same rank
as on the frontend that did, unless load moved it on either (a spill, or a first rank busier than the
slack), so without shared state every frontend sends a conversation to one rank from the first turn
that covers its key on.

Pure: no vLLM, no event loop, no clock. The client (`frontend.client`) asks `choose` for each new
request that is not pinned to a rank, and counts the decision (`Decision`) per rank.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

from corefleet_client.frontend.types import AffinitySettings, Decision

# The key's block where vLLM's cache config has none yet (the engines pick theirs): the key needs no exact match.
DEFAULT_BLOCK_SIZE = 16

TOKEN_BYTES = array("q").itemsize  # a token id as the key hashes it (signed 64-bit)


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8).digest()


def block_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hash of each block-aligned prefix of `tokens` (full blocks only): entry i covers i + 1 blocks."""
    data = array("q", tokens).tobytes()  # once: slicing bytes is cheaper than converting each block
    step = block_size * TOKEN_BYTES
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, len(data) - step + 1, step):
        previous = _digest(previous + data[start:start + step])
        hashes.append(previous)
    return hashes


def rendezvous(key: bytes, ranks: Iterable[int]) -> list[int]:
    """`ranks` in the key's order of preference (highest random weight first): the same on every frontend."""
    return sorted(ranks, key=lambda rank: _digest(key + rank.to_bytes(4, "little")), reverse=True)


def capacity(loads: Mapping[int, float], balance: float) -> float:
    """The most load a rank may hold after taking one more request: `balance` times the mean load then."""
    return max(1.0, math.ceil(balance * (sum(loads.values()) + 1) / len(loads)))


class PrefixAffinity:
    """The router's memory (continuations) and its choice; one per frontend, used on vLLM's event loop only."""

    def __init__(self, settings: AffinitySettings, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block size must be positive, not {block_size}")
        self.settings = settings
        self.block_size = block_size
        self._key_blocks = max(1, settings.prefix_tokens // block_size)
        # The hash of a routed prompt's full blocks, and of a new prefix's key -> the rank it went to.
        self._routed: OrderedDict[bytes, int] = OrderedDict()

    def choose(self, tokens: Sequence[int] | None, loads: Mapping[int, float],
               slack: float = 1.0) -> tuple[int, Decision] | None:
        """The rank for a new request with prompt `tokens` among `loads` (the ranks that take requests, with their
        loads), and why; None where the prompt has no full block (route by load). `slack`: how far over the least
        loaded a new prefix's first rank may be and still take it (one request, in the loads' unit)."""
        if not tokens or not loads:
            return None
        hashes = block_hashes(tokens, self.block_size)
        if not hashes:
            return None
        key_length = min(len(hashes), self._key_blocks)
        key = hashes[key_length - 1]
        held = self._held(hashes[key_length - 1:])
        if held is None:
            # A key this frontend has not routed (or whose rank left): the first rank in the key's order that is
            # within `slack` of the least loaded (every frontend's first choice, unless it is busier than that);
            # from now on the prefix and its continuations follow it.
            low = min(loads.values())
            rank = next(r for r in rendezvous(key, loads) if loads[r] <= low + slack)
            self._remember(key, rank)
            self._remember(hashes[-1], rank)
            return rank, Decision.NEW
        bound = capacity(loads, self.settings.balance)
        if held in loads and loads[held] + 1 <= bound:
            chosen = held  # the common case: no rendezvous order needed
        else:  # over its bound, or it takes no requests now (stalled, say): the prompt spills, the prefix stays its
            order = rendezvous(key, loads)
            # Some rank has room with balance >= 1 (the least loaded is within the mean + 1); the minimum is a
            # safeguard.
            found = next((r for r in order if loads[r] + 1 <= bound), None)
            chosen = min(order, key=lambda r: loads[r]) if found is None else found
        self._remember(hashes[-1], chosen)
        return chosen, Decision.AFFINITY if chosen == held else Decision.SPILL

    def forget(self, rank: int) -> None:
        """`rank` left the fleet: its prompts are no longer continued there (rendezvous picks again)."""
        for key in [k for k, r in self._routed.items() if r == rank]:
            del self._routed[key]

    def _held(self, hashes: list[bytes]) -> int | None:
        """The rank of the longest of these block-aligned prefixes of the prompt (those that cover its key) that this
        frontend routed."""
        for digest in reversed(hashes):
            rank = self._routed.get(digest)
            if rank is not None:
                return rank
        return None

    def _remember(self, digest: bytes, rank: int) -> None:
        self._routed[digest] = rank
        self._routed.move_to_end(digest)
        while len(self._routed) > self.settings.memory:
            self._routed.popitem(last=False)
