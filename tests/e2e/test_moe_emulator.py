# SPDX-License-Identifier: Apache-2.0
"""An `expertParallel` (MoE, elastic EP) fleet starts, serves and recovers, operator-run, with emulated engines.

The control plane is real, the operator runs as its own process, `podrunner` runs the pods as
processes, the frontend and the coordinator are real vLLM (the frontend builds its config with the
engines' EPLB and elastic-EP flags: vllm_compat change 9), and each engine pod runs corefleet's
wire-level engine emulator, which needs what a vLLM elastic-EP engine needs at startup: the
coordination store at the DP master address, engine 0's (served by engine 0's pod,
`corefleet_client.coordstore`), and enforces vLLM's elastic-EP ordering in a resize (a client that
gets it wrong fails against it). Resizes run in place through the frontend's elastic-EP client
(`frontend.elastic`): 2 -> 4 -> 2 under load, 1 refused (below vLLM's minimum for the experts), and
the faults: an operator restarted mid-resize, a leaving rank killed before its SHUTDOWN_COMPLETE, a
new rank that never gets ready.
One fleet serves the module; each test first brings it to the size it starts from, so each also runs alone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from collections.abc import Iterator

import pytest

from corefleet_client.admin import RankState
from corefleet_harness.emulator import EMULATOR_MODULE
from corefleet_harness.localcluster import LocalControlPlane
from corefleet_harness.support import wait_until
from corefleet_harness.tinymodel import VLLM_CPU_FLAGS, write_tiny_model
from corefleet_operator import constants
from factories import make_ecs
from fleettest import FleetView, Load, OperatorProcess, PinnedStream, ResizeWatch
from podrunner import PodRunner

pytestmark = pytest.mark.e2e

NAME = "moe"
SERVED = "tiny-moe"
SETTLE = 240.0
# readyTimeoutSeconds: the join timeout and every pod's startup budget (the frontend and coordinator are real
# vLLM: 20-40 s to import it on 2 busy cores; an emulated engine starts in a fraction of a second).
JOIN_TIMEOUT = 60
CONTEXT = 4096  # long enough for requests that stay in flight for seconds at the token delay


class Setup:
    def __init__(self, k8s: LocalControlPlane, ns: str, runner: PodRunner, fleet: FleetView,
                 operator: OperatorProcess) -> None:
        self.k8s, self.ns, self.runner, self.fleet, self.operator = k8s, ns, runner, fleet, operator

    def settle(self, replicas: int) -> None:
        self.fleet.wait_settled(replicas, SETTLE)

    def engine_log(self, rank: int) -> str:
        pod = self.runner.pod(constants.engine_name(NAME, rank))
        assert pod.log is not None
        return pod.log.read_text(errors="replace")

    def frontend_log(self) -> str:
        pod = self.runner.pod(constants.frontend_name(NAME))
        assert pod.log is not None
        return pod.log.read_text(errors="replace")

    def load(self, workers: int = 2) -> Load:
        return Load(f"http://{self.fleet.frontend_ip()}:8000", SERVED, workers=workers, max_tokens=16).start()

    def complete(self) -> dict[str, object]:
        body = json.dumps({"model": SERVED, "prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True})
        req = urllib.request.Request(f"http://{self.fleet.frontend_ip()}:8000/v1/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            result: dict[str, object] = json.loads(r.read())
        return result


@pytest.fixture(scope="module")
def setup(k8s: LocalControlPlane, crd_installed: None, module_namespace: str,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("moe-emulator")
    model = write_tiny_model(tmp / "tiny-moe", moe=True, context=CONTEXT)
    flags = list(VLLM_CPU_FLAGS)
    i = flags.index("--load-format")
    del flags[i:i + 2]
    flags[flags.index("--max-model-len") + 1] = str(CONTEXT)
    emulator = (EMULATOR_MODULE, "--token-delay-ms", "10")
    with PodRunner(k8s, module_namespace, tmp / "pods", engine=emulator) as runner, \
            OperatorProcess(k8s, module_namespace, tmp) as operator:
        ecs = (make_ecs(NAME, module_namespace).model(str(model)).replicas(2).max_replicas(4).tp(1).expert_parallel()
               .set("engine.loadFormat", "dummy").set("scaling.readyTimeoutSeconds", JOIN_TIMEOUT)
               .arg(*flags, "--served-model-name", SERVED).manifest())
        k8s.kubectl("apply", "-n", module_namespace, "-f", "-", input=json.dumps(ecs))
        s = Setup(k8s, module_namespace, runner, FleetView(k8s, module_namespace, NAME, runner, SERVED), operator)
        s.settle(2)
        yield s
        operator.check_clean()
        assert not runner.errors, runner.errors


def store_address(log: str) -> str:
    match = re.search(r"DP group formed through the coordination store (\S+) \(rank 0 at port", log)
    assert match, log[-3000:]
    return match.group(1)


def test_the_engines_start_through_engine_0s_coordination_store_and_serve(setup: Setup) -> None:
    s = setup
    engine0_ip = s.fleet.pods()[constants.engine_name(NAME, 0)]["status"]["podIP"]
    assert f"Coordination store listening on {engine0_ip}:{constants.COORD_STORE_PORT}" in s.engine_log(0)
    for rank in (0, 1):  # both opened it at engine 0's address, the DP master INIT named
        assert store_address(s.engine_log(rank)) == f"{engine0_ip}:{constants.COORD_STORE_PORT}"
    result = s.complete()
    assert result["usage"]["completion_tokens"] == 8, result  # type: ignore[index]


def test_2_4_2_in_place_under_load_and_1_refused(setup: Setup) -> None:
    s = setup
    s.fleet.at(2, SETTLE)
    before = s.fleet.uids()
    generation = s.fleet.status()["fleetGeneration"]
    load = s.load()
    try:
        with ResizeWatch(s.fleet) as up:
            s.fleet.scale(4)
            s.settle(4)

        def every_rank_served() -> bool:
            status = s.fleet.admin().fleet()
            return status.data_parallel_size == 4 and all(r.requests_total > 0 for r in status.ranks)

        wait_until(every_rank_served, 30, "every rank, the new ones too, to serve requests")
        # A long request on a leaving rank: the drain lets it finish before the ranks reconfigure.
        long = PinnedStream(f"http://{s.fleet.frontend_ip()}:8000", SERVED, rank=3, max_tokens=300)
        assert long.first_token.wait(30)
        with ResizeWatch(s.fleet) as down:
            s.fleet.scale(2)
            s.settle(2)
    finally:
        load.stop()
    assert long.result() == (True, "finish_reason length")
    assert load.outcomes, "the load sent nothing"
    assert not load.failures(), load.summary()
    after = s.fleet.uids()
    for name in before:  # the coordinator, the frontend and ranks 0 and 1: never restarted
        assert after[name] == before[name], f"{name} was recreated"
    assert "Preparing" in up.phases, up.phases
    assert up.phases[-1] == "Completed", up.phases
    assert "Draining" in down.phases, down.phases
    assert down.phases[-1] == "Completed", down.phases
    for rank in (2, 3):  # each leaving pod deleted only once its rank sent SHUTDOWN_COMPLETE (Retired)
        name = constants.engine_name(NAME, rank)
        assert rank in down.retired_at, (rank, down.retired_at)
        assert down.retired_at[rank] <= down.deleted_at[name], f"{name} deleted before rank {rank} was retired"
    log = s.frontend_log()
    ups = [o for o in s.fleet.admin().resizes() if o.phase == "Completed"]
    assert [(o.from_replicas, o.to_replicas, o.num_redundant_experts) for o in ups[:2]] == [(4, 2, 0), (2, 4, 4)]
    for op in ups[:2]:  # every notification accounted for, in the frontend's log
        assert f"Resize {op.id}: RECONFIGURE_FINISHED from rank 0" in log, log[-4000:]
    for rank in (2, 3):
        assert f"Resize {ups[0].id}: SHUTDOWN_COMPLETE from rank {rank}" in log, log[-4000:]
    # ... and in the operation's state: each leaving rank Retired by its own SHUTDOWN_COMPLETE.
    assert [(r.rank, r.state) for r in ups[0].ranks] == [(2, RankState.RETIRED), (3, RankState.RETIRED)]
    assert all(r.message.startswith("SHUTDOWN_COMPLETE") for r in ups[0].ranks), ups[0].ranks
    reasons = [r for r, _ in s.fleet.events() if r.startswith("Resize") or r == "RankRetired"]
    assert reasons.count("ResizeStarted") >= 2, reasons
    assert reasons[-1] == "ResizeCompleted", reasons
    assert reasons.index("ResizeStarted") < reasons.index("ResizeCompleted"), reasons
    st = s.fleet.status()
    assert (st["replicas"], st["fleetGeneration"], st["recoveries"]) == (2, generation, 0), st

    # Below the experts' minimum: vLLM's check, a clear refusal, and the fleet serves on at 2.
    s.fleet.scale(1)
    failed = s.fleet.wait_operation("Failed", timeout=60)
    assert "minimum is 2" in str(failed["message"]), failed
    # The event is posted just after the status is written.
    wait_until(lambda: any(r == "ResizeFailed" and "minimum is 2" in m for r, m in s.fleet.events()), 30,
               "the ResizeFailed event", interval=0.2, diagnose=lambda: str(s.fleet.events()[-5:]))
    s.fleet.scale(2)
    s.settle(2)
    assert s.fleet.status()["fleetGeneration"] == generation
    assert s.complete()["usage"]["completion_tokens"] == 8  # type: ignore[index]


def test_the_operator_restarted_mid_resize_carries_the_one_operation_on(setup: Setup) -> None:
    s = setup
    s.fleet.at(2, SETTLE)
    generation = s.fleet.status()["fleetGeneration"]
    s.fleet.scale(3)
    up = s.fleet.wait_operation("Pending", "Preparing", timeout=SETTLE)
    s.operator.kill()
    s.operator.start()
    s.settle(3)
    assert (s.fleet.operation()["id"], s.fleet.operation()["phase"]) == (up["id"], "Completed")
    started = [m for r, m in s.fleet.events() if r == "ResizeStarted" and str(up["id"]) in m]
    assert len(started) <= 1, started
    st = s.fleet.status()
    assert (st["replicas"], st["fleetGeneration"]) == (3, generation), st
    assert s.complete()["usage"]["completion_tokens"] == 8  # type: ignore[index]


def test_a_leaving_rank_killed_before_shutdown_complete_fails_the_resize_and_the_fleet_recovers(
        setup: Setup) -> None:
    s = setup
    s.fleet.at(3, SETTLE)
    before = s.fleet.status()
    long = PinnedStream(f"http://{s.fleet.frontend_ip()}:8000", SERVED, rank=2, max_tokens=3000)
    assert long.first_token.wait(30)
    s.fleet.scale(2)
    s.fleet.wait_operation("Draining", timeout=SETTLE)
    os.killpg(s.fleet.engine_pid(2), signal.SIGKILL)  # the leaving rank, before it could shut down
    ok, detail = long.result()
    assert not ok, detail
    assert "rank 2" in detail, detail
    wait_until(lambda: s.fleet.status().get("fleetGeneration") == before["fleetGeneration"] + 1, 120,
               "a recovery (the MoE fleet lost a member of its collectives)", diagnose=s.fleet.describe)
    op = s.fleet.status()["operation"]
    assert op["phase"] == "Failed", op
    assert "rank 2" in op["message"], op
    # Events are posted after the status write that the recovery shows (kopf's queue, best effort): wait for it.
    wait_until(lambda: any(r == "RankLost" and "left the fleet unusable: rank 2 died" in m
                           for r, m in s.fleet.events()), 30, "the RankLost event", interval=0.2,
               diagnose=lambda: str(s.fleet.events()[-5:]))
    s.settle(2)  # recovered at the committed 3 ranks, then resized in place to 2
    st = s.fleet.status()
    assert (st["recoveries"], st["replicas"]) == (before["recoveries"] + 1, 2), st
    assert s.complete()["usage"]["completion_tokens"] == 8  # type: ignore[index]


def test_a_new_rank_that_never_gets_ready_fails_the_resize_after_the_join_timeout_and_the_fleet_recovers(
        setup: Setup) -> None:
    s = setup
    s.fleet.at(2, SETTLE)
    before = s.fleet.status()
    s.runner.hold.add(constants.engine_name(NAME, 2))  # its pod is bound but never starts: no eep_ready/2
    try:
        s.fleet.scale(3)
        failed = s.fleet.wait_operation("Failed", timeout=JOIN_TIMEOUT + 60)
        assert "did not join within the join timeout" in str(failed["message"]), failed
        s.fleet.scale(2)  # give up on 3 (else the recovered fleet resizes to it again)
        wait_until(lambda: s.fleet.status().get("fleetGeneration") == before["fleetGeneration"] + 1, 120,
                   "a recovery (the old ranks were told to reconfigure: no way back)", diagnose=s.fleet.describe)
    finally:
        s.runner.hold.clear()
    s.settle(2)
    st = s.fleet.status()
    assert (st["recoveries"], st["replicas"]) == (before["recoveries"] + 1, 2), st
    assert s.complete()["usage"]["completion_tokens"] == 8  # type: ignore[index]


def test_a_killed_engine_0_takes_its_store_and_the_fleet_recovers_with_a_new_one(setup: Setup) -> None:
    s = setup
    s.fleet.at(2, SETTLE)
    before = s.fleet.status()
    os.killpg(s.fleet.engine_pid(0), signal.SIGKILL)
    wait_until(lambda: s.fleet.status().get("fleetGeneration") == before["fleetGeneration"] + 1, 120,
               "a recovery (MoE ranks share collectives: the whole fleet is recreated)", diagnose=s.fleet.describe)
    s.settle(2)
    engine0_ip = s.fleet.pods()[constants.engine_name(NAME, 0)]["status"]["podIP"]
    for rank in (0, 1):
        assert store_address(s.engine_log(rank)) == f"{engine0_ip}:{constants.COORD_STORE_PORT}"
    assert s.complete()["usage"]["completion_tokens"] == 8  # type: ignore[index]
    assert s.fleet.status()["recoveries"] == before["recoveries"] + 1
