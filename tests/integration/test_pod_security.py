# SPDX-License-Identifier: Apache-2.0
"""PodSecurity `restricted` (issue 27, part 3) on the real API server: its built-in PodSecurity admission
refuses every pod that does not meet the standard, so a fleet whose pods all get created in a namespace
labelled `pod-security.kubernetes.io/enforce=restricted` is compliant; and `helm install` of the chart
into such a namespace gets its operator pod created by the ReplicaSet controller (no FailedCreate)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kopf.testing import KopfRunner

from clusterview import ClusterView, running_operator
from corefleet_harness.localcluster import KubeletStandIn, LocalControlPlane
from corefleet_operator import constants, crd
from helmrun import Helm, helm_runner

pytestmark = pytest.mark.integration

CHART = Path(__file__).resolve().parents[2] / "charts" / "corefleet"
ENFORCE = "pod-security.kubernetes.io/enforce"


@pytest.fixture
def restricted(k8s: LocalControlPlane, namespace: str) -> str:
    """The test's namespace, enforcing the restricted Pod Security Standard."""
    k8s.kubectl("label", "namespace", namespace, f"{ENFORCE}=restricted", f"{ENFORCE}-version=latest")
    return namespace


@pytest.fixture(scope="module")
def ecs_crd(k8s: LocalControlPlane) -> None:
    k8s.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps(crd.crd()))
    k8s.wait_established(constants.CRD_NAME)


@pytest.fixture
def operator(k8s: LocalControlPlane, ecs_crd: None, restricted: str,
             kubelet: KubeletStandIn) -> Iterator[KopfRunner]:
    with running_operator(restricted) as runner:
        yield runner


def _events(k8s: LocalControlPlane, namespace: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = k8s.request("GET", f"/api/v1/namespaces/{namespace}/events")["items"]
    return items


def test_the_namespace_refuses_a_pod_that_is_not_restricted(k8s: LocalControlPlane, restricted: str) -> None:
    """The control for the tests below: this API server enforces the label."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain"},
           "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
    r = k8s.kubectl("apply", "-n", restricted, "-f", "-", input=json.dumps(pod), check=False)
    assert r.returncode != 0
    assert 'violates PodSecurity "restricted:latest"' in r.stderr, r.stderr


@pytest.mark.parametrize("storage", [None, {"hub": {"tokenSecret": {"name": "hf"}}},
                                     {"pvc": {"claimName": "weights"}}], ids=["none", "hub", "pvc"])
def test_a_fleet_in_a_restricted_namespace_gets_every_pod(k8s: LocalControlPlane, restricted: str,
                                                          operator: KopfRunner, storage: dict[str, Any] | None) -> None:
    cluster = ClusterView(k8s, restricted)
    fleet = cluster.make("llm").replicas(2).arg("--max-model-len=256")
    if storage is not None:
        fleet.storage(**storage)
    cluster.apply(fleet.manifest())

    def pods() -> dict[str, Any]:
        items = cluster.get(f"/api/v1/namespaces/{restricted}/pods?labelSelector={constants.LABEL_FLEET}=llm")["items"]
        return {p["metadata"]["name"]: p for p in items}

    cluster.wait("all four fleet pods created", lambda: len(pods()) == 4)
    assert sorted(pods()) == ["llm-coordinator", "llm-engine-0", "llm-engine-1", "llm-frontend"]
    for pod in pods().values():
        assert pod["spec"]["securityContext"]["runAsUser"] == constants.RUNTIME_UID
    if storage is None:  # (a PVC that does not exist leaves its pods unscheduled; they were admitted)
        cluster.wait_running("llm", 2)
    refusals = [e["message"] for e in _events(k8s, restricted) if "PodSecurity" in e.get("message", "")]
    assert refusals == []


@pytest.fixture
def helm(k8s: LocalControlPlane, tmp_path: Path) -> Helm:
    """Run the project's helm with its state under the test's temp dir, never in $HOME."""
    return helm_runner(k8s, tmp_path, timeout=180)


def test_helm_install_into_a_restricted_namespace_creates_the_operator_pod(
        k8s: LocalControlPlane, restricted: str, helm: Helm) -> None:
    release = f"psa-{restricted[-6:]}"  # cluster-scoped names (ClusterRole) unique to this test
    r = helm("install", release, str(CHART), "--namespace", restricted, "--skip-crds")
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        cluster = ClusterView(k8s, restricted)
        selector = f"app.kubernetes.io/instance={release}"

        def operator_pods() -> list[dict[str, Any]]:
            items: list[dict[str, Any]] = cluster.get(
                f"/api/v1/namespaces/{restricted}/pods?labelSelector={selector}")["items"]
            return items

        def created_or_refused() -> bool:
            return bool(operator_pods()) or any(e["reason"] == "FailedCreate" for e in _events(k8s, restricted))

        cluster.wait("the ReplicaSet creates the operator pod (or reports FailedCreate)", created_or_refused)
        failed = [e["message"] for e in _events(k8s, restricted) if e["reason"] == "FailedCreate"]
        assert failed == []
        [pod] = operator_pods()
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    finally:
        helm("uninstall", release, "--namespace", restricted)
