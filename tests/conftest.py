# SPDX-License-Identifier: Apache-2.0
"""Test tiers and the shared fixtures.

Tiers follow the directory: tests/unit -> unit, tests/integration -> integration, tests/e2e -> e2e,
tests/gpu -> gpu (a test may also carry the marker itself). unit tests start no processes.

`k8s` starts one real control plane per session (hack/control-plane.sh builds the binaries). If the
binaries are missing or a component fails, the fixture fails with the command and its log tail; it
never skips, so a broken build cannot turn into silently skipped integration tests.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from corefleet_harness.localcluster import KubeletStandIn, LocalControlPlane, add_gpu_node, resolve_bin_dir

# The logs of every failed test's processes, kept for the test runner (hack/test.sh).
pytest_plugins = ["failurelogs"]

TIERS = ("unit", "integration", "e2e", "gpu")
TESTS = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(TESTS.resolve())
        tier = rel.parts[0] if rel.parts[0] in TIERS else "unit"
        if not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def k8s(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalControlPlane]:
    """A real etcd + kube-apiserver + kube-controller-manager + kube-scheduler for the session."""
    # A short HPA sync period for the e2e HPA loop (tests/e2e/test_observability.py); no other test has an HPA.
    cp = LocalControlPlane(state_dir=tmp_path_factory.mktemp("control-plane"), bin_dir=resolve_bin_dir(),
                           hpa_sync_seconds=2)
    with cp, pytest.MonkeyPatch.context() as mp:
        # Only this cluster is reachable from the tests: no ambient kubeconfig or in-cluster config.
        mp.setenv("KUBECONFIG", str(cp.kubeconfig))
        mp.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        add_gpu_node(cp, "gpu-node-0", gpus=8)
        add_gpu_node(cp, "gpu-node-1", gpus=8)
        yield cp


@pytest.fixture
def namespace(k8s: LocalControlPlane) -> Iterator[str]:
    """A fresh namespace per test; pods are force-deleted after (no kubelet finishes deletions)."""
    ns = f"t-{uuid.uuid4().hex[:10]}"
    k8s.kubectl("create", "namespace", ns)
    yield ns
    k8s.kubectl("delete", "pods", "--all", "-n", ns, "--grace-period=0", "--force", "--wait=false",
                check=False)
    k8s.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture
def kubelet(k8s: LocalControlPlane, namespace: str) -> Iterator[KubeletStandIn]:
    """Marks pods the scheduler bound in `namespace` Running/Ready, as a kubelet would."""
    with KubeletStandIn(k8s, [namespace]) as stand_in:
        yield stand_in
    assert not stand_in.errors, stand_in.errors


@pytest.fixture(autouse=True)
def _no_ambient_cluster(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit tests never see a real cluster's credentials."""
    if request.node.get_closest_marker("unit"):
        monkeypatch.setenv("KUBECONFIG", os.devnull)
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
