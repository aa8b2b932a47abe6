# SPDX-License-Identifier: Apache-2.0
"""Fixtures shared by the e2e modules: the CRD and a namespace for operator-managed fleets, and the real node."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest

from corefleet_harness.localcluster import LocalControlPlane
from corefleet_operator import constants, crd
from nodetest import RealNode, assert_left_nothing, image_archives, image_store, node_cluster


@pytest.fixture(scope="session")
def crd_installed(k8s: LocalControlPlane) -> None:
    """The EngineCoreSet CRD, applied once (server-side, as `kubectl apply --server-side` does)."""
    k8s.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(crd.crd()))
    k8s.wait_established(constants.CRD_NAME)


@pytest.fixture(scope="module")
def module_namespace(k8s: LocalControlPlane) -> Iterator[str]:
    """A namespace for a whole module (its fleet is shared by the module's tests)."""
    ns = f"m-{uuid.uuid4().hex[:10]}"
    k8s.kubectl("create", "namespace", ns)
    yield ns
    k8s.kubectl("delete", "pods", "--all", "-n", ns, "--grace-period=0", "--force", "--wait=false", check=False)
    k8s.kubectl("delete", "namespace", ns, "--wait=false", check=False)



@pytest.fixture(scope="session")
def real_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNode]:
    """One real node for every module that runs pods as containers (test_localnode, test_node_fleet), with the
    images they run imported into its image store (kept between runs: see `LocalNode.image_store`). When the
    session ends it is stopped with whatever still runs on it, and must leave nothing on the host."""
    tmp = tmp_path_factory.mktemp("real-node")
    images = image_archives("pause", "base", "operator", "runtime-test")
    with node_cluster(tmp, images, store=image_store()) as (cp, node):
        yield RealNode(cp, node, tmp)
        run_dir = node.run_dir
        node.stop()  # (stop again on the way out is a no-op)
    assert_left_nothing(node, run_dir)
