# SPDX-License-Identifier: Apache-2.0
"""Stand-ins for what the frontend's `Fleet` is handed once it serves (`Fleet.serving`): its ResizeRunner and
LoadView protocols (client/corefleet_client/frontend/fleet.py), for tests that drive a Fleet without a client."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RecordingRunner:
    """A ResizeRunner that records what it was asked to run and cancel."""

    runs: list[str] = field(default_factory=list)
    cancels: list[tuple[str, str]] = field(default_factory=list)
    commits: list[str] = field(default_factory=list)
    orphans: list[tuple[str, str]] = field(default_factory=list)

    def run_resize(self, resize_id: str) -> None:
        self.runs.append(resize_id)

    def cancel_resize(self, resize_id: str, reason: str) -> None:
        self.cancels.append((resize_id, reason))

    def commit_resize(self, resize_id: str) -> None:
        self.commits.append(resize_id)

    def orphan_resize(self, resize_id: str, reason: str) -> None:
        self.orphans.append((resize_id, reason))


class IdleView:
    """A LoadView of a fleet with nothing in flight."""

    def lb_counts(self, rank: int) -> tuple[int, int, float]:
        return 0, 0, 0.0

    def in_flight(self, rank: int) -> int:
        return 0

    def closed(self) -> str | None:
        return None
