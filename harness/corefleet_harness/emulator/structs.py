# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.32.0's wire types, mirrored so that an emulated engine starts without importing vLLM or torch.

Each class here is the twin of the vLLM class `VLLM_MIRRORS` names: the same kind (msgspec Struct,
dataclass, enum), the same struct config (`array_like`, `omit_defaults`, `gc`, tag), the same fields
in the same order with the same types and defaults, so that msgspec encodes both to the same bytes and
either side decodes what the other sent. `tests/unit/test_emulator_mirror.py` compares every class
with vLLM's own, field by field and by encoding messages both ways, so a change of these types in the
pinned vLLM fails a unit test rather than drifting silently.

Two deliberate narrowings, both checked by that test:

* Opaque fields (`OPAQUE_FIELDS`) carry what the emulator never produces or reads: tensors, numpy
  arrays, logprobs, multimodal features, stats it does not keep. On a type the emulator sends they
  are typed `None` (it can only send the default, which is what vLLM's encoder writes for them); on
  `EngineCoreRequest`, which it receives, `Any` (decoded as plain msgpack and ignored, except that a
  tensor anywhere fails the decode, `serial.MsgpackDecoder`). Their names, positions and defaults
  still match vLLM's.
* `SamplingParams` is partial (`PARTIAL_MIRRORS`): vLLM encodes it as a map (not `array_like`), so a
  struct with only the fields the emulated scheduler reads decodes them exactly and skips the rest.

Where each type comes from: `vllm/v1/engine/__init__.py` (requests, outputs, enums, call ids),
`vllm/v1/engine/utils.py` (the handshake), `vllm/v1/metrics/stats.py` (scheduler stats, prefix cache),
`vllm/v1/metrics/cache_hit_source.py`, `vllm/sampling_params.py`, `vllm/v1/serial_utils.py`
(`UtilityResult`), `vllm/version.py`.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

# vllm/version.py (vllm/_version.py): what EngineCoreReadyResponse reports.
VLLM_VERSION = "0.32.0"

# vllm/v1/engine/__init__.py
EEP_NOTIFICATION_CALL_ID = -1


class EEPNotificationType(enum.Enum):
    RECONFIGURE_FINISHED = "RECONFIGURE_FINISHED"
    SHUTDOWN_COMPLETE = "SHUTDOWN_COMPLETE"


FINISH_REASON_STRINGS = ("stop", "length", "abort", "error", "repetition")


class FinishReason(enum.IntEnum):
    """stop / length / abort / error / repetition; an int on the wire."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4

    def __str__(self) -> str:
        return FINISH_REASON_STRINGS[self.value]


class EngineCoreRequestType(enum.Enum):
    """The first frame of every input message."""

    ADD = b"\x00"
    ABORT = b"\x01"
    START_DP_WAVE = b"\x02"
    UTILITY = b"\x03"
    EXECUTOR_FAILED = b"\x04"
    WAKEUP = b"\x05"


class ReconfigureRankType(enum.IntEnum):
    KEEP_CURRENT_RANK = -1
    SHUTDOWN_CURRENT_RANK = -2


class EngineCoreEventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class UtilityResult:
    """`vllm.v1.serial_utils.UtilityResult`: a utility call's result, encoded by the encoder's hook."""

    def __init__(self, r: Any = None) -> None:
        self.result = r


class CacheHitSource(str, enum.Enum):  # noqa: UP042  # as vLLM declares it (StrEnum formats differently)
    """`vllm/v1/metrics/cache_hit_source.py`: keys of `PrefixCacheStats.hits_by_source`."""

    DEVICE = "device"
    HOST = "host"
    P2P = "p2p"
    DISK = "disk"
    EXTERNAL_UNSPECIFIED = "external_unspecified"


# --- Handshake (vllm/v1/engine/utils.py, vllm/v1/engine/__init__.py) ------------------------------

@dataclass
class EngineZmqAddresses:
    inputs: list[str]
    outputs: list[str]
    coordinator_input: str | None = None
    coordinator_output: str | None = None
    frontend_stats_publish_address: str | None = None


@dataclass
class EngineHandshakeMetadata:
    """INIT, frontend -> engine (a msgpack map)."""

    addresses: EngineZmqAddresses
    parallel_config: dict[str, int | str | list[int]]


@dataclass
class EngineCoreReadyResponse:
    """Engine -> every input ROUTER, first (a msgpack map)."""

    max_model_len: int
    num_gpu_blocks: int
    block_size: int
    dp_stats_address: str | None
    dtype: str
    vllm_version: str
    world_size: int
    data_parallel_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    decode_context_parallel_size: int
    data_parallel_rank: int
    max_num_seqs: int
    max_num_batched_tokens: int
    instance_id: str
    supports_lora: bool
    max_loras: int
    mamba_block_size: int | None = None
    kv_cache_size_tokens: int | None = None
    kv_cache_max_concurrency: float | None = None
    kv_events_config: None = None  # opaque: KVEventsConfig
    weight_transfer_backend: str | None = None
    enable_sleep_mode: bool = False
    supports_draft_weight_updates: bool = False
    effective_attention_block_size: int | None = None


# --- Requests (frontend -> engine) ------------------------------------------------------------------

class SamplingParams(msgspec.Struct, omit_defaults=True, dict=True, weakref=True):
    """The fields of `vllm.sampling_params.SamplingParams` the emulated scheduler reads (a partial mirror:
    vLLM encodes it as a map, and msgspec skips the keys a struct does not name)."""

    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    _eos_token_id: int | None = None

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int] | None
    mm_features: Any  # opaque: list[MultiModalFeatureSpec] | None (tensors: refused)
    sampling_params: SamplingParams | None
    pooling_params: Any  # opaque: PoolingParams | None
    arrival_time: float
    lora_request: Any  # opaque: LoRARequest | None
    cache_salt: str | None
    data_parallel_rank: int | None
    prompt_embeds: Any = None  # opaque: torch.Tensor | None (refused)
    prompt_is_token_ids: list[bool] | None = None
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0
    trace_headers: Mapping[str, str] | None = None
    resumable: bool = False
    external_req_id: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    abort_immediately: bool = False
    session_id: str | None = None
    kv_hints: Any = None  # opaque: KvHintsEnvelope | None


class ReconfigureDistributedRequest(msgspec.Struct):
    """The argument of the `reinitialize_distributed` utility (a msgpack map)."""

    new_data_parallel_size: int
    new_data_parallel_rank: int
    new_data_parallel_rank_local: int
    new_data_parallel_master_ip: str
    new_data_parallel_master_port: int
    new_data_parallel_master_port_list: list[int]
    coord_store_port: int


# --- Outputs (engine -> frontend and coordinator) ---------------------------------------------------

class EngineCoreEvent(msgspec.Struct):
    """A timestamped (monotonic) request event."""

    type: EngineCoreEventType
    timestamp: float


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: None = None  # opaque: LogprobsLists (numpy)
    new_prompt_logprobs_tensors: None = None  # opaque: LogprobsTensors (torch)
    pooling_output: None = None  # opaque: torch.Tensor
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    events: list[EngineCoreEvent] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    trace_headers: Mapping[str, str] | None = None
    prefill_stats: None = None  # opaque: PrefillStats
    routed_experts: None = None  # opaque: np.ndarray
    num_nans_in_logits: int = 0
    mm_cache_miss_hashes: list[str] | None = None
    new_sampling_mask: None = None  # opaque: SamplingMaskLists (numpy)
    spec_decode_metrics: None = None  # opaque: RequestSpecDecodeMetrics
    prompt_token_id_logprobs: None = None  # opaque: torch.Tensor

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityOutput(msgspec.Struct, array_like=True, gc=False):
    call_id: int
    failure_message: str | None = None
    result: UtilityResult | None = None


@dataclass
class PrefixCacheStats:
    """`vllm.v1.metrics.stats.PrefixCacheStats` (with `BaseCacheStats`'s fields first)."""

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    hits_by_source: dict[CacheHitSource, int] = field(default_factory=dict)


@dataclass
class SchedulerStats:
    """Sent to the coordinator (request counts, wave) and with every step's outputs (a msgpack map)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_skipped_waiting_reqs: int = 0
    num_kv_fetch_reqs_by_stage: dict[str, int] = field(default_factory=dict)
    step_counter: int = 0
    current_wave: int = 0
    kv_cache_usage: float = 0.0
    iteration_details: None = None  # opaque: SchedulerIterationDetails
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    connector_prefix_cache_stats: PrefixCacheStats | None = None
    kv_cache_eviction_events: list[None] = field(default_factory=list)  # opaque: list[KVCacheEvictionEvent]
    spec_decoding_stats: None = None  # opaque: SpecDecodingStats
    kv_connector_stats: dict[str, Any] | None = None
    ec_connector_stats: dict[str, Any] | None = None
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    cudagraph_stats: None = None  # opaque: CUDAGraphStat
    perf_stats: None = None  # opaque: PerfStats


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: set[str] | None = None
    wave_complete: int | None = None
    start_wave: int | None = None
    weight_version: str | None = None

    def __post_init__(self) -> None:
        if self.timestamp == 0.0:
            self.timestamp = time.monotonic()


# --- What the drift test checks ---------------------------------------------------------------------

# Each mirror and the vLLM class it mirrors ("module:qualname").
VLLM_MIRRORS: dict[type, str] = {
    EEPNotificationType: "vllm.v1.engine:EEPNotificationType",
    FinishReason: "vllm.v1.engine:FinishReason",
    EngineCoreRequestType: "vllm.v1.engine:EngineCoreRequestType",
    ReconfigureRankType: "vllm.v1.engine:ReconfigureRankType",
    EngineCoreEventType: "vllm.v1.engine:EngineCoreEventType",
    UtilityResult: "vllm.v1.serial_utils:UtilityResult",
    CacheHitSource: "vllm.v1.metrics.cache_hit_source:CacheHitSource",
    EngineZmqAddresses: "vllm.v1.engine.utils:EngineZmqAddresses",
    EngineHandshakeMetadata: "vllm.v1.engine.utils:EngineHandshakeMetadata",
    EngineCoreReadyResponse: "vllm.v1.engine:EngineCoreReadyResponse",
    SamplingParams: "vllm.sampling_params:SamplingParams",
    EngineCoreRequest: "vllm.v1.engine:EngineCoreRequest",
    ReconfigureDistributedRequest: "vllm.v1.engine:ReconfigureDistributedRequest",
    EngineCoreEvent: "vllm.v1.engine:EngineCoreEvent",
    EngineCoreOutput: "vllm.v1.engine:EngineCoreOutput",
    UtilityOutput: "vllm.v1.engine:UtilityOutput",
    PrefixCacheStats: "vllm.v1.metrics.stats:PrefixCacheStats",
    SchedulerStats: "vllm.v1.metrics.stats:SchedulerStats",
    EngineCoreOutputs: "vllm.v1.engine:EngineCoreOutputs",
}

# Mirrors with only some of vLLM's fields (map-encoded types only).
PARTIAL_MIRRORS: frozenset[type] = frozenset({SamplingParams})

# Fields whose vLLM type the emulator does not model (see the module docstring).
OPAQUE_FIELDS: dict[type, frozenset[str]] = {
    EngineCoreReadyResponse: frozenset({"kv_events_config"}),
    EngineCoreRequest: frozenset({"mm_features", "pooling_params", "lora_request", "prompt_embeds", "kv_hints"}),
    EngineCoreOutput: frozenset({
        "new_logprobs", "new_prompt_logprobs_tensors", "pooling_output", "prefill_stats", "routed_experts",
        "new_sampling_mask", "spec_decode_metrics", "prompt_token_id_logprobs",
    }),
    SchedulerStats: frozenset({
        "iteration_details", "kv_cache_eviction_events", "spec_decoding_stats", "cudagraph_stats", "perf_stats",
    }),
}
