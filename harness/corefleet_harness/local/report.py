# SPDX-License-Identifier: Apache-2.0
"""`corefleet status`: a local fleet's processes (alive, RSS) and its ranks as the admin API reports them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from corefleet_client.admin import AdminError, FleetState
from corefleet_harness.local.procs import all_procs, owns, tree_rss_bytes
from corefleet_harness.local.state import load_record


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
