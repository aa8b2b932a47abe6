# SPDX-License-Identifier: Apache-2.0
"""Every message the emulated engine sends or receives, built from vLLM 0.32.0's wire types as the emulator
mirrors them (`structs`, `serial`: the same bytes as vLLM's own, without importing vLLM or torch).

Each builder names the vLLM code that produces the same bytes; `tests/unit/test_emulator_wire.py`
round-trips all of them through vLLM's decoders and `tests/unit/test_emulator_mirror.py` compares the
mirrored types and serializers with vLLM's. Nothing here opens a socket.

* HELLO / READY, engine -> handshake ROUTER: `EngineCoreProc.startup_handshake`, `_perform_handshake`;
* INIT (`EngineHandshakeMetadata`), handshake ROUTER -> engine: `wait_for_engine_startup` (v1/engine/utils.py);
* `EngineCoreReadyResponse`, engine -> every input ROUTER, first: `EngineCoreProc._make_ready_response`;
* `[type, msgpack, *aux]` ADD / ABORT / UTILITY, frontend -> engine: `AsyncMPClient._send_input`,
  `_call_utility_async`;
* `[START_DP_WAVE, msgpack((wave, exclude))]` and `READY`, coordinator -> engine:
  `DPCoordinatorProc._send_start_wave`, `process_input_socket`;
* `EngineCoreOutputs` (tokens, finished set, utility answers), engine -> output PULL:
  `Scheduler.update_from_output`, `EngineCoreProc._handle_client_request`;
* `EngineCoreOutputs(scheduler_stats=...)` and wave events, engine -> coordinator PULL:
  `_maybe_publish_request_counts`, `DPEngineCoreProc.run_busy_loop`;
* EEP notifications (call id -1), engine -> output PULL of client 0:
  `DPEngineCoreProc._eep_send_engine_core_notification`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from corefleet_harness.emulator.config import EmulatorConfig
from corefleet_harness.emulator.parallel_hash import compute_parallel_config_hash
from corefleet_harness.emulator.serial import MsgpackDecoder, MsgpackEncoder
from corefleet_harness.emulator.structs import (
    EEP_NOTIFICATION_CALL_ID,
    VLLM_VERSION,
    EEPNotificationType,
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineHandshakeMetadata,
    EngineZmqAddresses,
    FinishReason,
    ReconfigureDistributedRequest,
    ReconfigureRankType,
    SchedulerStats,
    UtilityOutput,
    UtilityResult,
)

__all__ = [
    "EEP_NOTIFICATION_CALL_ID",
    "ENGINE_CORE_DEAD",
    "HANDSHAKE_TIMEOUT_S",
    "VLLM_VERSION",
    "EEPNotificationType",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreReadyResponse",
    "EngineCoreRequest",
    "EngineCoreRequestType",
    "EngineHandshakeMetadata",
    "EngineZmqAddresses",
    "FinishReason",
    "InputDecoder",
    "MsgpackEncoder",
    "ReconfigureDistributedRequest",
    "ReconfigureRankType",
    "SchedulerStats",
    "UnsupportedRequest",
    "UtilityOutput",
    "UtilityResult",
    "compute_parallel_config_hash",
]

# vllm/v1/engine/core.py: HANDSHAKE_TIMEOUT_MINS = 5 (not imported: core.py pulls in the whole engine).
HANDSHAKE_TIMEOUT_S = 5 * 60
# EngineCoreProc.ENGINE_CORE_DEAD, the single-frame sentinel the frontend checks for.
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
# The coordinator's engine gate answer (DPCoordinatorProc.process_input_socket).
COORDINATOR_READY = b"READY"
SUBSCRIBE = b"\x01"


def identity(rank: int) -> bytes:
    """The engine's ZMQ identity: its global DP rank, 2 bytes little-endian (`EngineCoreProc.__init__`)."""
    return rank.to_bytes(length=2, byteorder="little")


# --- 1. Handshake ---------------------------------------------------------------------------------

def encode_hello(local: bool = False, headless: bool = True) -> bytes:
    """`EngineCoreProc.startup_handshake`: the registration message."""
    return msgspec.msgpack.encode({"status": "HELLO", "local": local, "headless": headless})


def decode_init(payload: bytes) -> EngineHandshakeMetadata:
    """`EngineCoreProc.startup_handshake`: INIT decoded into vLLM's dataclass (a msgpack map)."""
    return msgspec.msgpack.decode(payload, type=EngineHandshakeMetadata)


def encode_ready(parallel_config_hash: str | None, local: bool = False, headless: bool = True) -> bytes:
    """`EngineCoreProc._perform_handshake`: READY after the input sockets are registered.

    `parallel_config_hash` is present only when the engine's `data_parallel_size > 1`, which after
    `reconfigure_for_independent_dp_rank` (dense models) means only for MoE engines.
    """
    msg: dict[str, Any] = {"status": "READY", "local": local, "headless": headless}
    if parallel_config_hash is not None:
        msg["parallel_config_hash"] = parallel_config_hash
    return msgspec.msgpack.encode(msg)


def make_ready_response(cfg: EmulatorConfig, dp_stats_address: str | None) -> EngineCoreReadyResponse:
    """`EngineCoreProc._make_ready_response`, from the emulator's config (0.32.0 field list).

    A dense DP rank runs with `data_parallel_size` 1 (`reconfigure_for_independent_dp_rank`), so
    it reports 1 there and its global rank in `data_parallel_rank` (`engine_index`).
    """
    world_size = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
    return EngineCoreReadyResponse(
        max_model_len=cfg.max_model_len,
        num_gpu_blocks=cfg.num_gpu_blocks,
        block_size=cfg.block_size,
        dp_stats_address=dp_stats_address,
        dtype=cfg.dtype,
        vllm_version=VLLM_VERSION,
        world_size=world_size,
        data_parallel_size=cfg.data_parallel_size if cfg.coordinated_dp else 1,
        tensor_parallel_size=cfg.tensor_parallel_size,
        pipeline_parallel_size=cfg.pipeline_parallel_size,
        decode_context_parallel_size=cfg.decode_context_parallel_size,
        data_parallel_rank=cfg.rank,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        instance_id=cfg.instance_id,
        supports_lora=False,
        max_loras=0,
        mamba_block_size=None,
        kv_cache_size_tokens=cfg.num_gpu_blocks * cfg.block_size,
        kv_cache_max_concurrency=cfg.num_gpu_blocks * cfg.block_size / cfg.max_model_len,
        kv_events_config=None,
        weight_transfer_backend=None,
        enable_sleep_mode=False,
        supports_draft_weight_updates=False,
        effective_attention_block_size=cfg.block_size,
    )


def encode_ready_response(response: EngineCoreReadyResponse) -> bytes:
    """`process_input_sockets`: plain `msgspec.msgpack.encode` (a dataclass, so a map)."""
    return msgspec.msgpack.encode(response)


# --- 2. Inputs (frontend and coordinator -> engine) ----------------------------------------------

class UnsupportedRequest(Exception):
    """An ADD the emulator cannot serve (multimodal or embedding inputs); the engine answers it with
    `FinishReason.ERROR`, as vLLM answers a request its preprocessing fails (`_handle_request_preproc_error`)."""

    def __init__(self, request: EngineCoreRequest, reason: str) -> None:
        super().__init__(reason)
        self.request = request


class InputDecoder:
    """`EngineCoreProc.process_input_sockets`: frames -> (request type, request).

    ADD is decoded into `EngineCoreRequest` by `MsgpackDecoder(EngineCoreRequest)`; UTILITY, ABORT
    and START_DP_WAVE by the untyped `MsgpackDecoder()`. `b"READY"` from the coordinator (sent again
    whenever a new engine subscribes) is returned as None and must be ignored. A message with a tensor
    raises NotImplementedError (`serial`); an ADD with multimodal features or prompt embeddings raises
    UnsupportedRequest.
    """

    def __init__(self) -> None:
        self.add_request_decoder = MsgpackDecoder(EngineCoreRequest)
        self.generic_decoder = MsgpackDecoder()

    def decode(self, frames: Sequence[Any]) -> tuple[EngineCoreRequestType, Any] | None:
        type_frame, *data_frames = frames
        type_bytes = bytes(type_frame.buffer if hasattr(type_frame, "buffer") else type_frame)
        if type_bytes == COORDINATOR_READY:
            return None
        request_type = EngineCoreRequestType(type_bytes)
        if request_type == EngineCoreRequestType.ADD:
            request: EngineCoreRequest = self.add_request_decoder.decode(data_frames)
            for name in ("mm_features", "prompt_embeds"):
                if getattr(request, name) is not None:
                    raise UnsupportedRequest(request, f"the engine emulator does not serve requests with {name}")
            return request_type, request
        return request_type, self.generic_decoder.decode(data_frames)


# --- 3. Outputs (engine -> frontend) --------------------------------------------------------------

def make_token_output(request_id: str, token_ids: list[int], finish_reason: FinishReason | None,
                      stop_reason: int | str | None = None,
                      events: list[EngineCoreEvent] | None = None) -> EngineCoreOutput:
    """One request's new tokens in a step (`Scheduler.update_from_output`)."""
    return EngineCoreOutput(request_id=request_id, new_token_ids=token_ids, finish_reason=finish_reason,
                            stop_reason=stop_reason, events=events)


def make_events(arrival: float, scheduled: float | None) -> list[EngineCoreEvent]:
    """QUEUED (and SCHEDULED) events as `Request.take_events` reports them with log_stats on."""
    events = [EngineCoreEvent(EngineCoreEventType.QUEUED, arrival)]
    if scheduled is not None:
        events.append(EngineCoreEvent(EngineCoreEventType.SCHEDULED, scheduled))
    return events


def make_finish_outputs(request_ids: Iterable[str], finish_reason: FinishReason) -> EngineCoreOutputs:
    """`EngineCoreProc._send_finish_outputs_to_client`: explicit ABORT/ERROR outputs (pause "abort",
    shutdown, ADD rejected during shutdown). A client ABORT does not produce these: the aborted
    ids only appear in the next step's `finished_requests`."""
    req_ids = list(request_ids)
    outputs = [EngineCoreOutput(req_id, [], finish_reason=finish_reason) for req_id in req_ids]
    # vLLM passes the list as it is (a msgpack array in this order, where a set's order could differ).
    return EngineCoreOutputs(finished_requests=req_ids, outputs=outputs)  # type: ignore[arg-type]


def make_utility_output(call_id: int, result: Any = None, failure_message: str | None = None) -> EngineCoreOutputs:
    """`EngineCoreProc._handle_client_request` / `_invoke_utility_method`: a utility call's answer."""
    if failure_message is not None:
        output = UtilityOutput(call_id, failure_message=failure_message)
    else:
        output = UtilityOutput(call_id, result=UtilityResult(result))
    return EngineCoreOutputs(utility_output=output)


def utility_failure_message(method: str, error: BaseException) -> str:
    """`EngineCoreProc._invoke_utility_method`'s failure text."""
    return f"Call to {method} method failed: {error!s}"


SHUTTING_DOWN_MESSAGE = "Server shutting down"  # EngineCoreProc._reject_utility_in_shutdown


def make_eep_notification(kind: EEPNotificationType, dp_rank: int, engine_index: int) -> EngineCoreOutputs:
    """`DPEngineCoreProc._eep_send_engine_core_notification` (always to client index 0)."""
    outputs = EngineCoreOutputs(
        utility_output=UtilityOutput(call_id=EEP_NOTIFICATION_CALL_ID, result=UtilityResult((kind.value, dp_rank)))
    )
    outputs.engine_index = engine_index
    return outputs


# --- 4. Coordinator (engine -> coordinator PULL) --------------------------------------------------

def make_stats(num_running: int, num_waiting: int, kv_cache_usage: float, *,
               step_counter: int = 0, current_wave: int = 0) -> SchedulerStats:
    """`EngineCoreProc._maybe_publish_request_counts` (step/wave: `DPEngineCoreProc`'s override)."""
    return SchedulerStats(num_running, num_waiting, kv_cache_usage=kv_cache_usage,
                          step_counter=step_counter, current_wave=current_wave)


def make_coordinator_stats(stats: SchedulerStats) -> EngineCoreOutputs:
    return EngineCoreOutputs(scheduler_stats=stats)


def make_wave_complete(wave: int) -> EngineCoreOutputs:
    """`DPEngineCoreProc.run_busy_loop`: rank 0 reports the end of a wave."""
    return EngineCoreOutputs(wave_complete=wave)


def make_start_wave(wave: int) -> EngineCoreOutputs:
    """`DPEngineCoreProc.add_request` / `run_busy_loop`: ask the coordinator to start `wave`."""
    return EngineCoreOutputs(start_wave=wave)


def now() -> float:
    """Engine-core timestamps are monotonic (`EngineCoreEvent.new_event`)."""
    return time.monotonic()
