# SPDX-License-Identifier: Apache-2.0
"""README's main job, `corefleet up`: whole fleets as local processes, used through the `corefleet` command.

Each test runs the `corefleet` command as a user would: `up`, `scale` while a client keeps sending requests,
`status`, `down` (or Ctrl-C); and checks that the resize left the surviving processes alone and that
stopping leaves none of the recorded processes (nor their children) running. Here with emulated engines: a
dense fleet of 4 in the foreground, resized 4 -> 5 -> 2 and stopped with Ctrl-C; an MoE fleet with vLLM's
elastic EP, resized 2 -> 4 -> 2 (no resize below the experts' minimum, no replacement in place). The same
with real vLLM engines, 2 -> 3 -> 2: tests/e2e/test_vllm_local_fleet.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from corefleet_client.admin import AdminError, FleetState, ResizeRequest
from corefleet_harness import local
from corefleet_harness.support import free_ports, wait_until
from fleettest import Load
from procs import read_lines_until

pytestmark = pytest.mark.e2e

CLI = [sys.executable, "-m", "corefleet_harness.cli"]


def corefleet(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def descendants(pids: list[int]) -> set[int]:
    procs = local.all_procs()
    found, todo = set(), list(pids)
    while todo:
        pid = todo.pop()
        kids = [p.pid for p in procs if p.ppid == pid and local.is_running(p)]
        found.update(kids)
        todo.extend(kids)
    return found


def engine_pids(state: Path) -> dict[int, int]:
    rec = local.load_record(state)
    assert rec is not None
    return {p.rank: p.pid for p in rec.processes if p.role == local.ROLE_ENGINE and p.rank is not None}


def scale(state: Path, port: int, sizes: list[int], timeout: float, model: str = "tiny-llama") -> None:
    """`corefleet scale N` for each size, with a client sending requests all along: none fails, the
    ranks that stay keep their processes, and the state file follows."""
    # A client that keeps sending, a second between requests (see test_node_fleet.py for why not denser).
    load = Load(f"http://127.0.0.1:{port}", model, workers=1, max_tokens=8, pause_s=1.0).start()
    try:
        for n in sizes:
            before = engine_pids(state)
            out = corefleet("scale", str(n), "--state-dir", str(state), timeout=timeout)
            assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
            assert f"the fleet serves at {n} rank(s)" in out.stdout, out.stdout
            after = engine_pids(state)
            assert sorted(after) == list(range(n)), after
            assert {r: after[r] for r in before if r < n} == {r: before[r] for r in before if r < n}
            rec = local.load_record(state)
            assert rec is not None
            assert rec.replicas == n
            admin = rec.admin_client()
            fleet = admin.fleet()
            assert [(r.rank, r.state) for r in fleet.ranks] == [(r, "Serving") for r in range(n)], fleet
            if n > len(before):  # the new ranks serve
                wait_until(lambda: all(r.requests_total > 0 for r in admin.fleet().ranks), 60,  # noqa: B023
                           "the new ranks to serve requests")
            gone = [pid for r, pid in before.items() if r >= n and local.is_running(local.proc_stat(pid))]
            assert not gone, f"retired engines still run: {gone}"
    finally:
        load.stop()
    assert len(load.outcomes) > 3, load.summary()
    assert not load.failures(), load.summary()


def _cleanup(state: Path) -> None:
    if local.load_record(state) is not None:
        local.down(state)


def test_emulator_fleet_in_the_foreground_resized_and_stopped_with_ctrl_c(tmp_path: Path) -> None:
    """`corefleet up` in the foreground supervises what `corefleet scale` adds and removes, and Ctrl-C
    stops all of it."""
    state = tmp_path / "state"
    port = free_ports(1)[0]
    up = subprocess.Popen([*CLI, "up", "--engine", "emulator", "--replicas", "4", "--port", str(port),
                           "--state-dir", str(state)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        read_lines_until(up, "corefleet up: running", timeout=300)
        scale(state, port, [5, 2], timeout=300)
        assert up.poll() is None, "corefleet up stopped: it must expect the engines a resize retires"
        rec = local.load_record(state)
        assert rec is not None
        pids = [p.pid for p in rec.processes]
        children = descendants(pids)
        started = {pid: st.start_time for pid in [*pids, *children] if (st := local.proc_stat(pid)) is not None}
        up.send_signal(signal.SIGINT)
        assert up.wait(120) == 0
        left = {pid for pid in [*pids, *children]
                if local.is_running(st := local.proc_stat(pid)) and st is not None and st.start_time <= started[pid]}
        assert not left, f"still running after Ctrl-C: {left}"
        assert local.load_record(state) is None
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        _cleanup(state)


def test_emulator_moe_fleet_with_elastic_ep_resized_2_4_2(tmp_path: Path) -> None:
    """`corefleet up --moe --elastic-ep-max 4`: the same elastic-EP resize as in a cluster (engine 0 serves the
    coordination stores; new engines start as vLLM's scale-up launches them, with R' from the frontend), here
    with emulated engines (vLLM runs EPLB on GPUs only). hack/gpu-moe-resize.sh runs this with real vLLM."""
    state = tmp_path / "state"
    port = free_ports(1)[0]
    try:
        up = corefleet("up", "--detach", "--engine", "emulator", "--moe", "--replicas", "2", "--elastic-ep-max", "4",
                       "--port", str(port), "--state-dir", str(state), timeout=300)
        assert up.returncode == 0, f"stdout:\n{up.stdout}\nstderr:\n{up.stderr}"
        rec = local.load_record(state)
        assert rec is not None
        assert rec.elastic_ep
        assert rec.ports.coord_store is not None
        scale(state, port, [4, 2], timeout=300, model=local.TINY_MOE_MODEL_NAME)
        logs = Path(rec.state_dir) / local.LOG_DIR
        for rank in (2, 3):  # started as vLLM's scale-up launches a new engine, then shut down by the protocol
            log = (logs / f"engine-{rank}.log").read_text()
            assert "[Elastic EP] New engine of a scale-up to 4 ranks" in log, log[-2000:]
            assert f"[Elastic EP] Rank {rank} removed: exiting" in log, log[-2000:]
        engine0 = (logs / "engine-0.log").read_text()
        assert "Coordination store of resize local-2to4-" in engine0
        assert "Coordination store of resize local-4to2-" in engine0
        ops = rec.admin_client().resizes()
        assert [(o.from_replicas, o.to_replicas, o.num_redundant_experts) for o in ops[:2]] == [(4, 2, 0), (2, 4, 4)]
        frontend = (logs / "frontend.log").read_text()
        for rank in (2, 3):
            assert f"SHUTDOWN_COMPLETE from rank {rank}" in frontend, frontend[-3000:]
        refused = corefleet("scale", "1", "--state-dir", str(state), timeout=60)
        assert refused.returncode == 1
        assert "minimum is 2" in refused.stderr, refused.stdout + refused.stderr
        # No replacement in place either: an MoE fleet's ranks share collectives that cannot lose a member.
        admin = rec.admin_client(timeout=15)
        with pytest.raises(AdminError) as err:
            admin.start_resize(ResizeRequest(id="replace-1", replicas=2, replace=(1,)))
        assert err.value.status == 400
        assert "MoE" in err.value.body
        assert [o.id for o in admin.resizes() if o.replace] == []
        assert admin.fleet().state == FleetState.SERVING
    finally:
        _cleanup(state)
