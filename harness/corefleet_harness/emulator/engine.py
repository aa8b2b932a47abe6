# SPDX-License-Identifier: Apache-2.0
"""The emulated engine core process: vLLM 0.32.0's `EngineCoreProc` / `DPEngineCoreProc` minus the model.

Threads, as in vLLM:

* main: handshake, then the busy loop (`run_busy_loop`): input queue -> requests, utility calls,
  START_DP_WAVE; one scheduler step per `token_delay_s`; stats to the coordinator; elastic EP state;
* input (`process_input_sockets`): DEALER per frontend input + XSUB to the coordinator -> queue;
* output (`process_output_sockets`): queue -> PUSH per frontend output (by client index) or the
  coordinator PUSH (client index -1).

Every loop waits on a poller or a queue with a timeout and checks the stop event, so SIGTERM ends
the process within a fraction of a second and a vanished frontend leaves it idle, not spinning.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
import typing
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from corefleet_client.admin import ATTACH_UTILITY
from corefleet_client.coordstore import tcp_socket
from corefleet_harness.emulator import wire
from corefleet_harness.emulator.config import EmulatorConfig
from corefleet_harness.emulator.scheduler import EmulatedScheduler, PauseState
from corefleet_harness.emulator.sockets import make_zmq_socket
from corefleet_harness.emulator.store import get_cached_tcp_store_client
from corefleet_harness.emulator.wire import (
    EEPNotificationType,
    EngineCoreOutputs,
    EngineCoreRequestType,
    FinishReason,
    ReconfigureDistributedRequest,
    ReconfigureRankType,
)

logger = logging.getLogger(__name__)

POLL_S = 0.2  # how often blocked loops look at the stop event
NONBLOCKING_POLL_S = 0.01  # input wait while the elastic EP state progresses (vLLM spins here)
LOG_WAIT_S = 10.0  # vLLM logs "Waiting for READY message from DP Coordinator..." every 10 s
OUTPUT_LINGER_MS = 4000  # process_output_sockets
HANDSHAKE_LINGER_MS = 5000  # _perform_handshake
STORE_TIMEOUT_S = 300.0  # torch's TCPStore default, as get_cached_tcp_store_client uses it
DP_MASTER_PORT_KEY = "dp_master_port"  # ParallelConfig._pick_stateless_dp_port
EXIT_OK = 0
EXIT_FAILED = 1


class EngineExit(Exception):
    """Leave the busy loop and exit with `code` (vLLM raises SystemExit)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


# Worker types and states of vllm/distributed/elastic_ep/elastic_state.py, collapsed: the emulator
# has no DP group, workers or weights, so the collectives (weight transfer, KV-size MIN all-reduce,
# EPLB reshuffle, wave-state MAX all-reduce) are left out and every state that only waits for them
# passes at once. What remains is what other processes can observe: the store key
# `eep_ready/{rank}`, the EEP notifications and their order, the exit of a removed rank, and the one
# collective that orders the ranks of a resize, emulated below (GROUP_JOIN_KEY).
PREPARE, READY_FOR_SWITCH, COMPLETE = "PREPARE", "READY_FOR_SWITCH", "COMPLETE"

# Joining the new group of a resize, emulated on its coordination store. In vLLM every rank of the
# new group (the old ranks in PREPARE, after `reinitialize_distributed`; a new rank in its init,
# before READY) creates the new process groups, a collective of all of them: a new rank's READY
# comes only once every old rank has been sent `reinitialize_distributed`, and an old rank's
# `eep_ready` key only once every new rank has started (docs/vllm-protocol.md §10.2). Each rank sets
# its key and waits for the keys of ranks 0..size-1; a client that gets the order wrong waits here,
# as it would on vLLM, until GROUP_JOIN_TIMEOUT_S fails the engine.
GROUP_JOIN_KEY = "corefleet-emulator/joined/{rank}"
GROUP_JOIN_TIMEOUT_S = STORE_TIMEOUT_S


def group_join_keys(size: int) -> list[str]:
    return [GROUP_JOIN_KEY.format(rank=r) for r in range(size)]


def join_new_group(store: Any, rank: int, size: int, stop: threading.Event,
                   timeout_s: float = GROUP_JOIN_TIMEOUT_S) -> None:
    """Set this rank's join key and wait until ranks 0..size-1 all set theirs; RuntimeError at the timeout."""
    store.set(GROUP_JOIN_KEY.format(rank=rank), b"1")
    keys = group_join_keys(size)
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if stop.is_set():
            raise EngineExit(EXIT_OK)
        if time.monotonic() > deadline:
            missing = [k for k in keys if not store.check([k])]
            raise RuntimeError(f"rank {rank} waited {timeout_s:g}s for the new group of {size} rank(s) to form; "
                               f"missing: {', '.join(missing)}")
        time.sleep(POLL_S / 4)


def missing_ready_keys(store: Any, size: int) -> list[str]:
    """The `eep_ready/{rank}` keys of ranks 0..size-1 that are not set."""
    return [k for k in (f"eep_ready/{r}" for r in range(size)) if not store.check([k])]


@dataclass
class EmulatedEEPState:
    """`ElasticEPScalingState`: worker_type existing|new|removing, scale_type scale_up|scale_down."""

    worker_type: str
    scale_type: str
    store_host: str
    store_port: int
    ready_key: str
    request: ReconfigureDistributedRequest | None = None
    state: str = PREPARE
    commit_requested: bool = False
    _pending: Future[None] | None = None

    def is_ready_for_switch(self) -> bool:
        return self.worker_type == "existing" and self.state == READY_FOR_SWITCH

    def is_complete(self) -> bool:
        return self.state == COMPLETE


class EmulatedEngineCore:
    """One DP rank. `run()` returns the process exit code."""

    def __init__(self, cfg: EmulatorConfig, stop: threading.Event | None = None) -> None:
        self.cfg = cfg
        self.stop = stop or threading.Event()
        self.engine_index = cfg.rank
        self.dp_rank = cfg.rank
        self.identity = wire.identity(cfg.rank)
        self.coordinated_dp = cfg.coordinated_dp  # DPEngineCoreProc rather than EngineCoreProc
        self.input_queue: queue.Queue[tuple[EngineCoreRequestType, Any]] = queue.Queue()
        self.output_queue: queue.Queue[tuple[int, EngineCoreOutputs] | bytes] = queue.Queue()
        self.ready = threading.Event()  # READY sent on the handshake socket: /readyz
        self.addresses: wire.EngineZmqAddresses | None = None
        self.parallel_config: dict[str, Any] = {}
        self.has_coordinator = False
        self.publish_dp_lb_stats = False
        self.last_counts = (0, 0)
        self.scheduler = EmulatedScheduler(
            max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len, vocab_size=cfg.vocab_size,
            num_gpu_blocks=cfg.num_gpu_blocks, block_size=cfg.block_size, log_stats=cfg.log_stats,
        )
        self.engines_running = False
        self.shutting_down = False
        self.process_input_queue_block = True
        self._idle_state_callbacks: list[Callable[[], None]] = []
        self.next_step_at = 0.0
        self.sleeping = False
        self._weight_version = "default"
        self._loras: set[int] = set()
        # DPEngineCoreProc state.
        self.data_parallel_size = cfg.data_parallel_size
        self.step_counter = 0
        self.current_wave = 0
        self.pending_pause = False
        self.ignore_start_dp_wave = False
        self.eep_scaling_state: EmulatedEEPState | None = None
        self._dp_group_socket: socket.socket | None = None  # rank 0 of an elastic-EP fleet: its DP group port
        self._eep_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ElasticEPPrepare")
        self.utility_calls: dict[str, int] = {}
        self.notifications_sent: list[str] = []
        self._threads: list[threading.Thread] = []
        self._threads_stop = threading.Event()
        self._stats_lock = threading.Lock()
        self.started_at = time.monotonic()
        self.ready_after_s: float | None = None

    # ---- 1. Handshake (EngineCoreProc._perform_handshake / startup_handshake) ----------------------

    def _wait_readable(self, sock: zmq.Socket[Any], timeout_s: float | None, what: str) -> bool:
        """Poll `sock` until readable; False on stop, RuntimeError on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        next_log = time.monotonic() + LOG_WAIT_S
        while not self.stop.is_set():
            if sock.poll(timeout=int(POLL_S * 1000)):
                return True
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise RuntimeError(f"Did not receive {what} within {timeout_s:.0f} s")
            if now >= next_log:
                logger.info("Waiting for %s...", what)
                next_log = now + LOG_WAIT_S
        return False

    def run(self) -> int:
        ctx = zmq.Context()
        try:
            return self._run(ctx)
        except EngineExit as e:
            return e.code
        except Exception:
            if self.ready.is_set():
                logger.exception("EngineCore encountered a fatal error.")
                self.output_queue.put_nowait(wire.ENGINE_CORE_DEAD)
            else:
                logger.exception("EngineCore failed to start.")
            return EXIT_FAILED
        finally:
            self._stop_threads()
            self._eep_executor.shutdown(wait=False, cancel_futures=True)
            ctx.destroy(linger=0)

    def _run(self, ctx: zmq.Context[Any]) -> int:
        cfg = self.cfg
        handshake = make_zmq_socket(ctx, cfg.handshake_address, zmq.DEALER, identity=self.identity,
                                    linger=HANDSHAKE_LINGER_MS, bind=False)
        try:
            logger.info("Engine %d (emulated) handshaking with %s", cfg.rank, cfg.handshake_address)
            handshake.send(wire.encode_hello(local=False, headless=True))
            if not self._wait_readable(handshake, wire.HANDSHAKE_TIMEOUT_S, "the INIT message from the front-end"):
                return EXIT_OK
            init = wire.decode_init(handshake.recv())
            self._apply_init(init)

            if cfg.enable_elastic_ep and self.coordinated_dp and not cfg.scale_up_launch:
                self._init_elastic_ep_at_startup()
            if cfg.scale_up_launch and self.coordinated_dp:
                self._eep_scale_up_before_kv_init()

            ready_event = threading.Event()
            self._start_threads(ready_event)
            while not ready_event.wait(timeout=POLL_S):
                if self.stop.is_set():
                    return self._shutdown()
                if not self._threads[0].is_alive():
                    raise RuntimeError("Input socket thread died during startup")

            handshake.send(wire.encode_ready(wire.compute_parallel_config_hash(cfg) if self.coordinated_dp else None))
        finally:
            handshake.close()
        self.ready_after_s = time.monotonic() - self.started_at
        self.ready.set()
        logger.info("Engine %d (emulated) READY: dp_size=%d moe=%s, %d ms per step",
                    cfg.rank, self.data_parallel_size, self.coordinated_dp, round(cfg.token_delay_s * 1000))
        return self.run_busy_loop()

    def _apply_init(self, init: wire.EngineHandshakeMetadata) -> None:
        """`startup_handshake`: setattr(parallel_config, k, v) for each INIT key."""
        self.addresses = init.addresses
        self.parallel_config = dict(init.parallel_config)
        if self.coordinated_dp and "data_parallel_size" in self.parallel_config:
            self.data_parallel_size = int(self.parallel_config["data_parallel_size"])
        self.has_coordinator = init.addresses.coordinator_output is not None
        # EngineCoreProc.__init__: internal (or hybrid) DP load balancing publishes request counts.
        self.publish_dp_lb_stats = self.has_coordinator
        self.scheduler.finished_req_ids = self.scheduler.finished_req_ids if self.has_coordinator else None
        logger.info("INIT: inputs=%s outputs=%s coordinator_input=%s coordinator_output=%s parallel_config=%s",
                    init.addresses.inputs, init.addresses.outputs, init.addresses.coordinator_input,
                    init.addresses.coordinator_output, self.parallel_config)

    # ---- 2. IO threads (process_input_sockets / process_output_sockets) ---------------------------

    def _start_threads(self, ready_event: threading.Event) -> None:
        assert self.addresses is not None
        input_thread = threading.Thread(target=self._input_thread, args=(ready_event,), name="EngineInput",
                                        daemon=True)
        output_thread = threading.Thread(target=self._output_thread, name="EngineOutput", daemon=True)
        self._threads = [input_thread, output_thread]
        input_thread.start()
        output_thread.start()

    def _input_thread(self, ready_event: threading.Event) -> None:
        assert self.addresses is not None
        decoder = wire.InputDecoder()
        with contextlib.ExitStack() as stack, zmq.Context() as ctx:
            input_sockets = [
                stack.enter_context(make_zmq_socket(ctx, addr, zmq.DEALER, identity=self.identity, bind=False))
                for addr in self.addresses.inputs
            ]
            coord_socket = None
            if self.addresses.coordinator_input is not None:
                coord_socket = stack.enter_context(make_zmq_socket(
                    ctx, self.addresses.coordinator_input, zmq.XSUB, identity=self.identity, bind=False))
                coord_socket.send(wire.SUBSCRIBE)
            for sock in (*input_sockets, coord_socket):
                if sock is not None:
                    sock.setsockopt(zmq.LINGER, 0)

            poller = zmq.Poller()
            payload = wire.encode_ready_response(
                wire.make_ready_response(self.cfg, self.addresses.frontend_stats_publish_address))
            for sock in input_sockets:
                # The ROUTER can only route to a DEALER it has heard from: register first.
                sock.send(payload)
                poller.register(sock, zmq.POLLIN)
            if coord_socket is not None:
                if not self._wait_readable(coord_socket, None, "READY message from DP Coordinator"):
                    return
                first = coord_socket.recv()
                if first != wire.COORDINATOR_READY:
                    raise RuntimeError(f"expected READY from the DP coordinator, got {first!r}")
                poller.register(coord_socket, zmq.POLLIN)
            ready_event.set()

            while not self._threads_stop.is_set():
                for sock, _ in poller.poll(timeout=int(POLL_S * 1000)):
                    decoded = self._decode_input(decoder, sock.recv_multipart(copy=False))
                    if decoded is None:
                        continue
                    request_type, request = decoded
                    if request_type == EngineCoreRequestType.UTILITY and request[2] == ATTACH_UTILITY:
                        # corefleet's engine (`enginecore.announce_again_on_attach`): a replacement frontend's
                        # client waits for this engine's ready response on its new connection.
                        sock.send(payload)
                    self.input_queue.put_nowait(decoded)

    def _decode_input(self, decoder: wire.InputDecoder,
                      frames: list[Any]) -> tuple[EngineCoreRequestType, Any] | None:
        """One input message, decoded; None for the coordinator's READY (re-sent when a new engine subscribes),
        for an undecodable message (logged: a tensor, which the emulator does not decode) and for an ADD it
        cannot serve, which is answered with FinishReason.ERROR (`_handle_request_preproc_error`)."""
        try:
            return decoder.decode(frames)
        except wire.UnsupportedRequest as e:
            logger.error("Unsupported request %s: %s", e.request.request_id, e)
            self.output_queue.put_nowait((e.request.client_index, wire.make_finish_outputs(
                [e.request.request_id], FinishReason.ERROR)))
        except Exception:
            logger.exception("Undecodable input message (%d frames)", len(frames))
        return None

    def _output_thread(self) -> None:
        assert self.addresses is not None
        encoder = wire.MsgpackEncoder()
        with contextlib.ExitStack() as stack, zmq.Context() as ctx:
            sockets = [stack.enter_context(make_zmq_socket(ctx, addr, zmq.PUSH, linger=OUTPUT_LINGER_MS))
                       for addr in self.addresses.outputs]
            coord_socket = None
            if self.addresses.coordinator_output is not None:
                coord_socket = stack.enter_context(make_zmq_socket(
                    ctx, self.addresses.coordinator_output, zmq.PUSH, bind=False, linger=OUTPUT_LINGER_MS))
            while True:
                try:
                    output = self.output_queue.get(timeout=POLL_S)
                except queue.Empty:
                    if self._threads_stop.is_set():
                        break
                    continue
                if output == wire.ENGINE_CORE_DEAD:
                    for sock in sockets:
                        sock.send(output)
                    break
                assert not isinstance(output, bytes)
                client_index, outputs = output
                outputs.engine_index = self.engine_index
                if client_index == -1:
                    if coord_socket is not None:
                        coord_socket.send_multipart(encoder.encode(outputs))
                    continue
                sockets[client_index].send_multipart(encoder.encode(outputs), copy=False)

    def _stop_threads(self) -> None:
        """Let the output thread flush what is queued (its sockets linger), then stop both."""
        self._threads_stop.set()
        for thread in self._threads:
            thread.join(timeout=OUTPUT_LINGER_MS / 1000 + 1)

    # ---- 3. Busy loop (EngineCoreProc.run_busy_loop / DPEngineCoreProc.run_busy_loop) --------------

    def has_work(self) -> bool:
        return self.engines_running or self.scheduler.has_requests()

    def run_busy_loop(self) -> int:
        while True:
            if self.stop.is_set():
                return self._shutdown()
            was_running = self.engines_running
            self._process_input_queue()
            if self.stop.is_set():
                continue
            self._maybe_publish_request_counts()
            self._progress_elastic_ep()
            if not self._step_due():
                continue
            executed = self._process_engine_step()
            self._maybe_publish_request_counts()
            if self.coordinated_dp:
                self._dp_after_step(executed, was_running)

    def _step_due(self) -> bool:
        if not self.has_work():
            return False
        if not self.scheduler.has_unfinished_requests() and not self.engines_running:
            return True  # only finished ids to report: an empty step, no model time
        return time.monotonic() >= self.next_step_at

    def _process_input_queue(self) -> None:
        """Handle input until a step is due; block (in POLL_S slices) while there is nothing to do."""
        idle = not self.has_work()
        while not self.stop.is_set():
            has_work = self.has_work()
            if not has_work:
                idle = True
                self._notify_idle_state_callbacks()
                # Not blocking (elastic EP in progress): come back soon, without spinning on the queue.
                timeout = POLL_S if self.process_input_queue_block else NONBLOCKING_POLL_S
            else:
                if idle:  # idle -> busy: the first token takes one step time too
                    idle = False
                    self.next_step_at = time.monotonic() + self.cfg.token_delay_s
                if self._step_due():
                    break
                timeout = max(0.0, min(POLL_S, self.next_step_at - time.monotonic()))
            try:
                req = self.input_queue.get(timeout=timeout) if timeout > 0 else self.input_queue.get_nowait()
            except queue.Empty:
                if not has_work and not self.process_input_queue_block:
                    break
                continue
            self._handle_client_request(*req)
        while not self.input_queue.empty():
            self._handle_client_request(*self.input_queue.get_nowait())

    def _notify_idle_state_callbacks(self) -> None:
        while self._idle_state_callbacks:
            self._idle_state_callbacks.pop()()

    def _process_engine_step(self) -> bool:
        """One step; True if it "executed the model" (had requests to run)."""
        self.next_step_at = time.monotonic() + self.cfg.token_delay_s
        if not self.scheduler.has_requests():
            return False
        executed = self.scheduler.has_unfinished_requests()
        with self._stats_lock:
            outputs = self.scheduler.step(wire.now())
        for client_index, eco in outputs.items():
            self.output_queue.put_nowait((client_index, eco))
        return executed

    def _maybe_publish_request_counts(self) -> None:
        """`_maybe_publish_request_counts` (DP variant stamps step_counter and current_wave)."""
        if not self.publish_dp_lb_stats:
            return
        counts = self.scheduler.get_request_counts()
        if counts != self.last_counts:
            self.last_counts = counts
            stats = wire.make_stats(*counts, self.scheduler.get_kv_cache_usage(),
                                    step_counter=self.step_counter if self.coordinated_dp else 0,
                                    current_wave=self.current_wave if self.coordinated_dp else 0)
            self.output_queue.put_nowait((-1, wire.make_coordinator_stats(stats)))

    def _dp_after_step(self, executed: bool, was_running: bool) -> None:
        """The wave bookkeeping of `DPEngineCoreProc.run_busy_loop` after a step."""
        local_unfinished = self.scheduler.has_unfinished_requests()
        if not executed and not local_unfinished and not self.engines_running:
            return  # all engines idle
        # (A step without requests is vLLM's dummy batch; here it is just the step time.)
        self.engines_running = self._has_global_unfinished_reqs(local_unfinished)
        if not self.engines_running:
            if self.dp_rank == 0 or not self.has_coordinator:
                client_index = -1 if self.has_coordinator else 0
                self.output_queue.put_nowait((client_index, wire.make_wave_complete(self.current_wave)))
            self.current_wave += 1
            self.step_counter = 0
        elif not was_running and self.has_coordinator and self.dp_rank == 0 and not self.pending_pause:
            self.output_queue.put_nowait((-1, wire.make_start_wave(self.current_wave)))

    def _has_global_unfinished_reqs(self, local_unfinished: bool) -> bool:
        """vLLM all-reduces [unfinished, pending_pause] over the DP group every dp_sync_interval steps.

        The emulator has no DP group: each rank decides from its own state at the same step counts,
        so ranks leave a wave independently (rank 0 still reports wave_complete, as in vLLM).
        """
        self.step_counter += 1
        if self.step_counter != 1 and self.step_counter % self.cfg.dp_sync_interval != 0:
            return True
        if self.pending_pause:
            self.ignore_start_dp_wave = True
            self.pending_pause = False
        return local_unfinished

    def _shutdown(self) -> int:
        """`_handle_shutdown` with shutdown_timeout 0: abort what is in flight, tell the clients, exit 0."""
        if not self.shutting_down:
            self.shutting_down = True
            aborted = self.scheduler.finish_all()
            if aborted:
                logger.info("[shutdown] EngineCore: aborting in-flight requests count=%d", len(aborted))
            self._send_abort_outputs(aborted)
        logger.info("[shutdown] EngineCore (emulated) rank %d exiting", self.cfg.rank)
        return EXIT_OK

    def _send_abort_outputs(self, aborted: list[Any]) -> None:
        by_client: dict[int, list[str]] = {}
        for req in aborted:
            by_client.setdefault(req.client_index, []).append(req.request_id)
        for client_index, req_ids in by_client.items():
            self.output_queue.put_nowait((client_index, wire.make_finish_outputs(req_ids, FinishReason.ABORT)))

    # ---- 4. Requests (EngineCoreProc._handle_client_request) ---------------------------------------

    def _handle_client_request(self, request_type: EngineCoreRequestType, request: Any) -> None:
        if request_type == EngineCoreRequestType.ADD:
            if self.shutting_down:
                self.output_queue.put_nowait(
                    (request.client_index, wire.make_finish_outputs([request.request_id], FinishReason.ABORT)))
                return
            self.add_request(request, request.current_wave)
        elif request_type == EngineCoreRequestType.ABORT:
            with self._stats_lock:
                self.scheduler.abort_requests(request)
        elif request_type == EngineCoreRequestType.UTILITY:
            client_idx, call_id, method_name, args = request
            self._call_utility(client_idx, call_id, method_name, tuple(args))
        elif request_type == EngineCoreRequestType.START_DP_WAVE and self.coordinated_dp:
            if self.ignore_start_dp_wave:
                return
            new_wave, exclude_eng_index = request
            if exclude_eng_index != self.engine_index and new_wave >= self.current_wave:
                self.current_wave = new_wave
                if not self.engines_running:
                    logger.debug("EngineCore starting idle loop for wave %d.", new_wave)
                    self.engines_running = True
        else:
            logger.error("Unrecognized input request type encountered: %s", request_type)

    def add_request(self, request: wire.EngineCoreRequest, request_wave: int = 0) -> None:
        with self._stats_lock:
            self.scheduler.add_request(request, wire.now())
        # DPEngineCoreProc.add_request: follow a newer wave, or ask for the next one.
        if self.coordinated_dp and self.has_coordinator and request_wave != self.current_wave:
            if request_wave > self.current_wave:
                self.current_wave = request_wave
            elif not self.engines_running and self.scheduler.pause_state == PauseState.UNPAUSED:
                self.engines_running = True
                self.output_queue.put_nowait((-1, wire.make_start_wave(self.current_wave)))

    # ---- 5. Utility calls ---------------------------------------------------------------------------

    # Methods of vLLM's EngineCore/EngineCoreProc the emulator answers (dense and MoE engines) ...
    UTILITY_METHODS = (
        "get_supported_tasks", "reset_mm_cache", "reset_prefix_cache", "reset_encoder_cache",
        "pause_scheduler", "resume_scheduler", "is_scheduler_paused", "sleep", "wake_up", "is_sleeping",
        "release_kv_cache_memory", "execute_dummy_batch", "add_lora", "remove_lora", "list_loras", "pin_lora",
        "set_weight_version", "get_weight_version", "profile", "collective_rpc", "save_sharded_state",
        "compute_weight_checksums", "get_kv_cache_group_metadata",
        ATTACH_UTILITY,  # corefleet's engine adds it (`enginecore.install_attach_support`)
    )
    # ... and those only DPEngineCoreProc (MoE, DP > 1) has.
    DP_UTILITY_METHODS = ("reinitialize_distributed", "commit_prepared_elastic_ep", "barrier")

    def _call_utility(self, client_idx: int, call_id: int, method_name: str, args: tuple[Any, ...]) -> None:
        with self._stats_lock:
            self.utility_calls[method_name] = self.utility_calls.get(method_name, 0) + 1
        if self.shutting_down:
            self.output_queue.put_nowait(
                (client_idx, wire.make_utility_output(call_id, failure_message=wire.SHUTTING_DOWN_MESSAGE)))
            return

        def enqueue(result: Any = None, error: BaseException | None = None) -> None:
            if error is not None:
                logger.error("Invocation of %s method failed: %s", method_name, error)
                message = wire.utility_failure_message(method_name, error)
                out = wire.make_utility_output(call_id, failure_message=message)
            else:
                out = wire.make_utility_output(call_id, result)
            self.output_queue.put_nowait((client_idx, out))

        try:
            allowed = self.UTILITY_METHODS + (self.DP_UTILITY_METHODS if self.coordinated_dp else ())
            if method_name not in allowed:
                cls = "DPEngineCoreProc" if self.coordinated_dp else "EngineCoreProc"
                raise AttributeError(f"'{cls}' object has no attribute '{method_name}'")
            method = getattr(self, method_name)
            result = method(*_convert_msgspec_args(method, args))
        except Exception as e:
            enqueue(error=e)
            return
        if isinstance(result, Future):  # deferred, like pause_scheduler's future in vLLM
            def done(f: Future[Any]) -> None:
                exc = f.exception()
                enqueue(error=exc) if exc is not None else enqueue(f.result())

            result.add_done_callback(done)
            return
        enqueue(result)

    def corefleet_attach(self, client_index: int) -> int:
        """corefleet's `ATTACH_UTILITY` (`enginecore.install_attach_support`): a replacement frontend re-attached
        under `client_index`; what its lost predecessor left here is aborted (no client waits for it)."""
        with self._stats_lock:
            orphans = [rid for rid, req in self.scheduler.requests.items() if req.client_index == client_index]
            self.scheduler.abort_requests(orphans)
        logger.info("Frontend %d re-attached: aborted the %d request(s) its predecessor left", client_index,
                    len(orphans))
        return len(orphans)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def reset_mm_cache(self) -> None:
        return None

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return True

    def reset_encoder_cache(self) -> None:
        return None

    def get_kv_cache_group_metadata(self) -> list[dict[str, int | str | None]]:
        return [{"group_idx": 0, "kind": "full_attention", "block_size": self.cfg.block_size, "sliding_window": None}]

    def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> Future[Any] | None:
        """`EngineCoreProc.pause_scheduler`: abort/wait -> PAUSED_NEW, keep -> PAUSED_ALL; done when idle."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"Invalid pause mode: {mode}")
        if mode == "abort":
            with self._stats_lock:
                aborted = self.scheduler.finish_all()
            self._send_abort_outputs(aborted)
        self.scheduler.set_pause_state(PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW)
        if self._pause_complete():
            return None
        future: Future[Any] = Future()
        self._idle_state_callbacks.append(lambda: future.set_result(None))
        return future

    def _pause_complete(self) -> bool:
        if self.coordinated_dp:  # DPEngineCoreProc: two-phase pause, finished at the next DP sync
            self.pending_pause = True
            self.engines_running = True
            return False
        return not self.has_work()

    def resume_scheduler(self) -> None:
        if self.coordinated_dp:
            if self.pending_pause or (self.engines_running and self.ignore_start_dp_wave):
                raise RuntimeError("resume_scheduler called while pause is still in flight. Wait for the "
                                   "pause future to resolve before resuming.")
            if self.engines_running:
                return
        self.scheduler.set_pause_state(PauseState.UNPAUSED)
        self.sleeping = False
        if self.coordinated_dp:
            self.ignore_start_dp_wave = False
            # The barrier all-reduce over the DP group: this rank's own state only.
            if self.scheduler.has_unfinished_requests():
                self.engines_running = True

    def is_scheduler_paused(self) -> bool:
        return self.scheduler.pause_state != PauseState.UNPAUSED

    def sleep(self, level: int = 1, mode: str = "abort") -> Future[Any] | None:
        result = self.pause_scheduler(mode=mode, clear_cache=level >= 1)
        if level >= 1:
            self.sleeping = True
        return result

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.sleeping = False
        self.resume_scheduler()
        return True

    def is_sleeping(self) -> bool:
        return self.is_scheduler_paused() or self.sleeping

    def release_kv_cache_memory(self) -> None:
        if not (self.is_scheduler_paused() and not self.scheduler.has_requests()):
            raise RuntimeError("release_kv_cache_memory() requires a completed pause first")

    def execute_dummy_batch(self) -> None:
        return None

    def add_lora(self, lora_request: Any) -> bool:
        raise ValueError("LoRA is not enabled (the emulated engine reports supports_lora=False)")

    def remove_lora(self, lora_id: int) -> bool:
        return False

    def list_loras(self) -> set[int]:
        return set(self._loras)

    def pin_lora(self, lora_id: int) -> bool:
        return False

    def set_weight_version(self, weight_version: str) -> None:
        self._weight_version = weight_version

    def get_weight_version(self) -> str:
        return self._weight_version

    def profile(self, is_start: bool = True, profile_prefix: str | None = None,
                delay_iterations: int | None = None, max_iterations: int | None = None) -> None:
        return None

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        raise NotImplementedError("the emulated engine has no workers")

    def save_sharded_state(self, path: str, pattern: str | None = None, max_size: int | None = None) -> None:
        raise NotImplementedError("the emulated engine has no weights")

    def compute_weight_checksums(self) -> list[dict[str, str]]:
        raise NotImplementedError("the emulated engine has no weights")

    def barrier(self) -> None:
        return None

    # ---- 6. Elastic EP (DPEngineCoreProc + ElasticEPScalingState) ----------------------------------

    def reinitialize_distributed(self, reconfig_request: ReconfigureDistributedRequest) -> str:
        """`DPEngineCoreProc.reinitialize_distributed`: start prepare; returns the ready key."""
        if self.eep_scaling_state is not None:
            raise RuntimeError("Elastic EP reconfiguration is already active")
        is_shutdown = reconfig_request.new_data_parallel_rank == ReconfigureRankType.SHUTDOWN_CURRENT_RANK
        is_scale_down = reconfig_request.new_data_parallel_size < self.data_parallel_size
        self.eep_scaling_state = EmulatedEEPState(
            worker_type="removing" if is_shutdown else "existing",
            scale_type="scale_down" if is_scale_down else "scale_up",
            store_host=reconfig_request.new_data_parallel_master_ip,
            store_port=reconfig_request.coord_store_port,
            ready_key=f"eep_ready/{self.dp_rank}",
            request=reconfig_request,
        )
        self.process_input_queue_block = False
        logger.info("[Elastic EP] Received reconfiguration request and starting scaling up/down "
                    "(%s, %d -> %d)", self.eep_scaling_state.worker_type, self.data_parallel_size,
                    reconfig_request.new_data_parallel_size)
        return self.eep_scaling_state.ready_key

    def commit_prepared_elastic_ep(self) -> None:
        state = self.eep_scaling_state
        if state is None or state.commit_requested or not state.is_ready_for_switch():
            raise RuntimeError("No prepared Elastic EP reconfiguration is ready")
        assert state.request is not None
        # vLLM's switch is a collective of the whole new group: committed before every rank is ready
        # for it, it would hang; the emulator refuses instead.
        missing = missing_ready_keys(get_cached_tcp_store_client(state.store_host, state.store_port),
                                     state.request.new_data_parallel_size)
        if missing:
            raise RuntimeError("Elastic EP commit before every rank of the new group is ready for the switch: "
                               + ", ".join(missing) + " not set")
        state.commit_requested = True
        self.process_input_queue_block = False
        logger.info("[Elastic EP] Committing prepared reconfiguration")

    def _init_elastic_ep_at_startup(self) -> None:
        """What a vLLM engine with elastic EP does with the coordination store at startup: it opens the store
        at the DP master address (`parallel_state._init_elastic_ep_world`) and forms its DP group through it
        (`ParallelConfig._pick_stateless_dp_port`: rank 0 binds a port on that address and publishes it as
        `dp_master_port`, the others read it and connect). So the store must exist, and the DP master
        address must be rank 0's own (docs/vllm-protocol.md §10.2)."""
        host, port = self._init_store_address()
        if not port:
            raise RuntimeError(f"elastic EP needs the fleet's coordination store at startup, and INIT's "
                               f"_coord_store_port is 0 (DP master {host})")
        store = get_cached_tcp_store_client(host, port)
        if self.dp_rank == 0:
            sock = tcp_socket(host)
            sock.bind((host, 0))  # fails unless the DP master address is this engine's own
            sock.listen()
            self._dp_group_socket = sock
            dp_port = sock.getsockname()[1]
            store.set(DP_MASTER_PORT_KEY, str(dp_port).encode())
        else:
            dp_port = int(store.get(DP_MASTER_PORT_KEY).decode())  # waits for rank 0, up to the store's timeout
            with socket.create_connection((host, dp_port), timeout=STORE_TIMEOUT_S):
                pass
        logger.info("[Elastic EP] DP group formed through the coordination store %s:%d (rank 0 at port %d)",
                    host, port, dp_port)

    def _init_store_address(self) -> tuple[str, int]:
        """The coordination store INIT named: (the DP master address, `_coord_store_port`; 0 if none)."""
        host = str(self.parallel_config.get("data_parallel_master_ip", self.cfg.data_parallel_master_ip))
        return host, int(self.parallel_config.get("_coord_store_port", 0))

    def _eep_scale_up_before_kv_init(self) -> None:
        """`DPEngineCoreProc._eep_scale_up_before_kv_init`: a new engine of a live scale-up. It joins the new
        group (GROUP_JOIN_KEY) here, before its READY, as vLLM's new engine does in its init."""
        host, port = self._init_store_address()
        if not port:
            raise RuntimeError("a scale-up engine needs the resize's coord store: INIT's _coord_store_port is 0")
        self.ignore_start_dp_wave = True
        # PRE_KV_INIT (weights from the existing ranks, KV-size MIN all-reduce) has nothing to do here.
        self.eep_scaling_state = EmulatedEEPState(worker_type="new", scale_type="scale_up", store_host=host,
                                                  store_port=port, ready_key=f"eep_ready/{self.dp_rank}")
        self.process_input_queue_block = False
        logger.info("[Elastic EP] New engine of a scale-up to %d ranks (coord store %s:%d)",
                    self.data_parallel_size, host, port)
        join_new_group(get_cached_tcp_store_client(host, port), self.dp_rank, self.data_parallel_size, self.stop)
        logger.info("[Elastic EP] Joined the new group of %d ranks", self.data_parallel_size)

    def _mark_ready_for_switch(self, state: EmulatedEEPState) -> Future[None]:
        """`ElasticEPScalingState._mark_ready_for_switch`: store.set(ready_key, b"1"), off the busy loop."""
        if not state.store_port:
            raise RuntimeError("no coord store port (INIT's _coord_store_port is 0): cannot publish " + state.ready_key)

        def set_key() -> None:
            store = get_cached_tcp_store_client(state.store_host, state.store_port)
            if state.worker_type == "existing":  # a new rank joined before its READY
                assert state.request is not None
                join_new_group(store, self.dp_rank, state.request.new_data_parallel_size, self.stop)
            store.set(state.ready_key, b"1")
            logger.info("[Elastic EP] Set %s in the coord store %s:%d", state.ready_key, state.store_host,
                        state.store_port)

        return self._eep_executor.submit(set_key)

    def _progress_elastic_ep(self) -> None:
        """`DPEngineCoreProc.run_busy_loop`'s elastic block with `ElasticEPScalingState.progress`."""
        state = self.eep_scaling_state
        if state is None:
            return
        if state.commit_requested or not state.is_ready_for_switch():
            self._progress(state)
        if state.is_complete():
            if state.worker_type == "removing":
                logger.info("[Elastic EP] Rank %d removed: exiting", self.dp_rank)
                raise EngineExit(EXIT_OK)
            self.process_input_queue_block = True
            self.eep_scaling_state = None
        elif not state.commit_requested and state.is_ready_for_switch():
            self.process_input_queue_block = True

    def _progress(self, state: EmulatedEEPState) -> None:
        if state.worker_type == "removing":
            # PREPARE: commit_scale_down(removing=True) is the EPLB collective; then SHUTDOWN_COMPLETE.
            state.state = COMPLETE
            self._eep_send_engine_core_notification(EEPNotificationType.SHUTDOWN_COMPLETE)
            return
        if state.state == PREPARE:
            if state._pending is None:
                state._pending = self._mark_ready_for_switch(state)
            if not state._pending.done():
                return
            state._pending.result()  # a store error is fatal, as in vLLM
            state._pending = None
            # "new": the blocking wave-state all-reduce and commit_scale_up(False) follow at once.
            state.state = COMPLETE if state.worker_type == "new" else READY_FOR_SWITCH
        elif state.state == READY_FOR_SWITCH and state.commit_requested:
            assert state.request is not None
            self._update_parallel_config(state.request)
            state.state = COMPLETE
            # _send_reconfigure_finished: only rank 0 of the new DP group (KEEP keeps the rank).
            if self.dp_rank == 0:
                self._eep_send_engine_core_notification(EEPNotificationType.RECONFIGURE_FINISHED)

    def _update_parallel_config(self, req: ReconfigureDistributedRequest) -> None:
        self.data_parallel_size = req.new_data_parallel_size
        if req.new_data_parallel_rank != ReconfigureRankType.KEEP_CURRENT_RANK:
            self.dp_rank = req.new_data_parallel_rank
        self.parallel_config.update(
            data_parallel_size=req.new_data_parallel_size,
            data_parallel_master_ip=req.new_data_parallel_master_ip,
            data_parallel_master_port=req.new_data_parallel_master_port,
            _data_parallel_master_port_list=list(req.new_data_parallel_master_port_list),
            _coord_store_port=req.coord_store_port,
        )
        logger.info("[Elastic EP] Switched to new setup: data_parallel_size=%d", self.data_parallel_size)

    def _eep_send_engine_core_notification(self, kind: EEPNotificationType) -> None:
        self.notifications_sent.append(kind.value)
        self.output_queue.put_nowait((0, wire.make_eep_notification(kind, self.dp_rank, self.engine_index)))

    # ---- 7. Introspection (/stats) ------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        with self._stats_lock:
            c = self.scheduler.counters
            running, waiting = self.scheduler.get_request_counts()
            state = self.eep_scaling_state
            return {
                "rank": self.cfg.rank,
                "ready": self.ready.is_set(),
                "ready_after_s": self.ready_after_s,
                "moe": self.coordinated_dp,
                "data_parallel_size": self.data_parallel_size,
                "requests_added": c.requests_added,
                "requests_finished": c.requests_finished,
                "requests_aborted": c.requests_aborted,
                "tokens_generated": c.tokens_generated,
                "steps": c.steps,
                "added_ids": list(c.added_ids),
                "aborted_ids": list(c.aborted_ids),
                "running": running,
                "waiting": waiting,
                "paused": self.scheduler.pause_state.name,
                "current_wave": self.current_wave,
                "engines_running": self.engines_running,
                "utility_calls": dict(self.utility_calls),
                "notifications_sent": list(self.notifications_sent),
                "elastic_ep": None if state is None else {
                    "worker_type": state.worker_type, "scale_type": state.scale_type, "state": state.state,
                    "commit_requested": state.commit_requested},
            }


def _convert_msgspec_args(method: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, ...]:
    """`EngineCoreProc._convert_msgspec_args`: dicts/lists -> the msgspec Struct a parameter expects."""
    if not args:
        return args
    hints = typing.get_type_hints(method)
    names = [n for n in method.__code__.co_varnames[1:method.__code__.co_argcount]]
    converted = []
    for value, name in zip(args, names, strict=False):
        hint = hints.get(name)
        if isinstance(hint, type) and issubclass(hint, msgspec.Struct) and not isinstance(value, hint):
            value = msgspec.convert(value, type=hint)
        converted.append(value)
    return (*converted, *args[len(converted):])
