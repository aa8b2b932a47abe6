# SPDX-License-Identifier: Apache-2.0
"""Driving the engine emulator's request handling without sockets, in unit tests: what it puts on its output
queue, as the frontend decodes it."""

from __future__ import annotations

import queue
from typing import Any

from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequestType
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from corefleet_harness.emulator.engine import EmulatedEngineCore

FRONTEND_DECODER = MsgpackDecoder(EngineCoreOutputs)  # AsyncMPClient / DPCoordinatorProc


def roundtrip_outputs(outputs: EngineCoreOutputs) -> EngineCoreOutputs:
    """Engine side (`process_output_sockets`: MsgpackEncoder) -> frontend side (MsgpackDecoder)."""
    decoded: EngineCoreOutputs = FRONTEND_DECODER.decode(MsgpackEncoder().encode(outputs))
    return decoded


def drain(engine: EmulatedEngineCore) -> list[tuple[int, EngineCoreOutputs]]:
    """Everything on the engine's output queue now: (client index, outputs)."""
    items = []
    while True:
        try:
            item = engine.output_queue.get_nowait()
        except queue.Empty:
            return items
        assert not isinstance(item, bytes)
        items.append(item)


def utility(engine: EmulatedEngineCore, method: str, *args: Any) -> Any:
    """One utility call as the frontend sends it (client 0); its UtilityOutput as the frontend decodes it."""
    engine._handle_client_request(EngineCoreRequestType.UTILITY, (0, 9, method, list(args)))
    ((client, out),) = drain(engine)
    assert client == 0
    assert out.utility_output is not None
    return roundtrip_outputs(out).utility_output
