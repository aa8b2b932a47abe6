# SPDX-License-Identifier: Apache-2.0
"""The admin API server: a small HTTP server in its own thread.

It runs apart from vLLM's event loop on purpose: the loop is blocked while the engines handshake
at startup (vLLM's `wait_for_engine_startup` is synchronous), and that is exactly when the operator
wants to see which ranks have joined. It reads and writes only through an `AdminBackend` (the
frontend's `Fleet`), which is thread-safe and hands resizes to the event loop itself; no handler
waits for a resize to finish.
"""

from __future__ import annotations

import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from corefleet_client.admin import (
    AUTH_HEADER,
    FLEET_PATH,
    HEALTH_PATH,
    LIVE_PATH,
    LOOP_STALL_LIMIT_S,
    MAX_REQUEST_BYTES,
    RESIZES_PATH,
    FleetStatus,
    ResizeOperation,
    ResizeRequest,
    authorized,
)
from corefleet_client.process import send_json

logger = logging.getLogger(__name__)


class ResizeRefused(Exception):
    """A resize request the fleet will not carry out: the HTTP status, why, and the operation in the way."""

    def __init__(self, status: HTTPStatus, message: str, operation: ResizeOperation | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.operation = operation


class AdminBackend(Protocol):
    """What the admin API serves; every method is called from the server's threads."""

    def snapshot(self) -> FleetStatus: ...

    def start_resize(self, request: ResizeRequest) -> tuple[bool, ResizeOperation]:
        """(True if started now, the operation); raises ResizeRefused."""
        ...

    def resize(self, resize_id: str) -> ResizeOperation | None: ...

    def stalled_for(self) -> float:
        """Seconds since the serving frontend's event loop last showed progress (0 before it serves)."""
        ...

    def resizes(self) -> list[ResizeOperation]: ...

    def cancel_resize(self, resize_id: str, reason: str) -> ResizeOperation:
        """The operation, failed by the cancel; raises ResizeRefused (404, or 409 once it committed)."""
        ...


class AdminServer:
    def __init__(self, host: str, port: int, token: str, backend: AdminBackend) -> None:
        self.token = token
        self.backend = backend
        server = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "corefleet-admin"

            def log_message(self, format: str, *args: object) -> None:
                logger.debug("admin %s - %s", self.address_string(), format % args)

            def _send(self, status: HTTPStatus, body: dict[str, object]) -> None:
                challenge = {"WWW-Authenticate": 'Bearer realm="corefleet-admin"'}
                send_json(self, status, body, challenge if status == HTTPStatus.UNAUTHORIZED else None)

            def _error(self, status: HTTPStatus, message: str, operation: ResizeOperation | None = None) -> None:
                body: dict[str, Any] = {"error": message}
                if operation is not None:
                    body["operation"] = operation.to_json()
                self._send(status, body)

            def _authorized(self) -> bool:
                if authorized(self.headers.get(AUTH_HEADER), server.token):
                    return True
                self._send(HTTPStatus.UNAUTHORIZED, {"error": "missing or wrong bearer token"})
                return False

            def _body(self) -> Any:
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_REQUEST_BYTES:
                    raise ValueError(f"request body over {MAX_REQUEST_BYTES} bytes")
                raw = self.rfile.read(length) if length else b""
                try:
                    return json.loads(raw or b"{}")
                except ValueError as e:
                    raise ValueError(f"request body is not JSON: {e}") from None

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0].rstrip("/") or "/"
                if path == HEALTH_PATH:
                    self._send(HTTPStatus.OK, {"status": "ok"})
                    return
                if path == LIVE_PATH:  # answered from this thread: a wedged event loop cannot answer for itself
                    stalled = server.backend.stalled_for()
                    if stalled > LOOP_STALL_LIMIT_S:
                        self._send(HTTPStatus.SERVICE_UNAVAILABLE,
                                   {"status": "stalled", "error": f"the frontend's event loop made no progress "
                                                                  f"for {stalled:.0f}s"})
                    else:
                        self._send(HTTPStatus.OK, {"status": "ok"})
                    return
                if not self._authorized():
                    return
                if path == FLEET_PATH:
                    self._send(HTTPStatus.OK, server.backend.snapshot().to_json())
                elif path == RESIZES_PATH:
                    self._send(HTTPStatus.OK, {"operations": [o.to_json() for o in server.backend.resizes()]})
                elif path.startswith(RESIZES_PATH + "/") and path.count("/") == RESIZES_PATH.count("/") + 1:
                    resize_id = path[len(RESIZES_PATH) + 1:]
                    op = server.backend.resize(resize_id)
                    if op is None:
                        self._error(HTTPStatus.NOT_FOUND, f"no resize {resize_id!r}")
                    else:
                        self._send(HTTPStatus.OK, op.to_json())
                else:
                    self._error(HTTPStatus.NOT_FOUND, f"no such path {path}")

            def do_POST(self) -> None:
                path = self.path.split("?", 1)[0].rstrip("/")
                if not self._authorized():
                    return
                try:
                    body = self._body()
                    if path == RESIZES_PATH:
                        request = ResizeRequest.from_json(body)
                        problem = request.validate()
                        if problem is not None:
                            raise ValueError(problem)
                        started, op = server.backend.start_resize(request)
                        self._send(HTTPStatus.ACCEPTED if started else HTTPStatus.OK, op.to_json())
                        return
                    prefix, suffix = RESIZES_PATH + "/", "/cancel"
                    if path.startswith(prefix) and path.endswith(suffix):
                        reason = body.get("reason") if isinstance(body, dict) else None
                        if not isinstance(reason, str) or not reason:
                            raise ValueError("a cancel needs a non-empty 'reason'")
                        op = server.backend.cancel_resize(path[len(prefix):-len(suffix)], reason)
                        self._send(HTTPStatus.OK, op.to_json())
                        return
                    self._error(HTTPStatus.NOT_FOUND, f"no such path {path}")
                except ValueError as e:
                    self._error(HTTPStatus.BAD_REQUEST, str(e))
                except ResizeRefused as e:
                    self._error(e.status, e.message, e.operation)

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
