# SPDX-License-Identifier: Apache-2.0
"""Carrying out a plan: the actions on one fleet's children and frontend, and what may go wrong.

The planner decides what should happen (`actions.Action`); the reconciler hands the plan's actions to
this fleet's `Executor`, which makes the calls: children through the Kubernetes API (`kube.Kube`),
resizes through the frontend's admin API (`frontend_api.FrontendAPI`).

* A child is the fleet's only if its controller ownerReference is this EngineCoreSet's UID. An object
  of a child's name that the fleet does not control is never written: pods are created with a plain
  create (409 if the name is taken), other children are read first when they are not observed as the
  fleet's, and one controlled by anything else is refused (`Conflict`).
* An action the API server refuses (quota, PodSecurity, an admission webhook, a name conflict) is an
  `ActionFailure` (the object and the server's message); the other actions of the plan still run (they
  do not depend on each other within one plan). Transport errors propagate: the reconcile is retried
  as a whole.
* Expectations (`PendingCreates`): a pod just created is not created again before the watch shows it.
* Stuck terminations: a fleet pod still terminating `STUCK_TERMINATION_SECONDS` past its grace period
  (its node is lost: no kubelet confirms the deletion) is deleted with no grace period, so a recovery
  waiting for it proceeds.

No kopf here: events go out through the reconciler's `post`.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from corefleet_operator import constants
from corefleet_operator.actions import Action, Apply, CancelResize, Delete, Event, StartResize
from corefleet_operator.clock import SYSTEM_CLOCK, Clock
from corefleet_operator.frontend_api import FrontendAPI
from corefleet_operator.kube import Kube, KubeError
from corefleet_operator.observe import PodObs, Terminating, controller_uid
from corefleet_operator.planner import parse_time

EXPECTATION_SECONDS = 30.0  # how long a created pod may stay unseen before it is applied again
STUCK_TERMINATION_SECONDS = 30.0  # a pod still there this long past its deletion deadline is force-deleted
MAX_MESSAGE_CHARS = 400  # of each server message kept


class PendingCreates:
    """Pods this reconciler created that the watch has not shown yet (style: "expectations").

    A reconcile that runs before the watch delivers a new pod would apply it again; server-side
    apply makes that harmless, but at scale it is ~6% wasted writes. A pod is skipped while it is
    expected (same name, configuration and incarnation), unseen, and younger than the deadline.
    Times are the caller's monotonic clock.
    """

    def __init__(self) -> None:
        self._pods: dict[str, tuple[str, float]] = {}

    @staticmethod
    def _identity(obj: Mapping[str, Any]) -> str:
        ann = obj["metadata"].get("annotations") or {}
        return f"{ann.get(constants.ANNOTATION_SPEC_HASH)}/{ann.get(constants.ANNOTATION_GENERATION)}"

    def filter(self, actions: Iterable[Action], seen: set[str], now: float) -> list[Action]:
        self._pods = {n: e for n, e in self._pods.items() if n not in seen and e[1] > now}
        out = []
        for a in actions:
            if isinstance(a, Apply) and a.obj["kind"] == "Pod":
                name = str(a.obj["metadata"]["name"])
                if self._pods.get(name, ("", 0.0))[0] == self._identity(a.obj):
                    continue
            out.append(a)
        return out

    def created(self, obj: Mapping[str, Any], now: float) -> None:
        self._pods[str(obj["metadata"]["name"])] = (self._identity(obj), now + EXPECTATION_SECONDS)


@dataclasses.dataclass(frozen=True)
class ActionFailure:
    """An action on a child that did not happen: the object, and the API server's reason (or ours)."""

    target: str  # "Pod a-engine-0"
    message: str
    conflict: bool = False  # the name is taken by an object this fleet does not control

    def describe(self) -> str:
        return f"{self.target}: {self.message}"


class Conflict(Exception):
    """An object of a child's name exists and is not controlled by this EngineCoreSet."""


def target(kind: str, name: str) -> str:
    """How an action's object is named in failures and events: "Pod a-engine-0"."""
    return f"{kind} {name}"


def _key(action: Action) -> tuple[str, str]:
    if isinstance(action, Apply):
        return action.key
    if isinstance(action, Delete):
        return action.kind, action.name
    return "resize", action.resize_id


def _foreign(obj: Mapping[str, Any], fleet_uid: str) -> str:
    """Why `obj` (an object of a child's name) is not the fleet's to write, or "" if it is."""
    owner = controller_uid(obj.get("metadata") or {})
    if owner == fleet_uid:
        return ""
    refs = [r for r in obj["metadata"].get("ownerReferences") or () if r.get("controller")]
    who = f"{refs[0].get('kind')} {refs[0].get('name')}" if refs else "no controller (not created by corefleet)"
    return (f"it exists and is controlled by {who}, not by this {constants.KIND}: corefleet will not take it "
            "over (delete it, or rename the fleet)")


async def _apply_child(kube: Kube, obj: Mapping[str, Any], fleet_uid: str, observed_own: bool) -> None:
    """Create or converge one child without taking over an object the fleet does not control.

    Pods are only ever created (never changed in place): a plain create, which fails with 409 on a
    taken name. Other children are server-side applied (with force: the fleet owns their every
    field) once they are known to be the fleet's: observed in its own index, or read and found to be
    controlled by it (the watch may lag), or absent (created by the apply; a foreign object created
    in the moment between the read and the apply is the one race left)."""
    meta = obj["metadata"]
    kind, name, namespace = str(obj["kind"]), str(meta["name"]), str(meta["namespace"])
    if kind == "Pod":
        try:
            await kube.create(obj)
        except KubeError as e:
            if e.status != 409:
                raise
            have = await kube.get(str(obj["apiVersion"]), kind, namespace, name)
            if have is not None and (why := _foreign(have, fleet_uid)):
                raise Conflict(why) from None
        return
    if not observed_own:
        have = await kube.get(str(obj["apiVersion"]), kind, namespace, name)
        if have is not None and (why := _foreign(have, fleet_uid)):
            raise Conflict(why)
    await kube.apply(obj)


def stuck_terminations(pods: Iterable[Terminating], now: datetime.datetime,
                       margin: float) -> tuple[list[Terminating], float | None]:
    """The pods still there `margin` seconds past their deletion deadline, and the seconds until the
    next one is (None: no other pod is terminating). Pure."""
    stuck, wait = [], None
    for pod in pods:
        try:
            deadline = parse_time(pod.deadline)
        except ValueError:
            continue
        if deadline is None:
            continue
        left = (deadline - now).total_seconds() + margin
        if left <= 0:
            stuck.append(pod)
        else:
            wait = left if wait is None else min(wait, left)
    return stuck, wait


class Executor:
    """Carries out one fleet's actions (one per reconciler: it keeps the pods it created and expects).

    `kube` writes the children in `namespace` as the fleet's (`fleet_uid`: the EngineCoreSet's UID, the
    controller of its every child); `frontend` (None: resize actions are skipped) takes the resizes;
    `clock` times the expectations and says when a terminating pod is stuck."""

    def __init__(self, kube: Kube, namespace: str, fleet_uid: str, *, frontend: FrontendAPI | None = None,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.kube = kube
        self.namespace = namespace
        self.fleet_uid = fleet_uid
        self.frontend = frontend
        self.clock = clock
        self.pending = PendingCreates()

    def unexpected(self, actions: Iterable[Action], seen: Iterable[str]) -> list[Action]:
        """The actions less the creates of pods created earlier and still expected (not in `seen`: the
        names of the pods the watch shows)."""
        return self.pending.filter(actions, set(seen), self.clock.monotonic())

    async def carry_out(self, actions: Iterable[Action], *, own: Iterable[tuple[str, str]] = (),
                        frontend_at: PodObs | None = None, token: str = "") -> list[ActionFailure]:
        """Carry the plan's actions out in order; resize calls go to the frontend's admin API (the pod
        `frontend_at`, with the admin `token`).

        An action the API server refuses (quota, PodSecurity, a webhook, ...) or that would take over an
        object the fleet does not control (`own`: the (kind, name) of the children observed as the
        fleet's) is returned as an `ActionFailure` and the others still run. Transport errors propagate
        (the reconcile is retried as a whole)."""
        owned = set(own)
        failures: list[ActionFailure] = []
        for action in actions:
            key = _key(action)
            try:
                await self._carry_out(action, key in owned, frontend_at, token)
            except Conflict as e:
                failures.append(ActionFailure(target(*key), str(e), conflict=True))
            except KubeError as e:
                verb = "write" if isinstance(action, Apply) else "delete"
                detail = str(e.detail)[:MAX_MESSAGE_CHARS]
                failures.append(ActionFailure(target(*key), f"{verb} refused ({e.status}): {detail}"))
        return failures

    async def _carry_out(self, action: Action, observed_own: bool, frontend_at: PodObs | None, token: str) -> None:
        if isinstance(action, Apply):
            await _apply_child(self.kube, action.obj, self.fleet_uid, observed_own)
            if action.key[0] == "Pod":
                self.pending.created(action.obj, self.clock.monotonic())
        elif isinstance(action, Delete):
            await self.kube.delete(action.api_version, action.kind, self.namespace, action.name, action.uid,
                                   grace_period_seconds=action.grace_seconds)
        elif isinstance(action, StartResize) and self.frontend is not None:
            await self.frontend.start(frontend_at, token, action)
        elif isinstance(action, CancelResize) and self.frontend is not None:
            await self.frontend.cancel(frontend_at, token, action)

    async def force_delete_stuck(self, terminating: Iterable[Terminating],
                                 post: Callable[[Event], None]) -> tuple[list[ActionFailure], float | None]:
        """Delete with no grace period the fleet pods stuck terminating (their node is lost), each with an
        event (`post`); returns the deletes refused, and the seconds until the next terminating pod
        counts as stuck (None: no other pod is terminating)."""
        margin = STUCK_TERMINATION_SECONDS  # read at each call: a test of the real thing shortens it
        stuck, next_due = stuck_terminations(terminating, self.clock.now(), margin)
        failures = []
        for pod in stuck:
            try:
                if await self.kube.delete("v1", "Pod", self.namespace, pod.name, pod.uid, grace_period_seconds=0):
                    where = f"node {pod.node}" if pod.node else "no node"
                    post(Event("Warning", "ForceDeleted",
                               f"pod {pod.name} was still terminating {margin:.0f}s past its grace period "
                               f"(deadline {pod.deadline}; {where} does not confirm: lost?): deleted it "
                               "with gracePeriodSeconds=0 so the fleet can recover"))
            except KubeError as e:
                detail = str(e.detail)[:MAX_MESSAGE_CHARS]
                failures.append(ActionFailure(target("Pod", pod.name), f"force delete refused ({e.status}): {detail}"))
        return failures, next_due
