# SPDX-License-Identifier: Apache-2.0
"""README's main job, `corefleet up`: whole fleets as local processes, used through the `corefleet` command.

Each test runs the `corefleet` command as a user would: `up`, `scale` while a client keeps sending requests,
`status`, `down` (or Ctrl-C); and checks that the resize left the surviving processes alone and that
stopping leaves none of the recorded processes (nor their children) running. Here with emulated engines: a
dense fleet of 4 in the foreground, resized 4 -> 5 -> 2 and stopped with Ctrl-C; an MoE fleet with vLLM's
elastic EP, resized 2 -> 4 -> 2 (no resize below the experts' minimum, no replacement in place, its lost
frontend not replaced by the supervisor `up --detach` leaves running). The same
with real vLLM engines, 2 -> 3 -> 2: tests/e2e/test_vllm_local_fleet.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from corefleet_client.admin import AdminError, FleetState, ResizeRequest
from corefleet_harness import local
from corefleet_harness.support import free_ports, wait_until
from localfleet import CLI, corefleet, descendants, scale
from procs import read_lines_until

pytestmark = pytest.mark.e2e

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
        # Nor is its frontend replaced in place (elastic EP's state lives in it): the supervisor that
        # `up --detach` left running says so and leaves.
        rec = local.load_record(state)
        assert rec is not None
        supervisor = next(p for p in rec.processes if p.role == local.ROLE_SUPERVISOR)
        assert local.owns(rec, supervisor)
        lost = next(p for p in rec.processes if p.role == local.ROLE_FRONTEND)
        os.kill(lost.pid, signal.SIGKILL)
        wait_until(lambda: not local.owns(rec, supervisor), 30, "the supervisor to leave")
        said = (logs / "supervisor.log").read_text()
        assert "hold its elastic-EP state: not replaced in place" in said, said
        assert "cannot serve without its frontend" in said, said
    finally:
        _cleanup(state)
