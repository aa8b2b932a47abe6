# SPDX-License-Identifier: Apache-2.0
"""Helpers for e2e tests of operator-run fleets (import as `from fleettest import ...`).

* `OperatorProcess`: the operator as its own process (`python -m corefleet_operator`), which a test
  can kill with SIGKILL and start again, with its log kept and checked for tracebacks;
* `FleetView`: one EngineCoreSet on the control plane, its pods, events and frontend admin API;
* `Load`: a client sending a continuous mix of streaming and non-streaming completions to the
  frontend, recording every outcome;
* `ResizeWatch`: polls the EngineCoreSet, the frontend's resize and the pods in a thread, so that a
  test can check the order things happened in (phases seen, when a rank was retired and when its
  pod was deleted).
"""

from __future__ import annotations

import base64
import http.client
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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corefleet_client.admin import AdminClient, AdminError, ResizeOperation
from corefleet_harness.localcluster import LocalControlPlane
from corefleet_harness.support import tail, wait_until
from corefleet_harness.tinymodel import VLLM_CPU_FLAGS
from corefleet_operator import constants
from podrunner import PodRunner

ECS_PATH = "/apis/corefleet.io/v1alpha1/namespaces/{ns}/enginecoresets/{name}"
ADMIN_READ_TIMEOUT_S = 30.0  # FleetView.admin's calls
WATCH_ADMIN_TIMEOUT_S = 5.0  # ResizeWatch's


def ecs_engine_args(served: str, context: int | None = None) -> list[str]:
    """VLLM_CPU_FLAGS as an EngineCoreSet's `spec.engine.args`: without `--load-format dummy` (corefleet sets
    --load-format from spec.engine.loadFormat), with `--max-model-len context` if given, and a served name."""
    flags = list(VLLM_CPU_FLAGS)
    i = flags.index("--load-format")
    del flags[i:i + 2]
    if context is not None:
        flags[flags.index("--max-model-len") + 1] = str(context)
    return [*flags, "--served-model-name", served]


class OperatorProcess:
    """`python -m corefleet_operator -n NS` against the test cluster, restartable."""

    def __init__(self, k8s: LocalControlPlane, namespace: str, log_dir: Path, resync_seconds: float = 10.0,
                 metrics_port: int = 0, kubeconfig: Path | None = None) -> None:
        self.k8s, self.ns, self.log_dir = k8s, namespace, log_dir
        self.resync_seconds = resync_seconds
        self.metrics_port = metrics_port  # 0: no metrics endpoint
        self.kubeconfig = kubeconfig  # whose identity it runs with (default: the cluster admin's)
        self.proc: subprocess.Popen[bytes] | None = None
        self.logs: list[Path] = []

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        log = self.log_dir / f"operator-{len(self.logs)}.log"
        self.logs.append(log)
        with log.open("wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "corefleet_operator", "-n", self.ns, "--liveness", "",
                 "--metrics-port", str(self.metrics_port), "--metrics-address", "127.0.0.1",
                 "--resync-seconds", str(self.resync_seconds)],
                env={**self.k8s.env(), "PYTHONUNBUFFERED": "1",
                     **({"KUBECONFIG": str(self.kubeconfig)} if self.kubeconfig else {})},
                stdout=f, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)

    def kill(self) -> None:
        """SIGKILL, as a node failure or an OOM kill would stop it: no cleanup, no last write."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def output(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.logs if p.exists())

    def check_clean(self) -> None:
        """No traceback in any run's log (a kill leaves none: it gets no chance to write one)."""
        text = self.output()
        assert "Traceback" not in text, tail(self.logs[-1], 80)

    def __enter__(self) -> OperatorProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FleetView:
    """One EngineCoreSet, its pods and its frontend, as a test sees them."""

    def __init__(self, k8s: LocalControlPlane, namespace: str, name: str, runner: PodRunner | None,
                 model: str) -> None:
        """`runner`: the pod runner the fleet's pods run under; None on a real node (logs from `kubectl logs`)."""
        self.k8s, self.ns, self.name, self.runner, self.model = k8s, namespace, name, runner, model

    def ecs(self) -> dict[str, Any]:
        obj: dict[str, Any] = self.k8s.request("GET", ECS_PATH.format(ns=self.ns, name=self.name))
        return obj

    def status(self) -> dict[str, Any]:
        st: dict[str, Any] = self.ecs().get("status", {})
        return st

    def pods(self) -> dict[str, dict[str, Any]]:
        items = self.k8s.request(
            "GET", f"/api/v1/namespaces/{self.ns}/pods?labelSelector={constants.LABEL_FLEET}={self.name}")["items"]
        return {p["metadata"]["name"]: p for p in items}

    def events(self) -> list[tuple[str, str]]:
        """(reason, message) of the EngineCoreSet's events, in the order they were recorded."""
        items = self.k8s.request("GET", f"/api/v1/namespaces/{self.ns}/events")["items"]
        mine = [e for e in items if e["involvedObject"].get("name") == self.name
                and e["involvedObject"].get("kind") == constants.KIND]
        mine.sort(key=lambda e: int(e["metadata"]["resourceVersion"]))
        return [(e["reason"], e["message"]) for e in mine]

    def scale(self, replicas: int) -> None:
        """`kubectl scale ecs` (the scale subresource, as an HPA uses it)."""
        self.k8s.kubectl("scale", "-n", self.ns, f"ecs/{self.name}", f"--replicas={replicas}")

    def get_ecs(self) -> str:
        """`kubectl get ecs NAME` as a user reads it."""
        return self.k8s.kubectl("get", "-n", self.ns, "ecs", self.name).stdout

    def frontend_ip(self, index: int = 0) -> str:
        ip: str = self.pods()[constants.frontend_name(self.name, index)]["status"]["podIP"]
        return ip

    def frontends(self) -> int:
        """spec.frontend.replicas."""
        return int((self.ecs()["spec"].get("frontend") or {}).get("replicas", 1))

    def admin(self, index: int = 0, timeout: float = ADMIN_READ_TIMEOUT_S) -> AdminClient:
        """Frontend `index`'s admin API (frontend 0's takes resizes)."""
        secret_name = constants.admin_secret_name(self.name)
        secret = self.k8s.request("GET", f"/api/v1/namespaces/{self.ns}/secrets/{secret_name}")
        token = base64.b64decode(secret["data"][constants.ADMIN_TOKEN_KEY]).decode().strip()
        # A test reads what the frontend says, however slowly it says it: in CI, with real engines busy-polling beside
        # the frontend pods (100m CPU requests), a frontend's admin thread once took over 5 s to answer (the
        # operator's own calls time out at 5 s and are retried; the kubelet's liveness probe fails only after three
        # 5 s timeouts in a row).
        return AdminClient(f"http://{self.frontend_ip(index)}:{constants.FRONTEND_ADMIN_PORT}", token,
                           timeout=timeout)

    def engine_pid(self, rank: int) -> int:
        assert self.runner is not None, "engine_pid: pods run by a pod runner only"
        popen = self.runner.pod(constants.engine_name(self.name, rank)).popen
        assert popen is not None
        return popen.pid

    def settled(self, replicas: int) -> bool:
        """Running at `replicas`, no resize in flight, exactly the member pods, every one Ready."""
        st = self.status()
        op = st.get("operation") or {}
        if st.get("phase") != "Running" or st.get("replicas") != replicas or st.get("readyReplicas") != replicas:
            return False
        if op and op.get("phase") not in ("Completed", "Failed"):
            return False
        pods = self.pods()
        want = {constants.coordinator_name(self.name), *constants.frontend_names(self.name, self.frontends()),
                *(constants.engine_name(self.name, r) for r in range(replicas))}
        return set(pods) == want and all(
            not p["metadata"].get("deletionTimestamp")
            and {c["type"]: c["status"] for c in p["status"].get("conditions", [])}.get("Ready") == "True"
            for p in pods.values())

    def wait_settled(self, replicas: int, timeout: float, interval: float = 0.2) -> None:
        wait_until(lambda: self.settled(replicas), timeout, f"{self.name} Running at {replicas} ranks",
                   interval=interval, diagnose=self.describe)

    def at(self, replicas: int, timeout: float, interval: float = 0.2) -> None:
        """Where a test starts: the fleet scaled to `replicas`, whatever the test before it left (a resize that
        failed half-way), and settled there (a scale to the size it has changes nothing)."""
        self.scale(replicas)
        self.wait_settled(replicas, timeout, interval)

    def operation(self) -> dict[str, Any]:
        """`status.operation` ({} if none)."""
        op: dict[str, Any] = self.status().get("operation") or {}
        return op

    def wait_operation(self, *phases: str, timeout: float) -> dict[str, Any]:
        """Polls (every 50 ms: a phase may last a moment) until `status.operation` is in one of `phases`."""
        op: dict[str, Any] = wait_until(lambda: (o := self.operation()).get("phase") in phases and o, timeout,
                                        f"status.operation in {phases}", interval=0.05, diagnose=self.describe)
        return op

    def uids(self) -> dict[str, str]:
        """Pod name -> UID (a recreated pod has a new one)."""
        return {n: p["metadata"]["uid"] for n, p in self.pods().items()}

    def describe(self) -> str:
        st = self.status()
        return (f"status: {json.dumps(st, indent=1)}\nevents: {self.events()}\n"
                f"pods: {sorted(self.pods())}\n{self.log_tails(40)}")

    def log_tails(self, lines: int) -> str:
        if self.runner is not None:
            return self.runner.log_tails(lines)
        tails = []
        for name in sorted(self.pods()):
            r = self.k8s.kubectl("logs", "-n", self.ns, name, f"--tail={lines}", check=False)
            tails.append(f"--- {name} ---\n{r.stdout}{r.stderr}")
        return "\n".join(tails)


@dataclass
class Outcome:
    kind: str  # "stream" or "plain"
    ok: bool
    started: float
    latency: float
    detail: str = ""


@dataclass
class Load:
    """A continuous mix of streaming and non-streaming completions from `workers` threads."""

    url: str  # http://host:port
    model: str
    workers: int = 2
    max_tokens: int = 16
    pause_s: float = 0.05
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)  # on every request, e.g. X-data-parallel-rank

    def start(self) -> Load:
        for i in range(self.workers):
            t = threading.Thread(target=self._run, args=(i,), name=f"load-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)
        assert not any(t.is_alive() for t in self._threads), "a load worker hangs"

    def _run(self, worker: int) -> None:
        i = 0
        while not self._stop.is_set():
            stream = (i + worker) % 2 == 0
            t0 = time.monotonic()
            try:
                ok, detail = self._stream(i) if stream else self._plain(i)
            except (OSError, http.client.HTTPException, ValueError) as e:
                ok, detail = False, f"{type(e).__name__}: {e}"
            self.outcomes.append(Outcome("stream" if stream else "plain", ok, t0, time.monotonic() - t0, detail))
            i += 1
            self._stop.wait(self.pause_s)

    def _body(self, i: int, stream: bool) -> bytes:
        return json.dumps({"model": self.model, "prompt": f"Request {i}: once upon a time",
                           "max_tokens": self.max_tokens, "ignore_eos": True, "stream": stream}).encode()

    def _plain(self, i: int) -> tuple[bool, str]:
        req = urllib.request.Request(f"{self.url}/v1/completions", data=self._body(i, False),
                                     headers={"Content-Type": "application/json", **self.headers})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            return False, f"HTTP {e.code}: {e.read()[:300]!r}"
        reason = body["choices"][0]["finish_reason"]
        return reason == "length", f"finish_reason {reason}"

    def _stream(self, i: int) -> tuple[bool, str]:
        host, port = self.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        try:
            conn.request("POST", "/v1/completions", self._body(i, True),
                         {"Content-Type": "application/json", **self.headers})
            resp = conn.getresponse()
            if resp.status != 200:
                return False, f"HTTP {resp.status}: {resp.read()[:300]!r}"
            finish = None
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    return False, f"error event: {event['error']}"
                for choice in event.get("choices", ()):
                    finish = choice.get("finish_reason") or finish
            return finish == "length", f"finish_reason {finish}"
        finally:
            conn.close()

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    def summary(self) -> str:
        kinds = Counter((o.kind, o.ok) for o in self.outcomes)
        return f"{len(self.outcomes)} requests: {dict(kinds)}; failures: {[o.detail for o in self.failures()][:5]}"


# An event of a stream that neither ends it nor reports an error: not decoded (a long stream sends thousands, and a
# test reading several at once on a saturated machine starved its own threads decoding each).
_PLAIN_EVENT = re.compile(rb'"finish_reason":\s*null')


class PinnedStream:
    """One streaming completion pinned to a rank (`X-data-parallel-rank`), read to its end in a thread."""

    def __init__(self, url: str, model: str, rank: int, max_tokens: int) -> None:
        self.outcome: tuple[bool, str] | None = None
        self.first_token = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url, model, rank, max_tokens), daemon=True)
        self._thread.start()

    def _run(self, url: str, model: str, rank: int, max_tokens: int) -> None:
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=300)
        body = json.dumps({"model": model, "prompt": "A long story", "max_tokens": max_tokens, "ignore_eos": True,
                           "stream": True})
        try:
            conn.request("POST", "/v1/completions", body,
                         {"Content-Type": "application/json", "X-data-parallel-rank": str(rank)})
            resp = conn.getresponse()
            if resp.status != 200:
                self.outcome = (False, f"HTTP {resp.status}: {resp.read()[:300]!r}")
                return
            finish: str | None = None
            rest = b""
            while True:
                chunk = resp.read1(65536)
                *lines, rest = (rest + chunk).split(b"\n") if chunk else (rest, b"")
                for raw in lines:
                    line = raw.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    if b'"error"' not in line and _PLAIN_EVENT.search(line):
                        self.first_token.set()
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        self.outcome = (False, f"error event: {event['error']}")
                        return
                    self.first_token.set()
                    for choice in event.get("choices", ()):
                        finish = choice.get("finish_reason") or finish
                if not chunk:
                    break
            self.outcome = (finish == "length", f"finish_reason {finish}")
        except (OSError, http.client.HTTPException, ValueError) as e:
            self.outcome = (False, f"{type(e).__name__}: {e}")
        finally:
            self.first_token.set()
            conn.close()

    def result(self, timeout: float = 300) -> tuple[bool, str]:
        self._thread.join(timeout)
        assert self.outcome is not None, "the pinned stream did not end"
        return self.outcome


class LongStreams:
    """Keeps one long stream pinned to `rank` in flight per entry of `lengths` (its max_tokens), each that ends replaced
    at once by one as long, until a new one is refused or `stop()`: so that some are in flight when a drain of the
    rank begins, however late the drain comes on a busy machine. Streams of different lengths end at different
    times: a drain that begins while one is being replaced (CI: the node stalled for 7 s, and when it went on, the
    only stream ended and the operator began the drain in the same 150 ms) finds another in flight. Refused: a 503
    (the rank stopped taking requests, its drain began) or, for a stream sent just after the last one in flight ended
    the drain, vLLM's 400 for a rank the frontend no longer has (the scale-down committed first)."""

    def __init__(self, url: str, model: str, rank: int, lengths: tuple[int, ...]) -> None:
        self.streams: list[PinnedStream] = []
        self._url, self._model, self._rank = url, model, rank
        self._slots: list[PinnedStream | None] = [None] * len(lengths)
        self._lengths = lengths
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.refused():
                return
            for i, stream in enumerate(self._slots):
                if stream is None or stream.outcome is not None:
                    new = PinnedStream(self._url, self._model, self._rank, self._lengths[i])
                    self._slots[i] = new
                    self.streams.append(new)
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def started(self) -> int:
        """Streams that got their first token (or ended)."""
        return sum(s.first_token.is_set() for s in self.streams)

    def refused(self) -> list[PinnedStream]:
        """Streams the rank did not take: a 503, as the HTTP status or (vLLM streams its errors) the first event, or
        the 400 for a rank out of the frontend's range."""
        return [s for s in list(self.streams) if s.outcome is not None and not s.outcome[0]
                and (s.outcome[1].startswith("HTTP 503") or "'code': 503" in s.outcome[1]
                     or f"data_parallel_rank {self._rank} is out of range" in s.outcome[1])]

    def served(self) -> list[PinnedStream]:
        """Every stream the rank took: all but the refused ones."""
        refused = self.refused()
        return [s for s in list(self.streams) if s not in refused]


class ResizeWatch:
    """Polls the fleet in a thread while a resize runs; keeps what it saw, in order."""

    def __init__(self, fleet: FleetView, interval: float = 0.1) -> None:
        self.fleet = fleet
        self.interval = interval
        self.phases: list[str] = []  # status.operation.phase, consecutive repeats dropped
        self.fleet_phases: list[str] = []  # status.phase, likewise
        self.retired_at: dict[int, float] = {}  # rank -> when the frontend first reported it Retired
        self.deleted_at: dict[str, float] = {}  # pod -> when it was first seen terminating or gone
        self.errors: list[str] = []
        self._admin: AdminClient | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="resize-watch", daemon=True)
        self._pods: set[str] = set()

    def __enter__(self) -> ResizeWatch:
        # A short timeout: a poll blocked on a slow frontend would miss the status's phases meanwhile (a call that
        # times out is one of `errors`, and the next poll comes at once).
        self._admin = self.fleet.admin(timeout=WATCH_ADMIN_TIMEOUT_S)
        self._pods = set(self.fleet.pods())
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self._poll()  # what the test saw last is seen here too

    def _run(self) -> None:
        while not self._stop.is_set():
            self._poll()
            self._stop.wait(self.interval)

    def _poll(self) -> None:
        now = time.monotonic()
        try:
            st = self.fleet.status()
            op = st.get("operation") or {}
            for seq, value in ((self.phases, op.get("phase")), (self.fleet_phases, st.get("phase"))):
                if value and (not seq or seq[-1] != value):
                    seq.append(value)
            assert self._admin is not None
            if op.get("id"):
                seen: ResizeOperation | None = self._admin.resize(op["id"])
                for r in (seen.ranks if seen is not None else ()):
                    if r.state == "Retired":
                        self.retired_at.setdefault(r.rank, now)
            pods = self.fleet.pods()
            for name in self._pods:
                pod = pods.get(name)
                if pod is None or pod["metadata"].get("deletionTimestamp"):
                    self.deleted_at.setdefault(name, now)
            self._pods |= set(pods)
        except (OSError, AdminError, ValueError, KeyError) as e:
            self.errors.append(f"{type(e).__name__}: {e}")
