# SPDX-License-Identifier: Apache-2.0
"""The elastic-EP coordination store client: the one place an emulated engine imports torch.

vLLM's engines reach the fleet's coordination store (`eep_ready/{rank}`, `dp_master_port`) through
`torch.distributed.TCPStore`, served by corefleet's `coordstore` (a torch TCPStore master) or by the
emulator's own rank 0 (`--coord-store-port`). Its wire protocol is torch's own and versioned with torch,
so the emulator uses torch's client rather than a copy of the protocol: torch is imported in
`get_cached_tcp_store_client`, on first use, which only the elastic-EP paths reach (an elastic engine's
startup, a scale-up's new engine, `reinitialize_distributed` / `commit_prepared_elastic_ep`). Dense and
other MoE engines never import it (an import-linter contract in pyproject.toml names this module as
the exception).
"""

from __future__ import annotations

import functools
from typing import Any


@functools.lru_cache(maxsize=1)
def get_cached_tcp_store_client(host: str, port: int) -> Any:
    """`vllm.distributed.utils.get_cached_tcp_store_client`: a TCPStore client, cached (one at a time).

    torch is imported here rather than at the top so that importing the emulator costs no torch."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore(host, port, is_master=False, wait_for_workers=False)
