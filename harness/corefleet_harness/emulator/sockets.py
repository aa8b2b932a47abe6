# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.32.0's `make_zmq_socket` (`vllm/utils/network_utils.py`), for the emulator's engine sockets.

The same options on the same socket types: unlimited high-water marks and 0.5 GiB kernel buffers on
hosts with memory to spare (`_get_zmq_socket_buffer_size`), identity, linger, IPv6 for an IPv6 TCP
address, bind unless the type connects by default. Inherited listeners (`listener=`) are left out: the
emulator's engine connects every socket. `tests/unit/test_emulator_mirror.py` compares the options
with vLLM's own sockets.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from typing import Any

import psutil  # a vLLM dependency
import zmq

_ZMQ_LARGE_BUFFER_SIZE = 512 * 1024**2
_ZMQ_LARGE_BUFFER_MIN_TOTAL_MEMORY = 32 * 1024**3
_ZMQ_LARGE_BUFFER_MIN_AVAILABLE_MEMORY = 16 * 1024**3


def zmq_socket_buffer_size() -> int:
    """`_get_zmq_socket_buffer_size`: 0.5 GiB with > 32 GiB total and > 16 GiB available memory, else -1."""
    mem = psutil.virtual_memory()
    if mem.total > _ZMQ_LARGE_BUFFER_MIN_TOTAL_MEMORY and mem.available > _ZMQ_LARGE_BUFFER_MIN_AVAILABLE_MEMORY:
        return _ZMQ_LARGE_BUFFER_SIZE
    return -1


def is_valid_ipv6_address(address: str) -> bool:
    try:
        ipaddress.IPv6Address(address)
        return True
    except ValueError:
        return False


def zmq_path_scheme_and_host(path: str) -> tuple[str, str]:
    """`split_zmq_path`'s scheme and host (brackets of an IPv6 host removed)."""
    parsed = urllib.parse.urlsplit(path)
    if not parsed.scheme:
        raise ValueError(f"Invalid zmq path: {path}")
    return parsed.scheme, parsed.hostname or ""


def make_zmq_socket(ctx: zmq.Context[Any], path: str, socket_type: int, bind: bool | None = None,
                    identity: bytes | None = None, linger: int | None = None,
                    router_handover: bool = False) -> zmq.Socket[Any]:
    """A ZMQ socket with vLLM's options, bound or connected to `path`."""
    socket: zmq.Socket[Any] = ctx.socket(socket_type)
    buf_size = zmq_socket_buffer_size()
    if bind is None:
        bind = socket_type not in (zmq.PUSH, zmq.SUB, zmq.XSUB)
    if socket_type in (zmq.PULL, zmq.DEALER, zmq.ROUTER):
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.RCVBUF, buf_size)
    if socket_type in (zmq.PUSH, zmq.DEALER, zmq.ROUTER):
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.SNDBUF, buf_size)
    if socket_type == zmq.ROUTER and router_handover:
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
    if identity is not None:
        socket.setsockopt(zmq.IDENTITY, identity)
    if linger is not None:
        socket.setsockopt(zmq.LINGER, linger)
    if socket_type == zmq.XPUB:
        socket.setsockopt(zmq.XPUB_VERBOSE, True)
    scheme, host = zmq_path_scheme_and_host(path)
    if scheme == "tcp" and is_valid_ipv6_address(host):
        socket.setsockopt(zmq.IPV6, 1)
    if bind:
        socket.bind(path)
    else:
        socket.connect(path)
    return socket
