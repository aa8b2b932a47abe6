# SPDX-License-Identifier: Apache-2.0
"""A process kubelet for the e2e tier: runs each pod bound in a namespace as a local process.

`PodRunner(cp, namespace, work_dir)` polls the namespace's pods in a thread and, for each pod the
scheduler bound to a node, does what a kubelet and a cluster's DNS would:

1. gives it its own loopback address 127.0.0.N, so that every pod can bind the fleet's fixed ports,
   and records its DNS name `<hostname>.<subdomain>.<namespace>.svc` -> that address;
2. starts its (single) container's command once every pod DNS name its args name is known:
   `python` is this interpreter; env from the container (downward API: POD_IP, POD_NAME,
   POD_NAMESPACE); `$(VAR)` expanded in args as the kubelet does; pod DNS names and `0.0.0.0`
   replaced by addresses; Secret volumes written to a directory whose path replaces the mount
   path in args; the launchers' own listeners (`--health-host`, `--admin-host`) put on the pod's
   address. Each process gets its own session and a log file `<work_dir>/logs/<pod>-<uid>.log`;
3. reports the pod Running with its address, and Ready as its readinessProbe (httpGet or
   tcpSocket) answers; Failed or Succeeded with the exit code when the process exits (whatever
   else is left in its process group is killed, as a container's processes die with it);
4. on deletion, SIGTERMs the process group, SIGKILLs it after the grace period, and then removes
   the pod (a pod that vanished from the API is stopped the same way).

Test-only knobs: `engine` runs another module in place of an engine container's
`corefleet_client.engine` (the emulator: as another image would), and the pods named in `hold` are
bound but never started (as if their image never pulled).

`close()` stops everything it started. Errors of the loop are kept in `errors`.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import re
import signal
import socket
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
from corefleet_operator.localcluster import LocalControlPlane

logger = logging.getLogger(__name__)

LAUNCHER_HOST_FLAGS = {  # the launchers' own listeners bind 0.0.0.0 unless told otherwise
    commands.ENGINE_MODULE: "--health-host",
    commands.EMULATOR_MODULE: "--health-host",
    commands.FRONTEND_MODULE: "--admin-host",
}
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)|\$\$")


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
    ready: bool = False
    exit_reported: bool = False
    term_sent_at: float | None = None
    last_probe: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


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
        self.errors: list[BaseException] = []
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

    def pod(self, name: str) -> _Pod:
        """The live (not terminating) pod of that name that this runner started."""
        return next(p for p in self.pods.values()
                    if p.name == name and p.popen is not None and not p.pod["metadata"].get("deletionTimestamp"))

    def log_tails(self, lines: int = 30) -> str:
        out = []
        for p in self.pods.values():
            if p.log is not None:
                text = p.log.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"---- {p.name} ({p.ip}, {p.log})\n" + "\n".join(text))
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
        # 1. Addresses first, so that a pod's DNS name is known before the pods naming it start.
        for uid, pod in seen.items():
            if uid not in self.pods and pod["spec"].get("nodeName") and not pod["metadata"].get("deletionTimestamp"):
                self._assign(pod)
        for uid, p in list(self.pods.items()):
            pod = seen.get(uid)
            if pod is not None:
                p.pod = pod
            if pod is None or pod["metadata"].get("deletionTimestamp"):
                self._terminate(p, gone=pod is None)
            elif p.popen is None:
                self._maybe_start(p)
            else:
                self._watch(p)

    def _assign(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        ports = [port["containerPort"] for c in spec["containers"] for port in c.get("ports", [])]
        while True:
            if self._next_host > 250:
                raise RuntimeError("out of loopback addresses 127.0.0.2-250")
            ip = f"127.0.0.{self._next_host}"
            self._next_host += 1
            if all(_bindable(ip, port) for port in ports):
                break
        dns = f"{spec.get('hostname', meta['name'])}.{spec.get('subdomain', '')}.{self.ns}.svc"
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
        p.log = self.work_dir / "logs" / f"{p.name}-{p.uid[:8]}.log"
        p.logfile = p.log.open("wb")
        p.popen = subprocess.Popen([*command, *args], stdout=p.logfile, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=env, start_new_session=True, close_fds=True)
        p.started_at = _now()
        p.extra["started_wall"] = time.time()
        logger.info("started pod %s on %s: pid %d", p.name, p.ip, p.popen.pid)
        self._patch_status(p, self._running_status(p, ready=False))

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
                self._signal(p, signal.SIGKILL)  # the container's other processes die with it
                self._report_exit(p, rc)
            return
        now = time.monotonic()
        if now - p.last_probe < 0.5:
            return
        p.last_probe = now
        ready = self._probe(p)
        if ready != p.ready:
            p.ready = ready
            self._patch_status(p, self._running_status(p, ready))

    def _probe(self, p: _Pod) -> bool:
        container = p.pod["spec"]["containers"][0]
        probe = container.get("readinessProbe")
        if probe is None:
            return True
        named = {port.get("name"): port["containerPort"] for port in container.get("ports", [])}
        if "httpGet" in probe:
            get = probe["httpGet"]
            port = named.get(get["port"], get["port"])
            try:
                with urllib.request.urlopen(f"http://{p.ip}:{port}{get.get('path', '/')}", timeout=1) as r:
                    ok: bool = 200 <= r.status < 400
                    return ok
            except (OSError, urllib.error.URLError):
                return False
        if "tcpSocket" in probe:
            port = named.get(probe["tcpSocket"]["port"], probe["tcpSocket"]["port"])
            try:
                socket.create_connection((p.ip, int(port)), timeout=1).close()
            except OSError:
                return False
            return True
        raise ValueError(f"pod {p.name}: unsupported readinessProbe {probe}")

    def _terminate(self, p: _Pod, gone: bool) -> None:
        if self.names.get(p.dns) == p.ip:
            del self.names[p.dns]  # as DNS forgets a deleted pod; its successor gets a new address
        if p.popen is not None and p.popen.poll() is None:
            if p.term_sent_at is None:
                p.term_sent_at = time.monotonic()
                self._signal(p, signal.SIGTERM)
                return
            grace = min(self._grace, float(p.pod["spec"].get("terminationGracePeriodSeconds", 30)))
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
        logger.info("pod %s exited with %d", p.name, code)

    def _running_status(self, p: _Pod, ready: bool) -> dict[str, Any]:
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
                "started": True, "restartCount": 0, "state": {"running": {"startedAt": p.started_at}}}],
        }

    def _patch_status(self, p: _Pod, status: dict[str, Any]) -> None:
        try:
            self._cp.request("PATCH", f"/api/v1/namespaces/{self.ns}/pods/{p.name}/status",
                             {"metadata": {"uid": p.uid}, "status": status},  # the uid: a precondition
                             content_type="application/merge-patch+json")
        except urllib.error.HTTPError as e:
            if e.code not in (404, 409):  # deleted meanwhile: the next pass stops it
                raise


def _bindable(ip: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True
