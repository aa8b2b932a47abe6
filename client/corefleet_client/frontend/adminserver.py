# SPDX-License-Identifier: Apache-2.0
"""The admin API server: a small HTTP server in its own thread.

It runs apart from vLLM's event loop on purpose: the loop is blocked while the engines handshake
at startup (vLLM's `wait_for_engine_startup` is synchronous), and that is exactly when the operator
wants to see which ranks have joined. It reads and writes only through an `AdminBackend` (the
frontend's `Fleet`), which is thread-safe and hands resizes to the event loop itself; no handler
waits for a resize to finish.

`ResizeRefused` (`frontend.types`), raised by the backend, becomes the response's status and error.
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
from corefleet_client.frontend.types import ResizeRefused
from corefleet_client.process import send_json

logger = logging.getLogger(__name__)


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

    def commit_resize(self, resize_id: str) -> ResizeOperation:
        """A follower's Prepared part of a resize goes on (raises ResizeRefused)."""
        ...

    def cancel_resize(self, resize_id: str, reason: str) -> ResizeOperation:
        """The operation, failed by the cancel; raises ResizeRefused (404, or 409 once it committed)."""
        ...

    def orphan_resize(self, resize_id: str, reason: str) -> ResizeOperation:
        """A follower's part whose frontend 0 is gone decides now; raises ResizeRefused (404, 400)."""
        ...


class _HTTPServer(ThreadingHTTPServer):
    """The HTTP server: what every request's handler reads (the token, the backend)."""

    daemon_threads = True

    def __init__(self, host: str, port: int, token: str, backend: AdminBackend) -> None:
        self.token = token
        self.backend = backend
        super().__init__((host, port), _Handler)


class _Handler(BaseHTTPRequestHandler):
    """One request of the admin API (see `corefleet_client.admin` for the paths)."""

    server_version = "corefleet-admin"
    server: _HTTPServer

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
        if authorized(self.headers.get(AUTH_HEADER), self.server.token):
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
        if path == LIVE_PATH:
            self._live()
            return
        if not self._authorized():
            return
        backend = self.server.backend
        if path == FLEET_PATH:
            self._send(HTTPStatus.OK, backend.snapshot().to_json())
        elif path == RESIZES_PATH:
            self._send(HTTPStatus.OK, {"operations": [o.to_json() for o in backend.resizes()]})
        elif path.startswith(RESIZES_PATH + "/") and path.count("/") == RESIZES_PATH.count("/") + 1:
            resize_id = path[len(RESIZES_PATH) + 1:]
            op = backend.resize(resize_id)
            if op is None:
                self._error(HTTPStatus.NOT_FOUND, f"no resize {resize_id!r}")
            else:
                self._send(HTTPStatus.OK, op.to_json())
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no such path {path}")

    def _live(self) -> None:
        """Answered from this thread: a wedged event loop cannot answer for itself."""
        stalled = self.server.backend.stalled_for()
        if stalled > LOOP_STALL_LIMIT_S:
            self._send(HTTPStatus.SERVICE_UNAVAILABLE,
                       {"status": "stalled", "error": f"the frontend's event loop made no progress "
                                                      f"for {stalled:.0f}s"})
        else:
            self._send(HTTPStatus.OK, {"status": "ok"})

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if not self._authorized():
            return
        try:
            body = self._body()
            if path == RESIZES_PATH:
                self._start_resize(body)
                return
            prefix, suffix = RESIZES_PATH + "/", "/cancel"
            if path.startswith(prefix) and path.endswith(suffix):
                self._cancel_resize(path[len(prefix):-len(suffix)], body)
                return
            if path.startswith(prefix) and path.endswith("/orphan"):
                reason = self._reason(body)
                op = self.server.backend.orphan_resize(path[len(prefix):-len("/orphan")], reason)
                self._send(HTTPStatus.OK, op.to_json())
                return
            if path.startswith(prefix) and path.endswith("/commit"):
                op = self.server.backend.commit_resize(path[len(prefix):-len("/commit")])
                self._send(HTTPStatus.OK, op.to_json())
                return
            self._error(HTTPStatus.NOT_FOUND, f"no such path {path}")
        except ValueError as e:
            self._error(HTTPStatus.BAD_REQUEST, str(e))
        except ResizeRefused as e:
            self._error(e.status, e.message, e.operation)

    def _start_resize(self, body: Any) -> None:
        request = ResizeRequest.from_json(body)
        problem = request.validate()
        if problem is not None:
            raise ValueError(problem)
        started, op = self.server.backend.start_resize(request)
        self._send(HTTPStatus.ACCEPTED if started else HTTPStatus.OK, op.to_json())

    def _cancel_resize(self, resize_id: str, body: Any) -> None:
        op = self.server.backend.cancel_resize(resize_id, self._reason(body))
        self._send(HTTPStatus.OK, op.to_json())

    @staticmethod
    def _reason(body: Any) -> str:
        reason = body.get("reason") if isinstance(body, dict) else None
        if not isinstance(reason, str) or not reason:
            raise ValueError("a cancel or an orphaning needs a non-empty 'reason'")
        return reason


class AdminServer:
    """The admin API on `host:port`, in its own thread, over `backend`."""

    def __init__(self, host: str, port: int, token: str, backend: AdminBackend) -> None:
        self._httpd = _HTTPServer(host, port, token, backend)
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
