# SPDX-License-Identifier: Apache-2.0
"""Fixtures shared by the e2e modules that run operator-managed fleets."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest

from corefleet_harness.localcluster import LocalControlPlane
from corefleet_operator import constants, crd


@pytest.fixture(scope="session")
def crd_installed(k8s: LocalControlPlane) -> None:
    """The EngineCoreSet CRD, applied once (server-side, as `kubectl apply --server-side` does)."""
    k8s.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(crd.crd()))
    k8s.kubectl("wait", "--for=condition=Established", f"crd/{constants.CRD_NAME}", "--timeout=60s")


@pytest.fixture(scope="module")
def module_namespace(k8s: LocalControlPlane) -> Iterator[str]:
    """A namespace for a whole module (its fleet is shared by the module's tests)."""
    ns = f"m-{uuid.uuid4().hex[:10]}"
    k8s.kubectl("create", "namespace", ns)
    yield ns
    k8s.kubectl("delete", "pods", "--all", "-n", ns, "--grace-period=0", "--force", "--wait=false", check=False)
    k8s.kubectl("delete", "namespace", ns, "--wait=false", check=False)

