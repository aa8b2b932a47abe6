# SPDX-License-Identifier: Apache-2.0
"""A local fleet's frontend and coordinator, replaced in place when lost: the engines serve on.

The same path as the operator's pods (`corefleet_operator.planner.members`): the coordinator is started
again with its command line (its state, load statistics and the wave, is rebuilt from the engines), the
frontend with `--attach` at the fleet's recorded size (`FleetRecord.replicas`, what the last resize
committed) on the fleet's fixed engine ports, so that every running engine reconnects to it, announces
itself again and aborts what the lost frontend had in flight (`corefleet_client.frontend.attach`).

Not replaced, as on Kubernetes (where the whole fleet is recreated): a MoE fleet's members (its elastic-EP
state lives in them), a frontend of a fleet started without fixed engine ports (an older corefleet), and a
member replaced `MAX_REPLACEMENTS` times within `REPLACEMENT_WINDOW_S` (a crash loop: its log says why).
"""

from __future__ import annotations

import sys
from collections import deque
from pathlib import Path

from corefleet_harness.local.argv import coordinator_argv, frontend_argv, is_moe_model
from corefleet_harness.local.config import ROLE_COORDINATOR, ROLE_FRONTEND
from corefleet_harness.local.state import FleetRecord

MEMBER_ROLES = (ROLE_COORDINATOR, ROLE_FRONTEND)
MAX_REPLACEMENTS = 5
REPLACEMENT_WINDOW_S = 300.0


def member_argv(record: FleetRecord, role: str, index: int = 0) -> list[str]:
    """The command line of a replacement for the fleet's `role` (frontend `index`, or the coordinator), at its
    recorded size."""
    python = record.python or sys.executable
    moe = is_moe_model(record.model)
    if role == ROLE_COORDINATOR:
        return coordinator_argv(python, record.replicas, record.ports, moe=moe)
    if role == ROLE_FRONTEND:
        return frontend_argv(python, record.model, record.replicas, record.ports, Path(record.token_file),
                             record.vllm_flags, moe=moe, attach=True, frontends=record.frontends, client_index=index)
    raise ValueError(f"not a member role: {role!r}")


class Replacements:
    """When a lost member may be replaced in place, and why not (`refusal`); counts each replacement (`count`)."""

    def __init__(self, limit: int = MAX_REPLACEMENTS, window_s: float = REPLACEMENT_WINDOW_S) -> None:
        self.limit, self.window_s = limit, window_s
        self._times: dict[str, deque[float]] = {}

    def refusal(self, record: FleetRecord, role: str, now: float, name: str | None = None) -> str | None:
        """None if the lost `role` (the process `name`, one of several frontends) can be replaced in place; else why
        the fleet cannot keep its engines."""
        if role not in MEMBER_ROLES:
            raise ValueError(f"not a member role: {role!r}")
        if is_moe_model(record.model):
            return "a MoE fleet's frontend and coordinator hold its elastic-EP state: not replaced in place"
        if role == ROLE_FRONTEND and record.ports.engine_ports is None:
            return "the fleet was started without fixed engine ports (an older corefleet): its engines cannot " \
                   "find a replacement frontend"
        name = name or role
        times = self._times.get(name, deque())
        while times and now - times[0] > self.window_s:
            times.popleft()
        if len(times) >= self.limit:
            return f"the {name} was replaced {len(times)} times within {self.window_s:.0f} s (a crash loop)"
        return None

    def count(self, name: str, now: float) -> None:
        """One more replacement of the process `name` (its role, for the one frontend or the coordinator)."""
        self._times.setdefault(name, deque()).append(now)
