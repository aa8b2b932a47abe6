# SPDX-License-Identifier: Apache-2.0
"""The admin API server: a small HTTP server in its own thread.

It runs apart from vLLM's event loop on purpose: the loop is blocked while the engines handshake
(vLLM's `wait_for_engine_startup` is synchronous), and that is exactly when the operator wants to
see which ranks have joined. It only reads the `FleetTracker`.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from corefleet_client.admin import AUTH_HEADER, FLEET_PATH, HEALTH_PATH, FleetStatus, authorized

logger = logging.getLogger("corefleet.frontend.admin")


class AdminServer:
    def __init__(self, host: str, port: int, token: str, snapshot: Callable[[], FleetStatus]) -> None:
        self.token = token
        self.snapshot = snapshot
        server = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "corefleet-admin"

            def log_message(self, format: str, *args: object) -> None:
                logger.debug("admin %s - %s", self.address_string(), format % args)

            def _send(self, status: HTTPStatus, body: dict[str, object]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status == HTTPStatus.UNAUTHORIZED:
                    self.send_header("WWW-Authenticate", 'Bearer realm="corefleet-admin"')
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == HEALTH_PATH:
                    self._send(HTTPStatus.OK, {"status": "ok"})
                    return
                if not authorized(self.headers.get(AUTH_HEADER), server.token):
                    self._send(HTTPStatus.UNAUTHORIZED, {"error": "missing or wrong bearer token"})
                    return
                if path == FLEET_PATH:
                    self._send(HTTPStatus.OK, server.snapshot().to_json())
                    return
                self._send(HTTPStatus.NOT_FOUND, {"error": f"no such path {path}"})

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="corefleet-admin", daemon=True)

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def start(self) -> None:
        self._thread.start()
        logger.info("Admin API on port %d", self.port)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
