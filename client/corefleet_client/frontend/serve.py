# SPDX-License-Identifier: Apache-2.0
"""The frontend's process once its own flags are read: vLLM's API server over corefleet's client, and the admin API.

`__main__` reads corefleet's flags and the admin token without importing vLLM, then hands over
here (`serve`): vLLM's `vllm serve` flags are parsed and checked against corefleet's topology (one
API server, no local engine), the fleet registry is built, corefleet's changes to vLLM are
installed (`vllm_compat`; its client factory builds `KubeDPLBClient` with this fleet's options and
registry as constructor arguments, so nothing is set globally on the class), and vLLM's server runs
until SIGTERM/SIGINT, the admin API beside it.
"""

from __future__ import annotations

import argparse
import functools
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

import prometheus_client
import uvloop
import vllm
from vllm.entrypoints.launchers.api_server.entry import run_server, run_server_worker
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.entrypoints.launchers.launcher import setup_server
from vllm.utils.argparse_utils import FlexibleArgumentParser

from corefleet_client import vllm_compat
from corefleet_client.frontend.adminserver import AdminServer
from corefleet_client.frontend.client import client_factory
from corefleet_client.frontend.fleet import Fleet
from corefleet_client.frontend.followers import Followers
from corefleet_client.frontend.hold import Hold, HoldMiddleware, HoldSettings
from corefleet_client.frontend.metrics import FleetCollector
from corefleet_client.frontend.types import AffinitySettings, FleetOptions, RoutingPolicy, StallPolicy

logger = logging.getLogger("corefleet.frontend")


def parse_vllm_args(vllm_argv: Sequence[str]) -> argparse.Namespace:
    """vLLM's serve flags, as `vllm serve` parses them, refused (exit 2) where they are not a fleet frontend's."""
    vparser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    args: argparse.Namespace = vparser.parse_args(list(vllm_argv))
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    validate_parsed_serve_args(args)
    problems = []
    if args.headless:
        problems.append("--headless is for engines, not the frontend")
    if args.data_parallel_size_local != 0:
        problems.append("--data-parallel-size-local must be 0: the frontend starts no engine")
    if args.api_server_count not in (None, 1):
        problems.append("--api-server-count must be 1: one API server owns the engines' sockets")
    if args.data_parallel_rank is not None or args.data_parallel_start_rank is not None:
        problems.append("--data-parallel-rank/--data-parallel-start-rank are for engines")
    if args.data_parallel_external_lb or args.data_parallel_hybrid_lb:
        problems.append("external and hybrid load balancing are not corefleet's topology")
    if problems:
        vparser.error("; ".join(problems))
    args.api_server_count = None
    return args


def fleet_options(opts: argparse.Namespace) -> FleetOptions:
    """The client's options from corefleet's flags (`__main__.build_parser`)."""
    return FleetOptions(
        coordinator_address=opts.coordinator_address,
        coordinator_front_publish_port=opts.coordinator_front_publish_port,
        coordinator_back_output_port=opts.coordinator_back_output_port,
        coordinator_back_publish_port=opts.coordinator_back_publish_port,
        engine0_address=opts.engine0_address,
        coord_store_port=opts.coord_store_port,
        liveness_interval_s=opts.liveness_interval,
        liveness_timeout_s=opts.liveness_timeout,
        stall=StallPolicy(floor_s=opts.stall_timeout, step_factor=opts.stall_step_factor),
        routing=RoutingPolicy(opts.routing),
        affinity=AffinitySettings(prefix_tokens=opts.routing_prefix_tokens, balance=opts.routing_balance),
        engine_input_port=opts.engine_input_port,
        engine_output_port=opts.engine_output_port,
        advertise_address=opts.advertise_address,
        attach=opts.attach,
        attach_timeout_s=opts.attach_timeout,
        detached=tuple(opts.detached_ranks),
        frontend_addresses=tuple(opts.frontend_addresses),
        client_index=opts.client_index,
    )


def server_kwargs(options: FleetOptions) -> dict[str, Any]:
    """The keyword arguments of vLLM's `run_server` for this frontend: with several frontends, its client count and
    index, which `run_server` hands to `run_server_worker` as `client_config` (vLLM's multi-API-server path): they
    become AsyncLLM's `client_count`/`client_index` (so its client's, as a request's and utility's `client_index`)
    and the config's `_api_process_count`/`_api_process_rank`. None for one frontend: vLLM's defaults (1, 0)."""
    if options.client_count == 1:
        return {}
    return {"client_config": {"client_count": options.client_count, "client_index": options.client_index}}


async def run_api_server(args: argparse.Namespace, options: FleetOptions) -> None:
    """vLLM's API server for this frontend. Several frontends on one host (local mode) share the HTTP port as vLLM's
    own API servers do (`SO_REUSEPORT`: the kernel spreads connections over them); a pod's frontend binds it alone."""
    if options.client_count == 1:
        await run_server(args)
        return
    def interrupt_init(*_: object) -> None:  # as run_server: a SIGTERM before uvicorn installs its handlers stops it
        raise KeyboardInterrupt("terminated")

    signal.signal(signal.SIGTERM, interrupt_init)
    listen_address, sock = setup_server(args, reuse_port=True)
    await run_server_worker(listen_address, sock, args, **server_kwargs(options))


def install_vllm_changes(options: FleetOptions, fleet: Fleet, followers: Followers | None = None,
                         hold: Hold | None = None) -> None:
    """corefleet's changes to vLLM in this process (`vllm_compat`), its client built for this fleet; `hold` in front of
    the API server's app (`frontend.hold`)."""
    vllm_compat.use_client_factory(client_factory(options, fleet, followers))
    vllm_compat.install_fleet_health_check()
    vllm_compat.install_async_llm_hook()
    vllm_compat.install_public_route_filter(None if hold is None else functools.partial(hold_requests, hold=hold))
    vllm_compat.install_frontend_eplb_config()


def hold_requests(app: Any, hold: Hold) -> None:
    """The API server's app holds requests while no rank takes any (`frontend.hold`): outermost, around the app's
    middleware stack (vLLM's `build_app` returns the app with its stack built: Starlette's `add_middleware` refuses)."""
    app.middleware_stack = HoldMiddleware(app.middleware_stack or app.build_middleware_stack(), hold)


def serve(opts: argparse.Namespace, token: str, vllm_argv: Sequence[str]) -> int:
    """Run vLLM's API server and the admin API until stopped; the process's exit code."""
    args = parse_vllm_args(vllm_argv)
    options = fleet_options(opts)
    served = args.served_model_name[0] if args.served_model_name else args.model
    fleet = Fleet(model=served, data_parallel_size=args.data_parallel_size, vllm_version=vllm.__version__,
                  frontends=options.client_count, client_index=options.client_index)
    hold = Hold(HoldSettings(max_requests=opts.hold_requests, timeout_s=opts.hold_timeout), fleet.closed)
    fleet.demand = lambda: hold.counts.waiting  # a request waiting stops the fleet going idle
    prometheus_client.REGISTRY.register(FleetCollector(fleet, hold))  # beside vLLM's series on /metrics
    # Frontend 0 drives the others through each resize, over their admin APIs (the same port on each one's host).
    followers = Followers.of(options.frontend_addresses, opts.admin_port, token) if not options.follower else None
    install_vllm_changes(options, fleet, followers, hold)
    try:
        admin = AdminServer(opts.admin_host, opts.admin_port, token, fleet)
    except OSError as e:
        where = f"{opts.admin_host}:{opts.admin_port}"
        sys.stderr.write(f"corefleet frontend: cannot serve the admin API on {where}: {e}\n")
        return 1
    admin.start()
    try:
        uvloop.run(run_api_server(args, options))
    except KeyboardInterrupt:
        logger.info("Interrupted before the server started; exiting")
    finally:
        admin.stop()
    return 0
