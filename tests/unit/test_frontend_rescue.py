# SPDX-License-Identifier: Apache-2.0
"""A Stalled rank's requests that have not started go to another rank (`frontend.rescue.Rescue`), and what the
stalled rank sends for them afterwards never reaches vLLM's output handling."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace
from typing import Any

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

from corefleet_client.frontend.fleet import identity
from corefleet_client.frontend.rescue import Rescue


class Members:
    """What `Rescue` uses of `Membership`: vLLM's routing tables, the stalled ranks, an abort, failing requests."""

    def __init__(self) -> None:
        self.client = SimpleNamespace(reqs_in_flight={}, engine_inflight=Counter())
        self.stalled: dict[int, str] = {}
        self.records = {rank: SimpleNamespace(moved_total=0) for rank in (0, 1)}
        self.aborts: list[tuple[list[str], int]] = []
        self.failed: list[tuple[list[str], str]] = []

    def route(self, rid: str, rank: int) -> None:
        self.client.reqs_in_flight[rid] = identity(rank)
        self.client.engine_inflight[identity(rank)] += 1

    async def abort_on_engine(self, request_ids: list[str], rank: int) -> None:
        self.aborts.append((request_ids, rank))

    def fail_requests(self, request_ids: list[str], message: str, rank: int | None = None) -> None:
        self.failed.append((request_ids, message))


def request(rid: str, pinned: int | None = None) -> Any:
    return SimpleNamespace(request_id=rid, data_parallel_rank=pinned)


def outputs(rank: int, *rids: str, finished: set[str] | None = None) -> EngineCoreOutputs:
    return EngineCoreOutputs(engine_index=rank, outputs=[EngineCoreOutput(request_id=r, new_token_ids=[7])
                                                         for r in rids], finished_requests=finished)


def test_only_requests_without_an_output_move_and_the_stalled_rank_is_not_heard_for_them() -> None:
    async def main() -> None:
        members = Members()
        resent: list[str] = []

        async def resend(req: Any) -> None:  # corefleet's add_request_async: routes it to rank 0
            members.route(req.request_id, 0)
            resent.append(req.request_id)

        rescue = Rescue(members, resend)  # type: ignore[arg-type]
        for rid, rank, pinned in (("queued", 1, None), ("streaming", 1, None), ("pinned", 1, 1), ("other", 0, None)):
            members.route(rid, rank)
            rescue.sent(request(rid, pinned))
        rescue.engine_outputs(outputs(1, "streaming"))  # it has a token: its state lives on rank 1
        members.stalled[1] = "no output for 1.2s"
        assert await rescue.move_from(1) == 1
        assert resent == ["queued"]
        assert members.aborts == [(["queued"], 1)]
        assert members.client.reqs_in_flight["queued"] == identity(0)
        assert members.client.engine_inflight[identity(1)] == 2  # streaming and pinned stay
        assert rescue.moved == {"queued": 1}
        assert rescue.moved_total == 1
        assert members.records[1].moved_total == 1
        # Continued, rank 1 ends the step it was in (a first token for the moved request) and then its abort.
        late = outputs(1, "queued", "streaming")
        rescue.engine_outputs(late)
        assert [o.request_id for o in late.outputs] == ["streaming"]
        ended = outputs(1, finished={"queued", "streaming"})
        rescue.engine_outputs(ended)
        assert ended.finished_requests == {"streaming"}  # vLLM's tables keep "queued" on rank 0
        assert rescue.moved == {}
        # Rank 0's outputs for it pass, and start it.
        first = outputs(0, "queued")
        rescue.engine_outputs(first)
        assert [o.request_id for o in first.outputs] == ["queued"]
        assert "queued" not in rescue.unstarted

    asyncio.run(main())


def test_nothing_moves_once_the_rank_makes_progress_and_a_request_no_rank_takes_fails_with_the_reason() -> None:
    async def main() -> None:
        members = Members()

        async def refused(req: Any) -> None:
            raise RuntimeError("no rank of the fleet takes requests")

        rescue = Rescue(members, refused)  # type: ignore[arg-type]
        for rid in ("a", "b"):
            members.route(rid, 1)
            rescue.sent(request(rid))
        assert await rescue.move_from(1) == 0  # not stalled (any more)
        assert members.aborts == []
        members.stalled[1] = "no step ended"
        assert await rescue.move_from(1) == 2
        assert [ids for ids, _ in members.failed] == [["a"], ["b"]]
        assert "rank 1 stalled and no other rank took the request: no rank of the fleet takes requests" \
            in members.failed[0][1]
        rescue.forget_rank(1)
        assert rescue.moved == {}

    asyncio.run(main())
