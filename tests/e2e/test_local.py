# SPDX-License-Identifier: Apache-2.0
"""README's main job, `corefleet up`: a whole fleet as local processes, used through its endpoint.

Each test runs the `corefleet` command as a user would: `up --detach`, requests to the printed
OpenAI endpoint, `status`, `down`; and checks that `down` leaves none of the recorded processes
(nor their children) running. One fleet runs the engine emulator (4 ranks, fast), one real vLLM
engines on the tiny model (2 ranks, ~1 min, ~5 GiB: run the e2e tier under
`flock /tmp/corefleet-heavy.lock` on shared machines).
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from corefleet_client import local

pytestmark = pytest.mark.e2e

CLI = [sys.executable, "-m", "corefleet_operator.cli"]


def corefleet(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        data: dict[str, Any] = json.loads(r.read())
        return data


def descendants(pids: list[int]) -> set[int]:
    procs = local.all_procs()
    found, todo = set(), list(pids)
    while todo:
        pid = todo.pop()
        kids = [p.pid for p in procs if p.ppid == pid and local.is_running(p)]
        found.update(kids)
        todo.extend(kids)
    return found


def run_fleet(state: Path, engine: str, replicas: int, up_timeout: float) -> None:
    port = local.free_ports(1)[0]
    up = corefleet("up", "--detach", "--engine", engine, "--replicas", str(replicas), "--port", str(port),
                   "--state-dir", str(state), timeout=up_timeout)
    assert up.returncode == 0, f"stdout:\n{up.stdout}\nstderr:\n{up.stderr}"
    endpoint = f"http://127.0.0.1:{port}/v1"
    assert f"OpenAI endpoint: {endpoint}" in up.stdout
    rec = local.load_record(state)
    assert rec is not None
    assert [p.name for p in rec.processes] == ["coordinator", "frontend", *(f"engine-{r}" for r in range(replicas))]
    assert all(f"corefleet_client.{'emulator' if engine == 'emulator' else 'engine'}" in p.argv
               for p in rec.processes[2:])
    pids = [p.pid for p in rec.processes]
    children = descendants(pids)
    # Start times, so that a pid reused meanwhile by an unrelated process is not taken for ours.
    started = {pid: st.start_time for pid in [*pids, *children] if (st := local.proc_stat(pid)) is not None}

    # 1. Text prompts through the endpoint (completions and chat), spread over the ranks.
    for i in range(2 * replicas):
        out = post(f"{endpoint}/completions", {"model": "tiny-llama", "prompt": f"Hello, world {i}", "max_tokens": 4})
        assert out["usage"]["completion_tokens"] >= 1, out
        assert isinstance(out["choices"][0]["text"], str)
    chat = post(f"{endpoint}/chat/completions",
                {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat["choices"][0]["message"]["role"] == "assistant", chat

    # 2. `corefleet status`: every process alive with its RSS, every rank Serving, requests counted.
    status = corefleet("status", "--state-dir", str(state), timeout=60)
    print(status.stdout)  # the RSS table, for the record
    assert status.returncode == 0, status.stdout + status.stderr
    lines = status.stdout.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("PROCESS")) + 1
    rows = [ln.split() for ln in lines[start:start + len(pids)]]
    assert [int(r[2]) for r in rows] == pids
    assert all(r[3] == "yes" and float(r[4]) > 0 for r in rows), rows
    assert "fleet: Serving" in status.stdout
    start = next(i for i, ln in enumerate(lines) if ln.strip().startswith("RANK")) + 1
    ranks = [ln.split() for ln in lines[start:start + replicas]]
    assert [(int(r[0]), r[1]) for r in ranks] == [(r, "Serving") for r in range(replicas)]
    assert sum(int(r[5]) for r in ranks) >= 2 * replicas + 1

    # 3. `corefleet down`: nothing it started is left, children included.
    down = corefleet("down", "--state-dir", str(state), timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"stopped {len(pids)} of {len(pids)} processes" in down.stdout
    left = {pid: (st, local.proc_cmdline(pid)) for pid in [*pids, *children]
            if local.is_running(st := local.proc_stat(pid)) and st is not None and st.start_time <= started[pid]}
    assert not left, f"still running after `corefleet down`: {left}"
    assert local.load_record(state) is None


def _cleanup(state: Path) -> None:
    if local.load_record(state) is not None:
        local.down(state)


def test_emulator_fleet_of_four(tmp_path: Path) -> None:
    state = tmp_path / "state"
    try:
        run_fleet(state, "emulator", 4, up_timeout=300)
    finally:
        _cleanup(state)


def test_real_vllm_fleet_of_two(tmp_path: Path) -> None:
    state = tmp_path / "state"
    try:
        run_fleet(state, "vllm", 2, up_timeout=500)
    finally:
        _cleanup(state)
