# SPDX-License-Identifier: Apache-2.0
"""The elastic-EP coordination stores of a fleet, served from engine rank 0's pod.

    python -m corefleet_client.coordstore --host H --port P

vLLM 0.32.0 with `--enable-elastic-ep` opens a coordination TCPStore in every engine at startup
(`distributed/parallel_state.py::_init_elastic_ep_world`, and `ParallelConfig._pick_stateless_dp_port`
for the DP group: rank 0 binds a port and publishes it as `dp_master_port`, the others read it),
at `data_parallel_master_ip:_coord_store_port` from the INIT message. Its multiprocess launch
creates no such store (only the Ray actor manager does, `v1/engine/utils.py`), and the address is
also where every group's rank 0 binds, so the store must live in engine 0's network namespace
(docs/vllm-protocol.md §10.2). corefleet's INIT names engine 0's pod as the DP master
(`vllm_compat.advertised_parallel_config`, change 2) and this store's port as `_coord_store_port`;
engine 0's launcher (`corefleet_client.engine --coord-store-port`) runs this module as a child
beside its engine core, bound to the launcher's own host (the pod's address or 0.0.0.0).

The store on P is the startup's. vLLM's keys are not scoped per resize (`eep_ready/*`,
`dp_master_port`, the groups' `world_0`, `dp_0`, `ep_0`, `eplb_0`), so each resize needs a fresh
store, and upstream makes one per resize beside engine 0 (`DPLBAsyncMPClient.
_setup_elastic_ep_reconfig_bootstrap`, port 0 at the DP master address). Here the frontend, in
another pod, asks for it: `GET /resize-store?id=RESIZE` on P + 1 (`CONTROL_PORT_OFFSET`) makes a
fresh store on a free port of this host and answers `{"store_port": ..., "master_ports": [...]}`
with `MASTER_PORTS` more free ports of this host for the new groups' rank 0 (which binds here:
vLLM's `_data_parallel_master_port_list`). The same id gets the same answer (a retried request);
a new id closes the stores of earlier resizes, since one resize runs at a time. A store holds
keys only; a lost store fails the engines that use it, as it would in vLLM, and the launcher ends
the pod with it.

`StoreService` is also what the engine emulator's rank 0 runs in-process (it plays the launcher too).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import threading
import urllib.parse
import urllib.request
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any

from corefleet_client.process import configure_logging, send_json

logger = logging.getLogger(__name__)

EXIT_OK = 0
LISTEN_BACKLOG = 128
CONTROL_PORT_OFFSET = 1  # the control port (fresh stores for resizes) is the startup store's port + 1
MASTER_PORTS = 5  # free ports handed out with a resize's store (vLLM's get_open_ports_list(5))
RESIZE_STORE_PATH = "/resize-store"


def tcp_socket(host: str) -> socket.socket:
    """A TCP socket of the family `host` (an address, v4 or v6) needs."""
    return socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)


def serve(host: str, port: int) -> Any:
    """A TCPStore master listening on exactly `host:port` (torch's own master listens on every address,
    so it gets a socket bound here: `master_listen_fd`). The store owns that socket from then on (it
    closes it when it is destroyed): keep the store referenced for as long as it serves."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    sock = tcp_socket(host)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
        bound = sock.getsockname()[1]
        store = TCPStore(host, bound, is_master=True, world_size=-1, wait_for_workers=False,
                         master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store closes it
    return store


def free_ports(host: str, count: int) -> list[int]:
    """`count` ports free on `host` now (each bound to port 0, all held until every one is picked)."""
    socks = []
    try:
        for _ in range(count):
            sock = tcp_socket(host)
            socks.append(sock)
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class StoreService:
    """The startup's store on `host:port`, and fresh stores for resizes on request (the control port)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._lock = threading.Lock()
        self._resizes: dict[str, tuple[Any, dict[str, Any]]] = {}  # resize id -> (its store, the answer)
        self.startup = serve(host, port)
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                ids = urllib.parse.parse_qs(url.query).get("id", [])
                if url.path != RESIZE_STORE_PATH or len(ids) != 1 or not ids[0]:
                    send_json(self, HTTPStatus.NOT_FOUND, {"error": f"GET {RESIZE_STORE_PATH}?id=RESIZE"})
                    return
                try:
                    send_json(self, HTTPStatus.OK, service.resize_store(ids[0]))
                except OSError as e:
                    logger.exception("Cannot make the coordination store of resize %s", ids[0])
                    send_json(self, HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(e).__name__}: {e}"})

        try:
            self._http = ThreadingHTTPServer((host, port + CONTROL_PORT_OFFSET), Handler)
        except BaseException:
            del self.startup
            raise
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, name="coord-store-control", daemon=True)
        self._thread.start()
        logger.info("Coordination store listening on %s:%d (fresh stores for resizes: %s:%d%s)", host, port,
                    host, port + CONTROL_PORT_OFFSET, RESIZE_STORE_PATH)

    def resize_store(self, resize_id: str) -> dict[str, Any]:
        """The store of resize `resize_id`: made on the first request, the same answer after that."""
        with self._lock:
            known = self._resizes.get(resize_id)
            if known is not None:
                return known[1]
            store = serve(self.host, 0)
            answer = {"store_port": int(store.port), "master_ports": free_ports(self.host, MASTER_PORTS)}
            for old in list(self._resizes):  # one resize at a time: earlier ones are over
                logger.info("Closing the coordination store of resize %s", old)
                del self._resizes[old]
            self._resizes[resize_id] = (store, answer)
        logger.info("Coordination store of resize %s listening on %s:%d", resize_id, self.host, answer["store_port"])
        return answer

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        with self._lock:
            self._resizes.clear()
        del self.startup


def request_resize_store(host: str, store_port: int, resize_id: str, timeout: float = 10.0) -> tuple[int, list[int]]:
    """Ask engine 0's StoreService (its startup store at `host:store_port`) for resize `resize_id`'s fresh store:
    (the store's port, free ports of that host for the new groups' masters). Raises OSError or ValueError."""
    query = urllib.parse.urlencode({"id": resize_id})
    bracketed = f"[{host}]" if ":" in host else host
    url = f"http://{bracketed}:{store_port + CONTROL_PORT_OFFSET}{RESIZE_STORE_PATH}?{query}"
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body = json.loads(r.read())
    return int(body["store_port"]), [int(p) for p in body["master_ports"]]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m corefleet_client.coordstore",
                                description="Serve the elastic-EP coordination stores of a fleet: the startup's, "
                                            "and fresh ones for resizes on request.")
    p.add_argument("--host", default="0.0.0.0", help="the address to listen on (default: every address)")
    p.add_argument("--port", type=int, required=True,
                   help="the startup store's port (the INIT's _coord_store_port); the control port is the next one")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    configure_logging()
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    service = StoreService(opts.host, opts.port)
    while not stop.wait(1.0):
        pass
    logger.info("Coordination store stopping")
    service.close()
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
