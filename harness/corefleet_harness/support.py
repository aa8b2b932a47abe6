# SPDX-License-Identifier: Apache-2.0
"""The small tools every harness user needs: a wait with a deadline, free ports, a plain GET, a log's tail.

One copy of each for the harness (local mode, the local control plane and node), the tests and the
benchmarks. The product never imports it (the import contract keeps `corefleet_harness` out of
`corefleet_operator` and `corefleet_client`); it uses only the standard library, because local mode
and the `corefleet` command import it.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Literal, TypeAlias, TypeVar

T = TypeVar("T")
# A wait's condition: a truthy value when it holds (the wait returns it), else None or False.
Check: TypeAlias = Callable[[], T | Literal[False] | None]

LOCALHOST = "127.0.0.1"
DEFAULT_INTERVAL = 0.2  # a check may run kubectl or an HTTP call: not more often on a 2-core machine
LOWEST_FREE_PORT = 10000  # free ports are picked from here up to the ephemeral range
LINUX_EPHEMERAL_RANGE = (32768, 60999)  # Linux's default, if /proc does not say


# ---- waiting -------------------------------------------------------------------------------------
class WaitTimeout(TimeoutError, AssertionError):
    """A wait ran out of time.

    Harness code sees a TimeoutError; a test sees an AssertionError, so that a test whose condition
    never comes about fails as an assertion, and `except AssertionError` in a test catches it.
    """


def wait_until(check: Check[T], timeout: float, what: str, *, interval: float = DEFAULT_INTERVAL,
               retry_on: tuple[type[Exception], ...] = (), fatal: tuple[type[BaseException], ...] = (),
               diagnose: Callable[[], str] | None = None) -> T:
    """Call `check` every `interval` seconds until it returns something truthy, and return that (typed
    without the None or False that meant "not yet").

    After `timeout` seconds, WaitTimeout naming `what`, the last exception `check` raised (if any) and
    what `diagnose` (if given) says at that moment. An exception from `check` propagates at once,
    unless it is one of `retry_on` (it then means "not yet") and not one of `fatal`.
    """
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        result, error = _attempt(check, retry_on, fatal)
        if result:
            return result
        last = error or last
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout, last, diagnose)
        time.sleep(interval)


async def wait_until_async(check: Check[T], timeout: float, what: str, *,  # noqa: ASYNC109
                           interval: float = DEFAULT_INTERVAL, retry_on: tuple[type[Exception], ...] = (),
                           fatal: tuple[type[BaseException], ...] = (),
                           diagnose: Callable[[], str] | None = None) -> T:
    """`wait_until` in an event loop: the same checks and errors, with `asyncio.sleep` between the
    calls so that the tasks that make `check` come true run meanwhile. (`timeout` is `wait_until`'s
    deadline, not `asyncio.timeout`'s: the check is synchronous and the error names what was awaited.)"""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        result, error = _attempt(check, retry_on, fatal)
        if result:
            return result
        last = error or last
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout, last, diagnose)
        await asyncio.sleep(interval)


def _attempt(check: Check[T], retry_on: tuple[type[Exception], ...],
             fatal: tuple[type[BaseException], ...]) -> tuple[T | Literal[False] | None, Exception | None]:
    """One call of `check`: its result, or the exception that means "not yet"."""
    try:
        return check(), None
    except fatal:
        raise
    except retry_on as e:
        return None, e


def _timed_out(what: str, timeout: float, last: Exception | None,
               diagnose: Callable[[], str] | None) -> WaitTimeout:
    message = f"{what}: not done after {timeout:.0f} s"
    if last is not None:
        message += f" (last error: {last!r})"
    if diagnose is not None:
        message += f"\n{diagnose()}"
    return WaitTimeout(message)


# ---- ports ---------------------------------------------------------------------------------------
class NoFreePorts(OSError):
    """Not enough free ports on 127.0.0.1 below the ephemeral range."""


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for the source ports of outgoing connections."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return LINUX_EPHEMERAL_RANGE
    return lo, hi


def free_ports(count: int, exclude: Iterable[int] = ()) -> list[int]:
    """`count` distinct free TCP ports on 127.0.0.1 (held open together so none repeats).

    They lie below the kernel's ephemeral range. Processes of a fleet or a cluster connect to each
    other's fixed ports before the other side may be listening (an engine's DEALER retries until the
    frontend binds), and a TCP connect on one host to a port in the ephemeral range can pick that
    very port as its source and connect to itself, leaving the server unable to bind. The search
    starts at a random port, so that processes picking ports at the same time rarely collide.
    """
    taken = set(exclude)
    lo, _ = ephemeral_port_range()
    if lo - LOWEST_FREE_PORT < 10 * count:
        raise NoFreePorts(f"too few ports below the ephemeral range ({lo}) for {count} free ports")
    start = random.randrange(LOWEST_FREE_PORT, lo)
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        for port in (*range(start, lo), *range(LOWEST_FREE_PORT, start)):
            if len(ports) == count:
                break
            if port in taken:
                continue
            s = socket.socket()
            try:
                s.bind((LOCALHOST, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(port)
    finally:
        for s in socks:
            s.close()
    if len(ports) < count:
        raise NoFreePorts(f"found only {len(ports)} of {count} free ports on {LOCALHOST}")
    return ports


def free_port(exclude: Iterable[int] = ()) -> int:
    """One free TCP port on 127.0.0.1, below the ephemeral range (`free_ports`)."""
    return free_ports(1, exclude)[0]


def free_port_pair(exclude: Iterable[int] = (), attempts: int = 50, offset: int = 1) -> int:
    """A free port p with p + `offset` free too (a coordination store and its control port)."""
    taken = list(exclude)
    for _ in range(attempts):
        port = free_port(exclude=taken)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind((LOCALHOST, port))
                b.bind((LOCALHOST, port + offset))
        except OSError:
            taken.append(port)
            continue
        return port
    raise NoFreePorts(f"no free port pair (p, p + {offset}) on {LOCALHOST} in {attempts} tries")


# ---- HTTP and logs -------------------------------------------------------------------------------
def http_get(url: str, timeout: float = 5.0, *, unanswered_ok: bool = False) -> tuple[int, bytes]:
    """GET `url` (plain HTTP, no auth): (status, body) of whatever answers, error statuses included.

    When nothing answers (refused, reset, timed out) it raises the OSError, so that a wait names
    the reason (`wait_until(..., retry_on=(OSError,))`); with `unanswered_ok` it returns (0, b"").
    """
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        if unanswered_ok:
            return 0, b""
        raise


def tail(path: str | Path, lines: int = 40) -> str:
    """The last `lines` lines of a log file, or "(no log)" if it cannot be read."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
