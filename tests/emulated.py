# SPDX-License-Identifier: Apache-2.0
"""Driving the engine emulator's request handling without sockets, in unit tests: what it puts on its output
queue, as the frontend decodes it, and utility calls as the frontend encodes them. Each side is the real
one: vLLM's encoder and decoder for the frontend, the emulator's (`corefleet_harness.emulator.serial`) for
the engine."""

from __future__ import annotations

import queue
from typing import Any

from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequestType
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from corefleet_harness.emulator import wire
from corefleet_harness.emulator.engine import EmulatedEngineCore

FRONTEND_DECODER = MsgpackDecoder(EngineCoreOutputs)  # AsyncMPClient / DPCoordinatorProc
FRONTEND_ENCODER = MsgpackEncoder()  # MPClient.encoder


def roundtrip_outputs(outputs: Any) -> EngineCoreOutputs:
    """Engine side (`process_output_sockets`: the emulator's MsgpackEncoder) -> frontend (vLLM's MsgpackDecoder)."""
    decoded: EngineCoreOutputs = FRONTEND_DECODER.decode(wire.MsgpackEncoder().encode(outputs))
    return decoded


def drain(engine: EmulatedEngineCore) -> list[tuple[int, EngineCoreOutputs]]:
    """Everything on the engine's output queue now: (client index, outputs)."""
    items: list[tuple[int, EngineCoreOutputs]] = []
    while True:
        try:
            item = engine.output_queue.get_nowait()
        except queue.Empty:
            return items
        assert not isinstance(item, bytes)
        items.append(item)


def utility(engine: EmulatedEngineCore, method: str, *args: Any) -> Any:
    """One utility call as the frontend sends it (client 0: `_call_utility_async`, encoded by vLLM, decoded by the
    engine's input decoder); its UtilityOutput as the frontend decodes it."""
    frames = [EngineCoreRequestType.UTILITY.value, *(bytes(b) for b in FRONTEND_ENCODER.encode((0, 9, method, args)))]
    decoded = wire.InputDecoder().decode(frames)
    assert decoded is not None
    engine._handle_client_request(*decoded)
    ((client, out),) = drain(engine)
    assert client == 0
    assert out.utility_output is not None
    return roundtrip_outputs(out).utility_output
