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


# -- corefleet_client.vllm_compat and the frontend client: what they replace, wrap or call ---------


@pytest.fixture(scope="module")
def core_client() -> ModuleType:
    return importlib.import_module("vllm.v1.engine.core_client")


@pytest.fixture(scope="module")
def engine_utils() -> ModuleType:
    return importlib.import_module("vllm.v1.engine.utils")


def _params(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def test_client_factory_pinned(core_client: ModuleType) -> None:
    """vllm_compat change 1 replaces this static factory; AsyncLLM must still build clients only through it."""
    factory = inspect.getattr_static(core_client.EngineCoreClient, "make_async_mp_client")
    assert isinstance(factory, staticmethod)
    assert _params(core_client.EngineCoreClient.make_async_mp_client) == [
        "vllm_config", "executor_class", "log_stats", "client_addresses", "client_count", "client_index", "renderer",
    ]
    async_llm = importlib.import_module("vllm.v1.engine.async_llm")
    assert "EngineCoreClient.make_async_mp_client(" in inspect.getsource(async_llm.AsyncLLM.__init__)
    # The classes corefleet subclasses, and the choice it reproduces.
    src = inspect.getsource(core_client.EngineCoreClient.make_async_mp_client)
    assert "DPLBAsyncMPClient(" in src
    assert "data_parallel_external_lb" in src


def test_external_engine_launch_pinned(core_client: ModuleType, engine_utils: ModuleType) -> None:
    """The frontend client binds listeners, runs vLLM's handshake itself, then takes MPClient's external path."""
    assert _params(engine_utils.wait_for_engine_startup) == [
        "handshake_socket", "core_engines", "parallel_config", "coordinated_dp", "cache_config", "launch",
    ]
    assert _params(engine_utils.bind_engine_zmq_listeners) == ["vllm_config", "num_api_servers"]
    assert _params(engine_utils.CoreEngine)[:2] == ["index", "local"]
    assert {"NEW", "CONNECTED", "READY"} <= set(engine_utils.CoreEngineState.__members__)
    fields = list(engine_utils.CoreEngineLaunch.__dataclass_fields__)
    assert fields[:4] == ["engine_manager", "coordinator", "addresses", "tensor_queue"]
    init = inspect.getsource(core_client.MPClient.__init__)
    for key in ("input_address", "output_address", "stats_update_address", "input_listener", "output_listener"):
        assert f'"{key}"' in init, f"MPClient no longer reads client_addresses[{key!r}]"
    # vllm_compat change 2: INIT's parallel_config values are read off the object passed in.
    startup = inspect.getsource(engine_utils.wait_for_engine_startup)
    assert "getattr(parallel_config, k)" in startup
    assert '"data_parallel_master_ip"' in startup


def test_engine0_binds_the_master_address() -> None:
    """Why change 2 exists: engine rank 0 binds its DP group port on data_parallel_master_ip."""
    parallel = importlib.import_module("vllm.config.parallel")
    src = inspect.getsource(parallel.ParallelConfig._pick_stateless_dp_port)
    assert "s.bind((self.data_parallel_master_ip, 0))" in src


def test_dplb_internals_pinned(core_client: ModuleType) -> None:
    """Attributes and hooks of DPLBAsyncMPClient that KubeDPLBClient reads or overrides."""
    dplb = core_client.DPLBAsyncMPClient
    assert _params(dplb.get_core_engine_for_request) == ["self", "request"]
    assert _params(dplb._abort_requests) == ["self", "request_ids", "engine"]
    init = inspect.getsource(dplb.__init__)
    assert "self.reqs_in_flight" in init
    assert "self.engine_inflight" in init
    assert "self.lb_engines" in inspect.getsource(core_client.DPAsyncMPClient.__init__)
    route = inspect.getsource(dplb.get_core_engine_for_request)
    assert "self.lb_engines" in route
    assert "min_score" in route
    send = inspect.getsource(core_client.AsyncMPClient._send_input_message)
    assert "self.input_socket.send_multipart" in send
    assert "outputs_queue" in inspect.getsource(core_client.AsyncMPClient.get_output_async)
    # KubeMPClient (replicas 1) keeps its in-flight record through the same output hook as vLLM's DPLB client.
    output_task = inspect.getsource(core_client.AsyncMPClient._ensure_output_queue_task)
    assert 'getattr(self.__class__, "process_engine_outputs", None)' in output_task


def test_health_and_liveness_pinned() -> None:
    """vllm_compat change 3 wraps check_health; the liveness call and the error finish reason exist."""
    async_llm = importlib.import_module("vllm.v1.engine.async_llm")
    assert inspect.iscoroutinefunction(async_llm.AsyncLLM.check_health)
    health = importlib.import_module("vllm.entrypoints.serve.instrumentator.health")
    src = inspect.getsource(health.health)
    assert "check_health()" in src
    assert "except EngineDeadError" in src
    assert "503" in src
    core = importlib.import_module("vllm.v1.engine.core")
    assert _params(core.EngineCore.is_sleeping) == ["self"]
    engine = importlib.import_module("vllm.v1.engine")
    assert engine.FinishReason.ERROR.value == 3
