# SPDX-License-Identifier: Apache-2.0
"""corefleet_client.vllm_compat's changes that can be shown without an engine."""

from __future__ import annotations

import asyncio
from typing import Any

from corefleet_client import vllm_compat


class AlwaysReady:
    """A socket with a message always waiting: pyzmq then hands back a completed future."""

    def __init__(self) -> None:
        self.closed = False

    def recv_multipart(self, copy: bool = True) -> asyncio.Future[list[bytes]]:
        future: asyncio.Future[list[bytes]] = asyncio.get_running_loop().create_future()
        future.set_result([b"frame"])
        return future

    def close(self, linger: int = 0) -> None:
        self.closed = True


def reader_starves_others(socket: Any) -> bool:
    """Run a reader loop over `socket` next to another task: does the other task get to run?"""
    async def main() -> bool:
        ran = asyncio.Event()

        async def reader() -> None:
            for _ in range(1000):
                await socket.recv_multipart(copy=False)

        async def other() -> None:
            ran.set()

        reading = asyncio.create_task(reader())
        helper = asyncio.create_task(other())
        await asyncio.sleep(0)  # both are scheduled; the reader runs first
        ran_before_reader_finished = ran.is_set() and not reading.done()
        await reading
        await helper
        return not ran_before_reader_finished

    return asyncio.run(main())


def test_a_reader_of_a_busy_socket_starves_the_loop_and_the_yielding_socket_does_not() -> None:
    assert reader_starves_others(AlwaysReady())  # why change 7 exists
    assert not reader_starves_others(vllm_compat.YieldingSocket(AlwaysReady()))


def test_yielding_output_socket_is_seen_only_by_the_task_created_inside() -> None:
    class Resources:
        output_socket: Any = AlwaysReady()

    resources = Resources()
    real = resources.output_socket
    with vllm_compat.yielding_output_socket(resources):
        seen = resources.output_socket
        assert isinstance(seen, vllm_compat.YieldingSocket)
        seen.close()  # anything but recv_multipart reaches the real socket
    assert resources.output_socket is real
    assert real.closed
