# SPDX-License-Identifier: Apache-2.0
"""The elastic-EP coordination store of a fleet's startup, served from engine rank 0's pod.

    python -m corefleet_client.coordstore --host H --port P

vLLM 0.32.0 with `--enable-elastic-ep` opens a coordination TCPStore in every engine at startup
(`distributed/parallel_state.py::_init_elastic_ep_world`, and `ParallelConfig._pick_stateless_dp_port`
for the DP group: rank 0 binds a port and publishes it as `dp_master_port`, the others read it),
at `data_parallel_master_ip:_coord_store_port` from the INIT message. Its multiprocess launch
creates no such store (only the Ray actor manager does, `v1/engine/utils.py`), and the address is
also where every group's rank 0 binds, so the store must live in engine 0's network namespace
(docs/vllm-protocol.md §10.2). corefleet's INIT names engine 0's pod as the DP master
(`vllm_compat.advertised_parallel_config`, change 2) and this store's port as `_coord_store_port`;
engine 0's launcher (`corefleet_client.engine --coord-store-port`) runs this module as a child
beside its engine core, bound to the launcher's own host (the pod's address or 0.0.0.0).

The store is the startup's: vLLM's keys are not scoped per resize, so each resize needs a fresh
one (issue 11, not built yet). It holds keys only; a lost store fails the engines that use it,
as it would in vLLM, and the launcher ends the pod with it.

`serve` is also what the engine emulator's rank 0 runs in-process (it plays the launcher too).
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

from corefleet_client.process import configure_logging

logger = logging.getLogger(__name__)

EXIT_OK = 0
LISTEN_BACKLOG = 128


def serve(host: str, port: int) -> Any:
    """A TCPStore master listening on exactly `host:port` (torch's own master listens on every address,
    so it gets a socket bound here: `master_listen_fd`). The store owns that socket from then on (it
    closes it when it is destroyed): keep the store referenced for as long as it serves."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
        bound = sock.getsockname()[1]
        store = TCPStore(host, bound, is_master=True, world_size=-1, wait_for_workers=False,
                         master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store closes it
    return store


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m corefleet_client.coordstore",
                                description="Serve the elastic-EP coordination store of a fleet's startup.")
    p.add_argument("--host", default="0.0.0.0", help="the address to listen on (default: every address)")
    p.add_argument("--port", type=int, required=True, help="the port (the INIT's _coord_store_port)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    configure_logging()
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    store = serve(opts.host, opts.port)
    logger.info("Coordination store listening on %s:%d", opts.host, opts.port)
    while not stop.wait(1.0):
        pass
    logger.info("Coordination store stopping")
    del store
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
