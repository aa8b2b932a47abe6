# SPDX-License-Identifier: Apache-2.0
"""Process-level helpers shared by the fleet programs."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler
from typing import Any, NoReturn

LOG_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
# corefleet's loggers: the fleet programs' modules (`corefleet_client.*`) and the frontend's `corefleet.*`.
LOGGER_PREFIXES = ("corefleet", "corefleet_client")


def configure_logging(level: int | str = logging.INFO) -> None:
    """Log corefleet's own messages to stderr at `level`, whatever other libraries do to the root logger.

    A library vLLM's API server imports (model_hosting_container_standards, for SageMaker routes)
    sets the root logger and its handlers to ERROR when it is imported, which silenced every
    corefleet INFO line (resizes, ranks joining and leaving) once the server had started. corefleet's
    loggers therefore get their own handler and do not propagate to the root logger; the root logger
    is also configured (`logging.basicConfig`) for everything else.
    """
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    for name in LOGGER_PREFIXES:
        log = logging.getLogger(name)
        log.handlers = [handler]
        log.setLevel(level)
        log.propagate = False


def send_json(handler: BaseHTTPRequestHandler, status: int, body: Mapping[str, Any] | list[Any],
              headers: Mapping[str, str] | None = None) -> None:
    """Answer an HTTP request with `body` as JSON (the fleet programs' small HTTP servers)."""
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    handler.end_headers()
    handler.wfile.write(data)


def exit_promptly(code: int) -> NoReturn:
    """Exit with `code` without the interpreter's teardown.

    For a program's `__main__`, once it has closed what it opened. With torch loaded (vLLM imports
    it) the teardown takes 3-8 s on these machines, which a pod's stop and `corefleet down` wait out.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
