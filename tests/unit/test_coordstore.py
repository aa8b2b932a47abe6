# SPDX-License-Identifier: Apache-2.0
"""The elastic-EP coordination stores (`corefleet_client.coordstore.StoreService`) over real sockets.

The service runs in-process on 127.0.0.1: the startup TCPStore on a port P, its HTTP control port on
P + CONTROL_PORT_OFFSET. The tests talk to it as vLLM's engines and corefleet's frontend do: torch
TCPStore clients for the stores, `request_resize_store` (or plain urllib) for the control port.
"""

from __future__ import annotations

import datetime
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from corefleet_client.coordstore import (
    CONTROL_PORT_OFFSET,
    MASTER_PORTS,
    RESIZE_STORE_PATH,
    StoreService,
    request_resize_store,
)
from corefleet_harness.support import free_port_pair

HOST = "127.0.0.1"
CLIENT_TIMEOUT = datetime.timedelta(seconds=5)
DEAD_TIMEOUT = datetime.timedelta(milliseconds=300)  # a client of a closed store gives up after this
SERVICE_TRIES = 5


def start_service() -> StoreService:
    """A StoreService on a free port pair (retried: another process may take a port in between)."""
    error: OSError | None = None
    for _ in range(SERVICE_TRIES):
        try:
            return StoreService(HOST, free_port_pair(offset=CONTROL_PORT_OFFSET))
        except OSError as e:  # the pair was taken between the probe and the bind
            error = e
    raise AssertionError(f"cannot start a StoreService: {error}")


def client(port: int, timeout: datetime.timedelta = CLIENT_TIMEOUT) -> Any:
    """A TCPStore client of the store on HOST:port, as vLLM's engines open one."""
    return TCPStore(HOST, port, is_master=False, world_size=-1, wait_for_workers=False, timeout=timeout)


def assert_closed(port: int) -> None:
    """Nothing serves a store on HOST:port: the port refuses connections, and a new client fails."""
    with pytest.raises(ConnectionRefusedError), socket.create_connection((HOST, port), timeout=5):
        pass
    with pytest.raises(RuntimeError):  # torch's DistNetworkError / DistStoreError are RuntimeErrors
        client(port, DEAD_TIMEOUT)


def control_url(service: StoreService, path_and_query: str) -> str:
    return f"http://{HOST}:{service.port + CONTROL_PORT_OFFSET}{path_and_query}"


@pytest.fixture
def service() -> Iterator[StoreService]:
    svc = start_service()
    try:
        yield svc
    finally:
        svc.close()


def test_startup_store_serves_on_its_port(service: StoreService) -> None:
    a, b = client(service.port), client(service.port)
    a.set("dp_master_port", "29600")
    assert b.get("dp_master_port") == b"29600"


def test_resize_store_is_a_fresh_store(service: StoreService) -> None:
    startup = client(service.port)
    startup.set("eep_ready/0", "1")

    store_port, _ = request_resize_store(HOST, service.port, "r1")

    assert store_port not in (service.port, service.port + CONTROL_PORT_OFFSET)
    fresh = client(store_port)
    assert not fresh.check(["eep_ready/0"])
    fresh.set("world_0", "x")
    assert not startup.check(["world_0"])  # and the other way round


def test_same_id_gets_the_same_answer_and_store(service: StoreService) -> None:
    first = request_resize_store(HOST, service.port, "r1")
    client(first[0]).set("dp_0", "addr")

    again = request_resize_store(HOST, service.port, "r1")

    assert again == first
    assert client(again[0]).get("dp_0") == b"addr"


def test_new_id_gets_a_new_store_and_closes_the_old_one(service: StoreService) -> None:
    old_port, _ = request_resize_store(HOST, service.port, "r1")
    client(old_port).set("ep_0", "old")

    new_port, _ = request_resize_store(HOST, service.port, "r2")

    assert new_port != old_port
    assert not client(new_port).check(["ep_0"])
    assert_closed(old_port)
    # The startup store is untouched by resizes.
    client(service.port).set("k", "v")


def test_master_ports_are_distinct_ports(service: StoreService) -> None:
    store_port, master_ports = request_resize_store(HOST, service.port, "r1")

    assert len(master_ports) == MASTER_PORTS == 5
    assert all(type(p) is int and 1 <= p <= 65535 for p in master_ports)
    assert len(set(master_ports)) == MASTER_PORTS
    assert store_port not in master_ports


def test_answer_is_json_with_the_store_and_master_ports(service: StoreService) -> None:
    with urllib.request.urlopen(control_url(service, f"{RESIZE_STORE_PATH}?id=r1"), timeout=10) as r:
        assert r.headers["Content-Type"] == "application/json"
        body = json.loads(r.read())
    assert set(body) == {"store_port", "master_ports"}
    assert (body["store_port"], body["master_ports"]) == request_resize_store(HOST, service.port, "r1")


@pytest.mark.parametrize("path", [
    "/",
    "/nope?id=r1",
    RESIZE_STORE_PATH,
    f"{RESIZE_STORE_PATH}?id=",
    f"{RESIZE_STORE_PATH}?other=r1",
    f"{RESIZE_STORE_PATH}?id=r1&id=r2",
])
def test_bad_path_or_missing_id_is_404(service: StoreService, path: str) -> None:
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(control_url(service, path), timeout=10)
    assert e.value.code == 404
    assert RESIZE_STORE_PATH in json.loads(e.value.read())["error"]
    e.value.close()


def test_404_makes_no_store(service: StoreService) -> None:
    """A refused request leaves the current resize's store serving."""
    port, _ = request_resize_store(HOST, service.port, "r1")
    client(port).set("a", "1")
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(control_url(service, f"{RESIZE_STORE_PATH}?id="), timeout=10)
    assert client(port).get("a") == b"1"


def test_close_stops_the_control_port_and_the_stores() -> None:
    svc = start_service()
    try:
        resize_port, _ = request_resize_store(HOST, svc.port, "r1")
        client(svc.port).set("k", "v")
    finally:
        svc.close()

    with pytest.raises(OSError, match="refused"):  # URLError: connection refused
        request_resize_store(HOST, svc.port, "r2", timeout=2.0)
    assert_closed(svc.port)
    assert_closed(resize_port)
