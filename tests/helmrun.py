# SPDX-License-Identifier: Apache-2.0
"""The project's helm binary, run against a test's API server with its state under the test's temp dir, never in
$HOME (import as `from helmrun import Helm, helm_runner`)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from corefleet_harness.localcluster import LocalControlPlane

Helm = Callable[..., subprocess.CompletedProcess[str]]


def helm_runner(k8s: LocalControlPlane, state_dir: Path, timeout: float = 180) -> Helm:
    """`run(*args)`: helm ARGS against `k8s`, its cache, config and data under `state_dir`; never raises on a
    failure (the caller reads returncode and output)."""
    env = {**os.environ, "KUBECONFIG": str(k8s.kubeconfig)}
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[var] = str(state_dir / var.lower())

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([k8s.binary("helm"), *args], env=env, capture_output=True, text=True,
                              check=False, timeout=timeout)

    return run
