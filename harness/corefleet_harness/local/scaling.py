# SPDX-License-Identifier: Apache-2.0
"""`corefleet scale N`: resize a running local fleet in place, through the frontend's resize operation.

The admin API (`corefleet_client.admin`) runs the resize; this module starts the engines of new
ranks before (dense) or after (elastic EP) asking for it, follows it, and stops and forgets the
engines of retired ranks once the frontend has retired them. The state file marks leaving engines
`retiring`, so that a supervising `corefleet up` expects their exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TextIO

from corefleet_client import commands
from corefleet_client.admin import AdminClient, AdminError, RankState, ResizeOperation, ResizePhase, ResizeRequest
from corefleet_harness.local.argv import engine_argv, engine_env
from corefleet_harness.local.config import DEFAULT_READY_TIMEOUT, LOG_DIR, ROLE_ENGINE, LocalFleetError
from corefleet_harness.local.ports import with_new_ranks
from corefleet_harness.local.procs import owns
from corefleet_harness.local.state import FleetRecord, fleet_lock, load_record, save_record
from corefleet_harness.local.stopping import stop_fleet
from corefleet_harness.local.supervise import spawn
from corefleet_harness.support import tail

SCALE_POLL_SECONDS = 0.5
DEFAULT_DRAIN_TIMEOUT = 120.0


class FrontendLost(LocalFleetError):
    """The frontend running the resize was lost (its admin API gone, or it forgot the resize)."""


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
        with fleet_lock(state_dir, wait=False):
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
    try:
        op = _follow(admin, resize_id, op, state_dir, record, new_ranks, stop, out)
    except FrontendLost as e:
        # The resize lived in the lost frontend: it ends with it. Its replacement (by a supervising `corefleet up`)
        # attaches to the fleet's recorded ranks, so the new ranks' engines go and the leaving ones stay.
        _forget_engines(state_dir, new_ranks, out)
        _mark_retiring(state_dir, leaving, retiring=False)
        raise LocalFleetError(f"{e}: resize {resize_id} is rolled back; the fleet serves on at {current} rank(s) "
                              "once its frontend is replaced (`corefleet up` replaces it)") from None
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


def _follow(admin: AdminClient, resize_id: str, op: ResizeOperation, state_dir: Path, record: FleetRecord,
            new_ranks: list[int], stop: threading.Event, out: TextIO) -> ResizeOperation:
    """Follow the resize until it ends, printing its progress; cancel it if `stop` is set or an engine
    started for it exits. Returns the ended operation."""
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
            raise FrontendLost(f"lost the frontend's admin API during resize {resize_id}: {e}") from None
        if seen is None:
            raise FrontendLost(f"the frontend no longer knows resize {resize_id} (it was replaced)")
        op = seen
    _print_progress(op, shown, out)
    return op


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
    ports = with_new_ranks(record.ports, new_ranks)
    record = dataclasses.replace(record, ports=ports)
    save_record(record)
    flags: Sequence[str] = record.vllm_flags
    if op is not None and op.num_redundant_experts is not None:
        flags = commands.with_redundant_experts(flags, op.num_redundant_experts)
    for rank in new_ranks:
        argv = engine_argv(record.python or sys.executable, record.engine, record.model, replicas, rank, ports,
                           flags, token_delay_ms=record.token_delay_ms)
        env = engine_env(record.engine, rank, record.gpus_per_rank)
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
