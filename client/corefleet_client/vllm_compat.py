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

1. `use_client_class` replaces `EngineCoreClient.make_async_mp_client`
   (vllm/v1/engine/core_client.py). AsyncLLM builds its engine-core client only through this
   static factory and takes no class parameter, so the frontend cannot otherwise get corefleet's
   DPLB subclass. The replacement returns corefleet's classes exactly where vLLM would return
   `DPLBAsyncMPClient` (DP > 1, internal load balancing) or `AsyncMPClient` (DP = 1), and defers
   to vLLM otherwise (external load balancing).
2. `advertised_parallel_config` replaces the `data_parallel_master_ip` that
   `wait_for_engine_startup` (vllm/v1/engine/utils.py) sends in INIT for MoE fleets
   (`coordinated_dp`). vLLM sends the frontend's own address, because it assumes engine rank 0 runs
   next to the rank-0 frontend: engine 0 `bind()`s its DP group port there
   (`ParallelConfig._pick_stateless_dp_port`) and the other ranks connect to it. In corefleet
   engine 0 has its own pod, so INIT must name engine 0's address instead. Without a coordination
   store (`_coord_store_port == 0`, the case for a non-elastic fleet whose frontend has no local
   engines) the port comes from the INIT's `data_parallel_master_port`, a port that is free in
   engine 0's fresh pod. The elastic path (a coordination store per resize) is not covered here.
3. `install_fleet_health_check` wraps `AsyncLLM.check_health` (vllm/v1/engine/async_llm.py).
   vLLM's `/health` is 503 only when the whole engine-core client is dead, and a client with
   externally managed engines never learns that one died: a dense fleet kept answering 200 while
   requests routed to a killed rank hung (docs/vllm-on-cpu.md). The wrapper also raises
   `EngineDeadError` (which `/health` turns into 503) while the client reports a dead rank, without
   marking the whole client dead, so requests on the surviving ranks finish.
"""

from __future__ import annotations

import copy
from typing import Any

from vllm.config import ParallelConfig
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core_client import EngineCoreClient

_ORIGINAL_FACTORY = EngineCoreClient.make_async_mp_client
_ORIGINAL_CHECK_HEALTH = AsyncLLM.check_health


def use_client_class(dp_client: type, single_client: type) -> None:
    """Make AsyncLLM build corefleet's clients (change 1).

    `dp_client` wherever vLLM would build a DPLBAsyncMPClient (DP > 1, internal load balancing),
    `single_client` where it would build a plain AsyncMPClient (DP = 1); vLLM's own choice otherwise.
    """

    def make_async_mp_client(vllm_config: Any, executor_class: Any, log_stats: bool,
                             client_addresses: dict[str, Any] | None = None, client_count: int = 1,
                             client_index: int = 0, renderer: Any = None) -> Any:
        pc = vllm_config.parallel_config
        if not pc.data_parallel_external_lb:
            client_class = dp_client if pc.data_parallel_size > 1 else single_client
            return client_class(vllm_config, executor_class, log_stats, client_addresses, client_count,
                                client_index, renderer=renderer)
        return _ORIGINAL_FACTORY(vllm_config, executor_class, log_stats, client_addresses, client_count,
                                 client_index, renderer=renderer)

    EngineCoreClient.make_async_mp_client = staticmethod(make_async_mp_client)


def restore_client_factory() -> None:
    EngineCoreClient.make_async_mp_client = staticmethod(_ORIGINAL_FACTORY)


def advertised_parallel_config(parallel_config: ParallelConfig, engine0_address: str | None) -> ParallelConfig:
    """The ParallelConfig whose fields INIT advertises to engines (change 2).

    A copy with `data_parallel_master_ip` set to engine rank 0's address; the frontend's own
    config is left as it is (it binds its sockets on its own address). `compute_hash`, which the
    frontend checks READY against, ignores the master address, so the copy hashes the same.
    """
    if not engine0_address:
        return parallel_config
    advertised = copy.copy(parallel_config)
    advertised.data_parallel_master_ip = engine0_address
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
