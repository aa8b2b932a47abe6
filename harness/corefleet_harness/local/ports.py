# SPDX-License-Identifier: Apache-2.0
"""A local fleet's ports: the user's HTTP port, checked free, and free ports for everything else.

The free ports come from `corefleet_harness.support` (below the ephemeral range, so that no process's
outgoing connection takes a port another one is about to bind); running out of them is a
LocalFleetError here, which `corefleet up` and `corefleet scale` report.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from corefleet_harness.local.config import LOCALHOST, LocalFleetError
from corefleet_harness.support import NoFreePorts, free_port_pair, free_ports


@dataclass(frozen=True)
class Ports:
    http: int  # the OpenAI API (the user's endpoint)
    admin: int  # the frontend's admin API
    rpc: int  # the frontend's handshake ROUTER (--data-parallel-rpc-port)
    coord_front_publish: int
    coord_back_output: int
    coord_back_publish: int
    health: tuple[int, ...]  # per rank: the engine launcher's /livez and /readyz
    coord_store: int | None = None  # elastic EP: engine 0's coordination store (its control port is the next one)
    # The frontend's requests ROUTER and outputs PULL, fixed so that a replacement frontend binds the same and the
    # running engines reconnect to it (as the pods' `FRONTEND_ENGINE_INPUT/OUTPUT_PORT`); None in a fleet started
    # before they were (its frontend cannot be replaced in place).
    engine_input: int | None = None
    engine_output: int | None = None

    @property
    def engine_ports(self) -> tuple[int, int] | None:
        if self.engine_input is None or self.engine_output is None:
            return None
        return self.engine_input, self.engine_output


def check_port_free(port: int, what: str = "--port") -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((LOCALHOST, port))
        except OSError as e:
            hint = " (pick another with --port)" if what == "--port" else ""
            raise LocalFleetError(f"{what} {port} on {LOCALHOST} is taken: {e.strerror}{hint}") from None


def fleet_ports(http: int, replicas: int, *, elastic_ep: bool) -> Ports:
    """The ports of a new fleet serving on `http`: free ones for the admin API, the handshake, the
    coordinator, the frontend's engine sockets and each rank's health, and with elastic EP a free pair for the
    coordination store."""
    try:
        free = free_ports(7 + replicas, exclude=[http])
    except NoFreePorts as e:
        raise LocalFleetError(str(e)) from None
    store = None
    if elastic_ep:
        try:
            store = free_port_pair(exclude=[http, *free])
        except NoFreePorts as e:
            raise LocalFleetError(f"{e}, for the coordination store") from None
    return Ports(http=http, admin=free[0], rpc=free[1], coord_front_publish=free[2], coord_back_output=free[3],
                 coord_back_publish=free[4], engine_input=free[5], engine_output=free[6], health=tuple(free[7:]),
                 coord_store=store)


def with_new_ranks(ports: Ports, new_ranks: Sequence[int]) -> Ports:
    """`ports` with free health ports for `new_ranks` (consecutive, from the first rank not yet serving)."""
    try:
        health = free_ports(len(new_ranks), exclude=[ports.http, ports.admin, ports.rpc, *(ports.engine_ports or ()),
                                                     *ports.health])
    except NoFreePorts as e:
        raise LocalFleetError(str(e)) from None
    return dataclasses.replace(ports, health=(*ports.health[:new_ranks[0]], *health))
