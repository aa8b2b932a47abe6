# SPDX-License-Identifier: Apache-2.0
"""EngineCoreSet reconciliation: one path, triggered by everything that can change the answer.

One kopf daemon per EngineCoreSet runs `reconcile` — observe, plan (pure), write the status once if
it changed, post the plan's events, carry out the actions — and then sleeps until something wakes
it: a change of the EngineCoreSet, a change of one of its children (pods, Services, Secret,
PodDisruptionBudget, NetworkPolicy, all watched through kopf indexes with a server-side label
selector), or the timer. The daemon is also what runs on operator start (resume) and on create;
there are no create/update handlers, so kopf keeps no progress or diff-base of its own on our objects.

Failure handling (issue #9):

* A child is the fleet's only if its controller ownerReference is this EngineCoreSet's UID (the
  indexes are keyed by it): a pod or Service that merely carries the fleet's labels is not observed.
  An object of a child's name that the fleet does not control is never written: pods are created
  with a plain create (409 if the name is taken), other children are read first when they are not
  observed, and one controlled by anything else is refused (`ChildConflict`).
* An action the API server refuses (quota, PodSecurity, an admission webhook, a name conflict) is a
  Warning event `ActionFailed` naming the object and the server's message, and — through the one
  status write, on the next pass — the condition Degraded=True (`ActionsFailing`, or
  `ChildConflict` when every failure is a taken name). The reconciler keeps one pass's failures in
  memory for the next pass's status (a refusal repeated with the same message is not posted again);
  a pass without failures clears them. A failing reconcile backs off: it ignores wake-ups for up to
  `DEAF_SECONDS` and retries on a doubling timer (up to `MAX_BACKOFF_SECONDS`). A status write the
  API server refuses is a `StatusWriteFailed` event, and nothing else is done in that pass.
* A fleet pod stuck terminating past its grace period plus `STUCK_TERMINATION_SECONDS` (its node is
  lost: no kubelet confirms the deletion) is deleted with no grace period, with an event, so a
  recovery waiting for it proceeds.
* The admin token: the reconciler remembers the last token it saw in the fleet's admin Secret, so a
  deleted Secret is written back with the token the running frontend already uses (it reads it once,
  at start). After an operator restart with the Secret gone that token is lost (Kubernetes keeps no
  other copy, on purpose: not in the pod spec, an annotation or the status): the Secret is written
  with a new token and the frontend pod is deleted, so the fleet recovers with a frontend that uses it.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime
import logging
import os
import secrets
import time
from collections.abc import Iterable, Mapping
from typing import Any, get_args

import kopf

from corefleet_operator import constants, metrics
from corefleet_operator.actions import Action, Apply, CancelResize, Delete, Event, StartResize
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
    FrontendObs,
    Observed,
    PodObs,
    fleet_view_due,
    frontend_pod,
    observe,
    pod_obs,
    resize_in_flight,
)
from corefleet_operator.planner import (
    FRONTEND_POLL_SECONDS,
    Plan,
    PlanSettings,
    parse_time,
    plan,
    plan_invalid,
)
from corefleet_operator.status import DEGRADED, set_condition, status_patch

logger = logging.getLogger(__name__)

RESYNC_SECONDS = 60.0  # the timer: reconcile at least this often even if nothing was seen
STATUS_UNREADABLE_RETRY_SECONDS = 30.0  # a status that cannot be read is looked at again this often
MAX_BACKOFF_SECONDS = 60.0  # a failing reconcile is retried after 1, 2, 4, ... up to this many seconds
DEAF_SECONDS = 5.0  # ... and ignores wake-ups for up to this long (a failing fleet does not spin on its events)
STUCK_TERMINATION_SECONDS = 30.0  # a pod still there this long past its deletion deadline is force-deleted
MAX_FAILURES_SHOWN = 5  # failed actions named in the Degraded condition (the status stays small)
MAX_MESSAGE_CHARS = 400  # of each server message kept
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


def controller_uid(meta: Mapping[str, Any]) -> str:
    """The UID of the EngineCoreSet that controls an object (its controller ownerReference), else ""."""
    for ref in meta.get("ownerReferences") or ():
        if ref.get("controller") and ref.get("kind") == constants.KIND and \
                str(ref.get("apiVersion", "")).startswith(f"{constants.GROUP}/"):
            return str(ref.get("uid") or "")
    return ""


# Index keys: (namespace, fleet label, controlling EngineCoreSet's UID). A fleet reads its own UID's
# entries only: labels alone would let a user's object, or the children of a deleted EngineCoreSet
# of the same name still being garbage-collected, pass for the fleet's own.
ChildKey = tuple[str, str, str]


def _child_key(namespace: str | None, labels: Mapping[str, str], meta: Mapping[str, Any]) -> ChildKey:
    return str(namespace), labels[constants.LABEL_FLEET], controller_uid(meta)


@kopf.index("pods", labels=OWNED)
def fleet_pods(name: str, namespace: str | None, labels: Mapping[str, str], meta: kopf.Meta,
               spec: kopf.Spec, status: kopf.Status, **_: Any) -> dict[ChildKey, PodObs]:
    return {_child_key(namespace, labels, meta): pod_obs(name, meta, spec, status)}


@dataclasses.dataclass(frozen=True)
class Terminating:
    """A fleet pod being deleted: when its grace period ends (`deletionTimestamp`) and where it runs."""

    name: str
    uid: str
    deadline: str  # metadata.deletionTimestamp: the deletion request plus the grace period
    node: str


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


# ---- the reconcile path -----------------------------------------------------------------------
# Tests only: every recovery backoff is multiplied by this (e.g. 0.1: 0, 1 s, 2 s, ...), so that a crash loop
# runs through its budget in seconds. Read from the operator's environment; 1 unless set.
BACKOFF_SCALE_ENV = "COREFLEET_RECOVERY_BACKOFF_SCALE"


def plan_settings() -> PlanSettings:
    return PlanSettings(backoff_scale=float(os.environ.get(BACKOFF_SCALE_ENV) or 1.0))


def make_plan(body: Mapping[str, Any], observed: Observed, settings: PlanSettings | None = None) -> Plan:
    meta = body["metadata"]
    try:
        spec = EngineCoreSetSpec.parse(body.get("spec") or {})
    except SpecError as e:
        return plan_invalid(e, observed, now())
    fleet = FleetRef(name=str(meta["name"]), namespace=str(meta["namespace"]), uid=str(meta["uid"]), spec=spec)
    return plan(fleet, observed, now(), settings or plan_settings())


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


def _target(kind: str, name: str) -> str:
    return f"{kind} {name}"


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


async def carry_out(kube: Kube, namespace: str, actions: Iterable[Action], pending: PendingCreates | None = None,
                    frontend: FrontendAPI | None = None, frontend_at: PodObs | None = None, token: str = "", *,
                    fleet_uid: str = "", own: Iterable[tuple[str, str]] = ()) -> list[ActionFailure]:
    """Carry the plan's actions out in order; resize calls go to the frontend's admin API.

    An action the API server refuses (quota, PodSecurity, a webhook, ...) or that would take over an
    object the fleet does not control (`own`: the (kind, name) of the children observed as the
    fleet's) is returned as an `ActionFailure` and the others still run (they do not depend on each
    other within one plan). Transport errors propagate (the reconcile is retried as a whole)."""
    owned = set(own)
    failures: list[ActionFailure] = []
    for action in actions:
        key = action.key if isinstance(action, Apply) else \
            (action.kind, action.name) if isinstance(action, Delete) else ("resize", action.resize_id)
        try:
            if isinstance(action, Apply):
                await _apply_child(kube, action.obj, fleet_uid, key in owned)
                if pending is not None and key[0] == "Pod":
                    pending.created(action.obj, time.monotonic())
            elif isinstance(action, Delete):
                await kube.delete(action.api_version, action.kind, namespace, action.name, action.uid)
            elif isinstance(action, StartResize) and frontend is not None:
                await frontend.start(frontend_at, token, action)
            elif isinstance(action, CancelResize) and frontend is not None:
                await frontend.cancel(frontend_at, token, action)
        except Conflict as e:
            failures.append(ActionFailure(_target(*key), str(e), conflict=True))
        except KubeError as e:
            verb = "write" if isinstance(action, Apply) else "delete"
            detail = str(e.detail)[:MAX_MESSAGE_CHARS]
            failures.append(ActionFailure(_target(*key), f"{verb} refused ({e.status}): {detail}"))
    return failures


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


FLEET_METRICS = metrics.FleetMetrics(get_args(FleetPhase))


def publish(namespace: str, name: str, spec: Mapping[str, Any], status: EngineCoreSetStatus) -> None:
    """The fleet's phase, sizes, recoveries and resizes as metrics."""
    desired = int(spec.get("replicas") or 0)
    FLEET_METRICS.publish(namespace, name, phase=status.phase, desired=desired, committed=status.replicas,
                          ready=status.readyReplicas, maximum=int(spec.get("maxReplicas") or desired),
                          recoveries=status.recoveries, operation=status.operation)


class FleetReconciler:
    """The state one daemon keeps between its reconciles: caches of its own writes, the admin token
    it last saw, and the actions that failed (carried into the next status)."""

    def __init__(self, kube: Kube, body: kopf.Body) -> None:
        self.kube = kube
        self.body = body
        self.written_status: dict[str, Any] | None = None  # what we last wrote (the watch may lag)
        self.written_over = ""  # the resourceVersion of the body our last status write was planned on
        self.token = secrets.token_urlsafe(32)  # the admin token: a new one until the Secret is observed
        self.token_seen = False  # the token came from the fleet's Secret (the running frontend reads it)
        self.pending = PendingCreates()
        self.frontend = FrontendAPI()
        self.failures: list[ActionFailure] = []  # the last pass's failed actions
        self.failing = False  # the last pass had failed actions (the daemon backs off)
        self._next_stuck: float | None = None  # seconds until a terminating pod counts as stuck
        self.status_error = ""  # why the last status write was refused (shown once as an event)
        self.status_problem = ""  # what of the stored status could not be read (shown once as an event)
        self.fleet_view_at = 0.0  # when the frontend's view of the ranks may be read again (monotonic)

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

    def _post(self, events: Iterable[Event]) -> None:
        for ev in events:
            kopf.event(self.body, type=ev.type, reason=ev.reason, message=ev.message)

    def _admin_token(self, observed: Observed, fleet: str) -> tuple[Observed, Delete | None]:
        """Remember the token in the fleet's Secret; after a restart that finds no Secret while a
        frontend runs, that token is lost: the frontend pod must go (returned) with a new token."""
        if ("Secret", constants.admin_secret_name(fleet)) in observed.objects:
            self.token, self.token_seen = observed.admin_token, True
            return observed, None
        observed = dataclasses.replace(observed, admin_token=self.token)
        if self.token_seen:
            return observed, None  # deleted while we ran: written back with the token we saw
        running = next((p for p in observed.pods if p.role == constants.ROLE_FRONTEND and not p.terminating), None)
        if running is None:
            return observed, None
        return observed, Delete("v1", "Pod", running.name, running.uid)

    async def reconcile(self, indexes: Mapping[str, kopf.Index[Any, Any]]) -> float | None:
        """One pass; returns how soon to look again regardless of events (None: at the resync).
        `failing` says whether an action failed (the daemon then backs off)."""
        body = self.body
        meta = body["metadata"]
        self.failing = False
        if meta.get("deletionTimestamp"):
            return None  # owned children go with the EngineCoreSet (garbage collection)
        name, namespace, uid = str(meta["name"]), str(meta["namespace"]), str(meta["uid"])
        key = (namespace, name, uid)
        # Our last write, until the watch brings a newer body than the one it was planned on (then the
        # body is at least as new: a status wiped or changed since is seen, not masked by the cache).
        if self.written_status is not None and str(meta.get("resourceVersion")) != self.written_over:
            self.written_status = None
        stored = self.written_status if self.written_status is not None else dict(body.get("status") or {})
        objects = [o for idx in OBJECT_INDEXES for o in indexes[idx].get(key, [])]
        parsed = EngineCoreSetStatus.parse_report(stored)
        if parsed.problems and not self._status_readable(parsed):
            return STATUS_UNREADABLE_RETRY_SECONDS
        observed = observe(body, parsed.status, indexes[POD_INDEX].get(key, []), objects, self.token)
        observed, lost_frontend = self._admin_token(observed, name)
        frontend_at = frontend_pod(observed, name)
        if (resize_id := resize_in_flight(observed)) is not None:
            seen: FrontendObs = await self.frontend.observe(frontend_at, observed.admin_token, resize_id)
            observed = dataclasses.replace(observed, frontend=seen)
        elif fleet_view_due(observed) and time.monotonic() >= self.fleet_view_at:
            # The frontend's view of its ranks (a Dead or long Unresponsive rank is a loss), rate-limited:
            # an unanswering frontend must not cost its timeout on every reconcile.
            self.fleet_view_at = time.monotonic() + FRONTEND_POLL_SECONDS
            view = await self.frontend.fleet(frontend_at, observed.admin_token)
            observed = dataclasses.replace(observed, fleet=view)
        the_plan = make_plan(body, observed)
        publish(namespace, name, body.get("spec") or {}, the_plan.status)
        blocked = {f.target for f in self.failures}
        status = with_action_failures(the_plan.status, self.failures, observed.generation, now())
        patch = status_patch(stored, status)
        if patch is not None:
            try:
                await self.kube.patch_status(namespace, name, patch)
            except KubeError as e:
                # Nothing is done without the status written (it is the planner's memory: an
                # incarnation must be recorded before its pods exist); the refusal is shown once.
                why = f"status write refused ({e.status}): {str(e.detail)[:MAX_MESSAGE_CHARS]}"
                if why != self.status_error:
                    self._post([Event("Warning", "StatusWriteFailed", why)])
                self.status_error = why
                raise
            self.status_error = ""
            self.written_status = status.to_json()
            self.written_over = str(self.body["metadata"].get("resourceVersion"))  # the live body, now
        # The plan's events go out before its actions, so an action that fails cannot lose them. Two
        # are held back while actions fail: a "Repaired" of an object whose write is refused (a claim
        # that is not true), and "ReadyTimeout" (the planner compares it with the stored Degraded
        # condition, which says ActionsFailing meanwhile: it would repeat on every pass; it is posted
        # once the failures clear, if the fleet is still not ready).
        self._post(ev for ev in the_plan.events
                   if not (ev.reason == "Repaired" and any(ev.message.startswith(f"{t} ") for t in blocked))
                   and not (ev.reason == "ReadyTimeout" and self.failures))
        actions = self.pending.filter(the_plan.actions, {p.name for p in observed.pods}, time.monotonic())
        failures = await carry_out(self.kube, namespace, actions, self.pending, self.frontend, frontend_at,
                                   observed.admin_token, fleet_uid=uid, own=observed.objects.keys())
        requeue = the_plan.requeue_after
        if lost_frontend is not None:
            secret = _target("Secret", constants.admin_secret_name(name))
            if any(f.target == secret for f in failures) or secret in blocked:
                pass  # the Secret is not ours to write: a new frontend could not read our token either
            else:
                self._post([Event("Warning", "AdminTokenLost",
                                  f"the admin Secret {constants.admin_secret_name(name)} is gone and this operator "
                                  f"(restarted) never saw the token frontend pod {lost_frontend.name} reads: "
                                  "wrote a new token and deleted the frontend, so the fleet recovers with one "
                                  "that uses it")])
                failures += await carry_out(self.kube, namespace, [lost_frontend], fleet_uid=uid)
            self.token_seen = True
        failures += await self._force_delete_stuck(namespace, indexes[TERMINATING_INDEX].get(key, []))
        new = [f for f in failures if f not in self.failures]
        self._post(Event("Warning", "ActionFailed", f.describe()) for f in new)
        for f in new:
            logger.warning("%s/%s: %s", namespace, name, f.describe())
        cleared = bool(self.failures) and not failures
        self.failures = failures
        self.failing = bool(failures)
        if cleared:  # the Degraded condition of the failures goes with the next (prompt) pass
            requeue = 0.2
        if self._next_stuck is not None:
            requeue = self._next_stuck if requeue is None else min(requeue, self._next_stuck)
        return requeue

    async def _force_delete_stuck(self, namespace: str, terminating: Iterable[Terminating]) -> list[ActionFailure]:
        """Delete with no grace period the fleet pods stuck terminating (their node is lost)."""
        margin = STUCK_TERMINATION_SECONDS
        stuck, self._next_stuck = stuck_terminations(terminating, datetime.datetime.now(datetime.UTC), margin)
        failures = []
        for pod in stuck:
            try:
                if await self.kube.delete("v1", "Pod", namespace, pod.name, pod.uid, grace_period_seconds=0):
                    where = f"node {pod.node}" if pod.node else "no node"
                    self._post([Event("Warning", "ForceDeleted",
                                      f"pod {pod.name} was still terminating {margin:.0f}s past its grace period "
                                      f"(deadline {pod.deadline}; {where} does not confirm: lost?): deleted it "
                                      "with gracePeriodSeconds=0 so the fleet can recover")])
            except KubeError as e:
                detail = str(e.detail)[:MAX_MESSAGE_CHARS]
                failures.append(ActionFailure(_target("Pod", pod.name), f"force delete refused ({e.status}): {detail}"))
        return failures


POD_INDEX = "fleet_pods"
TERMINATING_INDEX = "fleet_terminating"
OBJECT_INDEXES = ("fleet_services", "fleet_secrets", "fleet_netpols", "fleet_pdbs")
INDEXES = (POD_INDEX, TERMINATING_INDEX, *OBJECT_INDEXES)


@kopf.daemon(*ECS, cancellation_timeout=30.0)
async def fleet(body: kopf.Body, name: str, namespace: str | None, memo: Any, stopped: kopf.DaemonStopped,
                logger: kopf.Logger, **kwargs: Any) -> None:
    """One per EngineCoreSet: reconcile, then sleep until woken (or the resync timer); a failing
    reconcile (an exception, or refused actions) backs off instead of retrying on every wake-up."""
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
            delay, deaf = resync, 0.0
            try:
                with metrics.RECONCILE_SECONDS.time():
                    requeue = await reconciler.reconcile(indexes)
                if requeue is not None:
                    delay = min(delay, max(requeue, 0.2))
                if reconciler.failing:
                    metrics.RECONCILES.labels("error").inc()
                    logger.warning("actions failed, retrying in %.0f s: %s", backoff,
                                   "; ".join(f.describe() for f in reconciler.failures))
                    delay, deaf, backoff = min(delay, backoff), min(backoff, DEAF_SECONDS), \
                        min(backoff * 2, MAX_BACKOFF_SECONDS)
                else:
                    metrics.RECONCILES.labels("ok").inc()
                    backoff = 1.0
            except (TimeoutError, KubeError, OSError) as e:
                metrics.RECONCILES.labels("error").inc()
                logger.warning("reconcile failed, retrying in %.0f s: %s: %s", backoff, type(e).__name__, e)
                delay, deaf, backoff = backoff, min(backoff, DEAF_SECONDS), min(backoff * 2, MAX_BACKOFF_SECONDS)
            except Exception:
                metrics.RECONCILES.labels("error").inc()
                logger.exception("reconcile failed unexpectedly, retrying in %.0f s", backoff)
                delay, deaf, backoff = backoff, min(backoff, DEAF_SECONDS), min(backoff * 2, MAX_BACKOFF_SECONDS)
            await _sleep(wake, stopped, delay, deaf)
    finally:
        metrics.FLEETS.dec()
        if memo.wakeups.get(key) is wake:
            del memo.wakeups[key]
        if body.get("metadata", {}).get("deletionTimestamp"):
            FLEET_METRICS.forget(*key)


async def _sleep(wake: asyncio.Event, stopped: kopf.DaemonStopped, seconds: float, deaf: float = 0.0) -> None:
    """Until woken, stopped, or `seconds` pass; wake-ups in the first `deaf` seconds count only after them."""
    started = time.monotonic()
    stopper = asyncio.ensure_future(stopped.wait())  # kopf's awaitable promise, not a coroutine
    waiter: asyncio.Future[Any] | None = None
    try:
        if deaf > 0:
            await asyncio.wait({stopper}, timeout=min(deaf, seconds))
            if stopper.done():
                return
        left = seconds - (time.monotonic() - started)
        if left <= 0:
            return
        waiter = asyncio.ensure_future(wake.wait())
        await asyncio.wait({waiter, stopper}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (waiter, stopper):
            if t is not None:
                t.cancel()
