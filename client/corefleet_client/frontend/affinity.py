# SPDX-License-Identifier: Apache-2.0
"""Prefix-affinity routing: requests that share a prompt prefix go to the rank whose prefix cache holds it.

vLLM's DP load balancer picks the least loaded rank and breaks ties by a rotating index, so the turns
of one conversation, and the requests behind one long system prompt, land on different ranks and each
misses the cache the previous one built. This router keeps them together, bounded by load:

* **The key.** The prompt's leading full blocks (the engines' KV block size), at most `prefix_tokens`
  tokens, hashed (BLAKE2b, so every frontend and every process computes the same key). A prompt
  shorter than one block has no useful prefix: the request goes by load (vLLM's own router).
* **The rank for a key**: rendezvous (highest-random-weight) hashing over the ranks that take
  requests. A function of the key and the ranks alone, so frontends agree without sharing state, and a
  rank that joins takes only the keys it now wins (about 1/N), a rank that leaves gives away only its
  own.
* **Bounded loads** (consistent hashing with bounded loads): a rank takes a request only while its load
  (vLLM's measure: the coordinator's waiting + running, or this client's in-flight count times the
  clients) stays within `balance` times the mean load after it; otherwise the request spills to the
  key's next rank in rendezvous order. A hot prefix spreads over as many ranks as its load needs, in
  the same order on every frontend, and no rank runs past the bound while another has room.
* **Continuations.** A prompt that extends one this frontend routed (the next turn of a conversation:
  the whole conversation so far) goes to the rank that prompt went to, even where the key (say, a
  system prompt that many conversations share) would pick another: each routed prompt's hash over all
  its full blocks is remembered (a bounded LRU), and a new prompt's block-aligned prefixes are looked up,
  longest first. This memory is per frontend; a turn that reaches another frontend falls back to the
  key, which is where its conversation started unless that rank was over its bound then.

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

def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8).digest()


def block_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hash of each block-aligned prefix of `tokens` (full blocks only): entry i covers i + 1 blocks."""
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        previous = _digest(previous + array("q", tokens[start:start + block_size]).tobytes())
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
        self._routed: OrderedDict[bytes, int] = OrderedDict()  # hash of a routed prompt's full blocks -> its rank

    def choose(self, tokens: Sequence[int] | None, loads: Mapping[int, float]) -> tuple[int, Decision] | None:
        """The rank for a new request with prompt `tokens` among `loads` (the ranks that take requests, with their
        loads), and why; None where the prompt has no full block (route by load)."""
        if not tokens or not loads:
            return None
        hashes = block_hashes(tokens, self.block_size)
        if not hashes:
            return None
        bound = capacity(loads, self.settings.balance)
        order = rendezvous(hashes[min(len(hashes), self._key_blocks) - 1], loads)
        previous = self._continued(hashes)
        if previous is not None and previous in loads:
            order.remove(previous)
            order.insert(0, previous)
        rank = next((r for r in order if loads[r] + 1 <= bound), None)
        if rank is None:  # cannot happen with balance >= 1 (the least loaded rank is within the mean + 1)
            rank = min(order, key=lambda r: loads[r])
        self._remember(hashes[-1], rank)
        return rank, Decision.AFFINITY if rank == order[0] else Decision.SPILL

    def forget(self, rank: int) -> None:
        """`rank` left the fleet: its prompts are no longer continued there (rendezvous picks again)."""
        for key in [k for k, r in self._routed.items() if r == rank]:
            del self._routed[key]

    def _continued(self, hashes: list[bytes]) -> int | None:
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
