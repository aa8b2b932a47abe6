# SPDX-License-Identifier: Apache-2.0
"""Conformance of the engine emulator's messages with vLLM 0.32.0's own encoders and decoders.

Each message the emulator sends is built by its code path and decoded the way the receiving vLLM
process decodes it (frontend: `MsgpackDecoder(EngineCoreOutputs)`, `EngineCoreReadyResponse`,
handshake dicts; coordinator: `MsgpackDecoder(EngineCoreOutputs)`); each message it receives is
built the way vLLM's frontend or coordinator builds it and decoded by the emulator. Plus the token,
stop, abort and pause rules as pure functions, and the engine's request handling without sockets.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgspec
import pytest
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import (
    EEP_NOTIFICATION_CALL_ID,
    EEPNotificationType,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    ReconfigureDistributedRequest,
    ReconfigureRankType,
)
from vllm.v1.engine.utils import EngineHandshakeMetadata, EngineZmqAddresses
from vllm.v1.serial_utils import MsgpackEncoder

from corefleet_harness.emulator import wire
from corefleet_harness.emulator.config import EmulatorConfig, parse_args
from corefleet_harness.emulator.engine import EmulatedEngineCore, _convert_msgspec_args
from corefleet_harness.emulator.scheduler import (
    FIRST_TOKEN_ID,
    EmulatedScheduler,
    PauseState,
    check_stop,
    expected_tokens,
    output_budget,
    token_id,
)
from emulated import drain, roundtrip_outputs, utility

CLIENT_ENCODER = MsgpackEncoder()  # MPClient.encoder


def client_frames(request_type: EngineCoreRequestType, body: Any) -> list[bytes]:
    """What the engine's DEALER receives from `AsyncMPClient._send_input` (the ROUTER strips the identity)."""
    return [request_type.value, *(bytes(b) for b in CLIENT_ENCODER.encode(body))]


def make_request(request_id: str = "req-1", prompt: list[int] | None = None, **sampling: Any) -> EngineCoreRequest:
    """An EngineCoreRequest as vLLM's InputProcessor.process_inputs builds one for a token prompt."""
    params = SamplingParams.from_optional(**{"max_tokens": 4, **sampling})
    params.update_from_generation_config({}, eos_token_id=2)
    return EngineCoreRequest(
        request_id=request_id, prompt_token_ids=prompt or [5, 6, 7], mm_features=None, sampling_params=params,
        pooling_params=None, arrival_time=time.time(), lora_request=None, cache_salt=None, data_parallel_rank=None,
        prompt_embeds=None, client_index=0, current_wave=0, priority=0, trace_headers=None,
        external_req_id=f"{request_id}-external",
    )


# ---- vLLM field lists the emulator was written against ---------------------------------------------


def test_the_pinned_vllm_structs_have_the_0_32_0_field_lists() -> None:
    """The emulator builds these by keyword; a field added upstream must be looked at, not guessed."""
    assert [f.name for f in dataclasses.fields(EngineCoreReadyResponse)] == [
        "max_model_len", "num_gpu_blocks", "block_size", "dp_stats_address", "dtype", "vllm_version",
        "world_size", "data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size",
        "decode_context_parallel_size", "data_parallel_rank", "max_num_seqs", "max_num_batched_tokens",
        "instance_id", "supports_lora", "max_loras", "mamba_block_size", "kv_cache_size_tokens",
        "kv_cache_max_concurrency", "kv_events_config", "weight_transfer_backend", "enable_sleep_mode",
        "supports_draft_weight_updates", "effective_attention_block_size",
    ]
    assert [f.name for f in dataclasses.fields(EngineHandshakeMetadata)] == ["addresses", "parallel_config"]
    assert ReconfigureDistributedRequest.__struct_fields__ == (
        "new_data_parallel_size", "new_data_parallel_rank", "new_data_parallel_rank_local",
        "new_data_parallel_master_ip", "new_data_parallel_master_port", "new_data_parallel_master_port_list",
        "coord_store_port",
    )
    assert {e.value for e in EEPNotificationType} == {"RECONFIGURE_FINISHED", "SHUTDOWN_COMPLETE"}
    # Constants the emulator copies rather than importing vllm/v1/engine/core.py (the whole engine).
    import vllm.v1.engine as engine_pkg

    source = (Path(engine_pkg.__file__).parent / "core.py").read_text()
    assert f"HANDSHAKE_TIMEOUT_MINS = {wire.HANDSHAKE_TIMEOUT_S // 60}\n" in source
    assert 'ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"' in source
    assert 'output = UtilityOutput(call_id, failure_message="Server shutting down")' in source
    assert 'output.failure_message = f"Call to {name} method failed: {str(e)}"' in source
    assert 'return f"eep_ready/{self.engine_core.dp_rank}"' in (
        Path(engine_pkg.__file__).parents[2] / "distributed" / "elastic_ep" / "elastic_state.py").read_text()


# ---- 1. Handshake ----------------------------------------------------------------------------------


def test_hello_is_what_startup_handshake_sends() -> None:
    vllm_hello = msgspec.msgpack.encode({"status": "HELLO", "local": False, "headless": True})
    assert wire.encode_hello() == vllm_hello
    msg = msgspec.msgpack.decode(wire.encode_hello())
    assert (msg["status"], msg["local"], msg["headless"]) == ("HELLO", False, True)  # wait_for_engine_startup


def test_init_from_wait_for_engine_startup_decodes() -> None:
    addresses = EngineZmqAddresses(inputs=["tcp://10.0.0.1:4001"], outputs=["tcp://10.0.0.1:4002"],
                                   coordinator_input="tcp://10.0.0.2:29553", coordinator_output="tcp://10.0.0.2:29552",
                                   frontend_stats_publish_address="tcp://10.0.0.2:29551")
    parallel_config = {"data_parallel_master_ip": "10.0.0.1", "data_parallel_master_port": 33333,
                       "_data_parallel_master_port_list": [1, 2, 3], "_coord_store_port": 44444,
                       "data_parallel_size": 4}
    payload = msgspec.msgpack.encode(EngineHandshakeMetadata(addresses=addresses, parallel_config=parallel_config))
    init = wire.decode_init(payload)
    assert dataclasses.asdict(init.addresses) == dataclasses.asdict(addresses)  # the emulator's mirrored dataclass
    assert init.parallel_config == parallel_config
    # A dense fleet's INIT carries no parallel config.
    assert wire.decode_init(msgspec.msgpack.encode(EngineHandshakeMetadata(addresses, {}))).parallel_config == {}


def test_ready_carries_the_hash_only_for_moe() -> None:
    moe = msgspec.msgpack.decode(wire.encode_ready("abc"))
    assert moe == {"status": "READY", "local": False, "headless": True, "parallel_config_hash": "abc"}
    dense = msgspec.msgpack.decode(wire.encode_ready(None))
    assert dense.get("parallel_config_hash") is None  # what wait_for_engine_startup reads
    assert dense == {"status": "READY", "local": False, "headless": True}
    assert wire.compute_parallel_config_hash(EmulatorConfig(data_parallel_size=2, is_moe=False)) is None
    moe_hash = wire.compute_parallel_config_hash(EmulatorConfig(data_parallel_size=2, is_moe=True))
    assert isinstance(moe_hash, str)
    assert moe_hash != wire.compute_parallel_config_hash(EmulatorConfig(data_parallel_size=3, is_moe=True))
    elastic = EmulatorConfig(data_parallel_size=2, is_moe=True, enable_expert_parallel=True, enable_eplb=True,
                             enable_elastic_ep=True, elastic_ep_max_dp_size=4, eplb_config={"use_async": False})
    assert wire.compute_parallel_config_hash(elastic) not in (None, moe_hash)
    assert wire.compute_parallel_config_hash(dataclasses.replace(elastic, parallel_config_hash="given")) == "given"


@pytest.mark.parametrize(("moe", "want_dp_size"), [(False, 1), (True, 4)])
def test_ready_response_decodes_as_the_frontend_decodes_it(moe: bool, want_dp_size: int) -> None:
    cfg = EmulatorConfig(rank=3, data_parallel_size=4, is_moe=moe, max_model_len=256, max_num_seqs=8)
    response = wire.make_ready_response(cfg, "tcp://10.0.0.2:29551")
    decoded = msgspec.msgpack.decode(wire.encode_ready_response(response), type=EngineCoreReadyResponse)
    assert dataclasses.asdict(decoded) == dataclasses.asdict(response)  # vLLM's type vs the emulator's mirror
    assert (decoded.data_parallel_rank, decoded.data_parallel_size) == (3, want_dp_size)
    assert (decoded.max_model_len, decoded.max_num_seqs, decoded.block_size) == (256, 8, 16)
    assert decoded.num_gpu_blocks > 0
    assert decoded.vllm_version.startswith("0.32.0")


# ---- 2. Inputs ---------------------------------------------------------------------------------------


def test_add_request_built_like_the_input_processor_decodes() -> None:
    request = make_request(prompt=[9, 8, 7], max_tokens=12, stop_token_ids=[77])
    request.client_index, request.current_wave = 0, 5
    message = wire.InputDecoder().decode(client_frames(EngineCoreRequestType.ADD, request))
    assert message is not None  # (None: the coordinator's READY)
    request_type, decoded = message
    assert request_type == wire.EngineCoreRequestType.ADD  # the emulator's own enum (same bytes, test_emulator_mirror)
    assert isinstance(decoded, wire.EngineCoreRequest)  # the emulator's mirror of vLLM's
    for name in ("request_id", "prompt_token_ids", "arrival_time", "client_index", "current_wave",
                 "data_parallel_rank", "external_req_id"):
        assert getattr(decoded, name) == getattr(request, name), name
    assert decoded.sampling_params is not None
    assert decoded.sampling_params.max_tokens == 12
    assert decoded.sampling_params.stop_token_ids == [77]
    assert decoded.sampling_params.eos_token_id == 2


def test_abort_utility_start_wave_and_coordinator_ready_decode() -> None:
    decoder = wire.InputDecoder()
    assert decoder.decode(client_frames(EngineCoreRequestType.ABORT, ["a", "b"])) == (
        wire.EngineCoreRequestType.ABORT, ["a", "b"])

    reconfig = ReconfigureDistributedRequest(3, ReconfigureRankType.KEEP_CURRENT_RANK,
                                             ReconfigureRankType.KEEP_CURRENT_RANK, "10.0.0.1", 5000, [1, 2], 6000)
    call_id = 2**63 + 5  # uuid1().int >> 64 is unsigned 64-bit
    message = decoder.decode(
        client_frames(EngineCoreRequestType.UTILITY, (0, call_id, "reinitialize_distributed", (reconfig,))))
    assert message is not None  # (None: the coordinator's READY)
    request_type, body = message
    assert request_type == wire.EngineCoreRequestType.UTILITY
    client_index, got_call_id, method, args = body
    assert (client_index, got_call_id, method) == (0, call_id, "reinitialize_distributed")
    engine = EmulatedEngineCore(EmulatorConfig(rank=0, data_parallel_size=2, is_moe=True))
    (converted,) = _convert_msgspec_args(engine.reinitialize_distributed, tuple(args))
    # EngineCoreProc._convert_msgspec_args: map -> Struct (the emulator's mirror of vLLM's)
    assert isinstance(converted, wire.ReconfigureDistributedRequest)
    assert msgspec.structs.asdict(converted) == msgspec.structs.asdict(reconfig)

    # DPCoordinatorProc._send_start_wave and the READY it re-sends when a new engine subscribes.
    frames = [EngineCoreRequestType.START_DP_WAVE.value, msgspec.msgpack.encode((7, 1))]
    assert decoder.decode(frames) == (wire.EngineCoreRequestType.START_DP_WAVE, [7, 1])
    assert decoder.decode([b"READY"]) is None


# ---- 3. Outputs ----------------------------------------------------------------------------------------


def test_step_outputs_decode_at_the_frontend() -> None:
    sched = EmulatedScheduler(max_num_seqs=8, max_model_len=256, vocab_size=512, num_gpu_blocks=100, block_size=16)
    sched.add_request(make_request("r1", [5, 6, 7], max_tokens=2), time.monotonic())
    first = roundtrip_outputs(sched.step(time.monotonic())[0])
    (out,) = first.outputs
    assert (out.request_id, out.new_token_ids, out.finish_reason) == ("r1", [token_id([5, 6, 7], 0, 512)], None)
    assert [e.type for e in out.events or []] == [1, 2]  # QUEUED, SCHEDULED
    assert first.scheduler_stats is not None
    assert (first.scheduler_stats.num_running_reqs, first.scheduler_stats.num_waiting_reqs) == (1, 0)
    assert first.finished_requests is None
    last = roundtrip_outputs(sched.step(time.monotonic())[0])
    (out,) = last.outputs
    assert (out.new_token_ids, out.finish_reason, out.stop_reason) == ([token_id([5, 6, 7], 1, 512)],
                                                                       FinishReason.LENGTH, None)
    assert out.events is None
    assert last.finished_requests == {"r1"}


def test_finish_outputs_utility_outputs_and_notifications_decode() -> None:
    aborted = roundtrip_outputs(wire.make_finish_outputs(["x", "y"], FinishReason.ABORT))
    assert aborted.finished_requests == {"x", "y"}
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in aborted.outputs] == [
        ("x", [], FinishReason.ABORT), ("y", [], FinishReason.ABORT)]

    from vllm.v1.engine.core_client import _process_utility_output

    ok = roundtrip_outputs(wire.make_utility_output(123, ("generate",)))
    assert ok.utility_output is not None
    future: Future[Any] = Future()
    _process_utility_output(ok.utility_output, {123: future})  # the frontend's own handler
    assert future.result() == ["generate"]
    failed = roundtrip_outputs(wire.make_utility_output(
        124, failure_message=wire.utility_failure_message("nope", AttributeError("no such method"))))
    future = Future()
    assert failed.utility_output is not None
    _process_utility_output(failed.utility_output, {124: future})
    with pytest.raises(Exception, match="Call to nope method failed: no such method"):
        future.result()

    for kind in EEPNotificationType:
        note = roundtrip_outputs(wire.make_eep_notification(kind, dp_rank=2, engine_index=2))
        assert note.engine_index == 2
        assert note.utility_output is not None
        assert note.utility_output.call_id == EEP_NOTIFICATION_CALL_ID
        kind_value, rank = note.utility_output.result.result  # eep_process_engine_core_notification
        assert (EEPNotificationType(kind_value), rank) == (kind, 2)


def test_coordinator_messages_decode_as_the_coordinator_reads_them() -> None:
    stats = roundtrip_outputs(wire.make_coordinator_stats(
        wire.make_stats(3, 5, 0.25, step_counter=7, current_wave=2)))
    assert not stats.outputs
    assert stats.utility_output is None  # the coordinator asserts both
    s = stats.scheduler_stats
    assert s is not None
    assert (s.num_running_reqs, s.num_waiting_reqs, s.kv_cache_usage, s.step_counter, s.current_wave) == (
        3, 5, 0.25, 7, 2)
    assert roundtrip_outputs(wire.make_wave_complete(4)).wave_complete == 4
    assert roundtrip_outputs(wire.make_start_wave(5)).start_wave == 5


# ---- 4. Pure rules ------------------------------------------------------------------------------------


def test_tokens_are_deterministic_in_range_and_never_special() -> None:
    prompt = [100, 200]
    assert expected_tokens(prompt, 3, 512) == [token_id(prompt, i, 512) for i in range(3)]
    assert token_id(prompt, 0, 512) == FIRST_TOKEN_ID + 300 % (512 - FIRST_TOKEN_ID)
    tokens = expected_tokens([7], 2000, 512)
    assert all(FIRST_TOKEN_ID <= t < 512 for t in tokens)
    assert len(set(tokens)) == 512 - FIRST_TOKEN_ID


def test_output_budget_and_stop_rules() -> None:
    assert output_budget(3, 10, 256) == 10
    assert output_budget(250, 10, 256) == 6  # max_model_len caps it
    assert output_budget(3, None, 256) == 253
    assert output_budget(300, 10, 256) == 1  # the prefill token is always sampled
    assert check_stop(2, 1, 10, eos_token_id=2, stop_token_ids=[9]) == (FinishReason.STOP, None)
    assert check_stop(9, 1, 10, eos_token_id=2, stop_token_ids=[9]) == (FinishReason.STOP, 9)
    assert check_stop(5, 10, 10, eos_token_id=2, stop_token_ids=[9]) == (FinishReason.LENGTH, None)
    assert check_stop(5, 3, 10, eos_token_id=None, stop_token_ids=None) == (None, None)


def test_stop_token_finishes_a_request_with_its_stop_reason() -> None:
    sched = EmulatedScheduler(max_num_seqs=4, max_model_len=256, vocab_size=512, num_gpu_blocks=100, block_size=16)
    stop_at = token_id([5], 2, 512)
    sched.add_request(make_request("s", [5], max_tokens=50, stop_token_ids=[stop_at]), 0.0)
    outs = [sched.step(float(i)) for i in range(3)]
    last = outs[-1][0].outputs[0]
    assert (last.new_token_ids, last.finish_reason, last.stop_reason) == ([stop_at], FinishReason.STOP, stop_at)


def test_batching_waiting_queue_and_kv_usage() -> None:
    sched = EmulatedScheduler(max_num_seqs=2, max_model_len=64, vocab_size=512, num_gpu_blocks=10, block_size=16)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", [1] * 20, max_tokens=3), 0.0)
    assert sched.get_request_counts() == (0, 3)
    outputs = sched.step(1.0)
    assert [o.request_id for o in outputs[0].outputs] == ["r0", "r1"]  # one token each, in one step
    assert sched.get_request_counts() == (2, 1)
    assert sched.get_kv_cache_usage() == pytest.approx(4 / 10)  # 2 requests x ceil(21 / 16) blocks
    sched.step(2.0)
    third = sched.step(3.0)
    assert third[0].finished_requests == {"r0", "r1"}
    assert sched.get_request_counts() == (0, 1)  # r2 is scheduled by the next step
    assert [o.request_id for o in sched.step(4.0)[0].outputs] == ["r2"]
    assert sched.get_request_counts() == (1, 0)


def test_abort_reports_only_in_the_next_finished_set() -> None:
    sched = EmulatedScheduler(max_num_seqs=2, max_model_len=64, vocab_size=512, num_gpu_blocks=10, block_size=16)
    sched.add_request(make_request("keep", max_tokens=10), 0.0)
    sched.add_request(make_request("gone", max_tokens=10), 0.0)
    sched.step(1.0)
    assert [r.request_id for r in sched.abort_requests(["gone", "unknown"])] == ["gone"]
    assert sched.abort_requests(["gone"]) == []  # idempotent, as finish_requests
    assert sched.has_finished_requests()
    step = sched.step(2.0)[0]
    assert [o.request_id for o in step.outputs] == ["keep"]  # no EngineCoreOutput for the aborted one
    assert step.finished_requests == {"gone"}
    assert sched.counters.aborted_ids == ["gone"]
    # Without a coordinator (include_finished_set False) there are no finished sets at all.
    plain = EmulatedScheduler(max_num_seqs=1, max_model_len=64, vocab_size=512, num_gpu_blocks=10, block_size=16,
                              include_finished_set=False, log_stats=False)
    plain.add_request(make_request("p", max_tokens=1), 0.0)
    assert plain.step(1.0)[0].finished_requests is None


def test_pause_states_follow_vllm() -> None:
    sched = EmulatedScheduler(max_num_seqs=1, max_model_len=64, vocab_size=512, num_gpu_blocks=10, block_size=16)
    sched.add_request(make_request("a", max_tokens=10), 0.0)
    sched.add_request(make_request("b", max_tokens=10), 0.0)
    sched.step(1.0)
    sched.set_pause_state(PauseState.PAUSED_NEW)  # running ones drain, waiting ones stay queued
    assert sched.get_num_unfinished_requests() == 1
    sched.set_pause_state(PauseState.PAUSED_ALL)
    assert not sched.has_requests()
    assert sched.step(2.0)[0].outputs == []


# ---- 5. The engine's request handling, without sockets ----------------------------------------------------


def test_utilities_the_frontend_calls_at_startup_and_unknown_ones() -> None:
    engine = EmulatedEngineCore(EmulatorConfig())
    assert utility(engine, "get_supported_tasks").result.result == ["generate"]
    assert utility(engine, "reset_mm_cache").result.result is None
    assert utility(engine, "reset_prefix_cache", False, False).result.result is True
    assert utility(engine, "is_sleeping").result.result is False
    assert utility(engine, "list_loras").result.result == []
    failed = utility(engine, "no_such_method")
    assert failed.failure_message == "Call to no_such_method method failed: 'EngineCoreProc' object has no attribute " \
                                     "'no_such_method'"
    # Dense engines are EngineCoreProc: no elastic EP.
    assert "has no attribute 'reinitialize_distributed'" in utility(engine, "reinitialize_distributed").failure_message
    assert engine.utility_calls["get_supported_tasks"] == 1


def test_moe_engine_elastic_calls_and_waves_without_sockets() -> None:
    engine = EmulatedEngineCore(EmulatorConfig(rank=1, data_parallel_size=2, is_moe=True))
    engine.has_coordinator = True
    assert "No prepared Elastic EP reconfiguration" in utility(engine, "commit_prepared_elastic_ep").failure_message
    request = ReconfigureDistributedRequest(1, ReconfigureRankType.SHUTDOWN_CURRENT_RANK,
                                            ReconfigureRankType.KEEP_CURRENT_RANK, "127.0.0.1", 1, [2], 3)
    assert utility(engine, "reinitialize_distributed", msgspec.to_builtins(request)).result.result == "eep_ready/1"
    assert engine.eep_scaling_state is not None
    assert (engine.eep_scaling_state.worker_type, engine.eep_scaling_state.scale_type) == ("removing", "scale_down")
    assert "already active" in utility(engine, "reinitialize_distributed", request).failure_message

    # START_DP_WAVE from the coordinator: taken unless this engine is the excluded one or the wave is old.
    engine._handle_client_request(wire.EngineCoreRequestType.START_DP_WAVE, [3, 1])
    assert (engine.current_wave, engine.engines_running) == (0, False)
    engine._handle_client_request(wire.EngineCoreRequestType.START_DP_WAVE, [3, 0])
    assert (engine.current_wave, engine.engines_running) == (3, True)
    # A request for an older wave on an idle engine asks the coordinator to start the current one.
    engine.engines_running = False
    engine.add_request(make_request("w", max_tokens=1), request_wave=1)
    ((client, out),) = drain(engine)
    assert (client, roundtrip_outputs(out).start_wave) == (-1, 3)


def test_parse_args_takes_an_engine_pods_command_line() -> None:
    cfg = parse_args([
        "--token-delay-ms", "5", "--health-port", "8002", "--",
        "/models/x", "--headless", "--data-parallel-size", "4", "--data-parallel-size-local", "1",
        "--data-parallel-start-rank", "2", "--data-parallel-address", "fleet-frontend.ns.svc",
        "--data-parallel-rpc-port", "29550", "--tensor-parallel-size", "1", "--load-format", "dummy",
        "--enable-expert-parallel", "--max-model-len", "512", "--max-num-seqs", "16", "--trust-remote-code",
    ], environ={"VLLM_ELASTIC_EP_SCALE_UP_LAUNCH": "1"})
    assert (cfg.rank, cfg.data_parallel_size, cfg.handshake_address) == (2, 4, "tcp://fleet-frontend.ns.svc:29550")
    assert (cfg.max_model_len, cfg.max_num_seqs, cfg.token_delay_s, cfg.health_port) == (512, 16, 0.005, 8002)
    assert cfg.enable_expert_parallel
    assert cfg.scale_up_launch
    assert not cfg.is_moe  # no config.json to read; --emulate-moe forces it
    assert parse_args(["--emulate-moe", "--", "m", "--headless", "-dp", "2", "-dpr", "1"], environ={}).coordinated_dp
    with pytest.raises(SystemExit):
        parse_args(["--", "m", "--headless", "-dp", "2", "-dpl", "2"], environ={})
    with pytest.raises(SystemExit):
        parse_args(["--", "m", "-dp", "2"], environ={})  # not headless
