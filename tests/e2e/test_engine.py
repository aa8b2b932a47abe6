# SPDX-License-Identifier: Apache-2.0
"""`python -m corefleet_client.engine` runs real vLLM engines that join a stock vLLM frontend.

One scenario (two engines are what two cores carry): a tiny llama with dummy weights, a stock
`vllm serve --data-parallel-size 2 --data-parallel-size-local 0` frontend, and ranks 0 and 1
each started through the launcher, before the frontend exists. It shows that

* the launchers report not ready while their engines wait for the frontend (the relay holds HELLO),
  and ready once the handshake went through them and the frontend is healthy;
* requests (token-id prompts) are served through the fleet;
* each launcher is the parent of its engine core and maps no vLLM/torch code of its own (issue 10:
  it used to hold a whole vLLM import per rank);
* an engine that dies makes its launcher report /livez 503 and exit non-zero (128+9 for SIGKILL);
* SIGTERM to a launcher stops its engine, exits 0 and leaves no process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from corefleet_harness.support import free_port, http_get, tail, wait_until

pytestmark = pytest.mark.e2e

STARTUP_TIMEOUT = 300.0  # two launchers, two engines and a frontend importing vLLM on 2 busy cores
STEP_TIMEOUT = 30.0
EXIT_TIMEOUT = 60.0

# docs/vllm-on-cpu.md: a llama small enough for the CPU kernels, no weights (--load-format dummy).
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 32, "vocab_size": 512,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}
VLLM_FLAGS = [
    "--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "256", "--max-num-seqs", "8",
    "--enforce-eager", "--kv-cache-memory-bytes", "67108864", "--skip-tokenizer-init",
]


def write_tiny_llama(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path


class Proc:
    """A child in its own session (so its whole group can be killed), its output in a log file."""

    def __init__(self, name: str, cmd: list[str], log_dir: Path) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        with self.log.open("wb") as out:
            self.popen = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        self.pid = self.popen.pid

    def output(self, lines: int = 60) -> str:
        return f"--- {self.name} ---\n{tail(self.log, lines)}"

    def alive(self) -> bool:
        if self.popen.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.popen.returncode}:\n{self.output()}")
        return True

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} still running {timeout:.0f}s later:\n{self.output()}")

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=30)


def get(port: int, path: str) -> tuple[int, Any]:
    """(status, JSON body); raises OSError while nothing listens."""
    status, body = http_get(f"http://127.0.0.1:{port}{path}")
    return status, json.loads(body) if body else None


def complete(port: int, prompt: list[int]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True,
                         "temperature": 0}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=STEP_TIMEOUT) as resp:
        assert resp.status == 200
        result: dict[str, Any] = json.loads(resp.read())
        return result


def engine_pid(launcher: Proc) -> int:
    """The engine core's pid, as the launcher logs it once the engine core reported its rank."""
    match = re.search(r"Engine core EngineCore_DP\d+ \(pid (\d+)\) is rank", launcher.log.read_text(errors="replace"))
    assert match, launcher.output()
    return int(match.group(1))


class LivezWatcher(threading.Thread):
    """Polls /livez until nothing answers, keeping every answer: the launcher's last words."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.seen: list[tuple[int, Any]] = []

    def run(self) -> None:
        deadline = time.monotonic() + EXIT_TIMEOUT
        while time.monotonic() < deadline:
            try:
                self.seen.append(get(self.port, "/livez"))
            except OSError:
                if self.seen:
                    return
            time.sleep(0.01)


def gone_or_zombie(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.kill_group()


def test_launched_engines_join_a_stock_frontend(tmp_path: Path, procs: list[Proc]) -> None:
    model = str(write_tiny_llama(tmp_path / "tiny-llama"))
    rpc_port, http_port = free_port(), free_port()
    health_ports = [free_port(), free_port()]
    store_port = free_port()

    def launcher(rank: int) -> Proc:
        # Rank 0 also serves a coordination store, as it does in an elastic-EP fleet (this dense fleet's
        # engines do not use it): a child of the launcher beside the engine core, stopped with it.
        store = ["--coord-store-port", str(store_port)] if rank == 0 else []
        return Proc(f"engine-{rank}", [
            sys.executable, "-m", "corefleet_client.engine",
            "--health-host", "127.0.0.1", "--health-port", str(health_ports[rank]), *store, "--",
            model, "--headless", "--data-parallel-size", "2", "--data-parallel-size-local", "1",
            "--data-parallel-start-rank", str(rank), "--data-parallel-address", "127.0.0.1",
            "--data-parallel-rpc-port", str(rpc_port), *VLLM_FLAGS,
        ], tmp_path)

    engines = [launcher(0), launcher(1)]
    procs.extend(engines)

    def all_alive() -> bool:
        return all(p.alive() for p in procs)  # raises with the dead one's log

    # 1. No frontend yet: each engine has said HELLO into its relay, and its launcher is not ready.
    for rank, eng in enumerate(engines):
        wait_until(lambda eng=eng: eng.alive() and "Handshake: HELLO from rank" in eng.log.read_text(),
                   STARTUP_TIMEOUT, f"rank {rank}'s engine to say HELLO", interval=0.5,
                   retry_on=(Exception,), fatal=(AssertionError,))
        starting = {"rank": rank, "state": "starting", "exitcode": None}
        assert get(health_ports[rank], "/readyz") == (503, starting)
        assert get(health_ports[rank], "/livez") == (200, starting)

    # 2. The stock frontend (internal LB, no local engines) takes both handshakes through the relays.
    frontend = Proc("frontend", [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(http_port),
        "--data-parallel-size", "2", "--data-parallel-size-local", "0", "--data-parallel-address", "127.0.0.1",
        "--data-parallel-rpc-port", str(rpc_port), *VLLM_FLAGS,
    ], tmp_path)
    procs.append(frontend)
    for rank in (0, 1):
        wait_until(lambda rank=rank: all_alive() and get(health_ports[rank], "/readyz")[0] == 200,
                   STARTUP_TIMEOUT, f"rank {rank} ready", interval=0.5, retry_on=(Exception,),
                   fatal=(AssertionError,))
        assert get(health_ports[rank], "/readyz") == (200, {"rank": rank, "state": "ready", "exitcode": None})
    wait_until(lambda: all_alive() and get(http_port, "/health")[0] == 200,
               STARTUP_TIMEOUT, "frontend healthy", interval=0.5, retry_on=(Exception,), fatal=(AssertionError,))

    # 2b. The launcher relays and probes; vLLM and torch live in its child, the engine core.
    for eng in engines:
        core = psutil.Process(engine_pid(eng))
        assert core.ppid() == eng.pid
        assert "libtorch" in Path(f"/proc/{core.pid}/maps").read_text()
        launcher_maps = Path(f"/proc/{eng.pid}/maps").read_text()
        assert "libtorch" not in launcher_maps, eng.output()
        assert "/vllm/" not in launcher_maps, eng.output()

    # 2c. Rank 0's coordination store answers on the launcher's host.
    from torch.distributed import TCPStore

    client = TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)
    client.set("probe", b"1")
    assert client.get("probe") == b"1"
    del client

    # 3. Requests go through. (Where DPLB sends each one is its business; both ranks are joined.)
    for prompt in ([1, 17, 42, 99], [1, 5, 6, 7, 8], [1, 300, 301]):
        result = complete(http_port, prompt)
        assert result["usage"]["completion_tokens"] == 4, result

    # 4. Rank 1's engine core dies, leaving a wedged executor worker behind (SIGSTOP: it cannot
    #    notice its parent's death and exit by itself). The launcher says /livez 503 while it stops
    #    the orphan (SIGTERM, 5 s grace, SIGKILL), then exits 128+SIGKILL.
    victim = psutil.Process(engine_pid(engines[1]))
    assert victim.ppid() == engines[1].pid
    workers = victim.children(recursive=True)
    assert workers, f"no executor worker under the engine core:\n{engines[1].output()}"
    watcher = LivezWatcher(health_ports[1])
    watcher.start()
    wait_until(lambda: bool(watcher.seen), STEP_TIMEOUT, "the /livez watcher's first answer", interval=0.1)
    for worker in workers:
        worker.suspend()
    victim.kill()
    assert engines[1].wait(EXIT_TIMEOUT) == 128 + signal.SIGKILL, engines[1].output()
    watcher.join(timeout=STEP_TIMEOUT)
    assert watcher.seen[0] == (200, {"rank": 1, "state": "ready", "exitcode": None})
    assert watcher.seen[-1] == (503, {"rank": 1, "state": "exited", "exitcode": -signal.SIGKILL}), watcher.seen[-5:]
    log = engines[1].log.read_text()
    assert "Engine core EngineCore_DP1 exited with code -9 without a stop signal" in log, engines[1].output()
    assert "the engine left behind" in log, engines[1].output()
    wait_until(lambda: all(gone_or_zombie(p) for p in [victim, *workers]),
               STEP_TIMEOUT, f"rank 1's processes {[p.pid for p in [victim, *workers]]} gone",
               interval=0.1, retry_on=(Exception,))

    # 5. SIGTERM to rank 0's launcher: the engine is shut down, exit 0, nothing left behind.
    rank0_tree = engines[0].descendants()
    assert any(p.pid == engine_pid(engines[0]) for p in rank0_tree), rank0_tree
    assert any("corefleet_client.coordstore" in p.cmdline() for p in rank0_tree), rank0_tree
    os.kill(engines[0].pid, signal.SIGTERM)
    assert engines[0].wait(EXIT_TIMEOUT) == 0, engines[0].output()
    wait_until(lambda: all(gone_or_zombie(p) for p in rank0_tree),
               STEP_TIMEOUT, f"rank 0's processes {[p.pid for p in rank0_tree]} gone",
               interval=0.1, retry_on=(Exception,))
    log = engines[0].log.read_text()
    assert "Engine stopped" in log, engines[0].output()
    assert "Traceback" not in log, engines[0].output()


def test_a_refused_engine_core_argument_fails_the_launcher_with_its_message() -> None:
    """The whole launcher, run for real (its engine core parses the flags with vLLM's own parser): the engine
    core refuses, the launcher exits with its status 2 and the parser's message, no traceback."""
    argv = ["tiny-model", "--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-start-rank",
            "1", "--data-parallel-address", "10.0.0.5", "--data-parallel-rpc-port", "29550"]  # no --headless
    result = subprocess.run([sys.executable, "-m", "corefleet_client.engine", "--health-host", "127.0.0.1",
                             "--health-port", str(free_port()), "--", *argv],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "--headless is required" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
