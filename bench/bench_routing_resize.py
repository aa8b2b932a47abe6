# SPDX-License-Identifier: Apache-2.0
"""Prefix-affinity's cache hits through an in-place resize 2 -> 3 -> 2 under multi-turn chat.

    flock /tmp/corefleet-heavy.lock .venv/bin/python bench/bench_routing_resize.py [--state-dir DIR]

corefleet only (stock vLLM cannot resize a running fleet): `corefleet up --replicas 2` with `--routing
prefix-affinity`, `bench_routing`'s model and vLLM flags (a KV cache of `--kv-tokens`, 8192, a rank: each
rank holds its share of the conversations at 2 and at 3) plus `--enable-prompt-tokens-details`, so that
each response says how many of its prompt tokens its rank's prefix cache served. `--conversations` clients chat (pausing
`--think-ms` on average before each turn), each conversation `--turns` turns of `--user-tokens` new
tokens and the server's own reply (`bench_routing`'s workload (a)); a finished conversation is followed
by a new one in its slot. After `--steady` requests, `corefleet scale 3`; once it has returned and
`--steady` more requests completed, `corefleet scale 2`; then `--steady` more.

Per request: cached prompt tokens (vLLM's `usage.prompt_tokens_details.cached_tokens`) against its ideal
(the block-aligned part of the prompt that the conversation's previous turn computed). The figure: for
each step, the hit rate over the `--steady` requests before it (hits / ideal, steady state), then the
same over consecutive buckets of `--bucket` requests from the moment the resize returned, and after how
many requests every bucket is within 10 % of steady state again (goal: 100).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import bench_fleet
import bench_routing
from bench_frontend import BenchError, log, run_in_state_dir
from corefleet_harness import local

GOAL_REQUESTS = 100
GOAL_WITHIN = 0.10


@dataclass
class Done:
    """One request, in the order requests completed."""

    conv: int
    turn: int
    prompt_len: int
    ideal: int
    cached: int
    ranks: int  # the fleet's size when it completed (as far as the driver knows: the last resize that returned)
    error: str = ""


class Driver:
    """Conversations until `stop`; every completed request in `done`, in completion order."""

    def __init__(self, base: str, args: argparse.Namespace, block: int) -> None:
        self.url = f"{base}/v1/completions"
        self.args = args
        self.block = block
        self.done: list[Done] = []
        self.ranks = 2
        self.stop = asyncio.Event()
        self._next_conv = 0

    async def slot(self, session: Any) -> None:
        args = self.args
        while not self.stop.is_set():
            conv = self._next_conv
            self._next_conv += 1
            rng = random.Random(f"{args.seed}-resize-conversation-{conv}")
            think = random.Random(f"{args.seed}-resize-think-{conv}")
            history: list[int] = []
            computed = 0
            for turn in range(1, args.turns + 1):
                if args.think_ms > 0:
                    await asyncio.sleep(think.expovariate(1000 / args.think_ms))
                if self.stop.is_set():
                    return
                prompt = history + bench_routing._rand_tokens(rng, args.user_tokens)
                if len(prompt) + args.output_tokens > args.context:
                    break
                ideal = 0 if turn == 1 else min(bench_routing.block_floor(computed, self.block),
                                                bench_routing.block_floor(len(prompt) - 1, self.block))
                try:
                    streamed = await bench_routing.stream_completion(session, self.url, prompt, args.output_tokens,
                                                                     usage=True)
                    if streamed.cached is None:
                        raise BenchError("no prompt token details in the usage (--enable-prompt-tokens-details?)")
                    ids, cached = streamed.ids, streamed.cached
                except (TimeoutError, BenchError, ValueError, OSError) as e:
                    self.done.append(Done(conv, turn, len(prompt), ideal, 0, self.ranks, f"{type(e).__name__}: {e}"))
                    break  # the conversation ends; nothing of it is known to be cached
                self.done.append(Done(conv, turn, len(prompt), ideal, cached, self.ranks))
                computed = len(prompt) + len(ids) - 1
                history = prompt + ids

    async def until(self, count: int, deadline_s: float) -> None:
        deadline = time.monotonic() + deadline_s
        while len(self.done) < count:
            if time.monotonic() > deadline:
                raise BenchError(f"only {len(self.done)} of {count} requests completed within {deadline_s:.0f}s")
            await asyncio.sleep(0.05)


def _scale(state: Path, replicas: int, timeout: float) -> float:
    started = time.monotonic()
    proc = subprocess.run([str(bench_fleet.BIN / "corefleet"), "scale", str(replicas), "--state-dir", str(state)],
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise BenchError(f"corefleet scale {replicas} failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
    return time.monotonic() - started


async def drive(side: bench_fleet.Side, args: argparse.Namespace,
                block: int) -> tuple[list[Done], list[dict[str, Any]]]:
    import aiohttp  # installed with vLLM

    driver = Driver(side.base, args, block)
    steps: list[dict[str, Any]] = []
    assert side.state_dir is not None
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        slots = [asyncio.create_task(driver.slot(session)) for _ in range(args.conversations)]
        try:
            await driver.until(args.steady, args.deadline)
            for replicas in (3, 2):
                before = len(driver.done)
                log(f"{before} requests done; corefleet scale {replicas}")
                took = await asyncio.to_thread(_scale, side.state_dir, replicas, args.deadline)
                driver.ranks = replicas
                at = len(driver.done)
                log(f"  scaled to {replicas} in {took:.1f}s ({at - before} requests completed meanwhile)")
                steps.append({"to": replicas, "started_at": before, "returned_at": at, "seconds": took})
                await driver.until(at + args.steady, args.deadline)
        finally:
            driver.stop.set()
            await asyncio.gather(*slots, return_exceptions=True)
    return driver.done, steps


def ratio(done: list[Done]) -> float:
    ideal = sum(d.ideal for d in done)
    return sum(min(d.cached, d.ideal) for d in done) / ideal if ideal else float("nan")


def recovery(done: list[Done], step: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    steady = ratio(done[max(0, step["started_at"] - args.steady):step["started_at"]])
    after = done[step["returned_at"]:step["returned_at"] + args.steady]
    buckets = [ratio(after[i:i + args.bucket]) for i in range(0, len(after), args.bucket)]
    during = ratio(done[step["started_at"]:step["returned_at"]])
    ok = [b >= (1 - GOAL_WITHIN) * steady for b in buckets]
    back = next((i for i in range(len(ok)) if all(ok[i:])), None)
    return {"to": step["to"], "steady": steady, "during": during, "buckets": buckets,
            "recovered_after": None if back is None else back * args.bucket}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=8, help="clients, each chatting (default 8)")
    p.add_argument("--turns", type=int, default=8, help="turns per conversation (default 8)")
    p.add_argument("--user-tokens", type=int, default=128, help="new tokens a turn (default 128)")
    p.add_argument("--output-tokens", type=int, default=32, help="reply tokens a turn (default 32)")
    p.add_argument("--think-ms", type=float, default=500.0, help="mean pause before each turn (default 500)")
    p.add_argument("--omp-bind", default="nobind",
                   help="VLLM_CPU_OMP_THREADS_BIND of every rank (default nobind: the OS places the OpenMP threads). "
                        "'' keeps local mode's binding (every rank on core 0 of 2 cores): there, the new rank's "
                        "engine core sat for minutes in sched_setaffinity onto core 0, where the serving ranks' "
                        "workers spin, and the scale-up failed at its 420 s join timeout (2026-12-05)")
    p.add_argument("--steady", type=int, default=200, help="requests before, between and after the steps (200)")
    p.add_argument("--bucket", type=int, default=25, help="requests per bucket after a step (default 25)")
    p.add_argument("--deadline", type=float, default=600.0, help="seconds each phase may take (default 600)")
    bench_routing.add_model_args(p)
    p.add_argument("--kv-tokens", type=int, default=8192, help="KV cache per rank in tokens (default 8192)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, help="seconds for the fleet to serve (default: corefleet up's)")
    p.add_argument("--state-dir", help="keep the model, the fleet's logs and the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_in_state_dir("bench_routing_resize", args.state_dir, lambda state, started: _run(args, state))


def _run(args: argparse.Namespace, state: Path) -> int:
    shape = bench_routing.shape_of(args)
    model = str(bench_routing.write_model(state / "models" / "routing-llama", shape).absolute())
    flags = (*bench_routing.vllm_flags(shape, args.kv_tokens * shape.kv_bytes_per_token(), args.max_num_seqs),
             "--enable-prompt-tokens-details")
    log(f"model: {shape.describe()}; KV cache {args.kv_tokens} tokens a rank; {args.conversations} conversations "
        f"x {args.turns} turns of {args.user_tokens} + {args.output_tokens} tokens, {args.think_ms:g} ms pauses")
    fleet_args = argparse.Namespace(ranks=2, engine=local.ENGINE_VLLM, ready_timeout=args.ready_timeout,
                                    token_delay_ms=0)
    env = {bench_routing.ROUTING_ENV: "prefix-affinity"}
    if args.omp_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_bind
    with bench_fleet.corefleet_fleet(fleet_args, state / "corefleet", model, 1, flags, env) as side:
        block = int(bench_routing.cache_info(bench_routing.scrape(side.base)).get("block_size", 0) or 0)
        if block <= 0:
            raise BenchError("the fleet's /metrics has no vllm:cache_config_info block_size")
        done, steps = asyncio.run(drive(side, args, block))
    errors = [d for d in done if d.error]
    results = [recovery(done, step, args) for step in steps]
    print()
    print(f"prefix-affinity through 2 -> 3 -> 2, {len(done)} requests ({len(errors)} failed), block {block}:")
    for step, res in zip(steps, results, strict=True):
        buckets = "  ".join(f"{b:.2f}" for b in res["buckets"])
        back = res["recovered_after"]
        verdict = "PASS" if back is not None and back <= GOAL_REQUESTS else "FAIL"
        print(f"  -> {res['to']} ranks (resize took {step['seconds']:.1f}s, {step['returned_at'] - step['started_at']}"
              f" requests during it): hits / ideal steady {res['steady']:.2f}, during {res['during']:.2f}; after, per "
              f"{args.bucket} requests: {buckets}")
        print(f"     every bucket within {GOAL_WITHIN:.0%} of steady after {back} requests (<= {GOAL_REQUESTS}: "
              f"{verdict})")
    for d in errors[:5]:
        print(f"  failed: conversation {d.conv} turn {d.turn}: {d.error}")
    (state / "bench_routing_resize.json").write_text(json.dumps(
        {"steps": steps, "results": results, "requests": [asdict(d) for d in done]}, indent=1))
    log(f"results: {state / 'bench_routing_resize.json'}")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
