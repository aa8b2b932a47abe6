# SPDX-License-Identifier: Apache-2.0
"""The operator's fleet as real processes: control plane + in-process operator + `podrunner`.

The operator builds its pods as for a cluster; `podrunner.PodRunner` runs each pod's command on
its own loopback address and reports it Running, Ready (through the pod's own readinessProbe) and
Failed as a kubelet would. The engines are real vLLM (the tiny model, dummy weights, on CPU).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from kopf.testing import KopfRunner

from corefleet_client.admin import AdminClient, RankState
from corefleet_client.tinymodel import VLLM_CPU_FLAGS, write_tiny_model
from corefleet_operator import constants, crd
from corefleet_operator.localcluster import LocalControlPlane, wait_until
from factories import make_ecs
from podrunner import PodRunner

NAME = "llm"
REPLICAS = 2
SERVED = "tiny"
POD_NAMES = [f"{NAME}-coordinator", f"{NAME}-engine-0", f"{NAME}-engine-1", f"{NAME}-frontend"]
START_TIMEOUT = 420.0  # two real vLLM engines starting together on a 2-core machine
ECS_PATH = "/apis/corefleet.io/v1alpha1/namespaces/{ns}/enginecoresets/" + NAME


def engine_flags() -> list[str]:
    """VLLM_CPU_FLAGS without `--load-format dummy`: corefleet sets --load-format (spec.engine.loadFormat)."""
    flags = list(VLLM_CPU_FLAGS)
    i = flags.index("--load-format")
    del flags[i:i + 2]
    return [*flags, "--served-model-name", SERVED]


def spread_engines_over_cpus(pod: Mapping[str, Any]) -> dict[str, str]:
    """One core per engine rank (vLLM binds each CPU engine's OpenMP threads to core 0 by default)."""
    labels = pod["metadata"].get("labels", {})
    if labels.get(constants.LABEL_ROLE) != constants.ROLE_ENGINE:
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[int(labels[constants.LABEL_RANK]) % len(cpus)])}


@pytest.fixture
def ecs_crd(k8s: LocalControlPlane) -> None:
    k8s.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(crd.crd()))
    k8s.kubectl("wait", "--for=condition=Established", "crd/enginecoresets.corefleet.io", "--timeout=60s")


@pytest.fixture
def runner(k8s: LocalControlPlane, namespace: str, tmp_path: Path) -> Iterator[PodRunner]:
    with PodRunner(k8s, namespace, tmp_path / "pods", extra_env=spread_engines_over_cpus) as r:
        yield r
    assert not r.errors, r.errors


class Fleet:
    def __init__(self, k8s: LocalControlPlane, ns: str, runner: PodRunner) -> None:
        self.k8s, self.ns, self.runner = k8s, ns, runner

    def ecs(self) -> dict[str, Any]:
        obj: dict[str, Any] = self.k8s.request("GET", ECS_PATH.format(ns=self.ns))
        return obj

    def status(self) -> dict[str, Any]:
        st: dict[str, Any] = self.ecs().get("status", {})
        return st

    def pods(self) -> dict[str, dict[str, Any]]:
        items = self.k8s.request(
            "GET", f"/api/v1/namespaces/{self.ns}/pods?labelSelector=corefleet.io/fleet={NAME}")["items"]
        return {p["metadata"]["name"]: p for p in items}

    def wait(self, what: str, check: Any, timeout: float = START_TIMEOUT) -> None:
        try:
            wait_until(check, timeout, what, interval=0.5)
        except TimeoutError as e:
            raise AssertionError(f"{e}\nstatus: {self.status()}\n{self.runner.log_tails()}") from None

    def all_pods_ready(self) -> bool:
        pods = self.pods()
        return sorted(pods) == POD_NAMES and all(
            not p["metadata"].get("deletionTimestamp") and p["status"].get("phase") == "Running"
            and p["status"].get("podIP", "").startswith("127.0.0.")
            and {c["type"]: c["status"] for c in p["status"].get("conditions", [])}.get("Ready") == "True"
            and all(c["ready"] for c in p["status"]["containerStatuses"])
            for p in pods.values())

    def running(self) -> bool:
        st = self.status()
        return st.get("phase") == "Running" and st.get("readyReplicas") == REPLICAS and st.get("replicas") == REPLICAS

    def frontend_ip(self) -> str:
        ip: str = self.pods()[f"{NAME}-frontend"]["status"]["podIP"]
        return ip

    def admin(self) -> AdminClient:
        secret = self.k8s.request("GET", f"/api/v1/namespaces/{self.ns}/secrets/{NAME}-admin")
        token = base64.b64decode(secret["data"]["token"]).decode().strip()
        return AdminClient(f"http://{self.frontend_ip()}:8001", token, timeout=5)

    def completion(self) -> dict[str, Any]:
        body = json.dumps({"model": SERVED, "prompt": "Hello", "max_tokens": 8}).encode()
        req = urllib.request.Request(f"http://{self.frontend_ip()}:8000/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
            out: dict[str, Any] = json.loads(r.read())
        return out

    def check_serving(self) -> None:
        """Every pod Ready through its probe, the fleet Running, a completion, both ranks Serving."""
        self.wait("every pod Ready through its readinessProbe", self.all_pods_ready)
        self.wait(f"{NAME} Running with {REPLICAS} ready replicas", self.running, timeout=60)
        out = self.completion()
        assert out["model"] == SERVED, out
        assert len(out["choices"]) == 1, out
        assert out["usage"]["completion_tokens"] > 0, out
        fleet = self.admin().fleet()
        assert [(r.rank, r.state) for r in fleet.ranks] == [(0, RankState.SERVING), (1, RankState.SERVING)], fleet


def test_operator_fleet_of_real_vllm_serves_and_recovers_from_a_killed_engine(
        k8s: LocalControlPlane, ecs_crd: None, namespace: str, runner: PodRunner, tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny-llama")
    ecs = (make_ecs(NAME, namespace).model(str(model)).replicas(REPLICAS).tp(1)
           .set("engine.loadFormat", "dummy").arg(*engine_flags()).manifest())
    fleet = Fleet(k8s, namespace, runner)
    args = ["run", "--standalone", f"--namespace={namespace}", "-m", "corefleet_operator.handlers"]
    with KopfRunner(args, timeout=60) as operator:
        k8s.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(ecs))  # schema and CEL accept it
        fleet.check_serving()
        assert fleet.status()["recoveries"] == 0
        old_uids = {p["metadata"]["uid"] for p in fleet.pods().values()}

        # A rank dies as a container would: SIGKILL to the engine's whole process group.
        os.killpg(runner.pod(f"{NAME}-engine-1").popen.pid, signal.SIGKILL)  # type: ignore[union-attr]

        fleet.wait("phase Recovering", lambda: fleet.status().get("phase") == "Recovering", timeout=60)
        assert fleet.status()["recoveries"] == 1
        fleet.check_serving()
        st = fleet.status()
        assert (st["recoveries"], st["fleetGeneration"]) == (1, 2), st
        pods = fleet.pods()
        assert not old_uids & {p["metadata"]["uid"] for p in pods.values()}
        assert {p["metadata"]["annotations"][constants.ANNOTATION_GENERATION] for p in pods.values()} == {"2"}
        lost = [e["message"] for e in k8s.request("GET", f"/api/v1/namespaces/{namespace}/events")["items"]
                if e["reason"] == "RankLost"]
        assert any(f"rank 1 (pod {NAME}-engine-1) failed" in m and "137" in m for m in lost), lost
    assert operator.exception is None, operator.exception
    assert operator.exit_code == 0, operator.output
    assert "Traceback" not in operator.output, operator.output
