# SPDX-License-Identifier: Apache-2.0
"""The engines' handshake with the frontend: vLLM's own HELLO -> INIT -> READY, run by corefleet's client.

vLLM's `MPClient.__init__` normally launches its engines and runs the handshake itself
(`launch_core_engines`). In a fleet the engines run in other pods, so `Handshake` does that step:

* At startup (`startup`), before vLLM's client is built: it binds the engine sockets (requests
  ROUTER, outputs PULL) on the frontend's address with vLLM's `bind_engine_zmq_listeners`, like
  vLLM's multi-API-server supervisor; it owns the handshake ROUTER on the fixed
  `--data-parallel-rpc-port` and runs vLLM's `wait_for_engine_startup` (INIT carries the
  frontend's socket addresses and the coordinator's fixed addresses) for every rank 0..N-1; and it
  returns the bound listeners as `client_addresses`, vLLM's path for "engines managed
  externally", which waits for each engine's ready response and subscribes to the coordinator.
* With fixed engine ports (`--engine-input-port`, `--engine-output-port`; the operator's pods), the
  engine sockets are bound on those ports and advertised under the pod's stable DNS name
  (`fixed_listener`), so that a replacement frontend binds the same; with `--attach` (`frontend.attach`)
  no handshake runs: the engines already run and reconnect.
* With several frontends (`--frontend-addresses`, docs/design/k-frontends.md), frontend 0 runs the handshake and INIT
  names every frontend's sockets (`advertised_addresses`); the others (`FleetOptions.follower`) run none:
  each engine connects to them by itself and its first message there is the ready response vLLM waits for.
* While the fleet serves (`join`, for a scale-up or a replacement): the handshake ROUTER is bound
  again for exactly the joining ranks, and the same exchange runs in a thread (vLLM's loop
  blocks), bounded by the operation's join timeout; a cancel, the deadline or shutdown stops it
  through a `HandshakeAbort`. Each joined rank's ready response is then read from the requests
  ROUTER (`read_ready_responses`): it arrives there before READY.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import time
from typing import Any

import msgspec
import vllm
import zmq
from vllm.utils.network_utils import ZmqListener, get_tcp_uri, zmq_socket_ctx
from vllm.v1.engine import EngineCoreReadyResponse
from vllm.v1.engine.utils import (
    CoreEngine,
    CoreEngineLaunch,
    CoreEngineState,
    EngineZmqAddresses,
    EngineZmqListeners,
    bind_engine_zmq_listeners,
    wait_for_engine_startup,
)

from corefleet_client import vllm_compat
from corefleet_client.admin import ResizeOperation
from corefleet_client.frontend.fleet import Fleet, describe, identity
from corefleet_client.frontend.types import EngineClient, FleetOptions, ResizeFailed

logger = logging.getLogger("corefleet.frontend")

# How long a new rank's ready response may lag behind its READY (sent before it, on another socket).
READY_RESPONSE_TIMEOUT_S = 30.0
# How long to retry binding the handshake port (a ROUTER closed moments ago may still hold it).
HANDSHAKE_BIND_TIMEOUT_S = 10.0

_HANDSHAKE_PROGRESS = {
    CoreEngineState.NEW: "waiting for the engine's HELLO",
    CoreEngineState.CONNECTED: "engine initialising (INIT sent)",
    CoreEngineState.READY: "engine READY; waiting for the other ranks",
}


def remote_engine(rank: int) -> CoreEngine:
    """vLLM's handshake bookkeeping for one engine of another pod (startup, scale-up and replacement)."""
    engine = CoreEngine(index=rank, local=False)
    engine.index = rank  # vLLM keeps only the identity
    return engine


def handshake_address(parallel_config: Any) -> str:
    """Where the frontend's handshake ROUTER binds: the fixed `--data-parallel-rpc-port` on its own address."""
    return str(get_tcp_uri(parallel_config.data_parallel_master_ip, parallel_config.data_parallel_rpc_port))


def advertised_addresses(own: EngineZmqAddresses, options: FleetOptions) -> EngineZmqAddresses:
    """The client sockets INIT tells the engines to connect to: this frontend's own (one frontend), or every
    frontend's by client index (`FleetOptions.frontend_addresses`, each at the same fixed ports on its own host:
    vLLM's engine opens a requests DEALER and an outputs PUSH per entry and answers client `i` on entry `i`)."""
    if options.client_count == 1:
        return EngineZmqAddresses(inputs=list(own.inputs), outputs=list(own.outputs))
    in_port, out_port = options.engine_input_port, options.engine_output_port
    if in_port is None or out_port is None:  # refused by the entrypoint's flags already
        raise ValueError("several frontends need the fixed engine ports")
    inputs = [str(get_tcp_uri(host, in_port)) for host in options.frontend_addresses]
    outputs = [str(get_tcp_uri(host, out_port)) for host in options.frontend_addresses]
    i = options.client_index
    if (inputs[i], outputs[i]) != (own.inputs[0], own.outputs[0]):
        raise ValueError(f"frontend {i} listens on {own.inputs[0]} and {own.outputs[0]}, but the frontend addresses "
                         f"name {inputs[i]} and {outputs[i]}")
    return EngineZmqAddresses(inputs=inputs, outputs=outputs)


def fixed_listener(host: str, port: int, advertised: str) -> ZmqListener:
    """A listening TCP socket on `host:port` for a ZMQ socket to adopt (as vLLM's `make_zmq_listener`), known to
    the engines as `advertised:port`. SO_REUSEADDR: a predecessor's connections in TIME_WAIT on the same address
    (a frontend restarted in place) must not keep the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen()
    except BaseException:
        listener.close()
        raise
    return ZmqListener(address=str(get_tcp_uri(advertised, port)), socket=listener)


def handshake_failure(e: Exception, operation: str, joining: str) -> ResizeFailed:
    """What ends an operation whose new engines' handshake raised `e` (call it in the `except` block): a
    ResizeFailed as it is; anything else was not expected, so it is logged with its traceback and wrapped."""
    if isinstance(e, ResizeFailed):
        return e
    logger.exception("%s: the new %s' handshake failed", operation, joining)
    return ResizeFailed(f"the new {joining}' handshake failed: {type(e).__name__}: {e}")


class HandshakeAbort:
    """Stops a running `wait_for_engine_startup` from another thread.

    vLLM's handshake loop polls the handshake socket and the sentinels of "watched frontend
    processes" (`CoreEngineLaunch.watched_frontend_processes`) and raises as soon as one of those
    becomes readable. This object is such a watched process: its sentinel is the read end of a pipe,
    and `fire()` makes it readable (vLLM then raises RuntimeError naming `name`).
    """

    def __init__(self, resize_id: str) -> None:
        self.name = f"corefleet resize {resize_id}"
        self.reason = ""
        self._read, self._write = os.pipe()
        self.sentinel = self._read

    @property
    def exitcode(self) -> int | None:
        return 1 if self.reason else None

    def fire(self, reason: str) -> None:
        if not self.reason:
            self.reason = reason
            with contextlib.suppress(OSError):
                os.write(self._write, b"x")

    def close(self) -> None:
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)


class Handshake:
    """The engines' handshake at startup and for ranks that join later (see the module docstring)."""

    def __init__(self, client: EngineClient, options: FleetOptions, fleet: Fleet) -> None:
        self.client = client  # vLLM's client: its requests socket and config once built (not yet at startup)
        self.options = options
        self.fleet = fleet
        self._abort: HandshakeAbort | None = None  # the running join's
        self._engine_addresses: EngineZmqAddresses | None = None
        self._engine_listeners: Any = None

    # ---- startup -------------------------------------------------------------------------------
    def startup(self, vllm_config: Any) -> dict[str, Any]:
        """Bind the engine sockets and handshake every rank (or, re-attaching, none); the `client_addresses`
        for MPClient."""
        options = self.options
        pc = vllm_config.parallel_config
        if pc.data_parallel_size_local != 0:
            raise ValueError("corefleet's frontend starts no engine: --data-parallel-size-local must be 0")
        listeners = self._bind_listeners(vllm_config)
        try:
            own = listeners.addresses
            addresses = advertised_addresses(own, options)
            addresses.coordinator_input = str(get_tcp_uri(options.coordinator_address,
                                                          options.coordinator_back_publish_port))
            addresses.coordinator_output = str(get_tcp_uri(options.coordinator_address,
                                                           options.coordinator_back_output_port))
            addresses.frontend_stats_publish_address = str(get_tcp_uri(options.coordinator_address,
                                                                       options.coordinator_front_publish_port))
            self._engine_addresses = addresses
            if options.attach:
                logger.info("Re-attaching to %d running engine(s) on %s and %s; coordinator at %s",
                            pc.data_parallel_size, own.inputs[0], own.outputs[0], options.coordinator_address)
            elif options.follower:
                # Frontend 0 runs the handshake and tells the engines every frontend's sockets; each engine's
                # first message on this frontend's requests socket is its ready response, which vLLM waits for.
                logger.info("Frontend %d of %d: waiting for %d engine(s) to connect to %s and %s (frontend 0 runs "
                            "their handshake); coordinator at %s", options.client_index, options.client_count,
                            pc.data_parallel_size, own.inputs[0], own.outputs[0], options.coordinator_address)
            else:
                engines = [remote_engine(rank) for rank in range(pc.data_parallel_size)]
                address = handshake_address(pc)
                logger.info("Waiting for %d engine(s) to handshake on %s; coordinator at %s",
                            len(engines), address, options.coordinator_address)
                with zmq_socket_ctx(address, zmq.ROUTER, bind=True) as handshake_socket:
                    self._exchange(vllm_config, handshake_socket, engines)
        except BaseException:
            listeners.cleanup()
            raise
        # Keep the listeners referenced until MPClient adopts their sockets: EngineZmqListeners closes
        # them when it is collected, and a closed listener would make MPClient bind the port anew,
        # resetting the connections the engines have already made.
        self._engine_listeners = listeners
        return {
            "input_address": own.inputs[0],
            "output_address": own.outputs[0],
            "input_listener": listeners.inputs[0].socket,
            "output_listener": listeners.outputs[0].socket,
            "stats_update_address": addresses.frontend_stats_publish_address,
        }

    def _bind_listeners(self, vllm_config: Any) -> EngineZmqListeners:
        """The engines' requests and outputs listeners: vLLM's (ephemeral ports on the DP address), or, with
        fixed ports, bound on the DP address and advertised under `advertise_address` (the pod's stable DNS
        name), so that a replacement frontend binds the same and running engines reconnect to it."""
        options = self.options
        if options.engine_input_port is None or options.engine_output_port is None:
            return bind_engine_zmq_listeners(vllm_config)
        host = vllm_config.parallel_config.data_parallel_master_ip
        advertised = options.advertise_address or host
        inputs = fixed_listener(host, options.engine_input_port, advertised)
        try:
            outputs = fixed_listener(host, options.engine_output_port, advertised)
        except BaseException:
            inputs.cleanup()
            raise
        return EngineZmqListeners(inputs=[inputs], outputs=[outputs])

    def _exchange(self, vllm_config: Any, handshake_socket: Any, engines: list[CoreEngine],
                  abort: HandshakeAbort | None = None, parallel_config: Any = None) -> None:
        """vLLM's HELLO -> INIT -> READY exchange with `engines` on a bound handshake ROUTER.

        `parallel_config`: the one INIT advertises and READY's hash is checked against, if not the
        fleet's own (an elastic-EP scale-up's: the new size, its ports, store and R')."""
        pc = parallel_config if parallel_config is not None else vllm_config.parallel_config
        options = self.options
        coordinated_dp = pc.data_parallel_size > 1 and vllm_config.model_config.is_moe
        progress = {e.index: e for e in engines}
        self.fleet.set_join_progress(lambda: {r: _HANDSHAKE_PROGRESS[e.state] for r, e in progress.items()})
        try:
            wait_for_engine_startup(
                handshake_socket, engines,
                pc if parallel_config is not None
                else vllm_compat.advertised_parallel_config(pc, options.engine0_address, options.coord_store_port),
                coordinated_dp, vllm_config.cache_config,
                CoreEngineLaunch(engine_manager=None, coordinator=None, addresses=self._engine_addresses,
                                 tensor_queue=None, watched_frontend_processes=[abort] if abort else []),
            )
        finally:
            self.fleet.set_join_progress(None)

    # ---- ranks that join a serving fleet ---------------------------------------------------------
    async def join(self, op: ResizeOperation, ranks: list[int], address: str, parallel_config: Any = None) -> None:
        """The handshake of `ranks`, in a thread, bounded by the operation's join timeout."""
        engines = [remote_engine(rank) for rank in ranks]
        abort = self._abort = HandshakeAbort(op.id)
        loop = asyncio.get_running_loop()
        handshake = loop.run_in_executor(None, self._join_thread, engines, address, abort, parallel_config)
        try:
            done, _ = await asyncio.wait({handshake}, timeout=op.join_timeout_s)
            if not done:
                waiting = [e.index for e in engines if e.state != CoreEngineState.READY]
                abort.fire(f"{describe(waiting)} did not join within the join timeout of {op.join_timeout_s:g}s")
            try:
                await handshake
            except (RuntimeError, zmq.ZMQError, OSError) as e:
                raise ResizeFailed(abort.reason or f"handshake failed: {e}") from None
        except asyncio.CancelledError:
            abort.fire("the frontend is shutting down")
            raise
        finally:
            if not handshake.done():
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(asyncio.shield(handshake), 5)
            self._abort = None
            abort.close()

    def _join_thread(self, engines: list[CoreEngine], address: str, abort: HandshakeAbort,
                     parallel_config: Any = None) -> None:
        """The thread: bind the handshake ROUTER again and run vLLM's handshake on it.

        The ROUTER closed at the end of the last handshake may still hold the port for a moment:
        binding is retried for `HANDSHAKE_BIND_TIMEOUT_S`. With handover, an engine that reconnects
        with a rank's identity replaces a stale connection of that identity (a pod being deleted).
        """
        deadline = time.monotonic() + HANDSHAKE_BIND_TIMEOUT_S
        while True:
            bound = False
            try:
                with zmq_socket_ctx(address, zmq.ROUTER, bind=True, router_handover=True) as handshake_socket:
                    bound = True
                    self._exchange(self.client.vllm_config, handshake_socket, engines, abort, parallel_config)
                return
            except zmq.ZMQError as e:
                if bound or e.errno != errno.EADDRINUSE or time.monotonic() > deadline or abort.reason:
                    raise
            time.sleep(0.1)

    def abort(self, reason: str, resize_id: str | None = None) -> None:
        """Stop the running join (only if it is `resize_id`'s, when given)."""
        abort = self._abort
        if abort is not None and (resize_id is None or abort.name.endswith(f" {resize_id}")):
            abort.fire(reason)

    def discard_stale_ready_responses(self) -> None:
        """Drop what ranks of an earlier, failed join left on the requests socket (their ready responses)."""
        while True:
            future = self.client.input_socket.recv_multipart(flags=zmq.NOBLOCK)
            if future.exception() is not None:  # zmq.Again: nothing left
                return
            frames = future.result()
            logger.info("Discarding a stale message from engine %d on the requests socket",
                        int.from_bytes(frames[0], "little"))

    async def read_ready_responses(self, ranks: list[int], wait_s: float = READY_RESPONSE_TIMEOUT_S) -> None:
        """Each joined rank's ready response (sent on the requests socket before READY), checked and applied; the
        wait for them is bounded by `wait_s`."""
        waiting = {identity(rank): rank for rank in ranks}
        deadline = time.monotonic() + wait_s
        while waiting:
            left = deadline - time.monotonic()
            try:
                frames = await asyncio.wait_for(self.client.input_socket.recv_multipart(), max(left, 0.001))
            except TimeoutError:
                raise ResizeFailed(f"no ready response from {describe(waiting.values())} within "
                                   f"{wait_s:g}s") from None
            engine, payload = frames[0], frames[-1]
            rank = waiting.pop(engine, None)
            if rank is None:
                logger.info("Ignoring a message from engine %d on the requests socket",
                            int.from_bytes(engine, "little"))
                continue
            if payload:
                self._check_ready_response(rank, payload)
            self.client._apply_ready_response(payload)

    def _check_ready_response(self, rank: int, payload: bytes) -> None:
        """A joining rank runs the fleet's vLLM version and tensor-parallel size."""
        response = msgspec.msgpack.decode(payload, type=EngineCoreReadyResponse)
        ours = self.client.vllm_config.parallel_config
        version = str(vllm.__version__)
        if response.vllm_version.split("+")[0] != version.split("+")[0]:
            raise ResizeFailed(f"rank {rank} runs vLLM {response.vllm_version}, the fleet "
                               f"{version}: every rank must run the same version")
        if response.tensor_parallel_size != ours.tensor_parallel_size:
            raise ResizeFailed(f"rank {rank} has tensor parallel size {response.tensor_parallel_size}, "
                               f"the fleet {ours.tensor_parallel_size}")
