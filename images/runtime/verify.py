# SPDX-License-Identifier: Apache-2.0
"""Run by images/runtime/Dockerfile as the build's last step: the image holds the vLLM it pins (VLLM_VERSION,
a local build tag like +cu129 allowed), the fleet processes are importable, and vLLM finds corefleet's plugin
(AMX on CPU; its entry point is in pyproject.toml). find_spec does not run the frontend or coordinator, which
need the pod's env."""

import importlib.metadata
import importlib.util
import os

import vllm

want = os.environ["VLLM_VERSION"]
assert vllm.__version__.split("+")[0] == want, f"vLLM {vllm.__version__} in the base image, want {want}"
import corefleet_client.engine  # noqa: E402, F401  (the launcher imports neither vLLM nor torch)

for mod in ("corefleet_client.frontend", "corefleet_client.coordinator", "corefleet_client.enginecore"):
    assert importlib.util.find_spec(mod) is not None, mod
plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
assert any(ep.name == "corefleet" for ep in plugins), list(plugins)
