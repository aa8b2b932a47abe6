# SPDX-License-Identifier: Apache-2.0
"""Everything corefleet changes in vLLM 0.32.0 to run frontend, coordinator and engines in separate pods.

Each change names the vLLM function it replaces or wraps and why. `tests/e2e/test_vllm_pins.py`
pins every one of those functions (signature and the lines this module depends on), so an upgrade
of vLLM that moves them fails the build instead of misbehaving at run time.

What needs no change at all, for the record:

* The standalone coordinator: vLLM's `DPCoordinatorProc.run_coordinator` runs unmodified on fixed
  ports (`corefleet_client.coordinator`).
* The frontend's handshake with engines in other pods: `MPClient.__init__` already has a path for
  "engines managed externally" (`client_addresses`, used by vLLM's multi-API-server mode), and
  vLLM's own `bind_engine_zmq_listeners` and `wait_for_engine_startup` do the listening and the
  HELLO/INIT/READY exchange; the frontend (`corefleet_client.frontend.client`) calls them itself.
* Dense engines: with a dense model every DP rank is an independent engine
  (`reconfigure_for_independent_dp_rank`); INIT carries no DP master address, so engine 0 can be
  anywhere.

The changes:

1. `use_client_factory` replaces `EngineCoreClient.make_async_mp_client`
   (vllm/v1/engine/core_client.py). AsyncLLM builds its engine-core client only through this
   static factory and takes no class parameter, so the frontend cannot otherwise get corefleet's
   DPLB subclass, nor hand it the fleet's options and registry. The replacement builds corefleet's
   client (`frontend.client.client_factory`: the class with those bound as constructor arguments)
   wherever vLLM would build an internal load-balancing client, `DPLBAsyncMPClient` (DP > 1) or
   `AsyncMPClient` (DP = 1): a fleet of one rank uses the same DPLB client, so that it can grow
   (change 4), and defers to vLLM otherwise (external load balancing).
2. `advertised_parallel_config` replaces the `data_parallel_master_ip` that
   `wait_for_engine_startup` (vllm/v1/engine/utils.py) sends in INIT for MoE fleets
   (`coordinated_dp`). vLLM sends the frontend's own address, because it assumes engine rank 0 runs
   next to the rank-0 frontend: engine 0 `bind()`s its DP group port there
   (`ParallelConfig._pick_stateless_dp_port`) and the other ranks connect to it. In corefleet
   engine 0 has its own pod, so INIT must name engine 0's address instead. Without a coordination
   store (`_coord_store_port == 0`, the case for a non-elastic fleet whose frontend has no local
   engines) the port comes from the INIT's `data_parallel_master_port`, a port that is free in
   engine 0's fresh pod. With elastic EP every engine opens a coordination store at startup, at
   that same address (`parallel_state._init_elastic_ep_world`), and vLLM's multiprocess launch
   creates none: engine 0's launcher serves one (`corefleet_client.coordstore`) on a fixed port,
   which INIT advertises as `_coord_store_port`, and makes a fresh one for each resize on
   request (vLLM's store keys are not scoped per resize; `frontend.elastic` asks for it).
3. `install_fleet_health_check` wraps `AsyncLLM.check_health` (vllm/v1/engine/async_llm.py).
   vLLM's `/health` is 503 only when the whole engine-core client is dead, and a client with
   externally managed engines never learns that one died: a dense fleet kept answering 200 while
   requests routed to a killed rank hung (docs/vllm-on-cpu.md). The wrapper also raises
   `EngineDeadError` (which `/health` turns into 503) while the client reports that no rank serves
   (`check_fleet_health`), without marking the whole client dead. One Dead or Unresponsive rank
   does not make it 503: the other ranks serve on, and new requests avoid that rank.
4. `init_dplb_client` replaces `DPLBAsyncMPClient.__init__`: the same statements without its
   `assert len(self.core_engines) > 1`. vLLM's DP client is the only one that can change its
   membership (its stats task and the coordinator follow `SCALE_ELASTIC_EP`), and the assertion
   would keep a fleet of one rank from ever growing, or a fleet from shrinking to one.
5. `install_async_llm_hook` wraps `AsyncLLM.__init__`: once vLLM has built the AsyncLLM, its
   engine-core client gets it (`attach_async_llm`). The client needs two things only AsyncLLM has:
   its stat loggers, which must follow the fleet's ranks (`frontend.stats`), and its output
   processor, through which a request is ended with an explicit error (change 6).
6. `fail_requests` ends requests the client cannot finish (their rank died, or a resize retired
   their rank at the end of its drain timeout) with an error that names why. vLLM's only way for a
   client to end a request is `FinishReason.ERROR`, which the API turns into a bare "Internal
   server error"; this puts a `GracefulHTTPError` (the status and message reach the HTTP client,
   also as the error event of a stream) into the request's output queue, then drops the request
   from the output processor as `AsyncLLM.abort` does (`OutputProcessor.abort_requests`).
7. `yielding_output_socket` changes what `AsyncMPClient._ensure_output_queue_task` reads engine
   outputs from: the same socket, but every receive lets the event loop run other tasks. vLLM's
   reader (`process_outputs_socket`) awaits `recv_multipart`, and pyzmq's asyncio socket returns an
   already completed future whenever a message is waiting, so as long as the engines send faster
   than the reader decodes, the reader never yields: the output handler, every streaming response,
   the admin API's and the liveness watcher's work wait. Seen with two fast CPU engines: the first
   token of a stream reached the client after 10-30 s, and the liveness watcher, starved as long,
   declared a healthy rank dead. It yields once the reader ran `OUTPUT_READER_SLICE_S` (10 ms) without a
   pause, not after every message: yielding per message made vLLM's output handler run per message, so
   every streamed token woke its HTTP response alone (one SSE chunk a token, where stock vLLM merges what
   arrived meanwhile into one), which cost the frontend 2.6x stock's CPU per streamed request with fast
   engines (bench_frontend.py --stream: 149 against 366 req/s; 401 against 419 with the slice). A receive
   that finds no message waiting is a pause (the loop runs other tasks then), and the next slice starts
   when it returns: counting the pause as reading made the reader yield again at the first message after
   most pauses, so a request's tokens came in 1.10 stream chunks where stock's came in 1.00. The slice was
   2 ms until 2026-12-05: on a slower machine a slice ended within more requests' bursts of tokens (1.14-1.24
   chunks a request, frontend CPU per streamed request 1.07x stock's, requests/s 0.93x); with 10 ms, 1.00
   chunks, 0.99x the CPU, 1.01x the requests/s (bench_frontend.py --stream, K=1, pinned). While engines
   flood the reader, every other task of the frontend waits at most that long; stock's reader never yields.
   The cleanup in `BackgroundResources` still sees vLLM's socket.
8. `install_public_route_filter` wraps `build_app` as `vllm.entrypoints.launchers.api_server.entry`
   calls it (`build_and_serve`): the FastAPI app vLLM builds loses `/scale_elastic_ep` and
   `/is_scaling_elastic_ep` (vllm/entrypoints/serve/elastic_ep/api_router.py, attached by
   `register_api_routers` for every "generate" model). They take no authentication and are
   served on the public port; a fleet's size is the operator's, changed through the frontend's
   authenticated admin API. They answer 404. The same wrapper adds corefleet's middleware to the app
   (`frontend.hold`: requests wait while no rank takes any), around its built middleware stack,
   before the app serves.
9. `install_frontend_eplb_config` wraps `EngineArgs.create_engine_config` (vllm/engine/arg_utils.py)
   in the frontend. An MoE frontend gets the engines' EPLB and elastic-EP flags, because its
   `ParallelConfig.compute_hash` is what each engine's READY is checked against; but vLLM refuses
   EPLB on a platform that is not CUDA, ROCm or XPU (`ParallelConfig._validate_parallel_config`), and a
   frontend pod has no GPU (nor does this machine). The frontend runs no expert: where the
   platform would refuse, its config is built with both off and they are set afterwards on the
   built `ParallelConfig`, with `eplb_config.communicator` and `elastic_ep_max_dp_size` as
   `__post_init__` sets them on a GPU (`set_eplb_as_on_a_gpu`; the emulator hashes READY the same
   way), and the redundant experts (refused with EPLB off; set on the frontend of an MoE fleet
   recreated at a size it was resized to). What vLLM would have checked about them (EP on, NIXL for
   async EPLB) the engines check at their own startup.
10. `attaching` wraps `make_zmq_socket` as `vllm.v1.engine.core_client` calls it while an `MPClient` is
   built over engines that already run (a frontend that replaces a lost one: `frontend.attach`). With
   engines "managed externally", `MPClient.__init__` creates its requests ROUTER and then waits for one
   message from every engine on it: the ready response each engine sends once, when its requests DEALER
   first connects. Running engines reconnect to a replacement frontend by themselves (libzmq reconnects
   and resolves the address again) but send nothing; the wrapper, once the ROUTER exists and before
   vLLM's wait, asks every engine to announce itself again (the `ATTACH_UTILITY` call, answered by
   `enginecore.install_attach_support`).
   A rank left out of the attach (`absent`: a rank whose replacement the lost frontend was running, whose new
   engine the operator deletes; `frontend.attach`) would keep vLLM waiting: its identity stands in that wait with
   a copy of a real ready response (`StandInReadySocket`, over the sync shadow of the ROUTER vLLM reads them from),
   so that the fleet's summed blocks count it as a replaced rank's engine does (`frontend.replace`). The client then
   marks it Dead, ready for a replacement.
11. `UtilityResults` is the client's `utility_results` (the futures of its utility calls by call
   id; `KubeDPLBClient.utility_results` wraps the dict vLLM's `MPClient.__init__` sets): vLLM pops an
   answer's future by call id (`_process_utility_output`) and a call id it does not know raises
   KeyError in the output task, which ends the client. A replacement frontend receives answers to
   calls it never made: its lost predecessor's, still queued on the engines' output sockets, and
   its own attach calls. They are logged and dropped.

Not a change of vLLM's code but of how corefleet's client answers one of its methods:
`KubeDPLBClient.call_utility_all_async` overrides `AsyncMPClient.call_utility_all_async`
(vllm/v1/engine/core_client.py), through which every utility of a DPLB client goes (its
`call_utility_async` takes the first of them): `/reset_prefix_cache`, `/sleep`, `/wake_up`,
`/is_sleeping`, collective RPCs. vLLM gathers an answer from every engine and waits forever on a
hung one; the override skips Dead and Unresponsive ranks.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import inspect
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator
from http import HTTPStatus
from typing import Any

import zmq
from vllm.config import ParallelConfig
from vllm.exceptions import GracefulHTTPError
from vllm.v1.engine import core_client as vllm_core_client
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core_client import DPAsyncMPClient, EngineCoreClient

logger = logging.getLogger("corefleet.frontend")

_ORIGINAL_FACTORY = EngineCoreClient.make_async_mp_client
_ORIGINAL_CHECK_HEALTH = AsyncLLM.check_health
_ORIGINAL_ASYNC_LLM_INIT = AsyncLLM.__init__


# vLLM's routes corefleet does not serve on the public port (change 8).
UNSERVED_ROUTES = ("/scale_elastic_ep", "/is_scaling_elastic_ep")


def use_client_factory(dp_client: Callable[..., Any]) -> None:
    """Make AsyncLLM build corefleet's client with `dp_client` for every internal load-balancing fleet (change 1)."""

    def make_async_mp_client(vllm_config: Any, executor_class: Any, log_stats: bool,
                             client_addresses: dict[str, Any] | None = None, client_count: int = 1,
                             client_index: int = 0, renderer: Any = None) -> Any:
        pc = vllm_config.parallel_config
        if not pc.data_parallel_external_lb:
            return dp_client(vllm_config, executor_class, log_stats, client_addresses, client_count,
                             client_index, renderer=renderer)
        return _ORIGINAL_FACTORY(vllm_config, executor_class, log_stats, client_addresses, client_count,
                                 client_index, renderer=renderer)

    EngineCoreClient.make_async_mp_client = staticmethod(make_async_mp_client)


def advertised_parallel_config(parallel_config: ParallelConfig, engine0_address: str | None,
                               coord_store_port: int | None = None) -> ParallelConfig:
    """The ParallelConfig whose fields INIT advertises to engines (change 2).

    A copy with `data_parallel_master_ip` set to engine rank 0's address and, for elastic EP,
    `_coord_store_port` set to the startup's coordination store beside it (`corefleet_client.coordstore`);
    the frontend's own config is left as it is (it binds its sockets on its own address).
    `compute_hash`, which the frontend checks READY against, ignores both, so the copy hashes the same.
    """
    if not engine0_address:
        return parallel_config
    advertised = copy.copy(parallel_config)
    advertised.data_parallel_master_ip = engine0_address
    if coord_store_port:
        advertised._coord_store_port = coord_store_port
    return advertised


def install_fleet_health_check() -> None:
    """Make `/health` 503 while the engine-core client reports a dead rank (change 3).

    The client opts in with a `check_fleet_health()` method that raises EngineDeadError.
    """

    async def check_health(self: AsyncLLM) -> None:
        await _ORIGINAL_CHECK_HEALTH(self)
        check_fleet = getattr(self.engine_core, "check_fleet_health", None)
        if check_fleet is not None:
            check_fleet()

    AsyncLLM.check_health = check_health


def init_dplb_client(client: Any, vllm_config: Any, executor_class: Any, log_stats: bool,
                     client_addresses: dict[str, Any] | None, client_count: int, client_index: int,
                     renderer: Any) -> None:
    """`DPLBAsyncMPClient.__init__` without its "more than one engine" assertion (change 4)."""
    client.client_count = client_count
    # To route aborts to the correct engine.
    client.reqs_in_flight = {}
    # Exact per-engine count of this client's unfinished requests.
    client.engine_inflight = Counter()
    DPAsyncMPClient.__init__(client, vllm_config, executor_class, log_stats, client_addresses, client_count,
                             client_index, renderer)
    client._prepared_elastic_ep = None
    client.eng_start_index = (len(client.core_engines) * client.client_index) // client_count


def install_async_llm_hook() -> None:
    """Hand every AsyncLLM to its engine-core client once built (change 5).

    The client opts in with `attach_async_llm(async_llm, stat_logger_options)`, where the options are
    the keyword arguments AsyncLLM built its `StatLoggerManager` with, besides the engine indexes.
    """

    signature = inspect.signature(_ORIGINAL_ASYNC_LLM_INIT)

    @functools.wraps(_ORIGINAL_ASYNC_LLM_INIT)
    def __init__(self: AsyncLLM, *args: Any, **kwargs: Any) -> None:
        _ORIGINAL_ASYNC_LLM_INIT(self, *args, **kwargs)
        attach = getattr(self.engine_core, "attach_async_llm", None)
        if attach is not None:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            given = bound.arguments
            attach(self, {
                "vllm_config": given["vllm_config"],
                "custom_stat_loggers": given["stat_loggers"],
                "enable_default_loggers": given["log_stats"],
                "aggregate_engine_logging": given["aggregate_engine_logging"],
                "client_count": given["client_count"],
            })

    AsyncLLM.__init__ = __init__


def set_stat_loggers(async_llm: AsyncLLM, loggers: Any) -> None:
    """Make AsyncLLM record into `loggers` (also in an output handler that already runs)."""
    async_llm.logger_manager = loggers
    ref = getattr(async_llm, "_logger_ref", None)
    if ref is not None:
        ref[0] = loggers


def fail_requests(async_llm: AsyncLLM, request_ids: Iterable[str], message: str,
                  status: HTTPStatus = HTTPStatus.SERVICE_UNAVAILABLE) -> list[str]:
    """End these requests (internal ids) with an HTTP error naming why (change 6); the ids it ended."""
    output_processor = async_llm.output_processor
    ids = list(request_ids)
    for request_id in ids:
        state = output_processor.request_states.get(request_id)
        if state is not None and state.queue is not None:
            state.queue.put(GracefulHTTPError(message, status))
    ended: list[str] = output_processor.abort_requests(ids, internal=True)
    return ended


# How long vLLM's engine-output reader may run without letting other tasks run (change 7).
OUTPUT_READER_SLICE_S = 0.010


class YieldingSocket:
    """An asyncio ZMQ socket whose `recv_multipart` lets other tasks run once the reader has run for
    `OUTPUT_READER_SLICE_S` without a pause (change 7)."""

    def __init__(self, socket: Any) -> None:
        self._socket = socket
        self._since = time.monotonic()
        self._paused = False

    def recv_multipart(self, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        """pyzmq's future itself (awaited by vLLM's reader), but after a slice a coroutine that yields first: no
        coroutine of its own per message, as the reader receives about ten messages per request."""
        received = self._socket.recv_multipart(*args, **kwargs)
        if not received.done():  # no message waiting: the reader pauses here and other tasks run
            self._paused = True
            return received  # type: ignore[no-any-return]
        now = time.monotonic()
        if self._paused:  # the reader's first receive since its pause: a new slice
            self._paused = False
            self._since = now
        elif now - self._since >= OUTPUT_READER_SLICE_S:
            return self._yielding_first(received)
        return received  # type: ignore[no-any-return]

    async def _yielding_first(self, received: Awaitable[Any]) -> Any:
        """The reader read for a slice: other tasks run, then a new slice starts with this message."""
        await asyncio.sleep(0)
        self._since = time.monotonic()
        return await received

    def __getattr__(self, name: str) -> Any:
        return getattr(self._socket, name)


@contextlib.contextmanager
def yielding_output_socket(resources: Any) -> Iterator[None]:
    """While vLLM creates its output task, `resources.output_socket` yields (change 7); vLLM's own socket after."""
    real = resources.output_socket
    resources.output_socket = YieldingSocket(real) if real is not None else None
    try:
        yield
    finally:
        resources.output_socket = real


def remove_routes(app: Any, paths: Iterable[str]) -> list[str]:
    """Remove the routes with these paths from a FastAPI/Starlette app; the paths removed."""
    unserved = set(paths)
    routes = app.router.routes
    removed = [r.path for r in routes if getattr(r, "path", None) in unserved]
    routes[:] = [r for r in routes if getattr(r, "path", None) not in unserved]
    return removed


def set_eplb_as_on_a_gpu(config: ParallelConfig, *, enable_eplb: bool, enable_elastic_ep: bool,
                         elastic_ep_max_dp_size: int | None = None, num_redundant_experts: int = 0) -> None:
    """Set EPLB and elastic EP on a ParallelConfig built with both off, as `ParallelConfig.__post_init__` sets
    them where EPLB runs (CUDA): the flags, the EPLB communicator it picks when none is given, the
    elastic-EP maximum size (built with elastic EP off, it is the DP size), and the redundant experts
    (refused with EPLB off, so built with none) (change 9)."""
    config.enable_eplb = enable_eplb
    config.enable_elastic_ep = enable_elastic_ep
    if enable_elastic_ep and elastic_ep_max_dp_size is not None:
        config.elastic_ep_max_dp_size = elastic_ep_max_dp_size
    config.eplb_config.num_redundant_experts = num_redundant_experts
    if enable_eplb and config.eplb_config.communicator is None:
        from vllm.distributed.nixl_utils import is_nixl_available

        if is_nixl_available():
            config.eplb_config.communicator = "nixl"
        else:
            config.eplb_config.communicator = "pynccl" if enable_elastic_ep else "torch_gloo"


def install_frontend_eplb_config() -> None:
    """Build the frontend's config where the platform refuses EPLB, with its EPLB flags kept for the hash (change 9)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    original = getattr(EngineArgs.create_engine_config, "__wrapped__", EngineArgs.create_engine_config)

    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.enable_eplb or current_platform.is_cuda_alike() or current_platform.is_xpu():
            return original(self, *args, **kwargs)
        eplb, elastic, eplb_config = self.enable_eplb, self.enable_elastic_ep, self.eplb_config
        redundant = int(getattr(eplb_config, "num_redundant_experts", 0) or 0)
        self.enable_eplb = self.enable_elastic_ep = False
        if redundant:  # vLLM refuses redundant experts with EPLB off: they are set afterwards too
            self.eplb_config = copy.copy(eplb_config)
            self.eplb_config.num_redundant_experts = 0
        try:
            config = original(self, *args, **kwargs)
        finally:
            self.enable_eplb, self.enable_elastic_ep, self.eplb_config = eplb, elastic, eplb_config
        set_eplb_as_on_a_gpu(config.parallel_config, enable_eplb=eplb, enable_elastic_ep=elastic,
                             elastic_ep_max_dp_size=self.elastic_ep_max_dp_size, num_redundant_experts=redundant)
        return config

    EngineArgs.create_engine_config = create_engine_config


def install_public_route_filter(prepare: Callable[[Any], None] | None = None) -> None:
    """Make the API server's app serve none of `UNSERVED_ROUTES` (change 8): they answer 404; then `prepare(app)`
    (corefleet's middleware: `frontend.hold`)."""
    from vllm.entrypoints.launchers.api_server import entry

    original = getattr(entry.build_app, "__wrapped__", entry.build_app)

    @functools.wraps(original)
    def build_app(*args: Any, **kwargs: Any) -> Any:
        app = original(*args, **kwargs)
        remove_routes(app, UNSERVED_ROUTES)
        if prepare is not None:
            prepare(app)
        return app

    entry.build_app = build_app



@contextlib.contextmanager
def attaching(announce: Callable[[Any], None], present: int = 0, absent: Iterable[bytes] = ()) -> Iterator[None]:
    """While an MPClient is built over running engines, `announce(requests_router)` runs once vLLM created the
    requests ROUTER, before it waits for every engine's message there. The engine identities `absent` are not
    waited for: once the `present` others answered, each stands in with a copy of a real ready response (change 10)."""
    original = vllm_core_client.make_zmq_socket
    original_zmq = vllm_core_client.zmq
    absent = tuple(absent)

    def make_zmq_socket(ctx: Any, path: str, socket_type: Any, *args: Any, **kwargs: Any) -> Any:
        made = original(ctx, path, socket_type, *args, **kwargs)
        if socket_type == zmq.ROUTER:
            announce(made)
        return made

    vllm_core_client.make_zmq_socket = make_zmq_socket
    if absent:
        vllm_core_client.zmq = ZmqWithStandIns(present, absent)
    try:
        yield
    finally:
        vllm_core_client.make_zmq_socket = original
        vllm_core_client.zmq = original_zmq


class ZmqWithStandIns:
    """The `zmq` module as `MPClient.__init__` sees it while attaching with absent engines: the same, except that
    `zmq.Socket.shadow` (how it reads the ready responses: `sync_input_socket`) gives a `StandInReadySocket`."""

    def __init__(self, present: int, absent: tuple[bytes, ...]) -> None:
        class Socket(zmq.Socket):  # type: ignore[type-arg]
            @classmethod
            def shadow(cls, address: Any) -> Any:
                return StandInReadySocket(zmq.Socket.shadow(address), present, absent)

        self.Socket = Socket

    def __getattr__(self, name: str) -> Any:
        return getattr(zmq, name)


class StandInReadySocket:
    """The ROUTER's sync shadow as vLLM waits on it for one ready response per engine: real messages pass; once one
    came from each of the `present` engines, every `absent` identity not heard from gets a copy of the last real
    ready response (an absent engine that did answer keeps its own)."""

    def __init__(self, socket: Any, present: int, absent: tuple[bytes, ...]) -> None:
        self._socket = socket
        self._present = present
        self._absent = set(absent)
        self._heard: set[bytes] = set()
        self._stand_ins: list[list[bytes]] = []

    def poll(self, timeout: int | None = None, flags: int = zmq.POLLIN) -> int:
        if self._stand_ins:
            return int(zmq.POLLIN)
        return int(self._socket.poll(timeout=timeout, flags=flags))

    def recv_multipart(self, *args: Any, **kwargs: Any) -> list[bytes]:
        if self._stand_ins:
            return self._stand_ins.pop(0)
        frames: list[bytes] = self._socket.recv_multipart(*args, **kwargs)
        identity = frames[0]
        if identity in self._absent:
            self._absent.discard(identity)
            logger.info("Engine rank %d answered although left out of the attach",
                        int.from_bytes(identity, "little"))
            return frames
        self._heard.add(identity)
        if len(self._heard) >= self._present and self._absent:
            payload = frames[1] if len(frames) > 1 else b""
            self._stand_ins = [[identity, payload] for identity in sorted(self._absent)]
            self._absent.clear()
        return frames


class UtilityResults(dict[int, Any]):
    """A client's utility futures by call id, where an answer to a call this client never made is dropped."""

    def pop(self, call_id: int, *default: Any) -> Any:
        if call_id in self or default:
            return super().pop(call_id, *default)
        logger.info("Dropping the answer to utility call %d, which this frontend did not make (a predecessor's, "
                    "or a re-attach call)", call_id)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.cancel()  # vLLM's setter then meets InvalidStateError, which it ignores
        return future
