# SPDX-License-Identifier: Apache-2.0
"""Drains that lose nothing: a dense rank's pod removed voluntarily is drained, then replaced in place on another node.

Real vLLM engines (the tiny model on CPU), the real control plane with its disruption controller, the operator as its
own process, `kubectl drain` and `kubectl delete` as a user runs them. The two nodes are Node objects whose pods the
process kubelet (`podrunner`) runs, preStop hooks included: the engines are processes, not containers (the real
node, test_node_fleet.py, is one node, and a drain needs a second one to move the rank to).

Placement: node A has one GPU and is cordoned while the fleet is created, node B has one GPU, so the coordinator,
the frontend and engine 0 go to B and engine 1 waits until A is uncordoned. Then B gets a second GPU, so that a rank
drained off A is replaced on B. One fleet serves the module.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from corefleet_harness.localcluster import LocalControlPlane, add_gpu_node, gpu_node
from corefleet_harness.support import wait_until
from corefleet_harness.tinymodel import write_tiny_model
from corefleet_operator import constants
from factories import make_ecs
from fleettest import FleetView, Load, OperatorProcess, ecs_engine_args
from podrunner import PodRunner

pytestmark = pytest.mark.e2e

NAME = "drain"
SERVED = "tiny"
POOL_LABEL = "corefleet.test/pool"
DRAIN_TIMEOUT = 60  # spec.scaling.drainTimeoutSeconds: each engine pod's grace period is this + 15 s
READY_TIMEOUT = 300  # real vLLM on 2 busy cores: a new engine loads in 20-60 s
SETTLE = 420.0


def engine_env(pod: Mapping[str, Any]) -> Mapping[str, str]:
    """Each rank's OpenMP threads on a core of their own, as pods with CPUs of their own would be (vLLM's default
    binding leaves the last core free). Not local mode's binding (`local.engine_cpu`, the cores but the last): with
    every rank on core 0, beside the other e2e lanes' engines, a new engine for a rank replaced under load did not
    finish starting within 300 s in CI (its worker never got through its import)."""
    rank = int(pod["metadata"]["labels"].get(constants.LABEL_RANK, "0"))
    cpus = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[rank % len(cpus)])}


class Setup:
    def __init__(self, k8s: LocalControlPlane, ns: str, fleet: FleetView, node_a: str, node_b: str) -> None:
        self.k8s, self.ns, self.fleet, self.node_a, self.node_b = k8s, ns, fleet, node_a, node_b

    def node_of(self, pod: str) -> str:
        node: str = self.fleet.pods()[pod]["spec"].get("nodeName", "")
        return node

    def load(self) -> Load:
        return Load(f"http://{self.fleet.frontend_ip()}:8000", SERVED, workers=3, max_tokens=24).start()


def cordon(k8s: LocalControlPlane, node: str, on: bool) -> None:
    k8s.request("PATCH", f"/api/v1/nodes/{node}", {"spec": {"unschedulable": on or None}},
                content_type="application/merge-patch+json")


def set_gpus(k8s: LocalControlPlane, node: str, gpus: int) -> None:
    status = gpu_node(node, gpus)["status"]
    k8s.request("PATCH", f"/api/v1/nodes/{node}/status", {"status": {"capacity": status["capacity"],
                                                                      "allocatable": status["allocatable"]}},
                content_type="application/merge-patch+json")


@pytest.fixture(scope="module")
def setup(k8s: LocalControlPlane, crd_installed: None, module_namespace: str,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("drain")
    ns = module_namespace
    model = write_tiny_model(tmp / "tiny")
    node_a, node_b = f"{ns}-a", f"{ns}-b"
    pool = {POOL_LABEL: ns}
    add_gpu_node(k8s, node_a, gpus=1, labels=pool)
    add_gpu_node(k8s, node_b, gpus=1, labels=pool)
    try:
        cordon(k8s, node_a, True)
        with PodRunner(k8s, ns, tmp / "pods", extra_env=engine_env) as runner, \
                OperatorProcess(k8s, ns, tmp) as operator:
            ecs = (make_ecs(NAME, ns).model(str(model)).replicas(2).max_replicas(2).tp(1)
                   .set("engine.loadFormat", "dummy").set("scaling.readyTimeoutSeconds", READY_TIMEOUT)
                   .set("scaling.drainTimeoutSeconds", DRAIN_TIMEOUT).set("scheduling.nodeSelector", pool)
                   .arg(*ecs_engine_args(SERVED)).manifest())
            k8s.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(ecs))
            fleet = FleetView(k8s, ns, NAME, runner, SERVED)
            engine1 = constants.engine_name(NAME, 1)
            wait_until(lambda: engine1 in fleet.pods(), 120, "engine 1's pod", diagnose=fleet.describe)
            cordon(k8s, node_a, False)
            s = Setup(k8s, ns, fleet, node_a, node_b)
            fleet.wait_settled(2, SETTLE)
            assert s.node_of(engine1) == node_a
            assert {s.node_of(p) for p in fleet.pods() if p != engine1} == {node_b}
            set_gpus(k8s, node_b, 2)  # room on B for the rank drained off A
            yield s
            operator.check_clean()
            assert not runner.errors, runner.errors
    finally:
        for node in (node_a, node_b):
            k8s.kubectl("delete", "node", node, "--wait=false", check=False)


def replaced_event(fleet: FleetView, rank: int, before: int) -> str | None:
    return next((m for reason, m in fleet.events()[before:] if reason == "RankReplaced" and f"rank {rank}" in m), None)


def remove_under_load(s: Setup, rank: int, remove: Callable[[], object],
                      record_property: Callable[[str, object], None]) -> None:
    """Under load through the frontend: `remove` the rank's pod, wait until it is replaced in place and the fleet
    serves at 2 again; then no request failed, only the rank's pod is new, the other engine's process is the same,
    and the removal was a drain (RankRemoved), not a loss: no recovery counted."""
    fleet = s.fleet
    engine, other = constants.engine_name(NAME, rank), 1 - rank
    fleet.wait_settled(2, SETTLE)
    uids, pid, events = fleet.uids(), fleet.engine_pid(other), len(fleet.events())
    load = s.load()
    try:
        wait_until(lambda: len(load.outcomes) >= 10, 120, "the load to run", diagnose=load.summary)
        started = time.monotonic()
        remove()
        wait_until(lambda: replaced_event(fleet, rank, events), READY_TIMEOUT, f"rank {rank} replaced (RankReplaced)",
                   diagnose=fleet.describe)
        fleet.wait_settled(2, SETTLE)
        record_property("seconds_to_replaced", round(time.monotonic() - started, 1))
        n = len(load.outcomes)
        wait_until(lambda: len(load.outcomes) >= n + 10, 120, "requests served after the replacement",
                   diagnose=load.summary)
    finally:
        load.stop()
    record_property("requests", len(load.outcomes))
    assert not load.failures(), load.summary()
    after = fleet.uids()
    assert after[engine] != uids[engine]
    assert {n: u for n, u in after.items() if n != engine} == {n: u for n, u in uids.items() if n != engine}
    assert fleet.engine_pid(other) == pid
    assert fleet.status()["recoveries"] == 0, fleet.describe()
    told = [reason for reason, _ in fleet.events()[events:]]
    assert "RankRemoved" in told, told
    assert "RankLost" not in told, told


def test_kubectl_drain_of_the_node_holding_rank_1_completes_under_load_and_loses_nothing(
        setup: Setup, record_property: Callable[[str, object], None]) -> None:
    s = setup
    engine0, engine1 = constants.engine_name(NAME, 0), constants.engine_name(NAME, 1)

    def drain() -> None:
        done = subprocess.run(
            [str(s.k8s.binary("kubectl")), "drain", s.node_a, "--ignore-daemonsets", "--delete-emptydir-data",
             f"--pod-selector={constants.LABEL_FLEET}={NAME}", "--timeout=300s"],
            env=s.k8s.env(), capture_output=True, text=True, timeout=330, check=False)
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{s.fleet.describe()}"
        assert f"evicting pod {s.ns}/{engine1}" in done.stdout + done.stderr, done.stdout + done.stderr

    remove_under_load(s, 1, drain, record_property)
    # Rank 1 serves again on B (A is cordoned); rank 0 never moved.
    assert s.node_of(engine1) == s.node_b
    assert s.node_of(engine0) == s.node_b


def test_a_deleted_engine_pod_is_drained_within_its_grace_period_and_replaced_under_load(
        setup: Setup, record_property: Callable[[str, object], None]) -> None:
    """A preemption or a manual `kubectl delete pod` (with the pod's grace period): no request fails."""
    s = setup
    remove_under_load(s, 0, lambda: s.k8s.kubectl("delete", "pod", "-n", s.ns, constants.engine_name(NAME, 0),
                                                  "--wait=false"), record_property)
