# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.32.0's `MsgpackEncoder` / `MsgpackDecoder` (`vllm/v1/serial_utils.py`) for what the emulator sends and
receives: msgspec's msgpack plus vLLM's hooks for `UtilityResult`, and nothing that needs torch or numpy.

Same bytes as vLLM for every message the emulator exchanges (`tests/unit/test_emulator_mirror.py`
encodes them with both and compares):

* `UtilityResult` is written as `(None, result)`, or with `VLLM_ALLOW_INSECURE_SERIALIZATION=1` as
  `(type info, result)`, exactly as vLLM's `enc_hook` writes it; `slice` as a `(start, stop, step)` tuple;
* a message is one frame: the emulator sends no tensors, so there are no out-of-band buffers.

Not supported, and refused loudly rather than decoded wrong: torch tensors, numpy arrays and multimodal
items (the `CUSTOM_TYPE_RAW_VIEW` extension inline, or out-of-band buffers in extra frames), and the
pickle / cloudpickle extensions of `VLLM_ALLOW_INSECURE_SERIALIZATION`. Encoding them raises
TypeError, receiving them NotImplementedError (the input thread logs the undecodable message).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import zmq
from msgspec import msgpack

from corefleet_harness.emulator.structs import UtilityResult

# vllm/v1/serial_utils.py: the msgpack extension codes vLLM's encoder writes.
CUSTOM_TYPE_PICKLE = 1
CUSTOM_TYPE_CLOUDPICKLE = 2
CUSTOM_TYPE_RAW_VIEW = 3

# vllm/envs.py: VLLM_ALLOW_INSECURE_SERIALIZATION = bool(int(os.getenv(..., "0"))), read on every use.
ENV_ALLOW_INSECURE_SERIALIZATION = "VLLM_ALLOW_INSECURE_SERIALIZATION"

Bytestr = bytes | bytearray | memoryview | zmq.Frame


def allow_insecure_serialization() -> bool:
    return bool(int(os.getenv(ENV_ALLOW_INSECURE_SERIALIZATION, "0")))


def _typestr(val: Any) -> tuple[str, str] | None:
    if val is None:
        return None
    t = type(val)
    return t.__module__, t.__qualname__


def _encode_type_info_recursive(obj: Any) -> Any:
    """vLLM's type info for a utility result (insecure serialization only): lists and dicts recursively."""
    if obj is None:
        return None
    if type(obj) is list:
        return [_encode_type_info_recursive(item) for item in obj]
    if type(obj) is dict:
        return {k: _encode_type_info_recursive(v) for k, v in obj.items()}
    return _typestr(obj)


class MsgpackEncoder:
    """`vllm.v1.serial_utils.MsgpackEncoder` without tensors: `encode` returns the frames to send (always one)."""

    def __init__(self) -> None:
        self.encoder = msgpack.Encoder(enc_hook=self.enc_hook)

    def encode(self, obj: Any) -> Sequence[Bytestr]:
        return [self.encoder.encode(obj)]

    def enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, slice):
            return tuple(int(v) if v is not None else None for v in (obj.start, obj.stop, obj.step))
        if isinstance(obj, UtilityResult):
            result = obj.result
            if not allow_insecure_serialization():
                return None, result
            return _encode_type_info_recursive(result), result
        raise TypeError(f"Object of type {type(obj)} is not serializable by the engine emulator (vLLM's encoder "
                        "would write tensors, arrays and multimodal items, or pickle it with "
                        f"{ENV_ALLOW_INSECURE_SERIALIZATION}=1; the emulator sends none of these)")


class MsgpackDecoder:
    """`vllm.v1.serial_utils.MsgpackDecoder(t)` for messages without tensors (refused, see the module docstring)."""

    def __init__(self, t: Any | None = None) -> None:
        args = () if t is None else (t,)
        self.decoder = msgpack.Decoder(*args, ext_hook=self.ext_hook, dec_hook=self.dec_hook)

    def decode(self, bufs: Bytestr | Sequence[Bytestr]) -> Any:
        if isinstance(bufs, (bytes, bytearray, memoryview, zmq.Frame)):
            frame: Any = bufs  # a zmq.Frame is a buffer too
        elif len(bufs) > 1:
            raise NotImplementedError(
                f"the message carries {len(bufs) - 1} out-of-band buffer(s) (tensors or arrays): "
                "the engine emulator does not decode tensors")
        else:
            frame = bufs[0]
        return self.decoder.decode(frame)

    def dec_hook(self, t: type, obj: Any) -> Any:
        if t is slice:
            return slice(*obj)
        if t is UtilityResult:
            result_type, result = obj
            if result_type is not None:
                raise NotImplementedError("typed utility results (insecure serialization) are not decoded by the "
                                          "engine emulator")
            return UtilityResult(result)
        return obj

    def ext_hook(self, code: int, data: memoryview) -> Any:
        if code == CUSTOM_TYPE_RAW_VIEW:
            raise NotImplementedError("the message carries an inline tensor or array (msgpack extension "
                                      f"{CUSTOM_TYPE_RAW_VIEW}): the engine emulator does not decode tensors")
        raise NotImplementedError(f"Extension type code {code} is not supported by the engine emulator (pickled "
                                  f"objects need {ENV_ALLOW_INSECURE_SERIALIZATION}=1 and vLLM itself)")
