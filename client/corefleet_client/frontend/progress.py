# SPDX-License-Identifier: Apache-2.0
"""Progress-aware rank health: how long a rank may go without progress before it is Stalled.

A rank stopped for seconds (SIGSTOP, a swapping host, a hung collective) keeps its connection, so the liveness
timeout (30 s: `frontend.liveness`) is all that took it out of the routing, and until then it got new requests
that waited on a rank that does nothing (issue 26: 14 requests in 40 s against 794 in the 30 s before, 4
closed-loop clients over 2 ranks; each request routed to it holds a client). A Stalled rank keeps its state
(Serving) and its in-flight requests that already streamed, but the router sends it new ones only when every rank
is stalled (`membership.routing_counts`), until it makes progress again; those that have not started go to another
rank (`frontend.rescue`). Two signals, whichever comes first:

* its outputs: a rank with requests in flight sends one batch of outputs per step (seen on the output socket's
  reader, vLLM's `process_engine_outputs` hook). No output for its *output bound* while it has had work (checked
  every `liveness.OUTPUT_CHECK_S`) is a stall; its next output ends it;
* its liveness call: an engine core answers utility calls between its steps (vLLM 0.32.0
  `EngineCoreProc.run_busy_loop` handles its input queue before each step), so an answer takes about as long as
  the step it waited behind, and a call unanswered past its *call bound* means no step ended since. This one
  also sees a rank with nothing in flight, or only prompts that prefill (which send nothing until their first
  token); the answer ends it.

Each bound comes from what the rank showed:

    output bound = max(floor, factor x its usual gap between outputs while busy) + prefill allowance
    call bound   = max(floor, factor x its slowest recent answer)                 + prefill allowance

* the usual gap is the 90th percentile of its recent gaps between outputs while it had work (its step time); the
  slowest recent answer is its step time with whatever queueing the frontend adds; `factor` (the frontend's
  `--stall-step-factor`, 10) leaves room for slower steps, a larger batch;
* the prefill allowance is for a step that is long for a reason the frontend knows: its requests still waiting
  for their first token (a long prompt prefills in one step where chunked prefill is off, or in long chunks)
  x the rank's cost of a prompt token, the slowest it showed (`prefilled`: each finished request's prefill
  time over its prompt tokens, from vLLM's request stats; it counts the steps of other requests that ran
  meanwhile, an overestimate, which is safe), twice over. A rank that has finished no request yet (one that
  joined in a scale-up, or replaced a lost one) takes the slowest cost any rank of the fleet showed
  (`fleet_prefill_cost`): the ranks run the same model with the same flags, and without it the new rank's
  first long prompt would be taken for a stall, and moved;
* `floor` (the frontend's `--stall-timeout`, 1 s; 0 turns all of this off) keeps a rank that has shown no
  history yet, or only very fast steps, from being judged on noise. The prefill cost needs vLLM's request stats
  (on unless the frontend runs with `--disable-log-stats`); without them there is no prefill allowance.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from corefleet_client.frontend.types import StallPolicy

HISTORY = 32  # answers and prefill samples a rank's bound is taken over
GAP_HISTORY = 256  # gaps between a busy rank's outputs its output bound is taken over
GAP_QUANTILE = 0.9  # of those gaps: a few that spanned a moment without work do not count
PREFILL_MARGIN = 2.0  # the prefill allowance is this many times the prefill's expected time


@dataclass
class RankProgress:
    """What one rank showed of its step times and its prefill cost, and when it last made progress (see the module
    docstring). Times are the event loop's."""

    answers: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))  # seconds each call waited
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=GAP_HISTORY))  # between outputs while busy
    prefill_s_per_token: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    last_output: float | None = None
    busy_since: float | None = None  # since when it has had requests in flight without a pause; None: none now

    def answered(self, waited_s: float) -> None:
        self.answers.append(max(0.0, waited_s))

    def prefilled(self, seconds: float, prompt_tokens: int) -> None:
        if prompt_tokens > 0 and seconds >= 0:
            self.prefill_s_per_token.append(seconds / prompt_tokens)

    def output(self, now: float) -> None:
        """The rank sent outputs (one step's)."""
        if self.last_output is not None and self.busy_since is not None and self.busy_since <= self.last_output:
            self.gaps.append(now - self.last_output)
        self.last_output = now

    def work(self, busy: bool, now: float) -> None:
        """Whether the rank has requests in flight now."""
        if not busy:
            self.busy_since = None
        elif self.busy_since is None:
            self.busy_since = now

    def quiet_for(self, now: float) -> float | None:
        """Seconds the rank has had work and sent no output; None while it has none."""
        if self.busy_since is None:
            return None
        return now - max(self.busy_since, self.last_output if self.last_output is not None else self.busy_since)

    def restart_clocks(self, now: float) -> None:
        """The frontend's own loop stalled: outputs may wait unread, nothing the rank did is known."""
        if self.busy_since is not None:
            self.busy_since = now
        if self.last_output is not None:
            self.last_output = max(self.last_output, now)

    @property
    def prefill_cost(self) -> float | None:
        """The slowest cost of a prompt token it showed (seconds); None before any."""
        return max(self.prefill_s_per_token, default=None)

    def _allowance(self, prefill_tokens: int, fleet_cost: float) -> float:
        per_token = self.prefill_cost
        return PREFILL_MARGIN * (fleet_cost if per_token is None else per_token) * max(0, prefill_tokens)

    def bound(self, policy: StallPolicy, prefill_tokens: int, fleet_cost: float = 0.0) -> float:
        """Seconds a liveness call may stay unanswered before the rank is Stalled, with `prefill_tokens` prompt
        tokens of its requests still waiting for their first token; `fleet_cost` (`fleet_prefill_cost`) stands for
        its own cost of a prompt token until it showed one."""
        step = max(self.answers, default=0.0)
        return max(policy.floor_s, policy.step_factor * step) + self._allowance(prefill_tokens, fleet_cost)

    def output_bound_before_prefill(self, policy: StallPolicy) -> float:
        """The output bound without the prefill allowance (computing that reads every request of the rank)."""
        gap = quantile(self.gaps, GAP_QUANTILE)
        return max(policy.floor_s, policy.step_factor * gap)

    def output_bound(self, policy: StallPolicy, prefill_tokens: int, fleet_cost: float = 0.0) -> float:
        """Seconds a rank with requests in flight may send no output before it is Stalled (`fleet_cost`: as for
        `bound`)."""
        return self.output_bound_before_prefill(policy) + self._allowance(prefill_tokens, fleet_cost)


def fleet_prefill_cost(ranks: Iterable[RankProgress]) -> float:
    """The slowest cost of a prompt token any of the ranks showed (seconds; 0 where none showed one): what a rank
    without its own is allowed."""
    return max((c for r in ranks if (c := r.prefill_cost) is not None), default=0.0)


def quantile(values: deque[float], q: float) -> float:
    """The q-quantile of `values` (0 for none), nearest rank."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
