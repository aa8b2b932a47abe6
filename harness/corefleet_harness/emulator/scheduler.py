# SPDX-License-Identifier: Apache-2.0
"""The emulated scheduler: vLLM's request bookkeeping and output shapes, with made-up tokens.

It mirrors what `vllm.v1.core.sched.scheduler.Scheduler` does for the wire, in one step per
`--token-delay-ms`:

* `add_request` queues a request as WAITING (`Scheduler.add_request`); each step first moves
  waiting requests to RUNNING up to `max_num_seqs` (`schedule`), then gives every running request
  exactly one token (a decode step; the first step is the prefill and also yields one token);
* a token is `token_id(prompt, i)`: deterministic, never a special id (0, 1, 2), below the vocab;
* a request finishes as `check_stop` (v1/core/sched/utils.py) decides: EOS -> STOP, a stop token
  -> STOP with `stop_reason` = that token, `max_tokens` or `max_model_len` reached -> LENGTH;
* `abort_requests` is `finish_requests(ids, FINISHED_ABORTED)`: the requests leave the queues and
  their ids are reported in the next step's `finished_requests`, with no `EngineCoreOutput` (the
  frontend has already finished them itself). Only `finish_all` (pause "abort", shutdown) leads to
  explicit `FinishReason.ABORT` outputs, sent by the engine;
* pause states and `get_num_unfinished_requests` follow `PauseState`: PAUSED_NEW keeps stepping
  the running requests and leaves the waiting ones queued, PAUSED_ALL freezes everything;
* `finished_requests` sets are kept per client index only with `include_finished_set` (the
  engine has a DP coordinator and internal load balancing, `EngineCore.__init__`).

The pure functions at the top are the token and stop rules, unit-tested on their own.
"""

from __future__ import annotations

import enum
import math
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from corefleet_harness.emulator import wire
from corefleet_harness.emulator.wire import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason

# Token ids below this are the special tokens of the tiny models (<unk>, <s>, </s>); never emitted.
FIRST_TOKEN_ID = 3


def token_id(prompt_token_ids: Iterable[int] | None, index: int, vocab_size: int) -> int:
    """The emulator's `index`-th output token for a prompt: FIRST_TOKEN_ID + (sum(prompt) + index) mod span."""
    span = max(1, vocab_size - FIRST_TOKEN_ID)
    return FIRST_TOKEN_ID + (sum(prompt_token_ids or ()) + index) % span


def expected_tokens(prompt_token_ids: list[int], count: int, vocab_size: int) -> list[int]:
    """The first `count` tokens the emulator generates for a prompt (for tests)."""
    return [token_id(prompt_token_ids, i, vocab_size) for i in range(count)]


def output_budget(prompt_len: int, max_tokens: int | None, max_model_len: int) -> int:
    """How many tokens a request may produce: `max_tokens`, capped so prompt + output <= max_model_len.

    At least one: vLLM always samples the prefill's token before `check_stop` looks at lengths.
    """
    limit = max_model_len - prompt_len
    budget = limit if max_tokens is None else min(max_tokens, limit)
    return max(1, budget)


def check_stop(token: int, num_output_tokens: int, budget: int, eos_token_id: int | None,
               stop_token_ids: Iterable[int] | None) -> tuple[FinishReason | None, int | None]:
    """(finish_reason, stop_reason) after `token` was appended, in `check_stop`'s order."""
    if eos_token_id is not None and token == eos_token_id:
        return FinishReason.STOP, None
    if token in (stop_token_ids or ()):
        return FinishReason.STOP, token
    if num_output_tokens >= budget:
        return FinishReason.LENGTH, None
    return None, None


class PauseState(enum.IntEnum):
    """vllm.v1.core.sched.interface.PauseState (same names and values)."""

    UNPAUSED = 0
    PAUSED_NEW = 1
    PAUSED_ALL = 2


@dataclass
class EmulatedRequest:
    request_id: str
    client_index: int
    prompt_token_ids: list[int]
    budget: int
    eos_token_id: int | None
    stop_token_ids: list[int]
    arrival: float
    output_token_ids: list[int] = field(default_factory=list)
    scheduled_at: float | None = None
    events_sent: bool = False

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest, max_model_len: int,
                                 arrival: float) -> EmulatedRequest:
        prompt = list(request.prompt_token_ids or ())
        params = request.sampling_params
        max_tokens = params.max_tokens if params is not None else 1
        return cls(
            request_id=request.request_id,
            client_index=request.client_index,
            prompt_token_ids=prompt,
            budget=output_budget(len(prompt), max_tokens, max_model_len),
            eos_token_id=params.eos_token_id if params is not None else None,
            stop_token_ids=list(params.stop_token_ids or ()) if params is not None else [],
            arrival=arrival,
        )


@dataclass
class SchedulerCounters:
    """What the emulator did, for `/stats` and the tests."""

    requests_added: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    tokens_generated: int = 0
    steps: int = 0
    aborted_ids: list[str] = field(default_factory=list)  # the most recent ones, oldest first
    added_ids: list[str] = field(default_factory=list)

    MAX_IDS = 1000

    def remember(self, ids: list[str], request_id: str) -> None:
        ids.append(request_id)
        del ids[:-self.MAX_IDS]


class EmulatedScheduler:
    def __init__(self, *, max_num_seqs: int, max_model_len: int, vocab_size: int, num_gpu_blocks: int,
                 block_size: int, log_stats: bool = True, include_finished_set: bool = True) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.log_stats = log_stats
        self.requests: dict[str, EmulatedRequest] = {}
        self.waiting: deque[EmulatedRequest] = deque()
        self.running: list[EmulatedRequest] = []
        self.pause_state = PauseState.UNPAUSED
        # finished_req_ids_dict: ids finished since the last step, per client index.
        self.finished_req_ids: dict[int, set[str]] | None = defaultdict(set) if include_finished_set else None
        self._finished_pending = False  # Scheduler.finished_req_ids (cleared by each schedule())
        self.counters = SchedulerCounters()

    # -- queries (Scheduler / SchedulerInterface) --

    def get_request_counts(self) -> tuple[int, int]:
        """(num_running_reqs, num_waiting_reqs)."""
        return len(self.running), len(self.waiting)

    def get_num_unfinished_requests(self) -> int:
        if self.pause_state == PauseState.PAUSED_ALL:
            return 0
        if self.pause_state == PauseState.PAUSED_NEW:
            return len(self.running)
        return len(self.running) + len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        return self._finished_pending

    def has_requests(self) -> bool:
        return self.has_unfinished_requests() or self.has_finished_requests()

    def get_kv_cache_usage(self) -> float:
        blocks = sum(math.ceil((len(r.prompt_token_ids) + len(r.output_token_ids)) / self.block_size)
                     for r in self.running)
        return min(1.0, blocks / self.num_gpu_blocks) if self.num_gpu_blocks else 0.0

    def make_stats(self) -> wire.SchedulerStats | None:
        if not self.log_stats:
            return None
        running, waiting = self.get_request_counts()
        return wire.SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting,
                                   kv_cache_usage=self.get_kv_cache_usage())

    # -- changes --

    def add_request(self, request: EngineCoreRequest, arrival: float) -> EmulatedRequest:
        if not isinstance(request.request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request.request_id)}")
        req = EmulatedRequest.from_engine_core_request(request, self.max_model_len, arrival)
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self.counters.requests_added += 1
        self.counters.remember(self.counters.added_ids, req.request_id)
        return req

    def _finish(self, req: EmulatedRequest) -> None:
        self.requests.pop(req.request_id, None)
        self._finished_pending = True
        if self.finished_req_ids is not None:
            self.finished_req_ids[req.client_index].add(req.request_id)

    def abort_requests(self, request_ids: Iterable[str] | str | None) -> list[EmulatedRequest]:
        """`Scheduler.finish_requests(request_ids, FINISHED_ABORTED)`; None means all. Idempotent."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        ids = list(self.requests) if request_ids is None else list(dict.fromkeys(request_ids))
        aborted = [self.requests[i] for i in ids if i in self.requests]
        if not aborted:
            return []
        gone = {id(r) for r in aborted}
        self.running = [r for r in self.running if id(r) not in gone]
        self.waiting = deque(r for r in self.waiting if id(r) not in gone)
        for req in aborted:
            self._finish(req)
            self.counters.requests_aborted += 1
            self.counters.remember(self.counters.aborted_ids, req.request_id)
        return aborted

    def finish_all(self) -> list[EmulatedRequest]:
        """Every unfinished request aborted (pause "abort", shutdown)."""
        return self.abort_requests(None)

    def set_pause_state(self, state: PauseState) -> None:
        self.pause_state = state

    # -- one step --

    def step(self, now: float) -> dict[int, EngineCoreOutputs]:
        """Schedule and "execute" one step; the outputs per client index (`update_from_output`)."""
        self._finished_pending = False
        if self.pause_state == PauseState.UNPAUSED:
            while self.waiting and len(self.running) < self.max_num_seqs:
                req = self.waiting.popleft()
                req.scheduled_at = now
                self.running.append(req)

        outputs: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        if self.pause_state != PauseState.PAUSED_ALL:
            still_running = []
            for req in self.running:
                token = token_id(req.prompt_token_ids, len(req.output_token_ids), self.vocab_size)
                req.output_token_ids.append(token)
                self.counters.tokens_generated += 1
                reason, stop_reason = check_stop(token, len(req.output_token_ids), req.budget,
                                                 req.eos_token_id, req.stop_token_ids)
                events = None
                if self.log_stats and not req.events_sent:
                    events = wire.make_events(req.arrival, req.scheduled_at)
                    req.events_sent = True
                outputs[req.client_index].append(
                    wire.make_token_output(req.request_id, [token], reason, stop_reason, events))
                if reason is None:
                    still_running.append(req)
                else:
                    self._finish(req)
                    self.counters.requests_finished += 1
            self.running = still_running
        self.counters.steps += 1

        step_outputs = {client: EngineCoreOutputs(outputs=outs) for client, outs in outputs.items()}
        if self.finished_req_ids:
            for client, finished in self.finished_req_ids.items():
                if (eco := step_outputs.get(client)) is not None:
                    eco.finished_requests = finished
                else:
                    step_outputs[client] = EngineCoreOutputs(finished_requests=finished)
            self.finished_req_ids.clear()
        if (stats := self.make_stats()) is not None:
            # Stats go to one frontend only, even when this step has no request outputs.
            if (eco := next(iter(step_outputs.values()), None)) is None:
                step_outputs[0] = eco = EngineCoreOutputs()
            eco.scheduler_stats = stats
        return step_outputs
