# SPDX-License-Identifier: Apache-2.0
"""Operator at scale on the real API server: time to converge, RSS, and API requests when idle.

    .venv/bin/python bench/bench_operator_scale.py [--fleets 200] [--ranks 16] [--namespaces 10]

One run, one local control plane (etcd + kube-apiserver + controller-manager + scheduler, fake GPU
nodes, the kubelet stand-in), two phases on the same cluster:

1. Baseline: the benchmark itself POSTs every object of `--fleets` fleets (exactly what
   `builders.fleet_children` returns for `--ranks` ranks, minus the owner reference to an
   EngineCoreSet that does not exist here) and waits until every pod is Running/Ready: T_base.
   That is the cost of the cluster alone: the API server, the scheduler and the kubelet stand-in.
   Its namespaces are then emptied and deleted, so the second phase starts on an empty cluster.
2. Operator: `python -m corefleet_operator` runs as a subprocess watching only the benchmark's own
   namespaces; the benchmark POSTs the EngineCoreSets and waits until every one reports phase
   Running with all ranks ready: T_op. The figure is T_op / T_base.

Then, with everything converged, an idle window of at least two resyncs of every fleet: reconciles,
the operator's own API requests per reconcile (its metrics) and the write requests the API server
saw for the operator's resources (its metrics; this also catches kopf's own writes). The goal is
0 writes when nothing changed. The exit status is non-zero only on errors, never on a missed goal.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import http.client
import json
import math
import re
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the tests' fleet factory: the same EngineCoreSets as the tests

from corefleet_harness.localcluster import (  # noqa: E402
    ControlPlaneError,
    KubeletStandIn,
    LocalControlPlane,
    add_gpu_node,
    resolve_bin_dir,
)
from corefleet_harness.support import free_port, http_get, tail, wait_until  # noqa: E402
from corefleet_operator import builders, constants, crd  # noqa: E402
from factories import make_ecs  # noqa: E402

PODS_PER_NODE = 250  # localcluster.gpu_node's pod capacity
WRITE_VERBS = frozenset({"POST", "PUT", "PATCH", "APPLY", "DELETE", "DELETECOLLECTION"})
WATCHED_RESOURCES = ("enginecoresets", "pods", "services", "secrets", "networkpolicies", "events")
PLURALS = {"Pod": "pods", "Service": "services", "Secret": "secrets", "NetworkPolicy": "networkpolicies"}
ECS_PATH = f"/apis/{constants.GROUP}/{constants.VERSION}"
METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
POLL = 0.5  # seconds between convergence polls, the same in both phases


class BenchError(RuntimeError):
    """Something went wrong (not a missed goal): the benchmark exits non-zero."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- a keep-alive client for the benchmark's own writes -------------------------------------------
class Api:
    """One persistent HTTPS connection per thread (the baseline should be a fast client, not a slow one)."""

    def __init__(self, cp: LocalControlPlane) -> None:
        self._host, self._port = cp.server.removeprefix("https://").split(":")
        self._ctx = ssl.create_default_context(cafile=str(cp.ca_file))
        self._headers = {"Authorization": f"Bearer {_admin_token(cp)}"}
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPSConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPSConnection(self._host, int(self._port), context=self._ctx, timeout=60)
            self._local.conn = conn
        return conn

    def request(self, method: str, path: str, body: Any = None, accept: str = "application/json") -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        headers = {**self._headers, "Content-Type": "application/json", "Accept": accept}
        for attempt in (1, 2):
            conn = self._conn()
            try:
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
            except (http.client.HTTPException, ConnectionError):
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise
                continue
            return resp.status, json.loads(raw) if raw else None
        raise AssertionError("unreachable")

    def create(self, path: str, body: Any) -> None:
        status, out = self.request("POST", path, body)
        if status >= 300:
            raise BenchError(f"POST {path}: {status} {(out or {}).get('message', out)}")


    def count(self, namespaces: Iterable[str], field_selector: str) -> int:
        """Pods matching `field_selector`, listed as metadata only (cheap enough for progress lines)."""
        n = 0
        for ns in namespaces:
            status, out = self.request("GET", f"/api/v1/namespaces/{ns}/pods?fieldSelector={field_selector}",
                                       accept=METADATA_LIST)
            if status != 200:
                raise BenchError(f"LIST pods in {ns}: {status} {out}")
            n += len(out.get("items") or [])  # null when empty
        return n

    def pod_states(self, namespaces: list[str]) -> str:
        """Where the pods are: waiting for the scheduler, for the kubelet stand-in, or Running."""
        unscheduled = self.count(namespaces, "spec.nodeName=")
        bound = self.count(namespaces, "spec.nodeName!=,status.phase=Pending")
        running = self.count(namespaces, "status.phase=Running")
        return f"pods unscheduled {unscheduled}, bound/Pending {bound}, Running {running}"


def _admin_token(cp: LocalControlPlane) -> str:
    config = json.loads(cp.kubeconfig.read_text())  # the harness writes its kubeconfig as JSON
    return str(config["users"][0]["user"]["token"])


# ---- cluster set-up -------------------------------------------------------------------------------
def node_plan(fleets: int, ranks: int, gpus_per_node: int) -> tuple[int, int, int]:
    """(nodes, GPUs needed, pods) so that every pod fits by GPUs and by the per-node pod limit."""
    gpus = fleets * ranks  # tensorParallelSize 1: one GPU per engine pod
    pods = fleets * (ranks + 2)  # + frontend + coordinator
    nodes = max(math.ceil(gpus / gpus_per_node), math.ceil(pods / (PODS_PER_NODE * 0.8))) + 1
    return nodes, gpus, pods


def create_namespaces(cp: LocalControlPlane, names: Iterable[str]) -> None:
    names = list(names)
    for ns in names:
        cp.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})

    def service_accounts() -> bool:  # pods are admitted only once the namespace's default SA exists
        return all(cp.exists(f"/api/v1/namespaces/{ns}/serviceaccounts/default") for ns in names)
    wait_until(service_accounts, 60, "default service accounts", interval=POLL)


def delete_namespaces(cp: LocalControlPlane, names: Iterable[str]) -> None:
    """Force-delete the pods (no kubelet would finish them), then the namespaces; wait until gone."""
    names = list(names)
    for ns in names:
        cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods", {"gracePeriodSeconds": 0})
        cp.request("DELETE", f"/api/v1/namespaces/{ns}")
    wait_until(lambda: not any(cp.exists(f"/api/v1/namespaces/{ns}") for ns in names), 300,
               "baseline namespaces deleted", interval=POLL)


def _ts(value: str) -> float:
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").timestamp()


def pod_latencies(cp: LocalControlPlane, namespaces: Iterable[str]) -> tuple[float, list[float]]:
    """(seconds between the first and the last pod created, each pod's create -> Running latency).

    Whole seconds (Kubernetes timestamps): enough to see whether the kubelet stand-in keeps up."""
    created, lat = [], []
    for ns in namespaces:
        for p in cp.request("GET", f"/api/v1/namespaces/{ns}/pods")["items"]:
            c = _ts(p["metadata"]["creationTimestamp"])
            created.append(c)
            if p.get("status", {}).get("startTime"):
                lat.append(_ts(p["status"]["startTime"]) - c)
    return (max(created) - min(created) if created else 0.0), lat


def describe_latency(span: float, lat: list[float]) -> str:
    if not lat:
        return "no pods"
    q = statistics.quantiles(lat, n=10) if len(lat) > 1 else [lat[0]] * 9
    return (f"pods created over {span:.0f} s; create->Running p50 {q[4]:.0f} s, p90 {q[8]:.0f} s, "
            f"max {max(lat):.0f} s")


@contextlib.contextmanager
def kubelet_stand_ins(cp: LocalControlPlane, namespaces: list[str], threads: int) -> Iterator[list[KubeletStandIn]]:
    """`threads` kubelet stand-ins, the namespaces dealt out among them (one thread is a bottleneck
    at thousands of pods: it patches one pod at a time)."""
    groups = [namespaces[i::threads] for i in range(max(1, threads))]
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(KubeletStandIn(cp, g)) for g in groups if g]


def check_kubelets(kubelets: Iterable[KubeletStandIn]) -> None:
    for k in kubelets:
        if k.errors:
            raise BenchError(f"kubelet stand-in failed: {k.errors[0]!r}")


# ---- phase 1: the baseline ------------------------------------------------------------------------
def fleet_names(fleets: int, namespaces: list[str]) -> list[tuple[str, str]]:
    return [(namespaces[i % len(namespaces)], f"f{i:04d}") for i in range(fleets)]


def baseline_objects(ns: str, name: str, ranks: int) -> list[dict[str, Any]]:
    fleet = make_ecs(name, ns).replicas(ranks).obj()
    objs = builders.fleet_children(fleet, dp_size=ranks, admin_token="benchmark-token")
    for obj in objs:  # no EngineCoreSet owns these: the garbage collector would delete them at once
        obj["metadata"].pop("ownerReferences", None)
    return objs


def collection_path(obj: dict[str, Any]) -> str:
    api_version, kind, ns = obj["apiVersion"], obj["kind"], obj["metadata"]["namespace"]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    return f"{base}/namespaces/{ns}/{PLURALS[kind]}"


def no_pending_pods(cp: LocalControlPlane, namespaces: Iterable[str]) -> bool:
    """True if no pod in these namespaces is outside phase Running (a cheap, server-filtered LIST)."""
    return not any(cp.request("GET", f"/api/v1/namespaces/{ns}/pods?fieldSelector=status.phase!=Running&limit=1")
                   ["items"] for ns in namespaces)


def all_pods_ready(cp: LocalControlPlane, namespaces: Iterable[str], expected: int) -> bool:
    count = 0
    for ns in namespaces:
        for p in cp.request("GET", f"/api/v1/namespaces/{ns}/pods")["items"]:
            conds = {c["type"]: c["status"] for c in p.get("status", {}).get("conditions", [])}
            if p["status"].get("phase") != "Running" or conds.get("Ready") != "True":
                return False
            count += 1
    return count == expected


def run_baseline(cp: LocalControlPlane, api: Api, namespaces: list[str], fleets: int, ranks: int,
                 workers: int, kubelet_threads: int, timeout: float) -> dict[str, float]:
    expected = fleets * (ranks + 2)
    work = [baseline_objects(ns, name, ranks) for ns, name in fleet_names(fleets, namespaces)]

    def create_fleet(objs: list[dict[str, Any]]) -> int:
        for obj in objs:  # one fleet's objects in order, as the operator applies them; fleets in parallel
            api.create(collection_path(obj), obj)
        return len(objs)

    with kubelet_stand_ins(cp, namespaces, kubelet_threads) as kubelets, \
            concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="baseline") as pool:
        t0 = time.monotonic()
        futures = [pool.submit(create_fleet, objs) for objs in work]
        posts_done = 0.0
        last_report = seen = t0

        def converged() -> bool:
            nonlocal posts_done, last_report, seen
            seen = time.monotonic()  # converged as of this poll's start (the LISTs below take time)
            check_kubelets(kubelets)
            done = [f for f in futures if f.done()]
            for f in done:
                f.result()  # a failed POST is an error
            if time.monotonic() - last_report > 15:
                last_report = time.monotonic()
                log(f"  baseline: t={last_report - t0:.0f} s, {len(done)}/{fleets} fleets posted, "
                    f"{api.pod_states(namespaces)}")
            if len(done) < len(futures):
                return False
            posts_done = posts_done or time.monotonic() - t0
            return no_pending_pods(cp, namespaces) and all_pods_ready(cp, namespaces, expected)

        wait_until(converged, timeout, "baseline pods Running/Ready", interval=POLL)
        t_base = seen - t0
    check_kubelets(kubelets)
    span, lat = pod_latencies(cp, namespaces)
    log(f"baseline converged in {t_base:.1f} s (all POSTs done at {posts_done:.1f} s); {describe_latency(span, lat)}")
    return {"t_base": t_base, "posts_done": posts_done, "objects": float(sum(len(w) for w in work))}


# ---- phase 2: the operator ------------------------------------------------------------------------
class Operator:
    """`python -m corefleet_operator` as a child process, with its liveness and metrics endpoints."""

    def __init__(self, cp: LocalControlPlane, namespaces: list[str], resync: float, log_path: Path) -> None:
        port = free_port()
        self.health = f"http://127.0.0.1:{free_port()}/healthz"
        self.metrics_url = f"http://127.0.0.1:{port}/metrics"
        self.log_path = log_path
        argv = [sys.executable, "-m", "corefleet_operator", f"--liveness={self.health}",
                f"--metrics-port={port}", "--metrics-address=127.0.0.1", f"--resync-seconds={resync:g}",
                *(f"--namespace={ns}" for ns in namespaces)]
        self._logf = log_path.open("wb")
        self.proc = subprocess.Popen(argv, env=cp.env(), stdout=self._logf, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise BenchError(f"operator exited with {self.proc.returncode}; log {self.log_path}:\n"
                             f"{tail(self.log_path)}")

    def wait_healthy(self, timeout: float = 120) -> None:
        def healthy() -> bool:
            self.check_alive()
            return http_get(self.health, 2, unanswered_ok=True)[0] == 200

        wait_until(healthy, timeout, "operator liveness", interval=0.2)

    def metrics(self) -> dict[tuple[str, ...], float]:
        """The operator's counters: ("reconciles", result) and ("api", verb, resource, code)."""
        self.check_alive()
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            text = r.read().decode()
        out: dict[tuple[str, ...], float] = {}
        for name, labels, value in parse_prometheus(text, ("corefleet_reconciles_total",
                                                             "corefleet_api_requests_total")):
            if name == "corefleet_reconciles_total":
                out[("reconciles", labels["result"])] = value
            else:
                out[("api", labels["verb"], labels["resource"], labels["code"])] = value
        return out

    def rss_kib(self) -> tuple[int, int]:
        """(VmRSS, VmHWM) of the operator process, in KiB."""
        fields = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0])
        return fields["VmRSS"], fields["VmHWM"]

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._logf.close()
        return self.proc.returncode


def parse_prometheus(text: str, names: Iterable[str]) -> Iterable[tuple[str, dict[str, str], float]]:
    wanted = tuple(f"{n}{{" for n in names)
    for line in text.splitlines():
        if line.startswith(wanted):
            name, _, rest = line.partition("{")
            labels_text, _, value = rest.rpartition("} ")
            labels = {k: v for k, v in re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels_text)}
            yield name, labels, float(value.split()[0])


def apiserver_writes(cp: LocalControlPlane) -> Counter[tuple[str, str, str]]:
    """apiserver_request_total of write verbs on the operator's resources, by (verb, resource, subresource)."""
    text = cp.request("GET", "/metrics", raw=True).decode()
    out: Counter[tuple[str, str, str]] = Counter()
    for _, labels, value in parse_prometheus(text, ("apiserver_request_total",)):
        if labels.get("verb") in WRITE_VERBS and labels.get("resource") in WATCHED_RESOURCES:
            out[(labels["verb"], labels["resource"], labels.get("subresource", ""))] += int(value)
    return out


def delta(after: Mapping[Any, float], before: Mapping[Any, float]) -> dict[Any, float]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def reconciles(m: dict[tuple[str, ...], float]) -> float:
    return sum(v for k, v in m.items() if k[0] == "reconciles")


def api_requests(m: dict[tuple[str, ...], float], writes_only: bool = False) -> float:
    return sum(v for k, v in m.items() if k[0] == "api" and (not writes_only or k[1] in WRITE_VERBS))


def fleets_running(cp: LocalControlPlane, ranks: int) -> Counter[str]:
    """Phases of every EngineCoreSet; "Running" counts only those with all ranks ready."""
    phases: Counter[str] = Counter()
    for ecs in cp.request("GET", f"{ECS_PATH}/{constants.PLURAL}")["items"]:
        st = ecs.get("status") or {}
        phase = st.get("phase") or "(none)"
        if phase == "Running" and st.get("readyReplicas") != ranks:
            phase = "Running(not all ready)"
        phases[phase] += 1
    return phases


def run_operator(cp: LocalControlPlane, api: Api, op: Operator, namespaces: list[str], fleets: int, ranks: int,
                 workers: int, kubelet_threads: int, timeout: float) -> dict[str, float]:
    manifests = [make_ecs(name, ns).replicas(ranks).manifest() for ns, name in fleet_names(fleets, namespaces)]
    with kubelet_stand_ins(cp, namespaces, kubelet_threads) as kubelets, \
            concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="ecs") as pool:
        t0 = time.monotonic()
        futures = [pool.submit(api.create, f"{ECS_PATH}/namespaces/{m['metadata']['namespace']}/{constants.PLURAL}", m)
                   for m in manifests]
        last_report = seen = t0

        def converged() -> bool:
            nonlocal last_report, seen
            seen = time.monotonic()  # converged as of this poll's start, as in the baseline
            op.check_alive()
            check_kubelets(kubelets)
            for f in futures:
                if f.done():
                    f.result()
            phases = fleets_running(cp, ranks)
            if time.monotonic() - last_report > 15:
                last_report = time.monotonic()
                log(f"  operator: t={last_report - t0:.0f} s, fleets {dict(sorted(phases.items()))}, "
                    f"{api.pod_states(namespaces)}")
            return phases["Running"] == fleets

        wait_until(converged, timeout, f"{fleets} EngineCoreSets Running with {ranks} ready ranks", interval=POLL)
        t_op = seen - t0
    check_kubelets(kubelets)
    span, lat = pod_latencies(cp, namespaces)
    log(f"operator converged in {t_op:.1f} s; {describe_latency(span, lat)}")
    return {"t_op": t_op}


def idle_window(cp: LocalControlPlane, op: Operator, fleets: int, resync: float) -> dict[str, Any]:
    """Settle for one resync of every fleet, then measure over at least two more."""
    deadline = 10 * resync + 120

    def after(n: float, since: dict[tuple[str, ...], float]) -> Callable[[], bool]:
        return lambda: reconciles(op.metrics()) - reconciles(since) >= n

    settle_start = op.metrics()
    settle_api = apiserver_writes(cp)
    wait_until(after(fleets, settle_start), deadline, f"{fleets} reconciles (settling)", interval=POLL)
    m0, w0, t0 = op.metrics(), apiserver_writes(cp), time.monotonic()
    settle_writes = sum(delta(w0, settle_api).values())
    wait_until(after(2 * fleets, m0), deadline, f"{2 * fleets} idle reconciles", interval=POLL)
    m1, w1, t1 = op.metrics(), apiserver_writes(cp), time.monotonic()
    return {"ops": delta(m1, m0), "server": delta(w1, w0), "seconds": t1 - t0, "settle_writes": settle_writes}


# ---- the run --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fleets", type=int, default=200, help="EngineCoreSets (default 200)")
    p.add_argument("--ranks", type=int, default=16, help="engine ranks per fleet (default 16)")
    p.add_argument("--namespaces", type=int, default=10, help="namespaces the fleets are spread over (default 10)")
    p.add_argument("--gpus-per-node", type=int, default=128, help="nvidia.com/gpu of each fake node")
    p.add_argument("--resync-seconds", type=float, default=10.0, help="the operator's --resync-seconds")
    p.add_argument("--kubelet-threads", type=int, default=0,
                   help="kubelet stand-in threads, namespaces dealt out among them (default: one per namespace)")
    p.add_argument("--workers", type=int, default=8, help="the benchmark's parallel POST clients")
    p.add_argument("--timeout", type=float, default=3600.0, help="deadline of each convergence, seconds")
    p.add_argument("--state-dir", help="keep the control plane's state and the operator log here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fleets < 1 or args.ranks < 1 or args.namespaces < 1:
        print("--fleets, --ranks and --namespaces must be at least 1", file=sys.stderr)
        return 2
    nss = min(args.namespaces, args.fleets)
    args.kubelet_threads = min(args.kubelet_threads or nss, nss)
    if args.state_dir and Path(args.state_dir).exists() and any(Path(args.state_dir).iterdir()):
        print(f"--state-dir {args.state_dir} is not empty (a new cluster needs a new directory)", file=sys.stderr)
        return 2
    started = time.monotonic()
    tmp = None if args.state_dir else tempfile.TemporaryDirectory(prefix="corefleet-bench-")
    state = Path(tmp.name if tmp is not None else args.state_dir)
    operators: list[Operator] = []  # the one started, for its log if something fails
    try:
        cp = LocalControlPlane(state_dir=state / "cluster", bin_dir=resolve_bin_dir())
        with cp:
            return _run(cp, args, nss, state, started, operators.append)
    except (BenchError, ControlPlaneError, TimeoutError, urllib.error.HTTPError) as e:
        detail = f"{e}: {e.read().decode(errors='replace')}" if isinstance(e, urllib.error.HTTPError) else str(e)
        print(f"bench_operator_scale: ERROR: {detail}", file=sys.stderr, flush=True)
        for op in operators:
            print(f"operator log {op.log_path} (tail):\n{tail(op.log_path)}", file=sys.stderr)
        return 1
    finally:
        if tmp is not None:
            tmp.cleanup()


def _run(cp: LocalControlPlane, args: argparse.Namespace, nss: int, state: Path, started: float,
         remember: Callable[[Operator], None]) -> int:
    fleets, ranks = args.fleets, args.ranks
    nodes, gpus, pods = node_plan(fleets, ranks, args.gpus_per_node)
    log(f"control plane up at {cp.server} ({time.monotonic() - started:.1f} s); registering {nodes} nodes "
        f"x {args.gpus_per_node} GPUs for {gpus} GPUs and {pods} pods")
    for i in range(nodes):
        add_gpu_node(cp, f"gpu-node-{i:03d}", gpus=args.gpus_per_node)
    cp.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(crd.crd()))
    cp.kubectl("wait", "--for=condition=Established", f"crd/{constants.PLURAL}.{constants.GROUP}", "--timeout=60s")
    api = Api(cp)

    base_ns = [f"bench-base-{i}" for i in range(nss)]
    op_ns = [f"bench-op-{i}" for i in range(nss)]
    create_namespaces(cp, base_ns)
    log(f"baseline: POSTing {fleets} fleets' objects ({pods} pods) over {nss} namespaces, {args.workers} clients, "
        f"{args.kubelet_threads} kubelet stand-in threads")
    base = run_baseline(cp, api, base_ns, fleets, ranks, args.workers, args.kubelet_threads, args.timeout)
    # Fair comparison: both phases start on an empty cluster (same nodes, no pods), each with its own
    # kubelet stand-in over its own namespaces only, the same polling and the same POST clients.
    delete_namespaces(cp, base_ns)
    create_namespaces(cp, op_ns)

    op = Operator(cp, op_ns, args.resync_seconds, state / "operator.log")
    remember(op)
    try:
        op.wait_healthy()
        rss_empty, _ = op.rss_kib()
        m_start = op.metrics()
        log(f"operator healthy (pid {op.proc.pid}, RSS {rss_empty / 1024:.0f} MiB); creating {fleets} EngineCoreSets")
        res = run_operator(cp, api, op, op_ns, fleets, ranks, args.workers, args.kubelet_threads, args.timeout)
        rss, hwm = op.rss_kib()
        m_conv = op.metrics()
        log(f"operator RSS {rss / 1024:.0f} MiB (peak {hwm / 1024:.0f} MiB); idle window: waiting for "
            f"{fleets} settling + {2 * fleets} idle reconciles (resync {args.resync_seconds:g} s)")
        idle = idle_window(cp, op, fleets, args.resync_seconds)
        rss_after_idle, hwm = op.rss_kib()
    finally:
        rc = op.stop()
    if rc not in (0, -signal.SIGTERM):
        raise BenchError(f"operator exited with {rc} on SIGTERM; log {op.log_path}:\n{tail(op.log_path)}")
    tracebacks = op.log_path.read_text(errors="replace").count("Traceback")

    conv = delta(m_conv, m_start)
    conv_errors = sum(v for k, v in conv.items() if k == ("reconciles", "error"))
    conv_by_verb = Counter[str]()
    for k, v in conv.items():
        if k[0] == "api":
            conv_by_verb[f"{k[1]} {k[2]}" + (f" {k[3]}" if not k[3].startswith("2") else "")] += int(v)
    ops = idle["ops"]
    n_idle = reconciles(ops)
    idle_requests = api_requests(ops)
    idle_writes = api_requests(ops, writes_only=True)
    server_writes = sum(idle["server"].values())
    ratio = res["t_op"] / base["t_base"]
    goal = "GOAL MET (0 writes)" if idle_writes == 0 and server_writes == 0 else \
        f"GOAL MISSED ({int(idle_writes)} operator writes, {server_writes} API-server writes; goal 0)"

    print()
    print("details:")
    print(f"  fair comparison: both phases start on an empty cluster (the baseline's namespaces are force-emptied "
          f"and deleted first), on the same {nodes} nodes, each with {args.kubelet_threads} kubelet stand-in "
          f"threads over its own namespaces only, {args.workers} POST clients and {POLL} s polls")
    print(f"  baseline objects POSTed: {int(base['objects'])}; all POSTs done at {base['posts_done']:.1f} s")
    print(f"  operator during convergence: {int(reconciles(conv))} reconciles ({int(conv_errors)} failed), "
          f"{int(api_requests(conv))} API requests: {dict(sorted(conv_by_verb.items()))}")
    print(f"  operator RSS before any fleet: {rss_empty / 1024:.1f} MiB; after the idle window: "
          f"{rss_after_idle / 1024:.1f} MiB")
    print(f"  API-server writes while settling (one resync after convergence): {idle['settle_writes']}")
    if idle["server"]:
        print(f"  API-server writes in the idle window by verb/resource/subresource: "
              f"{ {' '.join(filter(None, k)): v for k, v in sorted(idle['server'].items())} }")
    if ops:
        print(f"  operator counters in the idle window: { {' '.join(k): int(v) for k, v in sorted(ops.items())} }")
    print(f"  operator log: {op.log_path if args.state_dir else '(temp dir, removed)'}; tracebacks in it: "
          f"{tracebacks}")
    print()
    print(f"corefleet operator scale benchmark: {fleets} fleets x {ranks} ranks ({pods} pods, "
          f"{nss} namespaces, {nodes} nodes)")
    print(f"baseline (direct creates): {base['t_base']:.1f} s; operator converge: {res['t_op']:.1f} s; "
          f"ratio {ratio:.2f}")
    print(f"operator RSS: {rss / 1024:.1f} MiB (peak {hwm / 1024:.1f} MiB), "
          f"{(rss - rss_empty) / fleets:.0f} KiB per fleet over the empty operator ({rss / fleets:.0f} KiB "
          f"per fleet in all)")
    print(f"idle: {int(n_idle)} reconciles in {idle['seconds']:.1f} s; operator requests per idle reconcile: "
          f"{idle_requests / n_idle:.3f} (writes: {idle_writes / n_idle:.3f}); API server writes in window: "
          f"{server_writes}  -> {goal}")
    print(f"wall time: {time.monotonic() - started:.0f} s")
    if conv_errors or tracebacks:
        print(f"NOTE: {int(conv_errors)} failed reconciles and {tracebacks} tracebacks in the operator log")
    return 0


if __name__ == "__main__":
    sys.exit(main())
