# SPDX-License-Identifier: Apache-2.0
"""Whole-fleet serving: `corefleet up` against stock `vllm serve`, same engines, same model, same load.

    flock /tmp/corefleet-heavy.lock .venv/bin/python bench/bench_fleet.py [--rounds 3] [--ranks 2]
    flock /tmp/corefleet-heavy.lock .venv/bin/python bench/bench_fleet.py --engine emulator --ranks 4 \\
        [--token-delay-ms 20]

What users get end to end: requests/s, time to first token (TTFT) and time per output token (TPOT)
of a fleet started the way users start it, against stock vLLM serving the same engines on the same
machine. `bench_frontend.py` isolates the frontend's own cost over emulated engines; this one
includes what it leaves out: real vLLM engines competing with the frontend for the cores, and
where the processes are placed. Issue 10 was of that kind: local mode started each fleet process
in its own session, and with `kernel.sched_autogroup_enabled=1` the kernel shares the cores
between sessions (autogroups) before threads, so the frontend got one share against every
spinning engine worker's and the fleet served at about half of stock. This benchmark reports how
many autogroups each side's processes occupy (1 on both sides is the fix; a NOTE when more) and,
with `--keep-autogroups` (the kernel's autogroup scheduling left on, see below), would show that
regression as a throughput ratio of about 0.5.

The sides, one at a time, alternately and in ABBA order (stock, corefleet, corefleet, stock, ... for
`--rounds`: each side goes first in half the rounds, so that a machine whose speed drifts during the
run favours neither: on 2026-12-06, with stock always first, the load generator, the same program on
both sides, used 21 % more CPU per request in corefleet's windows, and the stock rounds alone ranged
from 38 to 66 req/s), each round on a freshly started fleet that is stopped before the next one starts:

* corefleet: the CLI, `corefleet up --detach --replicas N --engine E --port P --state-dir D`: the
  default tiny model that `corefleet up` writes into its state directory, its default vLLM flags
  (`VLLM_CPU_FLAGS` plus `--served-model-name tiny-llama`); stopped with `corefleet down
  --state-dir D`. The standalone coordinator, the frontend (`corefleet_client.frontend`) and per
  rank an engine launcher (`corefleet_client.engine`) whose EngineCore and worker are vLLM's.
* stock: `vllm serve MODEL --data-parallel-size N --api-server-count 1` with the same model
  directory (the one in corefleet's state directory, written by `tinymodel.write_tiny_model`
  before either side starts, which `corefleet up` then leaves as it is) and exactly the same vLLM
  flags: one API-server process like corefleet's frontend, its DP coordinator and, per rank,
  EngineCore and worker, all children of `vllm serve`.

Each side's top process (`corefleet up`, `vllm serve`) starts in its own session, and everything
it starts stays in that session, as when a user runs it from a terminal: each side is one
autogroup, and so is the load generator (a second terminal); the kernel's autogroup scheduling is
off while they run (below). Everything of a side is found by its session id; stock is stopped by
signalling its process group (SIGTERM, SIGKILL after 20 s), and both sides are checked to leave no
process behind.

CPU placement: local mode binds rank r's OpenMP threads to a core (`local.engine_cpu`: the usable
cores but the last, round, as vLLM's own "auto" binding leaves the last core to the other processes)
through `VLLM_CPU_OMP_THREADS_BIND=<core>` in each engine's environment. Stock gets the same cores
through vLLM's own per-rank syntax, `VLLM_CPU_OMP_THREADS_BIND=<core0>|<core1>|...` (one entry per
local DP rank; on 2 cores `0|0`, what stock picks by default), so each rank's worker computes on the
same core on both sides; the run prints the bindings each worker logged. A
`VLLM_CPU_OMP_THREADS_BIND` already in the environment is passed to both sides unchanged.

The load is vLLM's own load generator, `vllm bench serve` (streaming `/v1/completions`, the random
dataset, `--random-input-len 32 --random-output-len 32 --ignore-eos`, seed 0, so both sides get
the same prompts), run in its own process and session against each fleet: after a warm-up
(`--warmup-prompts` concurrent completions of the same lengths, not counted), once at
`--concurrency` 16 with `--prompts` 300 (throughput and TTFT under load) and once at concurrency 1
with `--floor-prompts` 40 of `--floor-output-len` 224 tokens (the latency floor: TTFT and TPOT of a
lone request; a 32-token stream lasts about 35 ms at c=1, too short for a per-token figure). Beside
the mean TPOT the run reports the median TPOT and the mean latency per output token (a request's
latency over its tokens, which a late first read cannot shrink).

The kernel's autogroup scheduling is switched off while the fleets run (`autogroups_off`; restored
afterwards; `--keep-autogroups` leaves it): with it on, the load generator's session gets an equal
share against a fleet's session, and on 2 cores (kernel 6.18, 2026-12-05) it was left unscheduled
while a fleet decoded: it read a request's first chunk late and the rest at once (a raw-socket
client after a c=16 run: median TTFT 247 ms, the whole 224-token request, against 6.5 ms in the
fleet's own session), on both sides, so TTFT up to the whole request and TPOT near 0. Until then the
c=1 TPOT ratios measured that, not the fleets. With it off every thread is scheduled on its own, as
when the load generator and the fleet share a session, and a client's reads keep up (TTFT p99 10-16
ms at c=1 on both sides). Each side still occupies one session, and the run still counts them. The
load
generator imports vLLM (~12 s of one core); the fleet's CPU is sampled only between its "Starting
main benchmark run" and its result, so its start-up counts nowhere (its time is reported).

Per process, by role (from the command line or vLLM's process title: frontend, coordinator,
engine launcher, EngineCore, worker, emulator, helper): CPU seconds during the measured
concurrency-16 run (psutil `cpu_times`, user + system, sampled at its start and end), and RSS and
PSS at rest (after the warm-up, before the load; RSS counts shared library pages in every
process, PSS shares them out).

Figures (medians over the rounds): `RATIO corefleet/stock throughput c=16` (goal >= 1.00), mean and
p99 TTFT ratios at c=16 (goal <= 1.10), mean TPOT ratios at c=16 and c=1 (goal <= 1.05; the c=1
median inter-token latency's ratio beside it), the difference of median TTFT at c=1 (goal within 2
ms; the mean's difference is printed beside it), `RATIO corefleet/stock RSS at rest` (goal <= 1.10).
Beside them, where a request's time goes on each side (`HOP_METRICS`: vLLM's own request histograms
from each API server's `/metrics`). Each is printed with whether its goal is met; the exit status is
non-zero only on errors (a fleet that does not come up, failed requests, a process left behind),
never on a missed goal.

Noise: with real vLLM CPU engines both sides stall now and then for 0.5-1.1 s, every in-flight
stream at once, even at concurrency 1 (a few times per 10 s; never over the emulator, so most
likely in the engines). One such stall moves the mean TTFT of 40 lone requests by ~25 ms and the
mean and p99 TTFT at c=16 by tens of percent, and the rounds of one side differ by up to ~50% in
requests/s; so the c=1 figure is the median, and each run reports how many waits for a token took
longer than 0.5 s (the load generator's JSON in `--state-dir` has every request's TTFT and
inter-token latencies, `--save-detailed`).

`--engine emulator` (e.g. `--ranks 4 --token-delay-ms 20`): the same comparison over corefleet's
emulated engines (no model runs; the frontend is real vLLM): stock is `vllm serve
--data-parallel-size N --data-parallel-size-local 0 --api-server-count 1` plus N emulators with
the command line corefleet's own engines get (`local.engine_argv`, as in `bench_frontend.py`),
corefleet is `corefleet up --engine emulator --token-delay-ms D`. With a per-token delay the
engines, not the frontend, bound the run, so requests/s measure how evenly each side spreads the
load. It reports requests per rank during the concurrency-16 run: routed (corefleet: the admin
API's `requests_total`, `GET /v1/fleet` with the state directory's bearer token), finished (stock:
`vllm:request_success_total{engine="i"}` from `/metrics`) and added on the engine side (both: the
emulators' `/stats`), with the max/mean skew.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

from bench_frontend import (
    SIDES,
    BenchError,
    _cpu_model,
    _vllm_version,
    autogroups_off,
    log,
    machine_busy_seconds,
    run_in_state_dir,
    side_order,
)
from corefleet_client.admin import AdminError
from corefleet_harness import local
from corefleet_harness.local import LOCALHOST
from corefleet_harness.support import WaitTimeout, free_ports, http_get, tail, wait_until
from corefleet_harness.tinymodel import VLLM_CPU_FLAGS, VOCAB_SIZE, write_tiny_model

SERVED_NAME = local.TINY_MODEL_NAME
BIN = Path(sys.executable).parent  # the venv's bin: `corefleet` and `vllm` live beside its python
STOP_GRACE = 20.0
REQUEST_TIMEOUT = 120.0
LOADGEN_TIMEOUT = 900.0  # one `vllm bench serve` run, its start-up included
MAIN_RUN_MARK = "Starting main benchmark run"
RESULT_MARK = "Serving Benchmark Result"
ROLE_ORDER = ("frontend", "coordinator", "engine launcher", "EngineCore", "worker", "emulator", "helper",
              "shell", "corefleet up", "other")
_TITLE = re.compile(r"\bVLLM::([A-Za-z]+)(?:_DP(\d+))?")
_TITLE_ROLES = {"EngineCore": "EngineCore", "Worker": "worker", "DPCoordinator": "coordinator",
                "APIServer": "frontend"}
STALL_S = 0.5  # a wait for a token this long is a stall (a step of the tiny model takes ~10-60 ms)
GOALS = {"throughput": 1.00, "ttft": 1.10, "tpot": 1.05, "c1_ttft_ms": 2.0, "rss": 1.10}


# ---- processes of one side: its session ----------------------------------------------------------
def session_pids(sid: int, not_before: int) -> list[int]:
    """The running processes of session `sid` started no earlier than its leader (clock ticks)."""
    return sorted(p.pid for p in local.all_procs()
                  if p.session == sid and local.is_running(p) and p.start_time >= not_before)


def role_of(cmdline: list[str]) -> tuple[str, int | None]:
    """(role, rank) of a fleet process, from vLLM's process title or the command line."""
    if cmdline[:2] == ["/bin/sh", "-c"]:
        return "shell", None  # stock's session leader over the emulators (its script names them all)
    text = " ".join(cmdline)
    m = _TITLE.search(text)
    if m:
        return _TITLE_ROLES.get(m.group(1), m.group(1)), int(m.group(2)) if m.group(2) else None
    rank = None
    if "--data-parallel-start-rank" in cmdline:
        with contextlib.suppress(IndexError, ValueError):
            rank = int(cmdline[cmdline.index("--data-parallel-start-rank") + 1])
    if "corefleet_client.frontend" in text:
        return "frontend", None
    if "corefleet_client.coordinator" in text:
        return "coordinator", None
    if "corefleet_client.enginecore" in text:  # the launcher's child, until vLLM retitles it
        return "EngineCore", rank
    if "corefleet_client.engine" in text:
        return "engine launcher", rank
    if "corefleet_harness.emulator" in text:
        return "emulator", rank
    if "multiprocessing" in text:
        return "helper", None
    if re.search(r"\bcorefleet up\b|corefleet_operator", text):
        return "corefleet up", None
    if "vllm" in text and " serve " in f" {text} ":
        return "frontend", None
    return "other", None


def role_label(role: str, rank: int | None) -> str:
    return role if rank is None else f"{role} {rank}"


def _label_key(label: str) -> tuple[int, str]:
    role = label.rsplit(" ", 1)[0] if label[-1:].isdigit() else label
    return (ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER), label)


def labels_of(pids: list[int]) -> dict[int, str]:
    """pid -> 'role' or 'role rank'; a worker without a rank in its title gets its EngineCore's."""
    out = {}
    for pid in pids:
        cmdline = local.proc_cmdline(pid)
        if cmdline is None:
            continue
        role, rank = role_of(cmdline)
        if role == "worker" and rank is None and (st := local.proc_stat(pid)) is not None:
            rank = role_of(local.proc_cmdline(st.ppid) or [])[1]
        out[pid] = role_label(role, rank)
    return out


def cpu_seconds(pid: int) -> float | None:
    """user + system CPU seconds of a process (all its threads), or None if it is gone."""
    try:
        t = psutil.Process(pid).cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return float(t.user + t.system)


def pss_bytes(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def autogroup(pid: int) -> str:
    """The scheduling autogroup of a process (`/autogroup-N`), '' where the kernel has none."""
    try:
        return Path(f"/proc/{pid}/autogroup").read_text().split()[0]
    except (OSError, IndexError):
        return ""


def thread_cpus(pid: int) -> dict[str, int]:
    """Cpus_allowed_list of each thread of a process -> how many threads have it."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                for line in (task / "status").read_text().splitlines():
                    if line.startswith("Cpus_allowed_list:"):
                        cpus = line.split(":", 1)[1].strip()
                        out[cpus] = out.get(cpus, 0) + 1
    return out


@dataclass
class ProcMem:
    pid: int
    label: str
    rss: int
    pss: int


@dataclass
class Side:
    """One running fleet: where to send requests, and the session that holds all its processes."""

    name: str
    engine: str
    ranks: int
    base: str  # http://127.0.0.1:PORT
    sid: int  # session id: the pid of the side's top process
    not_before: int  # the top process's start time (clock ticks after boot)
    logs: list[Path]
    health_ports: tuple[int, ...]
    started_in: float = 0.0
    state_dir: Path | None = None  # corefleet's

    def pids(self) -> list[int]:
        return session_pids(self.sid, self.not_before)


def _popen_session(argv: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as logf:
        return subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)


def _start_ticks(pid: int) -> int:
    st = local.proc_stat(pid)
    return st.start_time if st is not None else 0


def _tails(paths: list[Path], lines: int = 25) -> str:
    return "\n".join(f"--- last lines of {p}:\n{tail(p, lines)}" for p in paths)


def wait_serving(check: Callable[[], str | None], timeout: float, what: str,
                 failed: Callable[[], str | None] = lambda: None, logs: tuple[Path, ...] = ()) -> None:
    """`wait_until` for a check that says what is missing (None: done); `failed` says why to give up
    at once. A timeout names what was missing last and shows the tails of `logs` (a BenchError either way)."""
    missing: str | None = "nothing checked yet"

    def done() -> bool:
        nonlocal missing
        why = failed()
        if why is not None:
            raise BenchError(why)
        missing = check()
        return missing is None

    try:
        wait_until(done, timeout, what, interval=local.POLL_SECONDS)
    except WaitTimeout:
        raise BenchError(f"{what}: not done within {timeout:.0f} s ({missing})\n{_tails(list(logs))}") from None


def models_answer(base: str) -> str | None:
    status, body = http_get(f"{base}/v1/models", 5, unanswered_ok=True)
    if status != 200:
        return f"GET {base}/v1/models: {status or 'no answer'}"
    if SERVED_NAME.encode() not in body:
        return f"GET {base}/v1/models does not list {SERVED_NAME}: {body[:200]!r}"
    return None


def stop_session(name: str, sid: int, not_before: int, leader: subprocess.Popen[bytes] | None,
                 signal_first: bool) -> list[str]:
    """Make sure nothing of session `sid` runs. With `signal_first` (stock) SIGTERM its process group,
    wait, then SIGKILL whatever of the session is left; without (corefleet, after `corefleet down`)
    anything left is itself a finding. Returns what had to be killed."""
    def live() -> list[int]:
        if leader is not None:
            leader.poll()
        return session_pids(sid, not_before)

    killed: list[str] = []
    if signal_first and live():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        while live() and time.monotonic() < deadline:
            time.sleep(0.1)
    left = live()
    if left:
        killed = [f"{pid} {labels_of([pid]).get(pid, '?')}" for pid in left]
        log(f"{name}: still running, SIGKILL: {', '.join(killed)}")
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while live() and time.monotonic() < deadline:
            time.sleep(0.1)
        if live():
            raise BenchError(f"{name}: processes survived SIGKILL: {live()}")
    if leader is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            leader.wait(5)
    return killed


# ---- the two sides -------------------------------------------------------------------------------
def _omp_bind(ranks: int) -> str:
    """What local mode gives rank r (`VLLM_CPU_OMP_THREADS_BIND=<core>`), as vLLM's per-local-rank list."""
    cpus = sorted(os.sched_getaffinity(0))
    return "|".join(str(local.engine_cpu(r, cpus, local.reserved_cpus())) for r in range(ranks))


@contextlib.contextmanager
def stock_fleet(args: argparse.Namespace, work: Path, model: str, flags: tuple[str, ...]) -> Iterator[Side]:
    """`vllm serve` (with the emulators for `--engine emulator`) in one new session; stopped on the way out."""
    work.mkdir(parents=True, exist_ok=True)
    n = args.ranks
    http, rpc, *health = free_ports(2 + n)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    serve = [str(BIN / "vllm"), "serve", model, "--data-parallel-size", str(n), "--api-server-count", "1",
             "--host", LOCALHOST, "--port", str(http)]
    logs = [work / "vllm-serve.log"]
    leader_log = logs[0]
    if args.engine == local.ENGINE_VLLM:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", _omp_bind(n))
        argv = [*serve, *flags]
        health = []
    else:
        leader_log = work / "shell.log"
        ports = local.Ports(http=http, admin=0, rpc=rpc, coord_front_publish=0, coord_back_output=0,
                            coord_back_publish=0, health=tuple(health))
        cmds = [([*serve, "--data-parallel-size-local", "0", "--data-parallel-address", LOCALHOST,
                  "--data-parallel-rpc-port", str(rpc), *flags], logs[0])]
        for r in range(n):
            logs.append(work / f"emulator-{r}.log")
            cmds.append((local.engine_argv(sys.executable, local.ENGINE_EMULATOR, model, n, r, ports, flags,
                                           token_delay_ms=args.token_delay_ms), logs[-1]))
        # One shell leads the session and the process group; without job control its children stay in both.
        script = "".join(f"{shlex.join(c)} >{shlex.quote(str(p))} 2>&1 &\n" for c, p in cmds) + "wait\n"
        argv = ["/bin/sh", "-c", script]
    t0 = time.monotonic()
    leader = _popen_session(argv, leader_log, env)
    not_before = _start_ticks(leader.pid)
    side = Side(name="stock", engine=args.engine, ranks=n, base=f"http://{LOCALHOST}:{http}", sid=leader.pid,
                not_before=not_before, logs=logs, health_ports=tuple(health))
    seen: set[int] = set()
    try:
        def failed() -> str | None:
            if leader.poll() is not None:
                return f"stock: the fleet exited with {leader.returncode} before it served\n{_tails(logs)}"
            if args.engine == local.ENGINE_EMULATOR:  # one that ran and is gone (the shell starts them)
                roles = [role_of(local.proc_cmdline(pid) or []) for pid in side.pids()]
                seen.update(r for role, r in roles if role == "emulator" and r is not None)
                gone = [r for r in sorted(seen) if ("emulator", r) not in roles]
                if gone:
                    return f"stock: emulator {gone[0]} exited before the fleet served\n{_tails([logs[1 + gone[0]]])}"
            return None

        def ready() -> str | None:
            not_ready = [r for r, port in enumerate(side.health_ports)
                         if http_get(f"http://{LOCALHOST}:{port}/readyz", 2, unanswered_ok=True)[0] != 200]
            return f"emulators not ready: {not_ready}" if not_ready else models_answer(side.base)

        timeout = args.ready_timeout or local.DEFAULT_READY_TIMEOUT[args.engine]
        wait_serving(ready, timeout, "stock fleet serving", failed, tuple(logs))
        side.started_in = time.monotonic() - t0
        yield side
    finally:
        stop_session("stock", leader.pid, not_before, leader, signal_first=True)


@contextlib.contextmanager
def corefleet_fleet(args: argparse.Namespace, state: Path, model: str, round_no: int,
                    flags: tuple[str, ...] | None = None, env: dict[str, str] | None = None) -> Iterator[Side]:
    """`corefleet up --detach` in a new session; `corefleet down` on the way out. With `flags`, the fleet
    serves `model` (`--model`) with exactly those vLLM flags (after `--`); `env` is added to its environment."""
    port = free_ports(1)[0]
    argv = [str(BIN / "corefleet"), "up", "--detach", "--replicas", str(args.ranks), "--engine", args.engine,
            "--port", str(port), "--state-dir", str(state)]
    if args.engine == local.ENGINE_EMULATOR:
        argv += ["--token-delay-ms", str(args.token_delay_ms)]
    if args.ready_timeout:
        argv += ["--timeout", str(args.ready_timeout)]
    if flags is not None:
        argv += ["--model", model, "--", *flags]
    up_log = state.parent / f"corefleet-up-{round_no}.log"
    t0 = time.monotonic()
    failing = False
    up = _popen_session(argv, up_log, {**os.environ, **(env or {})})
    not_before = _start_ticks(up.pid)
    side = Side(name="corefleet", engine=args.engine, ranks=args.ranks, base=f"http://{LOCALHOST}:{port}",
                sid=up.pid, not_before=not_before, logs=[up_log], health_ports=(), state_dir=state)
    try:
        timeout = (args.ready_timeout or local.DEFAULT_READY_TIMEOUT[args.engine]) + 60
        try:
            rc = up.wait(timeout)
        except subprocess.TimeoutExpired:
            raise BenchError(f"corefleet up did not return within {timeout:.0f} s\n{_tails([up_log])}") from None
        if rc != 0:
            raise BenchError(f"corefleet up exited with {rc}\n{_tails([up_log], 60)}")
        record = local.load_record(state)
        if record is None:
            raise BenchError(f"corefleet up returned 0 but recorded no fleet in {state}")
        if record.model != model:
            raise BenchError(f"corefleet up serves {record.model}, not the shared model directory {model}")
        side.health_ports = record.ports.health
        side.logs = [up_log, *(Path(p.log) for p in record.processes)]
        wait_serving(lambda: models_answer(side.base), 60, "corefleet /v1/models", logs=tuple(side.logs))
        side.started_in = time.monotonic() - t0
        yield side
    except BaseException:
        failing = True
        raise
    finally:
        if up.poll() is None:  # still starting: it stops what it started on SIGTERM
            up.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                up.wait(STOP_GRACE + 15)
        down = subprocess.run([str(BIN / "corefleet"), "down", "--state-dir", str(state)], capture_output=True,
                              text=True, timeout=120, check=False)
        with up_log.open("a") as f:
            f.write(f"$ corefleet down (exit {down.returncode})\n{down.stdout}{down.stderr}")
        killed = stop_session("corefleet", up.pid, not_before, up, signal_first=False)
        logs = state / local.LOG_DIR
        if logs.is_dir():  # one log directory per round (a reused --state-dir keeps the older ones)
            target = state / f"{local.LOG_DIR}-round-{round_no}"
            if target.exists():
                target = target.with_name(f"{target.name}-{int(time.time())}")
            logs.rename(target)
        if (down.returncode != 0 or killed) and not failing:
            raise BenchError(f"corefleet down exited with {down.returncode} and left {killed or 'nothing'} "
                             f"running:\n{down.stdout}{down.stderr}")


# ---- load ---------------------------------------------------------------------------------------
def warm_up(base: str, prompts: int, input_len: int, output_len: int) -> float:
    """`prompts` concurrent completions of the measured lengths (token-id prompts); seconds taken."""
    rng = random.Random(1)
    bodies = [json.dumps({"model": SERVED_NAME, "prompt": [rng.randrange(3, VOCAB_SIZE) for _ in range(input_len)],
                          "max_tokens": output_len, "ignore_eos": True}).encode() for _ in range(prompts)]

    def one(body: bytes) -> str | None:
        req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
                got = json.loads(r.read())["usage"]["completion_tokens"]
        except (OSError, ValueError, KeyError) as e:
            return f"{type(e).__name__}: {e}"
        return None if got == output_len else f"{got} completion tokens, expected {output_len}"

    t0 = time.monotonic()
    with ThreadPoolExecutor(prompts) as pool:
        errors = [e for e in pool.map(one, bodies) if e is not None]
    if errors:
        raise BenchError(f"warm-up: {len(errors)} of {prompts} completions failed: {errors[:3]}")
    return time.monotonic() - t0


@dataclass
class LoadResult:
    concurrency: int
    prompts: int
    result: dict[str, Any]  # vllm bench serve's JSON
    startup_s: float  # its start until its main run began (vLLM import, tokenizer, dataset)
    cpu: dict[str, float] = field(default_factory=dict)  # label -> CPU seconds in the main run (fleet processes)
    loadgen_cpu: float = 0.0
    other_cpu: float = 0.0  # every other process on the machine
    window_s: float = 0.0
    hops: dict[str, float] = field(default_factory=dict)  # HOP_METRICS name -> mean seconds in the main run

    def hop_ms(self, name: str) -> float:
        return 1000 * self.hops.get(name, float("nan"))

    @property
    def latency_per_token_ms(self) -> float:
        """Mean over requests of its latency over its output tokens: unlike TPOT, which subtracts the TTFT, a first
        chunk read late with the rest at once leaves it as it is."""
        pairs = [(lat, n) for lat, n in zip(self.result.get("latencies") or [], self.result.get("output_lens") or [],
                                           strict=False) if lat is not None and n]
        return 1000 * statistics.mean(lat / n for lat, n in pairs) if pairs else float("nan")

    @property
    def median_itl_ms(self) -> float:
        """The client's median wait between two tokens: unlike the mean TPOT, a few stalls do not move it."""
        itls = [x for itl in self.result.get("itls") or [] for x in itl if x is not None]
        return 1000 * statistics.median(itls) if itls else float("nan")

    def get(self, key: str) -> float:
        return float(self.result.get(key, float("nan")))

    @property
    def stalls(self) -> int:
        """Waits of more than STALL_S for a token (first or next) over all requests."""
        ttfts = self.result.get("ttfts") or []
        itls = [x for itl in self.result.get("itls") or [] for x in itl]
        return sum(1 for x in (*ttfts, *itls) if x is not None and x > STALL_S)


def run_loadgen(side: Side, args: argparse.Namespace, model: str, concurrency: int, prompts: int,
                out: Path, tag: str, dataset: list[str] | None = None) -> LoadResult:
    """One `vllm bench serve` run against the side, in its own session; the side's CPU per process
    is sampled when its main run starts and when its result is printed. `dataset`: its dataset arguments
    (default: the random dataset, `args.input_len` in / `args.output_len` out)."""
    result_file = out / f"bench-{tag}.json"
    if dataset is None:
        dataset = ["--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
                   str(args.output_len)]
    argv = [str(BIN / "vllm"), "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
            "--base-url", side.base, "--model", SERVED_NAME, "--tokenizer", model, *dataset,
            "--max-concurrency", str(concurrency), "--num-prompts", str(prompts), "--ignore-eos", "--seed", "0",
            "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(out),
            "--result-filename", result_file.name]
    samples: dict[str, tuple[float, float, dict[int, float], float]] = {}

    scraped: dict[str, dict[str, tuple[float, float]]] = {}

    def sample(lg_pid: int) -> tuple[float, float, dict[int, float], float]:
        scraped["start" if "start" not in samples else "end"] = histogram_totals(side.base, HOP_METRICS)
        pids = side.pids()
        cpu = {pid: s for pid in pids if (s := cpu_seconds(pid)) is not None}
        lg = sum(s for pid in session_pids(lg_pid, 0) if (s := cpu_seconds(pid)) is not None)
        return time.monotonic(), machine_busy_seconds(), cpu, lg

    log_path = out / f"loadgen-{tag}.log"
    result_file.unlink(missing_ok=True)
    t0 = time.monotonic()
    t_main = float("nan")
    labels: dict[int, str] = {}
    with log_path.open("w") as logf:
        lg = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True, text=True)
        watchdog = threading.Timer(LOADGEN_TIMEOUT, lambda: os.killpg(lg.pid, signal.SIGKILL))
        watchdog.start()
        try:
            assert lg.stdout is not None
            for line in lg.stdout:
                if MAIN_RUN_MARK in line and "start" not in samples:
                    samples["start"] = sample(lg.pid)
                    t_main = samples["start"][0]
                    labels = labels_of(list(samples["start"][2]))
                elif RESULT_MARK in line and "start" in samples and "end" not in samples:
                    samples["end"] = sample(lg.pid)
                logf.write(line)
            rc = lg.wait(60)
        finally:
            watchdog.cancel()
            if lg.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(lg.pid, signal.SIGKILL)
                lg.wait()
    if rc != 0 or not result_file.exists() or set(samples) != {"start", "end"}:
        raise BenchError(f"{side.name}: vllm bench serve ({tag}) failed (exit {rc}); last lines of {log_path}:\n"
                         f"{tail(log_path)}")
    result = json.loads(result_file.read_text())
    if result.get("failed") or result.get("completed") != prompts:
        errors = sorted({e for e in result.get("errors", []) if e})[:3]
        raise BenchError(f"{side.name}: {result.get('failed')} of {prompts} requests failed ({tag}): {errors}")
    (t_a, busy_a, cpu_a, lg_a), (t_b, busy_b, cpu_b, lg_b) = samples["start"], samples["end"]
    cpu: dict[str, float] = {}
    for pid, end in cpu_b.items():
        label = labels.get(pid) or labels_of([pid]).get(pid, "other")
        cpu[label] = cpu.get(label, 0.0) + end - cpu_a.get(pid, 0.0)
    fleet = sum(cpu.values())
    return LoadResult(concurrency=concurrency, prompts=prompts, result=result, startup_s=t_main - t0, cpu=cpu,
                      loadgen_cpu=lg_b - lg_a, other_cpu=max(0.0, busy_b - busy_a - fleet - (lg_b - lg_a)),
                      window_s=t_b - t_a, hops=histogram_means(scraped["start"], scraped["end"]))


# ---- where a request's time goes: vLLM's own request histograms, on both sides -------------------
# Each side's API server (stock's, corefleet's frontend) exports the same histograms from the same code
# (vllm/v1/metrics/stats.py, loggers.py): the two TTFT-like ones are measured by the API server's clock
# (arrival of the HTTP request -> the output handler processed the first token / the last one); the others
# are differences of the engine's own timestamps (queued, scheduled, and each step's `EngineCoreOutputs.timestamp`,
# taken when the step's outputs are built). Beside the load generator's figures (the client's clock) they split a
# request into: the client and HTTP (client TTFT - server TTFT), the way in and out through the API server and the
# sockets (server TTFT - queue - prefill), the engine's own steps (queue, prefill, inter-token latency), and per
# token what happens after a step (client TPOT - engine inter-token latency: the output socket, the output
# handler, detokenizing, the HTTP stream).
HOP_METRICS = (
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_decode_time_seconds",
)


def parse_histogram_totals(text: str, names: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """Per histogram name: (sum, count) over every label set (all engines) in a Prometheus text exposition."""
    out = {name: (0.0, 0.0) for name in names}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, _, value = line.rpartition(" ")
        metric = series.split("{", 1)[0]
        for suffix, at in (("_sum", 0), ("_count", 1)):
            name = metric.removesuffix(suffix)
            if metric.endswith(suffix) and name in out:
                totals = list(out[name])
                totals[at] += float(value)
                out[name] = (totals[0], totals[1])
    return out


def histogram_totals(base: str, names: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    status, body = http_get(f"{base}/metrics", 10, unanswered_ok=True)
    if status != 200:
        raise BenchError(f"GET {base}/metrics: {status or 'no answer'}")
    return parse_histogram_totals(body.decode(errors="replace"), names)


def histogram_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean of each histogram's observations between two scrapes (NaN where there were none)."""
    means = {}
    for name, (total, count) in after.items():
        n = count - before.get(name, (0.0, 0.0))[1]
        means[name] = (total - before.get(name, (0.0, 0.0))[0]) / n if n > 0 else float("nan")
    return means


# ---- routing balance (emulator mode) -------------------------------------------------------------
def prometheus_per_engine(base: str, metric: str, ranks: int) -> list[int]:
    status, body = http_get(f"{base}/metrics", 10, unanswered_ok=True)
    if status != 200:
        raise BenchError(f"GET {base}/metrics: {status or 'no answer'}")
    counts = [0.0] * ranks
    for line in body.decode(errors="replace").splitlines():
        if line.startswith(metric + "{"):
            labels, _, value = line.rpartition(" ")
            m = re.search(r'engine="(\d+)"', labels)
            if m and int(m.group(1)) < ranks:
                counts[int(m.group(1))] += float(value)
    return [round(c) for c in counts]


def rank_counters(side: Side) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    if side.name == "corefleet":
        assert side.state_dir is not None
        record = local.load_record(side.state_dir)
        if record is None:
            raise BenchError(f"no fleet recorded in {side.state_dir}")
        try:
            ranks = sorted(record.admin_client(timeout=10).fleet().ranks, key=lambda r: r.rank)
        except (OSError, AdminError, ValueError, KeyError) as e:
            raise BenchError(f"corefleet admin API: {e}") from None
        out["routed (admin API requests_total)"] = [r.requests_total for r in ranks]
    else:
        out["finished (/metrics vllm:request_success_total)"] = prometheus_per_engine(
            side.base, "vllm:request_success_total", side.ranks)
    added = []
    for port in side.health_ports:
        status, body = http_get(f"http://{LOCALHOST}:{port}/stats", 10, unanswered_ok=True)
        added.append(int(json.loads(body)["requests_added"]) if status == 200 else -1)
    out["added on the engine (emulator /stats requests_added)"] = added
    return out


def skew(counts: list[int]) -> float:
    mean = statistics.fmean(counts) if counts else 0.0
    return max(counts) / mean if mean > 0 else float("nan")


# ---- one round of one side -----------------------------------------------------------------------
@dataclass
class RoundResult:
    side: str
    round: int
    up_s: float
    warmup_s: float
    c16: LoadResult
    c1: LoadResult
    rest: list[ProcMem]
    autogroups: list[str]
    bindings: list[str]
    per_rank: dict[str, list[int]] = field(default_factory=dict)

    def rss_total(self) -> int:
        return sum(p.rss for p in self.rest)

    def pss_total(self) -> int:
        return sum(p.pss for p in self.rest)


def omp_bindings(side: Side, pids: dict[int, str]) -> list[str]:
    """What each worker's OpenMP threads are bound to: vLLM's log line, and the workers' thread affinities."""
    out = []
    for path in side.logs:
        with contextlib.suppress(OSError):
            for line in path.read_text(errors="replace").splitlines():
                if "core ids=" in line or "VLLM_CPU_OMP_THREADS_BIND=" in line:
                    out.append(f"{path.name}: {line.strip()}")
    for pid, label in sorted(pids.items(), key=lambda kv: _label_key(kv[1])):
        if label.startswith("worker"):
            threads = ", ".join(f"cpus {c}: {n}" for c, n in sorted(thread_cpus(pid).items()))
            out.append(f"{label} (pid {pid}) threads by allowed cpus: {threads}")
    return out


def measure(side: Side, args: argparse.Namespace, model: str, out: Path, rnd: int) -> RoundResult:
    log(f"{side.name}: serving in {side.started_in:.1f} s; warming up")
    warmup_s = warm_up(side.base, args.warmup_prompts, args.input_len, args.output_len)
    pids = side.pids()
    labels = labels_of(pids)
    rest = [ProcMem(pid, labels[pid], rss, pss_bytes(pid))
            for pid in pids if pid in labels and (rss := rss_bytes(pid)) is not None]
    groups = sorted({autogroup(pid) for pid in pids} - {""})
    bindings = omp_bindings(side, labels) if side.engine == local.ENGINE_VLLM else []
    before = rank_counters(side) if side.engine == local.ENGINE_EMULATOR else {}
    log(f"{side.name}: {len(pids)} processes, {len(groups)} autogroup(s), RSS at rest "
        f"{sum(p.rss for p in rest) / 2**30:.2f} GiB; load c={args.concurrency} x {args.prompts} prompts")
    c16 = run_loadgen(side, args, model, args.concurrency, args.prompts, out, f"c{args.concurrency}")
    after = rank_counters(side) if side.engine == local.ENGINE_EMULATOR else {}
    log(f"{side.name}: c={args.concurrency}: {c16.get('request_throughput'):.2f} req/s; load c=1 x "
        f"{args.floor_prompts} prompts")
    c1 = run_loadgen(side, args, model, 1, args.floor_prompts, out, "c1",
                     ["--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
                      str(args.floor_output_len)])
    per_rank = {k: [a - b for a, b in zip(after[k], before[k], strict=True)] for k in after}
    return RoundResult(side=side.name, round=rnd, up_s=side.started_in, warmup_s=warmup_s, c16=c16, c1=c1, rest=rest,
                       autogroups=groups, bindings=bindings, per_rank=per_rank)


def rss_bytes(pid: int) -> int | None:
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


# ---- reporting -----------------------------------------------------------------------------------
def describe(r: RoundResult, concurrency: int) -> str:
    a, b = r.c16, r.c1
    by_role = sorted(a.cpu.items(), key=lambda kv: _label_key(kv[0]))
    cores = ", ".join(f"{label} {sec / a.window_s:.2f}" for label, sec in by_role if sec > 0.05)
    line = (f"{r.side:<10} round {r.round}: up {r.up_s:5.1f} s | c={concurrency}: "
            f"{a.get('request_throughput'):6.2f} req/s {a.get('output_throughput'):7.1f} tok/s, "
            f"TTFT mean {a.get('mean_ttft_ms'):6.1f} median {a.get('median_ttft_ms'):6.1f} "
            f"p99 {a.get('p99_ttft_ms'):6.1f} ms, TPOT mean {a.get('mean_tpot_ms'):5.1f} "
            f"p99 {a.get('p99_tpot_ms'):5.1f} ms | c=1: TTFT mean {b.get('mean_ttft_ms'):5.1f} "
            f"median {b.get('median_ttft_ms'):5.1f} "
            f"p99 {b.get('p99_ttft_ms'):5.1f} ms, TPOT mean {b.get('mean_tpot_ms'):5.1f} ms, "
            f"{b.get('request_throughput'):5.2f} req/s | waits > {STALL_S:g} s for a token: {a.stalls} / {b.stalls} "
            f"| RSS at rest {r.rss_total() / 2**30:.2f} GiB "
            f"(PSS {r.pss_total() / 2**30:.2f})\n"
            f"{'':<12}cores used during c={concurrency}: {cores}; fleet {sum(a.cpu.values()) / a.window_s:.2f}, "
            f"load generator {a.loadgen_cpu / a.window_s:.2f}, other {a.other_cpu / a.window_s:.2f} "
            f"({a.window_s:.1f} s); load generator start-up {a.startup_s:.1f} s / {b.startup_s:.1f} s; "
            f"autogroups {len(r.autogroups)}")
    for name, counts in r.per_rank.items():
        line += f"\n{'':<12}requests per rank, {name}: {counts} (max/mean {skew(counts):.2f})"
    return line


def _med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def side_by_side(title: str, by_side: dict[str, list[RoundResult]], value: Callable[[RoundResult], dict[str, float]],
                 fmt: Callable[[float], str], total_label: str) -> list[str]:
    """A per-label table, medians over the rounds, stock beside corefleet, with a total row."""
    labels = sorted({label for rs in by_side.values() for r in rs for label in value(r)}, key=_label_key)
    lines = [title, f"  {'process':<22}{'stock':>18}{'corefleet':>18}"]

    def cell(side: str, label: str | None) -> str:
        vals = [sum(value(r).values()) if label is None else value(r).get(label) for r in by_side[side]]
        present = [v for v in vals if v is not None]
        return fmt(_med(present)) if present else "-"

    for label in labels:
        lines.append(f"  {label:<22}{cell('stock', label):>18}{cell('corefleet', label):>18}")
    lines.append(f"  {total_label:<22}{cell('stock', None):>18}{cell('corefleet', None):>18}")
    return lines


def report(results: list[RoundResult], args: argparse.Namespace, started: float) -> list[str]:
    by_side = {side: [r for r in results if r.side == side] for side in SIDES}
    c = args.concurrency

    def med(side: str, pick: Callable[[RoundResult], float]) -> float:
        return _med([pick(r) for r in by_side[side]])

    rows: list[tuple[str, Callable[[RoundResult], float], str]] = [
        (f"c={c} requests/s", lambda r: r.c16.get("request_throughput"), "{:.2f}"),
        (f"c={c} output tokens/s", lambda r: r.c16.get("output_throughput"), "{:.1f}"),
        (f"c={c} TTFT mean ms", lambda r: r.c16.get("mean_ttft_ms"), "{:.1f}"),
        (f"c={c} TTFT median ms", lambda r: r.c16.get("median_ttft_ms"), "{:.1f}"),
        (f"c={c} TTFT p99 ms", lambda r: r.c16.get("p99_ttft_ms"), "{:.1f}"),
        (f"c={c} TPOT mean ms", lambda r: r.c16.get("mean_tpot_ms"), "{:.2f}"),
        (f"c={c} TPOT p99 ms", lambda r: r.c16.get("p99_tpot_ms"), "{:.2f}"),
        ("c=1 TTFT mean ms", lambda r: r.c1.get("mean_ttft_ms"), "{:.2f}"),
        ("c=1 TTFT median ms", lambda r: r.c1.get("median_ttft_ms"), "{:.2f}"),
        ("c=1 TTFT p99 ms", lambda r: r.c1.get("p99_ttft_ms"), "{:.2f}"),
        ("c=1 TPOT mean ms", lambda r: r.c1.get("mean_tpot_ms"), "{:.2f}"),
        ("c=1 TPOT p99 ms", lambda r: r.c1.get("p99_tpot_ms"), "{:.2f}"),
        ("c=1 TPOT median ms", lambda r: r.c1.get("median_tpot_ms"), "{:.2f}"),
        ("c=1 latency/token ms", lambda r: r.c1.latency_per_token_ms, "{:.3f}"),
        ("c=1 ITL median ms", lambda r: r.c1.median_itl_ms, "{:.2f}"),
        ("c=1 requests/s", lambda r: r.c1.get("request_throughput"), "{:.2f}"),
        (f"c={c} waits > {STALL_S:g} s", lambda r: r.c16.stalls, "{:.0f}"),
        (f"c=1 waits > {STALL_S:g} s", lambda r: r.c1.stalls, "{:.0f}"),
        ("fleet start s", lambda r: r.up_s, "{:.1f}"),
        (f"fleet CPU cores c={c}", lambda r: sum(r.c16.cpu.values()) / r.c16.window_s, "{:.2f}"),
        ("RSS at rest GiB", lambda r: r.rss_total() / 2**30, "{:.2f}"),
        ("PSS at rest GiB", lambda r: r.pss_total() / 2**30, "{:.2f}"),
    ]
    lines = [f"medians over {args.rounds} round(s):", f"  {'':<24}{'stock':>12}{'corefleet':>12}{'cf/stock':>10}"]
    for name, pick, fmt in rows:
        s, cf = med("stock", pick), med("corefleet", pick)
        ratio = f"{cf / s:.2f}" if s else "-"
        lines.append(f"  {name:<24}{fmt.format(s):>12}{fmt.format(cf):>12}{ratio:>10}")
    lines.append("")
    lines.append("where a request's time goes, mean ms (vLLM's request histograms on each API server, engine "
                 "timestamps "
                 "for queue/prefill/ITL; median over rounds):")
    lines.append(f"  {'':<52}{'stock':>10}{'corefleet':>10}{'cf-stock':>10}")
    for load in ("c1", "c16"):
        for name, pick in hop_rows(load, c):
            s, cf = med("stock", pick), med("corefleet", pick)
            lines.append(f"  {name:<52}{s:>10.2f}{cf:>10.2f}{cf - s:>+10.2f}")
    lines.append("")
    lines += side_by_side(f"CPU seconds per process during the c={c} run (user + system, median over rounds):",
                          by_side, lambda r: r.c16.cpu, lambda v: f"{v:.1f} s", "total fleet")
    win = {side: med(side, lambda r: r.c16.window_s) for side in SIDES}
    lines.append(f"  {'load generator':<22}{med('stock', lambda r: r.c16.loadgen_cpu):>16.1f} s"
                 f"{med('corefleet', lambda r: r.c16.loadgen_cpu):>16.1f} s")
    lines.append(f"  {'other processes':<22}{med('stock', lambda r: r.c16.other_cpu):>16.1f} s"
                 f"{med('corefleet', lambda r: r.c16.other_cpu):>16.1f} s")
    lines.append(f"  {'window':<22}{win['stock']:>16.1f} s{win['corefleet']:>16.1f} s")
    lines.append("")
    lines += side_by_side("RSS at rest per process, MiB (after the warm-up, before the load; median over rounds):",
                          by_side, lambda r: _sum_by_label(r.rest, "rss"), lambda v: f"{v / 2**20:.0f}",
                          "total RSS")
    lines.append(f"  {'total PSS':<22}{med('stock', lambda r: r.pss_total()) / 2**20:>18.0f}"
                 f"{med('corefleet', lambda r: r.pss_total()) / 2**20:>18.0f}")
    if any(r.per_rank for r in results):
        lines.append("")
        lines.append(f"requests per rank during the c={c} run (max/mean skew):")
        for r in results:
            for name, counts in r.per_rank.items():
                lines.append(f"  {r.side:<10} round {r.round} {name}: {counts} ({skew(counts):.2f})")
    lines.append("")
    lines.append(f"load generator start-up (vllm bench serve: import vLLM, tokenizer, dataset), median: "
                 f"{_med([x.startup_s for r in results for x in (r.c16, r.c1)]):.1f} s")
    lines.append(f"wall time: {time.monotonic() - started:.0f} s")
    return lines


def hop_rows(load: str, concurrency: int) -> list[tuple[str, Callable[[RoundResult], float]]]:
    """The rows of the where-the-time-goes table for one of the two runs ("c1", "c16"): see HOP_METRICS."""
    def run(r: RoundResult) -> LoadResult:
        return r.c1 if load == "c1" else r.c16

    c = "c=1" if load == "c1" else f"c={concurrency}"
    ttft, queue, prefill = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
                            "vllm:request_prefill_time_seconds")
    itl = "vllm:inter_token_latency_seconds"
    return [
        (f"{c} TTFT, client", lambda r: run(r).get("mean_ttft_ms")),
        (f"{c}   client + HTTP (client - server TTFT)", lambda r: run(r).get("mean_ttft_ms") - run(r).hop_ms(ttft)),
        (f"{c}   TTFT, server (API server's clock)", lambda r: run(r).hop_ms(ttft)),
        (f"{c}     in and out (server TTFT - queue - prefill)",
         lambda r: run(r).hop_ms(ttft) - run(r).hop_ms(queue) - run(r).hop_ms(prefill)),
        (f"{c}     engine queue", lambda r: run(r).hop_ms(queue)),
        (f"{c}     engine prefill", lambda r: run(r).hop_ms(prefill)),
        (f"{c} TPOT, client", lambda r: run(r).get("mean_tpot_ms")),
        (f"{c}   engine step to step (inter-token latency)", lambda r: run(r).hop_ms(itl)),
        (f"{c}   after the step (client TPOT - engine ITL)", lambda r: run(r).get("mean_tpot_ms") - run(r).hop_ms(itl)),
    ]


def _sum_by_label(procs: list[ProcMem], attr: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for p in procs:
        out[p.label] = out.get(p.label, 0.0) + getattr(p, attr)
    return out


def figures(results: list[RoundResult], concurrency: int) -> list[str]:
    by_side = {side: [r for r in results if r.side == side] for side in SIDES}

    def med(side: str, pick: Callable[[RoundResult], float]) -> float:
        return _med([pick(r) for r in by_side[side]])

    def verdict(ok: bool) -> str:
        return "goal met" if ok else "goal MISSED"

    tput = med("corefleet", lambda r: r.c16.get("request_throughput")) / med(
        "stock", lambda r: r.c16.get("request_throughput"))
    ttft = med("corefleet", lambda r: r.c16.get("mean_ttft_ms")) / med("stock", lambda r: r.c16.get("mean_ttft_ms"))
    p99 = med("corefleet", lambda r: r.c16.get("p99_ttft_ms")) / med("stock", lambda r: r.c16.get("p99_ttft_ms"))
    tpot = med("corefleet", lambda r: r.c16.get("mean_tpot_ms")) / med("stock", lambda r: r.c16.get("mean_tpot_ms"))
    tpot1 = med("corefleet", lambda r: r.c1.get("mean_tpot_ms")) / med("stock", lambda r: r.c1.get("mean_tpot_ms"))
    itl1 = med("corefleet", lambda r: r.c1.median_itl_ms) / med("stock", lambda r: r.c1.median_itl_ms)
    tpot1_med = med("corefleet", lambda r: r.c1.get("median_tpot_ms")) / med(
        "stock", lambda r: r.c1.get("median_tpot_ms"))
    lpt1 = med("corefleet", lambda r: r.c1.latency_per_token_ms) / med("stock", lambda r: r.c1.latency_per_token_ms)
    floor = med("corefleet", lambda r: r.c1.get("median_ttft_ms")) - med("stock", lambda r: r.c1.get("median_ttft_ms"))
    floor_mean = med("corefleet", lambda r: r.c1.get("mean_ttft_ms")) - med("stock", lambda r: r.c1.get("mean_ttft_ms"))
    rss = med("corefleet", RoundResult.rss_total) / med("stock", RoundResult.rss_total)
    return [
        f"RATIO corefleet/stock throughput c={concurrency} = {tput:.2f} (goal >= {GOALS['throughput']:.2f}): "
        f"{verdict(tput >= GOALS['throughput'])}",
        f"RATIO corefleet/stock mean TTFT c={concurrency} = {ttft:.2f} (goal <= {GOALS['ttft']:.2f}): "
        f"{verdict(ttft <= GOALS['ttft'])}",
        f"RATIO corefleet/stock p99 TTFT c={concurrency} = {p99:.2f} (goal <= {GOALS['ttft']:.2f}): "
        f"{verdict(p99 <= GOALS['ttft'])}",
        f"RATIO corefleet/stock mean TPOT c={concurrency} = {tpot:.2f} (goal <= {GOALS['tpot']:.2f}): "
        f"{verdict(tpot <= GOALS['tpot'])}",
        f"RATIO corefleet/stock mean TPOT c=1 = {tpot1:.2f} (goal <= {GOALS['tpot']:.2f}): "
        f"{verdict(tpot1 <= GOALS['tpot'])}  [median TPOT: {tpot1_med:.2f}, median ITL: {itl1:.2f}, "
        f"latency per output token: {lpt1:.2f}]",
        f"DIFF corefleet-stock median TTFT c=1 = {floor:+.2f} ms (goal within {GOALS['c1_ttft_ms']:.0f} ms): "
        f"{verdict(abs(floor) <= GOALS['c1_ttft_ms'])}  [mean: {floor_mean:+.2f} ms]",
        f"RATIO corefleet/stock RSS at rest = {rss:.2f} (goal <= {GOALS['rss']:.2f}): {verdict(rss <= GOALS['rss'])}",
    ]


# ---- the run --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--engine", choices=local.ENGINE_KINDS, default=local.ENGINE_VLLM,
                   help="real vLLM CPU engines (default) or corefleet's engine emulator")
    p.add_argument("--ranks", "--replicas", dest="ranks", type=int, default=2, help="data-parallel ranks (default 2)")
    p.add_argument("--token-delay-ms", type=int, default=20,
                   help="the emulator's time per step (default 20: the engines, not the frontend, bound the run)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per side, run alternately (default 3)")
    p.add_argument("--concurrency", type=int, default=16, help="concurrency of the loaded run (default 16)")
    p.add_argument("--prompts", type=int, default=300, help="prompts of the loaded run (default 300)")
    p.add_argument("--floor-prompts", type=int, default=40, help="prompts of the concurrency-1 run (default 40)")
    p.add_argument("--warmup-prompts", type=int, default=16, help="concurrent warm-up completions (default 16)")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (default 32)")
    p.add_argument("--output-len", type=int, default=32, help="generated tokens, ignore_eos (default 32)")
    p.add_argument("--floor-output-len", type=int, default=224,
                   help="generated tokens of the concurrency-1 run (default 224: the per-token latency floor)")
    p.add_argument("--ready-timeout", type=float, help="seconds for a fleet to serve (default: corefleet up's)")
    p.add_argument("--state-dir", help="keep the model, the fleets' logs and the load generator's results here")
    p.add_argument("--keep-autogroups", action="store_true",
                   help="leave kernel.sched_autogroup_enabled as it is (default: 0 while the fleets run, restored)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if min(args.ranks, args.rounds, args.concurrency, args.prompts, args.floor_prompts, args.warmup_prompts,
           args.input_len, args.output_len, args.floor_output_len) < 1 or args.token_delay_ms < 0:
        print("--ranks, --rounds, --concurrency, the prompt counts and lengths must be positive", file=sys.stderr)
        return 2
    if args.input_len + max(args.output_len, args.floor_output_len) > 256:
        print("--input-len + --output-len (and --floor-output-len) must fit the tiny model's 256 tokens",
              file=sys.stderr)
        return 2
    return run_in_state_dir("bench_fleet", args.state_dir, lambda state, started: _run(args, state, started))


def _run(args: argparse.Namespace, state: Path, started: float) -> int:
    cf_state = state / "corefleet"
    # The model `corefleet up` would write into its state directory, written first so that stock serves the same one.
    model = str(write_tiny_model(cf_state / local.MODEL_DIR / SERVED_NAME))
    flags = (*VLLM_CPU_FLAGS, "--served-model-name", SERVED_NAME)
    cores = len(os.sched_getaffinity(0))
    autogroup_on = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() \
        if Path("/proc/sys/kernel/sched_autogroup_enabled").exists() else "n/a"
    what = (f"{args.ranks} real vLLM CPU engines" if args.engine == local.ENGINE_VLLM else
            f"{args.ranks} emulated engines (--token-delay-ms {args.token_delay_ms})")
    log(f"{what} per side on {cores} CPU cores (sched_autogroup_enabled={autogroup_on}); {args.rounds} round(s) per "
        f"side; vllm bench serve c={args.concurrency} x {args.prompts} ({args.input_len} in / {args.output_len} out "
        f"tokens) and c=1 x {args.floor_prompts} ({args.input_len} in / {args.floor_output_len} out); model {model}")
    results: list[RoundResult] = []
    with autogroups_off(not args.keep_autogroups) as scheduling:
        log(f"autogroup scheduling while the fleets run: {scheduling}")
        for rnd in range(1, args.rounds + 1):
            for side_name in side_order(rnd):
                out = state / f"{side_name}-{rnd}"
                out.mkdir(parents=True, exist_ok=True)
                log(f"round {rnd}: starting the {side_name} fleet (load average {os.getloadavg()[0]:.2f})")
                fleet = (stock_fleet(args, out, model, flags) if side_name == "stock" else
                         corefleet_fleet(args, cf_state, model, rnd))
                with fleet as side:
                    res = measure(side, args, model, out, rnd)
                results.append(res)
                log(describe(res, args.concurrency))

    print()
    print("details:")
    print(f"  machine: {cores} CPU cores ({_cpu_model()}), "
          f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB; vLLM {_vllm_version()}; "
          f"kernel.sched_autogroup_enabled={autogroup_on}; {datetime.now().isoformat(timespec='minutes')}")
    print(f"  {what}; vLLM flags {' '.join(flags)}; each side's processes in one session")
    for r in results:
        print("  " + describe(r, args.concurrency))
    for side_name in SIDES:
        rs = [r for r in results if r.side == side_name]
        groups = {len(r.autogroups) for r in rs}
        print(f"  {side_name}: autogroups per round {[len(r.autogroups) for r in rs]}"
              + ("" if groups <= {0, 1} else "  NOTE: more than one autogroup: the kernel shares the cores between "
                 "them before threads (issue 10)"))
        if rs and rs[-1].bindings:
            print(f"  {side_name} OpenMP binding (last round):")
            for b in rs[-1].bindings:
                print(f"    {b}")
    print()
    for line in report(results, args, started):
        print(line)
    print()
    print(f"corefleet fleet benchmark: {what}, vllm bench serve random, c={args.concurrency} x {args.prompts} of "
          f"{args.input_len}/{args.output_len} tokens and c=1 x {args.floor_prompts} of "
          f"{args.input_len}/{args.floor_output_len}, {args.rounds} round(s) per side")
    for line in figures(results, args.concurrency):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
