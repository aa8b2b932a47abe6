# SPDX-License-Identifier: Apache-2.0
"""The vLLM API corefleet's fleet processes call, pinned: these fail if the installed vLLM changes underneath.

Importing vLLM takes about 10 s, so the import happens once, in a module fixture, and only when
these tests run (not at collection).
"""

from __future__ import annotations

import dataclasses
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


def test_elastic_engines_open_the_coordination_store_at_the_master_address(engine_utils: ModuleType) -> None:
    """Why engine 0's launcher serves a coordination store (corefleet_client.coordstore) and INIT advertises it:
    every elastic-EP engine opens the store at startup at the DP master address, vLLM's multiprocess launch
    creates none, and INIT carries the port."""
    parallel_state = importlib.import_module("vllm.distributed.parallel_state")
    world = inspect.getsource(parallel_state._init_elastic_ep_world)
    assert "parallel_config.data_parallel_master_ip, parallel_config._coord_store_port" in world
    launch = inspect.getsource(engine_utils.launch_core_engines)
    assert "and not parallel_config.enable_elastic_ep" in launch  # its store is for the non-elastic case only
    startup = inspect.getsource(engine_utils.wait_for_engine_startup)
    assert '"_coord_store_port"' in startup
    parallel = importlib.import_module("vllm.config.parallel")
    assert 'key = "dp_master_port"' in inspect.getsource(parallel.ParallelConfig._pick_stateless_dp_port)


def test_the_eplb_platform_check_and_communicator_choice_pinned() -> None:
    """vllm_compat change 9 builds the frontend's config with EPLB off where vLLM's platform check refuses it,
    and sets the communicator as ParallelConfig.__post_init__ would on CUDA."""
    parallel = importlib.import_module("vllm.config.parallel")
    validate = inspect.getsource(parallel.ParallelConfig._validate_parallel_config)
    assert "if not current_platform.is_cuda_alike() and not current_platform.is_xpu():" in validate
    post_init = inspect.getsource(parallel.ParallelConfig.__post_init__)
    choice = post_init[post_init.index("if self.enable_eplb and self.eplb_config.communicator is None:"):]
    for line in ('self.eplb_config.communicator = "torch_xccl"', "elif is_nixl_available():",
                 'self.eplb_config.communicator = "nixl"', "elif self.enable_elastic_ep:",
                 'self.eplb_config.communicator = "pynccl"', 'self.eplb_config.communicator = "torch_gloo"'):
        assert line in choice, line
    arg_utils = importlib.import_module("vllm.engine.arg_utils")
    assert "enable_eplb" in inspect.signature(arg_utils.EngineArgs).parameters


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
    output_task = inspect.getsource(core_client.AsyncMPClient._ensure_output_queue_task)
    assert 'getattr(self.__class__, "process_engine_outputs", None)' in output_task
    # frontend.rescue: the hook sees each message before it is queued for the output handler, and vLLM's own hook
    # (a staticmethod KubeDPLBClient's calls) takes finished requests out of the routing tables.
    assert output_task.index("await output_handler(_self, outputs)") < output_task.index(
        "outputs_queue.put_nowait(outputs)")
    assert isinstance(inspect.getattr_static(dplb, "process_engine_outputs"), staticmethod)
    assert "outputs.finished_requests" in inspect.getsource(dplb.process_engine_outputs)


def test_dplb_init_is_what_init_dplb_client_repeats(core_client: ModuleType) -> None:
    """vllm_compat change 4 runs DPLBAsyncMPClient.__init__'s statements without its size assertion."""
    import ast
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(core_client.DPLBAsyncMPClient.__init__)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    assigned = [t.attr for stmt in body if isinstance(stmt, ast.Assign | ast.AnnAssign)
                for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])
                if isinstance(t, ast.Attribute)]
    assert assigned == ["client_count", "reqs_in_flight", "engine_inflight", "_prepared_elastic_ep",
                        "eng_start_index"]
    asserts = [ast.unparse(stmt.test) for stmt in body if isinstance(stmt, ast.Assert)]
    assert asserts == ["len(self.core_engines) > 1"]
    calls = [ast.unparse(stmt.value.func) for stmt in body
             if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)]
    assert calls == ["super().__init__"]
    assert core_client.DPLBAsyncMPClient.__mro__[1] is core_client.DPAsyncMPClient
    # The size-1 fleet also needs DP's stats task; it only asserts there are ranks.
    stats_task = inspect.getsource(core_client.DPAsyncMPClient._ensure_stats_update_task)
    assert "assert len(self.engine_ranks_managed) > 0" in stats_task


def test_membership_change_pinned(core_client: ModuleType) -> None:
    """What a dense resize changes in the client (docs/vllm-protocol.md §10.1)."""
    stats_task = inspect.getsource(core_client.DPAsyncMPClient._ensure_stats_update_task)
    for line in ('decoded[0] == "SCALE_ELASTIC_EP"', "assert dp_size == new_engine_count",
                 "self.engine_ranks_managed = list(", "self.lb_engines = self.lb_engines +",
                 "self.lb_engines = self.lb_engines[:new_engine_count]", "await socket.send(scale_msg)",
                 "ranks = self.engine_ranks_managed", "self.lb_engines = sliced_counts"):
        assert line in stats_task, line
    route = inspect.getsource(core_client.DPLBAsyncMPClient.get_core_engine_for_request)
    assert "range(num_engines)" in route
    assert "self.core_engines[idx]" in route
    assert "request.data_parallel_rank" in route
    init = inspect.getsource(core_client.MPClient.__init__)
    assert "router_handover=enable_input_socket_handover" in init
    assert "self._apply_ready_response(payload)" in init
    # change 10's stand-ins for engines left out of an attach: the wait reads through the module's `zmq`
    assert "sync_input_socket = zmq.Socket.shadow(self.input_socket)" in init
    assert "identities.remove(identity)" in init
    assert core_client.zmq is importlib.import_module("zmq")
    ready = inspect.getsource(core_client.MPClient._apply_ready_response)
    assert "EngineCoreReadyResponse" in ready
    assert "num_gpu_blocks += response.num_gpu_blocks" in ready
    engine = importlib.import_module("vllm.v1.engine")
    fields = {f.name for f in dataclasses.fields(engine.EngineCoreReadyResponse)}
    assert {"vllm_version", "tensor_parallel_size", "num_gpu_blocks"} <= set(fields)
    utility = inspect.getsource(core_client._process_utility_output)
    assert "future = utility_results.pop(output.call_id)" in utility
    assert "except asyncio.InvalidStateError" in utility  # a cancelled liveness future is ignored


def test_output_reader_is_what_yielding_output_socket_wraps(core_client: ModuleType) -> None:
    """vllm_compat change 7: vLLM's output task reads `resources.output_socket` once, when it is created,
    and awaits its recv_multipart in a loop; the cleanup checks the socket's type."""
    task = inspect.getsource(core_client.AsyncMPClient._ensure_output_queue_task)
    assert "output_socket = resources.output_socket" in task
    assert "await output_socket.recv_multipart(copy=False)" in task
    assert "if resources.output_queue_task is not None:" in task
    cleanup = inspect.getsource(core_client.BackgroundResources.__call__)
    assert "isinstance(self.output_socket, zmq.asyncio.Socket)" in cleanup


def test_handshake_can_be_aborted_through_a_watched_process(engine_utils: ModuleType) -> None:
    """frontend.handshake.HandshakeAbort stops vLLM's handshake loop as a "watched frontend process"."""
    assert "watched_frontend_processes" in engine_utils.CoreEngineLaunch.__dataclass_fields__
    startup = inspect.getsource(engine_utils.wait_for_engine_startup)
    for line in ("proc.sentinel if isinstance(proc.sentinel, int) else proc.sentinel.fileno()",
                 "poller.register(fd, zmq.POLLIN)", "proc.exitcode is not None",
                 "Frontend process failed during engine core initialization"):
        assert line in startup, line
    assert "coordinated_dp" in startup
    assert "parallel_config_hash" in startup


def test_coordinator_follows_the_fleet_size() -> None:
    coordinator = importlib.import_module("vllm.v1.engine.coordinator")
    src = inspect.getsource(coordinator.DPCoordinatorProc.process_input_socket)
    for line in ('decoded[0] == "SCALE_ELASTIC_EP"', "self.engines.append(EngineState())",
                 "self.engines = self.engines[:new_engine_count]", 'publish_back.send(b"READY")',
                 "if eng_index >= len(self.engines):"):
        assert line in src, line
    network = importlib.import_module("vllm.utils.network_utils")
    assert "zmq.XPUB_VERBOSE" in inspect.getsource(network.make_zmq_socket)  # late subscribers are seen
    assert "router_handover" in _params(network.zmq_socket_ctx)


def test_stat_loggers_and_request_errors_pinned() -> None:
    """vllm_compat changes 5 and 6, and frontend.stats."""
    async_llm = importlib.import_module("vllm.v1.engine.async_llm")
    params = _params(async_llm.AsyncLLM.__init__)
    for name in ("vllm_config", "executor_class", "log_stats", "stat_loggers", "aggregate_engine_logging",
                 "client_count"):
        assert name in params, name
    init = inspect.getsource(async_llm.AsyncLLM.__init__)
    assert "self.logger_manager = StatLoggerManager(" in init
    handler = inspect.getsource(async_llm.AsyncLLM._run_output_handler)
    assert "self._logger_ref = [self.logger_manager]" in handler
    assert "logger_ref[0].record(" in handler
    loggers = importlib.import_module("vllm.v1.metrics.loggers")
    assert _params(loggers.StatLoggerManager.__init__) == [
        "self", "vllm_config", "engine_idxs", "custom_stat_loggers", "enable_default_loggers",
        "aggregate_engine_logging", "client_count"]
    assert "unregister_vllm_metrics()" in inspect.getsource(loggers.PrometheusStatLogger.__init__)
    assert "self.per_engine_labelvalues[engine_idx]" in inspect.getsource(loggers.PrometheusStatLogger.record)
    exceptions = importlib.import_module("vllm.exceptions")
    assert _params(exceptions.GracefulHTTPError.__init__) == ["self", "message", "http_status"]
    generate = inspect.getsource(async_llm.AsyncLLM.generate)
    assert "except (VLLMClientError, GracefulHTTPError)" in generate
    output = importlib.import_module("vllm.v1.engine.output_processor")
    assert _params(output.OutputProcessor.abort_requests) == ["self", "request_ids", "internal"]
    put = inspect.getsource(output.RequestOutputCollector.put)
    assert "if self.output is None or isinstance(output, Exception):" in put  # an error is never overwritten
    errors = importlib.import_module("vllm.entrypoints.serve.exception_handling.error_response")
    assert "isinstance(exc, GracefulHTTPError)" in inspect.getsource(errors.create_error_response)


def test_amx_permission_is_why_the_plugin_exists() -> None:
    """corefleet_client.vllm_plugin: vLLM's CPU attention uses AMX without asking Linux for it."""
    cpu_attn = importlib.import_module("vllm.v1.attention.backends.cpu_attn")
    src = inspect.getsource(cpu_attn._get_attn_isa)
    assert 'return "amx"' in src
    assert "_init_amx" not in src
    plugins = importlib.import_module("vllm.plugins")
    assert plugins.DEFAULT_PLUGINS_GROUP == "vllm.general_plugins"
    from importlib.metadata import entry_points

    assert "corefleet_client.vllm_plugin:register" in {
        e.value for e in entry_points(group="vllm.general_plugins")}


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


def test_engine_core_runs_in_process_as_the_manager_would_spawn_it(engine_utils: ModuleType) -> None:
    """corefleet_client.enginecore becomes the engine core: it repeats what CoreEngineProcManager does
    for one local engine before `proc.start()`, then runs the manager's own target in-process."""
    manager_init = inspect.getsource(engine_utils.CoreEngineProcManager.__init__)
    # The target and its keywords (enginecore passes the same ones, with dp_rank and local_dp_rank=0).
    assert "target=EngineCoreProc.run_engine_core" in manager_init
    for key in ('"vllm_config"', '"local_client"', '"handshake_address"', '"executor_class"', '"log_stats"',
                '"tensor_queue"', '{"dp_rank": global_index, "local_dp_rank": local_index}'):
        assert key in manager_init, key
    # The steps before proc.start(), and nothing else that enginecore would miss.
    assert "with _configure_uniproc_startup_threads(executor_class, local_engine_count):" in manager_init
    assert "set_assigned_physical_gpu_ids_for_dp_rank(" in manager_init
    assert "needs_device_env_isolation = not (" in manager_init
    assert "numa_utils.configure_subprocess(" in manager_init  # why enginecore refuses --numa-bind
    assert manager_init.count("with ") == 3, "CoreEngineProcManager wraps proc.start() in a new context"
    assert _params(engine_utils._configure_uniproc_startup_threads) == ["executor_class", "local_engine_count"]
    assert _params(engine_utils.set_assigned_physical_gpu_ids_for_dp_rank) == [
        "vllm_config", "local_dp_rank", "user_assigned_gpu_ids"]

    core = importlib.import_module("vllm.v1.engine.core")
    run = inspect.getattr_static(core.EngineCoreProc, "run_engine_core")
    assert isinstance(run, staticmethod), "run_engine_core is no longer a staticmethod"
    assert _params(core.EngineCoreProc.run_engine_core) == ["args", "dp_rank", "local_dp_rank", "kwargs"]
    source = inspect.getsource(core.EngineCoreProc.run_engine_core)
    # Its own signal handling (SIGTERM ends the busy loop with SystemExit), which the launcher relies on.
    assert "signal.signal(signal.SIGTERM, signal_handler)" in source
    assert "set_process_title(process_title)" in source
    params = inspect.signature(core.EngineCoreProc.__init__).parameters
    for name in ("vllm_config", "local_client", "handshake_address", "executor_class", "log_stats",
                 "tensor_queue"):
        assert name in params, name


def test_utility_calls_and_fan_out_pinned(core_client: ModuleType) -> None:
    """The liveness watcher and KubeDPLBClient.call_utility_all_async stand on these.

    vLLM's output task pops a utility answer's call id without a default (a KeyError for an id
    nobody registered takes the whole output task down): the watcher never removes an entry.
    Every utility of a DPLB client goes through `call_utility_all_async`, which gathers an answer
    from every engine: the override skips Dead and Unresponsive ranks.
    """
    assert "utility_results.pop(output.call_id)" in inspect.getsource(core_client._process_utility_output)
    call = inspect.getsource(core_client.AsyncMPClient._call_utility_async)
    assert "self.utility_results[call_id] = future" in call
    assert "(self.client_index, call_id, method, args)" in call
    fan_out = inspect.getsource(core_client.AsyncMPClient.call_utility_all_async)
    assert "asyncio.gather" in fan_out
    assert "for engine in self.core_engines" in fan_out
    assert "self.call_utility_all_async(method, *args)" in inspect.getsource(
        core_client.DPLBAsyncMPClient.call_utility_async)
    for method in ("reset_prefix_cache_async", "wake_up_async", "compute_weight_checksums_async"):
        assert "call_utility_all_async" in inspect.getsource(getattr(core_client.AsyncMPClient, method))
    # The connection check: an abort of ids the scheduler does not know is a no-op.
    scheduler = importlib.import_module("vllm.v1.core.sched.scheduler")
    finish = inspect.getsource(scheduler.Scheduler.finish_requests)
    assert "if request is None or request.is_finished():" in finish


def test_elastic_ep_routes_pinned() -> None:
    """vllm_compat change 8: the API server builds its app through `entry.build_app`, with these routes."""
    entry = importlib.import_module("vllm.entrypoints.launchers.api_server.entry")
    assert "app = build_app(args, supported_tasks, model_config)" in inspect.getsource(entry.build_and_serve)
    router = importlib.import_module("vllm.entrypoints.serve.elastic_ep.api_router")
    assert {r.path for r in router.router.routes} == {"/scale_elastic_ep", "/is_scaling_elastic_ep"}


def test_elastic_ep_client_steps_pinned(core_client: ModuleType) -> None:
    """What `frontend.elastic` replaces and reuses of vLLM's Ray-bound elastic-EP client (docs/vllm-protocol.md
    §10.2): the output task hands call id -1 to the class's `eep_process_engine_core_notification` as
    (client, (type, rank)); the reconfigure request's fields; the ready keys; the pause mode; R'."""
    task = inspect.getsource(core_client.AsyncMPClient._ensure_output_queue_task)
    assert 'getattr(self.__class__, "eep_process_engine_core_notification", None)' in task
    assert "outputs.utility_output.call_id == EEP_NOTIFICATION_CALL_ID" in task
    assert "notification_callback_handler(_self, notification_data)" in task
    assert core_client.EEP_NOTIFICATION_CALL_ID == -1
    request = inspect.getsource(core_client.DPLBAsyncMPClient._make_reconfig_request)
    for field in ("new_data_parallel_size=", "new_data_parallel_rank=rank_type", "new_data_parallel_master_ip=",
                  "new_data_parallel_master_port=", "new_data_parallel_master_port_list=", "coord_store_port="):
        assert field in request, field
    prepare = inspect.getsource(core_client.DPLBAsyncMPClient.prepare_elastic_ep)
    assert '"Only ray DP backend supports scaling elastic EP"' in prepare  # why corefleet has its own steps
    assert "num_physical_experts * new_data_parallel_size // cur_data_parallel_size" in prepare  # ExpertLayout
    up = inspect.getsource(core_client.DPLBAsyncMPClient._prepare_scale_up_elastic_ep)
    assert '"reinitialize_distributed", reconfig_request, engine=engine' in up
    assert 'f"eep_ready/{rank}"' in up
    commit_up = inspect.getsource(core_client.DPLBAsyncMPClient._commit_scale_up_elastic_ep)
    assert '"commit_prepared_elastic_ep", engine=engine' in commit_up
    down = inspect.getsource(core_client.DPLBAsyncMPClient._commit_scale_down_elastic_ep)
    assert "ReconfigureRankType.SHUTDOWN_CURRENT_RANK" in down
    mode = inspect.getsource(core_client.DPLBAsyncMPClient._eep_commit_pause_mode)
    assert 'return "keep"' in mode  # elastic.PAUSE_MODE
    engine = importlib.import_module("vllm.v1.engine")
    assert [t.value for t in engine.EEPNotificationType] == ["RECONFIGURE_FINISHED", "SHUTDOWN_COMPLETE"]
    core = importlib.import_module("vllm.v1.engine.core")
    reinit = inspect.getsource(core.DPEngineCoreProc.reinitialize_distributed)
    assert "Elastic EP reconfiguration is already active" in reinit  # a second one is refused (the emulator too)
    parallel = importlib.import_module("vllm.config.parallel")
    hashed = inspect.getsource(parallel.ParallelConfig.compute_hash)
    assert '"data_parallel_size"' not in hashed  # the size is hashed ...
    assert '"_coord_store_port"' in hashed  # ... the store is not


def test_a_steps_scheduler_stats_go_to_one_frontend_which_corefleet_makes_frontend_0() -> None:
    """vLLM sends a step's scheduler stats to the first client with an output (or client 0 if none has one), and
    attaches iteration details to the first output too; `enginecore.install_stats_to_frontend_0` moves them to
    frontend 0's output, first, so that one frontend's engine gauges are every engine's current ones."""
    scheduler = importlib.import_module("vllm.v1.core.sched.scheduler")
    src = inspect.getsource(scheduler.Scheduler.update_from_output)
    assert "Return stats to only one of the front-ends" in src
    assert "next(iter(engine_core_outputs.values()), None)" in src
    assert "engine_core_outputs[0] = eco = EngineCoreOutputs()" in src
    core = importlib.import_module("vllm.v1.engine.core")
    assert "next(iter(outputs.values()), None)" in inspect.getsource(core.EngineCore._attach_iteration_details)
    engine = importlib.import_module("vllm.v1.engine")
    stats_module = importlib.import_module("vllm.v1.metrics.stats")
    from corefleet_client.enginecore import stats_to_frontend_0

    def step(*clients: int, stats_at: int | None) -> dict[int, object]:
        outputs = {i: engine.EngineCoreOutputs() for i in clients}
        if stats_at is not None:
            outputs[stats_at].scheduler_stats = stats_module.SchedulerStats(num_running_reqs=3)
        return outputs

    moved = stats_to_frontend_0(step(2, 1, stats_at=2))  # only followers had outputs: frontend 0 gets one
    assert list(moved) == [0, 2, 1]
    assert moved[0].scheduler_stats.num_running_reqs == 3
    assert moved[2].scheduler_stats is None
    moved = stats_to_frontend_0(step(1, 0, stats_at=1))  # frontend 0 had an output too: it comes first
    assert list(moved) == [0, 1]
    assert (moved[0].scheduler_stats.num_running_reqs, moved[1].scheduler_stats) == (3, None)
    unchanged = step(0, 1, stats_at=0)
    assert stats_to_frontend_0(unchanged) is unchanged
    no_stats = step(1, stats_at=None)
    assert stats_to_frontend_0(no_stats) is no_stats
