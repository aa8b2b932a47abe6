# SPDX-License-Identifier: Apache-2.0
"""/proc: which processes run, whether a recorded pid is still the process that was started, their RSS.

A pid is acted on only while it is provably the process that was started: same boot, same start
time (clock ticks since boot, from /proc/PID/stat) and the recorded command line in
/proc/PID/cmdline (or the title vLLM's setproctitle gave it, which keeps the start time). So a pid
recycled by an unrelated process is never signalled.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from corefleet_harness.local.state import FleetRecord, ProcessRecord


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


def group_members(pgrp: int, procs: Iterable[ProcStat], not_before: int) -> list[ProcStat]:
    """The running members of process group `pgrp` started at or after `not_before` (clock ticks)."""
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
