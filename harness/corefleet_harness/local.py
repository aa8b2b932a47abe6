# SPDX-License-Identifier: Apache-2.0
"""Local mode: a whole fleet as processes on 127.0.0.1, no Kubernetes (`corefleet up/status/down`).

The processes run the same command lines the operator's pods run (both are built by
`corefleet_client.commands`), with every address 127.0.0.1 and every port a free one, except the
frontend's HTTP port, which the user picks:

* the coordinator: `python -m corefleet_client.coordinator --engine-count N ...` (vLLM's
  DPCoordinator on three fixed ports, without wave coordination for dense models);
* the frontend: `python -m corefleet_client.frontend <admin/coordinator flags> -- MODEL <vLLM flags>`,
  the OpenAI API on the HTTP port and the admin API (`corefleet_client.admin`) on its own port;
* one engine per rank: `python -m corefleet_client.engine` (real vLLM, headless) or
  `python -m corefleet_harness.emulator` (the wire-level test double), `--health-port H -- MODEL
  --headless --data-parallel-start-rank i ...`.

Supervision, all recorded in a state directory so that another `corefleet` command finds it:

* each process leads its own process group (`process_group=0`), so a terminal's Ctrl-C (sent to
  the foreground group) reaches only `corefleet up`, which then stops exactly what it started; its
  output goes to `logs/<name>.log`. Not its own session: with `kernel.sched_autogroup_enabled`
  (the default on most distributions) the CPU scheduler shares the cores between *sessions* before
  threads, so a fleet of one session per process gave the frontend one share against every
  spinning engine worker's share and served at about half of stock `vllm serve` (issue 10);
* the state file `fleet.json` lists each process (role, rank, pid, start time, command line, log),
  the ports, the endpoint and the admin token file. It is rewritten after every start, so a
  `corefleet up` that fails half way still leaves a record `corefleet down` can act on;
* stopping sends SIGTERM to each process group, then SIGKILL to what is left after a grace period.
  A pid is acted on only while it is provably the process that was started: same boot, same start
  time (clock ticks since boot, from /proc/PID/stat) and the recorded command line in
  /proc/PID/cmdline (or the title vLLM's setproctitle gave it, which keeps the start time). So a
  pid recycled by an unrelated process is never signalled. If a group leader is gone but members
  of its group remain (vLLM's EngineCore children), the group is still signalled: Linux does not
  reuse a pid that still names a process group.

This module uses only the standard library (the `corefleet` command lives in the operator package,
which never imports vLLM, torch or ZeroMQ); the tiny model is written by `corefleet_harness.tinymodel`,
which imports `tokenizers` only when it builds a tokenizer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from corefleet_client import commands
from corefleet_client.admin import (
    AdminClient,
    AdminError,
    FleetState,
    FleetStatus,
    RankState,
    ResizeOperation,
    ResizePhase,
    ResizeRequest,
)
from corefleet_harness.emulator import EMULATOR_MODULE
from corefleet_harness.tinymodel import VLLM_CPU_FLAGS, write_tiny_model

logger = logging.getLogger(__name__)

LOCALHOST = "127.0.0.1"
STATE_FILE = "fleet.json"
TOKEN_FILE = "admin-token"
LOG_DIR = "logs"
MODEL_DIR = "models"
STATE_VERSION = 1

ROLE_COORDINATOR = "coordinator"
ROLE_FRONTEND = "frontend"
ROLE_ENGINE = "engine"

ENGINE_VLLM = "vllm"
ENGINE_EMULATOR = "emulator"
ENGINE_KINDS = (ENGINE_VLLM, ENGINE_EMULATOR)
ENGINE_MODULES = {ENGINE_VLLM: commands.ENGINE_MODULE, ENGINE_EMULATOR: EMULATOR_MODULE}
LAUNCHER_ARGS_END = commands.LAUNCHER_ARGS_END  # where `corefleet up`'s own flags end and vLLM's begin

DEFAULT_PORT = 8000
DEFAULT_REPLICAS = 2
TINY_MODEL_NAME = "tiny-llama"
TINY_MOE_MODEL_NAME = "tiny-mixtral"
# Startup budgets: on a 2-core machine one real vLLM engine takes 20-45 s, and they start together.
DEFAULT_READY_TIMEOUT = {ENGINE_VLLM: 420.0, ENGINE_EMULATOR: 180.0}
STOP_GRACE_SECONDS = 20.0  # SIGTERM stops a vLLM engine's process tree in ~6-8 s
POLL_SECONDS = 0.5


class LocalFleetError(Exception):
    """A local fleet could not be started, found or stopped; the message says why and what to do."""


class Interrupted(LocalFleetError):
    """A stop signal arrived while the fleet was starting."""


def default_state_dir() -> Path:
    """`$XDG_RUNTIME_DIR/corefleet`, else `~/.cache/corefleet/local`."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "corefleet"
    return Path.home() / ".cache" / "corefleet" / "local"


# ---- command lines (pure) ------------------------------------------------------------------------
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


@dataclass(frozen=True)
class FleetOptions:
    replicas: int = DEFAULT_REPLICAS
    engine: str = ENGINE_VLLM
    model: str | None = None  # None: the tiny model, written into the state directory
    port: int = DEFAULT_PORT
    state_dir: Path = field(default_factory=default_state_dir)
    vllm_flags: tuple[str, ...] | None = None  # None: VLLM_CPU_FLAGS (plus a served name for the tiny model)
    moe: bool = False  # the tiny model's Mixtral variant (ignored with `model`)
    token_delay_ms: int | None = None  # the emulator's per-token delay
    ready_timeout: float | None = None
    python: str = sys.executable
    # Elastic EP for a MoE model (the largest size it may grow to): engine 0 serves the coordination stores
    # and `corefleet scale` resizes through vLLM's elastic-EP protocol. vLLM runs EPLB only on GPUs.
    elastic_ep_max: int | None = None
    gpus_per_rank: int = 0  # > 0: each engine rank sees its own GPUs (CUDA_VISIBLE_DEVICES)

    def validate(self) -> None:
        if self.replicas < 1:
            raise LocalFleetError(f"--replicas must be at least 1, not {self.replicas}")
        if self.engine not in ENGINE_KINDS:
            raise LocalFleetError(f"--engine must be one of {', '.join(ENGINE_KINDS)}, not {self.engine!r}")
        if not 0 < self.port < 65536:
            raise LocalFleetError(f"--port must be in 1..65535, not {self.port}")
        if self.token_delay_ms is not None and self.engine != ENGINE_EMULATOR:
            raise LocalFleetError("--token-delay-ms applies to --engine emulator only")
        if self.elastic_ep_max is not None and self.elastic_ep_max < self.replicas:
            raise LocalFleetError(f"--elastic-ep-max ({self.elastic_ep_max}) must be at least --replicas "
                                  f"({self.replicas})")
        if self.gpus_per_rank < 0:
            raise LocalFleetError(f"--gpus-per-rank must be >= 0, not {self.gpus_per_rank}")


def coordinator_argv(python: str, replicas: int, ports: Ports, *, moe: bool) -> list[str]:
    """The coordinator's command line (`commands.coordinator_args` on 127.0.0.1); wave
    coordination only for a MoE model."""
    return [
        *commands.command(commands.COORDINATOR_MODULE, python),
        *commands.coordinator_args(
            engine_count=replicas,
            host=LOCALHOST,
            front_publish_port=ports.coord_front_publish,
            back_output_port=ports.coord_back_output,
            back_publish_port=ports.coord_back_publish,
            wave_coordination=moe,
        ),
    ]


def frontend_argv(python: str, model: str, replicas: int, ports: Ports, token_file: Path,
                  vllm_flags: Sequence[str], *, moe: bool = False) -> list[str]:
    """The frontend's command line (`commands.frontend_args`), every listener on 127.0.0.1.

    MoE: engine rank 0 binds the DP master address the frontend advertises; here it is loopback too
    (and so is its coordination store, with elastic EP).
    """
    return [
        *commands.command(commands.FRONTEND_MODULE, python),
        *commands.frontend_args(
            model=model,
            dp_size=replicas,
            host=LOCALHOST,
            port=ports.http,
            dp_address=LOCALHOST,
            rpc_port=ports.rpc,
            admin_host=LOCALHOST,
            admin_port=ports.admin,
            admin_token_file=str(token_file),
            coordinator_address=LOCALHOST,
            coordinator_front_publish_port=ports.coord_front_publish,
            coordinator_back_output_port=ports.coord_back_output,
            coordinator_back_publish_port=ports.coord_back_publish,
            engine0_address=LOCALHOST if moe else None,
            coord_store_port=ports.coord_store if moe else None,
            vllm_flags=vllm_flags,
        ),
    ]


def engine_argv(python: str, engine: str, model: str, replicas: int, rank: int, ports: Ports,
                vllm_flags: Sequence[str], *, token_delay_ms: int | None = None) -> list[str]:
    """Rank `rank`'s command line (`commands.engine_args` on 127.0.0.1): the vLLM engine launcher
    or the emulator (`engine`); `token_delay_ms` applies to the emulator only."""
    return [
        *commands.command(ENGINE_MODULES[engine], python),
        *commands.engine_args(
            model=model,
            dp_size=replicas,
            rank=rank,
            dp_address=LOCALHOST,
            rpc_port=ports.rpc,
            health_host=LOCALHOST,
            health_port=ports.health[rank],
            token_delay_ms=token_delay_ms if engine == ENGINE_EMULATOR else None,
            coord_store_port=ports.coord_store if rank == 0 else None,
            vllm_flags=vllm_flags,
        ),
    ]


def is_moe_model(model: str) -> bool:
    """Whether a local model directory's config.json describes a MoE model (experts per layer)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    keys = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
    return isinstance(config, dict) and any(config.get(k) for k in keys)


def _ephemeral_port_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return lo, hi


def free_port_pair(exclude: Iterable[int] = (), attempts: int = 50) -> int:
    """A free port p whose next port is free too (a coordination store and its control port)."""
    taken = list(exclude)
    for _ in range(attempts):
        (port,) = free_ports(1, exclude=taken)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind((LOCALHOST, port))
                b.bind((LOCALHOST, port + 1))
        except OSError:
            taken.append(port)
            continue
        return port
    raise LocalFleetError("no two consecutive free ports found for the coordination store")


def free_ports(count: int, exclude: Iterable[int] = ()) -> list[int]:
    """`count` distinct free TCP ports on 127.0.0.1 (held open together so none repeats).

    They lie below the kernel's ephemeral range. The fleet's processes connect to each other's
    fixed ports before the other side may be listening (an engine's DEALER retries until the
    frontend binds), and a TCP connect on one host to a port in the ephemeral range can pick that
    very port as its source and connect to itself, leaving the server unable to bind.
    """
    taken = set(exclude)
    lo, _ = _ephemeral_port_range()
    first = 10000
    if lo - first < 10 * count:
        raise LocalFleetError(f"too few ports below the ephemeral range ({lo}) for {count} free ports")
    start = random.randrange(first, lo)
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        for port in (*range(start, lo), *range(first, start)):
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
        raise LocalFleetError(f"found only {len(ports)} of {count} free ports on {LOCALHOST}")
    return ports


def check_port_free(port: int, what: str = "--port") -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((LOCALHOST, port))
        except OSError as e:
            hint = " (pick another with --port)" if what == "--port" else ""
            raise LocalFleetError(f"{what} {port} on {LOCALHOST} is taken: {e.strerror}{hint}") from None


# ---- the state file ------------------------------------------------------------------------------
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


# ---- /proc ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProcStat:
    pid: int
    state: str
    ppid: int
    pgrp: int
    session: int
    start_time: int
    rss_bytes: int


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def proc_stat(pid: int) -> ProcStat | None:
    """Fields of /proc/PID/stat (None if there is no such process)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    # The command name (field 2) is in parentheses and may itself contain spaces or ')'.
    rest = raw[raw.rindex(")") + 2:].split()
    # rest[0] is field 3 (state); field N is rest[N - 3].
    return ProcStat(pid=pid, state=rest[0], ppid=int(rest[1]), pgrp=int(rest[2]), session=int(rest[3]),
                    start_time=int(rest[19]), rss_bytes=int(rest[21]) * _PAGE_SIZE)


def proc_cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.decode(errors="replace").rstrip("\0").split("\0") if raw else []


def all_procs() -> list[ProcStat]:
    procs = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := proc_stat(int(entry))) is not None:
            procs.append(st)
    return procs


def is_running(st: ProcStat | None) -> bool:
    return st is not None and st.state not in ("Z", "X")


def owns(record: FleetRecord, proc: ProcessRecord, st: ProcStat | None = None) -> bool:
    """Whether `proc.pid` is still the process that was started (never a recycled pid).

    Same boot, same start time, and the recorded command line (behind the interpreter of a `#!`
    script), or a vLLM process title
    (`VLLM::...`: setproctitle rewrites /proc/PID/cmdline, e.g. the coordinator's `VLLM::DPCoordinator`).
    """
    st = st if st is not None else proc_stat(proc.pid)
    if not is_running(st) or st is None or record.boot_id != boot_id() or st.start_time != proc.start_time:
        return False
    cmdline = proc_cmdline(proc.pid)
    if cmdline is None:
        return False
    n = len(proc.argv)
    # The kernel runs a `#!` script as `interpreter [arg] script args...`: the argv is then a suffix.
    return tuple(cmdline[-n:]) == proc.argv or (len(cmdline) == 1 and "::" in cmdline[0])


def _group_members(pgrp: int, procs: Iterable[ProcStat], not_before: int) -> list[ProcStat]:
    return [p for p in procs if p.pgrp == pgrp and is_running(p) and p.start_time >= not_before]


def tree_rss_bytes(pid: int, procs: Sequence[ProcStat]) -> int:
    """RSS of `pid` and all its descendants."""
    children: dict[int, list[ProcStat]] = {}
    by_pid = {p.pid: p for p in procs}
    for p in procs:
        children.setdefault(p.ppid, []).append(p)
    total, todo, seen = 0, [pid], set()
    while todo:
        cur = todo.pop()
        if cur in seen:
            continue
        seen.add(cur)
        if (st := by_pid.get(cur)) is not None and is_running(st):
            total += st.rss_bytes
        todo.extend(c.pid for c in children.get(cur, ()))
    return total


def wait_for(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll `check` until it returns True; TimeoutError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def tail(path: str | Path, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ---- stopping ------------------------------------------------------------------------------------
def _live_groups(record: FleetRecord, procs: Sequence[ProcStat]) -> dict[ProcessRecord, list[ProcStat]]:
    """For each recorded process: the running members of its process group, if that group is provably ours."""
    by_pid = {p.pid: p for p in procs}
    same_boot = record.boot_id == boot_id()
    groups: dict[ProcessRecord, list[ProcStat]] = {}
    for proc in record.processes:
        leader = by_pid.get(proc.pid)
        if is_running(leader):
            if owns(record, proc, leader):
                groups[proc] = _group_members(proc.pid, procs, proc.start_time)
            continue  # alive but someone else's: a recycled pid, never touched
        if same_boot:
            # Leader gone (or a zombie); its group id stays reserved while members remain.
            members = _group_members(proc.pid, procs, proc.start_time)
            if members:
                groups[proc] = members
    return groups


def _signal_groups(groups: Iterable[ProcessRecord], sig: signal.Signals) -> None:
    for proc in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)


def stop_fleet(record: FleetRecord, grace: float = STOP_GRACE_SECONDS, reap: Callable[[], None] | None = None,
               out: TextIO | None = None) -> list[ProcessRecord]:
    """Stop exactly the recorded processes: SIGTERM to each process group, SIGKILL after `grace` s.

    Which groups are ours is decided once, before the first signal (`_live_groups`); after that a
    group is waited for until none of its members runs. (Re-deciding while they stop would be
    wrong: an exiting leader has an empty /proc/PID/cmdline while its children still run.)
    `reap` (optional) collects exited children of the caller, so that they do not linger as
    zombies. Returns the processes that were still running and got signalled.
    """
    if reap is not None:
        reap()
    targets = list(_live_groups(record, all_procs()))
    if not targets:
        return targets

    def running() -> dict[ProcessRecord, list[ProcStat]]:
        if reap is not None:
            reap()
        procs = all_procs()
        groups = {t: _group_members(t.pid, procs, t.start_time) for t in targets}
        return {t: members for t, members in groups.items() if members}

    if out is not None:
        print("stopping " + ", ".join(f"{p.name} (pid {p.pid})" for p in targets), file=out, flush=True)
    _signal_groups(targets, signal.SIGTERM)
    deadline = time.monotonic() + grace
    groups = running()
    while groups and time.monotonic() < deadline:
        time.sleep(0.1)
        groups = running()
    if groups:
        if out is not None:
            names = ", ".join(p.name for p in groups)
            print(f"still running after {grace:.0f} s, killing: {names}", file=out, flush=True)
        _signal_groups(groups, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while groups and time.monotonic() < deadline:
            time.sleep(0.1)
            groups = running()
    if groups:
        raise LocalFleetError("processes survived SIGKILL: " + ", ".join(
            f"{p.name} pids {[m.pid for m in members]}" for p, members in groups.items()))
    return targets


def down(state_dir: Path, out: TextIO | None = None, grace: float = STOP_GRACE_SECONDS) -> int:
    """`corefleet down`: stop the recorded fleet and forget it (its logs stay)."""
    out = out or sys.stdout
    record = load_record(state_dir)
    if record is None:
        print(f"corefleet down: no fleet recorded in {state_dir}", file=out)
        return 0
    stopped = stop_fleet(record, grace=grace, out=out)
    by_pid = {p.pid: p for p in all_procs()}
    for proc in record.processes:
        if proc not in stopped and is_running(by_pid.get(proc.pid)):
            print(f"  {proc.name}: pid {proc.pid} now belongs to another process; left alone", file=out)
    state_file(state_dir).unlink(missing_ok=True)
    print(f"corefleet down: stopped {len(stopped)} of {len(record.processes)} processes "
          f"(logs in {Path(state_dir) / LOG_DIR})", file=out)
    return 0


# ---- status --------------------------------------------------------------------------------------
def _mib(n: int) -> str:
    return f"{n / 2**20:.0f}"


def status(state_dir: Path, out: TextIO | None = None) -> int:
    """`corefleet status`: each process (alive, RSS with its children) and the fleet from the admin API.

    Returns 0 if every process runs and the fleet is Serving, 1 otherwise (or if none is recorded).
    """
    out = out or sys.stdout
    record = load_record(state_dir)
    if record is None:
        print(f"no fleet recorded in {state_dir} (start one with `corefleet up`)", file=out)
        return 1
    procs = all_procs()
    by_pid = {p.pid: p for p in procs}
    print(f"fleet in {record.state_dir}: {record.replicas} x {record.engine} engine, model {record.served_model_name}",
          file=out)
    print(f"OpenAI endpoint: {record.endpoint}", file=out)
    print(f"admin API: {record.admin_url}/v1/fleet (token in {record.token_file})", file=out)
    print("", file=out)
    print(f"{'PROCESS':<14}{'RANK':>5}{'PID':>9}  {'ALIVE':<6}{'RSS_MIB':>8}", file=out)
    all_alive = True
    total = 0
    for proc in record.processes:
        alive = owns(record, proc, by_pid.get(proc.pid))
        all_alive &= alive
        rss = tree_rss_bytes(proc.pid, procs) if alive else 0
        total += rss
        rank = "-" if proc.rank is None else str(proc.rank)
        print(f"{proc.role:<14}{rank:>5}{proc.pid:>9}  {'yes' if alive else 'no':<6}{_mib(rss) if alive else '-':>8}",
              file=out)
    print(f"{'total':<36}{_mib(total):>8}", file=out)
    print("", file=out)
    try:
        fleet = record.admin_client(timeout=5).fleet()
    except (OSError, AdminError, ValueError, KeyError) as e:
        print(f"fleet: unknown (admin API: {e})", file=out)
        return 1
    print(f"fleet: {fleet.state}  data-parallel size {fleet.data_parallel_size}  vLLM {fleet.vllm_version}"
          + (f"  ({fleet.message})" if fleet.message else ""), file=out)
    print(f"{'RANK':>4}  {'STATE':<9}{'WAITING':>8}{'RUNNING':>8}{'IN_FLIGHT':>10}{'REQUESTS':>9}", file=out)
    for r in fleet.ranks:
        print(f"{r.rank:>4}  {r.state:<9}{r.waiting:>8}{r.running:>8}{r.in_flight:>10}{r.requests_total:>9}"
              + (f"  {r.message}" if r.message else ""), file=out)
    return 0 if all_alive and fleet.state == FleetState.SERVING else 1


# ---- scale ---------------------------------------------------------------------------------------
SCALE_LOCK = "scale.lock"
SCALE_POLL_SECONDS = 0.5
DEFAULT_DRAIN_TIMEOUT = 120.0


@contextlib.contextmanager
def _scale_lock(state_dir: Path) -> Iterator[None]:
    """One `corefleet scale` at a time per fleet (the frontend refuses a second resize anyway)."""
    with (Path(state_dir) / SCALE_LOCK).open("w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LocalFleetError(f"another `corefleet scale` runs for the fleet in {state_dir}") from None
        yield


def _print_progress(op: ResizeOperation, shown: dict[str, str], out: TextIO) -> None:
    lines = {"phase": f"  {op.phase}: {op.message}"}
    lines.update({f"rank {r.rank}": f"  rank {r.rank}: {r.state}" + (f" ({r.message})" if r.message else "")
                  for r in op.ranks})
    for key, line in lines.items():
        if shown.get(key) != line:
            shown[key] = line
            print(line, file=out, flush=True)


def scale(state_dir: Path, replicas: int, *, out: TextIO | None = None, err: TextIO | None = None,
          join_timeout: float | None = None, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
          stop: threading.Event | None = None) -> int:
    """`corefleet scale N`: resize the running local fleet in place, through the frontend's resize operation.

    Scale-up: the engines of the new ranks are started (recorded in the state file at once) and the
    frontend adds them when they have joined; if they do not, the resize fails and they are stopped
    again. Scale-down: the frontend drains the highest ranks and retires them; then, and only then,
    their engines are stopped and dropped from the state file. The surviving processes are never
    touched. Returns 0 once the fleet serves at `replicas` ranks.
    """
    out, err = out or sys.stdout, err or sys.stderr
    stop = stop or threading.Event()
    try:
        with _scale_lock(state_dir):
            return _scale(Path(state_dir), replicas, out, join_timeout, drain_timeout, stop)
    except LocalFleetError as e:
        print(f"corefleet scale: {e}", file=err, flush=True)
        return 1


def _scale(state_dir: Path, replicas: int, out: TextIO, join_timeout: float | None, drain_timeout: float,
           stop: threading.Event) -> int:
    record = load_record(state_dir)
    if record is None:
        raise LocalFleetError(f"no fleet recorded in {state_dir} (start one with `corefleet up`)")
    if replicas < 1:
        raise LocalFleetError(f"replicas must be at least 1, not {replicas} (`corefleet down` stops the fleet)")
    admin = record.admin_client(timeout=10)
    try:
        fleet = admin.fleet()
    except (OSError, AdminError, ValueError, KeyError) as e:
        raise LocalFleetError(f"the fleet's admin API does not answer ({e}); is it running?") from None
    if fleet.resize is not None and not fleet.resize.phase.terminal:
        raise LocalFleetError(f"resize {fleet.resize.id} ({fleet.resize.from_replicas} -> "
                              f"{fleet.resize.to_replicas}) is still running")
    current = fleet.data_parallel_size
    if replicas == current:
        print(f"corefleet scale: the fleet already has {current} rank(s)", file=out, flush=True)
        return 0
    t0 = time.monotonic()
    resize_id = f"local-{current}to{replicas}-{int(time.time())}"
    print(f"corefleet scale: {current} -> {replicas} in place (resize {resize_id})", file=out, flush=True)
    new_ranks = list(range(current, replicas))
    leaving = list(range(replicas, current))
    if leaving:
        _mark_retiring(state_dir, leaving)
    timeout = join_timeout if join_timeout is not None else DEFAULT_READY_TIMEOUT[record.engine]
    request = ResizeRequest(id=resize_id, replicas=replicas, drain_timeout_s=drain_timeout, join_timeout_s=timeout)
    if record.elastic_ep:  # the new engines need R' (and the frontend's checks) first: the resize starts first
        op = _start_resize(admin, request, state_dir, leaving, [], out)
        record = _start_new_engines(state_dir, record, new_ranks, replicas, op, out)
    else:
        record = _start_new_engines(state_dir, record, new_ranks, replicas, None, out)
        op = _start_resize(admin, request, state_dir, leaving, new_ranks, out)
    shown: dict[str, str] = {}
    cancelled = False
    while not op.phase.terminal:
        _print_progress(op, shown, out)
        if stop.wait(SCALE_POLL_SECONDS) and not cancelled:
            cancelled = True
            print("corefleet scale: interrupted: cancelling the resize", file=out, flush=True)
            with contextlib.suppress(OSError, AdminError):
                admin.cancel_resize(resize_id, "interrupted (corefleet scale)")
        gone = [p for p in (load_record(state_dir) or record).processes
                if p.role == ROLE_ENGINE and p.rank in new_ranks and not owns(record, p)]
        if gone and not cancelled:
            cancelled = True
            with contextlib.suppress(OSError, AdminError):
                admin.cancel_resize(resize_id, f"engine-{gone[0].rank} (pid {gone[0].pid}) exited; "
                                               f"last lines of {gone[0].log}:\n{tail(gone[0].log, 10)}")
        try:
            seen = admin.resize(resize_id)
        except (OSError, AdminError) as e:
            raise LocalFleetError(f"lost the frontend's admin API during resize {resize_id}: {e}") from None
        if seen is None:
            raise LocalFleetError(f"the frontend no longer knows resize {resize_id} (it restarted?)")
        op = seen
    _print_progress(op, shown, out)
    if op.phase == ResizePhase.FAILED:
        _forget_engines(state_dir, new_ranks, out)
        _mark_retiring(state_dir, leaving, retiring=False)
        print(f"corefleet scale: resize {resize_id} failed after {time.monotonic() - t0:.1f} s: {op.error}; "
              f"the fleet serves on at {current} rank(s)" if op.fleet_intact else
              f"corefleet scale: resize {resize_id} failed: {op.error}; the fleet must be restarted",
              file=out, flush=True)
        return 1
    retired = [r.rank for r in op.ranks if r.state == RankState.RETIRED]
    _forget_engines(state_dir, retired, out)
    record = load_record(state_dir) or record
    save_record(dataclasses.replace(record, replicas=replicas))
    print(f"corefleet scale: the fleet serves at {replicas} rank(s) ({time.monotonic() - t0:.1f} s)",
          file=out, flush=True)
    return 0


def _start_resize(admin: AdminClient, request: ResizeRequest, state_dir: Path, leaving: list[int],
                  started: list[int], out: TextIO) -> ResizeOperation:
    """Start the resize on the frontend; if it is refused, the ranks it would retire serve on and the engines
    started for it (`started`) are stopped again."""
    try:
        return admin.start_resize(request)[1]
    except (OSError, AdminError) as e:
        _forget_engines(state_dir, started, out)
        _mark_retiring(state_dir, leaving, retiring=False)
        raise LocalFleetError(f"the frontend refused the resize: {e}") from None


def _start_new_engines(state_dir: Path, record: FleetRecord, new_ranks: list[int], replicas: int,
                       op: ResizeOperation | None, out: TextIO) -> FleetRecord:
    """Start the new ranks' engines (recorded at once). Elastic EP: as vLLM's scale-up launches them
    (`VLLM_ELASTIC_EP_SCALE_UP_LAUNCH=1`, the redundant experts at the new size the frontend computed)."""
    if not new_ranks:
        return record
    health = free_ports(len(new_ranks), exclude=[record.ports.http, record.ports.admin, record.ports.rpc,
                                                 *record.ports.health])
    current = new_ranks[0]
    ports = dataclasses.replace(record.ports, health=(*record.ports.health[:current], *health))
    record = dataclasses.replace(record, ports=ports)
    save_record(record)
    flags: Sequence[str] = record.vllm_flags
    if op is not None and op.num_redundant_experts is not None:
        flags = commands.with_redundant_experts(flags, op.num_redundant_experts)
    for rank in new_ranks:
        argv = engine_argv(record.python or sys.executable, record.engine, record.model, replicas, rank, ports,
                           flags, token_delay_ms=record.token_delay_ms)
        env = _engine_env(record.engine, rank, record.gpus_per_rank)
        if op is not None:
            env[commands.ENV_SCALE_UP_LAUNCH] = "1"
        record, popen = spawn(record, ROLE_ENGINE, rank, argv, env)
        print(f"  started engine-{rank} (pid {popen.pid}), log {Path(state_dir) / LOG_DIR}/engine-{rank}.log",
              file=out, flush=True)
    return record


def _mark_retiring(state_dir: Path, ranks: Iterable[int], retiring: bool = True) -> FleetRecord | None:
    """Mark these ranks' engines as leaving (or not) in the state file: `corefleet up` expects them to exit."""
    ranks = set(ranks)
    record = load_record(state_dir)
    if record is None:
        return None
    procs = tuple(dataclasses.replace(p, retiring=retiring) if p.role == ROLE_ENGINE and p.rank in ranks else p
                  for p in record.processes)
    record = dataclasses.replace(record, processes=procs)
    save_record(record)
    return record


def _forget_engines(state_dir: Path, ranks: Iterable[int], out: TextIO) -> None:
    """Stop these ranks' engines and drop them from the state file (no other process is touched)."""
    ranks = set(ranks)
    record = _mark_retiring(state_dir, ranks) if ranks else None
    if record is None:
        return
    leaving = tuple(p for p in record.processes if p.role == ROLE_ENGINE and p.rank in ranks)
    stop_fleet(dataclasses.replace(record, processes=leaving), out=out)
    record = load_record(state_dir) or record
    save_record(dataclasses.replace(record, processes=tuple(
        p for p in record.processes if not (p.role == ROLE_ENGINE and p.rank in ranks))))


# ---- starting ------------------------------------------------------------------------------------
def _http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            ok: bool = r.status == 200
            return ok
    except (OSError, urllib.error.URLError):
        return False


def _fleet_serving(fleet: FleetStatus, replicas: int) -> bool:
    return (fleet.state == FleetState.SERVING and len(fleet.ranks) == replicas
            and all(r.state == RankState.SERVING for r in fleet.ranks))


class LocalFleet:
    """The processes one `corefleet up` started, with their Popen handles."""

    def __init__(self, record: FleetRecord, popens: dict[int, subprocess.Popen[bytes]]) -> None:
        self.record = record
        self.popens = popens

    def reap(self) -> None:
        for p in self.popens.values():
            p.poll()

    def exited(self) -> list[tuple[ProcessRecord, int | None]]:
        """The fleet's processes that have exited, with their exit codes where this process started them.

        The state file is the truth about which processes the fleet has: `corefleet scale` adds the
        engines it starts and removes the ones it retires (which are then only reaped here).
        """
        with contextlib.suppress(LocalFleetError):
            latest = load_record(Path(self.record.state_dir))
            if latest is not None:
                self.record = latest
        self.reap()
        done: list[tuple[ProcessRecord, int | None]] = []
        for proc in self.record.processes:
            if proc.retiring or (proc.role == ROLE_ENGINE and proc.rank is not None
                                 and proc.rank >= self.record.replicas):
                continue  # leaving or joining in a resize: `corefleet scale` looks after it
            popen = self.popens.get(proc.pid)
            if popen is not None:
                if popen.returncode is not None:
                    done.append((proc, popen.returncode))
            elif not owns(self.record, proc):
                done.append((proc, None))
        return done

    def stop(self, grace: float = STOP_GRACE_SECONDS, out: TextIO | None = None) -> None:
        try:
            stop_fleet(self.record, grace=grace, reap=self.reap, out=out)
        finally:
            for p in self.popens.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(1)
            state_file(Path(self.record.state_dir)).unlink(missing_ok=True)

    def wait_ready(self, timeout: float, stop: threading.Event | None = None) -> None:
        """Poll until the frontend's /health is 200 and the admin API reports every rank Serving.

        Fails at once with the log tail of a process that exits, or at the deadline with the log
        tail of the slowest one (the first engine that is not ready, else the frontend).
        """
        rec = self.record
        health = rec.endpoint.removesuffix("/v1") + "/health"
        deadline = time.monotonic() + timeout
        admin = rec.admin_client(timeout=2)
        last = "nothing checked yet"
        while True:
            if stop is not None and stop.is_set():
                raise Interrupted("interrupted while the fleet was starting")
            for proc, rc in self.exited():
                raise LocalFleetError(f"{proc.name} (pid {proc.pid}) exited with {rc} before the fleet was ready; "
                                      f"last lines of {proc.log}:\n{tail(proc.log)}")
            if not _http_ok(health):
                last = f"the frontend's {health} is not 200 yet"
            else:
                try:
                    fleet = admin.fleet()
                except (OSError, AdminError, ValueError, KeyError) as e:
                    last = f"admin API: {e}"
                else:
                    if _fleet_serving(fleet, rec.replicas):
                        return
                    last = f"admin API: fleet {fleet.state}, ranks " + ", ".join(
                        f"{r.rank} {r.state}" for r in fleet.ranks)
            if time.monotonic() >= deadline:
                slow = self._slowest()
                raise LocalFleetError(f"the fleet was not ready within {timeout:.0f} s ({last}); "
                                      f"{slow.name} (pid {slow.pid}) looks slowest, last lines of {slow.log}:\n"
                                      f"{tail(slow.log)}")
            time.sleep(POLL_SECONDS)

    def _slowest(self) -> ProcessRecord:
        ports = self.record.ports.health
        for proc in self.record.processes:
            if proc.role == ROLE_ENGINE and proc.rank is not None and \
                    not _http_ok(f"http://{LOCALHOST}:{ports[proc.rank]}/readyz"):
                return proc
        return next(p for p in self.record.processes if p.role == ROLE_FRONTEND)


def _engine_env(engine: str, rank: int, gpus_per_rank: int = 0) -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1"}
    if gpus_per_rank:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(rank * gpus_per_rank + i) for i in range(gpus_per_rank))
    elif engine == ENGINE_VLLM and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # vLLM binds each CPU engine's OpenMP threads to core 0 by default ("auto" picks per local
        # rank, and every engine here is local rank 0): spread the ranks over the usable cores.
        cpus = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpus[rank % len(cpus)])
    return env


def _check_not_running(state_dir: Path) -> None:
    record = load_record(state_dir)
    if record is None:
        return
    if _live_groups(record, all_procs()):
        raise LocalFleetError(f"a fleet recorded in {state_dir} is still running (endpoint {record.endpoint}); "
                              f"stop it with `corefleet down --state-dir {state_dir}` or pick another --state-dir")


def start(opts: FleetOptions) -> LocalFleet:
    """Start the coordinator, the frontend and the engines; record each in the state file as it starts.

    Does not wait for readiness (`LocalFleet.wait_ready`). If a start fails, what already runs is
    stopped again.
    """
    opts.validate()
    state_dir = Path(opts.state_dir).absolute()
    state_dir.mkdir(parents=True, exist_ok=True)
    _check_not_running(state_dir)
    check_port_free(opts.port)

    # 1. The model and the flags.
    if opts.model is None:
        served = TINY_MOE_MODEL_NAME if opts.moe else TINY_MODEL_NAME
        model = str(write_tiny_model(state_dir / MODEL_DIR / served, moe=opts.moe))
        default_flags: tuple[str, ...] = (*VLLM_CPU_FLAGS, "--served-model-name", served)
    else:
        # A local directory by its absolute path (the record and every process agree on it); else a name.
        model = str(Path(opts.model).absolute()) if Path(opts.model).is_dir() else opts.model
        served = model
        default_flags = ()
        if opts.vllm_flags is None:
            default_flags = VLLM_CPU_FLAGS
    flags = tuple(opts.vllm_flags) if opts.vllm_flags is not None else default_flags
    if "--served-model-name" in flags:
        served = flags[flags.index("--served-model-name") + 1]
    moe = is_moe_model(model)
    if opts.elastic_ep_max is not None:
        if not moe:
            raise LocalFleetError(f"--elastic-ep-max needs a MoE model; {model} has no experts")
        flags = (*flags, *commands.elastic_ep_flags(opts.elastic_ep_max))

    # 2. The admin token (never on a command line) and the ports.
    token_file = state_dir / TOKEN_FILE
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    n = opts.replicas
    free = free_ports(5 + n, exclude=[opts.port])
    store = free_port_pair(exclude=[opts.port, *free]) if opts.elastic_ep_max is not None else None
    ports = Ports(http=opts.port, admin=free[0], rpc=free[1], coord_front_publish=free[2],
                  coord_back_output=free[3], coord_back_publish=free[4], health=tuple(free[5:]), coord_store=store)

    # 3. The command lines, in start order.
    plan: list[tuple[str, int | None, list[str], dict[str, str]]] = [
        (ROLE_COORDINATOR, None, coordinator_argv(opts.python, n, ports, moe=moe), {"PYTHONUNBUFFERED": "1"}),
        (ROLE_FRONTEND, None, frontend_argv(opts.python, model, n, ports, token_file, flags, moe=moe),
         {"PYTHONUNBUFFERED": "1"}),
    ]
    plan += [
        (ROLE_ENGINE, r, engine_argv(opts.python, opts.engine, model, n, r, ports, flags,
                                     token_delay_ms=opts.token_delay_ms),
         _engine_env(opts.engine, r, opts.gpus_per_rank))
        for r in range(n)
    ]

    record = FleetRecord(
        state_dir=str(state_dir), engine=opts.engine, model=model, served_model_name=served, replicas=n,
        endpoint=f"http://{LOCALHOST}:{ports.http}/v1", admin_url=f"http://{LOCALHOST}:{ports.admin}",
        token_file=str(token_file), ports=ports, boot_id=boot_id(), started_at=time.time(),
        vllm_flags=flags, token_delay_ms=opts.token_delay_ms, python=opts.python, gpus_per_rank=opts.gpus_per_rank,
    )
    (state_dir / LOG_DIR).mkdir(exist_ok=True)
    fleet = LocalFleet(record, {})
    # 4. Start each process in its own process group; record it before starting the next one.
    try:
        for role, rank, argv, extra_env in plan:
            fleet.record, popen = spawn(fleet.record, role, rank, argv, extra_env)
            fleet.popens[popen.pid] = popen
    except BaseException:
        fleet.stop(grace=5)
        raise
    return fleet


def spawn(record: FleetRecord, role: str, rank: int | None, argv: list[str],
          extra_env: dict[str, str]) -> tuple[FleetRecord, subprocess.Popen[bytes]]:
    """Start one fleet process in its own process group (see the module docstring for why not a
    session), its output in `logs/<name>.log`; the record with it
    added, already saved (so that `corefleet down` finds it whatever happens next)."""
    name = role if rank is None else f"{role}-{rank}"
    log = Path(record.state_dir) / LOG_DIR / f"{name}.log"
    with log.open("ab") as logf:
        p = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env={**os.environ, **extra_env}, process_group=0, close_fds=True)
    st = proc_stat(p.pid)
    proc = ProcessRecord(role=role, rank=rank, pid=p.pid, start_time=st.start_time if st else -1,
                         argv=tuple(argv), log=str(log))
    record = dataclasses.replace(record, processes=(*record.processes, proc))
    save_record(record)
    logger.debug("started %s: pid %d: %s", name, p.pid, " ".join(argv))
    return record, p


def up(opts: FleetOptions, *, detach: bool, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """`corefleet up`: start the fleet, wait until it serves, print the endpoint; then either return
    (`detach`) or run until SIGINT/SIGTERM and stop exactly the processes it started."""
    out, err = out or sys.stdout, err or sys.stderr
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    t0 = time.monotonic()
    fleet: LocalFleet | None = None
    ready = False
    try:
        print(f"corefleet up: starting {opts.replicas} {opts.engine} engine(s), a coordinator and a frontend "
              f"in {opts.state_dir}", file=out, flush=True)
        fleet = start(opts)
        rec = fleet.record
        timeout = opts.ready_timeout if opts.ready_timeout is not None else DEFAULT_READY_TIMEOUT[opts.engine]
        fleet.wait_ready(timeout, stop)
        ready = True
        _print_ready(rec, time.monotonic() - t0, out)
        if detach:
            print("corefleet up: detached; the fleet keeps running", file=out, flush=True)
            return 0
        print("corefleet up: running; Ctrl-C stops everything it started", file=out, flush=True)
        while not stop.wait(1.0):
            gone = fleet.exited()
            if gone:
                proc, rc = gone[0]
                how = f"exited with {rc}" if rc is not None else "exited"
                print(f"corefleet up: {proc.name} (pid {proc.pid}) {how}; stopping the fleet. "
                      f"Last lines of {proc.log}:\n{tail(proc.log)}", file=err, flush=True)
                return 1
        return 0
    except LocalFleetError as e:
        print(f"corefleet up: {e}", file=err, flush=True)
        return 130 if isinstance(e, Interrupted) else 1
    finally:
        if fleet is not None and not (detach and ready):
            fleet.stop(out=out)
            print("corefleet up: stopped", file=out, flush=True)
        for s, h in previous.items():
            signal.signal(s, h)


def _print_ready(rec: FleetRecord, elapsed: float, out: TextIO) -> None:
    state_dir = rec.state_dir
    print(f"corefleet up: fleet of {rec.replicas} serving in {elapsed:.1f} s", file=out)
    print(f"  OpenAI endpoint: {rec.endpoint}   (model {rec.served_model_name!r})", file=out)
    print(f"  admin API: {rec.admin_url}/v1/fleet   (Authorization: Bearer $(cat {rec.token_file}))", file=out)
    print(f"  try: curl -s {rec.endpoint}/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{rec.served_model_name}\", \"prompt\": \"Hello\", \"max_tokens\": 8}}'", file=out)
    print(f"  logs: {state_dir}/{LOG_DIR}/   status: corefleet status --state-dir {state_dir}   "
          f"stop: corefleet down --state-dir {state_dir}", file=out, flush=True)

