# SPDX-License-Identifier: Apache-2.0
"""EngineCoreSet reconciliation in kopf: the indexes of the fleets' children and one daemon per fleet.

One kopf daemon per EngineCoreSet runs a reconcile pass (`reconciler.FleetReconciler`: observe, plan,
write the status once, post the plan's events, carry out its actions) and then sleeps until something
wakes it: a change of the EngineCoreSet, a change of one of its children (pods, Services, Secret,
PodDisruptionBudget, NetworkPolicy, all watched through kopf indexes with a server-side label
selector), or the timer. The daemon is also what runs on operator start (resume) and on create;
there are no create/update handlers, so kopf keeps no progress or diff-base of its own on our objects.
A failing pass (an exception, or refused actions) backs off (`reconciler.Backoff`): the daemon ignores
wake-ups for a while and retries on a doubling timer instead of on every wake-up.

A child is the fleet's only if its controller ownerReference is this EngineCoreSet's UID: the indexes
are keyed by it (`observe.ChildKey`), so a pod or Service that merely carries the fleet's labels is not
observed. What the daemon gives its reconciler (the API client, the planner's settings, the clocks)
comes from kopf's memo, filled at start-up (`handlers.lifecycle`).
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from corefleet_operator import constants, metrics
from corefleet_operator.actions import Event
from corefleet_operator.clock import SYSTEM_CLOCK, Clock
from corefleet_operator.kube import KubeError
from corefleet_operator.observe import ChildKey, PodObs, Terminating, controller_uid, pod_obs
from corefleet_operator.reconciler import FLEET_METRICS, Backoff, FleetIndexes, FleetReconciler

logger = logging.getLogger(__name__)

RESYNC_SECONDS = 60.0  # the timer: reconcile at least this often even if nothing was seen
ECS = (constants.GROUP, constants.VERSION, constants.PLURAL)
# Children of a fleet. (The server-side label selector set at startup already limits the watches
# to objects managed by corefleet; see handlers/lifecycle.py.)
OWNED = {constants.LABEL_FLEET: kopf.PRESENT}


# ---- observation: kopf's indexes keep compact copies of the children (observe.pod_obs) --------
def _wake(memo: Any, key: tuple[str, str]) -> None:
    event = memo.wakeups.get(key) if hasattr(memo, "wakeups") else None
    if event is not None:
        event.set()


def _fleet_key(namespace: str | None, labels: Mapping[str, str]) -> tuple[str, str]:
    return str(namespace), labels[constants.LABEL_FLEET]


def _child_key(namespace: str | None, labels: Mapping[str, str], meta: Mapping[str, Any]) -> ChildKey:
    return str(namespace), labels[constants.LABEL_FLEET], controller_uid(meta)


@kopf.index("pods", labels=OWNED)
def fleet_pods(name: str, namespace: str | None, labels: Mapping[str, str], meta: kopf.Meta,
               spec: kopf.Spec, status: kopf.Status, **_: Any) -> dict[ChildKey, PodObs]:
    return {_child_key(namespace, labels, meta): pod_obs(name, meta, spec, status)}


@kopf.index("pods", labels=OWNED)
def fleet_terminating(name: str, namespace: str | None, labels: Mapping[str, str], meta: kopf.Meta,
                      spec: kopf.Spec, **_: Any) -> dict[ChildKey, Terminating]:
    if not meta.get("deletionTimestamp"):
        return {}
    return {_child_key(namespace, labels, meta): Terminating(name, str(meta.get("uid", "")),
                                                             str(meta["deletionTimestamp"]),
                                                             str(spec.get("nodeName") or ""))}


def _object(kind: str, body: Mapping[str, Any]) -> tuple[str, str, dict[str, Any]]:
    return kind, str(body["metadata"]["name"]), copy.deepcopy(dict(body))


@kopf.index("services", labels=OWNED)
def fleet_services(namespace: str | None, labels: Mapping[str, str], meta: kopf.Meta, body: kopf.Body,
                   **_: Any) -> dict[ChildKey, tuple[str, str, dict[str, Any]]]:
    return {_child_key(namespace, labels, meta): _object("Service", body)}


@kopf.index("secrets", labels=OWNED)
def fleet_secrets(namespace: str | None, labels: Mapping[str, str], meta: kopf.Meta, body: kopf.Body,
                  **_: Any) -> dict[ChildKey, tuple[str, str, dict[str, Any]]]:
    return {_child_key(namespace, labels, meta): _object("Secret", body)}


@kopf.index("networking.k8s.io", "v1", "networkpolicies", labels=OWNED)
def fleet_netpols(namespace: str | None, labels: Mapping[str, str], meta: kopf.Meta, body: kopf.Body,
                  **_: Any) -> dict[ChildKey, tuple[str, str, dict[str, Any]]]:
    return {_child_key(namespace, labels, meta): _object("NetworkPolicy", body)}


@kopf.index("policy", "v1", "poddisruptionbudgets", labels=OWNED)
def fleet_pdbs(namespace: str | None, labels: Mapping[str, str], meta: kopf.Meta, body: kopf.Body,
               **_: Any) -> dict[ChildKey, tuple[str, str, dict[str, Any]]]:
    return {_child_key(namespace, labels, meta): _object("PodDisruptionBudget", body)}


POD_INDEX = "fleet_pods"
TERMINATING_INDEX = "fleet_terminating"
OBJECT_INDEXES = ("fleet_services", "fleet_secrets", "fleet_netpols", "fleet_pdbs")
INDEXES = (POD_INDEX, TERMINATING_INDEX, *OBJECT_INDEXES)


def fleet_indexes(indexes: Mapping[str, Any]) -> FleetIndexes:
    """kopf's indexes (passed to handlers by their names) as the reconciler reads them."""
    return FleetIndexes(pods=indexes[POD_INDEX], terminating=indexes[TERMINATING_INDEX],
                        objects=tuple(indexes[name] for name in OBJECT_INDEXES))


# ---- wake-ups ---------------------------------------------------------------------------------
# kopf updates its indexes before it calls event handlers, so a fleet woken from here sees the
# change that woke it. (Waking from the index functions themselves would race with that update.)
@kopf.on.event("pods", labels=OWNED)
@kopf.on.event("services", labels=OWNED)
@kopf.on.event("secrets", labels=OWNED)
@kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels=OWNED)
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=OWNED)
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


# ---- the daemon -------------------------------------------------------------------------------
def _poster(body: kopf.Body) -> Callable[[Event], None]:
    """Events on the EngineCoreSet, through kopf (which posts them in the background)."""

    def post(event: Event) -> None:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    return post


@kopf.daemon(*ECS, cancellation_timeout=30.0)
async def fleet(body: kopf.Body, name: str, namespace: str | None, memo: Any, stopped: kopf.DaemonStopped,
                logger: kopf.Logger, **kwargs: Any) -> None:
    """One per EngineCoreSet: reconcile, then sleep until woken (or the resync timer); a failing
    reconcile (an exception, or refused actions) backs off instead of retrying on every wake-up."""
    key = (str(namespace), name)
    wake = asyncio.Event()
    memo.wakeups[key] = wake
    clock: Clock = getattr(memo, "clock", SYSTEM_CLOCK)
    reconciler = FleetReconciler(memo.kube, body, settings=memo.plan_settings, post=_poster(body), clock=clock)
    indexes = fleet_indexes(kwargs)  # kopf passes them by name
    resync = float(getattr(memo, "resync_seconds", RESYNC_SECONDS))
    backoff = Backoff()
    metrics.FLEETS.inc()
    try:
        while not stopped:
            wake.clear()
            delay, deaf = await _pass(reconciler, indexes, backoff, resync, logger)
            await _sleep(wake, stopped, delay, deaf, clock)
    finally:
        metrics.FLEETS.dec()
        if memo.wakeups.get(key) is wake:
            del memo.wakeups[key]
        if body.get("metadata", {}).get("deletionTimestamp"):
            FLEET_METRICS.forget(*key)


async def _pass(reconciler: FleetReconciler, indexes: FleetIndexes, backoff: Backoff, resync: float,
                logger: kopf.Logger) -> tuple[float, float]:
    """One reconcile pass, counted; returns how long to sleep after it and how much of that deaf to wake-ups."""
    try:
        with metrics.RECONCILE_SECONDS.time():
            requeue = await reconciler.reconcile(indexes)
    except (TimeoutError, KubeError, OSError) as e:
        metrics.RECONCILES.labels("error").inc()
        wait, deaf = backoff.failed()
        logger.warning("reconcile failed, retrying in %.0f s: %s: %s", wait, type(e).__name__, e)
        return wait, deaf
    except Exception:
        metrics.RECONCILES.labels("error").inc()
        wait, deaf = backoff.failed()
        logger.exception("reconcile failed unexpectedly, retrying in %.0f s", wait)
        return wait, deaf
    delay = resync if requeue is None else min(resync, max(requeue, 0.2))
    if not reconciler.failing:
        metrics.RECONCILES.labels("ok").inc()
        backoff.succeeded()
        return delay, 0.0
    metrics.RECONCILES.labels("error").inc()
    wait, deaf = backoff.failed()
    logger.warning("actions failed, retrying in %.0f s: %s", wait, "; ".join(f.describe() for f in reconciler.failures))
    return min(delay, wait), deaf


async def _sleep(wake: asyncio.Event, stopped: kopf.DaemonStopped, seconds: float, deaf: float = 0.0,
                 clock: Clock = SYSTEM_CLOCK) -> None:
    """Until woken, stopped, or `seconds` pass; wake-ups in the first `deaf` seconds count only after them.
    (`clock.monotonic` must be the event loop's clock: the timeouts of `asyncio.wait` run on it.)"""
    started = clock.monotonic()
    stopper = asyncio.ensure_future(stopped.wait())  # kopf's awaitable promise, not a coroutine
    waiter: asyncio.Future[Any] | None = None
    try:
        if deaf > 0:
            await asyncio.wait({stopper}, timeout=min(deaf, seconds))
            if stopper.done():
                return
        left = seconds - (clock.monotonic() - started)
        if left <= 0:
            return
        waiter = asyncio.ensure_future(wake.wait())
        await asyncio.wait({waiter, stopper}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (waiter, stopper):
            if t is not None:
                t.cancel()
