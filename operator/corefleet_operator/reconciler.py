# SPDX-License-Identifier: Apache-2.0
"""One reconcile pass of an EngineCoreSet, and the memory one fleet's reconciler keeps between passes.

A pass (`FleetReconciler.reconcile`) observes the fleet (its children as the kopf indexes show them,
its stored status, and what the frontend's admin API says), plans (pure: `planner.plan`), writes the
status once if it changed, posts the plan's events and carries out its actions (`executor.Executor`).
The kopf daemon (`handlers.fleet`) runs it on every wake-up and on the timer and sleeps between passes;
this module imports no kopf: the indexes come in as plain mappings (`FleetIndexes`) and events go out
through a `post` callback.

Failure handling (issue #9):

* An action the API server refuses is a Warning event `ActionFailed` naming the object and the server's
  message, and, through the one status write of the next pass, the condition Degraded=True
  (`ActionsFailing`, or `ChildConflict` when every failure is a taken name). The reconciler keeps one
  pass's failures for the next pass's status (a refusal repeated with the same message is not posted
  again); a pass without failures clears them. A failing fleet backs off (`Backoff`): the daemon ignores
  wake-ups for up to `DEAF_SECONDS` and retries on a doubling timer (up to `MAX_BACKOFF_SECONDS`). A
  status write the API server refuses is a `StatusWriteFailed` event, and nothing else is done in that pass.
* The admin token: the reconciler remembers the last token it saw in the fleet's admin Secret, so a
  deleted Secret is written back with the token the running frontend already uses (it reads it once,
  at start). After an operator restart with the Secret gone that token is lost (Kubernetes keeps no
  other copy, on purpose: not in the pod spec, an annotation or the status): the Secret is written
  with a new token and the frontend pod is deleted, so the fleet recovers with a frontend that uses it.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, get_args

from corefleet_operator import constants, metrics
from corefleet_operator.actions import Delete, Event
from corefleet_operator.clock import SYSTEM_CLOCK, Clock, timestamp
from corefleet_operator.executor import MAX_MESSAGE_CHARS, ActionFailure, Executor, target
from corefleet_operator.frontend_api import FrontendAPI
from corefleet_operator.kube import Kube, KubeError
from corefleet_operator.models import (
    Condition,
    EngineCoreSetSpec,
    EngineCoreSetStatus,
    FleetPhase,
    FleetRef,
    ParsedStatus,
    SpecError,
)
from corefleet_operator.observe import (
    ChildKey,
    Observed,
    PodObs,
    Terminating,
    fleet_view_due,
    frontend_pod,
    observe,
    resize_in_flight,
)
from corefleet_operator.planner import FRONTEND_POLL_SECONDS, IDLE_POLL_SECONDS, Plan, PlanSettings, plan, plan_invalid
from corefleet_operator.status import DEGRADED, set_condition, status_patch

logger = logging.getLogger(__name__)

STATUS_UNREADABLE_RETRY_SECONDS = 30.0  # a status that cannot be read is looked at again this often
FAILURES_CLEARED_REQUEUE_SECONDS = 0.2  # the pass after failures cleared comes at once (their condition goes)
MAX_FAILURES_SHOWN = 5  # failed actions named in the Degraded condition (the status stays small)
FIRST_BACKOFF_SECONDS = 1.0  # a failing reconcile is retried after 1, 2, 4, ... seconds
MAX_BACKOFF_SECONDS = 60.0  # ... up to this many
DEAF_SECONDS = 5.0  # ... and ignores wake-ups for up to this long (a failing fleet does not spin on its events)


class Backoff:
    """The daemon's retry timing of one fleet: after each failing pass (an exception, or refused actions)
    the next waits twice as long (`FIRST_BACKOFF_SECONDS`, doubling up to `MAX_BACKOFF_SECONDS`), deaf to
    wake-ups for up to `DEAF_SECONDS` of it; a pass that succeeds starts over."""

    def __init__(self) -> None:
        self.seconds = FIRST_BACKOFF_SECONDS  # the wait after the next failure

    def failed(self) -> tuple[float, float]:
        """This failure's (wait, deaf) seconds; the next failure's wait doubles."""
        wait, deaf = self.seconds, min(self.seconds, DEAF_SECONDS)
        self.seconds = min(self.seconds * 2, MAX_BACKOFF_SECONDS)
        return wait, deaf

    def succeeded(self) -> None:
        self.seconds = FIRST_BACKOFF_SECONDS


@dataclasses.dataclass(frozen=True)
class FleetIndexes:
    """The fleets' children as the watches show them (kopf's indexes, read as plain mappings), by `ChildKey`:
    the pods (compact copies), the pods being deleted, and the other children's bodies per index."""

    pods: Mapping[ChildKey, Iterable[PodObs]]
    terminating: Mapping[ChildKey, Iterable[Terminating]]
    objects: Sequence[Mapping[ChildKey, Iterable[tuple[str, str, dict[str, Any]]]]]

    def objects_of(self, key: ChildKey) -> list[tuple[str, str, dict[str, Any]]]:
        return [o for index in self.objects for o in index.get(key, [])]


FLEET_METRICS = metrics.FleetMetrics(get_args(FleetPhase))


def publish(namespace: str, name: str, spec: Mapping[str, Any], status: EngineCoreSetStatus) -> None:
    """The fleet's phase, sizes, recoveries and resizes as metrics."""
    desired = int(spec.get("replicas") or 0)
    FLEET_METRICS.publish(namespace, name, phase=status.phase, desired=desired, committed=status.replicas,
                          ready=status.readyReplicas, maximum=int(spec.get("maxReplicas") or desired),
                          recoveries=status.recoveries, operation=status.operation)


def make_plan(body: Mapping[str, Any], observed: Observed, settings: PlanSettings, now: str) -> Plan:
    """The plan for the EngineCoreSet `body` (its spec parsed here, at the edge; an invalid one is planned as such)."""
    meta = body["metadata"]
    try:
        spec = EngineCoreSetSpec.parse(body.get("spec") or {})
    except SpecError as e:
        return plan_invalid(e, observed, now)
    fleet = FleetRef(name=str(meta["name"]), namespace=str(meta["namespace"]), uid=str(meta["uid"]), spec=spec)
    return plan(fleet, observed, now, settings)


def with_action_failures(status: EngineCoreSetStatus, failures: Iterable[ActionFailure], generation: int,
                         now: str) -> EngineCoreSetStatus:
    """The planned status, with Degraded=True saying which actions failed and why (pure).

    The reconciler carries the last pass's failures into this pass's one status write; without
    failures the planned status is returned as it is."""
    failures = list(failures)
    if not failures:
        return status
    reason = "ChildConflict" if all(f.conflict for f in failures) else "ActionsFailing"
    shown = "; ".join(f.describe() for f in failures[:MAX_FAILURES_SHOWN])
    more = f" (and {len(failures) - MAX_FAILURES_SHOWN} more)" if len(failures) > MAX_FAILURES_SHOWN else ""
    condition = Condition(type=DEGRADED, status="True", reason=reason, message=shown + more,
                          lastTransitionTime=now, observedGeneration=generation)
    return dataclasses.replace(status, conditions=set_condition(status.conditions, condition))


def _withheld(event: Event, blocked: set[str], failing: bool) -> bool:
    """Whether a plan's event is held back while actions fail: a "Repaired" of an object whose write is
    refused (a claim that is not true), and "ReadyTimeout" (the planner compares it with the stored
    Degraded condition, which says ActionsFailing meanwhile: it would repeat on every pass; it is posted
    once the failures clear, if the fleet is still not ready)."""
    if event.reason == "Repaired":
        return any(event.message.startswith(f"{t} ") for t in blocked)
    return event.reason == "ReadyTimeout" and failing


class FleetReconciler:
    """The state one daemon keeps between its reconciles: caches of its own writes, the admin token
    it last saw, and the actions that failed (carried into the next status).

    `body` is the EngineCoreSet as the watch shows it (kopf's live view: newer after each event);
    `settings` are the planner's; `post` posts an event on the EngineCoreSet; `clock` gives the times
    (the plan's wall time, the expectations' and the frontend poll's monotonic deadlines)."""

    def __init__(self, kube: Kube, body: Mapping[str, Any], *, settings: PlanSettings, post: Callable[[Event], None],
                 clock: Clock = SYSTEM_CLOCK, frontend: FrontendAPI | None = None) -> None:
        self.kube = kube
        self.body = body
        self.settings = settings
        self.post = post
        self.clock = clock
        self.frontend = frontend if frontend is not None else FrontendAPI()
        meta = body["metadata"]
        self.executor = Executor(kube, str(meta["namespace"]), str(meta["uid"]), frontend=self.frontend, clock=clock)
        self.written_status: dict[str, Any] | None = None  # what we last wrote (the watch may lag)
        self.written_over = ""  # the resourceVersion of the body our last status write was planned on
        self.token = secrets.token_urlsafe(32)  # the admin token: a new one until the Secret is observed
        self.token_seen = False  # the token came from the fleet's Secret (the running frontend reads it)
        self.failures: list[ActionFailure] = []  # the last pass's failed actions
        self.failing = False  # the last pass had failed actions (the daemon backs off)
        self._next_stuck: float | None = None  # seconds until a terminating pod counts as stuck
        self.status_error = ""  # why the last status write was refused (shown once as an event)
        self.status_problem = ""  # what of the stored status could not be read (shown once as an event)
        self.fleet_view_at = 0.0  # when the frontend's view of the ranks may be read again (monotonic)
        self.removals_seen: set[str] = set()  # UIDs of the engine pods being removed at the last reconcile

    def _now(self) -> str:
        return timestamp(self.clock.now())

    def _post(self, events: Iterable[Event]) -> None:
        for ev in events:
            self.post(ev)

    async def reconcile(self, indexes: FleetIndexes) -> float | None:
        """One pass; returns how soon to look again regardless of events (None: at the resync).
        `failing` says whether an action failed (the daemon then backs off)."""
        meta = self.body["metadata"]
        self.failing = False
        if meta.get("deletionTimestamp"):
            return None  # owned children go with the EngineCoreSet (garbage collection)
        name, namespace, uid = str(meta["name"]), str(meta["namespace"]), str(meta["uid"])
        key = (namespace, name, uid)
        stored = self._stored_status()
        parsed = EngineCoreSetStatus.parse_report(stored)
        if parsed.problems and not self._status_readable(parsed):
            return STATUS_UNREADABLE_RETRY_SECONDS
        observed = observe(self.body, parsed.status, indexes.pods.get(key, []), indexes.objects_of(key), self.token)
        observed, lost_frontend = self._admin_token(observed, name)
        frontend_at = frontend_pod(observed, name)
        observed = await self._ask_frontend(observed, frontend_at)
        the_plan = make_plan(self.body, observed, self.settings, self._now())
        if any(ev.reason == "StatusLost" for ev in the_plan.events):
            self.fleet_view_at = 0.0  # the next pass reads what the frontend runs (`planner.resize.frontends_resize`)
        publish(namespace, name, self.body.get("spec") or {}, the_plan.status)
        blocked = {f.target for f in self.failures}
        status = with_action_failures(the_plan.status, self.failures, observed.generation, self._now())
        await self._write_status(namespace, name, stored, status)
        # The plan's events go out before its actions, so an action that fails cannot lose them.
        self._post(ev for ev in the_plan.events if not _withheld(ev, blocked, bool(self.failures)))
        actions = self.executor.unexpected(the_plan.actions, (p.name for p in observed.pods))
        failures = await self.executor.carry_out(actions, own=observed.objects.keys(), frontend_at=frontend_at,
                                                 token=observed.admin_token)
        if lost_frontend:
            failures += await self._replace_frontend(name, lost_frontend, failures, blocked)
        stuck_failures, self._next_stuck = await self.executor.force_delete_stuck(indexes.terminating.get(key, []),
                                                                                  self.post)
        return self._settle(namespace, name, failures + stuck_failures, the_plan.requeue_after)

    def _stored_status(self) -> dict[str, Any]:
        """The status to plan on: our last write, until the watch brings a newer body than the one it was
        planned on (then the body is at least as new: a status wiped or changed since is seen, not masked
        by the cache)."""
        if self.written_status is not None and str(self.body["metadata"].get("resourceVersion")) != self.written_over:
            self.written_status = None
        return self.written_status if self.written_status is not None else dict(self.body.get("status") or {})

    def _status_readable(self, parsed: ParsedStatus) -> bool:
        """Whether a stored status with unreadable parts may be reconciled. Parts that define the
        fleet (its incarnation, committed size, the resize in flight) unreadable: touch nothing (a
        guess could delete every pod), say so once; other parts: go on (the next status write
        replaces them), say so once."""
        problems = "; ".join(parsed.problems)[:MAX_MESSAGE_CHARS]
        if parsed.identity_unreadable:
            message = (f"the stored status cannot be read ({problems}): nothing is done until it is fixed, e.g. "
                       f"`kubectl patch ecs {self.body['metadata']['name']} --subresource=status --type=merge "
                       "-p '{\"status\":null}'` (the pods of the newest incarnation are then adopted)")
            reason = "StatusUnreadable"
        else:
            message = f"parts of the stored status could not be read and are rewritten: {problems}"
            reason = "StatusRepaired"
        if message != self.status_problem:
            self._post([Event("Warning", reason, message)])
            logger.warning("%s/%s: %s", self.body["metadata"].get("namespace"), self.body["metadata"]["name"], message)
        self.status_problem = message
        return not parsed.identity_unreadable

    def _admin_token(self, observed: Observed, fleet: str) -> tuple[Observed, tuple[Delete, ...]]:
        """Remember the token in the fleet's Secret; after a restart that finds no Secret while frontends
        run, that token is lost: every frontend pod must go (returned) with a new token (frontend 0 reaches
        the others with it)."""
        if ("Secret", constants.admin_secret_name(fleet)) in observed.objects:
            self.token, self.token_seen = observed.admin_token, True
            return observed, ()
        observed = dataclasses.replace(observed, admin_token=self.token)
        if self.token_seen:
            return observed, ()  # deleted while we ran: written back with the token we saw
        return observed, tuple(Delete("v1", "Pod", p.name, p.uid) for p in observed.pods
                               if p.role == constants.ROLE_FRONTEND and not p.terminating)

    async def _ask_frontend(self, observed: Observed, frontend_at: PodObs | None) -> Observed:
        """`observed` with what the frontend's admin API says: of the resize in flight, or, while the fleet
        serves, of its ranks (a Dead or long Unresponsive rank is a loss), rate-limited: an unanswering
        frontend must not cost its timeout on every reconcile."""
        if (resize_id := resize_in_flight(observed)) is not None:
            seen = await self.frontend.observe(frontend_at, observed.admin_token, resize_id)
            return dataclasses.replace(observed, frontend=seen)
        # An engine pod newly being removed is read at once (no rate limit, once per pod): whether its rank still
        # serves decides between a drain and a loss (planner.step.removed).
        removing = {p.uid for p in observed.pods if p.terminating and p.role == constants.ROLE_ENGINE}
        fresh_removal = bool(removing - self.removals_seen)
        self.removals_seen = removing
        if fleet_view_due(observed) and (fresh_removal or self.clock.monotonic() >= self.fleet_view_at):
            # An idle fleet's frontend is asked more often: whether requests wait for it to wake.
            every = IDLE_POLL_SECONDS if observed.status.phase == "Idle" else FRONTEND_POLL_SECONDS
            self.fleet_view_at = self.clock.monotonic() + every
            view = await self.frontend.fleet(frontend_at, observed.admin_token)
            return dataclasses.replace(observed, fleet=view)
        return observed

    async def _write_status(self, namespace: str, name: str, stored: dict[str, Any],
                            status: EngineCoreSetStatus) -> None:
        """The pass's one status write, if the status changed. Nothing is done without it (it is the
        planner's memory: an incarnation must be recorded before its pods exist): a refusal is raised,
        and shown once as an event."""
        patch = status_patch(stored, status)
        if patch is None:
            return
        try:
            await self.kube.patch_status(namespace, name, patch)
        except KubeError as e:
            why = f"status write refused ({e.status}): {str(e.detail)[:MAX_MESSAGE_CHARS]}"
            if why != self.status_error:
                self._post([Event("Warning", "StatusWriteFailed", why)])
            self.status_error = why
            raise
        self.status_error = ""
        self.written_status = status.to_json()
        self.written_over = str(self.body["metadata"].get("resourceVersion"))  # the live body, now

    async def _replace_frontend(self, fleet: str, lost_frontend: Sequence[Delete], failures: Sequence[ActionFailure],
                                blocked: set[str]) -> list[ActionFailure]:
        """After a restart that found the admin Secret gone (its token lost): once the Secret is written
        with the new token, delete the frontend pods that read the old one (once: the token is ours now)."""
        secret = target("Secret", constants.admin_secret_name(fleet))
        refused: list[ActionFailure] = []
        if any(f.target == secret for f in failures) or secret in blocked:
            pass  # the Secret is not ours to write: a new frontend could not read our token either
        else:
            self._post([Event("Warning", "AdminTokenLost",
                              f"the admin Secret {constants.admin_secret_name(fleet)} is gone and this operator "
                              f"(restarted) never saw the token frontend pod(s) "
                              f"{', '.join(d.name for d in lost_frontend)} read: wrote a new token and deleted "
                              "the frontend, so the fleet recovers with one that uses it")])
            refused = await self.executor.carry_out(list(lost_frontend))
        self.token_seen = True
        return refused

    def _settle(self, namespace: str, name: str, failures: list[ActionFailure], requeue: float | None) -> float | None:
        """Remember the pass's failures (a new one is an event) and say how soon to look again."""
        new = [f for f in failures if f not in self.failures]
        self._post(Event("Warning", "ActionFailed", f.describe()) for f in new)
        for f in new:
            logger.warning("%s/%s: %s", namespace, name, f.describe())
        cleared = bool(self.failures) and not failures
        self.failures = failures
        self.failing = bool(failures)
        if cleared:  # the Degraded condition of the failures goes with the next (prompt) pass
            requeue = FAILURES_CLEARED_REQUEUE_SECONDS
        if self._next_stuck is not None:
            requeue = self._next_stuck if requeue is None else min(requeue, self._next_stuck)
        return requeue
