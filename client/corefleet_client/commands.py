# SPDX-License-Identifier: Apache-2.0
"""The fleet's command lines, built in one place for the operator's pods and for local mode.

Every fleet process is `python -m MODULE ARGS`. The functions here return ARGS (everything after
`python -m MODULE`) as pure functions of the values the caller decides: the operator's pod
builders (`corefleet_operator.builders`) pass `0.0.0.0`, `$(POD_IP)`, pod DNS names and fixed
ports; local mode (the harness's `corefleet up`) passes 127.0.0.1 and free ports. The launchers'
own flags come first, then `--`, then vLLM's (`corefleet_client.argv.split_launcher_argv`):

* the coordinator: `--engine-count N --host H --front-publish-port ... [--no-wave-coordination]`
  (it takes no vLLM flags);
* the frontend: `[--admin-host H] --admin-port P --admin-token-file F --coordinator-address A
  --coordinator-*-port ... [--engine0-address E] [--coord-store-port S] [--engine-*-port ...]
  [--advertise-address A] [--attach [--detached-ranks R,...]] [--frontend-addresses A0,A1,... --client-index I]
  -- MODEL --host H --port P
  --data-parallel-* ... <vLLM flags>`;
* an engine (or the emulator): `[--health-host H] --health-port P [--token-delay-ms D]
  [--coord-store-port S] -- MODEL --headless --data-parallel-* ... <vLLM flags>`.

A launcher binds its own listener (health, admin) to 0.0.0.0 unless told a host, so a pod leaves
those flags out. Flags that only one caller derives (tensor parallelism, load format, expert
parallelism, the user's engine args; local mode's CPU flags) are the caller's `vllm_flags`,
which always come last.

Standard library only: the operator imports this module, and it never imports vLLM, torch or
ZeroMQ (import contract in pyproject.toml).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from corefleet_client.argv import ARGS_END

ENGINE_MODULE = "corefleet_client.engine"
COORDINATOR_MODULE = "corefleet_client.coordinator"
FRONTEND_MODULE = "corefleet_client.frontend"
# Separates a corefleet launcher's own flags from the vLLM command line it passes on (the
# launchers split there: corefleet_client.argv).
LAUNCHER_ARGS_END = ARGS_END
DEFAULT_PYTHON = "python"  # a pod's interpreter, found on the image's PATH


def command(module: str, python: str = DEFAULT_PYTHON) -> list[str]:
    """`[python, "-m", module]`: what precedes a fleet process's arguments."""
    return [python, "-m", module]


def coordinator_args(
    *,
    engine_count: int,
    host: str,
    front_publish_port: int,
    back_output_port: int,
    back_publish_port: int,
    wave_coordination: bool,
) -> list[str]:
    """Arguments of vLLM's DPCoordinator run standalone (`corefleet_client.coordinator`).

    It listens on `host` at three fixed ports the frontend and the engines connect to. Without
    `wave_coordination` it gets `--no-wave-coordination`: vLLM coordinates request waves only for
    MoE (launch_core_engines passes enable_wave_coordination=model_config.is_moe), and dense
    engines reject START_DP_WAVE.
    """
    args = [
        "--engine-count", str(engine_count),
        "--host", host,
        "--front-publish-port", str(front_publish_port),
        "--back-output-port", str(back_output_port),
        "--back-publish-port", str(back_publish_port),
    ]
    if not wave_coordination:
        args.append("--no-wave-coordination")
    return args


def frontend_args(
    *,
    model: str,
    dp_size: int,
    host: str,
    port: int,
    dp_address: str,
    rpc_port: int,
    admin_port: int,
    admin_token_file: str,
    coordinator_address: str,
    coordinator_front_publish_port: int,
    coordinator_back_output_port: int,
    coordinator_back_publish_port: int,
    admin_host: str | None = None,
    engine0_address: str | None = None,
    coord_store_port: int | None = None,
    engine_ports: tuple[int, int] | None = None,
    advertise_address: str | None = None,
    attach: bool = False,
    detached: Sequence[int] = (),
    frontend_addresses: Sequence[str] = (),
    client_index: int = 0,
    policy: Sequence[str] = (),
    vllm_flags: Sequence[str] = (),
) -> list[str]:
    """Arguments of the frontend (`corefleet_client.frontend`): vLLM's API server with corefleet's
    DPLB client, the engines' handshake ROUTER and the admin API.

    The OpenAI API listens on `host:port`; the admin API on `admin_host` (the launcher's default,
    0.0.0.0, when None) at `admin_port`, with the bearer token read from `admin_token_file`. The
    frontend runs no engine itself (`--data-parallel-size-local 0`) and is the DP master at
    `dp_address:rpc_port`. `engine0_address` (MoE) is the address it advertises to the engines as
    the DP master: engine rank 0's, which binds its DP group port there. `coord_store_port`
    (elastic EP) is the port of the startup's coordination store beside engine 0, advertised too.
    `engine_ports` (requests, outputs): the fixed ports the engines' sockets connect to (ephemeral
    when None), at `advertise_address` (the frontend pod's stable DNS name; `dp_address` when None), so
    that a replacement frontend binds the same and the running engines reconnect to it. `attach`: the
    engines already run (a replaced frontend): re-attach to them instead of the startup handshake, but for the
    ranks `detached` (their replacement was in flight when the lost frontend went): they start Dead.
    `frontend_addresses` (several frontends, all at `engine_ports`): every frontend's advertised address by
    client index, this one's (`client_index`) being its `advertise_address`; frontend 0 runs the handshake.
    `policy`: the flags of the frontend's policies, as given: routing (`--routing POLICY` and its settings) and the
    hold of requests while no rank takes any (`--hold-requests`, `--hold-timeout`).
    """
    if client_index and not frontend_addresses:
        raise ValueError(f"client index {client_index} without the frontend addresses")
    launcher = [] if admin_host is None else ["--admin-host", admin_host]
    launcher += [
        "--admin-port", str(admin_port),
        "--admin-token-file", admin_token_file,
        "--coordinator-address", coordinator_address,
        "--coordinator-front-publish-port", str(coordinator_front_publish_port),
        "--coordinator-back-output-port", str(coordinator_back_output_port),
        "--coordinator-back-publish-port", str(coordinator_back_publish_port),
    ]
    if engine0_address is not None:
        launcher += ["--engine0-address", engine0_address]
    if coord_store_port is not None:
        launcher += ["--coord-store-port", str(coord_store_port)]
    if engine_ports is not None:
        launcher += ["--engine-input-port", str(engine_ports[0]), "--engine-output-port", str(engine_ports[1])]
    if advertise_address is not None:
        launcher += ["--advertise-address", advertise_address]
    launcher += policy
    if detached and not attach:
        raise ValueError("detached ranks without attach")
    if attach:
        launcher += ["--attach"]
    if detached:
        launcher += ["--detached-ranks", ",".join(str(r) for r in sorted(detached))]
    if frontend_addresses:
        launcher += ["--frontend-addresses", ",".join(frontend_addresses), "--client-index", str(client_index)]
    return [
        *launcher,
        LAUNCHER_ARGS_END,
        model,
        "--host", host,
        "--port", str(port),
        "--data-parallel-size", str(dp_size),
        "--data-parallel-size-local", "0",
        "--data-parallel-address", dp_address,
        "--data-parallel-rpc-port", str(rpc_port),
        *vllm_flags,
    ]


def engine_args(
    *,
    model: str,
    dp_size: int,
    rank: int,
    dp_address: str,
    rpc_port: int,
    health_port: int,
    health_host: str | None = None,
    token_delay_ms: int | None = None,
    coord_store_port: int | None = None,
    frontend_admin_port: int | None = None,
    vllm_flags: Sequence[str] = (),
) -> list[str]:
    """Arguments of data-parallel rank `rank`'s engine launcher: `corefleet_client.engine` (a
    headless vLLM engine core) or a stand-in that takes the same flags (the harness's engine emulator).

    The engine handshakes with the DP master (the frontend) at `dp_address:rpc_port`. The
    launcher answers /livez and /readyz on `health_host` (the launcher's default, 0.0.0.0, when
    None) at `health_port`. `token_delay_ms` is the emulator's per-token delay (the vLLM engine
    launcher has no such flag). `coord_store_port` (engine rank 0 of an elastic-EP fleet): the
    launcher also serves the startup's coordination store, on its health host at that port.
    `frontend_admin_port`: a drain (the pod's pre-stop hook) ends early once the frontend's admin port is closed.
    """
    launcher = [] if health_host is None else ["--health-host", health_host]
    launcher += ["--health-port", str(health_port)]
    if token_delay_ms is not None:
        launcher += ["--token-delay-ms", str(token_delay_ms)]
    if coord_store_port is not None:
        launcher += ["--coord-store-port", str(coord_store_port)]
    if frontend_admin_port is not None:
        launcher += ["--frontend-admin-port", str(frontend_admin_port)]
    return [
        *launcher,
        LAUNCHER_ARGS_END,
        model,
        "--headless",
        "--data-parallel-size", str(dp_size),
        "--data-parallel-size-local", "1",
        "--data-parallel-start-rank", str(rank),
        "--data-parallel-address", dp_address,
        "--data-parallel-rpc-port", str(rpc_port),
        *vllm_flags,
    ]


EPLB_CONFIG_FLAG = "--eplb-config"
# vLLM's marker of an engine started by a live elastic-EP scale-up (only on the new ranks of one).
ENV_SCALE_UP_LAUNCH = "VLLM_ELASTIC_EP_SCALE_UP_LAUNCH"


def elastic_ep_flags(max_size: int) -> list[str]:
    """vLLM's flags for an MoE fleet that resizes with elastic EP, identical on the frontend and every rank
    (EPLB is required by elastic EP; `max_size`: the largest data-parallel size it may grow to)."""
    return ["--enable-expert-parallel", "--enable-elastic-ep", "--enable-eplb", "--elastic-ep-max-dp-size",
            str(max_size)]


def with_redundant_experts(args: Sequence[str], redundant: int) -> list[str]:
    """`args` with the EPLB config's `num_redundant_experts` set to `redundant`, the user's other EPLB settings kept.

    vLLM's parser (FlexibleArgumentParser) folds the dotted forms (`--eplb-config.KEY VALUE`,
    `--eplb-config.KEY=VALUE`, values read as JSON or with a size suffix) into one dict it appends as
    a last `--eplb-config`, which replaces any JSON form whole. So: with dotted forms, the user's
    `num_redundant_experts` among them is dropped and `--eplb-config.num_redundant_experts R` added
    (vLLM parses the rest as the user wrote it); without, the last JSON form (`--eplb-config JSON` or
    `=JSON`) is merged with R and written back as the one `--eplb-config`."""
    dotted_key = f"{EPLB_CONFIG_FLAG}.num_redundant_experts"
    names = [a.partition("=")[0] for a in args]
    if any(n.startswith(EPLB_CONFIG_FLAG + ".") for n in names):
        out: list[str] = []
        i = 0
        while i < len(args):
            name, eq, _ = args[i].partition("=")
            if name == dotted_key:
                i += 1 if eq else 2
                continue
            out.append(args[i])
            i += 1
        return [*out, dotted_key, str(redundant)]
    out = []
    config: dict[str, Any] = {}
    i = 0
    while i < len(args):
        name, eq, inline = args[i].partition("=")
        if name == EPLB_CONFIG_FLAG:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
            i += 1 if eq else 2
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError:
                parsed = None
            config = parsed if isinstance(parsed, dict) else {}
            continue
        out.append(args[i])
        i += 1
    return [*out, EPLB_CONFIG_FLAG, json.dumps({**config, "num_redundant_experts": redundant}, sort_keys=True)]
