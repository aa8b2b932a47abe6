# SPDX-License-Identifier: Apache-2.0
"""Frontend overhead: corefleet's frontend against the stock vLLM frontend, requests/s under the same load.

    flock /tmp/corefleet-heavy.lock .venv/bin/python bench/bench_frontend.py \\
        [--duration 15] [--concurrency 32] [--rounds 4] [--max-tokens 16]

Both sides are one API-server process (vLLM's `run_server`) over 2 emulated engines
(`python -m corefleet_harness.emulator --token-delay-ms 0`), so the engines cost next to nothing
and what limits requests/s is the frontend's own work per request: HTTP, tokenizing, routing
(`get_core_engine_for_request`), bookkeeping, output processing and detokenizing. It does not
measure real engines, how the fleet's processes are placed (sessions, process groups, CPU
binding) or the engines' competition with the frontend for the cores: see `bench_fleet.py`.

* stock: `vllm serve MODEL --data-parallel-size 2 --data-parallel-size-local 0 --api-server-count 1
  ...`: vLLM's DPLB client, which starts its own DP coordinator (a child process), and waits for the
  two headless engines' handshake;
* corefleet: `corefleet_harness.local.start(engine="emulator")`: the standalone coordinator,
  `python -m corefleet_client.frontend` (vLLM's API server over corefleet's `KubeDPLBClient`, plus
  the admin API) and the engines.

The engines run the same command line on both sides (`local.engine_argv`), the same tiny model
(`tinymodel.write_tiny_model`) and the same vLLM flags (`VLLM_CPU_FLAGS`). `--api-server-count 1`
makes the stock frontend one API-server process like corefleet's (vLLM otherwise starts one per DP
rank).

The load is closed-loop: a separate process (so that its CPU does not count as the frontend's,
though it shares the cores) runs `--concurrency` asyncio workers, each sending non-streaming
`/v1/completions` (`max_tokens`, `ignore_eos`) one after another; after `--warmup` seconds it
counts the requests that complete within the next `--duration` seconds. The sides run one at a
time, alternately and in ABBA order (stock, corefleet, corefleet, stock, ... for `--rounds`: each side goes
first as often as the other: in runs of 2026-12-05 the first round, always stock's, often served 25-40% more
than every later one of either side), each round on a freshly started fleet that is stopped before
the next one starts. Both sides' fleet processes lead their own process groups in the benchmark's session (the
stock processes once had sessions of their own, corefleet's `local` ones shared the benchmark's: with the
kernel's autogroups that is not the same CPU scheduling); the load generator has its own session on both sides.
The kernel's autogroup scheduling is off while the fleets run (`autogroups_off`, restored afterwards;
`--keep-autogroups` leaves it on): with it on, the load generator's session gets as much CPU as the whole fleet's
on 2 busy cores, whatever either needs (bench_fleet.py's docstring has what that did to a client's reads).
The frontends have cores of their own (`--pin`, the default on a machine of 2 cores or more): the K frontend processes
on the last min(K, n - 1) of the n cores, every other process (engines, coordinator, the load generator) on the
others, the same on both sides; `--no-pin` leaves the placement to the kernel. In a cluster a frontend is a pod with
its own CPU request; left to the kernel on 2 cores, the frontend shares a core with the engines and the load generator
for part of each round, and the share differs from one fresh process to the next. Measured on 2026-12-05 (2 cores, 3-4
rounds per variant, K=1): unpinned, the frontend's CPU per request ranged from 1.35 to 2.05 ms across fresh processes
of the same side (req/s 504-763), the gap between the sides from 0.97x to 0.89x; pinned, 1.03-1.11 ms on both sides,
about 930 req/s each, whichever went first.
Besides requests/s, each round samples
CPU time per process over the measured window: the frontend's CPU milliseconds per request are
the least noisy figure on a shared machine.

Rounds matter more than duration: unpinned on a 2-core VM, one fleet's requests/s is steady within its window
but differs by up to ~15% from one freshly started frontend process to the next (either side), so
the default is 4 rounds of 15 s per side rather than 2 of 30 s.

The figure: RATIO corefleet/stock requests/s (medians over the rounds; goal >= 1.0). The exit
status is non-zero only on errors (a fleet that does not come up, failed requests), never on a
missed goal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from corefleet_harness import local
from corefleet_harness.local import LOCALHOST, FleetOptions, LocalFleet, LocalFleetError, Ports
from corefleet_harness.support import WaitTimeout, free_ports, http_get, tail, wait_until
from corefleet_harness.tinymodel import VLLM_CPU_FLAGS, write_tiny_model

REPLICAS = 2
SERVED_NAME = "tiny-llama"
PROMPT = "Hello, world! How are you today? The quick brown fox jumps over the lazy dog, request"
READY_TIMEOUT = 300.0  # two emulators and a frontend importing vLLM on 2 busy cores
STOP_GRACE = 20.0
REQUEST_TIMEOUT = 60.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
SIDES = ("stock", "corefleet")
AUTOGROUP_SWITCH = Path("/proc/sys/kernel/sched_autogroup_enabled")


@dataclass(frozen=True)
class CoreSplit:
    """Where the processes run (`--pin`): the frontends on `frontends`, everything else (the engines, the
    coordinator, the load generator, this process) on `rest`; None: wherever the kernel puts them."""

    frontends: frozenset[int]
    rest: frozenset[int]

    def describe(self) -> str:
        return f"the frontend process(es) on CPU {_cpus(self.frontends)}, every other process on CPU {_cpus(self.rest)}"


def _cpus(cores: frozenset[int]) -> str:
    return ",".join(map(str, sorted(cores)))


def core_split(cores: Iterable[int], frontends: int) -> CoreSplit | None:
    """The last min(K, n - 1) of the n cores for the K frontends, the others for the rest; None on one core."""
    ordered = sorted(cores)
    n = min(frontends, len(ordered) - 1)
    if n < 1:
        return None
    return CoreSplit(frontends=frozenset(ordered[-n:]), rest=frozenset(ordered[:-n]))


def pin_process(pid: int, cores: frozenset[int]) -> None:
    """Every thread of `pid` on `cores` (threads it starts later inherit their creator's)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cores)


def pin_fleet(fleet: Fleet, split: CoreSplit) -> None:
    """The fleet's frontend processes on the split's frontend cores, its other processes on the rest."""
    for role, pids in fleet.roles.items():
        for pid in pids:
            pin_process(pid, split.frontends if role == "frontend" else split.rest)


@contextlib.contextmanager
def pinned(fleet: Fleet, split: CoreSplit | None) -> Iterator[None]:
    """The fleet pinned (`pin_fleet`), and this process (so the load generator it starts) on the rest, inside; this
    process's own cores again after. Nothing where `split` is None."""
    if split is None:
        yield
        return
    pin_fleet(fleet, split)
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, split.rest)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)


def side_order(rnd: int) -> tuple[str, ...]:
    """ABBA: round 1 stock first, round 2 corefleet first, ... (each side first in half the rounds)."""
    return SIDES if rnd % 2 else SIDES[::-1]


class BenchError(RuntimeError):
    """Something went wrong (not a missed goal): the benchmark exits non-zero."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- the load generator (its own process: `bench_frontend.py --loadgen URL ...`) -------------------
async def _load(url: str, model: str, concurrency: int, warmup: float, duration: float,
                max_tokens: int, stream: bool = False) -> dict[str, Any]:
    import aiohttp  # installed with vLLM

    loop = asyncio.get_running_loop()
    t_start = loop.time() + warmup
    t_end = t_start + duration
    latencies: list[float] = []
    ttfts: list[float] = []  # streaming: time to the first token
    tpots: list[float] = []  # streaming: time per output token after the first
    events: list[int] = []  # streaming: the token events (SSE chunks with a choice) of each request
    errors: list[str] = []
    counter = 0
    headers = {"Content-Type": "application/json"}

    async def streamed(resp: Any, t0: float) -> tuple[str | None, float, float, int]:
        """Read an SSE completion; (error, TTFT, TPOT) as `vllm bench serve` defines them: the first chunk with a
        choice (the tiny model's tokens may decode to no text), and (end - first) / (max_tokens - 1)."""
        first = None
        finish = None
        chunks = 0
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                return f"error event: {event['error']}", 0.0, 0.0, 0
            chunks += 1 if event.get("choices") else 0
            for choice in event.get("choices", ()):
                first = first if first is not None else loop.time()
                finish = choice.get("finish_reason") or finish
        end = loop.time()
        if first is None or finish != "length":
            return f"stream ended without its tokens (finish_reason {finish})", 0.0, 0.0, 0
        return None, first - t0, (end - first) / max(1, max_tokens - 1), chunks

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal counter
        while (t0 := loop.time()) < t_end:
            counter += 1
            body = json.dumps({"model": model, "prompt": f"{PROMPT} {counter}", "max_tokens": max_tokens,
                               "ignore_eos": True, "temperature": 0.0, "stream": stream}).encode()
            error = None
            ttft = tpot = 0.0
            chunks = 0
            try:
                async with session.post(url, data=body, headers=headers) as resp:
                    if resp.status != 200:
                        error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                    elif stream:
                        error, ttft, tpot, chunks = await streamed(resp, t0)
                    else:
                        got = json.loads(await resp.read())["usage"]["completion_tokens"]
                        if got != max_tokens:
                            error = f"{got} completion tokens, expected {max_tokens}"
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as e:
                error = f"{type(e).__name__}: {e}"
            t1 = loop.time()
            if t_start <= t1 <= t_end:  # completed within the window (it may have started in the warm-up)
                if error is None:
                    latencies.append(t1 - t0)
                    if stream:
                        ttfts.append(ttft)
                        tpots.append(tpot)
                        events.append(chunks)
                else:
                    errors.append(error)

    async def marks() -> None:
        await asyncio.sleep(max(0.0, t_start - loop.time()))
        print("WINDOW_START", flush=True)  # the parent samples CPU times now
        await asyncio.sleep(max(0.0, t_end - loop.time()))
        print("WINDOW_END", flush=True)

    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(marks(), *(worker(session) for _ in range(concurrency)))
    latencies.sort()
    ttfts.sort()
    tpots.sort()
    return {
        "completed": len(latencies),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:5],
        "seconds": duration,
        "p50_ms": 1000 * _quantile(latencies, 0.50),
        "p99_ms": 1000 * _quantile(latencies, 0.99),
        "ttft_p50_ms": 1000 * _quantile(ttfts, 0.50),
        "ttft_p99_ms": 1000 * _quantile(ttfts, 0.99),
        "tpot_p50_ms": 1000 * _quantile(tpots, 0.50),
        "tpot_p99_ms": 1000 * _quantile(tpots, 0.99),
        "events_per_request": statistics.fmean(events) if events else float("nan"),
        "sent": counter,
    }


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def loadgen_main(args: argparse.Namespace) -> int:
    import uvloop  # installed with vLLM: the cheapest event loop for the client too

    result = uvloop.run(_load(args.loadgen, SERVED_NAME, args.concurrency, args.warmup, args.duration,
                              args.max_tokens, args.stream))
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# ---- processes, CPU and memory -------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), or 0 if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    rest = raw[raw.rindex(")") + 2:].split()  # rest[N - 3] is field N
    return (int(rest[11]) + int(rest[12])) / CLK_TCK


def rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) in MiB, or NaN if the process is gone."""
    fields = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    return fields.get("VmRSS", float("nan")), fields.get("VmHWM", float("nan"))


def children(pid: int) -> list[int]:
    """Every descendant of `pid` (the stock frontend's DP coordinator, vLLM helper processes)."""
    procs = local.all_procs()
    kids: dict[int, list[int]] = {}
    for p in procs:
        kids.setdefault(p.ppid, []).append(p.pid)
    out, todo = [], list(kids.get(pid, ()))
    while todo:
        cur = todo.pop()
        out.append(cur)
        todo.extend(kids.get(cur, ()))
    return out


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy since boot (/proc/stat: all but idle and iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(values) - values[3] - values[4]) / CLK_TCK


def post_completion(base: str, max_tokens: int) -> dict[str, Any]:
    body = json.dumps({"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": max_tokens,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
        result: dict[str, Any] = json.loads(r.read())
    return result


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path


@dataclass
class Fleet:
    """One side's running fleet: where to send requests and which process plays which role."""

    side: str
    base: str  # http://127.0.0.1:PORT
    frontend_pid: int
    health_ports: tuple[int, ...]
    roles: dict[str, list[int]] = field(default_factory=dict)  # role -> pids, sampled for CPU
    logs: dict[str, Path] = field(default_factory=dict)
    frontends: int = 1  # API-server processes (stock --api-server-count, corefleet --frontends)


class StockFleet:
    """`vllm serve` (internal DP load balancing, no local engine) plus the emulated engines.

    Each process runs in its own session; stopping sends SIGTERM to each process group and
    SIGKILL to what is left after a grace period. The pids are this process's unreaped children,
    so none can be recycled meanwhile.
    """

    def __init__(self, work: Path, model: str, flags: tuple[str, ...], token_delay_ms: int,
                 api_servers: int = 1) -> None:
        self.work = work
        self.api_servers = api_servers
        self.procs: list[Proc] = []
        http, rpc, h0, h1 = free_ports(4)
        self.ports = Ports(http=http, admin=0, rpc=rpc, coord_front_publish=0, coord_back_output=0,
                           coord_back_publish=0, health=(h0, h1))
        py = sys.executable
        self.plan = [("frontend", [
            py, "-m", "vllm.entrypoints.cli.main", "serve", model,
            "--data-parallel-size", str(REPLICAS), "--data-parallel-size-local", "0",
            "--data-parallel-address", LOCALHOST, "--data-parallel-rpc-port", str(rpc),
            "--api-server-count", str(api_servers), "--host", LOCALHOST, "--port", str(http), *flags,
        ])] + [(f"engine-{r}", local.engine_argv(py, local.ENGINE_EMULATOR, model, REPLICAS, r, self.ports, flags,
                                                 token_delay_ms=token_delay_ms)) for r in range(REPLICAS)]

    def start(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        for name, argv in self.plan:
            log_path = self.work / f"{name}.log"
            with log_path.open("wb") as logf:
                # Its own process group in the benchmark's session, as `local.start` runs corefleet's processes.
                p = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"}, process_group=0)
            self.procs.append(Proc(name, p, log_path))

    def wait_ready(self, timeout: float) -> None:
        """The frontend's /health is 200 (vLLM serves HTTP only after every engine's handshake) and
        each engine's /readyz is 200; fail at once with the log tail of a process that exits."""
        last = "nothing checked yet"
        not_ready: list[int] = []

        def ready() -> bool:
            nonlocal last, not_ready
            for p in self.procs:
                if p.popen.poll() is not None:
                    raise BenchError(f"stock {p.name} exited with {p.popen.returncode} before the fleet was ready; "
                                     f"last lines of {p.log}:\n{tail(p.log)}")
            not_ready = [r for r, port in enumerate(self.ports.health)
                         if http_get(f"http://{LOCALHOST}:{port}/readyz", 2, unanswered_ok=True)[0] != 200]
            if http_get(f"http://{LOCALHOST}:{self.ports.http}/health", 2, unanswered_ok=True)[0] == 200 \
                    and not not_ready:
                return True
            last = f"engines not ready: {not_ready}" if not_ready else "the frontend's /health is not 200 yet"
            return False

        try:
            wait_until(ready, timeout, "the stock fleet ready", interval=local.POLL_SECONDS)
        except WaitTimeout:
            slow = self.procs[1 + not_ready[0]] if not_ready else self.procs[0]
            raise BenchError(f"the stock fleet was not ready within {timeout:.0f} s ({last}); last lines of "
                             f"{slow.log}:\n{tail(slow.log)}") from None

    def fleet(self) -> Fleet:
        fe = self.procs[0].popen.pid
        kids = children(fe)
        if self.api_servers == 1:  # one API server: the `vllm serve` process itself; its child, the coordinator
            frontends, coordinator = [fe], kids
        else:  # vLLM's API servers are child processes (titled APIServer_i) beside the coordinator (DPCoordinator)
            wait_until(lambda: len(_titled(children(fe), "APIServer")) == self.api_servers, 30,
                       "the stock API server processes")
            kids = children(fe)
            frontends = [fe, *_titled(kids, "APIServer")]
            coordinator = [pid for pid in kids if pid not in frontends]
        return Fleet(side="stock", base=f"http://{LOCALHOST}:{self.ports.http}", frontend_pid=fe,
                     health_ports=self.ports.health,
                     roles={"frontend": frontends, "coordinator": coordinator,
                            **{p.name: [p.popen.pid] for p in self.procs[1:]}},
                     logs={p.name: p.log for p in self.procs}, frontends=self.api_servers)

    def stop(self) -> None:
        def live() -> list[Proc]:
            alive = []
            for p in self.procs:
                p.popen.poll()  # reap the leader, so that a finished group reads as gone
                try:
                    os.killpg(p.popen.pid, 0)
                except ProcessLookupError:
                    continue
                alive.append(p)
            return alive

        for sig, grace in ((signal.SIGTERM, STOP_GRACE), (signal.SIGKILL, 10.0)):
            todo = live()
            for p in todo:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, sig)
            deadline = time.monotonic() + grace
            while todo and time.monotonic() < deadline:
                time.sleep(0.1)
                todo = live()
            if not todo:
                return
        raise BenchError("stock fleet processes survived SIGKILL: " + ", ".join(p.name for p in live()))


def _titled(pids: list[int], title: str) -> list[int]:
    """The processes whose command line (vLLM's process title) contains `title`."""
    return [pid for pid in pids if title in " ".join(local.proc_cmdline(pid) or ())]


def corefleet_fleet(fleet: LocalFleet) -> Fleet:
    rec = fleet.record
    by_role = {p.name: p for p in rec.processes}
    fe = by_role[local.ROLE_FRONTEND].pid
    coord = by_role[local.ROLE_COORDINATOR].pid
    frontends = [p.pid for p in rec.processes if p.role == local.ROLE_FRONTEND]
    roles = {"frontend": frontends, "frontend-children": [kid for pid in frontends for kid in children(pid)],
             "coordinator": [coord, *children(coord)]}
    roles |= {f"engine-{r}": [by_role[f"engine-{r}"].pid] for r in range(rec.replicas)}
    return Fleet(side="corefleet", base=rec.endpoint.removesuffix("/v1"), frontend_pid=fe,
                 health_ports=rec.ports.health, roles=roles, logs={p.name: Path(p.log) for p in rec.processes},
                 frontends=rec.frontends)


@contextlib.contextmanager
def running(side: str, work: Path, model: str, flags: tuple[str, ...], token_delay_ms: int,
            frontends: int = 1) -> Iterator[Fleet]:
    """A fleet of `side` with `frontends` API-server processes, started, ready and checked with one completion;
    stopped on the way out."""
    t0 = time.monotonic()
    if side == "stock":
        stock = StockFleet(work, model, flags, token_delay_ms, api_servers=frontends)
        try:
            stock.start()
            stock.wait_ready(READY_TIMEOUT)
            fleet = stock.fleet()
            yield _checked(fleet, t0)
        finally:
            stock.stop()
        return
    opts = FleetOptions(replicas=REPLICAS, engine=local.ENGINE_EMULATOR, model=model, vllm_flags=flags,
                        port=free_ports(1)[0], state_dir=work, token_delay_ms=token_delay_ms, frontends=frontends)
    cf: LocalFleet | None = None
    try:
        try:
            cf = local.start(opts)
            cf.wait_ready(READY_TIMEOUT)
        except LocalFleetError as e:
            raise BenchError(f"the corefleet fleet did not come up: {e}") from None
        yield _checked(corefleet_fleet(cf), t0)
    finally:
        if cf is not None:
            cf.stop()


def _checked(fleet: Fleet, t0: float) -> Fleet:
    """One completion through the frontend, so that a fleet that answers /health but not requests fails here."""
    try:
        result = post_completion(fleet.base, 4)
    except (OSError, ValueError) as e:
        raise BenchError(f"{fleet.side}: the first completion failed ({e}); frontend log tail:\n"
                         f"{tail(fleet.logs['frontend'])}") from None
    if result.get("usage", {}).get("completion_tokens") != 4:
        raise BenchError(f"{fleet.side}: unexpected first completion: {result}")
    log(f"{fleet.side}: fleet serving in {time.monotonic() - t0:.1f} s (frontend pid {fleet.frontend_pid}, "
        f"first completion ok)")
    return fleet


def engine_requests(fleet: Fleet) -> list[int]:
    """requests_added per rank, from each emulator's /stats."""
    out = []
    for port in fleet.health_ports:
        status, body = http_get(f"http://{LOCALHOST}:{port}/stats", 10, unanswered_ok=True)
        out.append(int(json.loads(body)["requests_added"]) if status == 200 else -1)
    return out


# ---- one round -----------------------------------------------------------------------------------
@dataclass
class RoundResult:
    side: str
    round: int
    frontends: int
    rps: float
    completed: int
    errors: int
    error_samples: list[str]
    p50_ms: float
    p99_ms: float
    ttft: tuple[float, float]  # streaming: p50, p99 ms (NaN without --stream)
    tpot: tuple[float, float]
    events: float  # streaming: the mean token events (SSE chunks) per request; fewer, larger ones cost less CPU
    cpu: dict[str, float]  # role -> CPU seconds in the window
    other_cpu: float  # CPU seconds of every other process on the machine in the window
    rss: tuple[float, float]  # the frontend process: (VmRSS, VmHWM) MiB after the load
    coordinator_rss: float
    per_rank: list[int]

    @property
    def fe_ms_per_req(self) -> float:
        """CPU ms of all the frontend processes together per completed request."""
        return 1000 * self.cpu["frontend"] / self.completed if self.completed else float("nan")

    @property
    def req_per_fe_cpu_s(self) -> float:
        """Completed requests per CPU second of the frontend processes (flat as K grows: no per-frontend waste)."""
        return self.completed / self.cpu["frontend"] if self.cpu["frontend"] > 0 else float("nan")


def run_load(fleet: Fleet, args: argparse.Namespace, rnd: int, logs: Path) -> RoundResult:
    argv = [sys.executable, str(Path(__file__).resolve()), "--loadgen", f"{fleet.base}/v1/completions",
            "--concurrency", str(args.concurrency), "--warmup", str(args.warmup), "--duration", str(args.duration),
            "--max-tokens", str(args.max_tokens), *(["--stream"] if args.stream else [])]
    before_ranks = engine_requests(fleet)
    err_path = logs / f"loadgen-{fleet.side}-{rnd}.log"
    result: dict[str, Any] | None = None
    samples: dict[str, dict[str, float]] = {}
    with err_path.open("wb") as errf:
        lg = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errf, stdin=subprocess.DEVNULL,
                              start_new_session=True)
        try:
            roles = {**fleet.roles, "loadgen": [lg.pid]}

            def sample() -> dict[str, float]:
                s = {role: sum(cpu_seconds(pid) for pid in pids) for role, pids in roles.items()}
                s["_machine"] = machine_busy_seconds()
                s["_t"] = time.monotonic()
                return s

            assert lg.stdout is not None
            for raw in lg.stdout:
                line = raw.decode().strip()
                if line == "WINDOW_START":
                    samples["start"] = sample()
                elif line == "WINDOW_END":
                    samples["end"] = sample()
                elif line.startswith("RESULT "):
                    result = json.loads(line.removeprefix("RESULT "))
            rc = lg.wait(REQUEST_TIMEOUT + 30)
        finally:
            if lg.poll() is None:
                os.killpg(lg.pid, signal.SIGKILL)
                lg.wait()
    if rc != 0 or result is None or set(samples) != {"start", "end"}:
        raise BenchError(f"load generator failed (exit {rc}); its stderr:\n{tail(err_path)}")
    after_ranks = engine_requests(fleet)
    start, end = samples["start"], samples["end"]
    cpu = {role: end[role] - start[role] for role in roles}
    other = (end["_machine"] - start["_machine"]) - sum(cpu.values())
    fe_rss = rss_mib(fleet.frontend_pid)
    coord_pids = fleet.roles.get("coordinator", [])
    coord_rss = sum(rss_mib(pid)[0] for pid in coord_pids)
    return RoundResult(
        side=fleet.side, round=rnd, frontends=fleet.frontends, rps=result["completed"] / result["seconds"],
        completed=result["completed"], errors=result["errors"], error_samples=result["error_samples"],
        p50_ms=result["p50_ms"], p99_ms=result["p99_ms"], ttft=(result["ttft_p50_ms"], result["ttft_p99_ms"]),
        tpot=(result["tpot_p50_ms"], result["tpot_p99_ms"]), events=result["events_per_request"], cpu=cpu,
        other_cpu=max(0.0, other), rss=fe_rss,
        coordinator_rss=coord_rss,
        per_rank=[a - b for a, b in zip(after_ranks, before_ranks, strict=True)],
    )


def describe(r: RoundResult, duration: float) -> str:
    cores = ", ".join(f"{role} {sec / duration:.2f}" for role, sec in r.cpu.items() if sec > 0.005)
    streamed = f"TTFT p50/p99 {r.ttft[0]:.0f}/{r.ttft[1]:.0f} ms  TPOT p50/p99 {r.tpot[0]:.1f}/{r.tpot[1]:.1f} ms  " \
        f"{r.events:.2f} token events/request  " if r.ttft[0] == r.ttft[0] else ""
    return (f"{r.side:<10} K={r.frontends} round {r.round}: {r.rps:7.1f} req/s  ({r.completed} ok, {r.errors} "
            f"errors)  p50 {r.p50_ms:.0f} ms  p99 {r.p99_ms:.0f} ms  {streamed}frontend CPU {r.fe_ms_per_req:.2f} "
            f"ms/req ({r.req_per_fe_cpu_s:.0f} req per frontend CPU-s)  "
            f"frontend RSS {r.rss[0]:.0f} MiB (peak {r.rss[1]:.0f})  coordinator RSS {r.coordinator_rss:.0f} MiB  "
            f"requests per rank {r.per_rank}\n"
            f"{'':<12}CPU cores used in the window: {cores}; other processes {r.other_cpu / duration:.2f}")


# ---- the run --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=15.0, help="measured seconds per round (default 15)")
    p.add_argument("--warmup", type=float, default=5.0, help="unmeasured seconds of load before each window")
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop client workers (default 32)")
    p.add_argument("--rounds", type=int, default=4, help="rounds per side, run alternately (default 4)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each completion (default 16)")
    p.add_argument("--token-delay-ms", type=int, default=0, help="the emulated engines' time per step (default 0)")
    p.add_argument("--state-dir", help="keep the model, the fleets' logs and the load generator's here")
    p.add_argument("--frontends", default="1",
                   help="API-server processes per side, a comma-separated list run in turn: stock --api-server-count "
                        "K against corefleet --frontends K (default 1)")
    p.add_argument("--stream", action="store_true",
                   help="streamed completions: TTFT and TPOT are measured too (default: non-streaming)")
    p.add_argument("--keep-autogroups", action="store_true",
                   help="leave the kernel's autogroup scheduling on while the fleets run (default: off, see "
                        "autogroups_off)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="leave every process wherever the kernel puts it (default: the K frontends on the last K "
                        "cores, at most all but one, everything else on the others; see the module docstring)")
    p.add_argument("--loadgen", metavar="URL", help=argparse.SUPPRESS)  # internal: run the load generator
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.loadgen:
        return loadgen_main(args)
    if args.duration <= 0 or args.warmup < 0 or args.concurrency < 1 or args.rounds < 1 or args.max_tokens < 1:
        print("--duration, --concurrency, --rounds and --max-tokens must be positive", file=sys.stderr)
        return 2
    try:
        args.frontend_counts = [int(k) for k in str(args.frontends).split(",")]
    except ValueError:
        args.frontend_counts = []
    if not args.frontend_counts or any(not 1 <= k <= local.MAX_FRONTENDS for k in args.frontend_counts):
        print(f"--frontends must list counts in 1..{local.MAX_FRONTENDS}, not {args.frontends!r}", file=sys.stderr)
        return 2
    return run_in_state_dir("bench_frontend", args.state_dir, lambda state, started: _run(args, state, started))


@contextlib.contextmanager
def autogroups_off(switch_off: bool = True) -> Iterator[str]:
    """`kernel.sched_autogroup_enabled` 0 inside (when `switch_off` and it was 1), restored on the way out, a SIGTERM
    included (it raises SystemExit inside); yields what the scheduling is inside, for the report. Why: bench_fleet's
    module docstring (the load generator's reads)."""
    try:
        before = AUTOGROUP_SWITCH.read_text().strip()
    except OSError:
        yield "no autogroup scheduling in this kernel"
        return
    if not switch_off or before != "1":
        yield f"kernel.sched_autogroup_enabled={before}, left as it is"
        return
    try:
        AUTOGROUP_SWITCH.write_text("0")
    except OSError as e:
        yield f"kernel.sched_autogroup_enabled=1, left as it is (cannot switch it off: {e.strerror})"
        return
    def terminated(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield "off (kernel.sched_autogroup_enabled=0, 1 again afterwards)"
    finally:
        AUTOGROUP_SWITCH.write_text(before)
        signal.signal(signal.SIGTERM, previous)


def run_in_state_dir(prog: str, state_dir: str | None, run: Callable[[Path, float], int]) -> int:
    """`run(state, started)` in `state_dir` (a temporary directory, removed afterwards, if None); a
    BenchError becomes a message and exit status 1."""
    started = time.monotonic()
    tmp = None if state_dir else tempfile.TemporaryDirectory(prefix=f"corefleet-{prog.replace('_', '-')}-")
    state = Path(tmp.name if tmp is not None else str(state_dir)).absolute()
    try:
        return run(state, started)
    except BenchError as e:
        print(f"{prog}: ERROR: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if tmp is not None:
            tmp.cleanup()


def _run(args: argparse.Namespace, state: Path, started: float) -> int:
    model = str(write_tiny_model(state / "models" / SERVED_NAME))
    flags = (*VLLM_CPU_FLAGS, "--served-model-name", SERVED_NAME)
    cores = len(os.sched_getaffinity(0))
    log(f"{REPLICAS} emulated engines (--token-delay-ms {args.token_delay_ms}) per side on {cores} CPU cores; "
        f"{args.rounds} round(s) per side, {args.warmup:g} s warm-up + {args.duration:g} s measured, "
        f"{args.concurrency} workers, max_tokens {args.max_tokens}")
    splits = {k: core_split(os.sched_getaffinity(0), k) if args.pin else None for k in args.frontend_counts}
    args.placement = {k: split.describe() if split else "wherever the kernel puts them" for k, split in splits.items()}
    for k in args.frontend_counts:
        log(f"K={k}: {args.placement[k]}")
    results: list[RoundResult] = []
    with autogroups_off(not args.keep_autogroups) as scheduling:
        log(f"the kernel's autogroup scheduling: {scheduling}")
        for rnd in range(1, args.rounds + 1):
            for k in args.frontend_counts:
                for side in side_order(rnd):
                    work = state / f"{side}-k{k}-{rnd}"
                    log(f"round {rnd}: starting the {side} fleet with {k} frontend(s) (load average "
                        f"{os.getloadavg()[0]:.2f})")
                    with running(side, work, model, flags, args.token_delay_ms, frontends=k) as fleet, \
                            pinned(fleet, splits[k]):
                        res = run_load(fleet, args, rnd, work)
                    results.append(res)
                    log(describe(res, args.duration))
    args.scheduling = scheduling
    if args.frontend_counts != [1]:
        return _report_frontends(args, results, cores, started)

    by_side = {side: [r for r in results if r.side == side] for side in SIDES}
    rps = {side: [r.rps for r in rs] for side, rs in by_side.items()}
    med = {side: statistics.median(v) for side, v in rps.items()}
    mean = {side: statistics.fmean(v) for side, v in rps.items()}
    fe_ms = {side: statistics.median(r.fe_ms_per_req for r in rs) for side, rs in by_side.items()}
    ratio = med["corefleet"] / med["stock"]
    errors = sum(r.errors for r in results)

    print()
    print("details:")
    print(f"  machine: {cores} CPU cores ({_cpu_model()}), "
          f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB; vLLM "
          f"{_vllm_version()}; Python {platform.python_version()}; {datetime.now().isoformat(timespec='minutes')}")
    print(f"  N = {REPLICAS} emulated engines (--data-parallel-size {REPLICAS}): the machine has {cores} cores, and "
          f"each side's frontend, coordinator, engines and the load generator share them (placement below)")
    print("  one API-server process per side: the stock frontend runs with --api-server-count 1 (vLLM's default "
          "would be one per DP rank); its DP coordinator is its child process")
    print("  the load generator runs in its own process (asyncio + aiohttp + uvloop), competing for the same cores; "
          "its CPU and the engines' are listed per round")
    print(f"  sides run alternately ({', '.join(f'{r.side} {r.round}' for r in results)}), one fleet at a time, "
          "each round on a freshly started fleet")
    print(f"  the kernel's autogroup scheduling: {args.scheduling}")
    print(f"  processes: {args.placement[1]}")
    for r in results:
        print("  " + describe(r, args.duration))
    if errors:
        for r in results:
            if r.errors:
                print(f"  {r.side} round {r.round} error samples: {r.error_samples}")
    print()
    stream = "streamed" if args.stream else "non-streaming"
    print(f"corefleet frontend benchmark: {args.concurrency} closed-loop workers, /v1/completions {stream}, "
          f"max_tokens {args.max_tokens}, {args.duration:g} s x {args.rounds} rounds per side")
    for side in SIDES:
        rs = by_side[side]
        print(f"{side:<10} requests/s per round {[round(x, 1) for x in rps[side]]}, median {med[side]:.1f}, "
              f"mean {mean[side]:.1f}; p50 {statistics.median(r.p50_ms for r in rs):.0f} ms, "
              f"p99 {statistics.median(r.p99_ms for r in rs):.0f} ms; frontend CPU {fe_ms[side]:.2f} ms/request; "
              f"frontend RSS {max(r.rss[0] for r in rs):.0f} MiB (peak {max(r.rss[1] for r in rs):.0f})")
    print(f"frontend CPU per request corefleet/stock = {fe_ms['corefleet'] / fe_ms['stock']:.2f}")
    print(f"ratio of means: {mean['corefleet'] / mean['stock']:.2f}")
    print(f"wall time: {time.monotonic() - started:.0f} s")
    if errors:
        print(f"NOTE: {errors} requests failed; the figures are not comparable")
    print(f"RATIO corefleet/stock requests/s = {ratio:.2f} (goal >= 1.0)  "
          f"[medians: corefleet {med['corefleet']:.1f}, stock {med['stock']:.1f} req/s]", flush=True)
    return 1 if errors else 0


def _report_frontends(args: argparse.Namespace, results: list[RoundResult], cores: int, started: float) -> int:
    """The K-frontends run: per K, each side's medians, the ratio corefleet/stock, and requests per frontend
    CPU-second against K=1's (flat within 10 %: adding frontends wastes no CPU per request)."""
    errors = sum(r.errors for r in results)
    print()
    print("details:")
    print(f"  machine: {cores} CPU cores ({_cpu_model()}); vLLM {_vllm_version()}; Python "
          f"{platform.python_version()}; {datetime.now().isoformat(timespec='minutes')}")
    print(f"  {REPLICAS} emulated engines (--token-delay-ms {args.token_delay_ms}); stock: vllm serve "
          "--api-server-count K (its API servers share one port, vLLM's DP coordinator beside them); corefleet: "
          "corefleet up --frontends K (K frontend processes sharing the port with SO_REUSEPORT, the standalone "
          "coordinator); one fleet at a time, fresh per round, sides and K alternating")
    print(f"  the kernel's autogroup scheduling: {args.scheduling}")
    for k, placement in args.placement.items():
        print(f"  processes at K={k}: {placement}")
    for r in results:
        print("  " + describe(r, args.duration))
    print()
    stream = "streamed" if args.stream else "non-streaming"
    print(f"corefleet frontends benchmark: {args.concurrency} closed-loop workers, /v1/completions {stream}, "
          f"max_tokens {args.max_tokens}, {args.duration:g} s x {args.rounds} rounds per side and K")
    base: dict[str, float] = {}
    for k in args.frontend_counts:
        med: dict[str, dict[str, float]] = {}
        for side in SIDES:
            rs = [r for r in results if r.side == side and r.frontends == k]
            med[side] = {"rps": statistics.median(r.rps for r in rs),
                         "ttft50": statistics.median(r.ttft[0] for r in rs),
                         "ttft99": statistics.median(r.ttft[1] for r in rs),
                         "tpot50": statistics.median(r.tpot[0] for r in rs),
                         "tpot99": statistics.median(r.tpot[1] for r in rs),
                         "ms": statistics.median(r.fe_ms_per_req for r in rs),
                         "eff": statistics.median(r.req_per_fe_cpu_s for r in rs)}
            base.setdefault(side, med[side]["eff"])
            m = med[side]
            print(f"K={k} {side:<10} {m['rps']:7.1f} req/s (rounds {[round(r.rps, 1) for r in rs]}); TTFT p50/p99 "
                  f"{m['ttft50']:.0f}/{m['ttft99']:.0f} ms; TPOT p50/p99 {m['tpot50']:.1f}/{m['tpot99']:.1f} ms; "
                  f"frontend CPU {m['ms']:.2f} ms/req = {m['eff']:.0f} req per frontend CPU-s "
                  f"({m['eff'] / base[side]:.2f}x K={args.frontend_counts[0]}'s)")
        flat = {side: med[side]["eff"] / base[side] for side in SIDES}
        print(f"RATIO K={k} corefleet/stock requests/s = {med['corefleet']['rps'] / med['stock']['rps']:.2f} "
              f"(goal >= 1.0); TTFT p50 {_ratio(med['corefleet']['ttft50'], med['stock']['ttft50'])}, TPOT p50 "
              f"{_ratio(med['corefleet']['tpot50'], med['stock']['tpot50'])}; req per frontend CPU-s vs "
              f"K={args.frontend_counts[0]}: corefleet {flat['corefleet']:.2f}, stock {flat['stock']:.2f} (goal: "
              f"corefleet within 0.90-1.10); corefleet's against stock's {flat['corefleet'] / flat['stock']:.2f} "
              "(where K frontends share cores, both sides lose to the sharing)", flush=True)
    print(f"wall time: {time.monotonic() - started:.0f} s")
    if errors:
        print(f"NOTE: {errors} requests failed; the figures are not comparable")
    return 1 if errors else 0


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else f"{a:.1f} ms vs {b:.1f} ms"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.machine()


def _vllm_version() -> str:
    from importlib.metadata import version

    return version("vllm")


if __name__ == "__main__":
    sys.exit(main())
