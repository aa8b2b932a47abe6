# SPDX-License-Identifier: Apache-2.0
"""An `expertParallel` (MoE, elastic EP) fleet starts, serves and recovers, operator-run, with emulated engines.

The control plane is real, the operator runs as its own process, `podrunner` runs the pods as
processes, the frontend and the coordinator are real vLLM (the frontend builds its config with the
engines' EPLB and elastic-EP flags: vllm_compat change 9), and each engine pod runs corefleet's
wire-level engine emulator, which needs what a vLLM elastic-EP engine needs at startup: the
coordination store at the DP master address, engine 0's (issue 11; served by engine 0's pod,
`corefleet_client.coordstore`). Resizes of MoE fleets in place are issue 11's next steps.
"""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from collections.abc import Iterator

import pytest

from corefleet_client import commands
from corefleet_client.tinymodel import VLLM_CPU_FLAGS, write_tiny_model
from corefleet_operator import constants
from corefleet_operator.localcluster import LocalControlPlane
from factories import make_ecs
from fleettest import FleetView, OperatorProcess, wait_for
from podrunner import PodRunner

pytestmark = pytest.mark.e2e

NAME = "moe"
SERVED = "tiny-moe"
SETTLE = 240.0
JOIN_TIMEOUT = 90


class Setup:
    def __init__(self, k8s: LocalControlPlane, ns: str, runner: PodRunner, fleet: FleetView) -> None:
        self.k8s, self.ns, self.runner, self.fleet = k8s, ns, runner, fleet

    def settle(self, replicas: int) -> None:
        wait_for(lambda: self.fleet.settled(replicas), SETTLE, f"{NAME} Running at {replicas} ranks",
                 on_timeout=self.fleet.describe)

    def engine_log(self, rank: int) -> str:
        pod = self.runner.pod(constants.engine_name(NAME, rank))
        assert pod.log is not None
        return pod.log.read_text(errors="replace")

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
    model = write_tiny_model(tmp / "tiny-moe", moe=True)
    flags = list(VLLM_CPU_FLAGS)
    i = flags.index("--load-format")
    del flags[i:i + 2]
    emulator = (commands.EMULATOR_MODULE, "--token-delay-ms", "10")
    with PodRunner(k8s, module_namespace, tmp / "pods", engine=emulator) as runner, \
            OperatorProcess(k8s, module_namespace, tmp) as operator:
        ecs = (make_ecs(NAME, module_namespace).model(str(model)).replicas(2).max_replicas(2).tp(1).expert_parallel()
               .set("engine.loadFormat", "dummy").set("scaling.readyTimeoutSeconds", JOIN_TIMEOUT)
               .arg(*flags, "--served-model-name", SERVED).manifest())
        k8s.kubectl("apply", "-n", module_namespace, "-f", "-", input=json.dumps(ecs))
        s = Setup(k8s, module_namespace, runner, FleetView(k8s, module_namespace, NAME, runner, SERVED))
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


def test_a_killed_engine_0_takes_its_store_and_the_fleet_recovers_with_a_new_one(setup: Setup) -> None:
    s = setup
    before = s.fleet.status()
    os.killpg(s.fleet.engine_pid(0), signal.SIGKILL)
    wait_for(lambda: s.fleet.status().get("fleetGeneration") == before["fleetGeneration"] + 1, 120,
             "a recovery (MoE ranks share collectives: the whole fleet is recreated)", on_timeout=s.fleet.describe)
    s.settle(2)
    engine0_ip = s.fleet.pods()[constants.engine_name(NAME, 0)]["status"]["podIP"]
    for rank in (0, 1):
        assert store_address(s.engine_log(rank)) == f"{engine0_ip}:{constants.COORD_STORE_PORT}"
    assert s.complete()["usage"]["completion_tokens"] == 8  # type: ignore[index]
    assert s.fleet.status()["recoveries"] == before["recoveries"] + 1
