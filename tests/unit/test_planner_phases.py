# SPDX-License-Identifier: Apache-2.0
"""The planner's phases one at a time (`corefleet_operator.planner.*`): each phase's contract on small,
hand-built inputs. The whole planner is walked through sequences in test_planner.py; these pin what each
phase promises the next one."""

from __future__ import annotations

import datetime
from dataclasses import replace
from typing import Any

import pytest

from corefleet_operator import builders, constants
from corefleet_operator.actions import Apply, CancelResize, Delete, StartResize
from corefleet_operator.models import (
    Condition,
    EngineCoreSetStatus,
    FleetRef,
    OperationStatus,
    RankStatus,
    RecoveryStatus,
)
from corefleet_operator.observe import FleetObs, FrontendObs, Observed, PodObs, RankObs, ResizeObs, pod_obs
from corefleet_operator.planner import Plan, PlanSettings, plan
from corefleet_operator.planner.basis import Basis, begin
from corefleet_operator.planner.children import child_actions, wanted_pods
from corefleet_operator.planner.follow import Flight, follow_operation
from corefleet_operator.planner.losses import Losses, find_losses
from corefleet_operator.planner.members import continue_members, members_in_place
from corefleet_operator.planner.phase import fleet_phase, phase_events, ready_timeout_event
from corefleet_operator.planner.ranks import rank_statuses
from corefleet_operator.planner.recovery import (
    backoff_left,
    backoff_seconds,
    next_attempt,
    recovery_for,
    still_given_up,
    streak,
    when,
)
from corefleet_operator.planner.replace import ReplaceStep, continue_replace, in_place
from corefleet_operator.planner.requeue import operation_wake, requeue_after
from corefleet_operator.planner.resize import (
    REDUNDANT_EXPERTS_POLL_SECONDS,
    RESIZE_POLL_SECONDS,
    ResizeStep,
    continue_resize,
    retry_wait,
    start_resize,
)
from corefleet_operator.planner.step import Step, after_losses, first_step, new_size
from factories import make_ecs

T0 = datetime.datetime(2026, 11, 29, 12, 0, 0, tzinfo=datetime.UTC)
NOW = "2026-11-29T12:00:00Z"
FLEET = make_ecs("f").replicas(3).obj()


def at(seconds: float) -> str:
    return (T0 + datetime.timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(rank: int | str, fleet: FleetRef = FLEET, gen: int = 1, **kw: Any) -> PodObs:
    """A pod of the fleet: an engine rank, or "frontend" / "coordinator"; Running and Ready unless told."""
    if isinstance(rank, int):
        name, role, number = constants.engine_name(fleet.name, rank), constants.ROLE_ENGINE, rank
    else:
        name = constants.frontend_name(fleet.name) if rank == "frontend" else constants.coordinator_name(fleet.name)
        role, number = rank, None
    fields: dict[str, Any] = {"phase": "Running", "ready": True, "node": "n", "uid": f"uid-{name}-{gen}",
                              "spec_hash": builders.fleet_config_hash(fleet.spec), **kw}
    return PodObs(name=name, role=role, rank=number, fleet_generation=gen, **fields)


def members(n: int = 3, fleet: FleetRef = FLEET, gen: int = 1) -> list[PodObs]:
    return [pod("coordinator", fleet, gen), pod("frontend", fleet, gen), *(pod(r, fleet, gen) for r in range(n))]


def serving(n: int = 3, gen: int = 1, phase: Any = "Running", **kw: Any) -> EngineCoreSetStatus:
    return EngineCoreSetStatus(observedGeneration=1, replicas=n, phase=phase, fleetGeneration=gen, **kw)


def observed(status: EngineCoreSetStatus, pods: list[PodObs], **kw: Any) -> Observed:
    return Observed(generation=kw.pop("generation", 1), status=status, pods=tuple(pods), admin_token="token", **kw)


def resize_op(frm: int, to: int, phase: Any = "Pending", started: float = 0, **kw: Any) -> OperationStatus:
    return OperationStatus(id="op", fromReplicas=frm, toReplicas=to, phase=phase, startedAt=at(started),
                           fleetGeneration=1, **kw)


def step_of(basis: Basis, **kw: Any) -> Step:
    fields: dict[str, Any] = {"generation": basis.generation, "committed": basis.committed,
                              "phase": basis.old.phase, "new_incarnation": basis.fresh,
                              "operation": basis.old.operation, "recovery": basis.streak,
                              "recoveries": basis.old.recoveries, **kw}
    return Step(**fields)


# ---- basis ------------------------------------------------------------------------------------------
def test_begin_a_fresh_fleet_is_incarnation_one_at_the_spec_size() -> None:
    basis = begin(FLEET, observed(EngineCoreSetStatus(), []), NOW)
    assert (basis.fresh, basis.generation, basis.committed, basis.running) == (True, 1, 3, None)
    assert [e.reason for e in basis.events] == ["Creating"]
    assert basis.members == {"f-coordinator", "f-frontend", "f-engine-0", "f-engine-1", "f-engine-2"}


def test_begin_adopts_the_newest_incarnation_when_the_status_is_lost() -> None:
    pods = [*members(2, gen=3), pod(2, gen=2)]
    basis = begin(FLEET, observed(EngineCoreSetStatus(), pods), NOW)
    assert (basis.fresh, basis.generation, basis.committed, basis.old.phase) == (False, 3, 2, "Degraded")
    assert [e.reason for e in basis.events] == ["StatusLost"]
    assert set(basis.current) == {"f-coordinator", "f-frontend", "f-engine-0", "f-engine-1"}  # not gen 2's pod


def test_begin_sees_the_operation_in_flight_and_sorts_the_pods() -> None:
    running = resize_op(3, 4)
    pods = [*members(3), pod(0, gen=2, terminating=True)]
    basis = begin(FLEET, observed(serving(operation=running), pods), NOW)
    assert basis.running == running
    assert [p.name for p in basis.terminating] == ["f-engine-0"]
    assert len(basis.live) == 5
    assert set(basis.live_by_name) == basis.members
    done = replace(running, phase="Completed")
    assert begin(FLEET, observed(serving(operation=done), pods), NOW).running is None


# ---- recovery ---------------------------------------------------------------------------------------
def test_the_backoff_is_zero_then_ten_seconds_doubling_to_five_minutes_times_the_scale() -> None:
    assert [backoff_seconds(n) for n in range(1, 9)] == [0, 10, 20, 40, 80, 160, 300, 300]
    assert backoff_seconds(3, scale=0.1) == pytest.approx(2.0)


def test_a_streak_ends_with_a_new_spec_generation_or_after_ten_minutes_running() -> None:
    rec = RecoveryStatus(attempt=2, lostAt=at(-700), reason="x", retryAt=at(-690), observedGeneration=1)
    complete = Condition(type="Progressing", status="False", reason="Complete", lastTransitionTime=at(-650))
    recovering = serving(phase="Recovering", recovery=rec)
    assert streak(recovering, 1, NOW) == rec
    assert streak(recovering, 2, NOW) is None  # the spec changed
    assert streak(serving(recovery=rec, conditions=(complete,)), 1, NOW) is None  # 650 s Running
    assert streak(serving(recovery=rec, conditions=(replace(complete, lastTransitionTime=at(-60)),)), 1, NOW) == rec


def test_an_attempt_past_the_budget_is_exhausted_and_each_records_when_its_pods_may_start() -> None:
    first = next_attempt(None, budget=1, settings=PlanSettings())
    assert (first.number, first.wait, first.exhausted) == (1, 0.0, False)
    rec = recovery_for(first, "lost", spec_generation=4, now=NOW)
    assert (rec.attempt, rec.lostAt, rec.retryAt, rec.observedGeneration) == (1, NOW, NOW, 4)
    assert when(first, rec) == "now"
    second = next_attempt(rec, budget=1, settings=PlanSettings(backoff_scale=0.5))
    assert (second.number, second.wait, second.exhausted) == (2, 5.0, True)
    assert when(second, recovery_for(second, "lost", 4, NOW)) == f"after a backoff of 5s (at {at(5)})"


def test_a_backoff_holds_only_a_recovering_fleet_with_ranks() -> None:
    rec = RecoveryStatus(attempt=2, lostAt=NOW, retryAt=at(10))
    assert backoff_left("Recovering", rec, 3, NOW) == 10
    assert backoff_left("Recovering", rec, 3, at(20)) == 0
    assert backoff_left("Restarting", rec, 3, NOW) == 0
    assert backoff_left("Recovering", rec, 0, NOW) == 0


def test_a_fleet_given_up_stays_so_until_its_spec_changes() -> None:
    rec = RecoveryStatus(attempt=3, lostAt=NOW, observedGeneration=1)
    failed = serving(phase="Failed", recovery=rec)
    assert still_given_up(failed, fresh=False, spec_generation=1) == rec
    assert still_given_up(failed, fresh=False, spec_generation=2) is None
    assert still_given_up(serving(recovery=rec), fresh=False, spec_generation=1) is None


# ---- resize -----------------------------------------------------------------------------------------
def test_a_resize_starts_with_exactly_the_ranks_it_adds_or_retires() -> None:
    up = start_resize(make_ecs("f").replicas(5).obj(), 3, 2, NOW)
    assert (up.operation.fromReplicas, up.operation.toReplicas, up.operation.phase) == (3, 5, "Pending")
    assert up.operation.id == "3to5-g2-20261129t120000z"
    assert up.operation.fleetGeneration == 2
    assert (up.joining, up.leaving) == (frozenset({3, 4}), frozenset())
    assert [type(a) for a in up.actions] == [StartResize]
    assert [e.reason for e in up.events] == ["ResizeStarted"]
    down = start_resize(make_ecs("f").replicas(1).obj(), 3, 2, NOW)
    assert (down.joining, down.leaving) == (frozenset(), frozenset({1, 2}))
    assert "draining and retiring ranks 1..2" in down.events[0].message


def follow_resize(op: OperationStatus, frontend: FrontendObs | None, pods: list[PodObs] | None = None,
                  now: str = NOW, fleet: FleetRef = FLEET) -> ResizeStep:
    pods = members(3) if pods is None else pods
    current = {p.name: p for p in pods}
    return continue_resize(fleet, observed(serving(operation=op), pods, frontend=frontend), op, 3, current, now)


def test_a_resize_waits_for_an_unreachable_frontend_until_its_timeouts_pass() -> None:
    op = resize_op(3, 4)
    gone = FrontendObs(reachable=False, error="refused")
    waiting = follow_resize(op, gone)
    assert not waiting.lost
    assert waiting.operation.message == "waiting for the frontend's admin API: refused"
    late = follow_resize(op, gone, now=at(1800 + 121))  # readyTimeoutSeconds + the grace
    assert "no answer from the frontend" in late.lost


def test_a_resize_the_frontend_refused_fails_and_its_new_ranks_go() -> None:
    step = follow_resize(resize_op(3, 4), FrontendObs(reachable=True, refused="409: busy"))
    assert (step.operation.phase, step.operation.message, step.retired) == ("Failed", "409: busy", frozenset({3}))
    assert [e.reason for e in step.events] == ["ResizeFailed"]
    assert not step.lost


def test_a_resize_the_frontend_does_not_know_is_asked_again_while_pending_and_lost_after() -> None:
    unknown = FrontendObs(reachable=True)
    asked = follow_resize(resize_op(3, 4), unknown)
    assert [a.resize_id for a in asked.actions if isinstance(a, StartResize)] == ["op"]
    assert "no longer knows it" in follow_resize(resize_op(3, 4, phase="Preparing"), unknown).lost


def test_a_completed_scale_up_commits_once_its_new_pods_are_ready() -> None:
    done = FrontendObs(reachable=True, resize=ResizeObs(id="op", phase="Completed", message="ok"))
    unready = follow_resize(resize_op(3, 4, phase="Preparing"), done, [*members(3), pod(3, ready=False)])
    assert (unready.operation.phase, unready.committed) == ("Committing", 3)
    assert [e.reason for e in unready.events] == ["ResizeCommitting"]
    ready = follow_resize(resize_op(3, 4, phase="Committing"), done, [*members(3), pod(3)])
    assert (ready.operation.phase, ready.committed, ready.operation.finishedAt) == ("Completed", 4, NOW)
    assert [e.reason for e in ready.events] == ["ResizeCompleted"]


def test_a_completed_scale_down_retires_the_leaving_ranks() -> None:
    done = FrontendObs(reachable=True, resize=ResizeObs(id="op", phase="Completed"))
    step = follow_resize(resize_op(3, 1, phase="Draining"), done)
    assert (step.committed, step.retired) == (1, frozenset({1, 2}))
    assert [e.reason for e in step.events] == ["RankRetired", "RankRetired", "ResizeCompleted"]


@pytest.mark.parametrize(("intact", "lost", "retired"), [(True, False, {3}), (False, True, frozenset())])
def test_a_failed_resize_leaves_the_fleet_at_its_size_or_lost(intact: bool, lost: bool, retired: Any) -> None:
    failed = FrontendObs(reachable=True, resize=ResizeObs(id="op", phase="Failed", error="e", fleet_intact=intact))
    step = follow_resize(resize_op(3, 4, phase="Preparing"), failed)
    assert (step.operation.phase, bool(step.lost), step.retired) == ("Failed", lost, retired)


def test_a_draining_resize_follows_the_frontend_and_retires_ranks_one_by_one() -> None:
    seen = ResizeObs(id="op", phase="Draining", message="draining", ranks={1: ("Draining", ""), 2: ("Retired", "")})
    step = follow_resize(resize_op(3, 1, phase="Preparing"), FrontendObs(reachable=True, resize=seen))
    assert (step.operation.phase, step.retired) == ("Draining", frozenset({2}))
    assert step.rank_states == {1: ("Draining", ""), 2: ("Retired", "")}
    assert [e.reason for e in step.events] == ["ResizeDraining"]


def test_a_new_ranks_failed_pod_cancels_the_resize_and_is_told_once() -> None:
    preparing = FrontendObs(reachable=True, resize=ResizeObs(id="op", phase="Preparing"))
    pods = [*members(3), pod(3, phase="Failed", message="OOMKilled")]
    first = follow_resize(resize_op(3, 4, phase="Preparing"), preparing, pods)
    assert [type(a) for a in first.actions] == [CancelResize]
    assert [e.reason for e in first.events] == [
        "ResizeCancelling"]
    assert first.operation.message.startswith("cancelling: pod f-engine-3 of rank 3 failed: OOMKilled")
    again = follow_resize(first.operation, preparing, pods)
    assert [type(a) for a in again.actions] == [CancelResize]
    assert not again.events


def test_a_resize_past_its_timeout_is_cancelled() -> None:
    preparing = FrontendObs(reachable=True, resize=ResizeObs(id="op", phase="Preparing"))
    step = follow_resize(resize_op(3, 4, phase="Preparing"), preparing, now=at(1921))
    assert [a.reason for a in step.actions if isinstance(a, CancelResize)] == [
        "it ran 1921s, past its timeout of 1920s"]


def test_a_failed_resize_is_retried_after_five_minutes_unless_the_size_changes() -> None:
    last = resize_op(3, 4, phase="Failed", finishedAt=NOW)
    assert retry_wait(serving(operation=last), 4, at(100)) == 200
    assert retry_wait(serving(operation=last), 5, at(100)) == 0
    assert retry_wait(serving(operation=last), 4, at(400)) == 0


# ---- replacement --------------------------------------------------------------------------------------
def basis_of(status: EngineCoreSetStatus, pods: list[PodObs], fleet: FleetRef = FLEET, **kw: Any) -> Basis:
    return begin(fleet, observed(status, pods, **kw), NOW)


@pytest.mark.parametrize(("case", "expected"), [
    ("one engine rank", True),
    ("an MoE fleet", False),
    ("every rank", False),
    ("the frontend too", False),
    ("a frontend not ready", False),
    ("while starting", False),
    ("a configuration change too", False),
])
def test_only_some_engine_ranks_of_a_serving_dense_fleet_are_replaced_in_place(case: str, expected: bool) -> None:
    fleet = make_ecs("f").replicas(3).expert_parallel().obj() if case == "an MoE fleet" else FLEET
    pods = members(3, fleet)
    if case == "a frontend not ready":
        pods[1] = replace(pods[1], ready=False)
    basis = basis_of(serving(phase="Starting" if case == "while starting" else "Running"), pods, fleet)
    lost: list[tuple[int | None, str]] = [(1, "rank 1 failed")]
    if case == "every rank":
        lost = [(0, "x"), (1, "x"), (2, "x")]
    if case == "the frontend too":
        lost.append((None, "frontend failed"))
    assert in_place(fleet, basis, lost, changed=case == "a configuration change too") is expected


def follow_replace(op: OperationStatus, pods: list[PodObs], frontend: FrontendObs | None = None,
                   rec: RecoveryStatus | None = None, now: str = NOW) -> ReplaceStep:
    obs = observed(serving(operation=op), pods, frontend=frontend)
    return continue_replace(FLEET, obs, op, {p.name: p for p in pods if not p.terminating}, rec, now)


def replace_op(phase: Any = "Pending", **kw: Any) -> OperationStatus:
    return OperationStatus(id="rep", fromReplicas=3, toReplicas=3, phase=phase, startedAt=NOW, fleetGeneration=1,
                           replace=(1,), **kw)


def test_a_replacement_deletes_the_old_pod_then_waits_out_the_backoff_then_prepares() -> None:
    old_pod = pod(1, phase="Failed")
    deleting = follow_replace(replace_op(), [*members(3)[:3], old_pod, pod(2)])
    # A short grace period: the pre-stop hook of a pod the operator deletes waits for no release.
    assert deleting.actions == (Delete("v1", "Pod", "f-engine-1", old_pod.uid,
                                       grace_seconds=constants.ENGINE_DELETE_GRACE_SECONDS),)
    assert not deleting.create
    assert deleting.operation.phase == "Pending"
    rec = RecoveryStatus(attempt=2, lostAt=NOW, retryAt=at(10))
    backoff = follow_replace(replace_op(), [pod("coordinator"), pod("frontend"), pod(0), pod(2)], rec=rec)
    assert (backoff.operation.phase, backoff.wait, backoff.create) == ("Pending", 10, False)
    ready = follow_replace(replace_op(), [pod("coordinator"), pod("frontend"), pod(0), pod(2)], rec=rec, now=at(10))
    assert (ready.operation.phase, ready.create) == ("Preparing", True)


def test_a_replacement_is_asked_of_the_frontend_once_it_reports_the_rank_dead() -> None:
    pods = [*members(3)[:3], pod(1, ready=False), pod(2)]
    alive = FrontendObs(reachable=True, fleet=FleetObs(reachable=True, ranks={1: RankObs(1, "Serving")}))
    waiting = follow_replace(replace_op("Preparing"), pods, alive)
    assert not waiting.actions
    assert "rank 1 Serving" in waiting.operation.message
    dead = FrontendObs(reachable=True, fleet=FleetObs(reachable=True, ranks={1: RankObs(1, "Dead")}))
    asked = follow_replace(replace_op("Preparing"), pods, dead)
    assert [(a.resize_id, a.replace) for a in asked.actions if isinstance(a, StartResize)] == [("rep", (1,))]


def test_a_rank_whose_pod_is_being_removed_while_it_serves_is_drained_by_the_frontend_before_it_goes() -> None:
    """A drain's eviction or a delete with the pod's grace period: the frontend is asked for a vacating replacement
    at once (no new request to the rank, its requests finish, its engine released), not once the rank is Dead."""
    leaving = pod(1, terminating=True)
    pods = [*members(3)[:3], leaving, pod(2)]

    def view(state: str) -> FrontendObs:
        return FrontendObs(reachable=True, fleet=FleetObs(reachable=True, ranks={
            0: RankObs(0, "Serving"), 1: RankObs(1, state), 2: RankObs(2, "Serving")}))

    asked = follow_replace(replace_op(), pods, view("Serving"))
    spec = FLEET.spec.scaling
    assert asked.actions == (StartResize("rep", 3, float(spec.drainTimeoutSeconds), float(spec.readyTimeoutSeconds),
                                         replace=(1,), vacate=True),)  # no delete: the pod is being deleted
    assert (asked.operation.phase, asked.create) == ("Pending", False)
    assert "asking the frontend to drain" in asked.operation.message
    # A rank the frontend reports Dead (the operator's own delete of a lost rank): nothing to drain.
    assert not follow_replace(replace_op(), pods, view("Dead")).actions
    # Once the frontend runs it: not asked again; what it does is shown until the old pod is gone.
    known = FrontendObs(reachable=True, resize=ResizeObs(id="rep", phase="Draining", message="draining rank 1"))
    draining = follow_replace(replace_op(), pods, known)
    assert not draining.actions
    assert "draining rank 1" in draining.operation.message
    assert draining.operation.phase == "Pending"
    # Gone: Preparing, and the new pod may be created.
    gone = follow_replace(replace_op(), [*members(3)[:3], pod(2)], known)
    assert (gone.operation.phase, gone.create) == ("Preparing", True)


@pytest.mark.parametrize(("case", "voluntary"), [
    ("evicted while serving", True),
    ("evicted while the frontend reports it Dead", False),
    ("failed", False),
    ("no view of the ranks", False),
])
def test_a_rank_removed_voluntarily_is_replaced_without_counting_as_a_recovery(case: str, voluntary: bool) -> None:
    gone = pod(1, phase="Failed") if case == "failed" else pod(1, terminating=True)
    state = "Dead" if "Dead" in case else "Serving"
    ranks = FleetObs(reachable=True, ranks={r: RankObs(r, state if r == 1 else "Serving") for r in range(3)})
    obs = observed(serving(), [*members(3)[:3], gone, pod(2)],
                   fleet=None if case == "no view of the ranks" else ranks)
    out = plan(FLEET, obs, NOW)
    assert out.status.operation is not None
    assert out.status.operation.replace == (1,)  # replaced in place either way
    assert (out.status.recoveries == 0) is voluntary
    assert ("RankRemoved" in [e.reason for e in out.events]) is voluntary
    assert ("RankLost" in [e.reason for e in out.events]) is not voluntary


def test_a_replacement_completes_once_the_frontend_serves_on_the_new_pods_and_they_are_ready() -> None:
    done = FrontendObs(reachable=True, resize=ResizeObs(id="rep", phase="Completed"))
    committing = follow_replace(replace_op("Preparing"), [*members(3)[:3], pod(1, ready=False), pod(2)], done)
    assert committing.operation.phase == "Committing"
    completed = follow_replace(replace_op("Committing"), members(3), done, now=at(30))
    assert (completed.operation.phase, completed.operation.finishedAt) == ("Completed", at(30))
    assert [e.reason for e in completed.events] == ["RankReplaced"]


def test_a_replacement_whose_new_pod_fails_or_that_runs_too_long_is_lost() -> None:
    failed = follow_replace(replace_op("Preparing"), [*members(3)[:3], pod(1, phase="Failed"), pod(2)])
    assert "the new pod of rank 1 (f-engine-1) failed" in failed.lost
    late = follow_replace(replace_op("Preparing"), [*members(3)[:3], pod(1, ready=False), pod(2)],
                          FrontendObs(reachable=False, error="refused"), now=at(1800 + 121))
    assert "not done 1921s after its new pod(s) could start" in late.lost


# ---- follow -------------------------------------------------------------------------------------------
def test_following_nothing_keeps_the_stored_operation_and_experts() -> None:
    last = resize_op(2, 3, phase="Completed")
    basis = basis_of(serving(operation=last, redundantExperts=4), members(3))
    flight = follow_operation(FLEET, observed(basis.old, members(3)), basis, NOW)
    assert flight == Flight(operation=last, committed=3, redundant_size=3, redundant_experts=4)


def test_a_resize_completed_now_commits_its_size_and_its_redundant_experts() -> None:
    op = resize_op(3, 4, phase="Committing")
    seen = ResizeObs(id="op", phase="Completed", num_redundant_experts=6)
    pods = [*members(3), pod(3)]
    obs = observed(serving(operation=op, redundantExperts=4), pods, frontend=FrontendObs(reachable=True, resize=seen))
    flight = follow_operation(FLEET, obs, begin(FLEET, obs, NOW), NOW)
    assert (flight.committed, flight.moving) == (4, frozenset({3}))
    assert (flight.redundant_size, flight.redundant_experts) == (4, 6)
    assert flight.operation is not None
    assert flight.operation.phase == "Completed"
    assert not flight.lost


def test_a_replacement_in_flight_moves_its_ranks() -> None:
    op = replace_op("Preparing")
    obs = observed(serving(operation=op), members(3), frontend=FrontendObs(reachable=False, error="x"))
    flight = follow_operation(FLEET, obs, begin(FLEET, obs, NOW), NOW)
    assert flight.moving == {1}
    assert flight.replacing is not None
    assert flight.resize is None


# ---- losses -------------------------------------------------------------------------------------------
def test_losses_are_failed_vanished_slow_and_dead_members_in_that_order() -> None:
    pods = [pod("coordinator"), pod("frontend", phase="Failed", message="OOMKilled"),
            pod(1, ready=False, unready_since=at(-1801)), pod(2)]
    fleet_view = FleetObs(reachable=True, ranks={2: RankObs(2, "Dead")})
    obs = observed(serving(), pods, fleet=fleet_view)
    basis = begin(FLEET, obs, NOW)
    losses = find_losses(FLEET, obs, basis, follow_operation(FLEET, obs, basis, NOW), NOW)
    assert [rank for rank, _ in losses.lost] == [None, 0, 1, 2]
    assert losses.reason.startswith("frontend (pod f-frontend) failed: OOMKilled; pod f-engine-0 disappeared; "
                                    "rank 1 (pod f-engine-1) not ready 1800s")
    assert losses.ranks == [0, 1, 2]
    assert not losses.changed


def test_the_ranks_an_operation_moves_are_no_losses_and_a_new_hash_is_a_change() -> None:
    op = resize_op(3, 1, phase="Draining")
    pods = [*members(3)[:3], pod(1, phase="Failed"), pod(2, spec_hash="other")]
    seen = FrontendObs(reachable=True, resize=ResizeObs(id="op", phase="Draining"))
    obs = observed(serving(phase="Scaling", operation=op), pods, frontend=seen)
    basis = begin(FLEET, obs, NOW)
    losses = find_losses(FLEET, obs, basis, follow_operation(FLEET, obs, basis, NOW), NOW)
    assert losses == Losses(lost=(), changed=True)


def test_the_frontends_view_counts_only_while_the_fleet_serves_with_nothing_in_flight() -> None:
    fleet_view = FleetObs(reachable=True, ranks={1: RankObs(1, "Unresponsive", since=T0.timestamp() - 61),
                                                 2: RankObs(2, "Whatever")})
    for status, lost in ((serving(), [1]), (serving(phase="Starting"), [])):
        obs = observed(status, members(3), fleet=fleet_view)
        basis = begin(FLEET, obs, NOW)
        assert find_losses(FLEET, obs, basis, follow_operation(FLEET, obs, basis, NOW), NOW).ranks == lost


# ---- the next step ------------------------------------------------------------------------------------
def decide_after(status: EngineCoreSetStatus, pods: list[PodObs], losses: Losses, fleet: FleetRef = FLEET,
                 **kw: Any) -> Step | Plan:
    obs = observed(status, pods, **kw)
    basis = begin(fleet, obs, NOW)
    return after_losses(fleet, obs, basis, losses, step_of(basis), PlanSettings(), NOW)


def test_a_lost_dense_rank_starts_a_replacement_in_the_same_incarnation() -> None:
    step = decide_after(serving(), [*members(3)[:3], pod(1, phase="Failed"), pod(2)], Losses(lost=((1, "x"),)))
    assert isinstance(step, Step)
    assert step.replacing is not None
    assert (step.generation, step.new_incarnation, step.recoveries) == (1, False, 1)
    assert step.operation is not None
    assert step.operation.replace == (1,)
    assert [e.reason for e in step.events] == ["RankLost"]
    assert step.recovery is not None


def test_a_lost_moe_rank_recreates_the_fleet_and_fails_the_operation_in_flight() -> None:
    moe = make_ecs("f").replicas(3).expert_parallel().obj()
    status = serving(phase="Scaling", operation=resize_op(3, 4, phase="Preparing"))
    step = decide_after(status, members(3, moe), Losses(lost=((1, "x"),)), moe)
    assert isinstance(step, Step)
    assert (step.generation, step.new_incarnation, step.phase, step.committed, step.resize) == (
        2, True, "Recovering", 3, None)
    assert step.operation is not None
    assert step.operation.phase == "Failed"
    assert [e.reason for e in step.events] == ["ResizeFailed", "RankLost"]


def test_a_loss_past_the_budget_gives_the_fleet_up() -> None:
    fleet = make_ecs("f").replicas(3).set("scaling.maxRecoveries", 0).obj()
    plan = decide_after(serving(), members(3, fleet), Losses(lost=((None, "frontend failed"),)), fleet)
    assert isinstance(plan, Plan)
    assert plan.status.phase == "Failed"
    assert [e.reason for e in plan.events] == ["RankLost", "RecoveriesExhausted"]
    assert {type(a) for a in plan.actions} == {Delete}


def test_a_configuration_change_or_a_spec_change_after_giving_up_restarts_the_fleet() -> None:
    changed = decide_after(serving(), members(3), Losses(changed=True))
    assert isinstance(changed, Step)
    assert (changed.phase, changed.generation, changed.committed) == ("Restarting", 2, 3)
    rec = RecoveryStatus(attempt=1, lostAt=NOW, observedGeneration=1)
    given_up = decide_after(serving(phase="Failed", recovery=rec), [], Losses(), generation=2)
    assert isinstance(given_up, Step)
    assert (given_up.phase, given_up.generation, given_up.recovery) == (
        "Restarting", 2, None)


@pytest.mark.parametrize(("old_phase", "committed", "replicas", "expected"), [
    ("Running", 3, 0, ("Running", 1, 0, False, "Stopping")),
    ("Stopped", 0, 2, ("Starting", 2, 2, True, "Creating")),
    ("Starting", 3, 2, ("Restarting", 2, 2, True, "Restarting")),
    ("Running", 3, 5, ("Running", 1, 3, False, "ResizeStarted")),
    ("Degraded", 3, 5, ("Degraded", 1, 3, False, None)),
])
def test_a_new_size(old_phase: Any, committed: int, replicas: int, expected: tuple[Any, ...]) -> None:
    fleet = make_ecs("f").replicas(replicas).obj()
    basis = basis_of(serving(committed, phase=old_phase), members(committed, fleet), fleet)
    step = new_size(fleet, basis, step_of(basis), NOW)
    told = step.events[-1].reason if step.events else None
    assert (step.phase, step.generation, step.committed, step.new_incarnation, told) == expected
    assert step.in_flight is (told == "ResizeStarted")


def test_a_new_size_waits_for_a_failed_resizes_retry() -> None:
    fleet = make_ecs("f").replicas(4).obj()
    basis = basis_of(serving(operation=resize_op(3, 4, phase="Failed", finishedAt=at(-100))), members(3), fleet)
    step = new_size(fleet, basis, step_of(basis), NOW)
    assert (step.retry_in, step.resize) == (200, None)


# ---- children -----------------------------------------------------------------------------------------
def children_of(status: EngineCoreSetStatus, pods: list[PodObs], fleet: FleetRef = FLEET, backoff: float = 0,
                **kw: Any) -> tuple[Step, Any]:
    obs = observed(status, pods, **kw)
    basis = begin(fleet, obs, NOW)
    flight = follow_operation(fleet, obs, basis, NOW)
    step = after_losses(fleet, obs, basis, find_losses(fleet, obs, basis, flight, NOW), first_step(basis, flight),
                        PlanSettings(), NOW)
    assert isinstance(step, Step)
    step = new_size(fleet, basis, step, NOW)
    return step, child_actions(fleet, obs, basis, flight, step, backoff)


def test_new_pods_wait_until_every_older_pod_is_gone() -> None:
    old = [*members(3, gen=1)]
    step, children = children_of(serving(), old, make_ecs("f").replicas(3).image("other:1").obj())
    assert step.generation == 2
    assert [a.name for a in children.actions if isinstance(a, Delete)] == [p.name for p in old]
    assert not children.created
    assert not children.standing
    terminating = [replace(p, terminating=True) for p in old]
    _, still = children_of(replace(serving(gen=2), phase="Restarting"), terminating)
    assert not still.created  # the old pods still terminate
    _, fresh = children_of(replace(serving(gen=2), phase="Restarting"), [])
    assert fresh.created == ("f-coordinator", "f-frontend", "f-engine-0", "f-engine-1", "f-engine-2")


def test_a_recovery_backoff_holds_the_new_pods() -> None:
    rec = RecoveryStatus(attempt=2, lostAt=NOW, retryAt=at(10), observedGeneration=1)
    _, held = children_of(serving(gen=2, phase="Recovering", recovery=rec), [], backoff=10)
    assert not held.created
    assert not any(isinstance(a, Apply) and a.obj["kind"] == "Pod" for a in held.actions)


def test_drifted_children_are_repaired_and_switched_off_ones_deleted() -> None:
    objects = {(o["kind"], o["metadata"]["name"]): o
               for o in builders.fleet_objects(FLEET, admin_token="token", dp_size=3)}
    service = next(k for k in objects if k[0] == "Service")
    objects[service] = {**objects[service], "spec": {"ports": []}}
    objects[("NetworkPolicy", "f")] = {"metadata": {"uid": "np-uid"}}
    _, children = children_of(serving(), members(3), objects=objects)
    assert [(e.reason, e.message.split(" was ")[0]) for e in children.events] == [
        ("Repaired", f"Service {service[1]}")]
    assert Delete("networking.k8s.io/v1", "NetworkPolicy", "f", "np-uid") in children.actions
    assert [a.obj["metadata"]["name"] for a in children.actions if isinstance(a, Apply)] == [service[1]]


def test_an_moe_scale_ups_new_pods_wait_for_the_redundant_experts() -> None:
    moe = make_ecs("f").replicas(4).expert_parallel().obj()
    op = resize_op(3, 4, phase="Preparing")
    seen = FrontendObs(reachable=True, resize=ResizeObs(id="op", phase="Preparing"))
    step, waiting = children_of(serving(phase="Scaling", operation=op), members(3, moe), moe, frontend=seen)
    assert step.joining == {3}
    assert waiting.awaiting_experts
    assert not waiting.created
    named = replace(seen, resize=ResizeObs(id="op", phase="Preparing", num_redundant_experts=2))
    _, creating = children_of(serving(phase="Scaling", operation=op), members(3, moe), moe, frontend=named)
    assert creating.created == ("f-engine-3",)
    assert not creating.awaiting_experts


def test_the_wanted_pods_are_the_members_and_the_ranks_kept() -> None:
    assert wanted_pods(FLEET, Step(generation=1, committed=0, phase="Stopped", new_incarnation=False,
                                   operation=None, recovery=None, recoveries=0)) == frozenset()
    resize = ResizeStep(operation=resize_op(2, 3, phase="Preparing"), committed=2, joining=frozenset({2}))
    step = Step(generation=1, committed=2, phase="Scaling", new_incarnation=False, operation=resize.operation,
                recovery=None, recoveries=0, resize=resize)
    assert wanted_pods(FLEET, step) == {"f-coordinator", "f-frontend", "f-engine-0", "f-engine-1", "f-engine-2"}


# ---- phase, ranks, requeue ----------------------------------------------------------------------------
@pytest.mark.parametrize(("replicas", "status", "pods", "expected"), [
    (0, serving(0, phase="Stopped"), [], "Stopped"),
    (0, serving(3), members(3), "Stopped"),  # stopping: the pods deleted this pass no longer stand
    (3, serving(), members(3), "Running"),
    (3, serving(), [*members(3)[:4], pod(2, ready=False)], "Degraded"),
    (3, serving(phase="Starting"), [*members(3)[:4], pod(2, ready=False)], "Starting"),
    (3, serving(phase="Recovering", gen=2), [], "Recovering"),
])
def test_the_fleet_phase_follows_what_stands(replicas: int, status: EngineCoreSetStatus, pods: list[PodObs],
                                             expected: str) -> None:
    fleet = make_ecs("f").replicas(replicas).obj()
    step, children = children_of(status, pods, fleet)
    assert fleet_phase(fleet, begin(fleet, observed(status, pods), NOW), step, children) == expected


def test_a_fleet_replacing_ranks_is_degraded_and_one_resizing_is_scaling() -> None:
    pods = [*members(3)[:3], pod(1, phase="Failed"), pod(2)]
    step, children = children_of(serving(), pods)
    assert step.replacing_now
    assert fleet_phase(FLEET, begin(FLEET, observed(serving(), pods), NOW), step,
                                              children) == "Degraded"
    status = serving(phase="Scaling", operation=resize_op(3, 1, phase="Draining"))
    seen = FrontendObs(reachable=True, resize=ResizeObs(id="op", phase="Draining"))
    step, children = children_of(status, members(3), frontend=seen)
    basis = begin(FLEET, observed(status, members(3), frontend=seen), NOW)
    assert fleet_phase(FLEET, basis, step, children) == "Scaling"


def test_phase_events_are_told_on_the_transition_only() -> None:
    status = serving(phase="Starting")
    obs = observed(status, members(3))
    basis = begin(FLEET, obs, NOW)
    step = step_of(basis)
    assert [e.reason for e in phase_events(FLEET, obs, basis, step, "Running")] == ["FleetReady"]
    running = begin(FLEET, observed(serving(), members(3)), NOW)
    assert phase_events(FLEET, obs, running, step_of(running), "Running") == ()
    degraded = Condition(type="Degraded", status="True", reason="ReadyTimeout", lastTransitionTime=NOW, message="m")
    assert [e.reason for e in ready_timeout_event(serving(), serving(conditions=(degraded,)))] == ["ReadyTimeout"]
    assert ready_timeout_event(serving(conditions=(degraded,)), serving(conditions=(degraded,))) == ()


def test_rank_statuses_show_the_frontends_account_of_moving_ranks() -> None:
    op = resize_op(3, 5, phase="Preparing")
    seen = FrontendObs(reachable=True, resize=ResizeObs(id="op", phase="Preparing", ranks={
        3: ("Joining", "handshake"), 4: ("Joining", "handshake")}))
    pods = [*members(3), pod(3, ready=False), pod(4, node="")]
    step, children = children_of(serving(phase="Scaling", operation=op), pods, make_ecs("f").replicas(5).obj(),
                                 frontend=seen)
    ranks = rank_statuses(FLEET, step, children)
    assert [(r.rank, r.phase, r.message) for r in ranks][3:] == [(3, "Joining", "handshake"), (4, "Pending", "")]


def test_a_rank_replaced_in_place_is_pending_then_joining() -> None:
    pods = [*members(3)[:3], pod(1, phase="Failed"), pod(2)]
    step, children = children_of(serving(), pods)
    ranks = {r.rank: r for r in rank_statuses(FLEET, step, children)}
    assert ranks[1].phase == "Pending"
    assert ranks[1].message.startswith("being replaced in place (replace-r1-g1-")
    assert ranks[0] == RankStatus(rank=0, pod="f-engine-0", phase="Serving")


def test_the_wake_up_is_the_operations_poll_the_retry_or_the_backoff_end() -> None:
    basis = basis_of(serving(), members(3))
    quiet = step_of(basis)
    assert operation_wake(quiet, 0, False) is None
    assert operation_wake(replace(quiet, retry_in=200.0), 0, False) == 200
    assert operation_wake(replace(quiet, retry_in=200.0), 30, False) == 30
    resize = start_resize(make_ecs("f").replicas(4).obj(), 3, 1, NOW)
    assert operation_wake(replace(quiet, resize=resize), 0, False) == RESIZE_POLL_SECONDS
    assert operation_wake(replace(quiet, resize=resize), 0, True) == REDUNDANT_EXPERTS_POLL_SECONDS
    waiting = ReplaceStep(operation=replace_op(), wait=7.0)
    assert operation_wake(replace(quiet, replacing=waiting), 0, False) == 7


def test_the_requeue_adds_the_readiness_deadlines_and_the_frontends_view() -> None:
    basis = basis_of(serving(), members(3))
    step = step_of(basis)
    unready = [pod(0, ready=False, unready_since=at(-1790))]
    assert requeue_after(FLEET, step, serving(phase="Starting"), (), None, NOW) == 1800
    assert requeue_after(FLEET, step, serving(phase="Starting"), unready, None, NOW) == 11
    assert requeue_after(FLEET, step, serving(), (), None, NOW) == 15
    assert requeue_after(FLEET, step, serving(), (), 1.0, NOW) == 1


@pytest.mark.parametrize(("change", "told"), [
    ({"storage": {"pvc": {"claimName": "weights"}}, "model": "m"}, "model, storage"),
    ({"engine": {"podTemplate": {"spec": {"runtimeClassName": "nvidia"}}}}, "engine.podTemplate"),
    ({"image": "other:2"}, "image"),
])
def test_a_fleet_recreated_for_a_new_configuration_says_which_part_changed(change: dict[str, Any], told: str) -> None:
    """The pods carry their configuration's parts (ANNOTATION_CONFIG_SECTIONS): the Restarting event names the
    ones that differ (storage, a role's pod template, ...), as a platform team needs to know why every rank
    restarts."""
    old = make_ecs("f").replicas(3)
    built = [c for c in builders.fleet_children(old.obj(), dp_size=3, admin_token="t", fleet_generation=1)
             if c["kind"] == "Pod"]
    pods = [replace(pod_obs(p["metadata"]["name"], {**p["metadata"], "uid": f"u{i}"}, {**p["spec"], "nodeName": "n"},
                            {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}))
            for i, p in enumerate(built)]
    new = make_ecs("f").replicas(3)
    for key, value in change.items():
        new = new.set(key, value)
    out = plan(new.obj(), observed(serving(), pods), NOW)
    (restarting,) = [e for e in out.events if e.reason == "Restarting"]
    assert restarting.message.startswith(f"spec changed ({told}): recreating all ranks at 3"), restarting.message


# ---- a replacement of the frontend and/or coordinator in place ------------------------------------------
def members_op(phase: Any = "Pending", started: float = 0, roles: tuple[Any, ...] = ("frontend",)) -> OperationStatus:
    return OperationStatus(id="replace-frontend-g1-x", fromReplicas=3, toReplicas=3, phase=phase,
                           startedAt=at(started), fleetGeneration=1, members=roles)


def test_only_a_serving_dense_fleet_that_lost_only_its_members_replaces_them_in_place() -> None:
    moe = make_ecs("f").replicas(3).expert_parallel().obj()
    lost_frontend = ((None, "frontend (pod f-frontend) failed"),)
    cases: list[tuple[EngineCoreSetStatus, FleetRef, tuple[Any, ...], tuple[Any, ...], bool, bool]] = [
        (serving(), FLEET, lost_frontend, ("frontend",), False, True),
        (serving(phase="Degraded"), FLEET, lost_frontend, ("frontend",), False, True),
        (serving(), moe, lost_frontend, ("frontend",), False, False),  # elastic EP: wave and EPLB state
        (serving(), FLEET, ((None, "resize op lost the fleet"),), (), False, False),  # an operation's loss
        # with some engine ranks (left out of the attach, replaced after), not every one
        (serving(), FLEET, (*lost_frontend, (1, "rank 1 failed")), ("frontend",), False, True),
        (serving(), FLEET, (*lost_frontend, *((r, f"rank {r} failed") for r in range(3))), ("frontend",), False,
         False),
        (serving(phase="Scaling", operation=resize_op(3, 4, phase="Preparing")), FLEET,
         (*lost_frontend, (1, "rank 1 failed")), ("frontend",), False, False),
        (serving(), FLEET, lost_frontend, ("frontend",), True, False),  # a configuration change
        # the frontend lost during a dense resize it ran (which ends with it): yes; the coordinator alone: not now
        # (once the resize ended: planner.members.after_resize)
        (serving(phase="Scaling", operation=resize_op(3, 4, phase="Preparing")), FLEET, lost_frontend,
         ("frontend",), False, True),
        (serving(phase="Scaling", operation=resize_op(3, 4, phase="Preparing")), FLEET,
         ((None, "coordinator (pod f-coordinator) failed"),), ("coordinator",), False, False),
        (serving(phase="Scaling", operation=resize_op(3, 4, phase="Preparing")), moe, lost_frontend,
         ("frontend",), False, False),
        (serving(phase="Starting"), FLEET, lost_frontend, ("frontend",), False, False),
    ]
    for status, fleet, lost, roles, changed, expected in cases:
        basis = basis_of(status, members(3, fleet), fleet)
        assert members_in_place(fleet, basis, lost, roles, changed) is expected, (status.phase, lost, roles)


def test_a_lost_frontend_starts_a_member_replacement_without_backoff_as_the_streaks_first_or_second() -> None:
    pods = [pod("coordinator"), pod("frontend", phase="Failed"), *(pod(r) for r in range(3))]
    # (attempt, members replaced before): only member losses count; a rank's (attempt 1, none) does not.
    for attempt, members, expected in ((0, 0, True), (1, 1, True), (1, 0, True), (2, 1, True), (2, 2, False)):
        streak = RecoveryStatus(attempt=attempt, lostAt=at(-5), observedGeneration=1, members=members) \
            if attempt else None
        step = decide_after(serving(phase="Degraded" if attempt else "Running", recovery=streak), pods,
                            Losses(lost=((None, "frontend (pod f-frontend) failed"),), members=("frontend",)))
        assert isinstance(step, Step)
        assert step.recovery is not None
        assert step.recovery.attempt == attempt + 1
        assert step.recoveries == 1
        if expected:
            assert (step.generation, step.new_incarnation, step.replacing_now, step.attaching) == (
                1, False, True, frozenset({0}))
            assert step.operation is not None
            assert (step.operation.members, step.operation.phase) == (("frontend",), "Pending")
            assert step.recovery.retryAt == step.recovery.lostAt  # not held by a backoff
            assert [e.reason for e in step.events] == ["MemberLost"]
            assert [(a.name, a.uid) for a in step.replacing.actions] == [  # type: ignore[union-attr]
                ("f-frontend", "uid-f-frontend-1")]
            assert step.recovery.members == members + 1
        else:  # a third member loss in the streak: the fleet is recreated, with its backoff
            assert (step.generation, step.new_incarnation, step.phase) == (2, True, "Recovering")
            assert [e.reason for e in step.events] == ["RankLost"]
            assert step.recovery.members == members


def test_a_member_replacement_deletes_waits_creates_and_completes() -> None:
    old = [pod("coordinator"), pod("frontend", phase="Failed"), *(pod(r) for r in range(3))]
    pending = members_op()
    step = continue_members(FLEET, observed(serving(operation=pending), old), pending,
                            {p.name: p for p in old}, NOW)
    assert (step.operation.phase, step.create) == ("Pending", False)
    assert [a.name for a in step.actions if isinstance(a, Delete)] == ["f-frontend"]
    going = [pod("coordinator"), pod("frontend", phase="Failed", terminating=True), *(pod(r) for r in range(3))]
    step = continue_members(FLEET, observed(serving(operation=pending), going), pending, {}, NOW)
    assert (step.operation.phase, step.actions, step.create) == ("Pending", (), False)  # waits while it goes
    gone = [pod("coordinator"), *(pod(r) for r in range(3))]
    step = continue_members(FLEET, observed(serving(operation=pending), gone), pending, {p.name: p for p in gone}, NOW)
    assert (step.operation.phase, step.create, step.lost) == ("Preparing", True, "")
    preparing = step.operation
    starting = [*gone, pod("frontend", ready=False)]
    step = continue_members(FLEET, observed(serving(operation=preparing), starting), preparing,
                            {p.name: p for p in starting}, at(30))
    assert (step.operation.phase, step.lost) == ("Preparing", "")
    done = [*gone, pod("frontend")]
    step = continue_members(FLEET, observed(serving(operation=preparing), done), preparing,
                            {p.name: p for p in done}, at(40))
    assert step.operation.phase == "Completed"
    assert [e.reason for e in step.events] == ["FrontendReplaced"]
    assert "after 40s; the engines served on, none restarted" in step.events[0].message
    ended = [*gone, pod("frontend", phase="Failed", message="exited with 1")]
    step = continue_members(FLEET, observed(serving(operation=preparing), ended), preparing,
                            {p.name: p for p in ended}, at(40))
    assert step.lost == f"replacement {preparing.id}: the new frontend (pod f-frontend) failed: exited with 1"
    late = FLEET.spec.scaling.readyTimeoutSeconds + 121
    step = continue_members(FLEET, observed(serving(operation=preparing), starting), preparing,
                            {p.name: p for p in starting}, at(late))
    assert f"not done {late}s after it began" in step.lost


def test_the_member_pods_a_replacement_moves_are_no_losses_and_the_others_are() -> None:
    op = members_op("Preparing")
    pods = [pod("coordinator", phase="Failed"), *(pod(r) for r in range(3))]  # the new frontend not created yet
    obs = observed(serving(phase="Degraded", operation=op), pods)
    basis = begin(FLEET, obs, NOW)
    flight = follow_operation(FLEET, obs, basis, NOW)
    assert flight.moving_members == {"f-frontend"}
    losses = find_losses(FLEET, obs, basis, flight, NOW)
    assert [rank for rank, _ in losses.lost] == [None]
    assert losses.members == ("coordinator",)
    step = after_losses(FLEET, obs, basis, losses, first_step(basis, flight), PlanSettings(), NOW)
    assert isinstance(step, Step)
    assert (step.generation, step.new_incarnation) == (2, True)  # something else lost meanwhile: recreated
    assert step.operation is not None
    assert step.operation.phase == "Failed"


def test_a_member_replacement_holds_its_pods_until_the_old_ones_are_gone_and_the_budget_holds_the_engines() -> None:
    both = members_op(roles=("coordinator", "frontend"))
    pods = [pod("coordinator", phase="Failed"), *(pod(r) for r in range(3))]  # the frontend vanished already
    step, children = children_of(serving(phase="Degraded", operation=both), pods)
    assert step.replacing_now
    assert not children.created  # the frontend waits for the coordinator's old pod
    assert [a.name for a in children.actions if isinstance(a, Delete)] == ["f-coordinator"]
    gone = [*(pod(r) for r in range(3))]
    step, children = children_of(serving(phase="Degraded", operation=both), gone)
    assert sorted(children.created) == ["f-coordinator", "f-frontend"]
    frontend = next(a.obj for a in children.actions
                    if isinstance(a, Apply) and a.obj["metadata"]["name"] == "f-frontend")
    assert "--attach" in frontend["spec"]["containers"][0]["args"]
    budget = next(a.obj for a in children.actions if isinstance(a, Apply)
                  and a.obj["metadata"]["name"] == constants.engines_budget_name("f"))
    assert budget["spec"]["minAvailable"] == 3
