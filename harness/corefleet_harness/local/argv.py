# SPDX-License-Identifier: Apache-2.0
"""The command lines and environments of a local fleet's processes (pure but for `engine_env`'s CPU list).

The same command lines the operator's pods run (`corefleet_client.commands`), with every address
127.0.0.1 and the ports of `Ports`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from corefleet_client import commands
from corefleet_harness.local.config import ENGINE_EMULATOR, ENGINE_MODULES, ENGINE_VLLM, LOCALHOST, frontend_host
from corefleet_harness.local.ports import Ports


def coordinator_argv(python: str, replicas: int, ports: Ports, *, moe: bool) -> list[str]:
    """The coordinator's command line (`commands.coordinator_args` on 127.0.0.1); wave
    coordination only for a MoE model."""
    return [
        *commands.command(commands.COORDINATOR_MODULE, python),
        *commands.coordinator_args(
            engine_count=replicas,
            host=LOCALHOST,
            front_publish_port=ports.coord_front_publish,
            back_output_port=ports.coord_back_output,
            back_publish_port=ports.coord_back_publish,
            wave_coordination=moe,
        ),
    ]


def frontend_argv(python: str, model: str, replicas: int, ports: Ports, token_file: Path,
                  vllm_flags: Sequence[str], *, moe: bool = False, attach: bool = False, frontends: int = 1,
                  client_index: int = 0) -> list[str]:
    """The frontend's command line (`commands.frontend_args`), every listener on 127.0.0.1, the engines'
    sockets on the fleet's fixed ports; `attach`: a replacement frontend, re-attaching to the running engines.

    Several frontends (`frontends`): frontend `client_index` binds its engine sockets and admin API on its own
    loopback address (`config.frontend_host`), and all of them share the OpenAI API's port on 127.0.0.1.

    MoE: engine rank 0 binds the DP master address the frontend advertises; here it is loopback too
    (and so is its coordination store, with elastic EP).
    """
    own = frontend_host(client_index)
    several = frontends > 1
    return [
        *commands.command(commands.FRONTEND_MODULE, python),
        *commands.frontend_args(
            model=model,
            dp_size=replicas,
            host=LOCALHOST,
            port=ports.http,
            dp_address=own,
            rpc_port=ports.rpc,
            admin_host=own,
            admin_port=ports.admin,
            admin_token_file=str(token_file),
            coordinator_address=LOCALHOST,
            coordinator_front_publish_port=ports.coord_front_publish,
            coordinator_back_output_port=ports.coord_back_output,
            coordinator_back_publish_port=ports.coord_back_publish,
            engine0_address=LOCALHOST if moe else None,
            coord_store_port=ports.coord_store if moe else None,
            engine_ports=ports.engine_ports,
            advertise_address=own if several else None,
            frontend_addresses=[frontend_host(i) for i in range(frontends)] if several else (),
            client_index=client_index,
            attach=attach,
            vllm_flags=vllm_flags,
        ),
    ]


def engine_argv(python: str, engine: str, model: str, replicas: int, rank: int, ports: Ports,
                vllm_flags: Sequence[str], *, token_delay_ms: int | None = None) -> list[str]:
    """Rank `rank`'s command line (`commands.engine_args` on 127.0.0.1): the vLLM engine launcher
    or the emulator (`engine`); `token_delay_ms` applies to the emulator only."""
    return [
        *commands.command(ENGINE_MODULES[engine], python),
        *commands.engine_args(
            model=model,
            dp_size=replicas,
            rank=rank,
            dp_address=LOCALHOST,
            rpc_port=ports.rpc,
            health_host=LOCALHOST,
            health_port=ports.health[rank],
            token_delay_ms=token_delay_ms if engine == ENGINE_EMULATOR else None,
            coord_store_port=ports.coord_store if rank == 0 else None,
            vllm_flags=vllm_flags,
        ),
    ]


# Cores a CPU fleet leaves to everything but the engines' compute (vLLM's own default for one worker per engine on
# x86 and Arm: `OMPProcessManager.reserve_cpu_num`, overridden by the same variable).
DEFAULT_RESERVED_CPUS = 1


def engine_cpu(rank: int, cpus: Sequence[int], reserved: int = DEFAULT_RESERVED_CPUS) -> int:
    """The core rank `rank`'s OpenMP threads are bound to, of the usable `cpus`: the ranks go round the cores
    but the last `reserved` ones (all of them when there are no more than that), which are left to the engine
    cores' own processes, the frontend and the coordinator, as vLLM's "auto" binding leaves them.

    Why not every core: a vLLM CPU worker's OpenMP threads spin while they wait for each other, so a core
    shared between a worker and a busy Python process (the frontend, the coordinator, an engine core's
    scheduler) stalls both; measured with 2 real ranks on 2 cores (bench_fleet.py, 2026-12-05): ranks on cores
    0 and 1 served 26-45 requests/s at concurrency 16 with 24-45 waits of 0.5-1.1 s for a token per 150
    requests, ranks both on core 0 (core 1 left free, as stock `vllm serve` binds them) 60-100 requests/s."""
    ordered = sorted(cpus)
    usable = ordered[:-reserved] if 0 < reserved < len(ordered) else ordered
    return usable[rank % len(usable)]


def reserved_cpus() -> int:
    """`VLLM_CPU_NUM_OF_RESERVED_CPU` where it is set (vLLM's own knob), else `DEFAULT_RESERVED_CPUS`."""
    try:
        return max(0, int(os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", DEFAULT_RESERVED_CPUS)))
    except ValueError:
        return DEFAULT_RESERVED_CPUS


def engine_env(engine: str, rank: int, gpus_per_rank: int = 0) -> dict[str, str]:
    """The environment an engine rank adds to `corefleet up`'s: its GPUs, or its CPU core (`engine_cpu`)."""
    env = {"PYTHONUNBUFFERED": "1"}
    if gpus_per_rank:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(rank * gpus_per_rank + i) for i in range(gpus_per_rank))
    elif engine == ENGINE_VLLM and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # vLLM's "auto" binding picks cores per local rank, and every engine here is local rank 0 of its own
        # launcher: left to vLLM, every rank would get every core but the reserved one.
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(engine_cpu(rank, sorted(os.sched_getaffinity(0)), reserved_cpus()))
    return env


def is_moe_model(model: str) -> bool:
    """Whether a local model directory's config.json describes a MoE model (experts per layer)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    keys = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
    return isinstance(config, dict) and any(config.get(k) for k in keys)
