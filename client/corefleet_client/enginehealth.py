# SPDX-License-Identifier: Apache-2.0
"""What the engine launcher (`corefleet_client.engine`) knows about its engine, and how it says it.

Three parts, none of which imports vLLM (so that they are tested without torch):

* `HandshakeRelay`: the engine's startup handshake passes through the launcher. The engine core
  connects its handshake DEALER to a ROUTER bound here on a local `ipc://` path; a DEALER here,
  with the engine's identity (the DP rank, 2 bytes little-endian), connects to the frontend's
  handshake ROUTER. Frames pass through unchanged in both directions: HELLO and READY up,
  INIT down. Once READY has gone up, the engine has joined the fleet, and the relay closes.
* `EngineState`: starting / ready / exited, from the relay and the engine process's sentinel
  (`ChildProcess`: a pidfd, for the engine core the launcher starts with `subprocess`).
* `HealthServer`: `GET /livez` and `GET /readyz` on a stdlib HTTP server in a thread.

Why relaying the handshake is transparent (vLLM 0.32.0, `v1/engine/core.py`
`EngineCoreProc._perform_handshake` / `startup_handshake`, and `v1/engine/utils.py`
`wait_for_engine_startup`):

* The engine opens one DEALER (`IDENTITY = engine_index.to_bytes(2, "little")`, linger 5 s) to the
  handshake address, sends HELLO `msgpack({"status": "HELLO", "local": False, "headless": True})`,
  waits up to `HANDSHAKE_TIMEOUT_MINS` (5) for one INIT frame, initialises (model load, KV cache,
  input registration on the frontend's own ROUTER, coordinator READY), then sends READY
  `msgpack({"status": "READY", "local": ..., "headless": ..., "parallel_config_hash": ...})` and
  closes the DEALER. All of it is one-frame messages.
* The frontend identifies the engine only by the ROUTER envelope (the DEALER identity, which the
  relay's DEALER repeats) and checks `local`/`headless` and, for MoE, the config hash. No payload
  carries the engine's own address: HELLO and READY are flags and a hash, INIT carries the
  frontend's and coordinator's addresses (`EngineZmqAddresses`) and, for MoE, the DP master
  settings. The engine connects to those itself; nothing goes back through the relay afterwards.
* The frontend never learns the peer's IP from the handshake socket, so relaying through a
  different TCP connection changes nothing it sees.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import multiprocessing.connection
import os
import socket
import subprocess
import threading
import time
import urllib.parse
from typing import Any, Protocol

import msgspec
import zmq

from corefleet_client.admin import DRAIN_PATH
from corefleet_client.process import send_json

logger = logging.getLogger(__name__)

# How long the relay keeps READY queued for the frontend after closing (vLLM's engine DEALER uses the same).
HANDSHAKE_LINGER_MS = 5000
_POLL_MS = 100

STATE_STARTING = "starting"
STATE_READY = "ready"
STATE_EXITED = "exited"
STATE_DRAINING = "draining"

DRAIN_POLL_S = 0.2
DEFAULT_DRAIN_TIMEOUT_S = 30.0
FRONTEND_GONE_PROBES = 3  # refused connections in a row to the frontend's admin port: it is gone


def engine_identity(rank: int) -> bytes:
    """The ZMQ identity vLLM gives DP rank `rank`'s engine (`EngineCoreProc.__init__`)."""
    return rank.to_bytes(length=2, byteorder="little")


def _status(payload: bytes) -> str | None:
    """The `status` of a handshake message, or None if it is not the msgpack map vLLM sends."""
    try:
        msg = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return None
    status = msg.get("status") if isinstance(msg, dict) else None
    return status if isinstance(status, str) else None


class HandshakeRelay:
    """Pass one engine's startup handshake through to the frontend and note when it is READY.

    The sockets are created (and the engine-side ROUTER bound) in the constructor, in the caller's
    thread, so that a bind error surfaces there; from `start()` on only the relay thread uses them.
    """

    def __init__(self, rank: int, engine_address: str, frontend_address: str,
                 joined: threading.Event | None = None) -> None:
        self.rank = rank
        self.identity = engine_identity(rank)
        self.engine_address = engine_address
        self.frontend_address = frontend_address
        # Set once READY has been passed to the frontend.
        self.joined = joined if joined is not None else threading.Event()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        try:
            self._engine_side = self._ctx.socket(zmq.ROUTER)
            self._engine_side.setsockopt(zmq.LINGER, 0)
            self._engine_side.bind(engine_address)
            self._frontend_side = self._ctx.socket(zmq.DEALER)
            self._frontend_side.setsockopt(zmq.IDENTITY, self.identity)
            self._frontend_side.setsockopt(zmq.LINGER, HANDSHAKE_LINGER_MS)
            self._frontend_side.connect(frontend_address)
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name="handshake-relay", daemon=True)

    def start(self) -> None:
        logger.info(
            "Relaying rank %d's handshake: engine %s <-> frontend %s",
            self.rank, self.engine_address, self.frontend_address,
        )
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop relaying (nothing queued is sent unless READY already went) and wait for the thread."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=timeout)
        else:
            self._close_sockets(linger=0)

    def _run(self) -> None:
        engine_peer = self.identity  # the ROUTER envelope of the engine, as it said HELLO
        poller = zmq.Poller()
        poller.register(self._engine_side, zmq.POLLIN)
        poller.register(self._frontend_side, zmq.POLLIN)
        linger = 0
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(_POLL_MS))
                if self._frontend_side in events:
                    # 2. INIT (EngineHandshakeMetadata): frontend -> engine.
                    frames = self._frontend_side.recv_multipart(copy=True)
                    logger.info("Handshake: %s from the frontend relayed to rank %d's engine",
                                _status(frames[0]) or "INIT", self.rank)
                    self._engine_side.send_multipart([engine_peer, *frames])
                if self._engine_side in events:
                    # 1. HELLO, 3. READY: engine -> frontend.
                    peer, *frames = self._engine_side.recv_multipart(copy=True)
                    if peer != self.identity:
                        logger.error(
                            "Handshake from an engine with identity %r (rank %d) on rank %d's relay; dropped",
                            peer, int.from_bytes(peer, "little"), self.rank,
                        )
                        continue
                    engine_peer = peer
                    status = _status(frames[0]) if frames else None
                    self._frontend_side.send_multipart(frames)
                    logger.info("Handshake: %s from rank %d's engine relayed to the frontend",
                                status or "an unrecognised message", self.rank)
                    if status == "READY":
                        # The engine has closed its handshake socket; READY may still be queued here.
                        linger = HANDSHAKE_LINGER_MS
                        self.joined.set()
                        logger.info("Rank %d's engine has joined the fleet", self.rank)
                        return
        except zmq.ZMQError as e:
            if not self._stop.is_set():
                logger.error("Handshake relay for rank %d failed: %s", self.rank, e)
        finally:
            self._close_sockets(linger=linger)

    def _close_sockets(self, linger: int) -> None:
        self._engine_side.close(linger=0)
        self._frontend_side.close(linger=linger)
        self._ctx.term()  # waits up to `linger` for READY to reach the frontend
        if self.engine_address.startswith("ipc://"):
            # libzmq 4.3.5 leaves the socket file behind, on close and on unbind alike.
            with contextlib.suppress(OSError):
                os.unlink(self.engine_address.removeprefix("ipc://"))


class _Process(Protocol):
    """What EngineState reads of the engine's process (a `ChildProcess`, or a multiprocessing.Process)."""

    @property
    def sentinel(self) -> int: ...

    @property
    def exitcode(self) -> int | None: ...


class ChildProcess:
    """A `subprocess.Popen` child seen as `_Process`: a pidfd as its sentinel (readable once it has
    exited) and its exit status read without reaping it (`waitid(WNOWAIT)`), so that the health
    server's threads never race the main thread, which reaps it with `wait()`. The exit code follows
    multiprocessing's convention: -N when killed by signal N."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.sentinel = os.pidfd_open(popen.pid)

    @property
    def exitcode(self) -> int | None:
        if self._popen.returncode is not None:
            return self._popen.returncode
        try:
            info = os.waitid(os.P_PID, self._popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped by the main thread meanwhile
            return self._popen.returncode
        if info is None:
            return None
        killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        return -info.si_status if killed else info.si_status

    def close(self) -> None:
        os.close(self.sentinel)


class EngineState:
    """The engine's state as the probes see it: starting, ready (READY relayed, process alive) or exited.

    Read from the HTTP server's threads. The process's sentinel (readable once it has exited) is
    checked rather than `is_alive()`, which would reap the child under the main thread's feet.
    """

    def __init__(self, rank: int | None, joined: threading.Event | None = None) -> None:
        self.rank = rank  # None until the engine core has reported it
        self.joined = joined if joined is not None else threading.Event()
        self.draining = threading.Event()  # the pod is being removed: not ready any more
        self.released = threading.Event()  # the frontend released the engine: its pod may stop
        self.frontend: tuple[str, int] | None = None  # where to see whether the frontend still runs (drain)
        self._process: _Process | None = None

    def attach(self, process: _Process) -> None:
        self._process = process

    def exited(self) -> bool:
        process = self._process
        return process is not None and bool(multiprocessing.connection.wait([process.sentinel], timeout=0))

    def snapshot(self) -> dict[str, Any]:
        process = self._process
        exited = self.exited()
        if exited:
            state = STATE_EXITED
        elif self.draining.is_set():
            state = STATE_DRAINING
        elif process is not None and self.joined.is_set():
            state = STATE_READY
        else:
            state = STATE_STARTING
        exitcode = process.exitcode if exited and process is not None else None
        return {"rank": self.rank, "state": state, "exitcode": exitcode, "released": self.released.is_set()}

    def drain(self, timeout: float) -> str:
        """The pod is being removed (its pre-stop hook): not ready from now on; returns, saying why, once the
        frontend released the engine, the engine exited, the frontend is gone, or `timeout` seconds passed."""
        if not self.draining.is_set():
            logger.info("Draining: the pod is being removed; waiting up to %gs for the frontend to release "
                        "this engine", timeout)
        self.draining.set()
        deadline = time.monotonic() + timeout
        unreachable = 0
        while True:
            if self.released.wait(DRAIN_POLL_S):
                return "released by the frontend"
            if self.exited():
                return "the engine exited"
            unreachable = unreachable + 1 if not self._frontend_reachable() else 0
            if unreachable >= FRONTEND_GONE_PROBES:
                return "the frontend is gone"
            if time.monotonic() >= deadline:
                return f"not released within {timeout:g}s"

    def _frontend_reachable(self) -> bool:
        """Whether the frontend's admin port accepts a connection (True when there is nothing to ask)."""
        if self.frontend is None:
            return True
        try:
            with socket.create_connection(self.frontend, timeout=DRAIN_POLL_S * 5):
                return True
        except OSError:
            return False


class _HealthHandler(http.server.BaseHTTPRequestHandler):
    server: _HealthHTTPServer

    def do_GET(self) -> None:
        path, _, query = self.path.partition("?")
        if path == DRAIN_PATH:
            self._drain(urllib.parse.parse_qs(query).get("timeout", [""])[0])
            return
        if path not in ("/livez", "/readyz"):
            self._reply(404, {"error": f"no such path {path}; try /livez, /readyz or {DRAIN_PATH}"})
            return
        snapshot = self.server.state.snapshot()
        ok = snapshot["state"] != STATE_EXITED if path == "/livez" else snapshot["state"] == STATE_READY
        self._reply(200 if ok else 503, snapshot)

    def _drain(self, timeout: str) -> None:
        try:
            seconds = float(timeout) if timeout else DEFAULT_DRAIN_TIMEOUT_S
        except ValueError:
            self._reply(400, {"error": f"timeout must be a number of seconds, not {timeout!r}"})
            return
        why = self.server.state.drain(max(0.0, seconds))
        logger.info("Drain over: %s", why)
        self._reply(200, {**self.server.state.snapshot(), "drained": why})

    def _reply(self, code: int, body: dict[str, Any]) -> None:
        send_json(self, code, body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("health %s - %s", self.address_string(), format % args)


class _HealthHTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], state: EngineState) -> None:
        self.state = state
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _HealthHandler)


class HealthServer:
    """`/livez` (200 unless the engine process has exited) and `/readyz` (200 once READY was relayed
    and the process is alive, until a drain), each with a JSON body `{"rank", "state", "exitcode", "released"}`;
    `/drain?timeout=S`, the pod's pre-stop hook: `EngineState.drain`."""

    def __init__(self, host: str, port: int, state: EngineState) -> None:
        self._httpd = _HealthHTTPServer((host, port), state)  # OSError if the port cannot be bound
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="health-server", daemon=True)

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def start(self) -> None:
        self._thread.start()
        logger.info("Serving /livez and /readyz on port %d", self.port)

    def close(self) -> None:
        if self._thread.ident is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            self._httpd.server_close()
