# SPDX-License-Identifier: Apache-2.0
"""The emulator's probe endpoints, with the engine launcher's semantics (operator builders.py):

* `GET /livez`: 200 as soon as the process runs (the engine may still be importing);
* `GET /readyz`: 200 once the engine sent READY on the handshake socket (joined the fleet), 503
  before that and once it is shutting down;
* `GET /stats`: the emulator's counters as JSON (requests added/finished/aborted per rank, aborted
  ids, tokens, utility calls, elastic EP state), for tests and benchmarks.

Standard library only: it starts before the engine is imported.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)


class HealthState:
    """What the probes read; the engine is attached once it is imported."""

    def __init__(self) -> None:
        self.snapshot: Callable[[], dict[str, Any]] | None = None
        self.ready: Callable[[], bool] = lambda: False
        self.stopping = threading.Event()


def _handler(state: HealthState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/livez":
                self._reply(200, b"ok")
            elif path == "/readyz":
                ok = state.ready() and not state.stopping.is_set()
                self._reply(200 if ok else 503, b"ok" if ok else b"not ready")
            elif path == "/stats":
                body = state.snapshot() if state.snapshot is not None else {"ready": False}
                self._reply(200, json.dumps(body).encode(), "application/json")
            else:
                self._reply(404, b"not found")

        def _reply(self, code: int, body: bytes, content_type: str = "text/plain") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("health: " + format, *args)

    return Handler


def start_health_server(host: str, port: int, state: HealthState) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), _handler(state))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="health",
                     daemon=True).start()
    logger.info("Health endpoints on http://%s:%d (/livez /readyz /stats)", host, server.server_address[1])
    return server
