# SPDX-License-Identifier: Apache-2.0
"""The vLLM API corefleet's fleet processes call, pinned: these fail if the installed vLLM changes underneath.

Importing vLLM takes about 10 s, so the import happens once, in a module fixture, and only when
these tests run (not at collection).
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType

import pytest

pytestmark = pytest.mark.e2e  # needs the vLLM runtime installed


@pytest.fixture(scope="module")
def coordinator_module() -> ModuleType:
    return importlib.import_module("vllm.v1.engine.coordinator")


def test_vllm_version(coordinator_module: ModuleType) -> None:
    import vllm  # already imported by the fixture

    assert vllm.__version__.startswith("0.32.0"), vllm.__version__


def test_run_coordinator_signature(coordinator_module: ModuleType) -> None:
    """corefleet_client.coordinator calls run_coordinator with these keywords, in this process."""
    run = inspect.getattr_static(coordinator_module.DPCoordinatorProc, "run_coordinator")
    assert isinstance(run, staticmethod), "run_coordinator is no longer a staticmethod"
    params = inspect.signature(coordinator_module.DPCoordinatorProc.run_coordinator).parameters
    assert list(params)[:4] == [
        "engine_count", "front_publish_address", "back_output_address", "back_publish_address",
    ]
    # The pipe it reports its bound endpoints on (the coordinator logs them from it), and the
    # two options the CLI exposes with vLLM's defaults.
    expected_defaults = {
        "zmq_addr_pipe": None,
        "min_stats_update_interval_ms": 100,
        "enable_wave_coordination": True,
    }
    for name, default in expected_defaults.items():
        assert name in params, f"run_coordinator lost {name!r}"
        assert params[name].default == default, (name, params[name].default)
    for name, p in params.items():
        if name not in ("engine_count", "front_publish_address", "back_output_address", "back_publish_address"):
            assert p.default is not inspect.Parameter.empty, f"run_coordinator has a new required parameter {name!r}"
