# SPDX-License-Identifier: Apache-2.0
"""A replacement frontend re-attaches to engines that already run, instead of their startup handshake.

A frontend pod that is lost (killed, OOM, evicted, its node drained) is replaced by the operator with a
new pod of the same name, started with `--attach` and the fleet's committed size, while the engines run
on with their weights loaded. What makes that possible:

* The engines' requests and outputs sockets on the frontend are on fixed ports (`--engine-input-port`,
  `--engine-output-port`), advertised under the frontend pod's stable DNS name (`--advertise-address`):
  the addresses every engine was given in its handshake's INIT stay valid. libzmq reconnects a lost
  connection by itself and resolves the name again each time, so every running engine's requests DEALER
  and outputs PUSH connect to the replacement as soon as it listens.
* vLLM's client, built over engines "managed externally", waits for one message from every engine on its
  requests ROUTER: the ready response an engine sends only when that socket first connects. So, once the
  ROUTER exists (`vllm_compat.attaching`), `announce` sends each rank the `ATTACH_UTILITY` call as soon as
  the ROUTER knows its connection (ROUTER_MANDATORY refuses a send to a rank not connected yet). The
  engine (`enginecore.install_attach_support`) sends its ready response again on that connection, and
  aborts whatever it still holds for this client index: the lost frontend's requests, whose clients got
  an error when their connection broke (no orphaned request keeps a slot).
* The answers to those calls, and to calls the lost frontend made, arrive with call ids this client does
  not know: vLLM would fail on them (`vllm_compat.tolerate_unknown_utility_results`).

The committed size comes from the operator (`--data-parallel-size`, what it recorded): the ranks
0..N-1 are attached, but those of `--detached-ranks` (a replacement of them was in flight when the lost
frontend went, and the operator deleted their new engines): they are not asked, vLLM's wait gets a stand-in for
each (`vllm_compat.attaching`), and they start Dead, to be replaced. A rank that does not reconnect within
`--attach-timeout` fails the start (exit 1): the operator then recreates the fleet, as it would for a rank lost
with its frontend.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from vllm.v1.engine import EngineCoreRequestType
from vllm.v1.serial_utils import MsgpackEncoder

from corefleet_client.admin import ATTACH_UTILITY
from corefleet_client.frontend.fleet import describe, identity

logger = logging.getLogger("corefleet.frontend")

_RETRY_S = 0.05


def attach_request(client_index: int) -> list[Any]:
    """The frames (after the engine's identity) of the `ATTACH_UTILITY` call, as vLLM's client sends a utility."""
    call_id = uuid.uuid1().int >> 64  # as vLLM numbers its utility calls
    return [EngineCoreRequestType.UTILITY.value,
            *MsgpackEncoder().encode((client_index, call_id, ATTACH_UTILITY, (client_index,)))]


def announcer(ranks: Sequence[int], client_index: int, timeout: float,
              clock: Callable[[], float] = time.monotonic) -> Callable[[Any], None]:
    """What `vllm_compat.attaching` runs on the requests ROUTER: each rank asked to announce itself again."""

    def announce(router: Any) -> None:
        sync: zmq.Socket[bytes] = zmq.Socket.shadow(router.underlying)
        sync.setsockopt(zmq.ROUTER_MANDATORY, 1)
        waiting = list(ranks)
        started = clock()
        while waiting:
            for rank in list(waiting):
                try:
                    sync.send_multipart([identity(rank), *attach_request(client_index)], flags=zmq.NOBLOCK)
                except zmq.ZMQError as e:
                    if e.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                        raise
                    continue
                waiting.remove(rank)
                logger.info("Rank %d reconnected after %.2fs: asked it to re-attach", rank, clock() - started)
            if waiting:
                if clock() - started > timeout:
                    raise RuntimeError(f"{describe(waiting)} did not reconnect to this frontend within "
                                       f"{timeout:g}s: cannot re-attach to the running engines")
                time.sleep(_RETRY_S)

    return announce
