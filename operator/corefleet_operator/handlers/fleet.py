# SPDX-License-Identifier: Apache-2.0
"""EngineCoreSet reconciliation: one path, triggered by everything that can change the answer.

One kopf daemon per EngineCoreSet runs `reconcile` — observe, plan (pure), write the status once if
it changed, carry out the actions, emit events — and then sleeps until something wakes it: a
change of the EngineCoreSet, a change of one of its children (pods, Services, Secret,
NetworkPolicy, all watched through kopf indexes with a server-side label selector), or the timer.
The daemon is also what runs on operator start (resume) and on create; there are no
create/update handlers, so kopf keeps no progress or diff-base of its own on our objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import datetime
import logging
import secrets
import time
from collections.abc import Iterable, Mapping
from typing import Any, get_args

import kopf

from corefleet_operator import constants, metrics
from corefleet_operator.frontend_api import FrontendAPI
from corefleet_operator.kube import Kube, KubeError
from corefleet_operator.models import EngineCoreSetSpec, FleetPhase, FleetRef, SpecError
from corefleet_operator.observe import (
    FrontendObs,
    Observed,
    PodObs,
    frontend_pod,
    observe,
    pod_obs,
    resize_in_flight,
)
from corefleet_operator.planner import Action, Apply, CancelResize, Delete, Plan, StartResize, plan, plan_invalid
from corefleet_operator.status import status_patch

logger = logging.getLogger(__name__)

RESYNC_SECONDS = 60.0  # the timer: reconcile at least this often even if nothing was seen
MAX_BACKOFF_SECONDS = 60.0
ECS = (constants.GROUP, constants.VERSION, constants.PLURAL)
# Children of a fleet. (The server-side label selector set at startup already limits the watches
# to objects managed by corefleet; see handlers/lifecycle.py.)
OWNED = {constants.LABEL_FLEET: kopf.PRESENT}


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- observation: kopf's indexes keep compact copies of the children (observe.pod_obs) --------
def _wake(memo: Any, key: tuple[str, str]) -> None:
    event = memo.wakeups.get(key) if hasattr(memo, "wakeups") else None
    if event is not None:
        event.set()


def _fleet_key(namespace: str | None, labels: Mapping[str, str]) -> tuple[str, str]:
    return str(namespace), labels[constants.LABEL_FLEET]


@kopf.index("pods", labels=OWNED)
def fleet_pods(name: str, namespace: str | None, labels: Mapping[str, str], meta: kopf.Meta,
               spec: kopf.Spec, status: kopf.Status, **_: Any) -> dict[tuple[str, str], PodObs]:
    return {_fleet_key(namespace, labels): pod_obs(name, meta, spec, status)}


def _object(kind: str, body: Mapping[str, Any]) -> tuple[str, str, dict[str, Any]]:
    return kind, str(body["metadata"]["name"]), copy.deepcopy(dict(body))


@kopf.index("services", labels=OWNED)
def fleet_services(namespace: str | None, labels: Mapping[str, str], body: kopf.Body,
                   **_: Any) -> dict[tuple[str, str], tuple[str, str, dict[str, Any]]]:
    return {_fleet_key(namespace, labels): _object("Service", body)}


@kopf.index("secrets", labels=OWNED)
def fleet_secrets(namespace: str | None, labels: Mapping[str, str], body: kopf.Body,
                  **_: Any) -> dict[tuple[str, str], tuple[str, str, dict[str, Any]]]:
    return {_fleet_key(namespace, labels): _object("Secret", body)}


@kopf.index("networking.k8s.io", "v1", "networkpolicies", labels=OWNED)
def fleet_netpols(namespace: str | None, labels: Mapping[str, str], body: kopf.Body,
                  **_: Any) -> dict[tuple[str, str], tuple[str, str, dict[str, Any]]]:
    return {_fleet_key(namespace, labels): _object("NetworkPolicy", body)}


# ---- wake-ups ---------------------------------------------------------------------------------
# kopf updates its indexes before it calls event handlers, so a fleet woken from here sees the
# change that woke it. (Waking from the index functions themselves would race with that update.)
@kopf.on.event("pods", labels=OWNED)
@kopf.on.event("services", labels=OWNED)
@kopf.on.event("secrets", labels=OWNED)
@kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels=OWNED)
def child_changed(namespace: str | None, labels: Mapping[str, str], memo: Any, **_: Any) -> None:
    _wake(memo, _fleet_key(namespace, labels))


@kopf.on.event(*ECS)
def fleet_changed(name: str, namespace: str | None, memo: Any, **_: Any) -> None:
    _wake(memo, (str(namespace), name))


WAKE_HANDLERS = ("child_changed", "fleet_changed")


class QuietWakeups(logging.Filter):
    """Drops kopf's INFO line for every call of the wake-up handlers (one per child event: thousands
    of lines a minute at 200 fleets); their failures are still logged."""

    QUIET = frozenset(f"Handler '{h}' succeeded." for h in WAKE_HANDLERS)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.INFO and record.getMessage() in self.QUIET)


# ---- the reconcile path -----------------------------------------------------------------------
def make_plan(body: Mapping[str, Any], observed: Observed) -> Plan:
    meta = body["metadata"]
    try:
        spec = EngineCoreSetSpec.parse(body.get("spec") or {})
    except SpecError as e:
        return plan_invalid(e, observed, now())
    fleet = FleetRef(name=str(meta["name"]), namespace=str(meta["namespace"]), uid=str(meta["uid"]), spec=spec)
    return plan(fleet, observed, now())


EXPECTATION_SECONDS = 30.0  # how long a created pod may stay unseen before it is applied again


class PendingCreates:
    """Pods this reconciler created that the watch has not shown yet (style: "expectations").

    A reconcile that runs before the watch delivers a new pod would apply it again; server-side
    apply makes that harmless, but at scale it is ~6% wasted writes. A pod is skipped while it is
    expected (same name, configuration and incarnation), unseen, and younger than the deadline.
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


async def carry_out(kube: Kube, namespace: str, actions: Iterable[Action], pending: PendingCreates | None = None,
                    frontend: FrontendAPI | None = None, frontend_at: PodObs | None = None, token: str = "") -> None:
    """Carry the plan's actions out in order; resize calls go to the frontend's admin API."""
    for action in actions:
        if isinstance(action, Apply):
            await kube.apply(action.obj)
            if pending is not None and action.obj["kind"] == "Pod":
                pending.created(action.obj, time.monotonic())
        elif isinstance(action, Delete):
            await kube.delete(action.api_version, action.kind, namespace, action.name, action.uid)
        elif isinstance(action, StartResize) and frontend is not None:
            await frontend.start(frontend_at, token, action)
        elif isinstance(action, CancelResize) and frontend is not None:
            await frontend.cancel(frontend_at, token, action)


PHASES: tuple[str, ...] = get_args(FleetPhase)


def publish(namespace: str, name: str, the_plan: Plan) -> None:
    """The fleet's phase and recoveries as metrics."""
    for phase in PHASES:
        metrics.FLEET_PHASE.labels(namespace, name, phase).set(1 if the_plan.status.phase == phase else 0)
    metrics.RECOVERIES.labels(namespace, name).set(the_plan.status.recoveries)


def forget(namespace: str, name: str) -> None:
    """Drop a deleted fleet's series."""
    with contextlib.suppress(KeyError):
        for phase in PHASES:
            metrics.FLEET_PHASE.remove(namespace, name, phase)
        metrics.RECOVERIES.remove(namespace, name)


class FleetReconciler:
    """The state one daemon keeps between its reconciles: only caches of its own writes."""

    def __init__(self, kube: Kube, body: kopf.Body) -> None:
        self.kube = kube
        self.body = body
        self.written_status: dict[str, Any] | None = None  # what we last wrote (the watch may lag)
        self.token = secrets.token_urlsafe(32)  # used only until the admin Secret is observed
        self.pending = PendingCreates()
        self.frontend = FrontendAPI()

    async def reconcile(self, indexes: Mapping[str, kopf.Index[Any, Any]]) -> float | None:
        """One pass; returns how soon to look again regardless of events (None: at the resync)."""
        body = self.body
        meta = body["metadata"]
        if meta.get("deletionTimestamp"):
            return None  # owned children go with the EngineCoreSet (garbage collection)
        name, namespace = str(meta["name"]), str(meta["namespace"])
        key = (namespace, name)
        stored = self.written_status if self.written_status is not None else dict(body.get("status") or {})
        pods_index, *object_indexes = INDEXES
        objects = [o for idx in object_indexes for o in indexes[idx].get(key, [])]
        observed = observe(body, stored, indexes[pods_index].get(key, []), objects, self.token)
        frontend_at = frontend_pod(observed, name)
        if (resize_id := resize_in_flight(observed)) is not None:
            seen: FrontendObs = await self.frontend.observe(frontend_at, observed.admin_token, resize_id)
            observed = dataclasses.replace(observed, frontend=seen)
        the_plan = make_plan(body, observed)
        publish(namespace, name, the_plan)
        patch = status_patch(stored, the_plan.status)
        if patch is not None:
            await self.kube.patch_status(namespace, name, patch)
            self.written_status = the_plan.status.to_json()
        actions = self.pending.filter(the_plan.actions, {p.name for p in observed.pods}, time.monotonic())
        await carry_out(self.kube, namespace, actions, self.pending, self.frontend, frontend_at, observed.admin_token)
        for ev in the_plan.events:
            kopf.event(body, type=ev.type, reason=ev.reason, message=ev.message)
        return the_plan.requeue_after


INDEXES = ("fleet_pods", "fleet_services", "fleet_secrets", "fleet_netpols")


@kopf.daemon(*ECS, cancellation_timeout=30.0)
async def fleet(body: kopf.Body, name: str, namespace: str | None, memo: Any, stopped: kopf.DaemonStopped,
                logger: kopf.Logger, **kwargs: Any) -> None:
    """One per EngineCoreSet: reconcile, then sleep until woken (or the resync timer)."""
    key = (str(namespace), name)
    wake = asyncio.Event()
    memo.wakeups[key] = wake
    reconciler = FleetReconciler(memo.kube, body)
    indexes: dict[str, kopf.Index[Any, Any]] = {idx: kwargs[idx] for idx in INDEXES}  # kopf passes them by name
    resync = float(getattr(memo, "resync_seconds", RESYNC_SECONDS))
    backoff = 1.0
    metrics.FLEETS.inc()
    try:
        while not stopped:
            wake.clear()
            delay = resync
            try:
                with metrics.RECONCILE_SECONDS.time():
                    requeue = await reconciler.reconcile(indexes)
                metrics.RECONCILES.labels("ok").inc()
                if requeue is not None:
                    delay = min(delay, max(requeue, 0.2))
                backoff = 1.0
            except (TimeoutError, KubeError, OSError) as e:
                metrics.RECONCILES.labels("error").inc()
                logger.warning("reconcile failed, retrying in %.0f s: %s: %s", backoff, type(e).__name__, e)
                delay, backoff = backoff, min(backoff * 2, MAX_BACKOFF_SECONDS)
            except Exception:
                metrics.RECONCILES.labels("error").inc()
                logger.exception("reconcile failed unexpectedly, retrying in %.0f s", backoff)
                delay, backoff = backoff, min(backoff * 2, MAX_BACKOFF_SECONDS)
            await _sleep(wake, stopped, delay)
    finally:
        metrics.FLEETS.dec()
        if memo.wakeups.get(key) is wake:
            del memo.wakeups[key]
        if body.get("metadata", {}).get("deletionTimestamp"):
            forget(*key)


async def _sleep(wake: asyncio.Event, stopped: kopf.DaemonStopped, seconds: float) -> None:
    """Until woken, stopped, or `seconds` pass."""
    waiter = asyncio.ensure_future(wake.wait())
    stopper = asyncio.ensure_future(stopped.wait())  # kopf's awaitable promise, not a coroutine
    try:
        await asyncio.wait({waiter, stopper}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (waiter, stopper):
            t.cancel()
