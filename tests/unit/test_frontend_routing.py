# SPDX-License-Identifier: Apache-2.0
"""What vLLM's router reads before each choice: `routing_counts`, and vLLM's own router run on it.

The router (`DPLBAsyncMPClient.get_core_engine_for_request`, vLLM 0.32.0) scans only as many ranks
as the coordinator's last counts hold. After a scale-up, a publish the coordinator made before it
applied `SCALE_ELASTIC_EP` can arrive last; without the padding the new ranks get no unpinned
request until the coordinator's next publish (up to 5 s when no count changes).
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.engine.core_client import DPLBAsyncMPClient

from corefleet_client.frontend.fleet import identity
from corefleet_client.frontend.membership import routing_counts
from corefleet_client.frontend.progress import HISTORY, RankProgress, fleet_prefill_cost
from corefleet_client.frontend.types import STALLED_LOAD, UNROUTABLE, StallPolicy


def test_counts_shorter_than_the_fleet_are_padded_with_idle_ranks() -> None:
    counts: list[list[int | float]] = [[0, 2, 0.1], [1, 1, 0.2]]
    assert routing_counts(counts, 4, ()) == [[0, 2, 0.1], [1, 1, 0.2], [0, 0, 0.0], [0, 0, 0.0]]


def test_counts_as_long_as_the_fleet_are_kept_as_they_are() -> None:
    counts: list[list[int | float]] = [[0, 2, 0.1], [1, 1, 0.2]]
    assert routing_counts(counts, 2, ()) is counts
    assert counts == [[0, 2, 0.1], [1, 1, 0.2]]


def test_ranks_that_take_no_request_look_fully_loaded() -> None:
    counts: list[list[int | float]] = [[0, 0, 0.0]]
    view = routing_counts(counts, 3, [2, 0, 7])  # 7: not in the fleet (left already): ignored
    assert view == [[UNROUTABLE, UNROUTABLE, 0.0], [0, 0, 0.0], [UNROUTABLE, UNROUTABLE, 0.0]]


def route(lb: list[list[int | float]], size: int, inflight: dict[int, int] | None = None) -> int:
    """One routing choice by vLLM's own router on a stand-in client; the rank it picked."""
    engines = [identity(r) for r in range(size)]
    client: Any = SimpleNamespace(
        reqs_in_flight={}, engine_inflight=Counter({identity(r): n for r, n in (inflight or {}).items()}),
        lb_engines=lb, core_engines=engines, client_count=1, eng_start_index=0)
    request = SimpleNamespace(request_id="r", data_parallel_rank=None, pooling_params=None)
    chosen = DPLBAsyncMPClient.get_core_engine_for_request(client, request)
    return int.from_bytes(chosen, "little")


@pytest.mark.parametrize("padded", [False, True])
def test_the_new_rank_of_a_scale_up_gets_requests_only_with_the_padding(padded: bool) -> None:
    # 2 -> 3: ranks 0 and 1 each run a request; the coordinator's counts still hold two ranks.
    stale: list[list[int | float]] = [[0, 1, 0.1], [0, 1, 0.1]]
    lb = routing_counts(stale, 3, ()) if padded else stale
    assert route(lb, 3, {0: 1, 1: 1}) == (2 if padded else 0)


def test_a_stalled_rank_is_picked_only_when_every_rank_that_takes_requests_is_stalled() -> None:
    # Rank 1 stalled with nothing on it, rank 0 busy: the router still picks rank 0.
    lb = routing_counts([[0, 5, 0.1], [0, 0, 0.0], [0, 0, 0.0]], 3, [2], [1])
    assert lb[1] == [0, STALLED_LOAD, 0.0]
    assert lb[2] == [UNROUTABLE, UNROUTABLE, 0.0]
    assert route(lb, 3, {0: 5}) == 0
    # Every rank that takes requests is stalled (rank 2 takes none): their own loads decide, no rank is refused.
    counts: list[list[int | float]] = [[0, 3, 0.1], [0, 1, 0.0], [0, 0, 0.0]]
    lb = routing_counts(counts, 3, [2], [0, 1])
    assert lb[:2] == [[0, 3, 0.1], [0, 1, 0.0]]
    assert route(lb, 3, {0: 3, 1: 1}) == 1
    # A rank both unroutable and stalled is unroutable.
    assert routing_counts([[0, 0, 0.0], [0, 0, 0.0]], 2, [1], [1])[1] == [UNROUTABLE, UNROUTABLE, 0.0]


def test_a_ranks_stall_bound_follows_its_slowest_recent_step_and_its_prompts_still_prefilling() -> None:
    policy = StallPolicy(floor_s=3.0, step_factor=10.0)
    progress = RankProgress()
    assert progress.bound(policy, 0) == 3.0  # nothing shown yet: the floor
    for waited in (0.01, 0.05, 0.02):
        progress.answered(waited)
    assert progress.bound(policy, 0) == 3.0  # 10 x 50 ms is under the floor
    progress.answered(0.5)
    assert progress.bound(policy, 0) == pytest.approx(5.0)  # 10 x its slowest recent step
    for _ in range(HISTORY):
        progress.answered(0.02)  # the slow step left the history
    assert progress.bound(policy, 0) == 3.0
    progress.prefilled(0.032, 64)  # 0.5 ms a prompt token
    progress.prefilled(0.1, 0)  # no prompt tokens: no sample
    assert progress.bound(policy, 8000) == pytest.approx(3.0 + 2 * 8000 * 0.0005)
    assert progress.bound(policy, 8000, fleet_cost=0.01) == pytest.approx(3.0 + 2 * 8000 * 0.0005)  # its own counts


def test_a_rank_that_showed_no_prefill_cost_is_allowed_the_slowest_any_rank_of_the_fleet_showed() -> None:
    policy = StallPolicy(floor_s=1.0, step_factor=10.0)
    shown, slower, new = RankProgress(), RankProgress(), RankProgress()
    assert fleet_prefill_cost([shown, slower, new]) == 0.0  # a fleet that prefilled nothing yet: no allowance
    assert new.bound(policy, 8000, fleet_prefill_cost([new])) == 1.0
    shown.prefilled(0.032, 64)  # 0.5 ms a prompt token
    slower.prefilled(0.064, 64)  # 1 ms
    cost = fleet_prefill_cost([shown, slower, new])
    assert cost == pytest.approx(0.001)
    assert new.bound(policy, 8000, cost) == pytest.approx(1.0 + 2 * 8000 * 0.001)
    assert new.output_bound(policy, 8000, cost) == pytest.approx(1.0 + 2 * 8000 * 0.001)
    assert new.output_bound(policy, 0, cost) == 1.0  # nothing prefilling: nothing allowed
    assert not StallPolicy(floor_s=0).enabled
