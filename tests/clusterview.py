# SPDX-License-Identifier: Apache-2.0
"""Reads and writes of a test namespace on the real API server, for the operator's integration tests
(through the admin kubeconfig of `LocalControlPlane`), and the operator run in-process for one namespace
(`running_operator`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

from kopf.testing import KopfRunner

from corefleet_harness.localcluster import LocalControlPlane
from corefleet_harness.support import wait_until
from factories import EcsFactory, make_ecs

OPERATOR_ARGS = ["run", "--standalone", "-m", "corefleet_operator.handlers"]


@contextlib.contextmanager
def running_operator(namespace: str) -> Iterator[KopfRunner]:
    """The operator (kopf, in this process) for one namespace; on exit, it must have raised nothing and logged no
    traceback."""
    with KopfRunner([*OPERATOR_ARGS, f"--namespace={namespace}"], timeout=60) as runner:
        yield runner
    assert runner.exception is None, runner.exception
    assert runner.exit_code == 0, runner.output
    assert "Traceback" not in runner.output, runner.output


class ClusterView:
    def __init__(self, k8s: LocalControlPlane, namespace: str) -> None:
        self.k8s, self.ns = k8s, namespace

    def make(self, name: str) -> EcsFactory:
        return make_ecs(name, self.ns)

    def get(self, path: str) -> Any:
        return self.k8s.request("GET", path)

    def ecs(self, name: str) -> dict[str, Any]:
        obj: dict[str, Any] = self.get(f"/apis/corefleet.io/v1alpha1/namespaces/{self.ns}/enginecoresets/{name}")
        return obj

    def apply(self, obj: dict[str, Any]) -> None:
        self.k8s.kubectl("apply", "-n", self.ns, "-f", "-", input=json.dumps(obj))

    def wait(self, what: str, check: Callable[[], bool], timeout: float = 90) -> None:
        wait_until(check, timeout, what, interval=0.2, retry_on=(Exception,))

    def running(self, name: str, replicas: int) -> bool:
        st: dict[str, Any] = self.ecs(name).get("status", {})
        return st.get("phase") == "Running" and st.get("readyReplicas") == replicas and st.get("replicas") == replicas

    def wait_running(self, name: str, replicas: int, timeout: float = 90) -> dict[str, Any]:
        self.wait(f"{name} Running with {replicas} ready", lambda: self.running(name, replicas), timeout)
        return self.ecs(name)
