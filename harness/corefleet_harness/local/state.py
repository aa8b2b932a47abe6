# SPDX-License-Identifier: Apache-2.0
"""The state file `fleet.json`: what a local fleet runs, so that another `corefleet` command finds it.

It lists each process (role, rank, pid, start time, command line, log), the ports, the endpoint and
the admin token file. `corefleet up` rewrites it after every start, so that an `up` that fails half
way still leaves a record `corefleet down` can act on; `corefleet scale` adds and drops engines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corefleet_client.admin import AdminClient
from corefleet_harness.local.config import FLEET_LOCK, STATE_FILE, STATE_VERSION, LocalFleetError, frontend_host
from corefleet_harness.local.ports import Ports


@dataclass(frozen=True)
class ProcessRecord:
    role: str
    rank: int | None
    pid: int
    start_time: int  # clock ticks after boot (/proc/PID/stat field 22)
    argv: tuple[str, ...]
    log: str
    retiring: bool = False  # an engine a resize removes: its exit is expected (`corefleet scale`)

    @property
    def name(self) -> str:
        return self.role if self.rank is None else f"{self.role}-{self.rank}"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProcessRecord:
        return cls(role=data["role"], rank=data["rank"], pid=int(data["pid"]), start_time=int(data["start_time"]),
                   argv=tuple(data["argv"]), log=data["log"], retiring=bool(data.get("retiring", False)))


@dataclass(frozen=True)
class FleetRecord:
    state_dir: str
    engine: str
    model: str
    served_model_name: str
    replicas: int
    endpoint: str  # the OpenAI API base URL, .../v1
    admin_url: str
    token_file: str
    ports: Ports
    boot_id: str
    processes: tuple[ProcessRecord, ...] = ()
    started_at: float = 0.0
    version: int = STATE_VERSION
    # What `corefleet scale` starts new engines with (the fleet's own engine command lines).
    vllm_flags: tuple[str, ...] = ()
    token_delay_ms: int | None = None
    python: str = ""
    gpus_per_rank: int = 0
    frontends: int = 1  # frontend processes: frontend 0 ("frontend"), then "frontend-1" ... (rank: client index)

    def frontend_admin_url(self, index: int) -> str:
        """Frontend `index`'s admin API (frontend 0's is `admin_url`: resizes go there)."""
        return self.admin_url if index == 0 else f"http://{frontend_host(index)}:{self.ports.admin}"

    @property
    def elastic_ep(self) -> bool:
        """A MoE fleet with elastic EP: its resizes run vLLM's elastic-EP protocol."""
        return self.ports.coord_store is not None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FleetRecord:
        if data.get("version") != STATE_VERSION:
            raise ValueError(f"state file version {data.get('version')!r}, expected {STATE_VERSION}")
        fields = {f.name for f in dataclasses.fields(cls)} - {"processes", "ports", "vllm_flags"}
        procs = tuple(ProcessRecord.from_json(p) for p in data.get("processes", ()))
        ports = Ports(**{**data["ports"], "health": tuple(data["ports"]["health"])})
        return cls(**{k: v for k, v in data.items() if k in fields}, ports=ports, processes=procs,
                   vllm_flags=tuple(data.get("vllm_flags", ())))

    def admin_client(self, timeout: float = 5.0) -> AdminClient:
        return AdminClient(self.admin_url, Path(self.token_file).read_text().strip(), timeout=timeout)


def state_file(state_dir: Path) -> Path:
    return Path(state_dir) / STATE_FILE


def save_record(record: FleetRecord) -> None:
    """Write the state file atomically (a reader sees the old or the new one)."""
    path = state_file(Path(record.state_dir))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record.to_json(), indent=2) + "\n")
    tmp.replace(path)


def load_record(state_dir: Path) -> FleetRecord | None:
    """The fleet recorded in `state_dir`, or None if there is none."""
    path = state_file(state_dir)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise LocalFleetError(f"cannot read {path}: {e}") from None
    try:
        return FleetRecord.from_json(data)
    except (KeyError, TypeError, ValueError) as e:
        raise LocalFleetError(f"{path} is not a corefleet state file ({e}); remove it by hand") from None


@contextlib.contextmanager
def fleet_lock(state_dir: Path, *, wait: bool) -> Iterator[None]:
    """One change of the fleet's processes at a time: a `corefleet scale`, or the replacement of a lost frontend or
    coordinator (which waits for a resize to end: a resize whose frontend is lost ends at once). Without `wait`,
    a change already running is a LocalFleetError."""
    with (Path(state_dir) / FLEET_LOCK).open("w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise LocalFleetError(f"another `corefleet scale`, or the replacement of a lost frontend or coordinator, "
                                  f"runs for the fleet in {state_dir}") from None
        yield
