# SPDX-License-Identifier: Apache-2.0
"""The harness's shared tools (`corefleet_harness.support`): the wait, the free ports, the GET and the log tail."""

from __future__ import annotations

import asyncio
import socket
import threading
import urllib.error
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from corefleet_harness.support import (
    WaitTimeout,
    ephemeral_port_range,
    free_port_pair,
    free_ports,
    http_get,
    tail,
    wait_until,
    wait_until_async,
)


# ---- wait_until ----------------------------------------------------------------------------------
def test_wait_until_returns_once_true_and_times_out_with_last_error() -> None:
    calls = iter([False, False, True])
    wait_until(lambda: next(calls), 5, "three tries", interval=0.001)

    def boom() -> bool:
        raise ValueError("not yet")

    with pytest.raises(TimeoutError, match=r"never: not done after 0 s \(last error: ValueError\('not yet'\)\)"):
        wait_until(boom, 0.05, "never", interval=0.01, retry_on=(Exception,))


def test_wait_until_propagates_fatal_errors_at_once() -> None:
    def fatal() -> bool:
        raise KeyError("dead")

    with pytest.raises(KeyError):
        wait_until(fatal, 60, "fatal", retry_on=(Exception,), fatal=(KeyError,))


def test_wait_until_returns_the_checks_first_truthy_value() -> None:
    values: Iterator[dict[str, str] | None] = iter([None, {}, {"phase": "Running"}])
    assert wait_until(lambda: next(values), 5, "a truthy value", interval=0.001) == {"phase": "Running"}


def test_wait_until_propagates_what_it_does_not_retry_on() -> None:
    calls: list[int] = []

    def refused() -> bool:
        calls.append(1)
        raise ConnectionRefusedError("refused")

    with pytest.raises(ConnectionRefusedError, match="refused"):
        wait_until(refused, 60, "no retry")
    with pytest.raises(ConnectionRefusedError, match="refused"):
        wait_until(refused, 60, "retry on ValueError only", retry_on=(ValueError,))
    assert len(calls) == 2  # once each: no second try


def test_a_wait_in_vain_is_an_assertion_for_tests_and_a_timeout_for_the_harness() -> None:
    with pytest.raises(AssertionError) as err:
        wait_until(lambda: False, 0, "the impossible", interval=0.001, diagnose=lambda: "state: nothing happened")
    assert isinstance(err.value, TimeoutError)
    assert isinstance(err.value, WaitTimeout)
    assert str(err.value) == "the impossible: not done after 0 s\nstate: nothing happened"


def test_wait_until_async_lets_the_loop_run_until_the_check_holds() -> None:
    async def scenario() -> str:
        done: list[str] = []

        async def later() -> None:
            await asyncio.sleep(0)
            done.append("set")

        task = asyncio.create_task(later())
        got = await wait_until_async(lambda: done[0] if done else None, 5, "the task", interval=0.001)
        await task
        with pytest.raises(AssertionError, match="never: not done after 0 s\nwhy: no task sets it"):
            await wait_until_async(lambda: False, 0, "never", interval=0.001, diagnose=lambda: "why: no task sets it")
        return got

    assert asyncio.run(scenario()) == "set"


# ---- free ports ----------------------------------------------------------------------------------
def test_free_ports_lie_below_the_ephemeral_range() -> None:
    """A connect to an ephemeral port on the same host can connect to itself and steal the port."""
    lo, _ = ephemeral_port_range()
    ports = free_ports(40, exclude=[free_ports(1)[0]])
    assert len(set(ports)) == 40
    assert all(1024 < p < lo for p in ports), ports


def test_a_free_port_pair_is_two_free_ports() -> None:
    port = free_port_pair()
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", port))
        b.bind(("127.0.0.1", port + 1))


def test_free_ports_leave_out_the_excluded() -> None:
    taken = free_ports(5)
    assert not set(free_ports(20, exclude=taken)) & set(taken)


# ---- http_get and tail ---------------------------------------------------------------------------
class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        code = int(self.path.strip("/"))
        body = f"status {code}".encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_http_get_returns_every_answer_with_its_body(server: str) -> None:
    assert http_get(f"{server}/200") == (200, b"status 200")
    assert http_get(f"{server}/404") == (404, b"status 404")
    assert http_get(f"{server}/503", 2) == (503, b"status 503")


def test_http_get_raises_when_nothing_answers_unless_told_not_to() -> None:
    url = f"http://127.0.0.1:{free_ports(1)[0]}/health"
    with pytest.raises(urllib.error.URLError, match="Connection refused"):  # an OSError
        http_get(url)
    assert http_get(url, unanswered_ok=True) == (0, b"")


def test_tail_is_the_last_lines_or_says_there_is_no_log(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert tail(log, 3) == "line 97\nline 98\nline 99"
    assert tail(str(log)).splitlines() == [f"line {i}" for i in range(60, 100)]
    assert tail(tmp_path / "missing.log") == "(no log)"
