# SPDX-License-Identifier: Apache-2.0
"""The process kubelet's probe attempts (`podrunner.run_probe`) and probe defaults, without processes:
an in-process HTTP server answers, a socket that listens but never accepts stands for a hung one.
(The probe semantics over time, with real containers, are in tests/integration/test_podrunner_probes.py.)"""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator

import pytest

from corefleet_harness.support import free_port
from podrunner import LIVENESS, READINESS, Probe, run_probe


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        code = int(self.path.strip("/"))
        self.send_response(code)
        if code in (301, 302):
            self.send_header("Location", "/500")  # not followed: the 3xx is the answer
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[int]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield int(httpd.server_address[1])
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def hung() -> Iterator[int]:
    """A port whose connections complete (the kernel's backlog) but are never answered."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield int(s.getsockname()[1])


@pytest.mark.parametrize(("code", "ok"), [(200, True), (204, True), (302, True), (399, True), (400, False),
                                          (500, False), (503, False)])
def test_http_probe_succeeds_on_200_to_399(server: int, code: int, ok: bool) -> None:
    got, detail = run_probe({"httpGet": {"path": f"/{code}", "port": "health"}}, "127.0.0.1", {"health": server}, {},
                            timeout=5)
    assert got is ok, detail


def test_http_probe_of_a_hung_server_times_out(hung: int) -> None:
    ok, detail = run_probe({"httpGet": {"path": "/livez", "port": hung}}, "127.0.0.1", {}, {}, timeout=0.3)
    assert not ok
    assert "timed out" in detail, detail


def test_http_and_tcp_probes_of_a_closed_port_fail() -> None:
    port = free_port()
    assert not run_probe({"httpGet": {"path": "/", "port": port}}, "127.0.0.1", {}, {}, timeout=1)[0]
    assert not run_probe({"tcpSocket": {"port": port}}, "127.0.0.1", {}, {}, timeout=1)[0]


def test_tcp_probe_needs_only_a_connection(hung: int) -> None:
    assert run_probe({"tcpSocket": {"port": "rpc"}}, "127.0.0.1", {"rpc": hung}, {}, timeout=1)[0]


def test_probe_defaults_are_the_apis() -> None:
    probe = Probe.parse(LIVENESS, {"httpGet": {"path": "/livez", "port": 8002}})
    assert (probe.initial_delay, probe.period, probe.timeout, probe.success_threshold, probe.failure_threshold,
            probe.grace) == (0, 10, 1, 1, 3, None)


@pytest.mark.parametrize("probe", [{"grpc": {"port": 9000}}, {}, {"httpGet": {"port": 1}, "tcpSocket": {"port": 1}}])
def test_unsupported_probes_are_refused(probe: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="unsupported readinessProbe"):
        Probe.parse(READINESS, probe)
