# SPDX-License-Identifier: Apache-2.0
"""Resizing a serving fleet: corefleet's in-place resize against the restart path, on the same fleet and load.

    flock /tmp/corefleet-heavy.lock .venv/bin/python bench/bench_resize.py [--small 8] [--large 16]
        [--workers 8] [--max-tokens 24] [--token-delay-ms 10] [--steady 20] [--moe]

One run, one fleet, one load. The real control plane (etcd + kube-apiserver + controller-manager +
scheduler), the operator as its own process, and tests/podrunner.py as the kubelet; the frontend
and the coordinator are real vLLM, each engine pod runs corefleet's engine emulator (a `--token-
delay-ms` per token, nothing computed: what is measured is the fleet's machinery, not a model).

A separate load-generator process keeps `--workers` clients sending a mix of streaming and
non-streaming completions (`--max-tokens`, ignore_eos) to the frontend's pod address (there is no
kube-proxy here; when the frontend pod is replaced it follows the new address), and records every
request: start, end, outcome.

The steps, each after a `--steady` window at the current size:

1. in place, up:   `replicas` small -> large through the scale subresource (what `kubectl scale`
   and an HPA do): corefleet's resize; the survivors keep serving.
2. in place, down: large -> small.
3. restart, up:    small -> large by recreating the fleet at the new size, which is what
   LeaderWorkerSet, llm-d and KServe do on a size change (here: `replicas` and an engine env var
   changed together, so the operator's configuration hash changes and it recreates every pod).
4. restart, down:  large -> small, likewise.

For each: the time until the fleet serves at the new size (status Running at that size and every
rank Serving on the frontend), the failed requests while it changed, and p50/p99 latency of the
requests that started while it changed against the steady window before it. For the in-place
steps also the time corefleet itself adds: for a scale-up, `replicas` changed -> resize Completed
minus the slowest new engine's own start (its process started -> its READY sent to the frontend,
from the launcher's log); for a scale-down, minus the drain (until the leaving ranks had no request
left). Goals: 0 failed requests in place, p99 added < 1 s, corefleet's own added time < 2 s.

`--moe` runs an `expertParallel` fleet of a tiny Mixtral with `--experts` experts (16 by default): the
in-place steps are then vLLM's elastic-EP protocol (frontend.elastic), the restart steps the same
recreation.

The figure: RATIO in-place/restart of the time until the new size serves, per direction. The exit
status is non-zero only on errors (a fleet that does not settle), never on a missed goal.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

from corefleet_harness.emulator import EMULATOR_MODULE  # noqa: E402
from corefleet_harness.localcluster import LocalControlPlane, add_gpu_node, resolve_bin_dir  # noqa: E402
from corefleet_harness.support import wait_until  # noqa: E402
from corefleet_harness.tinymodel import VLLM_CPU_FLAGS, write_tiny_model  # noqa: E402
from corefleet_operator import constants, crd  # noqa: E402
from factories import make_ecs  # noqa: E402
from fleettest import FleetView, OperatorProcess  # noqa: E402
from podrunner import PodRunner  # noqa: E402

NAME = "bench"
SERVED = "tiny"
CONTEXT = 1024
LOADGEN = Path(__file__).resolve().parent / "resize_loadgen.py"


@dataclass
class Step:
    name: str
    frm: int
    to: int
    changed_at: float
    serving_at: float
    completed_at: float | None = None  # the resize's Completed, seen by polling the status (in place)
    engine_start: float = 0.0  # the slowest new engine's own start (in place, up)
    drain: float = 0.0  # until the leaving ranks had no request (in place, down)

    @property
    def took(self) -> float:
        return self.serving_at - self.changed_at


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", type=int, default=8)
    p.add_argument("--large", type=int, default=16)
    p.add_argument("--workers", type=int, default=8, help="concurrent clients")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--token-delay-ms", type=int, default=10)
    p.add_argument("--steady", type=float, default=20.0, help="seconds of load measured before each change")
    p.add_argument("--settle-timeout", type=float, default=900.0)
    p.add_argument("--moe", action="store_true", help="an expertParallel (MoE, elastic EP) fleet")
    p.add_argument("--experts", type=int, default=16, help="the MoE model's experts (with --moe)")
    return p.parse_args(argv)


def quantile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def log_time(path: Path, pattern: str) -> float | None:
    """The wall-clock time of the first log line matching `pattern` (corefleet's `INFO 2026-12-01 10:00:00,123`)."""
    for line in path.read_text(errors="replace").splitlines():
        if re.search(pattern, line) and (m := re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", line)):
            return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


class Bench:
    def __init__(self, args: argparse.Namespace, k8s: LocalControlPlane, ns: str, runner: PodRunner,
                 fleet: FleetView, work: Path) -> None:
        self.args, self.k8s, self.ns, self.runner, self.fleet, self.work = args, k8s, ns, runner, fleet, work
        self.target = work / "target"
        self.results = work / "requests.jsonl"
        self.restarts = 0

    def point_load_at_frontend(self) -> None:
        tmp = self.target.with_suffix(".tmp")
        tmp.write_text(f"{self.fleet.frontend_ip()}:8000")
        tmp.replace(self.target)

    def serving(self, n: int) -> bool:
        if not self.fleet.settled(n):
            return False
        self.point_load_at_frontend()
        try:
            status = self.fleet.admin().fleet()
        except OSError:
            return False
        return status.data_parallel_size == n and all(r.state == "Serving" for r in status.ranks)

    def settle(self, n: int) -> float:
        wait_until(lambda: self.serving(n), self.args.settle_timeout, f"the fleet serving at {n}", interval=0.05,
                   diagnose=self.fleet.describe)
        return time.time()

    def change(self, name: str, frm: int, to: int, restart: bool) -> Step:
        time.sleep(self.args.steady)  # a steady window at the current size, under load
        pods_before = {n: p["metadata"]["uid"] for n, p in self.fleet.pods().items()}
        changed_at = time.time()
        if restart:
            self.restarts += 1
            self.k8s.request("PATCH", f"/apis/{constants.API_VERSION}/namespaces/{self.ns}/enginecoresets/{NAME}",
                             {"spec": {"replicas": to, "engine": {"env": [{"name": "BENCH_RESTART",
                                                                           "value": str(self.restarts)}]}}},
                             content_type="application/merge-patch+json")
        else:
            self.fleet.scale(to)
        completed_at = None
        if not restart:
            def completed() -> float | None:
                op = self.fleet.status().get("operation") or {}
                return time.time() if op.get("phase") == "Completed" and op.get("toReplicas") == to else None
            completed_at = wait_until(completed, self.args.settle_timeout, "the resize to complete", interval=0.02)
        serving_at = self.settle(to)
        step = Step(name, frm, to, changed_at, serving_at, completed_at)
        if not restart and to > frm:
            step.engine_start = max(self.engine_start(rank, pods_before) for rank in range(frm, to))
        if not restart and to < frm:
            step.drain = self.drain_time(changed_at)
        print(f"{name}: {frm} -> {to}: serving after {step.took:.1f} s"
              + (f" (resize Completed after {completed_at - changed_at:.1f} s)" if completed_at else ""), flush=True)
        return step

    def engine_start(self, rank: int, before: dict[str, str]) -> float:
        """Rank's engine process start -> its READY relayed/sent, from the podrunner's record and its log."""
        name = constants.engine_name(NAME, rank)
        pod = next(p for p in self.runner.pods.values() if p.name == name and p.popen is not None)
        started = float(pod.extra["started_wall"])
        assert pod.log is not None
        ready = log_time(pod.log, r"READY|sent READY|joined the fleet")
        if ready is None:
            raise RuntimeError(f"no READY in {pod.log}")
        return ready - started

    def drain_time(self, changed_at: float) -> float:
        """From the change until the last request that was running on a leaving rank ended (<= the drain)."""
        ends = [end for start, end, _, _ in self.requests() if start < changed_at < end]
        return max(ends, default=changed_at) - changed_at

    def requests(self) -> list[tuple[float, float, bool, str]]:
        out = []
        for line in self.results.read_text().splitlines():
            if line.strip():
                start, end, ok, detail = json.loads(line)
                out.append((float(start), float(end), bool(ok), str(detail)))
        return out

    def window(self, start: float, end: float) -> tuple[list[float], int, int]:
        lat, failed, total = [], 0, 0
        for s, e, ok, _ in self.requests():
            if start <= s < end:
                total += 1
                lat.append(e - s)
                failed += not ok
        return lat, failed, total


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-resize-"))
    kind = "MoE (elastic EP) emulated engines" if args.moe else "emulated engines"
    print(f"bench_resize: {platform.node()}, {os.cpu_count()} CPUs; {kind}, {args.token_delay_ms} ms/token; "
          f"{args.workers} clients, {args.max_tokens} tokens each; {args.small} <-> {args.large} ranks; in {work}",
          flush=True)
    model = write_tiny_model(work / "tiny", moe=args.moe, context=CONTEXT)
    if args.moe:
        config = json.loads((model / "config.json").read_text())
        config["num_local_experts"] = args.experts
        (model / "config.json").write_text(json.dumps(config))
    flags = list(VLLM_CPU_FLAGS)
    del flags[flags.index("--load-format"):flags.index("--load-format") + 2]
    flags[flags.index("--max-model-len") + 1] = str(CONTEXT)
    emulator = (EMULATOR_MODULE, "--token-delay-ms", str(args.token_delay_ms))
    with LocalControlPlane(state_dir=work / "cp", bin_dir=resolve_bin_dir()) as k8s:
        add_gpu_node(k8s, "gpu-node-0", gpus=64)
        k8s.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(crd.crd()))
        k8s.kubectl("wait", "--for=condition=Established", f"crd/{constants.CRD_NAME}", "--timeout=60s")
        ns = "bench"
        k8s.kubectl("create", "namespace", ns)
        with PodRunner(k8s, ns, work / "pods", engine=emulator) as runner, \
                OperatorProcess(k8s, ns, work, resync_seconds=30) as operator:
            factory = make_ecs(NAME, ns).model(str(model)).replicas(args.small).max_replicas(args.large)
            ecs = ((factory.expert_parallel() if args.moe else factory)
                   .set("engine.loadFormat", "dummy").set("scaling.readyTimeoutSeconds", int(args.settle_timeout))
                   .set("scaling.drainTimeoutSeconds", 60).arg(*flags, "--served-model-name", SERVED).manifest())
            k8s.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(ecs))
            fleet = FleetView(k8s, ns, NAME, runner, SERVED)
            bench = Bench(args, k8s, ns, runner, fleet, work)
            t0 = time.time()
            bench.settle(args.small)
            print(f"fleet of {args.small} serving after {time.time() - t0:.0f} s", flush=True)
            load = subprocess.Popen([sys.executable, str(LOADGEN), str(bench.target), str(bench.results),
                                     str(args.workers), str(args.max_tokens), SERVED], start_new_session=True)
            try:
                steps = [
                    bench.change("in-place up", args.small, args.large, restart=False),
                    bench.change("in-place down", args.large, args.small, restart=False),
                    bench.change("restart up", args.small, args.large, restart=True),
                    bench.change("restart down", args.large, args.small, restart=True),
                ]
                time.sleep(args.steady)
            finally:
                os.killpg(load.pid, signal.SIGINT)
                load.wait(90)
            operator.check_clean()
            report(bench, steps, args)
    return 0


def report(bench: Bench, steps: list[Step], args: argparse.Namespace) -> None:
    print()
    print(f"{'step':<15}{'from':>5}{'to':>5}{'serving_s':>11}{'failed':>8}{'requests':>10}"
          f"{'p50_ms':>9}{'p99_ms':>9}{'steady_p50':>11}{'steady_p99':>11}{'p99_added_ms':>13}{'own_s':>7}")
    own: dict[str, float] = {}
    added: dict[str, float] = {}
    for step in steps:
        lat, failed, total = bench.window(step.changed_at, step.serving_at)
        steady, _, _ = bench.window(step.changed_at - args.steady, step.changed_at)
        p99_added = (quantile(lat, 0.99) - quantile(steady, 0.99)) * 1000
        added[step.name] = p99_added
        own_s = ""
        if step.completed_at is not None:
            taken = step.completed_at - step.changed_at
            own[step.name] = taken - (step.engine_start if step.to > step.frm else step.drain)
            own_s = f"{own[step.name]:.2f}"
        print(f"{step.name:<15}{step.frm:>5}{step.to:>5}{step.took:>11.1f}{failed:>8}{total:>10}"
              f"{quantile(lat, 0.5) * 1000:>9.0f}{quantile(lat, 0.99) * 1000:>9.0f}"
              f"{quantile(steady, 0.5) * 1000:>11.0f}{quantile(steady, 0.99) * 1000:>11.0f}{p99_added:>13.0f}"
              f"{own_s:>7}")
        if step.engine_start:
            print(f"{'':<15}(slowest new engine's own start: {step.engine_start:.1f} s)")
        if step.drain:
            print(f"{'':<15}(drain: {step.drain:.1f} s)")
    by_name = {s.name: s for s in steps}
    for direction in ("up", "down"):
        inplace, restart = by_name[f"in-place {direction}"], by_name[f"restart {direction}"]
        print(f"RATIO in-place/restart time until the new size serves, {direction}: "
              f"{inplace.took / restart.took:.2f} ({inplace.took:.1f} s / {restart.took:.1f} s)")
    failures = {s.name: bench.window(s.changed_at, s.serving_at)[1] for s in steps}
    print(f"failed requests: {failures}")
    in_place = failures["in-place up"] + failures["in-place down"]
    p99_ok = all(added[f"in-place {d}"] < 1000 for d in ("up", "down"))
    print("goals: 0 failed in place: " + ("met" if not in_place else "MISSED")
          + "; p99 added in place < 1 s: " + ("met" if p99_ok else "MISSED")
          + "; corefleet's own added time < 2 s: " + ("met" if all(v < 2 for v in own.values()) else "MISSED"))


if __name__ == "__main__":
    sys.exit(main())
