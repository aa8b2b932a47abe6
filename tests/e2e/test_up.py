# SPDX-License-Identifier: Apache-2.0
"""`corefleet cluster up`: a local Kubernetes control plane plus the operator, stopped by Ctrl-C.

(README's main job, the local fleet without Kubernetes, is `corefleet up`: tests/e2e/test_local.py.)
"""

from __future__ import annotations

import json
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from corefleet_harness.localcluster import ADMIN_TOKEN
from corefleet_harness.support import wait_until
from procs import read_lines_until


def test_cluster_up_runs_control_plane_and_operator_until_interrupted(tmp_path: Path) -> None:
    state = tmp_path / "state"
    proc = subprocess.Popen([sys.executable, "-m", "corefleet_harness.cli", "cluster", "up",
                             "--state-dir", str(state)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _check_up(proc, state)
    finally:  # whatever failed, `corefleet cluster up` stops what it started on SIGINT; kill only as a last resort
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _check_up(proc: subprocess.Popen[str], state: Path) -> None:
    lines = read_lines_until(proc, "running; Ctrl-C", timeout=240)
    kubeconfig = Path(next(ln.split("=", 1)[1] for ln in lines if "export KUBECONFIG=" in ln))
    server = json.loads(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    ctx = ssl.create_default_context(cafile=str(state / "certs" / "apiserver.crt"))

    def get(path: str) -> dict[str, Any]:
        req = urllib.request.Request(server + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            body: dict[str, Any] = json.loads(r.read())
            return body

    metrics_url = next(ln.split(": ", 1)[1] for ln in lines if "operator metrics:" in ln)
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        assert b"corefleet_fleets 0.0" in r.read()
    node = get("/api/v1/nodes/gpu-node-0")
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    # The README's next step works: the sample is accepted and the operator picks it up.
    kubectl = [str(Path(next(ln.split("=", 1)[1] for ln in lines if "export PATH=" in ln).split(":")[0]) / "kubectl"),
               f"--kubeconfig={kubeconfig}"]
    sample = Path(__file__).resolve().parents[2] / "manifests" / "samples" / "enginecoreset.yaml"
    subprocess.run([*kubectl, "apply", "-n", "default", "-f", str(sample)], check=True, capture_output=True)

    def status_written() -> bool:
        ecs = get("/apis/corefleet.io/v1alpha1/namespaces/default/enginecoresets/qwen3-dense")
        status: dict[str, Any] = ecs.get("status", {})
        return status.get("phase") == "Starting"

    def pods_created() -> bool:
        pods = get("/api/v1/namespaces/default/pods?labelSelector=corefleet.io/fleet=qwen3-dense")
        return len(pods["items"]) == 4

    wait_until(status_written, 60, "the operator's first status of the sample", interval=0.1, retry_on=(Exception,))
    wait_until(pods_created, 60, "the sample's coordinator, frontend and 2 engine pods", interval=0.1,
               retry_on=(Exception,))

    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)

    assert proc.returncode == 0, err
    assert "corefleet cluster up: stopped" in out
    with pytest.raises(urllib.error.URLError):
        get("/readyz")  # everything it started is gone
    operator_log = (state / "operator.log").read_text()
    assert "Traceback" not in operator_log
    assert "Forbidden" not in operator_log
