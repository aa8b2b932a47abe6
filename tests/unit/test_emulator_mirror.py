# SPDX-License-Identifier: Apache-2.0
"""The engine emulator's own copies of vLLM's wire types and serializers are vLLM 0.32.0's, exactly.

The emulator imports neither vLLM nor torch (`corefleet_harness.emulator.structs`, `serial`, `sockets`,
`parallel_hash`); these tests import both and compare, so that a change of the pinned vLLM fails here
instead of letting the emulator drift:

1. every mirrored class against vLLM's: kind, struct or dataclass config, field names and order,
   required-ness, defaults, types (nested types by the vLLM class they mirror), enum members;
2. representative messages encoded by both serializers to the same bytes, and each side decoding the
   other's; what the emulator does not support (tensors, pickles) refused loudly;
3. the socket options of `make_zmq_socket`;
4. READY's parallel-config hash against vLLM's own `ParallelConfig` for a grid of flags, factor by factor;
5. the emulator package importing neither vLLM nor torch.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import json
import sys
import time
import types
from typing import Any, cast, get_args

import msgspec
import msgspec.inspect as mi
import numpy as np
import pytest
import torch
import vllm.config.utils
import vllm.distributed.nixl_utils
import zmq
from vllm.config import ParallelConfig
from vllm.config.parallel import EPLBCommunicatorBackend, EPLBConfig, EPLBPolicyOption
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils import network_utils
from vllm.v1 import engine as vllm_engine
from vllm.v1 import serial_utils
from vllm.v1.engine.utils import EngineHandshakeMetadata, EngineZmqAddresses
from vllm.v1.metrics import stats as vllm_stats
from vllm.version import __version__ as vllm_version

from corefleet_client.vllm_compat import set_eplb_as_on_a_gpu
from corefleet_harness.emulator import parallel_hash, serial, sockets, structs, wire
from corefleet_harness.emulator.config import EmulatorConfig
from corefleet_harness.emulator.engine import EmulatedEngineCore
from emulated import drain, roundtrip_outputs

MIRRORS = sorted(structs.VLLM_MIRRORS.items(), key=lambda item: item[1])


def vllm_class(path: str) -> Any:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


# ---- 1. The mirrored classes -----------------------------------------------------------------------


def test_every_class_in_structs_mirrors_a_vllm_class() -> None:
    defined = {obj for obj in vars(structs).values() if isinstance(obj, type) and obj.__module__ == structs.__name__}
    assert defined == set(structs.VLLM_MIRRORS)
    for path in structs.VLLM_MIRRORS.values():
        assert class_path(vllm_class(path)) == path  # named where vLLM defines it
    assert set(structs.VLLM_MIRRORS) >= structs.PARTIAL_MIRRORS
    assert set(structs.OPAQUE_FIELDS) <= set(structs.VLLM_MIRRORS)


def kind(cls: type) -> str:
    if issubclass(cls, enum.Enum):
        return "enum"
    if issubclass(cls, msgspec.Struct):
        return "struct"
    if dataclasses.is_dataclass(cls):
        return "dataclass"
    return "class"


def class_fields(cls: type) -> tuple[mi.Field, ...]:
    """A struct's or a dataclass's fields, as msgspec sees them."""
    return cast("mi.StructType | mi.DataclassType", mi.type_info(cls)).fields


def shape(t: Any, mirrored: bool) -> Any:
    """A msgspec type, comparable across the two sides: classes by the vLLM class they are (or mirror)."""
    if isinstance(t, (mi.StructType, mi.DataclassType, mi.EnumType, mi.CustomType, mi.NamedTupleType,
                      mi.TypedDictType)):
        return ("class", structs.VLLM_MIRRORS.get(t.cls, f"not mirrored: {t.cls}") if mirrored else class_path(t.cls))
    if isinstance(t, mi.Type):
        return (type(t).__name__, tuple((name, shape(getattr(t, name), mirrored)) for name in t.__struct_fields__))
    if isinstance(t, tuple):
        return tuple(shape(x, mirrored) for x in t)
    return t


def default_of(f: mi.Field) -> Any:
    if f.default_factory is not msgspec.NODEFAULT:
        return ("factory", msgspec.to_builtins(f.default_factory()))
    return ("default", msgspec.to_builtins(f.default) if f.default is not msgspec.NODEFAULT else "required")


@pytest.mark.parametrize(("mirror", "path"), MIRRORS, ids=[path for _, path in MIRRORS])
def test_the_mirror_is_vllms_class(mirror: type, path: str) -> None:
    original = vllm_class(path)
    assert kind(mirror) == kind(original)
    if kind(mirror) == "enum":
        members = cast("type[enum.Enum]", mirror)  # kind() says so
        assert [(m.name, m.value, str(m)) for m in members] == [(m.name, m.value, str(m)) for m in original]
        assert [b.__name__ for b in mirror.__mro__[1:]] == [b.__name__ for b in original.__mro__[1:]]
        return
    if kind(mirror) == "class":  # UtilityResult: a plain wrapper with .result
        def params(cls: type[object]) -> list[tuple[str, Any]]:
            return [(p.name, p.default) for p in inspect.signature(cls.__init__).parameters.values()]

        assert params(mirror) == params(original)
        assert vars(mirror(5)) == vars(original(5))
        return
    if kind(mirror) == "struct":
        config_names = [n for n in dir(msgspec.structs.StructConfig) if not n.startswith("_")]
        struct_config = cast("type[msgspec.Struct]", mirror).__struct_config__  # kind() says so
        assert {n: getattr(struct_config, n) for n in config_names} == \
               {n: getattr(original.__struct_config__, n) for n in config_names}
    else:
        assert repr(mirror.__dataclass_params__) == repr(original.__dataclass_params__)  # type: ignore[attr-defined]

    mirror_fields = {f.name: f for f in class_fields(mirror)}
    original_fields = {f.name: f for f in class_fields(original)}
    if mirror in structs.PARTIAL_MIRRORS:
        assert not original.__struct_config__.array_like  # a subset only decodes right from a map
        assert set(mirror_fields) <= set(original_fields)
    else:
        assert list(mirror_fields) == list(original_fields)  # names and order
    opaque = structs.OPAQUE_FIELDS.get(mirror, frozenset())
    assert opaque <= set(mirror_fields)
    for name, f in mirror_fields.items():
        g = original_fields[name]
        assert (f.encode_name, f.required, default_of(f)) == (g.encode_name, g.required, default_of(g)), name
        if name not in opaque:
            assert shape(f.type, mirrored=True) == shape(g.type, mirrored=False), name


def test_constants_are_vllms() -> None:
    assert vllm_version == structs.VLLM_VERSION
    assert structs.EEP_NOTIFICATION_CALL_ID == vllm_engine.EEP_NOTIFICATION_CALL_ID
    assert structs.FINISH_REASON_STRINGS == vllm_engine.FINISH_REASON_STRINGS
    assert (serial.CUSTOM_TYPE_PICKLE, serial.CUSTOM_TYPE_CLOUDPICKLE, serial.CUSTOM_TYPE_RAW_VIEW) == (
        serial_utils.CUSTOM_TYPE_PICKLE, serial_utils.CUSTOM_TYPE_CLOUDPICKLE, serial_utils.CUSTOM_TYPE_RAW_VIEW)
    assert (sockets._ZMQ_LARGE_BUFFER_SIZE, sockets._ZMQ_LARGE_BUFFER_MIN_TOTAL_MEMORY,
            sockets._ZMQ_LARGE_BUFFER_MIN_AVAILABLE_MEMORY) == (
        network_utils._ZMQ_LARGE_BUFFER_SIZE, network_utils._ZMQ_LARGE_BUFFER_MIN_TOTAL_MEMORY,
        network_utils._ZMQ_LARGE_BUFFER_MIN_AVAILABLE_MEMORY)
    assert sockets.zmq_socket_buffer_size() == network_utils._get_zmq_socket_buffer_size()


# ---- 2. Messages: the same bytes both ways ---------------------------------------------------------

VLLM = types.SimpleNamespace(
    **{name: getattr(vllm_engine, name) for name in (
        "EngineCoreOutputs", "EngineCoreOutput", "EngineCoreEvent", "EngineCoreEventType", "FinishReason",
        "UtilityOutput", "EngineCoreRequest", "ReconfigureDistributedRequest", "EngineCoreReadyResponse")},
    SchedulerStats=vllm_stats.SchedulerStats, PrefixCacheStats=vllm_stats.PrefixCacheStats,
    UtilityResult=serial_utils.UtilityResult, SamplingParams=SamplingParams,
    EngineZmqAddresses=EngineZmqAddresses, EngineHandshakeMetadata=EngineHandshakeMetadata,
)


def outputs_messages(ns: Any) -> list[Any]:
    """EngineCoreOutputs of every shape the emulator sends, built from `ns` (vLLM's classes or the mirrors)."""
    events = [ns.EngineCoreEvent(ns.EngineCoreEventType.QUEUED, 1.5),
              ns.EngineCoreEvent(ns.EngineCoreEventType.SCHEDULED, 2.25)]
    outs = ns.EngineCoreOutputs
    return [
        outs(engine_index=3, timestamp=12.5, outputs=[
            ns.EngineCoreOutput("r1", [5, 6], finish_reason=None, stop_reason=None, events=events),
            ns.EngineCoreOutput("r2", [7], finish_reason=ns.FinishReason.STOP, stop_reason=7),
            ns.EngineCoreOutput("r3", [8], finish_reason=ns.FinishReason.LENGTH, stop_reason="</s>"),
        ], finished_requests={"r2"}, scheduler_stats=ns.SchedulerStats(2, 1, kv_cache_usage=0.25)),
        outs(finished_requests=["x", "y"], timestamp=1.0,
             outputs=[ns.EngineCoreOutput(r, [], finish_reason=ns.FinishReason.ABORT) for r in ("x", "y")]),
        outs(finished_requests=["e"], timestamp=1.0, outputs=[ns.EngineCoreOutput("e", [], finish_reason=3)]),
        outs(timestamp=2.0, utility_output=ns.UtilityOutput(123, result=ns.UtilityResult(("generate",)))),
        outs(timestamp=2.0, utility_output=ns.UtilityOutput(2**64 - 1, result=ns.UtilityResult(None))),
        outs(timestamp=2.0, utility_output=ns.UtilityOutput(5, result=ns.UtilityResult(
            [{"group_idx": 0, "kind": "full_attention", "block_size": 16, "sliding_window": None}]))),
        outs(timestamp=2.0, utility_output=ns.UtilityOutput(6, result=ns.UtilityResult({"a": [1, 2.5, True]}))),
        outs(timestamp=2.0, utility_output=ns.UtilityOutput(7, failure_message="Call to x method failed: no")),
        outs(engine_index=2, timestamp=3.0, utility_output=ns.UtilityOutput(
            -1, result=ns.UtilityResult(("RECONFIGURE_FINISHED", 2)))),
        outs(timestamp=4.0, scheduler_stats=ns.SchedulerStats(3, 5, kv_cache_usage=0.5, step_counter=7,
                                                                current_wave=2)),
        outs(timestamp=5.0, wave_complete=4),
        outs(timestamp=5.0, start_wave=5),
        outs(timestamp=5.0, weight_version="v2", outputs=[ns.EngineCoreOutput("w", [1], num_nans_in_logits=1,
                                                                              mm_cache_miss_hashes=["h"])]),
    ]


def frames(bufs: Any) -> list[bytes]:
    return [bytes(b) for b in bufs]


def plain(obj: Any) -> Any:
    """A message as JSON values, comparable across the two sides (sets sorted, utility results unwrapped)."""
    def unwrap(value: Any) -> Any:
        if isinstance(value, (structs.UtilityResult, serial_utils.UtilityResult)):
            return {"utility_result": value.result}
        raise TypeError(type(value))

    return msgspec.json.decode(msgspec.json.encode(obj, enc_hook=unwrap, order="deterministic"))


@pytest.mark.parametrize("insecure", ["0", "1"])
def test_outputs_encode_to_vllms_bytes_and_decode_both_ways(insecure: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", insecure)
    vllm_encoder = serial_utils.MsgpackEncoder()
    vllm_decoder = serial_utils.MsgpackDecoder(vllm_engine.EngineCoreOutputs)
    emulator_encoder, emulator_decoder = serial.MsgpackEncoder(), serial.MsgpackDecoder(structs.EngineCoreOutputs)
    for ours, theirs in zip(outputs_messages(structs), outputs_messages(VLLM), strict=True):
        sent = frames(emulator_encoder.encode(ours))
        assert sent == frames(vllm_encoder.encode(theirs)), theirs
        if insecure == "1":
            continue  # typed utility results: the frontend decodes them (below, with it off); the engine never does
        assert plain(vllm_decoder.decode(sent)) == plain(theirs)  # the frontend reads what the emulator sent ...
        assert plain(emulator_decoder.decode(frames(vllm_encoder.encode(theirs)))) == plain(ours)  # ... and back


def test_a_fresh_outputs_timestamp_is_monotonic_as_in_vllm() -> None:
    before = time.monotonic()
    assert before <= structs.EngineCoreOutputs().timestamp <= time.monotonic()
    assert structs.EngineCoreOutputs(timestamp=7.0).timestamp == 7.0


def vllm_request(**overrides: Any) -> Any:
    params = SamplingParams.from_optional(max_tokens=7, stop_token_ids=[77, 78], temperature=0.5, seed=3)
    params.update_from_generation_config({"eos_token_id": [2, 9]}, eos_token_id=2)
    fields: dict[str, Any] = dict(
        request_id="req-1-abcd", prompt_token_ids=[9, 8, 7], mm_features=None, sampling_params=params,
        pooling_params=None, arrival_time=1234.5, lora_request=None, cache_salt="salt", data_parallel_rank=1,
        prompt_embeds=None, client_index=2, current_wave=5, priority=-1, trace_headers={"traceparent": "00-x"},
        external_req_id="req-1", reasoning_ended=False, reasoning_parser_kwargs={"k": 1}, session_id="s",
    )
    return vllm_engine.EngineCoreRequest(**{**fields, **overrides})


def assert_same_request(ours: structs.EngineCoreRequest, theirs: Any) -> None:
    for name in ours.__struct_fields__:
        if name in structs.OPAQUE_FIELDS[structs.EngineCoreRequest]:
            continue
        if name == "sampling_params" and theirs.sampling_params is not None:
            for param in structs.SamplingParams.__struct_fields__:
                assert getattr(ours.sampling_params, param) == getattr(theirs.sampling_params, param), param
            assert ours.sampling_params is not None
            assert ours.sampling_params.eos_token_id == theirs.sampling_params.eos_token_id
            continue
        assert getattr(ours, name) == getattr(theirs, name), name


def test_requests_decode_both_ways() -> None:
    vllm_encoder, emulator_encoder = serial_utils.MsgpackEncoder(), serial.MsgpackEncoder()
    ours_decoder = serial.MsgpackDecoder(structs.EngineCoreRequest)
    theirs_decoder = serial_utils.MsgpackDecoder(vllm_engine.EngineCoreRequest)
    lora = LoRARequest("adapter", 1, "/tmp/adapter")
    for theirs in (vllm_request(), vllm_request(sampling_params=None, prompt_token_ids=None),
                   vllm_request(lora_request=lora, resumable=True, abort_immediately=True, prompt_is_token_ids=[True])):
        ours = ours_decoder.decode(vllm_encoder.encode(theirs))
        assert isinstance(ours, structs.EngineCoreRequest)
        assert_same_request(ours, theirs)
        again = theirs_decoder.decode(emulator_encoder.encode(ours))  # and back, opaque fields included
        assert_same_request(ours, again)
        assert again.lora_request == theirs.lora_request


def test_handshake_ready_response_and_reconfigure_are_vllms_bytes() -> None:
    addresses: dict[str, Any] = dict(inputs=["tcp://10.0.0.1:4001"],
                                     outputs=["tcp://10.0.0.1:4002", "tcp://10.0.0.1:4003"],
                                     coordinator_input="tcp://10.0.0.2:29553", coordinator_output=None)
    config: dict[str, Any] = {"data_parallel_size": 4, "data_parallel_master_ip": "10.0.0.1",
                              "_data_parallel_master_port_list": [1, 2]}
    theirs = msgspec.msgpack.encode(EngineHandshakeMetadata(EngineZmqAddresses(**addresses), config))
    ours = msgspec.msgpack.encode(structs.EngineHandshakeMetadata(structs.EngineZmqAddresses(**addresses), config))
    assert ours == theirs
    assert msgspec.msgpack.decode(ours, type=EngineHandshakeMetadata) == EngineHandshakeMetadata(
        EngineZmqAddresses(**addresses), config)

    cfg = EmulatorConfig(rank=3, data_parallel_size=4, is_moe=True, max_model_len=300, instance_id="i")
    response = wire.make_ready_response(cfg, "tcp://10.0.0.2:29551")
    theirs_response = vllm_engine.EngineCoreReadyResponse(**dataclasses.asdict(response))
    assert wire.encode_ready_response(response) == msgspec.msgpack.encode(theirs_response)

    values = (3, -1, -2, "10.0.0.1", 5000, [1, 2], 6000)
    reconfig = msgspec.msgpack.encode(vllm_engine.ReconfigureDistributedRequest(*values))
    assert msgspec.msgpack.encode(structs.ReconfigureDistributedRequest(*values)) == reconfig
    assert msgspec.msgpack.decode(reconfig, type=structs.ReconfigureDistributedRequest) == \
           structs.ReconfigureDistributedRequest(*values)


def test_untyped_inputs_decode_as_vllms_generic_decoder_does() -> None:
    encoder = serial_utils.MsgpackEncoder()
    reconfig = vllm_engine.ReconfigureDistributedRequest(3, -1, -1, "h", 1, [2], 3)
    body: Any
    for body in ((0, 2**63 + 5, "reinitialize_distributed", (reconfig,)), (1, 7, "sleep", (1, "wait")),
                 ["a", "b"], (7, 1), (0, 1, "collective_rpc", ("m", None, (slice(1, 5),), {}))):
        bufs = encoder.encode(body)
        assert serial.MsgpackDecoder().decode(bufs) == serial_utils.MsgpackDecoder().decode(bufs)


def test_tensors_and_pickles_are_refused_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    encoder = serial_utils.MsgpackEncoder()
    decoder = serial.MsgpackDecoder(structs.EngineCoreRequest)
    small = encoder.encode(vllm_request(prompt_embeds=torch.zeros(2, 2)))  # inline (CUSTOM_TYPE_RAW_VIEW)
    assert len(small) == 1
    with pytest.raises(NotImplementedError, match="inline tensor"):
        decoder.decode(small)
    large = encoder.encode(vllm_request(prompt_embeds=torch.zeros(64, 64)))  # an out-of-band frame
    assert len(large) == 2
    with pytest.raises(NotImplementedError, match="out-of-band"):
        decoder.decode(large)
    with pytest.raises(NotImplementedError, match="inline tensor"):
        serial.MsgpackDecoder().decode(encoder.encode((0, 1, "m", (np.zeros(3),))))
    with pytest.raises(TypeError, match="not serializable by the engine emulator"):
        serial.MsgpackEncoder().encode(structs.UtilityOutput(1, result=structs.UtilityResult(np.zeros(2))))
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    pickled = serial_utils.MsgpackEncoder().encode((0, 1, "m", (Exception("x"),)))
    with pytest.raises(NotImplementedError, match="Extension type code 1"):
        serial.MsgpackDecoder().decode(pickled)
    # An ADD with multimodal features decodes, and the engine answers it with an error (wire.UnsupportedRequest).
    request = structs.EngineCoreRequest("mm", [1], [{"modality": "image"}], None, None, 0.0, None, None, None)
    add = [structs.EngineCoreRequestType.ADD.value, *frames(serial.MsgpackEncoder().encode(request))]
    with pytest.raises(wire.UnsupportedRequest, match="mm_features") as unsupported:
        wire.InputDecoder().decode(add)
    assert unsupported.value.request.request_id == "mm"
    engine = EmulatedEngineCore(EmulatorConfig())
    assert engine._decode_input(wire.InputDecoder(), add) is None
    ((client, out),) = drain(engine)
    failed = roundtrip_outputs(out)
    assert client == 0
    assert [(o.request_id, o.finish_reason) for o in failed.outputs] == [("mm", vllm_engine.FinishReason.ERROR)]
    assert engine._decode_input(wire.InputDecoder(), [add[0], *small]) is None  # a tensor: logged, not queued
    assert drain(engine) == []
    assert engine.input_queue.empty()


# ---- 3. Sockets ------------------------------------------------------------------------------------

SOCKET_OPTIONS = (zmq.RCVHWM, zmq.SNDHWM, zmq.RCVBUF, zmq.SNDBUF, zmq.IDENTITY, zmq.LINGER, zmq.IPV6)


def options(sock: zmq.Socket[Any]) -> dict[int, Any]:
    return {opt: sock.getsockopt(opt) for opt in SOCKET_OPTIONS}


@pytest.mark.parametrize(("socket_type", "path", "kwargs"), [
    (zmq.DEALER, "tcp://127.0.0.1:1", {"identity": b"\x01\x00", "linger": 5000, "bind": False}),
    (zmq.DEALER, "tcp://[::1]:1", {"identity": b"\x02\x00", "bind": False}),
    (zmq.XSUB, "tcp://10.1.2.3:1", {"identity": b"\x03\x00"}),
    (zmq.PUSH, "tcp://localhost:1", {"linger": 4000}),
    (zmq.PUSH, "ipc:///tmp/corefleet-emulator-mirror-test", {}),
])
def test_sockets_have_vllms_options(socket_type: int, path: str, kwargs: dict[str, Any]) -> None:
    with zmq.Context() as ctx:
        ours = sockets.make_zmq_socket(ctx, path, socket_type, **kwargs)
        theirs = network_utils.make_zmq_socket(ctx, path, socket_type, **kwargs)
        try:
            assert options(ours) == options(theirs)
        finally:
            ours.close(linger=0)
            theirs.close(linger=0)


# ---- 4. The parallel-config hash -------------------------------------------------------------------


def vllm_parallel_config_hash(cfg: EmulatorConfig) -> str | None:
    """What the emulator computed with vLLM's own ParallelConfig before it mirrored the hash: the reference."""
    if cfg.parallel_config_hash is not None:
        return cfg.parallel_config_hash
    if not cfg.coordinated_dp:
        return None
    kwargs: dict[str, Any] = dict(
        data_parallel_size=cfg.data_parallel_size, tensor_parallel_size=cfg.tensor_parallel_size,
        pipeline_parallel_size=cfg.pipeline_parallel_size,
        decode_context_parallel_size=cfg.decode_context_parallel_size,
        is_moe_model=cfg.is_moe, enable_expert_parallel=cfg.enable_expert_parallel, enable_eplb=cfg.enable_eplb,
        enable_elastic_ep=cfg.enable_elastic_ep, dp_sync_interval=cfg.dp_sync_interval)
    if cfg.elastic_ep_max_dp_size is not None:
        kwargs["elastic_ep_max_dp_size"] = cfg.elastic_ep_max_dp_size
    if cfg.eplb_config:
        kwargs["eplb_config"] = EPLBConfig(**cfg.eplb_config)
    if cfg.disable_nccl_for_dp_synchronization is not None:
        kwargs["disable_nccl_for_dp_synchronization"] = cfg.disable_nccl_for_dp_synchronization
    try:
        return hash_as_vllm_config_would(ParallelConfig(**kwargs), cfg)
    except ValueError:
        pass
    # EPLB is refused off CUDA/ROCm/XPU: built without it, then set as ParallelConfig.__post_init__ sets it on a GPU.
    redundant = int(cfg.eplb_config.get("num_redundant_experts", 0))
    if redundant:
        kwargs["eplb_config"] = EPLBConfig(**{**cfg.eplb_config, "num_redundant_experts": 0})
    try:
        config = ParallelConfig(**{**kwargs, "enable_eplb": False, "enable_elastic_ep": False})
    except ValueError:
        return None
    set_eplb_as_on_a_gpu(config, enable_eplb=cfg.enable_eplb, enable_elastic_ep=cfg.enable_elastic_ep,
                         elastic_ep_max_dp_size=cfg.elastic_ep_max_dp_size, num_redundant_experts=redundant)
    return hash_as_vllm_config_would(config, cfg)


def hash_as_vllm_config_would(config: Any, cfg: EmulatorConfig) -> str:
    """The hashed fields `VllmConfig.__post_init__` fills in (vllm/config/vllm.py), then the hash."""
    config.set_dcp_defaults()
    if not config.enable_batch_sharded_sampling:
        config.enable_batch_sharded_sampling = False
    if config.disable_nccl_for_dp_synchronization is None:
        config.disable_nccl_for_dp_synchronization = cfg.async_scheduling
    return str(config.compute_hash())


MOE = EmulatorConfig(data_parallel_size=2, is_moe=True)
EP = dataclasses.replace(MOE, enable_expert_parallel=True)
EPLB = dataclasses.replace(EP, enable_eplb=True)
ELASTIC = dataclasses.replace(EPLB, enable_elastic_ep=True, elastic_ep_max_dp_size=4, eplb_config={"use_async": False})
HASH_GRID = [
    MOE, dataclasses.replace(MOE, data_parallel_size=3), dataclasses.replace(MOE, data_parallel_size=8),
    dataclasses.replace(MOE, tensor_parallel_size=2), dataclasses.replace(MOE, pipeline_parallel_size=2),
    dataclasses.replace(MOE, tensor_parallel_size=2, decode_context_parallel_size=2),
    dataclasses.replace(MOE, decode_context_parallel_size=2),  # tp % dcp: refused, no hash
    dataclasses.replace(MOE, tensor_parallel_size=0),  # refused
    EP, dataclasses.replace(EP, dp_sync_interval=8), dataclasses.replace(EP, async_scheduling=False),
    dataclasses.replace(EP, disable_nccl_for_dp_synchronization=True),
    dataclasses.replace(EP, async_scheduling=False, disable_nccl_for_dp_synchronization=False),
    EPLB, dataclasses.replace(EPLB, eplb_config={"num_redundant_experts": 2, "window_size": 10, "step_interval": 20}),
    dataclasses.replace(EPLB, eplb_config={"communicator": "torch_gloo", "log_balancedness": True,
                                           "log_balancedness_interval": 5, "enable_migration_batching": True}),
    dataclasses.replace(EPLB, eplb_config={"use_async": False, "communicator": "pynccl"}),
    ELASTIC, dataclasses.replace(ELASTIC, elastic_ep_max_dp_size=None), dataclasses.replace(ELASTIC, eplb_config={}),
    dataclasses.replace(ELASTIC, tensor_parallel_size=2, data_parallel_size=3,
                        eplb_config={"num_redundant_experts": 1}),
    dataclasses.replace(EP, enable_elastic_ep=True),  # elastic EP without EPLB
    dataclasses.replace(EP, elastic_ep_max_dp_size=6),  # a maximum without elastic EP: ignored
    dataclasses.replace(EPLB, enable_expert_parallel=False),
    dataclasses.replace(MOE, parallel_config_hash="given"),
    EmulatorConfig(data_parallel_size=2, is_moe=False), EmulatorConfig(data_parallel_size=1, is_moe=True),
]


@pytest.fixture
def vllm_factors(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The factors vLLM hashes, as JSON would write them (captured from `hash_factors`)."""
    captured: list[dict[str, Any]] = []
    original = vllm.config.utils.hash_factors

    def capture(items: dict[str, Any]) -> str:
        captured.append(json.loads(json.dumps(items)))
        digest: str = original(items)
        return digest

    monkeypatch.setattr(vllm.config.utils, "hash_factors", capture)
    return captured


@pytest.mark.parametrize("nixl", [False, True])
@pytest.mark.parametrize("cfg", HASH_GRID)
def test_the_parallel_config_hash_is_vllms(cfg: EmulatorConfig, nixl: bool, vllm_factors: list[dict[str, Any]],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm.distributed.nixl_utils, "is_nixl_available", lambda: nixl)
    monkeypatch.setattr(parallel_hash, "nixl_available", lambda: nixl)
    want = vllm_parallel_config_hash(cfg)
    if vllm_factors:
        assert parallel_hash.parallel_config_factors(cfg, nixl=nixl) == vllm_factors[-1]  # names a differing factor
    assert parallel_hash.compute_parallel_config_hash(cfg) == want


@pytest.mark.parametrize("eplb_config", [{"no_such_field": 1}, {"window_size": 0}, {"policy": "other"},
                                         {"communicator": "pynccl"}, {"communicator": "carrier-pigeon"},
                                         {"num_redundant_experts": -1}])
def test_an_eplb_config_vllm_refuses_fails_the_engine(eplb_config: dict[str, Any]) -> None:
    cfg = dataclasses.replace(EPLB, eplb_config=eplb_config)
    with pytest.raises(ValueError):  # noqa: PT011  # pydantic's ValidationError is a ValueError
        vllm_parallel_config_hash(cfg)
    with pytest.raises(ValueError):  # noqa: PT011
        parallel_hash.compute_parallel_config_hash(cfg)


def test_eplb_defaults_and_choices_are_vllms() -> None:
    assert dataclasses.asdict(EPLBConfig()) == parallel_hash.EPLB_DEFAULTS
    assert get_args(EPLBCommunicatorBackend) == parallel_hash.EPLB_COMMUNICATORS
    assert get_args(EPLBPolicyOption) == parallel_hash.EPLB_POLICIES


# ---- 5. No vLLM, no torch -------------------------------------------------------------------------


def test_the_emulator_imports_neither_vllm_nor_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Import every emulator module afresh with vLLM and torch made unimportable (None in sys.modules)."""
    for name in list(sys.modules):
        if name.split(".")[0] in ("vllm", "torch"):
            monkeypatch.setitem(sys.modules, name, None)
        elif name.startswith(("corefleet_harness", "corefleet_client")):
            monkeypatch.delitem(sys.modules, name)
    for module in ("engine", "__main__", "wire", "structs", "serial", "sockets", "parallel_hash", "store",
                   "scheduler", "config", "health"):
        importlib.import_module(f"corefleet_harness.emulator.{module}")
    fresh = sys.modules["corefleet_harness.emulator.parallel_hash"]
    assert fresh.compute_parallel_config_hash(MOE) == parallel_hash.compute_parallel_config_hash(MOE)
