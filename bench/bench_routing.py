# SPDX-License-Identifier: Apache-2.0
"""Prefix-affinity routing: corefleet's local fleet against stock `vllm serve`, real vLLM CPU engines, prefix cache.

    flock /tmp/corefleet-heavy.lock .venv/bin/python bench/bench_routing.py [--ranks 2,4] \\
        [--sides stock,prefix-affinity,least-loaded] [--state-dir DIR]

What it measures: whether sending requests that share a prompt prefix to the same data-parallel rank (corefleet's
frontend with `COREFLEET_ROUTING=prefix-affinity`, which `corefleet up` hands to its frontend through the
environment) turns into prefix-cache hits, lower time to first token (TTFT) and more throughput than stock vLLM's
DP load balancer (least load, rotating tie-break: the turns of one conversation land on different ranks), and
that it costs nothing where nothing is shared.

Engines: `--ranks` real vLLM CPU engines a side, the same model directory and exactly the same vLLM flags on every
side, each rank's OpenMP threads on the same core on both sides (`bench_fleet._omp_bind`, local mode's
`engine_cpu`). The model (`write_model`) is a dummy-weight llama, bigger than the tests' tiny one so that a long
prefill costs many decode steps (the run measures and prints both: `calibrate`), with the tiny model's tokenizer
(`tinymodel.write_tiny_model`, copied). Prefix caching is vLLM 0.32's default; it is passed explicitly
(`--enable-prefix-caching`) and confirmed from each side's engine log. The KV cache of each rank is sized
(`--kv-cache-memory-bytes`) to `--kv-share-factor` x the workloads' working set / ranks: one rank cannot hold
the whole working set, but holds its share (with room for an uneven split) when prefixes are partitioned.

Sides (`--sides`): `stock`: `vllm serve MODEL --data-parallel-size N --api-server-count 1`
(`bench_fleet.stock_fleet`); `prefix-affinity` and `least-loaded` (a control): `corefleet up --detach --model
MODEL -- FLAGS` with `COREFLEET_ROUTING` set (`bench_fleet.corefleet_fleet`). Per N, the sides run one after the
other (the order reversed for every other N and round), each on freshly started processes, stopped before the next
starts. Each fleet runs the three workloads in turn:

(a) multi-turn chat (`chat_driver`, this process, asyncio + aiohttp): `--conversations` C concurrent
    conversations of `--turns` T turns; turn 1 is `--user-tokens` random token ids (distinct per conversation),
    turn t the previous turn's prompt + the tokens the server returned for it (`return_token_ids`) + a new user
    message of `--user-tokens` random ids. Streaming `/v1/completions` with token-id prompts (exact lengths),
    `max_tokens` `--output-tokens`, `ignore_eos`. Between a reply and the next turn the user thinks for an
    exponential time of mean `--think-ms` (500 ms; the conversations start spread over twice that), the same
    pauses on every side. With `--think-ms 0` (a closed loop) the conversations run in lockstep: every turn of
    every conversation arrives in the same burst, the first tokens of a rank's burst come out of one batched
    prefill step, and TTFT measures the burst, not the request. The ideal hit for turn t > 1 is the
    block-aligned length of what the previous turn computed (its prompt and all but its last output token), at
    most the block-aligned length of the prompt minus one token (vLLM always computes a prompt's last token).
    The kernel's autogroup scheduling is off while the fleets run (`--keep-autogroups` leaves it on), as in
    bench_fleet: with it on, a client in a session of its own (this driver, `vllm bench serve`) was left
    unscheduled while a fleet decoded and read its tokens late, on every side. Runs before 2026-12-05 had it on.
(b) shared system prompts: `vllm bench serve --dataset-name prefix_repetition` (the independent load generator,
    `bench_fleet.run_loadgen`): `--prefixes` P prefixes of `--prefix-len` tokens, each with
    `--prompts-per-prefix` different suffixes of `--suffix-len` tokens, shuffled, `--output-tokens` out, at
    concurrency `--concurrency`. Ideal: every request but the first of each prefix hits the block-aligned prefix
    (its BOS included).
(c) no sharing: `vllm bench serve --dataset-name random`, `--random-prompts` prompts of `--random-input-len`
    tokens, same output length and concurrency. Not quite without sharing: vLLM's random dataset makes each prompt
    a run of consecutive token ids from a random start, and with this model's 512-token vocabulary a few of 64
    prompts start at the same id and are the same prompt (ideal about 9 % at the defaults).
The ideal hit rates of (b) and (c) come from the load generator's own prompts (`dataset_prompts`: vLLM's
`get_samples` with the same arguments and seed, tokenized as the server does; their token counts match the
servers' query counters exactly): per prompt in order, the longest block-aligned prefix an earlier one had.

Hit rates come from vLLM's own counters on each side's API server (`/metrics`: `vllm:prefix_cache_hits_total`
and `vllm:prefix_cache_queries_total`, one series per engine), scraped before and after each workload: hits /
queries (all ranks, and per rank). A preempted request is queried again, so under cache pressure queries can
exceed the prompt tokens sent (the run prints both).

Figures (per workload and N; corefleet prefix-affinity against stock measured in the same run, so they are
comparable across runs): (a), (b): TTFT p50 ratio <= 0.5, throughput (requests/s) ratio >= 1.1, hit rate >= 90 %
of the workload's ideal; (c): throughput ratio >= 0.97, TTFT p50 ratio <= 1.05. Each printed with PASS/FAIL; the
exit status is non-zero only on errors (a fleet that does not serve, failed requests), never on a missed goal.
Everything is also written to `bench_routing.json` in the state directory.

`COREFLEET_ROUTING` is ignored by frontends that predate the routing policy: then the corefleet sides route as
before (least loaded) and the run says which routing commit, if any, the checkout has.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import bench_fleet
from bench_fleet import SERVED_NAME, Side, corefleet_fleet, run_loadgen, stock_fleet
from bench_frontend import BenchError, _cpu_model, _vllm_version, autogroups_off, log, run_in_state_dir
from corefleet_harness import local
from corefleet_harness.support import http_get
from corefleet_harness.tinymodel import VLLM_CPU_FLAGS, VOCAB_SIZE, write_tiny_model

STOCK = "stock"
ROUTINGS = ("prefix-affinity", "least-loaded")
ALL_SIDES = (STOCK, *ROUTINGS)
WORKLOADS = ("a", "b", "c")
WORKLOAD_NAMES = {"a": "(a) multi-turn chat", "b": "(b) shared system prompts", "c": "(c) random, no sharing"}
ROUTING_ENV = "COREFLEET_ROUTING"
REQUEST_TIMEOUT = 600.0
FIRST_TOKEN_ID = 3  # random prompts avoid <unk>, <s>, </s>
BF16_BYTES = 2
GOALS_SHARED = {"ttft_p50": 0.5, "throughput": 1.1, "hit_of_ideal": 0.9}
GOALS_RANDOM = {"ttft_p50": 1.05, "throughput": 0.97}
ROUTING_COMMIT = re.compile(r"^[0-9a-f]+ routing:")


# ---- the model -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    intermediate: int
    head_dim: int
    context: int

    @property
    def heads(self) -> int:
        return self.hidden // self.head_dim

    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head (no GQA here), bf16."""
        return 2 * self.layers * self.heads * self.head_dim * BF16_BYTES

    def params(self) -> int:
        attn = 4 * self.hidden * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp) + 2 * VOCAB_SIZE * self.hidden

    def describe(self) -> str:
        return (f"llama, hidden {self.hidden}, {self.layers} layers, {self.heads} heads x head_dim {self.head_dim} "
                f"(no GQA), intermediate {self.intermediate}, vocab {VOCAB_SIZE}, context {self.context}, "
                f"{self.params() / 1e6:.1f} M parameters (dummy bf16 weights), KV "
                f"{self.kv_bytes_per_token() / 1024:.1f} KiB/token")


def write_model(path: Path, shape: Shape) -> Path:
    """A dummy-weight llama of `shape` at `path`, with the tiny model's tokenizer."""
    return write_tiny_model(path, context=shape.context, shape={
        "hidden_size": shape.hidden, "num_hidden_layers": shape.layers, "intermediate_size": shape.intermediate,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.heads, "head_dim": shape.head_dim})


def vllm_flags(shape: Shape, kv_bytes: int, max_num_seqs: int) -> tuple[str, ...]:
    """`VLLM_CPU_FLAGS` with this benchmark's context, batch and KV cache, prefix caching on, the served name."""
    flags = list(VLLM_CPU_FLAGS)
    for name, value in (("--max-model-len", shape.context), ("--max-num-seqs", max_num_seqs),
                        ("--kv-cache-memory-bytes", kv_bytes)):
        flags[flags.index(name) + 1] = str(value)
    return (*flags, "--enable-prefix-caching", "--served-model-name", SERVED_NAME)


# ---- vLLM's counters on each side's API server ---------------------------------------------------
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
DECISIONS = "corefleet_frontend_rank_requests_routed_by_prefix_total"  # corefleet's frontend: affinity / spill
_SERIES = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}\s+(\S+)')


def scrape(base: str) -> str:
    status, body = http_get(f"{base}/metrics", 10, unanswered_ok=True)
    if status != 200:
        raise BenchError(f"GET {base}/metrics: {status or 'no answer'}")
    return body.decode(errors="replace")


def _by_label(text: str, metric: str, label: str) -> dict[str, float]:
    """value of `label` -> `metric` summed over its other labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SERIES.match(line)
        if m and m.group(1) == metric:
            found = re.search(rf'{label}="([^"]*)"', m.group(2))
            if found:
                out[found.group(1)] = out.get(found.group(1), 0.0) + float(m.group(3))
    return out


def per_engine(text: str, metric: str) -> dict[int, float]:
    """engine index -> value of `metric` (summed over its other labels)."""
    return {int(engine): value for engine, value in _by_label(text, metric, "engine").items()}


def decisions(text: str) -> dict[str, float]:
    """corefleet's prefix-affinity decisions (new, affinity, spill), all ranks; empty on stock."""
    return _by_label(text, DECISIONS, "decision")


def cache_info(text: str) -> dict[str, str]:
    """The labels of `vllm:cache_config_info` (block_size, num_gpu_blocks, enable_prefix_caching, ...)."""
    for line in text.splitlines():
        m = _SERIES.match(line)
        if m and m.group(1) == "vllm:cache_config_info":
            return dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
    return {}


@dataclass
class CacheCounts:
    hits: dict[int, float]
    queries: dict[int, float]
    requests: dict[int, float]  # vllm:request_success_total per engine
    decisions: dict[str, float]

    @classmethod
    def read(cls, base: str) -> CacheCounts:
        text = scrape(base)
        return cls(per_engine(text, HITS), per_engine(text, QUERIES), per_engine(text, "vllm:request_success_total"),
                   decisions(text))

    def minus(self, before: CacheCounts) -> CacheCounts:
        return CacheCounts(diff(self.hits, before.hits), diff(self.queries, before.queries),
                           diff(self.requests, before.requests),
                           {k: v - before.decisions.get(k, 0.0) for k, v in self.decisions.items()})


def diff(after: dict[int, float], before: dict[int, float]) -> dict[int, float]:
    return {e: v - before.get(e, 0.0) for e, v in after.items()}


# ---- (a): the multi-turn chat driver -------------------------------------------------------------
@dataclass
class Req:
    conv: int
    turn: int
    prompt_len: int
    ideal_hit: int
    ttft: float = float("nan")
    tpot: float = float("nan")
    out_tokens: int = 0
    error: str = ""


def _rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, VOCAB_SIZE) for _ in range(n)]


def block_floor(n: int, block: int) -> int:
    return max(0, n) // block * block


@dataclass
class Streamed:
    """One streamed completion as the client saw it."""

    ttft: float  # seconds
    tpot: float  # seconds (nan with fewer than 2 tokens)
    ids: list[int]  # the generated token ids (`return_token_ids`)
    cached: int | None = None  # prompt tokens the rank's prefix cache served (with `usage`; vLLM's
    # `--enable-prompt-tokens-details`), None where the stream said nothing of it


async def stream_completion(session: Any, url: str, prompt: list[int], max_tokens: int,
                            usage: bool = False) -> Streamed:
    """One streamed completion (token ids returned); with `usage`, the server's usage chunk is asked for too."""
    import aiohttp  # installed with vLLM

    body: dict[str, Any] = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                            "stream": True, "temperature": 0.0, "return_token_ids": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    t0 = time.monotonic()
    first = last = float("nan")
    ids: list[int] = []
    cached: int | None = None
    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)) as resp:
        if resp.status != 200:
            raise BenchError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                raise BenchError(f"stream error: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                got = choice.get("token_ids") or []
                if got:
                    now = time.monotonic()
                    if not ids:
                        first = now
                    last = now
                    ids.extend(got)
            details = (chunk.get("usage") or {}).get("prompt_tokens_details")
            if details is not None:
                cached = int(details.get("cached_tokens") or 0)
    tpot = (last - first) / (len(ids) - 1) if len(ids) > 1 else float("nan")
    return Streamed(first - t0, tpot, ids, cached)


async def _chat(base: str, conversations: int, turns: int, user_tokens: int, output_tokens: int, block: int,
                seed: int, think_s: float) -> tuple[list[Req], float]:
    import aiohttp  # installed with vLLM

    url = f"{base}/v1/completions"
    reqs: list[Req] = []

    async def conversation(session: Any, conv: int) -> None:
        rng = random.Random(f"{seed}-conversation-{conv}")
        think = random.Random(f"{seed}-think-{conv}")  # the same pauses on every side
        history: list[int] = []
        computed = 0  # tokens of this conversation whose KV the last turn computed
        for turn in range(1, turns + 1):
            if think_s > 0:  # the user reads and types (turn 1: conversations start spread out)
                await asyncio.sleep(think.uniform(0, 2 * think_s) if turn == 1 else think.expovariate(1 / think_s))
            prompt = history + _rand_tokens(rng, user_tokens)
            ideal = 0 if turn == 1 else min(block_floor(computed, block), block_floor(len(prompt) - 1, block))
            r = Req(conv=conv, turn=turn, prompt_len=len(prompt), ideal_hit=ideal)
            reqs.append(r)
            try:
                streamed = await stream_completion(session, url, prompt, output_tokens)
                r.ttft, r.tpot, ids = streamed.ttft, streamed.tpot, streamed.ids
                r.out_tokens = len(ids)
                if r.out_tokens != output_tokens:
                    raise BenchError(f"{r.out_tokens} tokens, expected {output_tokens}")
            except (TimeoutError, aiohttp.ClientError, BenchError, ValueError, KeyError) as e:
                r.error = f"{type(e).__name__}: {e}"
                ids = _rand_tokens(rng, output_tokens)  # the conversation goes on; nothing of this turn is cached
                computed = 0
                history = prompt + ids
                continue
            computed = len(prompt) + len(ids) - 1  # the last output token's KV is never computed
            history = prompt + ids

    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(conversation(session, c) for c in range(conversations)))
    return reqs, time.monotonic() - t0


def chat_driver(base: str, args: argparse.Namespace, block: int) -> tuple[list[Req], float]:
    return asyncio.run(_chat(base, args.conversations, args.turns, args.user_tokens, args.output_tokens, block,
                             args.seed, args.think_ms / 1000))


# ---- (b), (c): the load generator's own prompts, for the ideal hit rates ---------------------------
def dataset_argv(args: argparse.Namespace, workload: str) -> list[str]:
    if workload == "b":
        return ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
                "--prefix-repetition-suffix-len", str(args.suffix_len), "--prefix-repetition-num-prefixes",
                str(args.prefixes), "--prefix-repetition-output-len", str(args.output_tokens)]
    return ["--dataset-name", "random", "--random-input-len", str(args.random_input_len), "--random-output-len",
            str(args.output_tokens)]


def n_prompts(args: argparse.Namespace, workload: str) -> int:
    return int(args.prefixes * args.prompts_per_prefix if workload == "b" else args.random_prompts)


def dataset_prompts(model: str, dataset: list[str], n: int, seed: int) -> list[list[int]]:
    """The prompts `vllm bench serve` sends with these dataset arguments (its own `get_samples`, same seed), in
    its order, as token ids the way the server tokenizes a completion's text (BOS added). Note: vLLM's random
    dataset makes each prompt a run of consecutive token ids from a random start, and with this model's 512-token
    vocabulary two prompts of 64 often start alike: "random" prompts then share whole prefixes."""
    from vllm.benchmarks.datasets import get_samples
    from vllm.benchmarks.serve import add_cli_args
    from vllm.tokenizers import get_tokenizer
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    ns = parser.parse_args(["--model", SERVED_NAME, "--tokenizer", model, *dataset, "--num-prompts", str(n),
                            "--seed", str(seed)])
    tokenizer = get_tokenizer(model)
    return [list(tokenizer.encode(r.prompt)) for r in get_samples(ns, tokenizer)]


def ideal_hits(prompts: list[list[int]], block: int) -> int:
    """Prompt tokens a perfect cache would serve: per prompt, in order, the longest block-aligned prefix (short of
    its last token) that an earlier prompt had."""
    seen: set[int] = set()
    total = 0
    for tokens in prompts:
        keys = [hash(tuple(tokens[:end])) for end in range(block, len(tokens) + 1, block)]
        usable = block_floor(len(tokens) - 1, block) // block
        hit = 0
        while hit < min(usable, len(keys)) and keys[hit] in seen:
            hit += 1
        total += hit * block
        seen.update(keys)
    return total


# ---- calibration: what a prefill and a decode step cost -------------------------------------------
def calibrate(base: str, lengths: tuple[int, int], output_tokens: int, reps: int, seed: int) -> dict[str, float]:
    """Lone requests (nothing else in flight), fresh random prompts (no cache hits) at two lengths: the median
    TTFT at each, the prefill cost per token from their difference, the median TPOT (a decode step at batch 1)."""
    import aiohttp  # installed with vLLM

    async def run() -> dict[str, float]:
        rng = random.Random(f"{seed}-calibration-{time.monotonic_ns()}")
        ttft: dict[int, list[float]] = {n: [] for n in lengths}
        tpot: list[float] = []
        async with aiohttp.ClientSession() as session:
            await stream_completion(session, f"{base}/v1/completions", _rand_tokens(rng, 32), 4)  # first-call costs
            for _ in range(reps):
                for n in lengths:
                    streamed = await stream_completion(session, f"{base}/v1/completions", _rand_tokens(rng, n),
                                                       output_tokens)
                    ttft[n].append(streamed.ttft)
                    tpot.append(streamed.tpot)
        short, long_ = lengths
        m_short, m_long = statistics.median(ttft[short]), statistics.median(ttft[long_])
        per_token = (m_long - m_short) / (long_ - short)
        step = statistics.median(tpot)
        return {f"ttft_{short}_ms": 1000 * m_short, f"ttft_{long_}_ms": 1000 * m_long,
                "prefill_ms_per_token": 1000 * per_token, "decode_step_ms": 1000 * step,
                f"prefill_{long_}_in_decode_steps": m_long / step if step > 0 else float("nan")}

    return asyncio.run(run())


# ---- one workload's figures ------------------------------------------------------------------------
@dataclass
class WorkloadResult:
    workload: str
    requests: int
    errors: int
    duration_s: float
    req_per_s: float
    out_tok_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float
    tpot_mean_ms: float
    prompt_tokens: int
    ideal_hit_tokens: int
    hits: dict[int, float]
    queries: dict[int, float]
    requests_per_rank: dict[int, float] = field(default_factory=dict)
    decisions: dict[str, float] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        q = sum(self.queries.values())
        return sum(self.hits.values()) / q if q > 0 else float("nan")

    @property
    def ideal(self) -> float:
        return self.ideal_hit_tokens / self.prompt_tokens if self.prompt_tokens else float("nan")

    @property
    def hit_of_ideal(self) -> float:
        return self.hit_rate / self.ideal if self.ideal > 0 else float("nan")

    def per_rank_rates(self) -> str:
        return ", ".join(f"{e}: {self.hits.get(e, 0) / q:.0%} of {q:.0f}" if q else f"{e}: -"
                         for e, q in sorted(self.queries.items()))

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(hit_rate=self.hit_rate, ideal_hit_rate=self.ideal, hit_of_ideal=self.hit_of_ideal)
        return d


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def chat_result(reqs: list[Req], duration: float, counts: CacheCounts) -> WorkloadResult:
    ok = [r for r in reqs if not r.error]
    ttfts = [1000 * r.ttft for r in ok]
    tpots = [1000 * r.tpot for r in ok if not math.isnan(r.tpot)]
    return WorkloadResult(
        workload="a", requests=len(reqs), errors=len(reqs) - len(ok), duration_s=duration,
        req_per_s=len(ok) / duration, out_tok_per_s=sum(r.out_tokens for r in ok) / duration,
        ttft_p50_ms=statistics.median(ttfts) if ttfts else float("nan"), ttft_p99_ms=_pct(ttfts, 0.99),
        ttft_mean_ms=statistics.fmean(ttfts) if ttfts else float("nan"),
        tpot_mean_ms=statistics.fmean(tpots) if tpots else float("nan"),
        prompt_tokens=sum(r.prompt_len for r in reqs), ideal_hit_tokens=sum(r.ideal_hit for r in reqs),
        hits=counts.hits, queries=counts.queries, requests_per_rank=counts.requests, decisions=counts.decisions)


def loadgen_result(workload: str, lg: bench_fleet.LoadResult, counts: CacheCounts, ideal_hit_tokens: int,
                   ) -> WorkloadResult:
    res = lg.result
    prompt_tokens = int(res.get("total_input_tokens", 0))
    return WorkloadResult(
        workload=workload, requests=int(res.get("completed", 0)) + int(res.get("failed", 0) or 0),
        errors=int(res.get("failed", 0) or 0), duration_s=float(res.get("duration", float("nan"))),
        req_per_s=lg.get("request_throughput"), out_tok_per_s=lg.get("output_throughput"),
        ttft_p50_ms=lg.get("median_ttft_ms"), ttft_p99_ms=lg.get("p99_ttft_ms"), ttft_mean_ms=lg.get("mean_ttft_ms"),
        tpot_mean_ms=lg.get("mean_tpot_ms"), prompt_tokens=prompt_tokens,
        ideal_hit_tokens=ideal_hit_tokens, hits=counts.hits, queries=counts.queries,
        requests_per_rank=counts.requests, decisions=counts.decisions)


# ---- one fleet -----------------------------------------------------------------------------------
@dataclass
class FleetResult:
    side: str
    ranks: int
    round: int
    up_s: float
    block_size: int
    cache: dict[str, str]
    prefix_caching_logged: list[str]
    calibration: dict[str, float]
    workloads: dict[str, WorkloadResult]

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "workloads"}
        d["workloads"] = {k: w.to_json() for k, w in self.workloads.items()}
        return d


def _grep(paths: list[Path], pattern: re.Pattern[str], limit: int) -> list[str]:
    found: list[str] = []
    for path in paths:
        with contextlib.suppress(OSError):
            for line in path.read_text(errors="replace").splitlines():
                if pattern.search(line):
                    found.append(f"{path.name}: {line.strip()[:300]}")
                    if len(found) >= limit:
                        return found
    return found


def side_logs(side: Side) -> list[Path]:
    """The side's logs: stock's `vllm serve` log; corefleet's `up` log and every process's."""
    return list(side.logs)


def run_workloads(side: Side, args: argparse.Namespace, model: str, out: Path, rnd: int,
                  prompts: dict[str, list[list[int]]]) -> FleetResult:
    text = scrape(side.base)
    cache = cache_info(text)
    block = int(cache.get("block_size") or 0)
    if block <= 0:
        raise BenchError(f"{side.name}: no vllm:cache_config_info block_size on {side.base}/metrics")
    logs = side_logs(side)
    pc = _grep(logs, re.compile(r"enable_prefix_caching=(True|False)"), 8)
    if not pc or any("enable_prefix_caching=False" in line for line in pc):
        raise BenchError(f"{side.name}: the engine log does not confirm prefix caching: {pc}")
    log(f"{side.name} N={side.ranks}: serving in {side.started_in:.1f} s; block size {block}, "
        f"{cache.get('num_gpu_blocks', '?')} KV blocks over all ranks; calibrating")
    cal = calibrate(side.base, (args.calib_short, args.calib_long), args.output_tokens, args.calib_reps, args.seed)
    log(f"{side.name}: lone request TTFT {cal[f'ttft_{args.calib_short}_ms']:.1f} ms at {args.calib_short} "
        f"tokens, {cal[f'ttft_{args.calib_long}_ms']:.1f} ms at {args.calib_long}; prefill "
        f"{cal['prefill_ms_per_token']:.3f} ms/token; decode step {cal['decode_step_ms']:.2f} ms; a "
        f"{args.calib_long}-token prefill = {cal[f'prefill_{args.calib_long}_in_decode_steps']:.0f} decode steps")
    results: dict[str, WorkloadResult] = {}
    for wl in args.workloads:
        before = CacheCounts.read(side.base)
        if wl == "a":
            log(f"{side.name}: (a) {args.conversations} conversations x {args.turns} turns")
            reqs, duration = chat_driver(side.base, args, block)
            counts = CacheCounts.read(side.base).minus(before)
            res = chat_result(reqs, duration, counts)
            (out / "chat-requests.json").write_text(json.dumps([asdict(r) for r in reqs]))
        elif wl == "b":
            n = args.prefixes * args.prompts_per_prefix
            log(f"{side.name}: (b) vllm bench serve prefix_repetition, {args.prefixes} prefixes x "
                f"{args.prompts_per_prefix}, c={args.concurrency}")
            lg = run_loadgen(side, args, model, args.concurrency, n, out, "prefix", dataset_argv(args, "b"))
            counts = CacheCounts.read(side.base).minus(before)
            # BOS + the prefix, block-aligned, once per request but the first of each prefix.
            res = loadgen_result("b", lg, counts, ideal_hits(prompts["b"], block))
        else:
            log(f"{side.name}: (c) vllm bench serve random, {args.random_prompts} x {args.random_input_len} tokens, "
                f"c={args.concurrency}")
            lg = run_loadgen(side, args, model, args.concurrency, args.random_prompts, out, "random",
                             dataset_argv(args, "c"))
            counts = CacheCounts.read(side.base).minus(before)
            res = loadgen_result("c", lg, counts, ideal_hits(prompts["c"], block))
        results[wl] = res
        log(f"{side.name}: {WORKLOAD_NAMES[wl]}: {res.req_per_s:.2f} req/s, TTFT p50 {res.ttft_p50_ms:.0f} "
            f"p99 {res.ttft_p99_ms:.0f} ms, TPOT {res.tpot_mean_ms:.1f} ms, hit rate {res.hit_rate:.1%} (ideal "
            f"{res.ideal:.1%}), per rank {res.per_rank_rates()}, requests per rank "
            f"{[round(v) for _, v in sorted(res.requests_per_rank.items())]}, routing decisions "
            f"{_decisions(res)}, errors {res.errors}")
    return FleetResult(side=side.name, ranks=side.ranks, round=rnd, up_s=side.started_in, block_size=block,
                       cache=cache, prefix_caching_logged=pc[:2], calibration=cal,
                       workloads=results)


@contextlib.contextmanager
def fleet(side_name: str, args: argparse.Namespace, state: Path, model: str, flags: tuple[str, ...], ranks: int,
          run_no: int) -> Iterator[Side]:
    fleet_args = argparse.Namespace(ranks=ranks, engine=local.ENGINE_VLLM, ready_timeout=args.ready_timeout,
                                    token_delay_ms=0)
    if side_name == STOCK:
        with stock_fleet(fleet_args, state / f"stock-n{ranks}-{run_no}", model, flags) as side:
            yield side
    else:
        with corefleet_fleet(fleet_args, state / f"corefleet-n{ranks}", model, run_no, flags,
                             {ROUTING_ENV: side_name}) as side:
            side.name = side_name
            yield side


# ---- reporting -----------------------------------------------------------------------------------
def _decisions(w: WorkloadResult) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted(w.decisions.items())) or "-"


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else float("nan")


def _med(values: list[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return statistics.median(vals) if vals else float("nan")


def figures(results: list[FleetResult], ranks: int, workload: str) -> tuple[list[str], dict[str, Any]]:
    """The table of one workload at N ranks (medians over rounds) and the goals for prefix-affinity vs stock."""
    by_side: dict[str, list[WorkloadResult]] = {}
    for r in results:
        if r.ranks == ranks and workload in r.workloads:
            by_side.setdefault(r.side, []).append(r.workloads[workload])
    if not by_side:
        return [], {}
    cols: list[tuple[str, Callable[[WorkloadResult], float], str]] = [
        ("TTFT p50 ms", lambda w: w.ttft_p50_ms, "{:.0f}"),
        ("TTFT p99 ms", lambda w: w.ttft_p99_ms, "{:.0f}"),
        ("TPOT mean ms", lambda w: w.tpot_mean_ms, "{:.1f}"),
        ("req/s", lambda w: w.req_per_s, "{:.2f}"),
        ("out tok/s", lambda w: w.out_tok_per_s, "{:.0f}"),
        ("hit rate", lambda w: w.hit_rate, "{:.1%}"),
        ("ideal", lambda w: w.ideal, "{:.1%}"),
        ("hit/ideal", lambda w: w.hit_of_ideal, "{:.2f}"),
        ("errors", lambda w: float(w.errors), "{:.0f}"),
    ]
    lines = [f"{WORKLOAD_NAMES[workload]}, N={ranks} (median of {max(len(v) for v in by_side.values())} round(s)):",
             "  " + f"{'side':<17}" + "".join(f"{c:>13}" for c, _, _ in cols)]
    meds: dict[str, dict[str, float]] = {}
    for side in ALL_SIDES:
        if side not in by_side:
            continue
        meds[side] = {c: _med([pick(w) for w in by_side[side]]) for c, pick, _ in cols}
        lines.append("  " + f"{side:<17}" + "".join(
            f"{(fmt.format(meds[side][c]) if not math.isnan(meds[side][c]) else '-'):>13}" for c, _, fmt in cols))
    for side, ws in by_side.items():
        for i, w in enumerate(ws):
            lines.append(f"    {side} round {i + 1}: hits per rank {w.per_rank_rates()}; requests per rank "
                         f"{[round(v) for _, v in sorted(w.requests_per_rank.items())]}; routing decisions "
                         f"{_decisions(w)}; "
                         f"queries {sum(w.queries.values()):.0f} / prompt tokens sent {w.prompt_tokens}")
    verdicts: dict[str, Any] = {}
    for side in ROUTINGS:
        if side not in meds or STOCK not in meds:
            continue
        ttft = _ratio(meds[side]["TTFT p50 ms"], meds[STOCK]["TTFT p50 ms"])
        tput = _ratio(meds[side]["req/s"], meds[STOCK]["req/s"])
        hit = meds[side]["hit/ideal"]
        checks: list[tuple[str, float, str, bool]]
        if workload == "c":
            checks = [("TTFT p50 ratio", ttft, f"<= {GOALS_RANDOM['ttft_p50']}", ttft <= GOALS_RANDOM["ttft_p50"]),
                      ("throughput ratio", tput, f">= {GOALS_RANDOM['throughput']}",
                       tput >= GOALS_RANDOM["throughput"])]
        else:
            checks = [("TTFT p50 ratio", ttft, f"<= {GOALS_SHARED['ttft_p50']}", ttft <= GOALS_SHARED["ttft_p50"]),
                      ("throughput ratio", tput, f">= {GOALS_SHARED['throughput']}",
                       tput >= GOALS_SHARED["throughput"]),
                      ("hit rate / ideal", hit, f">= {GOALS_SHARED['hit_of_ideal']}",
                       hit >= GOALS_SHARED["hit_of_ideal"])]
        goal = side == ROUTINGS[0]
        text = "; ".join(f"{name} {value:.2f} ({want}: {('PASS' if ok else 'FAIL') if goal else 'control'})"
                         for name, value, want, ok in checks)
        lines.append(f"  RATIO {side}/stock: {text}")
        verdicts[side] = {name: {"value": value, "goal": want, "pass": ok} for name, value, want, ok in checks}
    return lines, {"medians": meds, "verdicts": verdicts}


def routing_commit() -> str:
    """The commits of this checkout (of its last 200) whose message starts with `routing:`, newest first, their
    subjects cut at 80 characters (empty if none)."""
    try:
        out = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent.parent), "log", "--oneline",
                              "-n", "200"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "(git log failed)"
    return "; ".join(line[:80] for line in out.splitlines() if ROUTING_COMMIT.match(line))


# ---- the run -------------------------------------------------------------------------------------
def working_set(args: argparse.Namespace) -> dict[str, int]:
    """Tokens whose KV each workload would keep if nothing were evicted (all ranks together)."""
    conv = args.turns * (args.user_tokens + args.output_tokens)
    return {"a": args.conversations * conv,
            "b": args.prefixes * (args.prefix_len + 1) + args.concurrency * (args.suffix_len + args.output_tokens),
            "c": args.concurrency * (args.random_input_len + args.output_tokens)}


def kv_tokens_per_rank(args: argparse.Namespace, ranks: int, block: int) -> int:
    ws = max(working_set(args)[w] for w in args.workloads)
    return max(block_floor(math.ceil(args.kv_share_factor * ws / ranks) + block - 1, block),
               block_floor(args.context + block - 1, block))


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model's shape and the engines' batch (`shape_of`)."""
    p.add_argument("--hidden", type=int, default=768, help="hidden size (default 768)")
    p.add_argument("--layers", type=int, default=6, help="layers (default 6)")
    p.add_argument("--intermediate", type=int, default=2048, help="MLP size (default 2048)")
    p.add_argument("--head-dim", type=int, default=64, help="head_dim (default 64; the CPU attention needs >= 32)")
    p.add_argument("--context", type=int, default=2048, help="max_position_embeddings and --max-model-len")
    p.add_argument("--max-num-seqs", type=int, default=16, help="vLLM --max-num-seqs (default 16)")


def shape_of(args: argparse.Namespace) -> Shape:
    return Shape(hidden=args.hidden, layers=args.layers, intermediate=args.intermediate, head_dim=args.head_dim,
                 context=args.context)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--ranks", default="2,4", help="data-parallel sizes to run, comma-separated (default 2,4)")
    p.add_argument("--sides", default=",".join(ALL_SIDES),
                   help=f"sides, comma-separated, of {', '.join(ALL_SIDES)} (default all)")
    p.add_argument("--workloads", default="a,b,c", help="of a, b, c (default all)")
    p.add_argument("--rounds", type=int, default=1, help="fresh fleets per side and N (default 1)")
    add_model_args(p)
    p.add_argument("--kv-share-factor", type=float, default=1.5,
                   help="KV cache per rank = this x the working set / ranks (default 1.5)")
    p.add_argument("--block-size", type=int, default=128,
                   help="the engines' KV block size used to size the cache (vLLM's CPU default 128; the run "
                        "reads the real one from /metrics for the ideal hit rates)")
    # the workloads
    p.add_argument("--conversations", type=int, default=12, help="(a) concurrent conversations (default 12)")
    p.add_argument("--turns", type=int, default=8, help="(a) turns per conversation (default 8)")
    p.add_argument("--user-tokens", type=int, default=128, help="(a) tokens of each user message (default 128)")
    p.add_argument("--think-ms", type=float, default=500,
                   help="(a) mean pause between a reply and the next turn (exponential; conversations start spread "
                        "over twice that), the same on every side; 0: closed loop, all conversations start at once "
                        "and stay in lockstep (default 500)")
    p.add_argument("--output-tokens", type=int, default=32, help="generated tokens per request (default 32)")
    p.add_argument("--prefixes", type=int, default=14, help="(b) shared prefixes (default 14)")
    p.add_argument("--prefix-len", type=int, default=1024, help="(b) prefix tokens (default 1024)")
    p.add_argument("--suffix-len", type=int, default=64, help="(b) suffix tokens (default 64)")
    p.add_argument("--prompts-per-prefix", type=int, default=7, help="(b) requests per prefix (default 7)")
    p.add_argument("--random-prompts", type=int, default=64, help="(c) prompts (default 64)")
    p.add_argument("--random-input-len", type=int, default=512, help="(c) prompt tokens (default 512)")
    p.add_argument("--concurrency", type=int, default=12, help="(b), (c) concurrency (default 12)")
    p.add_argument("--calib-short", type=int, default=64, help="calibration: short prompt (default 64)")
    p.add_argument("--calib-long", type=int, default=1024, help="calibration: long prompt (default 1024)")
    p.add_argument("--calib-reps", type=int, default=3, help="calibration: requests per length (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-autogroups", action="store_true",
                   help="leave kernel.sched_autogroup_enabled as it is (default: 0 while the fleets run, restored; "
                        "bench_frontend.autogroups_off)")
    p.add_argument("--ready-timeout", type=float, help="seconds for a fleet to serve (default: corefleet up's)")
    p.add_argument("--state-dir", help="keep the model, the fleets' logs, the load generator's and this "
                                       "benchmark's results (bench_routing.json) here")
    args = p.parse_args(argv)
    args.ranks_list = [int(x) for x in args.ranks.split(",") if x.strip()]
    args.sides_list = [x.strip() for x in args.sides.split(",") if x.strip()]
    args.workloads = [x.strip() for x in args.workloads.split(",") if x.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bad = [s for s in args.sides_list if s not in ALL_SIDES] + [w for w in args.workloads if w not in WORKLOADS]
    if bad or not args.ranks_list or min(args.ranks_list) < 1 or args.rounds < 1:
        print(f"bad --sides/--workloads/--ranks/--rounds: {bad or args.ranks}", file=sys.stderr)
        return 2
    longest = max(args.turns * (args.user_tokens + args.output_tokens),
                  args.prefix_len + args.suffix_len + 1 + args.output_tokens,
                  args.random_input_len + args.output_tokens, args.calib_long + args.output_tokens)
    if longest > args.context:
        print(f"the longest request ({longest} tokens) does not fit --context {args.context}", file=sys.stderr)
        return 2
    if args.prefixes * args.prompts_per_prefix < args.prefixes or args.head_dim < 32:
        print("--prompts-per-prefix must be >= 1 and --head-dim >= 32", file=sys.stderr)
        return 2
    return run_in_state_dir("bench_routing", args.state_dir, lambda state, started: _run(args, state, started))


def _run(args: argparse.Namespace, state: Path, started: float) -> int:
    shape = shape_of(args)
    model = str(write_model(state / "models" / "routing-llama", shape).absolute())
    commit = routing_commit()
    ws = working_set(args)
    cores = len(os.sched_getaffinity(0))
    none = "NONE (COREFLEET_ROUTING is ignored by this checkout: both corefleet sides route as before)"
    log(f"routing commit: {commit or none}")
    log(f"model {model}: {shape.describe()}")
    log("working sets (tokens, all ranks): " + ", ".join(f"({w}) {ws[w]}" for w in args.workloads))
    log("the load generator's prompts for (b) and (c), as it makes them (vLLM's get_samples, same seed), for "
        "their ideal hit rates")
    prompts = {w: dataset_prompts(model, dataset_argv(args, w), n_prompts(args, w), args.seed)
               for w in ("b", "c") if w in args.workloads}
    plan: list[tuple[int, int, str]] = []
    for i, n in enumerate(args.ranks_list):
        for rnd in range(1, args.rounds + 1):
            order = args.sides_list if (i + rnd) % 2 == 1 else list(reversed(args.sides_list))
            plan += [(n, rnd, s) for s in order]
    results: list[FleetResult] = []
    sizing: dict[int, dict[str, Any]] = {}
    with autogroups_off(not args.keep_autogroups) as scheduling:
        log(f"autogroup scheduling while the fleets run: {scheduling}")
        errors = 0
        for run_no, (n, rnd, side_name) in enumerate(plan, start=1):
            tokens = kv_tokens_per_rank(args, n, args.block_size)
            kv_bytes = tokens * shape.kv_bytes_per_token()
            flags = vllm_flags(shape, kv_bytes, args.max_num_seqs)
            if n not in sizing:
                share = {w: ws[w] / n for w in args.workloads}
                sizing[n] = {"kv_tokens_per_rank": tokens, "kv_bytes_per_rank": kv_bytes, "flags": list(flags),
                             "working_set": {w: ws[w] for w in args.workloads}, "share_per_rank": share}
                log(f"N={n}: KV cache {kv_bytes / 2**20:.0f} MiB a rank = {tokens} tokens "
                    f"({shape.kv_bytes_per_token()} B/token): " + ", ".join(
                        f"({w}) {tokens / ws[w]:.0%} of the working set, {tokens / share[w]:.1f}x a rank's share"
                        for w in args.workloads))
            out = state / f"n{n}-{side_name}-{rnd}"
            out.mkdir(parents=True, exist_ok=True)
            log(f"[{run_no}/{len(plan)}] N={n} round {rnd}: starting {side_name} (load average "
                f"{os.getloadavg()[0]:.2f})")
            with fleet(side_name, args, state, model, flags, n, run_no) as side:
                res = run_workloads(side, args, model, out, rnd, prompts)
            results.append(res)
            errors += sum(w.errors for w in res.workloads.values())
            (state / "bench_routing.json").write_text(json.dumps(
                {"partial": True, "results": [r.to_json() for r in results]}, indent=1, default=str))
    print()
    print("details:")
    print(f"  machine: {cores} CPU cores ({_cpu_model()}), "
          f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB; vLLM {_vllm_version()}; "
          f"{datetime.now().isoformat(timespec='minutes')}; OpenMP binding per rank "
          f"{os.environ.get('VLLM_CPU_OMP_THREADS_BIND') or bench_fleet._omp_bind(max(args.ranks_list))}")
    print(f"  routing commit: {commit or 'none'}")
    print(f"  model: {shape.describe()}")
    for r in results:
        c = r.calibration
        print(f"  {r.side} N={r.ranks} round {r.round}: up {r.up_s:.0f} s; block {r.block_size}, "
              f"{r.cache.get('num_gpu_blocks', '?')} KV blocks over all ranks; lone request TTFT "
              f"{c[f'ttft_{args.calib_short}_ms']:.1f} / {c[f'ttft_{args.calib_long}_ms']:.1f} ms at "
              f"{args.calib_short} / {args.calib_long} tokens, prefill {c['prefill_ms_per_token']:.3f} ms/token, "
              f"decode step {c['decode_step_ms']:.2f} ms ({c[f'prefill_{args.calib_long}_in_decode_steps']:.0f} "
              f"steps per {args.calib_long}-token prefill)")
        if r.side == ROUTINGS[0] and not any(sum(w.decisions.values()) for w in r.workloads.values()):
            print(f"    WARNING: its frontend made no prefix-affinity decisions ({DECISIONS}): COREFLEET_ROUTING "
                  "not honoured?")
    for n, s in sizing.items():
        print(f"  N={n}: --kv-cache-memory-bytes {s['kv_bytes_per_rank']} ({s['kv_tokens_per_rank']} tokens a rank)")
    print(f"  vLLM flags (N={args.ranks_list[0]}): {' '.join(sizing[args.ranks_list[0]]['flags'])}")
    print(f"  (a) {args.conversations} conversations x {args.turns} turns, {args.user_tokens} user + "
          f"{args.output_tokens} output tokens a turn; (b) {args.prefixes} prefixes x {args.prompts_per_prefix}, "
          f"{args.prefix_len} + {args.suffix_len} tokens, c={args.concurrency}; (c) {args.random_prompts} x "
          f"{args.random_input_len} tokens, c={args.concurrency}")
    print()
    summary: dict[str, Any] = {}
    for n in args.ranks_list:
        for wl in args.workloads:
            lines, data = figures(results, n, wl)
            summary[f"{wl}-n{n}"] = data
            for line in lines:
                print(line)
            print()
    print(f"wall time: {time.monotonic() - started:.0f} s; errors: {errors}", flush=True)
    (state / "bench_routing.json").write_text(json.dumps(
        {"routing_commit": commit, "model": asdict(shape), "sizing": sizing, "args": {
            k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list))},
         "results": [r.to_json() for r in results], "summary": summary}, indent=1, default=str))
    log(f"results: {state / 'bench_routing.json'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
