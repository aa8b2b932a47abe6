# SPDX-License-Identifier: Apache-2.0
"""`python -m corefleet_harness.emulator [--token-delay-ms 10] [--health-port P] -- MODEL --headless ...`

1. Parse the command line and start the health server, so `/livez` answers while the engine
   is being imported (it imports neither vLLM nor torch, so that is quick).
2. SIGTERM/SIGINT: before the engine runs, exit 0 at once (nothing is connected yet); after, ask
   the busy loop to stop (it aborts in-flight requests, flushes its outputs and returns 0).
3. Import the engine (the emulator's mirror of vLLM's structs and serializers) and run it; its return
   value is the exit code.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType

from corefleet_client.process import configure_logging, exit_promptly
from corefleet_harness.emulator.config import parse_args
from corefleet_harness.emulator.health import HealthState, start_health_server

logger = logging.getLogger("corefleet_harness.emulator")


def main(argv: Sequence[str] | None = None) -> int:
    started = time.monotonic()
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging(cfg.log_level)

    health = HealthState()
    server = start_health_server(cfg.health_host, cfg.health_port, health) if cfg.health_port is not None else None

    stop = threading.Event()
    engine_started = False

    def _request_stop(signum: int, frame: FrameType | None) -> None:
        health.stopping.set()
        if not engine_started:
            raise SystemExit(0)  # still importing the engine: nothing to close
        if not stop.is_set():
            logger.info("[shutdown] EngineCore (emulated): received %s", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _request_stop)
    signal.signal(signal.SIGINT, _request_stop)

    from corefleet_harness.emulator.engine import EmulatedEngineCore

    coord_store = None
    if cfg.coord_store_port is not None:  # what engine rank 0's launcher serves beside a vLLM engine
        from corefleet_client.coordstore import StoreService

        coord_store = StoreService(cfg.health_host, cfg.coord_store_port)
    engine = EmulatedEngineCore(cfg, stop)
    engine.started_at = started
    health.ready = engine.ready.is_set
    health.snapshot = engine.snapshot
    engine_started = True
    logger.info("Emulated engine imported in %.1f s", time.monotonic() - started)
    try:
        rc = engine.run()
    finally:
        health.stopping.set()
        if server is not None:
            server.shutdown()
            server.server_close()
        if coord_store is not None:
            coord_store.close()
    logger.info("Emulated engine rank %d exiting with %d", cfg.rank, rc)
    return rc


if __name__ == "__main__":
    exit_promptly(main())  # every socket and thread of the emulator is closed and joined by now
