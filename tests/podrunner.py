# SPDX-License-Identifier: Apache-2.0
"""A process kubelet for the e2e tier: runs each pod bound in a namespace as a local process.

`PodRunner(cp, namespace, work_dir)` polls the namespace's pods in a thread and, for each pod the
scheduler bound to a node, does what a kubelet and a cluster's DNS would:

1. gives it its own loopback address 127.0.0.N, so that every pod can bind the fleet's fixed ports,
   and records its DNS name `<hostname>.<subdomain>.<namespace>.svc` -> that address (a pod that replaces a
   gone one of the same DNS name gets the same address, as cluster DNS would point the name at it);
2. starts its (single) container's command once every pod DNS name its args name is known:
   `python` is this interpreter; env from the container (downward API: POD_IP, POD_NAME,
   POD_NAMESPACE); `$(VAR)` expanded in args as the kubelet does; pod DNS names and `0.0.0.0`
   replaced by addresses; Secret volumes written to a directory whose path replaces the mount
   path in args; the launchers' own listeners (`--health-host`, `--admin-host`) put on the pod's
   address. Each process gets its own session and a log file `<work_dir>/logs/<pod>-<uid>.log`;
3. runs the container's probes as the kubelet's prober does (below), and reports the pod Running
   with its address, `started` from the startupProbe, and Ready (`ContainersReady`, `Ready`,
   `containerStatuses[].ready`) from the readinessProbe; Failed or Succeeded with the exit code
   when the process exits (whatever else is left in its process group is killed, as a
   container's processes die with it);
4. on deletion, runs the container's preStop hook (in a thread, for at most the deletion's grace period:
   `deletionGracePeriodSeconds`, else the pod's), then SIGTERMs the process group, SIGKILLs it after what is
   left of the grace period (at least 2 s, as the kubelet), and then removes the pod (a pod that vanished from
   the API is stopped the same way, without the hook).

Probes (kubelet `pkg/kubelet/prober/worker.go` semantics): each of the container's
`startupProbe`, `readinessProbe` and `livenessProbe` (`httpGet`, `tcpSocket` or `exec`) gets its own
thread, so that a probe waiting out its `timeoutSeconds` blocks neither the pod's other probes nor
the runner. A probe runs first `initialDelaySeconds` after the container started, then every
`periodSeconds`, each attempt bounded by `timeoutSeconds`; its result changes only after
`successThreshold` (or `failureThreshold`) consecutive attempts agree. Readiness and liveness run
only once the startup probe has succeeded (the startup probe then stops); until readiness succeeds
the container is not ready (with no readinessProbe it is ready once started). A liveness or startup
probe that fails `failureThreshold` times in a row kills the container: SIGTERM to its process
group, SIGKILL after the pod's `terminationGracePeriodSeconds` (or the probe's own, capped by
`grace`), so a hung process ends with exit code 137; pods are `restartPolicy: Never` (no
container restarts here), so the pod ends Failed (Succeeded if the process exits 0 on SIGTERM).
`httpGet` succeeds on a status in 200..399 (redirects are not followed), `tcpSocket` on a
connection, `exec` (run on this host with the container's env; `python` is this interpreter) on
exit status 0. Each attempt is logged in `probe_log`; state changes and kills are also posted as
the kubelet's `Unhealthy` and `Killing` Events on the pod.

Test-only knobs: `engine` runs another module in place of an engine container's
`corefleet_client.engine` (the emulator: as another image would), and the pods named in `hold` are
bound but never started (as if their image never pulled).

`close()` stops everything it started. Errors of the loop and of the probe threads are kept in
`errors`; `exits` records when each container's exit was reported, and with which code.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import logging
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from corefleet_client import commands
from corefleet_harness.emulator import EMULATOR_MODULE
from corefleet_harness.localcluster import LocalControlPlane
from corefleet_harness.support import tail

logger = logging.getLogger(__name__)

LAUNCHER_HOST_FLAGS = {  # the launchers' own listeners bind 0.0.0.0 unless told otherwise
    commands.ENGINE_MODULE: "--health-host",
    EMULATOR_MODULE: "--health-host",
    commands.FRONTEND_MODULE: "--admin-host",
}
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)|\$\$")

STARTUP, READINESS, LIVENESS = "startup", "readiness", "liveness"
PROBE_FIELDS = {STARTUP: "startupProbe", READINESS: "readinessProbe", LIVENESS: "livenessProbe"}
PROBE_LOG_MAX = 10000  # attempts kept in `probe_log` (the oldest are dropped)
ADDRESS_WAIT_S = 30.0  # how long a successor pod waits for its predecessor's address to be bindable again


@dataclass(frozen=True)
class Probe:
    """One container probe with the API's defaults filled in."""

    kind: str  # startup, readiness or liveness
    action: Mapping[str, Any]  # {"httpGet": ...}, {"tcpSocket": ...} or {"exec": ...}
    initial_delay: float = 0.0
    period: float = 10.0
    timeout: float = 1.0
    success_threshold: int = 1
    failure_threshold: int = 3
    grace: float | None = None  # the probe's own terminationGracePeriodSeconds

    @classmethod
    def parse(cls, kind: str, probe: Mapping[str, Any]) -> Probe:
        actions = [k for k in ("httpGet", "tcpSocket", "exec", "grpc") if k in probe]
        if len(actions) != 1 or actions[0] == "grpc":
            raise ValueError(f"unsupported {PROBE_FIELDS[kind]} {dict(probe)}: one of httpGet, tcpSocket, exec")
        grace = probe.get("terminationGracePeriodSeconds")
        return cls(kind, {actions[0]: probe[actions[0]]},
                   initial_delay=float(probe.get("initialDelaySeconds", 0)),
                   period=float(probe.get("periodSeconds", 10)),
                   timeout=float(probe.get("timeoutSeconds", 1)),
                   success_threshold=int(probe.get("successThreshold", 1)),
                   failure_threshold=int(probe.get("failureThreshold", 3)),
                   grace=None if grace is None else float(grace))


@dataclass(frozen=True)
class ProbeAttempt:
    """One probe run, as `PodRunner.probe_log` keeps it."""

    at: float  # time.monotonic() when it ended (before its result was applied)
    pod: str
    uid: str
    kind: str
    ok: bool
    detail: str
    changed: bool  # the probe's result changed with this attempt (its threshold was reached)


@dataclass
class _Pod:
    name: str
    uid: str
    ip: str
    dns: str
    pod: dict[str, Any]
    popen: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    logfile: IO[bytes] | None = None
    started_at: str = ""
    started_mono: float = 0.0
    exit_reported: bool = False
    term_sent_at: float | None = None
    prestop_started_at: float | None = None  # the container's preStop hook runs (deletion seen)
    prestop_done: threading.Event = field(default_factory=threading.Event)
    env: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    # Written by the probe threads under `lock`, read by the runner's loop.
    lock: threading.Lock = field(default_factory=threading.Lock)
    started: bool = False  # the startup probe succeeded (or there is none)
    ready: bool = False  # the readiness probe's result (with none: started)
    kill_reason: str = ""  # a liveness or startup probe failed: the container is being killed
    kill_grace: float = 0.0
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message) to post
    reported: tuple[bool, bool] | None = None  # (started, ready) last written to the pod's status
    probes_stop: threading.Event = field(default_factory=threading.Event)
    started_event: threading.Event = field(default_factory=threading.Event)
    probe_threads: list[threading.Thread] = field(default_factory=list)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def expand(value: str, env: Mapping[str, str]) -> str:
    """The kubelet's `$(VAR)` expansion: known variables are replaced, `$$` is a literal `$`."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _VAR.sub(sub, value)


class PodRunner:
    def __init__(self, cp: LocalControlPlane, namespace: str, work_dir: Path, *, interval: float = 0.2,
                 grace: float = 20.0, extra_env: Callable[[Mapping[str, Any]], Mapping[str, str]] | None = None,
                 engine: tuple[str, ...] = ()) -> None:
        """`engine`: what runs in place of an engine container's module (`corefleet_client.engine`):
        `(module, *launcher flags)`, e.g. the emulator with its token delay, as another image would."""
        self._cp, self.ns, self.work_dir = cp, namespace, work_dir
        self._interval, self._grace, self._extra_env = interval, grace, extra_env
        self._engine = engine
        self.hold: set[str] = set()  # pods bound but never started (as if their image never pulled)
        self.pods: dict[str, _Pod] = {}  # by uid
        self.names: dict[str, str] = {}  # pod DNS name -> address
        self._last_address: dict[str, str] = {}  # pod DNS name -> the address of its last, deleted pod
        self._address_wait: dict[str, float] = {}  # pod DNS name -> since when its successor waits for that address
        self.address_changes: list[str] = []  # successors that got a new address after all (a name that moved)
        self.errors: list[BaseException] = []
        self.probe_log: list[ProbeAttempt] = []  # every probe attempt, in order
        self.exits: dict[str, tuple[float, int]] = {}  # pod uid -> (time.monotonic(), exit code) as reported
        self._next_host = 2
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pod-runner", daemon=True)
        (work_dir / "logs").mkdir(parents=True, exist_ok=True)

    # ---- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> PodRunner:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the loop, then every process it started (SIGTERM, SIGKILL after the grace period)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)
        for p in self.pods.values():
            p.probes_stop.set()
            self._signal(p, signal.SIGTERM)
        deadline = time.monotonic() + self._grace
        for p in self.pods.values():
            if p.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(max(0.1, deadline - time.monotonic()))
            self._signal(p, signal.SIGKILL)
            if p.popen is not None:
                p.popen.wait()
            if p.logfile is not None:
                p.logfile.close()
        for p in self.pods.values():
            for t in p.probe_threads:
                t.join(10)  # an attempt in flight ends within its timeout

    def pod(self, name: str) -> _Pod:
        """The live (not terminating) pod of that name that this runner started."""
        return next(p for p in self.pods.values()
                    if p.name == name and p.popen is not None and not p.pod["metadata"].get("deletionTimestamp"))

    def pod_log(self, name: str) -> str:
        """The log of the last pod of that name that this runner started."""
        logs = [p.log for p in self.pods.values() if p.name == name and p.log is not None]
        return logs[-1].read_text(errors="replace") if logs else ""

    def log_tails(self, lines: int = 30) -> str:
        out = []
        for p in self.pods.values():
            if p.log is not None:
                out.append(f"---- {p.name} ({p.ip}, {p.log})\n" + tail(p.log, lines))
        return "\n".join(out)

    # ---- the loop -----------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._pass()
            except Exception as e:  # kept for the test; the loop keeps serving
                logger.exception("pod runner pass failed")
                self.errors.append(e)
            self._stop.wait(self._interval)

    def _pass(self) -> None:
        items = self._cp.request("GET", f"/api/v1/namespaces/{self.ns}/pods")["items"]
        seen = {pod["metadata"]["uid"]: pod for pod in items}
        # 1. Deletions first: a pod whose process has ended is forgotten at once, so that a successor of the same DNS
        # name seen in this very pass keeps its address (`_assign`), as cluster DNS would point the name at it.
        for uid, p in list(self.pods.items()):
            pod = seen.get(uid)
            if pod is None or pod["metadata"].get("deletionTimestamp"):
                if pod is not None:
                    p.pod = pod
                self._terminate(p, gone=pod is None)
        # 2. Addresses, so that a pod's DNS name is known before the pods naming it start.
        for uid, pod in seen.items():
            if uid not in self.pods and pod["spec"].get("nodeName") and not pod["metadata"].get("deletionTimestamp"):
                self._assign(pod)
        for uid, p in list(self.pods.items()):
            pod = seen.get(uid)
            if pod is None or pod["metadata"].get("deletionTimestamp"):
                continue  # (1.)
            p.pod = pod
            if p.popen is None:
                self._maybe_start(p)
            else:
                self._watch(p)

    def _assign(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        ports = [port["containerPort"] for c in spec["containers"] for port in c.get("ports", [])]
        dns = f"{spec.get('hostname', meta['name'])}.{spec.get('subdomain', '')}.{self.ns}.svc"
        # A pod that replaces a gone one of the same DNS name keeps its address, as cluster DNS would point the
        # name at the new pod: processes that connect by that name (here rewritten to the address) reconnect.
        before = self.names.get(dns, self._last_address.get(dns))
        if before is not None:
            free = all(p.ip != before for p in self.pods.values())
            if free and all(_bindable(before, port, reuse=True) for port in ports):
                self._address_wait.pop(dns, None)
                self.pods[meta["uid"]] = _Pod(meta["name"], meta["uid"], before, dns, pod)
                self.names[dns] = before
                return
            if free:
                # Its predecessor's sockets may linger a moment (a killed process's connections closing): the
                # successor waits for the address rather than move the name, which processes started with it (here
                # given the address in its place) could not follow.
                since = self._address_wait.setdefault(dns, time.monotonic())
                if time.monotonic() - since < ADDRESS_WAIT_S:
                    return
                self._address_wait.pop(dns, None)
                self.address_changes.append(f"{meta['name']}: {before} not bindable for {ADDRESS_WAIT_S:.0f}s")
            else:
                self.address_changes.append(f"{meta['name']}: {before} still held by " + ", ".join(
                    f"{q.name} ({q.uid[:8]}, exited {q.popen is not None and q.popen.poll() is not None})"
                    for q in self.pods.values() if q.ip == before))
        while True:
            if self._next_host > 250:
                raise RuntimeError("out of loopback addresses 127.0.0.2-250")
            ip = f"127.0.0.{self._next_host}"
            self._next_host += 1
            if all(_bindable(ip, port) for port in ports):
                break
        self.pods[meta["uid"]] = _Pod(meta["name"], meta["uid"], ip, dns, pod)
        self.names[dns] = ip

    def _maybe_start(self, p: _Pod) -> None:
        if p.name in self.hold:
            return
        container = p.pod["spec"]["containers"][0]
        env = self._env(p, container)
        args = [expand(a, env) for a in container.get("args", [])]
        command = [expand(a, env) for a in container.get("command", [])]
        for a in args:
            for ref in re.findall(rf"[a-z0-9.-]+\.{re.escape(self.ns)}\.svc", a):
                if ref.count(".") == 3 and ref not in self.names:
                    return  # a pod it names has no address yet
        args = [self._rewrite(a, p.ip) for a in args]
        args = self._mount_secrets(p, container, args)
        if command[:1] == ["python"]:
            command[0] = sys.executable
        module = command[2] if command[1:2] == ["-m"] and len(command) > 2 else ""
        if module == commands.ENGINE_MODULE and self._engine:
            module = self._engine[0]
            command = [*command[:2], module]
            args = [*self._engine[1:], *args]
        if module in LAUNCHER_HOST_FLAGS and "--" in args:
            args = [LAUNCHER_HOST_FLAGS[module], p.ip, *args]
        probes = {kind: Probe.parse(kind, container[f]) for kind, f in PROBE_FIELDS.items() if f in container}
        p.log = self.work_dir / "logs" / f"{p.name}-{p.uid[:8]}.log"
        p.logfile = p.log.open("wb")
        p.popen = subprocess.Popen([*command, *args], stdout=p.logfile, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=env, start_new_session=True, close_fds=True)
        p.started_at = _now()
        p.started_mono = time.monotonic()
        p.env = env
        p.extra["started_wall"] = time.time()
        logger.info("started pod %s on %s: pid %d", p.name, p.ip, p.popen.pid)
        self._start_probes(p, probes, container)
        self._sync_status(p)

    def _env(self, p: _Pod, container: Mapping[str, Any]) -> dict[str, str]:
        fields = {"status.podIP": p.ip, "metadata.name": p.name, "metadata.namespace": self.ns,
                  "status.hostIP": "127.0.0.1", "metadata.uid": p.uid}
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = expand(var["value"], env)
            elif "fieldRef" in var.get("valueFrom", {}):
                env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
            else:
                raise ValueError(f"pod {p.name}: env {var['name']}: unsupported source {var.get('valueFrom')}")
        if self._extra_env is not None:
            env.update(self._extra_env(p.pod))
        return env

    def _rewrite(self, arg: str, ip: str) -> str:
        for name, addr in self.names.items():
            arg = arg.replace(name, addr)
        return ip if arg == "0.0.0.0" else arg

    def _mount_secrets(self, p: _Pod, container: Mapping[str, Any], args: list[str]) -> list[str]:
        volumes = {v["name"]: v for v in p.pod["spec"].get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            secret = volumes.get(mount["name"], {}).get("secret")
            if secret is None:
                continue
            obj = self._cp.request("GET", f"/api/v1/namespaces/{self.ns}/secrets/{secret['secretName']}")
            directory = self.work_dir / "volumes" / f"{p.name}-{p.uid[:8]}" / mount["name"]
            directory.mkdir(parents=True, exist_ok=True)
            for key, value in obj.get("data", {}).items():
                path = directory / key
                path.write_bytes(base64.b64decode(value))
                path.chmod(0o600)
            prefix = mount["mountPath"].rstrip("/")
            args = [str(directory) + a[len(prefix):] if a == prefix or a.startswith(prefix + "/") else a
                    for a in args]
        return args

    def _watch(self, p: _Pod) -> None:
        assert p.popen is not None
        rc = p.popen.poll()
        if rc is not None:
            if not p.exit_reported:
                p.probes_stop.set()
                self._signal(p, signal.SIGKILL)  # the container's other processes die with it
                self._post_events(p)
                self._report_exit(p, rc)
            return
        with p.lock:
            kill_reason, kill_grace = p.kill_reason, p.kill_grace
        if kill_reason:  # as the kubelet kills a container that failed its liveness or startup probe
            if p.term_sent_at is None:
                p.term_sent_at = time.monotonic()
                logger.info("pod %s: %s; killing it (grace %.0f s)", p.name, kill_reason, kill_grace)
                self._signal(p, signal.SIGTERM)
            elif time.monotonic() - p.term_sent_at >= kill_grace:
                self._signal(p, signal.SIGKILL)
        self._post_events(p)
        self._sync_status(p)

    def _sync_status(self, p: _Pod) -> None:
        with p.lock:
            now = (p.started, p.ready)
        if now != p.reported:
            self._patch_status(p, self._running_status(p, started=now[0], ready=now[1]))
            p.reported = now

    # ---- probes -------------------------------------------------------------------------------
    def _start_probes(self, p: _Pod, probes: Mapping[str, Probe], container: Mapping[str, Any]) -> None:
        ports = {port["name"]: int(port["containerPort"]) for port in container.get("ports", []) if "name" in port}
        pod_grace = float(p.pod["spec"].get("terminationGracePeriodSeconds", 30))
        with p.lock:
            p.started = STARTUP not in probes
            p.ready = p.started and READINESS not in probes
        if p.started:
            p.started_event.set()
        for probe in probes.values():
            grace = min(self._grace, probe.grace if probe.grace is not None else pod_grace)
            t = threading.Thread(target=self._probe_worker, args=(p, probe, ports, grace, READINESS in probes),
                                 name=f"probe-{p.name}-{probe.kind}", daemon=True)
            p.probe_threads.append(t)
            t.start()

    def _probe_worker(self, p: _Pod, probe: Probe, ports: Mapping[str, int], grace: float,
                      has_readiness: bool) -> None:
        """One probe of one container, as a kubelet prober worker runs it (until the container stops,
        its startup probe succeeds, or its liveness/startup probe has it killed)."""
        try:
            if probe.kind != STARTUP:
                # Readiness and liveness wait for the startup probe (kubelet: readiness is then triggered at once).
                while not p.started_event.wait(0.1):
                    if p.probes_stop.is_set():
                        return
            next_at = max(p.started_mono + probe.initial_delay, time.monotonic())
            last: bool | None = None
            run = 0
            while not p.probes_stop.wait(max(0.0, next_at - time.monotonic())):
                next_at = max(next_at + probe.period, time.monotonic())  # a ticker drops the ticks it missed
                ok, detail = run_probe(probe.action, p.ip, ports, p.env, probe.timeout)
                at = time.monotonic()
                if p.probes_stop.is_set():
                    return  # the container stopped meanwhile: the result no longer counts
                run = run + 1 if ok == last else 1
                last = ok
                done = changed = False
                if run >= (probe.success_threshold if ok else probe.failure_threshold):
                    done, changed = self._probe_result(p, probe, ok, detail, grace, has_readiness)
                self.probe_log.append(ProbeAttempt(at, p.name, p.uid, probe.kind, ok, detail, changed))
                if len(self.probe_log) > PROBE_LOG_MAX:
                    del self.probe_log[:len(self.probe_log) - PROBE_LOG_MAX]
                if done:
                    return
        except Exception as e:  # kept for the test, as the loop's own
            logger.exception("pod %s: %s probe worker failed", p.name, probe.kind)
            self.errors.append(e)

    def _probe_result(self, p: _Pod, probe: Probe, ok: bool, detail: str, grace: float,
                      has_readiness: bool) -> tuple[bool, bool]:
        """Apply a probe's result once its threshold is reached: (its worker is done, the pod changed)."""
        with p.lock:
            if probe.kind == STARTUP and ok:
                p.started = True
                p.ready = p.ready or not has_readiness
                p.started_event.set()
                return True, True
            if probe.kind == READINESS:
                changed = p.ready != ok
                if changed and not ok:
                    p.events.append(("Warning", "Unhealthy", f"Readiness probe failed: {detail}"))
                p.ready = ok
                return False, changed
            if ok:
                return False, False  # liveness: healthy
            what = "Liveness" if probe.kind == LIVENESS else "Startup"
            p.events.append(("Warning", "Unhealthy", f"{what} probe failed: {detail}"))
            if not p.kill_reason:
                p.kill_reason = f"failed {probe.kind} probe ({probe.failure_threshold} in a row: {detail})"
                p.kill_grace = grace
                container = p.pod["spec"]["containers"][0]["name"]
                # The kubelet's words for a restartPolicy Never pod of one container (1.37, computePodActions):
                # nothing to keep or restart, so it kills the whole pod, each container "Stopping container X";
                # the probe's failure is in the Unhealthy event above.
                p.events.append(("Normal", "Killing", f"Stopping container {container}"))
            return True, True  # kubelet: on hold until the container is replaced (never: restartPolicy Never)

    def _post_events(self, p: _Pod) -> None:
        with p.lock:
            events, p.events = p.events, []
        container = p.pod["spec"]["containers"][0]["name"]
        for type_, reason, message in events:
            now = _now()
            body = {
                "metadata": {"generateName": f"{p.name}.", "namespace": self.ns},
                "involvedObject": {"kind": "Pod", "apiVersion": "v1", "namespace": self.ns, "name": p.name,
                                   "uid": p.uid, "fieldPath": f"spec.containers{{{container}}}"},
                "type": type_, "reason": reason, "message": message, "source": {"component": "kubelet"},
                "firstTimestamp": now, "lastTimestamp": now, "count": 1,
            }
            try:
                self._cp.request("POST", f"/api/v1/namespaces/{self.ns}/events", body)
            except urllib.error.HTTPError as e:
                if e.code not in (403, 404, 409):  # a terminating namespace
                    raise

    def _terminate(self, p: _Pod, gone: bool) -> None:
        p.probes_stop.set()
        if self.names.get(p.dns) == p.ip:
            del self.names[p.dns]  # as DNS forgets a deleted pod (until its successor of the same name is there)
            self._last_address[p.dns] = p.ip
        if p.popen is not None and p.popen.poll() is None:
            if p.term_sent_at is None:
                if not gone and self._prestop_running(p):
                    return
                p.term_sent_at = time.monotonic()
                self._signal(p, signal.SIGTERM)
                return
            grace = min(self._grace, self._remaining_grace(p))
            if time.monotonic() - p.term_sent_at < grace:
                return
            self._signal(p, signal.SIGKILL)
            p.popen.wait(10)
        self._signal(p, signal.SIGKILL)
        if p.logfile is not None:
            p.logfile.close()
        if not gone:
            try:
                self._cp.request("DELETE", f"/api/v1/namespaces/{self.ns}/pods/{p.name}",
                                 {"gracePeriodSeconds": 0, "preconditions": {"uid": p.uid}})
            except urllib.error.HTTPError as e:
                if e.code not in (404, 409):
                    raise
        del self.pods[p.uid]

    @staticmethod
    def _deletion_grace(p: _Pod) -> float:
        """The grace period of the pod's deletion (the delete's own, else the pod's), as the kubelet takes it."""
        meta, spec = p.pod["metadata"], p.pod["spec"]
        grace = meta.get("deletionGracePeriodSeconds")
        return float(grace if grace is not None else spec.get("terminationGracePeriodSeconds", 30))

    def _remaining_grace(self, p: _Pod) -> float:
        """After the preStop hook: what is left of the grace period, at least 2 s (the kubelet's minimum)."""
        spent = time.monotonic() - p.prestop_started_at if p.prestop_started_at is not None else 0.0
        return max(2.0, self._deletion_grace(p) - spent)

    def _prestop_running(self, p: _Pod) -> bool:
        """The container's preStop hook (kubelet semantics): run once when the deletion is seen, in a thread, before
        SIGTERM, for at most the deletion's grace period; True while it still runs within it."""
        container = p.pod["spec"]["containers"][0]
        hook = (container.get("lifecycle") or {}).get("preStop")
        if hook is None:
            return False
        if p.prestop_started_at is None:
            p.prestop_started_at = time.monotonic()
            grace = self._deletion_grace(p)
            ports = {port["name"]: port["containerPort"] for port in container.get("ports", []) if "name" in port}

            def run() -> None:
                ok, detail = run_probe(hook, p.ip, ports, p.env, max(grace, 1.0))
                logger.info("pod %s: preStop hook %s (%s)", p.name, "done" if ok else "failed", detail)
                if not ok:
                    with p.lock:
                        p.events.append(("Warning", "FailedPreStopHook", f"PreStopHook failed: {detail}"))
                p.prestop_done.set()

            threading.Thread(target=run, name=f"prestop-{p.name}", daemon=True).start()
            logger.info("pod %s: deletion seen (grace %gs): running its preStop hook", p.name, grace)
        return not p.prestop_done.is_set() and time.monotonic() - p.prestop_started_at < self._deletion_grace(p)

    # ---- processes and status -----------------------------------------------------------------
    @staticmethod
    def _signal(p: _Pod, sig: signal.Signals) -> None:
        if p.popen is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.popen.pid, sig)  # the group outlives its leader while members remain

    def _report_exit(self, p: _Pod, rc: int) -> None:
        code = 128 - rc if rc < 0 else rc
        now = _now()
        container = p.pod["spec"]["containers"][0]
        self._patch_status(p, {
            "phase": "Succeeded" if code == 0 else "Failed",
            "conditions": [{"type": t, "status": "True" if t == "PodScheduled" else "False", "lastTransitionTime": now}
                           for t in ("PodScheduled", "ContainersReady", "Ready")],
            "containerStatuses": [{
                "name": container["name"], "image": container["image"], "imageID": "", "ready": False,
                "started": False, "restartCount": 0,
                "state": {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                         "startedAt": p.started_at, "finishedAt": now}}}],
        })
        p.exit_reported = True
        self.exits[p.uid] = (time.monotonic(), code)
        logger.info("pod %s exited with %d", p.name, code)

    def _running_status(self, p: _Pod, *, started: bool, ready: bool) -> dict[str, Any]:
        now, cond = _now(), "True" if ready else "False"
        container = p.pod["spec"]["containers"][0]
        return {
            "phase": "Running", "podIP": p.ip, "podIPs": [{"ip": p.ip}], "hostIP": "127.0.0.1",
            "startTime": p.started_at,
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": p.started_at},
                {"type": "Initialized", "status": "True", "lastTransitionTime": p.started_at},
                {"type": "ContainersReady", "status": cond, "lastTransitionTime": now},
                {"type": "Ready", "status": cond, "lastTransitionTime": now},
            ],
            "containerStatuses": [{
                "name": container["name"], "image": container["image"], "imageID": "", "ready": ready,
                "started": started, "restartCount": 0, "state": {"running": {"startedAt": p.started_at}}}],
        }

    def _patch_status(self, p: _Pod, status: dict[str, Any]) -> None:
        try:
            self._cp.request("PATCH", f"/api/v1/namespaces/{self.ns}/pods/{p.name}/status",
                             {"metadata": {"uid": p.uid}, "status": status},  # the uid: a precondition
                             content_type="application/merge-patch+json")
        except urllib.error.HTTPError as e:
            if e.code not in (404, 409):  # deleted meanwhile: the next pass stops it
                raise


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # a 3xx is the probe's answer


def _no_verify() -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # the kubelet does not verify a probe's certificate
    return context


_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect(),  # no proxy from the env
                                    urllib.request.HTTPSHandler(context=_no_verify()))


def run_probe(action: Mapping[str, Any], ip: str, ports: Mapping[str, int], env: Mapping[str, str],
              timeout: float) -> tuple[bool, str]:
    """One probe attempt against a container at `ip`: (succeeded, what was seen)."""
    if "httpGet" in action:
        get = action["httpGet"]
        port = ports.get(get["port"], get["port"]) if isinstance(get["port"], str) else get["port"]
        url = f"{get.get('scheme', 'HTTP').lower()}://{get.get('host') or ip}:{port}{get.get('path', '/')}"
        headers = {h["name"]: h["value"] for h in get.get("httpHeaders", [])}
        try:
            with _HTTP.open(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
                code = r.status
        except urllib.error.HTTPError as e:
            code = e.code
            e.close()
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out
            return False, f"Get {url!r}: {type(e).__name__}: {e}"
        return 200 <= code < 400, f"HTTP probe failed with statuscode: {code}" if code >= 400 else f"HTTP {code}"
    if "tcpSocket" in action:
        tcp = action["tcpSocket"]
        port = ports.get(tcp["port"], tcp["port"]) if isinstance(tcp["port"], str) else tcp["port"]
        host = tcp.get("host") or ip
        try:
            socket.create_connection((host, int(port)), timeout=timeout).close()
        except OSError as e:
            return False, f"dial tcp {host}:{port}: {type(e).__name__}: {e}"
        return True, f"connected to {host}:{port}"
    if "exec" in action:
        command = list(action["exec"]["command"])
        if command[:1] == ["python"]:
            command[0] = sys.executable
        try:
            done = subprocess.run(command, env=dict(env), stdin=subprocess.DEVNULL, capture_output=True,
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return False, f"command {command!r} timed out after {timeout:g}s"
        except OSError as e:
            return False, f"command {command!r}: {e}"
        out = (done.stdout + done.stderr).decode(errors="replace").strip()[-300:]
        return done.returncode == 0, f"exit {done.returncode}: {out}"
    raise ValueError(f"unsupported probe {dict(action)}")


def _bindable(ip: str, port: int, reuse: bool = False) -> bool:
    """Whether `ip:port` is free (`reuse`: free but for connections in TIME_WAIT, as a server with SO_REUSEADDR
    binds it)."""
    with socket.socket() as s:
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True
