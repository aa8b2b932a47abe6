# SPDX-License-Identifier: Apache-2.0
"""The real standalone coordinator process, driven at the wire level as vLLM 0.32.0's engines and frontend do.

Roles played here with pyzmq (frames as in vllm/v1/engine/core.py and core_client.py):

* engines: an XSUB (identity = rank, 2 bytes little-endian) connected to back publish that sends
  `b"\\x01"` and waits for `b"READY"` (`EngineCoreProc.process_input_sockets`), and a PUSH to back
  output carrying `EngineCoreOutputs(engine_index, scheduler_stats=SchedulerStats(running, waiting,
  kv_cache_usage=...))` encoded by vLLM's MsgpackEncoder (`process_output_sockets`, client_index -1);
* frontend: an XSUB connected to front publish that sends `b"\\x01"` and decodes
  `(counts, current_wave, engines_running)` (`DPAsyncMPClient._ensure_stats_update_task`), and sends
  the wave-start notification `msgpack((engine_index, current_wave))` up the same socket.

Each coordinator start imports vLLM (about 10 s), so the protocol and shutdown run in one test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from corefleet_harness.support import free_ports

pytestmark = pytest.mark.e2e

STARTUP_TIMEOUT = 180.0  # importing vLLM on a busy 2-core CI machine
STEP_TIMEOUT = 10.0
EXIT_TIMEOUT = 15.0


@pytest.fixture(scope="module")
def vllm_wire() -> SimpleNamespace:
    """vLLM's own wire types, imported when the tests run rather than at collection."""
    from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequestType
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackEncoder

    return SimpleNamespace(
        EngineCoreOutputs=EngineCoreOutputs,
        EngineCoreRequestType=EngineCoreRequestType,
        SchedulerStats=SchedulerStats,
        encoder=MsgpackEncoder(),
    )


@pytest.fixture
def ctx() -> Iterator[zmq.SyncContext]:
    context: zmq.SyncContext = zmq.Context()
    yield context
    context.destroy(linger=0)


class Coordinator:
    """`python -m corefleet_client.coordinator` with its merged output read by a thread."""

    def __init__(self, ports: list[int], *extra: str) -> None:
        self.ports = ports
        cmd = [
            sys.executable, "-m", "corefleet_client.coordinator",
            "--engine-count", "2", "--host", "127.0.0.1",
            "--front-publish-port", str(ports[0]),
            "--back-output-port", str(ports[1]),
            "--back-publish-port", str(ports[2]),
            *extra,
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines[-60:])

    def wait_for_line(self, needle: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if needle in line:
                        return line
                if self.proc.poll() is not None and not self._reader.is_alive():
                    pytest.fail(f"coordinator exited ({self.proc.returncode}) before {needle!r}:\n{self.output}")
                left = deadline - time.monotonic()
                if left <= 0:
                    pytest.fail(f"no {needle!r} within {timeout}s:\n{self.output}")
                self._cond.wait(timeout=min(left, 1.0))

    def wait_bound(self) -> None:
        line = self.wait_for_line("DP coordinator bound:", STARTUP_TIMEOUT)
        front, back_out, back_pub = (f"tcp://127.0.0.1:{p}" for p in self.ports)
        assert f"front_publish={front} back_output={back_out} back_publish={back_pub}" in line, line

    def wait_exit(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"coordinator still running {timeout}s after the signal:\n{self.output}")
        self._reader.join(timeout=5)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._reader.join(timeout=5)


@contextlib.contextmanager
def coordinator(ports: list[int], *extra: str) -> Iterator[Coordinator]:
    c = Coordinator(ports, *extra)
    try:
        yield c
    finally:
        c.kill()


def recv_within(sock: zmq.SyncSocket, timeout: float) -> list[bytes] | None:
    """One multipart message, or None if none arrives in time."""
    if sock.poll(timeout=int(timeout * 1000), flags=zmq.POLLIN):
        return sock.recv_multipart()
    return None


def latest_stats(sock: zmq.SyncSocket, timeout: float) -> tuple[object, int, bool]:
    """The next stats publish, drained to the newest as DPLBAsyncMPClient does, decoded as it does."""
    frames = recv_within(sock, timeout)
    assert frames is not None, f"no stats publish within {timeout}s"
    buf = frames[-1]
    while sock.poll(timeout=0, flags=zmq.POLLIN):
        buf = sock.recv()
    counts, wave, running = msgspec.msgpack.decode(buf)
    return counts, wave, running


def test_coordinator_gate_stats_waves_and_shutdown(vllm_wire: SimpleNamespace, ctx: zmq.SyncContext) -> None:
    ports = free_ports(3)
    front_addr, back_out_addr, back_pub_addr = (f"tcp://127.0.0.1:{p}" for p in ports)

    with coordinator(ports, "--min-stats-update-interval-ms", "100") as coord:
        coord.wait_bound()

        # The frontend subscribes first, so it sees the first publish after the gate opens.
        front = ctx.socket(zmq.XSUB)
        front.setsockopt(zmq.LINGER, 0)
        front.connect(front_addr)
        front.send(b"\x01")

        engines_sub = []
        engines_push = []
        for rank in range(2):
            sub = ctx.socket(zmq.XSUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.IDENTITY, rank.to_bytes(2, "little"))
            sub.connect(back_pub_addr)
            engines_sub.append(sub)
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(back_out_addr)
            engines_push.append(push)

        # (a) The engine gate: one subscription is not enough ...
        engines_sub[0].send(b"\x01")
        assert recv_within(engines_sub[0], 1.0) is None, "READY before every engine subscribed"
        assert recv_within(front, 0.2) is None, "stats published before the engine gate opened"
        # ... both are: each engine gets exactly one READY.
        engines_sub[1].send(b"\x01")
        for rank, sub in enumerate(engines_sub):
            assert recv_within(sub, STEP_TIMEOUT) == [b"READY"], f"engine {rank}: no READY\n{coord.output}"

        # The first publish after the gate: zero counts, [waiting, running, kv_cache_usage] per engine.
        counts, wave, running = latest_stats(front, STEP_TIMEOUT)
        assert (counts, wave, running) == ([[0, 0, 0.0], [0, 0, 0.0]], 0, False)

        # (b) Stats: each engine pushes its (running, waiting) counts as DPEngineCoreProc does.
        sent = {0: (3, 5, 0.25), 1: (1, 0, 0.5)}  # rank -> (running, waiting, kv_cache_usage)
        for rank, (n_running, n_waiting, kv) in sent.items():
            stats = vllm_wire.SchedulerStats(n_running, n_waiting, kv_cache_usage=kv)
            outputs = vllm_wire.EngineCoreOutputs(engine_index=rank, scheduler_stats=stats)
            engines_push[rank].send_multipart(vllm_wire.encoder.encode(outputs))
        want = [[5, 3, 0.25], [0, 1, 0.5]]  # [waiting, running, kv_cache_usage] indexed by rank
        deadline = time.monotonic() + STEP_TIMEOUT
        while (left := deadline - time.monotonic()) > 0:
            counts, wave, running = latest_stats(front, left)
            if counts == want:
                break
        assert counts == want, f"last published counts {counts}\n{coord.output}"
        assert (wave, running) == (0, False)

        # Wave start from the frontend (0.32.0 wire form of its FIRST_REQ notification: the stats
        # task sends msgpack((engine_index, current_wave))): every engine gets START_DP_WAVE
        # (wave, excluded engine) while the engines are not running.
        front.send(msgspec.msgpack.encode((1, 0)))
        start = vllm_wire.EngineCoreRequestType.START_DP_WAVE.value
        for rank, sub in enumerate(engines_sub):
            frames = recv_within(sub, STEP_TIMEOUT)
            assert frames is not None, f"engine {rank}: no START_DP_WAVE\n{coord.output}"
            assert len(frames) == 2, frames
            assert frames[0] == start, frames
            assert msgspec.msgpack.decode(frames[1]) == [0, 1], frames  # (wave 0, engine 1 already has it)

        # (c) SIGTERM with every peer still connected: exit 0 promptly, through vLLM's own exit path.
        coord.proc.send_signal(signal.SIGTERM)
        assert coord.wait_exit(EXIT_TIMEOUT) == 0, coord.output
        assert "DP Coordinator process exiting" in coord.output

    # The ports are free again: a second coordinator binds the same three, and stops on SIGINT.
    with coordinator(ports, "--no-wave-coordination") as second:
        second.wait_bound()
        assert "wave coordination off" in second.output
        second.proc.send_signal(signal.SIGINT)
        assert second.wait_exit(EXIT_TIMEOUT) == 0, second.output


def test_coordinator_port_in_use_fails_clearly() -> None:
    ports = free_ports(3)
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", ports[1]))
        taken.listen()
        with coordinator(ports) as coord:
            rc = coord.wait_exit(STARTUP_TIMEOUT)
            assert rc != 0, coord.output
            assert f"Cannot bind --back-output-port {ports[1]} on 127.0.0.1" in coord.output, coord.output
            assert "Address already in use" in coord.output, coord.output


def test_coordinator_defaults_match_the_operator() -> None:
    """The coordinator's default ports are the ones the operator passes (constants.py)."""
    from corefleet_client import coordinator as cli
    from corefleet_operator import constants

    assert (cli.DEFAULT_FRONT_PUBLISH_PORT, cli.DEFAULT_BACK_OUTPUT_PORT, cli.DEFAULT_BACK_PUBLISH_PORT) == (
        constants.COORDINATOR_FRONT_PUBLISH_PORT,
        constants.COORDINATOR_BACK_OUTPUT_PORT,
        constants.COORDINATOR_BACK_PUBLISH_PORT,
    )
