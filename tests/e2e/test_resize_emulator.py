# SPDX-License-Identifier: Apache-2.0
"""Resizes in place and their faults, on one operator-run fleet of emulated engines.

The control plane is real, the operator runs as its own process (so that a test can SIGKILL it and
start it again), `podrunner` runs the pods as processes, the frontend and the coordinator are real
vLLM, and each engine pod runs corefleet's wire-level engine emulator in place of a vLLM engine
(a 10 ms token delay, so that requests stay in flight). One fleet serves the whole module: each
test first brings it to the size it starts from, so each also runs alone. Real vLLM engines resize in place
on the real node (test_node_fleet.py) and in local mode (test_vllm_local_fleet.py).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from corefleet_client.admin import RankState
from corefleet_harness.emulator import EMULATOR_MODULE
from corefleet_harness.localcluster import LocalControlPlane
from corefleet_harness.support import wait_until
from corefleet_harness.tinymodel import write_tiny_model
from corefleet_operator import constants
from factories import make_ecs
from fleettest import FleetView, Load, OperatorProcess, PinnedStream, ResizeWatch, ecs_engine_args
from podrunner import PodRunner

pytestmark = pytest.mark.e2e

NAME = "emu"
SERVED = "tiny"
TOKEN_DELAY_MS = 10
CONTEXT = 4096  # long enough for requests that stay in flight for tens of seconds at the token delay
# readyTimeoutSeconds, the join timeout and every pod's startup budget: an emulated engine starts in a fraction
# of a second, but the frontend and the coordinator are real vLLM (20-40 s to import it on 2 busy cores); a rank
# that never joins fails the resize after it.
JOIN_TIMEOUT = 60
SETTLE = 240.0
HOLD_TIMEOUT = 10  # how long a request waits at the frontend while no rank takes requests (spec.frontend.hold)


class Setup:
    def __init__(self, k8s: LocalControlPlane, ns: str, runner: PodRunner, operator: OperatorProcess,
                 fleet: FleetView) -> None:
        self.k8s, self.ns, self.runner, self.operator, self.fleet = k8s, ns, runner, operator, fleet

    def settle(self, replicas: int, timeout: float = SETTLE) -> None:
        self.fleet.wait_settled(replicas, timeout)

    def load(self, workers: int = 2) -> Load:
        return Load(f"http://{self.fleet.frontend_ip()}:8000", SERVED, workers=workers, max_tokens=24).start()


@pytest.fixture(scope="module")
def setup(k8s: LocalControlPlane, crd_installed: None, module_namespace: str,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("resize-emulator")
    model = write_tiny_model(tmp / "tiny", context=CONTEXT)
    emulator = (EMULATOR_MODULE, "--token-delay-ms", str(TOKEN_DELAY_MS))
    with PodRunner(k8s, module_namespace, tmp / "pods", engine=emulator) as runner, \
            OperatorProcess(k8s, module_namespace, tmp) as operator:
        ecs = (make_ecs(NAME, module_namespace).model(str(model)).replicas(2).max_replicas(4).tp(1)
               .set("engine.loadFormat", "dummy").set("scaling.readyTimeoutSeconds", JOIN_TIMEOUT)
               .set("scaling.drainTimeoutSeconds", 60).set("frontend.hold.timeoutSeconds", HOLD_TIMEOUT)
               .set("idle", {}).arg(*ecs_engine_args(SERVED, CONTEXT)).manifest())
        k8s.kubectl("apply", "-n", module_namespace, "-f", "-", input=json.dumps(ecs))
        fleet = FleetView(k8s, module_namespace, NAME, runner, SERVED)
        s = Setup(k8s, module_namespace, runner, operator, fleet)
        s.settle(2)
        yield s
        operator.check_clean()
        assert not runner.errors, runner.errors


def pids(s: Setup, ranks: range) -> dict[int, int]:
    return {r: s.fleet.engine_pid(r) for r in ranks}


def test_2_4_1_in_place_under_load(setup: Setup) -> None:
    s = setup
    s.fleet.at(2, SETTLE)
    before = s.fleet.status()
    before_pids, before_uids = pids(s, range(2)), s.fleet.uids()
    load = s.load()
    try:
        with ResizeWatch(s.fleet) as up:
            s.fleet.scale(4)
            s.settle(4)
        def every_rank_served() -> bool:
            status = s.fleet.admin().fleet()
            return status.data_parallel_size == 4 and all(r.requests_total > 0 for r in status.ranks)

        wait_until(every_rank_served, 30, "every rank, the new ones too, to serve requests")
        assert pids(s, range(2)) == before_pids
        # A long request on a leaving rank: the drain lets it finish (~4 s at the token delay).
        long = PinnedStream(f"http://{s.fleet.frontend_ip()}:8000", SERVED, rank=3, max_tokens=400)
        assert long.first_token.wait(30)
        with ResizeWatch(s.fleet) as down:
            s.fleet.scale(1)
            s.settle(1)
    finally:
        load.stop()
    assert long.result() == (True, "finish_reason length")
    assert load.outcomes, "the load sent nothing"
    assert not load.failures(), load.summary()
    assert s.fleet.engine_pid(0) == before_pids[0]
    after = s.fleet.uids()
    for name in (f"{NAME}-coordinator", f"{NAME}-frontend", f"{NAME}-engine-0"):
        assert after[name] == before_uids[name], f"{name} was recreated"
    assert "Preparing" in up.phases, up.phases
    assert up.phases[-1] == "Completed", up.phases
    assert "Draining" in down.phases, down.phases
    assert down.phases[-1] == "Completed", down.phases
    assert "Scaling" in up.fleet_phases, up.fleet_phases
    assert up.fleet_phases[-1] == "Running", up.fleet_phases
    for rank in (1, 2, 3):
        name = constants.engine_name(NAME, rank)
        assert rank in down.retired_at, (rank, down.retired_at)
        assert down.retired_at[rank] <= down.deleted_at[name], f"{name} deleted before rank {rank} was retired"
    st = s.fleet.status()
    assert (st["replicas"], st["fleetGeneration"], st["recoveries"]) == (1, before["fleetGeneration"],
                                                                         before["recoveries"]), st


def test_operator_killed_mid_scale_up_and_mid_scale_down_resumes_once(setup: Setup) -> None:
    s = setup
    s.fleet.at(1, SETTLE)
    with ResizeWatch(s.fleet) as watch:
        # Mid scale-up: the resize is recorded, the new engines have not joined (maybe not even been created).
        s.fleet.scale(3)
        up = s.fleet.wait_operation("Pending", "Preparing", timeout=SETTLE)
        s.operator.kill()
        s.operator.start()
        s.settle(3)
        assert s.fleet.operation()["id"] == up["id"]  # the same resize, carried on
        # Mid scale-down: the leaving ranks drain.
        load = s.load(workers=3)
        try:
            s.fleet.scale(1)
            down = s.fleet.wait_operation("Pending", "Draining", timeout=SETTLE)
            s.operator.kill()
            s.operator.start()
            s.settle(1)
        finally:
            load.stop()
    assert s.fleet.operation()["id"] == down["id"]
    assert not load.failures(), load.summary()
    # One operation each on the frontend (a killed operator's last events may be lost, never doubled).
    assert [o.id for o in s.fleet.admin().resizes()][:2] == [down["id"], up["id"]]
    events = s.fleet.events()
    for op in (up, down):
        assert len([m for reason, m in events if reason == "ResizeStarted" and str(op["id"]) in m]) <= 1, events
    # No pod was recreated: the scale-up's pods were deleted only by the scale-down, once each.
    deleted = sorted(watch.deleted_at)
    assert deleted == [constants.engine_name(NAME, 1), constants.engine_name(NAME, 2)], deleted
    assert watch.phases[-1] == "Completed"


def test_a_change_during_a_resize_is_queued(setup: Setup) -> None:
    s = setup
    s.fleet.at(1, SETTLE)
    s.fleet.scale(2)
    first = s.fleet.wait_operation("Pending", "Preparing", timeout=SETTLE)
    s.fleet.scale(3)
    wait_until(lambda: any(r == "ResizeQueued" for r, _ in s.fleet.events()), 30, "a ResizeQueued event")
    assert s.fleet.operation()["id"] == first["id"]  # never two at once
    s.settle(3)
    ops = s.fleet.admin().resizes()
    assert [(o.from_replicas, o.to_replicas) for o in ops[:2]] == [(2, 3), (1, 2)]
    assert s.fleet.status()["recoveries"] == 0


def test_a_rank_that_never_joins_fails_the_resize_and_the_fleet_serves_on(setup: Setup) -> None:
    s = setup
    s.fleet.at(3, SETTLE)
    s.runner.hold.add(constants.engine_name(NAME, 3))  # its pod is bound but never starts
    survivors = s.fleet.uids()
    load = s.load()
    try:
        s.fleet.scale(4)
        failed = s.fleet.wait_operation("Failed", timeout=JOIN_TIMEOUT + 60)
        assert "did not join" in str(failed["message"]), failed
        s.fleet.scale(3)  # give up on 4 (else the operator tries again after its backoff)
        s.settle(3)
    finally:
        load.stop()
        s.runner.hold.clear()
    assert not load.failures(), load.summary()
    assert {n: u for n, u in s.fleet.uids().items()} == survivors
    assert any(r == "ResizeFailed" for r, _ in s.fleet.events())
    status = s.fleet.admin().fleet()
    assert status.data_parallel_size == 3
    assert [r.state for r in status.ranks] == [RankState.SERVING] * 3


def test_a_leaving_rank_killed_while_draining_fails_its_requests_and_the_resize_completes(setup: Setup) -> None:
    s = setup
    s.fleet.scale(3)
    s.settle(3)
    url = f"http://{s.fleet.frontend_ip()}:8000"
    # Long streams pinned to the leaving rank (unpinned, where a request lands is the router's choice),
    # and short unpinned load that the other ranks serve throughout.
    doomed = [PinnedStream(url, SERVED, rank=2, max_tokens=3000) for _ in range(2)]
    load = s.load()
    try:
        for stream in doomed:
            assert stream.first_token.wait(60), "a pinned stream on rank 2 got no first token"
        wait_until(lambda: s.fleet.admin().fleet().rank(2).in_flight >= 2, 30, "both streams in flight on rank 2",
                   diagnose=lambda: json.dumps(s.fleet.admin().fleet_json(), indent=1))
        s.fleet.scale(2)
        s.fleet.wait_operation("Draining", timeout=SETTLE)
        os.killpg(s.fleet.engine_pid(2), signal.SIGKILL)
        s.settle(2, timeout=60)
    finally:
        load.stop()
    for stream in doomed:
        ok, detail = stream.result()
        assert not ok, detail
        assert "rank 2" in detail, detail
    # A short unpinned request may have been on rank 2 when it died: that one fails, naming it; no other.
    assert load.outcomes, "the load sent nothing"
    assert all("rank 2" in o.detail for o in load.failures()), load.summary()
    st = s.fleet.status()
    assert (st["recoveries"], st["fleetGeneration"]) == (0, 1), st
    op = s.fleet.admin().resizes()[0]
    assert op.rank(2).state == RankState.RETIRED
    assert "died while draining" in op.rank(2).message
    assert s.fleet.admin().fleet().state == "Serving"


class EndpointWatch:
    """Polls, in a thread, the frontend pod's Ready condition and its /health; keeps every moment either was not."""

    def __init__(self, s: Setup, interval: float = 0.2) -> None:
        self.s, self.interval = s, interval
        self.bad: list[str] = []
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="endpoint-watch", daemon=True)

    def __enter__(self) -> EndpointWatch:
        self._url = f"http://{self.s.fleet.frontend_ip()}:8000/health"
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        name = constants.frontend_name(NAME)
        while not self._stop.is_set():
            self.polls += 1
            try:
                pod = self.s.fleet.pods().get(name)
                conditions = {c["type"]: c["status"] for c in (pod or {}).get("status", {}).get("conditions", [])}
                if conditions.get("Ready") != "True":
                    self.bad.append(f"frontend pod not Ready: {conditions}")
                with urllib.request.urlopen(self._url, timeout=5) as resp:
                    if resp.status != 200:
                        self.bad.append(f"/health {resp.status}")
            except urllib.error.HTTPError as e:
                self.bad.append(f"/health {e.code}")
            except (OSError, ValueError) as e:
                self.bad.append(f"{type(e).__name__}: {e}")
            self._stop.wait(self.interval)


def test_a_killed_dense_rank_is_replaced_in_place_while_rank_0_serves(setup: Setup) -> None:
    s = setup
    s.fleet.scale(2)  # what the previous test left; set here so that one failure does not fail the next
    s.settle(2)
    victim = constants.engine_name(NAME, 1)
    before_uids = s.fleet.uids()
    survivors = {name: s.runner.pod(name).popen.pid for name in (  # type: ignore[union-attr]
        constants.frontend_name(NAME), constants.coordinator_name(NAME), constants.engine_name(NAME, 0))}
    st = s.fleet.status()
    recoveries, incarnation = st["recoveries"], st["fleetGeneration"]
    pinned = Load(f"http://{s.fleet.frontend_ip()}:8000", SERVED, workers=2, max_tokens=16,
                  headers={"X-data-parallel-rank": "0"})
    with EndpointWatch(s) as endpoint, ResizeWatch(s.fleet) as watch:
        pinned.start()
        try:
            wait_until(lambda: len([o for o in pinned.outcomes if o.ok]) >= 4, 60, "rank 0's load to get going")
            os.killpg(s.fleet.engine_pid(1), signal.SIGKILL)
            wait_until(lambda: (s.fleet.status().get("operation") or {}).get("replace") == [1], 60,
                       "a replacement of rank 1 in status.operation", diagnose=s.fleet.describe)
            s.settle(2)
            served = len([o for o in pinned.outcomes if o.ok])
            wait_until(lambda: len([o for o in pinned.outcomes if o.ok]) > served, 30, "rank 0 to serve on")
        finally:
            pinned.stop()
    # Rank 1 has a new pod (same name, same incarnation); the frontend, coordinator and rank 0 are the same
    # pods and processes, and served throughout.
    after = s.fleet.uids()
    assert after[victim] != before_uids[victim]
    assert {n: u for n, u in after.items() if n != victim} == {n: u for n, u in before_uids.items() if n != victim}
    assert {name: s.runner.pod(name).popen.pid for name in survivors} == survivors  # type: ignore[union-attr]
    assert pinned.outcomes, "the load sent nothing"
    assert not pinned.failures(), pinned.summary()
    assert endpoint.polls > 10
    assert not endpoint.bad, endpoint.bad[:10]
    # Counted as one loss; the fleet phase was Degraded meanwhile, never Recovering.
    st = s.fleet.status()
    assert (st["replicas"], st["fleetGeneration"], st["recoveries"]) == (2, incarnation, recoveries + 1), st
    assert st["recovery"]["attempt"] >= 1, st
    assert "rank 1" in st["recovery"]["reason"], st
    op = st["operation"]
    assert (op["phase"], op["replace"], op["fromReplicas"], op["toReplicas"]) == ("Completed", [1], 2, 2), op
    assert "Degraded" in watch.fleet_phases, watch.fleet_phases
    assert "Recovering" not in watch.fleet_phases, watch.fleet_phases
    assert watch.fleet_phases[-1] == "Running", watch.fleet_phases
    events = s.fleet.events()
    assert any(r == "RankLost" and "replacing rank 1 in place" in m for r, m in events), events
    assert any(r == "RankReplaced" and op["id"] in m for r, m in events), events
    # The frontend replaced it through its handshake: one operation, and rank 1 serves again.
    assert s.fleet.admin().resizes()[0].replace == (1,)
    status = s.fleet.admin().fleet()
    assert [r.state for r in status.ranks] == [RankState.SERVING] * 2


def test_a_frontend_killed_mid_scale_up_is_replaced_in_place_and_the_resize_rolled_back_then_run_again(
        setup: Setup) -> None:
    """The frontend SIGKILLed while a scale-up 2 -> 3 waits for rank 2 (Preparing): the resize lived in it, so it
    is rolled back (ResizeFailed: rank 2's pod goes), the frontend is replaced in place and re-attaches to ranks 0
    and 1 (the emulator answers corefleet's attach call as corefleet's engine does), and the resize runs again, as
    `replicas` still asks: one recovery, the same incarnation, ranks 0 and 1 never recreated."""
    s = setup
    s.fleet.scale(2)
    s.settle(2)
    before = s.fleet.status()
    uids = s.fleet.uids()
    events = len(s.fleet.events())
    s.fleet.scale(3)
    s.fleet.wait_operation("Preparing", timeout=SETTLE)
    os.killpg(s.runner.pod(constants.frontend_name(NAME)).popen.pid, signal.SIGKILL)  # type: ignore[union-attr]
    wait_until(lambda: "FrontendReplaced" in {r for r, _ in s.fleet.events()[events:]}, 2 * SETTLE,
               "the frontend replaced in place", diagnose=s.fleet.describe)
    s.settle(3, timeout=2 * SETTLE)  # the resize run again once the frontend was back
    story = s.fleet.events()[events:]
    told = {reason: message for reason, message in story}
    assert "rolled back to 2 ranks" in told.get("ResizeFailed", ""), story
    assert "MemberLost" in told, story
    assert not {"Recovering", "Restarting", "RankLost"} & set(told), story
    st = s.fleet.status()
    assert (st["fleetGeneration"], st["recoveries"]) == (before["fleetGeneration"], before["recoveries"] + 1), st
    after = s.fleet.uids()
    for rank in (0, 1):
        name = constants.engine_name(NAME, rank)
        assert after[name] == uids[name], f"{name} was recreated"
    assert after[constants.frontend_name(NAME)] != uids[constants.frontend_name(NAME)]


def test_a_coordinator_killed_mid_scale_up_is_replaced_in_place_once_the_resize_ended(setup: Setup) -> None:
    """The coordinator SIGKILLed under load while a scale-up 2 -> 3 waits for rank 2 (Preparing). The frontend's
    resize needs no coordinator, but rank 2's engine waits for the coordinator's READY before its handshake ends:
    the operator cancels the scale-up (rank 2's pod goes; had rank 2 joined first, the resize completes instead),
    replaces the coordinator in place once the resize ended, and the scale-up runs again, as `replicas` still asks.
    No request fails; one recovery, the same incarnation; the frontend and ranks 0 and 1 are never recreated."""
    s = setup
    s.fleet.at(2, SETTLE)
    before = s.fleet.status()
    uids = s.fleet.uids()
    events = len(s.fleet.events())
    load = s.load()
    try:
        s.fleet.scale(3)
        s.fleet.wait_operation("Preparing", timeout=SETTLE)
        coordinator = s.runner.pod(constants.coordinator_name(NAME))
        os.killpg(coordinator.popen.pid, signal.SIGKILL)  # type: ignore[union-attr]
        wait_until(lambda: "CoordinatorReplaced" in {r for r, _ in s.fleet.events()[events:]}, 2 * SETTLE,
                   "the coordinator replaced in place", diagnose=s.fleet.describe)
        s.settle(3, timeout=2 * SETTLE)  # the scale-up run again (or completed) once the coordinator was back
    finally:
        load.stop()
    story = s.fleet.events()[events:]
    told = {reason: message for reason, message in story}
    print(f"coordinator killed mid scale-up: {story}; {load.summary()}")
    assert "MemberLost" in told, story
    assert not {"Recovering", "Restarting", "RankLost"} & set(told), story
    if "ResizeCancelling" in told:  # rank 2 had not joined: rolled back, then run again
        assert "a new rank cannot join without it" in told["ResizeCancelling"], story
        assert "retried once the coordinator is replaced in place" in told.get("ResizeFailed", ""), story
    assert "the fleet serves at 3 ranks" in told.get("ResizeCompleted", ""), story
    assert load.outcomes, "the load sent nothing"
    assert not load.failures(), load.summary()
    st = s.fleet.status()
    assert (st["fleetGeneration"], st["recoveries"]) == (before["fleetGeneration"], before["recoveries"] + 1), st
    after = s.fleet.uids()
    for name in (constants.engine_name(NAME, 0), constants.engine_name(NAME, 1), constants.frontend_name(NAME)):
        assert after[name] == uids[name], f"{name} was recreated"
    assert after[constants.coordinator_name(NAME)] != uids[constants.coordinator_name(NAME)]


def test_a_coordinator_killed_mid_replacement_of_a_rank_is_replaced_in_place_and_the_rank_replaced_again(
        setup: Setup) -> None:
    """Rank 1's engine SIGKILLed, and its new pod held unstarted (as if its image never pulled) while the frontend
    waits for it; then the coordinator SIGKILLed. A new engine waits for the coordinator's READY, so the replacement
    is rolled back (ResizeFailed; the frontend, which lives on, gives its part up), the coordinator is replaced in
    place, and rank 1 replaced again (RankReplacementResumed, RankReplaced): the same incarnation, two recoveries
    (the engine's loss and the coordinator's), rank 0 and the frontend never recreated."""
    s = setup
    s.fleet.at(2, SETTLE)
    before = s.fleet.status()
    uids = s.fleet.uids()
    events = len(s.fleet.events())
    engine1 = constants.engine_name(NAME, 1)
    s.runner.hold.add(engine1)
    try:
        os.killpg(s.fleet.engine_pid(1), signal.SIGKILL)

        def asked() -> str:
            op = s.fleet.status().get("operation") or {}
            ids = {o.id for o in s.fleet.admin().resizes() if o.replace == (1,) and o.phase == "Preparing"}
            return op["id"] if op.get("replace") == [1] and op.get("id") in ids else ""

        wait_until(asked, SETTLE, "the frontend asked to replace rank 1 (its new pod held)", diagnose=s.fleet.describe)
        interrupted = asked()
        os.killpg(s.runner.pod(constants.coordinator_name(NAME)).popen.pid, signal.SIGKILL)  # type: ignore[union-attr]
        wait_until(lambda: "MemberLost" in {r for r, _ in s.fleet.events()[events:]}, SETTLE,
                   "the coordinator's loss acted on", diagnose=s.fleet.describe)
    finally:
        s.runner.hold.discard(engine1)
    story, told = rank_1_replaced_story(s, events, "coordinator killed mid replacement of rank 1")
    assert f"replacement {interrupted} of rank 1 rolled back" in told.get("ResizeFailed", ""), story
    assert "replaced again once the coordinator is" in told["ResizeFailed"], story
    assert {"MemberLost", "CoordinatorReplaced", "RankReplacementResumed", "RankReplaced"} <= set(told), story
    assert not {"Recovering", "Restarting"} & set(told), story
    cancelled = next(o for o in s.fleet.admin().resizes() if o.id == interrupted)
    assert cancelled.phase == "Failed", cancelled
    assert "cancelled" in cancelled.error, cancelled
    assert_rank_0_and_frontend_kept(s, before, uids, recoveries=2)


def test_the_coordinator_and_an_engine_killed_together_are_replaced_in_place(setup: Setup) -> None:
    """The coordinator's and rank 1's processes SIGKILLed at once (as a node's loss takes both): the coordinator is
    replaced in place with rank 1 left out, then rank 1 is replaced in place; the same incarnation, rank 0 and the
    frontend never recreated."""
    s = setup
    s.fleet.at(2, SETTLE)
    before = s.fleet.status()
    uids = s.fleet.uids()
    events = len(s.fleet.events())
    os.killpg(s.runner.pod(constants.coordinator_name(NAME)).popen.pid, signal.SIGKILL)  # type: ignore[union-attr]
    os.killpg(s.fleet.engine_pid(1), signal.SIGKILL)
    story, told = rank_1_replaced_story(s, events, "coordinator and rank 1 killed together")
    # The process kubelet gives a pod's successor its address, as cluster DNS would follow the name: the frontend hands
    # new engines the coordinator's address it was started with.
    assert not s.runner.address_changes, s.runner.address_changes
    assert {"MemberLost", "CoordinatorReplaced", "RankReplacementResumed", "RankReplaced"} <= set(told), story
    # seen in one pass, or the engine's loss a pass after the coordinator's (left out of its replacement then)
    # The operator sees the two ends in one pass or in two, in either order: the rank left out of the coordinator's
    # replacement from its start or a pass later (one recovery), or the rank's replacement started first and then
    # interrupted by the coordinator's loss (a recovery each: that replacement had begun).
    engine_first = story[0][0] == "RankLost" and "replacing rank 1 in place" in story[0][1]
    if engine_first:
        assert "rolled back" in told.get("ResizeFailed", ""), story
    else:
        assert "rank 1 replaced in place after" in told["MemberLost"] \
            or "rank 1 left out of replacement" in told.get("RankLost", ""), story
    assert not {"Recovering", "Restarting"} & set(told), story
    assert_rank_0_and_frontend_kept(s, before, uids, recoveries=2 if engine_first else 1)


def rank_1_replaced_story(s: Setup, events: int, what: str) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """Once rank 1 is replaced (again) and the fleet settled at 2: the events since `events`, and by reason."""
    wait_until(lambda: "RankReplaced" in {r for r, _ in s.fleet.events()[events:]}, 2 * SETTLE,
               "rank 1 replaced", diagnose=s.fleet.describe)
    s.settle(2)
    story = s.fleet.events()[events:]
    print(f"{what}: {story}")
    return story, dict(story)


def assert_rank_0_and_frontend_kept(s: Setup, before: dict[str, Any], uids: dict[str, str], recoveries: int) -> None:
    """The same incarnation, `recoveries` more, rank 0's and the frontend's pods the same, both ranks serving."""
    st = s.fleet.status()
    assert (st["fleetGeneration"], st["recoveries"]) == (before["fleetGeneration"],
                                                        before["recoveries"] + recoveries), st
    after = s.fleet.uids()
    for name in (constants.engine_name(NAME, 0), constants.frontend_name(NAME)):
        assert after[name] == uids[name], f"{name} was recreated"
    assert [r.state for r in s.fleet.admin().fleet().ranks] == [RankState.SERVING] * 2


def held_request(url: str) -> tuple[int, dict[str, str], str, float]:
    """A completion sent while no rank takes requests: its status, headers (lower-case names), body and how long it
    took."""
    body = json.dumps({"model": SERVED, "prompt": "Hello", "max_tokens": 4}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    start = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=HOLD_TIMEOUT + 60) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read().decode(), time.monotonic() - start
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read().decode(), time.monotonic() - start


def test_a_wake_that_cannot_succeed_leaves_the_fleet_idle_answers_held_requests_503_and_is_retried(
        setup: Setup) -> None:
    """Issue 28: `replicas: 0` with `spec.idle` idles the fleet in place (engine pods gone, frontend and coordinator
    kept); `replicas: 1` wakes it, but the new engine's pod never starts: a request held meanwhile gets 503 with
    Retry-After within the hold's limit, naming the wake; the wake fails at the join timeout, the fleet stays idle
    (status.idle and Degraded/WakeFailed say why) and the operator wakes it again after the recovery backoff."""
    s = setup
    s.fleet.at(1, SETTLE)
    members = {n: u for n, u in s.fleet.uids().items() if "engine" not in n}
    events = len(s.fleet.events())
    engine = constants.engine_name(NAME, 0)

    def idle() -> bool:
        return s.fleet.status().get("phase") == "Idle" and engine not in s.fleet.pods()

    s.fleet.scale(0)
    wait_until(idle, SETTLE, "the fleet idle, its engine pod gone", diagnose=s.fleet.describe)
    assert {n: u for n, u in s.fleet.uids().items()} == members
    s.runner.hold.add(engine)  # bound, never started: it never gets ready
    try:
        s.fleet.scale(1)
        wait_until(lambda: s.fleet.status().get("phase") == "Waking", 60, "the wake to start",
                   diagnose=s.fleet.describe)
        status, headers, body, took = held_request(f"http://{s.fleet.frontend_ip()}:8000")
        assert status == 503, body
        assert HOLD_TIMEOUT - 1 <= took <= HOLD_TIMEOUT + 10, took
        assert headers.get("retry-after") == str(HOLD_TIMEOUT), headers
        assert "the fleet is waking (wake-" in json.loads(body)["error"]["message"], body
        wait_until(lambda: any(r == "WakeFailed" for r, _ in s.fleet.events()[events:]), JOIN_TIMEOUT + 120,
                   "the wake to fail", diagnose=s.fleet.describe)
        st = s.fleet.status()
        assert st["idle"]["wakeFailures"] == 1, st
        assert st["idle"]["retryAt"], st
        assert {c["type"]: c["reason"] for c in st["conditions"]}["Degraded"] == "WakeFailed", st
    finally:
        s.runner.hold.discard(engine)
    s.settle(1)  # the next wake, after the backoff, with an engine that starts
    told = [r for r, _ in s.fleet.events()[events:]]
    assert told.count("FleetWaking") == 2, told
    assert told.count("FleetAwake") == 1, told
    assert not {"RankLost", "MemberLost", "Recovering"} & set(told), told
    assert {n: u for n, u in s.fleet.uids().items() if "engine" not in n} == members
    status, _, body, _ = held_request(f"http://{s.fleet.frontend_ip()}:8000")
    assert status == 200, body
