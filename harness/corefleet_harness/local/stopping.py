# SPDX-License-Identifier: Apache-2.0
"""Stopping a local fleet: exactly its recorded processes, each with its whole process group.

Stopping sends SIGTERM to each process group, then SIGKILL to what is left after a grace period.
A group is signalled only while its leader is provably the recorded process (`procs.owns`); if a
group leader is gone but members of its group remain (vLLM's EngineCore children), the group is
still signalled: Linux does not reuse a pid that still names a process group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TextIO

from corefleet_harness.local.config import LOG_DIR, ROLE_SUPERVISOR, STOP_GRACE_SECONDS, LocalFleetError
from corefleet_harness.local.procs import ProcStat, all_procs, boot_id, group_members, is_running, owns
from corefleet_harness.local.state import FleetRecord, ProcessRecord, load_record, state_file


def live_groups(record: FleetRecord, procs: Sequence[ProcStat]) -> dict[ProcessRecord, list[ProcStat]]:
    """For each recorded process: the running members of its process group, if that group is provably ours."""
    by_pid = {p.pid: p for p in procs}
    same_boot = record.boot_id == boot_id()
    groups: dict[ProcessRecord, list[ProcStat]] = {}
    for proc in record.processes:
        leader = by_pid.get(proc.pid)
        if is_running(leader):
            if owns(record, proc, leader):
                groups[proc] = group_members(proc.pid, procs, proc.start_time)
            continue  # alive but someone else's: a recycled pid, never touched
        if same_boot:
            # Leader gone (or a zombie); its group id stays reserved while members remain.
            members = group_members(proc.pid, procs, proc.start_time)
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

    Which groups are ours is decided once, before the first signal (`live_groups`); after that a
    group is waited for until none of its members runs. (Re-deciding while they stop would be
    wrong: an exiting leader has an empty /proc/PID/cmdline while its children still run.)
    `reap` (optional) collects exited children of the caller, so that they do not linger as
    zombies. Returns the processes that were still running and got signalled.

    A detached fleet's supervisor is stopped first, and the fleet then as the state file records it: a lost
    member it replaced meanwhile is stopped too, and nothing replaces a member being stopped.
    """
    supervisors = tuple(p for p in record.processes if p.role == ROLE_SUPERVISOR)
    if supervisors and len(supervisors) < len(record.processes):
        stopped = stop_fleet(dataclasses.replace(record, processes=supervisors), grace, reap, out)
        with contextlib.suppress(LocalFleetError):
            record = load_record(Path(record.state_dir)) or record
        rest = dataclasses.replace(record, processes=tuple(p for p in record.processes if p.role != ROLE_SUPERVISOR))
        return stopped + stop_fleet(rest, grace, reap, out)
    if reap is not None:
        reap()
    targets = list(live_groups(record, all_procs()))
    if not targets:
        return targets

    def running() -> dict[ProcessRecord, list[ProcStat]]:
        if reap is not None:
            reap()
        procs = all_procs()
        groups = {t: group_members(t.pid, procs, t.start_time) for t in targets}
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
