# SPDX-License-Identifier: Apache-2.0
"""`python -m corefleet_client.frontend [corefleet flags] -- <vllm serve flags>`

vLLM's own OpenAI API server (`run_server`, one API server process) over corefleet's engine-core
client (`frontend.client`), plus the authenticated admin API on its own port (`frontend.serve`).
The vLLM flags are parsed by vLLM's `vllm serve` parser, so every serve flag works; the DP flags
must describe a frontend with no local engine: `--data-parallel-size N --data-parallel-size-local 0
--data-parallel-address <this pod's IP> --data-parallel-rpc-port P`.

Exit codes: 0 after SIGTERM/SIGINT, 2 for bad arguments or a missing admin token, 1 otherwise.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from corefleet_client.admin import read_token
from corefleet_client.argv import split_launcher_argv
from corefleet_client.frontend.hold import DEFAULT_HOLD_REQUESTS, DEFAULT_HOLD_TIMEOUT_S
from corefleet_client.frontend.types import (
    DEFAULT_ROUTING,
    DEFAULT_ROUTING_BALANCE,
    DEFAULT_ROUTING_PREFIX_TOKENS,
    DEFAULT_STALL_STEP_FACTOR,
    DEFAULT_STALL_TIMEOUT_S,
    ENV_ROUTING,
    RoutingPolicy,
)
from corefleet_client.process import configure_logging, exit_promptly

EXIT_USAGE = 2
# The default of --liveness-timeout where the command line is not one's own (local fleets in tests).
ENV_LIVENESS_TIMEOUT = "COREFLEET_LIVENESS_TIMEOUT"
ENV_STALL_TIMEOUT = "COREFLEET_STALL_TIMEOUT"
ENV_HOLD_REQUESTS = "COREFLEET_HOLD_REQUESTS"
ENV_HOLD_TIMEOUT = "COREFLEET_HOLD_TIMEOUT"


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name, "").strip()
    try:
        return float(value) if value else default
    except ValueError:
        sys.stderr.write(f"corefleet frontend: ${name}={value!r} is not a number; using {default:g}\n")
        return default


def _env_routing() -> str:
    value = os.environ.get(ENV_ROUTING, "").strip()
    if value and value not in tuple(RoutingPolicy):
        sys.stderr.write(f"corefleet frontend: ${ENV_ROUTING}={value!r} is not one of "
                         f"{', '.join(RoutingPolicy)}; using {DEFAULT_ROUTING}\n")
        return DEFAULT_ROUTING.value
    return value or DEFAULT_ROUTING.value


def _addresses(value: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in value.split(","))


def _ranks(value: str) -> tuple[int, ...]:
    try:
        ranks = tuple(sorted({int(r) for r in value.split(",") if r.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of ranks: {value!r}") from None
    if any(r < 0 for r in ranks):
        raise argparse.ArgumentTypeError(f"a rank is not negative: {value!r}")
    return ranks


def frontends_problem(opts: argparse.Namespace) -> str | None:
    """What is wrong with the K-frontend flags (`--frontend-addresses`, `--client-index`), or None."""
    addresses: tuple[str, ...] = opts.frontend_addresses
    if not addresses:
        return None if opts.client_index == 0 else "--client-index needs --frontend-addresses"
    if any(not a for a in addresses):
        return f"--frontend-addresses has an empty entry: {','.join(addresses)!r}"
    if len(set(addresses)) != len(addresses):
        return f"--frontend-addresses names a frontend twice: {','.join(addresses)!r}"
    if not 0 <= opts.client_index < len(addresses):
        return f"--client-index must be in 0..{len(addresses) - 1}, got {opts.client_index}"
    if opts.engine_input_port is None or opts.engine_output_port is None:
        return ("--frontend-addresses needs --engine-input-port and --engine-output-port: the engines are told "
                "every frontend's sockets at those fixed ports")
    if opts.advertise_address != addresses[opts.client_index]:
        return (f"--advertise-address ({opts.advertise_address}) must be entry {opts.client_index} of "
                f"--frontend-addresses ({addresses[opts.client_index]}): that is where the engines connect to "
                "this frontend")
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m corefleet_client.frontend",
        usage="%(prog)s [options] -- MODEL [vllm serve options]",
        description="vLLM's OpenAI API server over engines and a coordinator running in other processes/pods.",
    )
    p.add_argument("--admin-host", default="0.0.0.0", help="address of the admin API")
    p.add_argument("--admin-port", type=int, default=8001, help="port of the admin API")
    p.add_argument("--admin-token-file", default=None,
                   help="file holding the admin bearer token "
                        "(else $COREFLEET_ADMIN_TOKEN_FILE or $COREFLEET_ADMIN_TOKEN)")
    p.add_argument("--coordinator-address", required=True, help="host of the standalone DP coordinator")
    p.add_argument("--coordinator-front-publish-port", type=int, default=29551)
    p.add_argument("--coordinator-back-output-port", type=int, default=29552)
    p.add_argument("--coordinator-back-publish-port", type=int, default=29553)
    p.add_argument("--engine0-address", default=None,
                   help="MoE fleets: engine rank 0's address, advertised to the engines as the DP master")
    p.add_argument("--coord-store-port", type=int, default=None,
                   help="elastic-EP fleets: the port of the startup's coordination store in engine rank 0's pod, "
                        "advertised to the engines as _coord_store_port")
    p.add_argument("--engine-input-port", type=int, default=None,
                   help="fixed port of the engines' requests socket (ephemeral if unset; fixed, a replacement "
                        "frontend binds the same and the running engines reconnect to it)")
    p.add_argument("--engine-output-port", type=int, default=None,
                   help="fixed port of the engines' outputs socket (as --engine-input-port)")
    p.add_argument("--advertise-address", default=None,
                   help="the address the engines are told to connect their sockets to (the pod's stable DNS name; "
                        "the --data-parallel-address if unset)")
    p.add_argument("--attach", action="store_true",
                   help="the engines already run (this frontend replaces a lost one): re-attach to ranks "
                        "0..--data-parallel-size-1 instead of the startup handshake")
    p.add_argument("--attach-timeout", type=float, default=60.0,
                   help="with --attach: seconds for every engine to reconnect and answer")
    p.add_argument("--detached-ranks", type=_ranks, default=(),
                   help="with --attach: ranks not to attach, comma-separated (their replacement was in flight when the "
                        "lost frontend went, and their new engines were deleted): they start Dead, ready to be "
                        "replaced")
    p.add_argument("--frontend-addresses", type=_addresses, default=(),
                   help="several frontends per fleet: the advertised address of every frontend, comma-separated, by "
                        "client index (this one's is its --advertise-address); frontend 0 runs the engines' handshake "
                        "and tells them all; needs the fixed --engine-input-port and --engine-output-port")
    p.add_argument("--client-index", type=int, default=0,
                   help="with --frontend-addresses: this frontend's index among them (vLLM's client index)")
    p.add_argument("--liveness-interval", type=float, default=1.0,
                   help="seconds between liveness calls to each engine")
    p.add_argument("--liveness-timeout", type=float, default=_env_float(ENV_LIVENESS_TIMEOUT, 30.0),
                   help="an engine that does not answer a liveness call within this many seconds is Unresponsive: "
                        "it gets no new request until it answers (a lost connection makes it Dead) "
                        f"(default ${ENV_LIVENESS_TIMEOUT}, else 30)")
    p.add_argument("--stall-timeout", type=float, default=_env_float(ENV_STALL_TIMEOUT, DEFAULT_STALL_TIMEOUT_S),
                   help="the least time an engine may end no step (its liveness call unanswered) before it is "
                        "Stalled: new requests go to the other ranks until it makes progress, its own wait for it; "
                        "longer where its recent steps were slow (--stall-step-factor times the slowest) or its "
                        "requests' prompts still prefill; 0: never (default $" + ENV_STALL_TIMEOUT +
                        f", else {DEFAULT_STALL_TIMEOUT_S:g})")
    p.add_argument("--stall-step-factor", type=float, default=DEFAULT_STALL_STEP_FACTOR,
                   help="an engine is Stalled after no step for this many times its slowest recent step, if that "
                        f"is longer than --stall-timeout (default {DEFAULT_STALL_STEP_FACTOR:g})")
    p.add_argument("--routing", choices=tuple(RoutingPolicy), default=_env_routing(),
                   help="how a request not pinned to a rank finds one: least-loaded (vLLM's router) or "
                        "prefix-affinity (the rank that holds the prompt's prefix in its cache, within "
                        f"--routing-balance of the mean load) (default ${ENV_ROUTING}, else {DEFAULT_ROUTING})")
    p.add_argument("--routing-prefix-tokens", type=int, default=DEFAULT_ROUTING_PREFIX_TOKENS,
                   help="prefix-affinity: how many leading prompt tokens (whole KV blocks) pick a prompt's rank "
                        f"(default {DEFAULT_ROUTING_PREFIX_TOKENS})")
    p.add_argument("--routing-balance", type=float, default=DEFAULT_ROUTING_BALANCE,
                   help="prefix-affinity: a rank takes a request while its load stays within this many times the "
                        f"mean; past it the request spills to the prefix's next rank (default "
                        f"{DEFAULT_ROUTING_BALANCE:g}, at least 1)")
    p.add_argument("--hold-requests", type=int, default=int(_env_float(ENV_HOLD_REQUESTS, DEFAULT_HOLD_REQUESTS)),
                   help="while no rank takes requests (every rank Dead, Unresponsive or leaving), up to this many "
                        "requests wait for one instead of failing at once; past it a request gets 503 with "
                        f"Retry-After; 0: none waits (default ${ENV_HOLD_REQUESTS}, else {DEFAULT_HOLD_REQUESTS})")
    p.add_argument("--hold-timeout", type=float, default=_env_float(ENV_HOLD_TIMEOUT, DEFAULT_HOLD_TIMEOUT_S),
                   help="how long such a request waits for a rank before it gets 503 with Retry-After (default "
                        f"${ENV_HOLD_TIMEOUT}, else {DEFAULT_HOLD_TIMEOUT_S:g} s)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ours, vllm_argv = split_launcher_argv(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    opts = parser.parse_args(ours)
    if not vllm_argv:
        parser.error("the vLLM serve arguments (MODEL and flags) must follow '--'")
    if opts.liveness_interval <= 0 or opts.liveness_timeout <= 0:
        parser.error("--liveness-interval and --liveness-timeout must be positive")
    if opts.stall_timeout < 0 or opts.stall_step_factor < 1:
        parser.error("--stall-timeout must be 0 (off) or positive, --stall-step-factor at least 1")
    if opts.hold_requests < 0 or opts.hold_timeout < 0:
        parser.error("--hold-requests and --hold-timeout cannot be negative")
    if opts.routing_prefix_tokens < 1 or opts.routing_balance < 1:
        parser.error("--routing-prefix-tokens must be positive, --routing-balance at least 1")
    if opts.attach and (opts.engine_input_port is None or opts.engine_output_port is None):
        parser.error("--attach needs --engine-input-port and --engine-output-port: the running engines connect "
                     "to fixed ports")
    if opts.detached_ranks and not opts.attach:
        parser.error("--detached-ranks needs --attach: only a frontend that re-attaches leaves ranks out")
    if (problem := frontends_problem(opts)) is not None:
        parser.error(problem)
    try:
        token = read_token(opts.admin_token_file)
    except (OSError, ValueError) as e:
        sys.stderr.write(f"corefleet frontend: {e}\n")
        return EXIT_USAGE
    configure_logging(logging.INFO)
    # vLLM is imported only now, with the module that serves (not to break an import cycle: there is
    # none), so that `--help` and argument errors stay fast.
    from corefleet_client.frontend import serve

    return serve.serve(opts, token, vllm_argv)


if __name__ == "__main__":
    exit_promptly(main())
