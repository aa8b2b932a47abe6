# SPDX-License-Identifier: Apache-2.0
"""What a plan asks for: the actions on the fleet's children and frontend, and the events to post.

A leaf module (it imports nothing of corefleet): the planner produces these values, the executor
carries them out, and the admin-API adapter turns the frontend's actions into calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Apply:
    """Server-side apply of a whole object (create or converge)."""

    obj: Mapping[str, Any]

    @property
    def key(self) -> tuple[str, str]:
        return str(self.obj["kind"]), str(self.obj["metadata"]["name"])


@dataclass(frozen=True)
class Delete:
    """Delete exactly this object: by name, with its UID as a precondition."""

    api_version: str
    kind: str
    name: str
    uid: str
    # The grace period of a pod's delete (None: the pod's own). The operator's deletes of engine pods are short
    # (constants.ENGINE_DELETE_GRACE_SECONDS): their pre-stop hook waits for a release that only a vacating
    # replacement sends.
    grace_seconds: int | None = None


@dataclass(frozen=True)
class StartResize:
    """Ask the frontend's admin API to start (or, same id and target, confirm) a resize."""

    resize_id: str
    replicas: int
    drain_timeout_s: float
    join_timeout_s: float
    replace: tuple[int, ...] = ()  # a replacement in place: these Dead ranks get new engines (replicas unchanged)
    vacate: bool = False  # the replaced ranks' pods are being removed: drain and release them first
    idle: bool = False  # go idle: drain every rank and release its engine (replicas unchanged)


@dataclass(frozen=True)
class CancelResize:
    """Ask the frontend to give a resize up (a new rank's pod failed: it will never join)."""

    resize_id: str
    reason: str


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


Action = Apply | Delete | StartResize | CancelResize
