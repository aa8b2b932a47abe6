# SPDX-License-Identifier: Apache-2.0
"""Progress-aware rank health: how long a rank may go without ending a step before it is Stalled.

The liveness watcher (`frontend.liveness`) keeps one cheap utility call outstanding per rank. An engine
core answers utility calls between its steps (vLLM 0.32.0 `EngineCoreProc.run_busy_loop` handles its input
queue before each step), so an answer takes about as long as the step it waited behind, and a call that stays
unanswered means the rank ended no step since it was sent: it makes no progress. Unanswered for the liveness
timeout (30 s) the rank is Unresponsive; but a rank stopped for seconds (SIGSTOP, a swapping host, a hung
collective) got new requests all that time, half a fleet's traffic waiting on a rank that does nothing.

So a rank whose call stays unanswered past its *stall bound* is Stalled: it keeps its state (Serving) and its
in-flight requests, but the router sends it new requests only when every rank is stalled (`membership`), until
its next answer. The bound comes from what the rank itself showed:

    bound = max(floor, factor x the slowest of its recent answers) + 2 x prefill allowance

* the slowest recent answer is its recent step time (and whatever queueing the frontend adds); `factor`
  leaves room for a step that is slower than those, a larger batch;
* the prefill allowance is for a step that is long for a reason the frontend knows: its requests still waiting
  for their first token (a long prompt prefills in one step where chunked prefill is off, or in long chunks) x
  the rank's cost of a prompt token, the slowest it showed (`prefilled` samples: each finished request's prefill
  time over its prompt tokens, from vLLM's request stats; it counts the steps of other requests that ran
  meanwhile, an overestimate, which is safe), twice over;
* `floor` (the frontend's `--stall-timeout`, 0 turns all of this off) keeps a rank that has shown no history
  yet, or only very fast steps, from being judged on noise.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from corefleet_client.frontend.types import StallPolicy

HISTORY = 32  # answers and prefill samples a rank's bound is taken over
PREFILL_MARGIN = 2.0  # the prefill allowance is this many times the prefill's expected time


@dataclass
class RankProgress:
    """What one rank showed of its step times and its prefill cost (see the module docstring)."""

    answers: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))  # seconds each call waited
    prefill_s_per_token: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))

    def answered(self, waited_s: float) -> None:
        self.answers.append(max(0.0, waited_s))

    def prefilled(self, seconds: float, prompt_tokens: int) -> None:
        if prompt_tokens > 0 and seconds >= 0:
            self.prefill_s_per_token.append(seconds / prompt_tokens)

    def bound(self, policy: StallPolicy, prefill_tokens: int) -> float:
        """Seconds without an answer after which the rank is Stalled, with `prefill_tokens` prompt tokens of its
        requests still waiting for their first token."""
        step = max(self.answers, default=0.0)
        per_token = max(self.prefill_s_per_token, default=0.0)
        return max(policy.floor_s, policy.step_factor * step) + PREFILL_MARGIN * per_token * max(0, prefill_tokens)
