# SPDX-License-Identifier: Apache-2.0
"""Starting and supervising a local fleet: `corefleet up`.

Each process leads its own process group (`process_group=0`), so a terminal's Ctrl-C (sent to the
foreground group) reaches only `corefleet up`, which then stops exactly what it started; its output
goes to `logs/<name>.log`. Not its own session: with `kernel.sched_autogroup_enabled` (the default
on most distributions) the CPU scheduler shares the cores between *sessions* before threads, so a
fleet of one session per process gave the frontend one share against every spinning engine
worker's share and served at about half of stock `vllm serve` (issue 10). Each process is recorded
in the state file as soon as it starts (`spawn`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from corefleet_client import commands
from corefleet_client.admin import AdminClient, AdminError, FleetState, FleetStatus, RankState
from corefleet_harness.local.argv import coordinator_argv, engine_argv, engine_env, frontend_argv, is_moe_model
from corefleet_harness.local.config import (
    DEFAULT_READY_TIMEOUT,
    LOCALHOST,
    LOG_DIR,
    MODEL_DIR,
    POLL_SECONDS,
    ROLE_COORDINATOR,
    ROLE_ENGINE,
    ROLE_FRONTEND,
    ROLE_SUPERVISOR,
    STOP_GRACE_SECONDS,
    TINY_MODEL_NAME,
    TINY_MOE_MODEL_NAME,
    TOKEN_FILE,
    FleetOptions,
    Interrupted,
    LocalFleetError,
)
from corefleet_harness.local.members import MEMBER_ROLES, Replacements, member_argv
from corefleet_harness.local.ports import Ports, check_port_free, fleet_ports
from corefleet_harness.local.procs import all_procs, boot_id, owns, proc_stat
from corefleet_harness.local.state import (
    FleetRecord,
    ProcessRecord,
    fleet_lock,
    load_record,
    save_record,
    state_file,
)
from corefleet_harness.local.stopping import live_groups, stop_fleet
from corefleet_harness.support import WaitTimeout, http_get, tail, wait_until
from corefleet_harness.tinymodel import VLLM_CPU_FLAGS, write_tiny_model

logger = logging.getLogger(__name__)


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
            if proc.role == ROLE_SUPERVISOR:
                continue  # not part of the fleet it supervises
            popen = self.popens.get(proc.pid)
            if popen is not None:
                if popen.returncode is not None:
                    done.append((proc, popen.returncode))
            elif not owns(self.record, proc):
                done.append((proc, None))
        return done

    def replace_member(self, lost: ProcessRecord) -> ProcessRecord:
        """Start a replacement for the lost frontend or coordinator (`members`): what is left of the lost
        process's group is stopped first (it may hold the ports), then the replacement is started under the same
        name and log, and recorded in the lost one's place. Waits for a `corefleet scale` to end (it ends at once
        when the frontend it follows is lost, and rolls its resize back)."""
        state_dir = Path(self.record.state_dir)
        with fleet_lock(state_dir, wait=True):
            record = load_record(state_dir) or self.record
            stop_fleet(dataclasses.replace(record, processes=(lost,)), grace=5, reap=self.reap)
            record = dataclasses.replace(record, processes=tuple(p for p in record.processes if p != lost))
            with Path(lost.log).open("a") as log:
                log.write(f"\n---- corefleet: {lost.name} (pid {lost.pid}) was lost; its replacement follows ----\n")
            self.record, popen = spawn(record, lost.role, lost.rank, member_argv(record, lost.role, lost.rank or 0),
                                       {"PYTHONUNBUFFERED": "1"})
        self.popens[popen.pid] = popen
        return next(p for p in self.record.processes if p.pid == popen.pid)

    def stop(self, grace: float = STOP_GRACE_SECONDS, out: TextIO | None = None) -> None:
        try:
            stop_fleet(self.record, grace=grace, reap=self.reap, out=out)
        finally:
            for p in self.popens.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(1)
            state_file(Path(self.record.state_dir)).unlink(missing_ok=True)

    def wait_ready(self, timeout: float, stop: threading.Event | None = None) -> None:
        """Poll until the frontend's /health is 200 and every frontend's admin API reports every rank Serving.

        Fails at once with the log tail of a process that exits, or at the deadline with the log
        tail of the slowest one (the first engine that is not ready, else the frontend).
        """
        rec = self.record
        health = rec.endpoint.removesuffix("/v1") + "/health"
        token = Path(rec.token_file).read_text().strip()
        admins = [AdminClient(rec.frontend_admin_url(i), token, timeout=2) for i in range(rec.frontends)]
        last = "nothing checked yet"

        def serving() -> bool:
            nonlocal last
            if stop is not None and stop.is_set():
                raise Interrupted("interrupted while the fleet was starting")
            for proc, rc in self.exited():
                raise LocalFleetError(f"{proc.name} (pid {proc.pid}) exited with {rc} before the fleet was ready; "
                                      f"last lines of {proc.log}:\n{tail(proc.log)}")
            if http_get(health, 2, unanswered_ok=True)[0] != 200:
                last = f"the frontend's {health} is not 200 yet"
                return False
            for i, admin in enumerate(admins):
                which = f"frontend {i}'s admin API" if rec.frontends > 1 else "admin API"
                try:
                    fleet = admin.fleet()
                except (OSError, AdminError, ValueError, KeyError) as e:
                    last = f"{which}: {e}"
                    return False
                if not _fleet_serving(fleet, rec.replicas):
                    last = f"{which}: fleet {fleet.state}, ranks " + ", ".join(f"{r.rank} {r.state}"
                                                                              for r in fleet.ranks)
                    return False
            return True

        try:
            wait_until(serving, timeout, "the fleet serving", interval=POLL_SECONDS)
        except WaitTimeout:
            slow = self._slowest()
            raise LocalFleetError(f"the fleet was not ready within {timeout:.0f} s ({last}); "
                                  f"{slow.name} (pid {slow.pid}) looks slowest, last lines of {slow.log}:\n"
                                  f"{tail(slow.log)}") from None

    def _slowest(self) -> ProcessRecord:
        ports = self.record.ports.health
        for proc in self.record.processes:
            if proc.role == ROLE_ENGINE and proc.rank is not None and \
                    http_get(f"http://{LOCALHOST}:{ports[proc.rank]}/readyz", 2, unanswered_ok=True)[0] != 200:
                return proc
        return next(p for p in self.record.processes if p.role == ROLE_FRONTEND)


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


# ---- corefleet up --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Model:
    """What the fleet serves: the model (a directory's absolute path, or a name), its served name,
    the vLLM flags of the frontend and the engines, and whether it is a MoE model."""

    path: str
    served: str
    flags: tuple[str, ...]
    moe: bool


def _check_not_running(state_dir: Path) -> None:
    record = load_record(state_dir)
    if record is None:
        return
    if live_groups(record, all_procs()):
        raise LocalFleetError(f"a fleet recorded in {state_dir} is still running (endpoint {record.endpoint}); "
                              f"stop it with `corefleet down --state-dir {state_dir}` or pick another --state-dir")


def _model(opts: FleetOptions, state_dir: Path) -> _Model:
    """The model and the flags: the tiny model (written into the state directory) unless one is named."""
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
    return _Model(path=model, served=served, flags=flags, moe=moe)


def _write_token(state_dir: Path) -> Path:
    """A new admin token, readable by this user only (it never appears on a command line)."""
    token_file = state_dir / TOKEN_FILE
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return token_file


def _start_order(opts: FleetOptions, model: _Model, ports: Ports,
                 token_file: Path) -> list[tuple[str, int | None, list[str], dict[str, str]]]:
    """The fleet's processes in start order: (role, rank, command line, added environment)."""
    n = opts.replicas
    plan: list[tuple[str, int | None, list[str], dict[str, str]]] = [
        (ROLE_COORDINATOR, None, coordinator_argv(opts.python, n, ports, moe=model.moe), {"PYTHONUNBUFFERED": "1"}),
    ]
    plan += [  # frontend 0 keeps its one-frontend name ("frontend"); the others are "frontend-1", ...
        (ROLE_FRONTEND, i or None, frontend_argv(opts.python, model.path, n, ports, token_file, model.flags,
                                                 moe=model.moe, frontends=opts.frontends, client_index=i),
         {"PYTHONUNBUFFERED": "1"})
        for i in range(opts.frontends)
    ]
    plan += [
        (ROLE_ENGINE, r, engine_argv(opts.python, opts.engine, model.path, n, r, ports, model.flags,
                                     token_delay_ms=opts.token_delay_ms),
         engine_env(opts.engine, r, opts.gpus_per_rank))
        for r in range(n)
    ]
    return plan


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
    model = _model(opts, state_dir)
    token_file = _write_token(state_dir)
    ports = fleet_ports(opts.port, opts.replicas, elastic_ep=opts.elastic_ep_max is not None)
    plan = _start_order(opts, model, ports, token_file)
    record = FleetRecord(
        state_dir=str(state_dir), engine=opts.engine, model=model.path, served_model_name=model.served,
        replicas=opts.replicas, endpoint=f"http://{LOCALHOST}:{ports.http}/v1",
        admin_url=f"http://{LOCALHOST}:{ports.admin}", token_file=str(token_file), ports=ports, boot_id=boot_id(),
        started_at=time.time(), vllm_flags=model.flags, token_delay_ms=opts.token_delay_ms, python=opts.python,
        gpus_per_rank=opts.gpus_per_rank, frontends=opts.frontends,
    )
    (state_dir / LOG_DIR).mkdir(exist_ok=True)
    fleet = LocalFleet(record, {})
    # Start each process in its own process group; record it before starting the next one.
    try:
        for role, rank, argv, extra_env in plan:
            fleet.record, popen = spawn(fleet.record, role, rank, argv, extra_env)
            fleet.popens[popen.pid] = popen
    except BaseException:
        fleet.stop(grace=5)
        raise
    return fleet


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
        frontends = "a frontend" if opts.frontends == 1 else f"{opts.frontends} frontends"
        print(f"corefleet up: starting {opts.replicas} {opts.engine} engine(s), a coordinator and {frontends} "
              f"in {opts.state_dir}", file=out, flush=True)
        fleet = start(opts)
        rec = fleet.record
        timeout = opts.ready_timeout if opts.ready_timeout is not None else DEFAULT_READY_TIMEOUT[opts.engine]
        fleet.wait_ready(timeout, stop)
        ready = True
        _print_ready(rec, time.monotonic() - t0, out)
        if detach:
            fleet.record, popen = spawn_supervisor(fleet.record)
            print(f"corefleet up: detached; the fleet keeps running (its supervisor, pid {popen.pid}, replaces a "
                  "lost frontend or coordinator)", file=out, flush=True)
            return 0
        print("corefleet up: running; Ctrl-C stops everything it started", file=out, flush=True)
        return _supervise(fleet, stop, out, err)
    except LocalFleetError as e:
        print(f"corefleet up: {e}", file=err, flush=True)
        return 130 if isinstance(e, Interrupted) else 1
    finally:
        if fleet is not None and not (detach and ready):
            fleet.stop(out=out)
            print("corefleet up: stopped", file=out, flush=True)
        for s, h in previous.items():
            signal.signal(s, h)


def _supervise(fleet: LocalFleet, stop: threading.Event, out: TextIO, err: TextIO, *,
               detached: bool = False) -> int:
    """Run until `stop` is set (0), replacing a lost frontend or coordinator in place (`members`) while the
    engines serve on. Any other process's exit, or a member that cannot be replaced, ends it (1, with the log's
    tail: `corefleet up` then stops the fleet). `detached` (`corefleet supervise`, the supervisor `corefleet up
    --detach` leaves running): an engine's exit is only reported (the frontend serves on without the rank, as
    before there was a supervisor), and it ends (0) once the fleet is stopped (`corefleet down`)."""
    replacements = Replacements()
    reported: set[int] = set()
    name = "corefleet supervise" if detached else "corefleet up"
    while not stop.wait(1.0):
        if detached and not _still_supervised(Path(fleet.record.state_dir)):
            return 0
        for proc, rc in fleet.exited():
            how = f"exited with {rc}" if rc is not None else "exited"
            member = proc.role in MEMBER_ROLES
            refusal = replacements.refusal(fleet.record, proc.role, time.monotonic(), proc.name) if member else None
            if member and refusal is None:
                print(f"{name}: {proc.name} (pid {proc.pid}) {how}: replacing it in place, the engines serve on. "
                      f"Last lines of {proc.log}:\n{tail(proc.log)}", file=err, flush=True)
                replacements.count(proc.name, time.monotonic())
                new = fleet.replace_member(proc)
                print(f"{name}: {proc.name} replaced (pid {new.pid})", file=out, flush=True)
                continue
            if proc.pid in reported:
                continue
            reported.add(proc.pid)
            why = f" ({refusal})" if refusal else ""
            print(f"{name}: {proc.name} (pid {proc.pid}) {how}{why}. Last lines of {proc.log}:\n{tail(proc.log)}",
                  file=err, flush=True)
            if detached:
                if not member:
                    continue  # the frontend reports the rank Dead and serves on without it
                print(f"{name}: the fleet cannot serve without its {proc.role}: stop it with `corefleet down` and "
                      "start it again", file=err, flush=True)
                return 1
            print(f"{name}: stopping the fleet", file=err, flush=True)
            return 1
    return 0


def _still_supervised(state_dir: Path) -> bool:
    """Whether the state file still records this process as the fleet's supervisor (`corefleet down` forgets it)."""
    try:
        record = load_record(state_dir)
    except LocalFleetError:
        return False
    return record is not None and any(p.role == ROLE_SUPERVISOR and p.pid == os.getpid() for p in record.processes)


def supervisor_argv(state_dir: str) -> list[str]:
    """corefleet's own command, in this interpreter (the fleet's processes may run another: `--python`)."""
    return [sys.executable, "-m", "corefleet_harness.cli", "supervise", "--state-dir", state_dir]


def spawn_supervisor(record: FleetRecord) -> tuple[FleetRecord, subprocess.Popen[bytes]]:
    """Start a detached fleet's supervisor (`corefleet supervise`), recorded like the fleet's processes, so that
    `corefleet down` stops it (first: `stopping.stop_fleet`)."""
    return spawn(record, ROLE_SUPERVISOR, None, supervisor_argv(record.state_dir),
                 {"PYTHONUNBUFFERED": "1"})


def supervise(state_dir: Path, stop: threading.Event, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """`corefleet supervise`: supervise a detached fleet until it is stopped (`_supervise`)."""
    out, err = out or sys.stdout, err or sys.stderr
    record = load_record(state_dir)
    if record is None:
        print(f"corefleet supervise: no fleet recorded in {state_dir}", file=err, flush=True)
        return 1
    return _supervise(LocalFleet(record, {}), stop, out, err, detached=True)


def _print_ready(rec: FleetRecord, elapsed: float, out: TextIO) -> None:
    state_dir = rec.state_dir
    print(f"corefleet up: fleet of {rec.replicas} serving in {elapsed:.1f} s", file=out)
    print(f"  OpenAI endpoint: {rec.endpoint}   (model {rec.served_model_name!r})", file=out)
    print(f"  admin API: {rec.admin_url}/v1/fleet   (Authorization: Bearer $(cat {rec.token_file}))", file=out)
    print(f"  try: curl -s {rec.endpoint}/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{rec.served_model_name}\", \"prompt\": \"Hello\", \"max_tokens\": 8}}'", file=out)
    print(f"  logs: {state_dir}/{LOG_DIR}/   status: corefleet status --state-dir {state_dir}   "
          f"stop: corefleet down --state-dir {state_dir}", file=out, flush=True)
