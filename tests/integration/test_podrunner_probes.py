# SPDX-License-Identifier: Apache-2.0
"""The process kubelet (`podrunner.PodRunner`) runs a container's probes as the kubelet does.

Each pod here is one tiny HTTP server process on the real control plane's fake node: `GET /NAME`
answers with the status code written in the file `NAME` of the pod's state directory (503 while
there is none), so a test toggles a probe's answer by writing a file, and hangs the whole container
with SIGSTOP. Probe periods are 1 s (the API's minimum); no test sleeps: each polls the pod's status
or the runner's `probe_log` with a deadline.
"""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from corefleet_harness.localcluster import LocalControlPlane
from corefleet_harness.support import wait_until
from podrunner import LIVENESS, READINESS, STARTUP, PodRunner, ProbeAttempt

PORT = 8080
DEADLINE = 60.0

# The container: an HTTP server on (pod address, PORT) whose answers come from files in its state directory.
SERVER = """
import http.server, os, signal, sys
host, port, state = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if "--ignore-sigterm" in sys.argv:
    signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM received and ignored", flush=True))
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        path = os.path.join(state, self.path.strip("/"))
        code = int(open(path).read().strip()) if os.path.exists(path) else 503
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
print("serving", flush=True)
http.server.ThreadingHTTPServer((host, port), Handler).serve_forever()
"""


LISTENING = {"tcpSocket": {"port": "web"}, "periodSeconds": 1, "failureThreshold": 60}


def http_probe(path: str, **fields: Any) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "web"}, "periodSeconds": 1, "timeoutSeconds": 1, **fields}


class Pods:
    def __init__(self, k8s: LocalControlPlane, ns: str, runner: PodRunner, tmp: Path) -> None:
        self.k8s, self.ns, self.runner, self.tmp = k8s, ns, runner, tmp

    def create(self, name: str, *, files: dict[str, str] | None = None, ignore_sigterm: bool = False, grace: int = 2,
               **probes: dict[str, Any]) -> Path:
        """A server pod with `probes` (readinessProbe=..., ...) and its state directory (returned) holding
        `files`. Unless given one, its startupProbe waits for the server to listen (a tcpSocket probe)."""
        state = self.tmp / name
        state.mkdir()
        for file, text in (files or {}).items():
            (state / file).write_text(text)
        probes.setdefault("startupProbe", LISTENING)
        container = {
            "name": "web", "image": "server:test", "command": ["python"],
            "args": ["-c", SERVER, "0.0.0.0", str(PORT), str(state), *(["--ignore-sigterm"] if ignore_sigterm else [])],
            "ports": [{"name": "web", "containerPort": PORT, "protocol": "TCP"}], **probes,
        }
        self.k8s.request("POST", f"/api/v1/namespaces/{self.ns}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeName": "gpu-node-0", "restartPolicy": "Never", "terminationGracePeriodSeconds": grace,
                     "containers": [container]}})
        return state

    def status(self, name: str) -> dict[str, Any]:
        status: dict[str, Any] = self.k8s.request("GET", f"/api/v1/namespaces/{self.ns}/pods/{name}")["status"]
        return status

    def ready(self, name: str) -> bool | None:
        """The pod's Ready condition (None before the runner reported it Running), checked against the
        ContainersReady condition and the container's own `ready`."""
        st = self.status(name)
        if st.get("phase") != "Running":
            return None
        conditions: dict[str, bool] = {c["type"]: c["status"] == "True" for c in st["conditions"]}
        assert conditions["Ready"] == conditions["ContainersReady"] == st["containerStatuses"][0]["ready"], st
        return conditions["Ready"]

    def wait_ready(self, name: str, want: bool) -> None:
        wait_until(lambda: self.ready(name) is want, DEADLINE, f"pod {name} Ready={want}", interval=0.05,
                   diagnose=lambda: f"{self.status(name)}\n{self.attempts(name)}\n{self.runner.log_tails()}")

    def wait_terminated(self, name: str) -> dict[str, Any]:
        def terminated() -> dict[str, Any] | None:
            st = self.status(name)
            return st if st.get("phase") in ("Failed", "Succeeded") else None

        st: dict[str, Any] = wait_until(terminated, DEADLINE, f"pod {name} to end", interval=0.05,
                                        diagnose=lambda: f"{self.status(name)}\n{self.attempts(name)}")
        return st

    def attempts(self, name: str, kind: str | None = None) -> list[ProbeAttempt]:
        return [a for a in list(self.runner.probe_log) if a.pod == name and kind in (None, a.kind)]

    def wait_attempts(self, name: str, kind: str, count: int) -> list[ProbeAttempt]:
        got: list[ProbeAttempt] = wait_until(lambda: len(a := self.attempts(name, kind)) >= count and a, DEADLINE,
                                             f"{count} {kind} probe attempts on {name}", interval=0.05)
        return got

    def pid(self, name: str) -> int:
        popen = self.runner.pod(name).popen
        assert popen is not None
        return popen.pid

    def events(self, name: str) -> list[tuple[str, str]]:
        items = self.k8s.request("GET", f"/api/v1/namespaces/{self.ns}/events")["items"]
        mine = sorted((e for e in items if e["involvedObject"].get("name") == name),
                      key=lambda e: int(e["metadata"]["resourceVersion"]))
        return [(e["reason"], e["message"]) for e in mine]


@pytest.fixture
def pods(k8s: LocalControlPlane, namespace: str, tmp_path: Path) -> Iterator[Pods]:
    with PodRunner(k8s, namespace, tmp_path / "runner", interval=0.05, grace=5) as runner:
        yield Pods(k8s, namespace, runner, tmp_path)
    assert not runner.errors, runner.errors


def run_before(attempts: list[ProbeAttempt], flip: ProbeAttempt) -> int:
    """How many attempts in a row, up to and including `flip`, had `flip`'s result."""
    before = attempts[:attempts.index(flip) + 1]
    n = 0
    for a in reversed(before):
        if a.ok != flip.ok:
            break
        n += 1
    return n


def flips(attempts: list[ProbeAttempt]) -> list[ProbeAttempt]:
    return [a for a in attempts if a.changed]


def test_readiness_changes_only_after_its_thresholds(pods: Pods) -> None:
    state = pods.create("ready", readinessProbe=http_probe("/ready", successThreshold=2, failureThreshold=3))
    # Not ready until the probe succeeds: the first attempts fail and the pod shows Running, not Ready.
    pods.wait_attempts("ready", READINESS, 4)
    assert pods.ready("ready") is False
    assert not any(a.ok for a in pods.attempts("ready", READINESS))

    (state / "ready").write_text("200")
    pods.wait_ready("ready", True)
    up = flips(pods.attempts("ready", READINESS))
    assert [(a.ok, run_before(pods.attempts("ready", READINESS), a)) for a in up] == [(True, 2)], up

    (state / "ready").write_text("500")
    pods.wait_ready("ready", False)
    attempts = pods.attempts("ready", READINESS)
    down = flips(attempts)[-1]
    assert (down.ok, run_before(attempts, down)) == (False, 3), attempts
    assert "statuscode: 500" in down.detail, down
    assert pods.status("ready")["phase"] == "Running"  # a failing readiness probe kills nothing
    wait_until(lambda: ("Unhealthy", f"Readiness probe failed: {down.detail}") in pods.events("ready"), DEADLINE,
               "the Unhealthy event")

    (state / "ready").write_text("302")  # 200..399 is success
    pods.wait_ready("ready", True)


def test_startup_probe_gates_readiness_and_liveness(pods: Pods) -> None:
    state = pods.create("slow", files={"ready": "200", "live": "200"},
                        startupProbe=http_probe("/started", failureThreshold=60),
                        readinessProbe=http_probe("/ready"), livenessProbe=http_probe("/live"))
    pods.wait_attempts("slow", STARTUP, 3)
    assert pods.attempts("slow", READINESS) == pods.attempts("slow", LIVENESS) == []
    st = pods.status("slow")
    assert (st["containerStatuses"][0]["started"], pods.ready("slow")) == (False, False), st

    (state / "started").write_text("200")
    pods.wait_ready("slow", True)
    assert pods.status("slow")["containerStatuses"][0]["started"] is True
    started = flips(pods.attempts("slow", STARTUP))
    assert [a.ok for a in started] == [True], started
    readiness = pods.attempts("slow", READINESS)
    assert readiness[0].at >= started[0].at
    assert readiness[0].ok
    # The startup probe is done: liveness runs on, startup never again.
    pods.wait_attempts("slow", LIVENESS, 3)
    assert pods.attempts("slow", STARTUP)[-1] == started[0]


def test_initial_delay_then_every_period(pods: Pods) -> None:
    pods.create("delayed", readinessProbe=http_probe("/ready", initialDelaySeconds=3, periodSeconds=2))
    attempts = pods.wait_attempts("delayed", READINESS, 3)
    began = pods.runner.pod("delayed").started_mono
    assert attempts[0].at - began >= 3, (began, attempts)
    gaps = [b.at - a.at for a, b in itertools.pairwise(attempts)]  # attempts end up to timeoutSeconds late
    assert all(1.0 <= g <= 4.0 for g in gaps), gaps


def test_liveness_failure_kills_the_container_sigterm_then_sigkill(pods: Pods) -> None:
    state = pods.create("stubborn", files={"live": "200"}, ignore_sigterm=True, grace=1,
                        livenessProbe=http_probe("/live", failureThreshold=2))
    pods.wait_ready("stubborn", True)  # no readinessProbe: ready once started
    pods.wait_attempts("stubborn", LIVENESS, 2)
    (state / "live").write_text("500")

    st = pods.wait_terminated("stubborn")
    assert st["phase"] == "Failed", st
    cs = st["containerStatuses"][0]
    assert (cs["state"]["terminated"]["exitCode"], cs["ready"]) == (137, False), cs
    attempts = pods.attempts("stubborn", LIVENESS)
    kill = flips(attempts)
    assert [(a.ok, run_before(attempts, a)) for a in kill] == [(False, 2)], attempts
    assert attempts[-1] == kill[0]  # no probing of a container being killed
    # SIGTERM first (the server ignored it), SIGKILL after the pod's grace period.
    log = pods.runner.pod_log("stubborn")
    assert "SIGTERM received and ignored" in log, log
    reasons = [r for r, _ in pods.events("stubborn")]
    assert reasons == ["Unhealthy", "Killing"], pods.events("stubborn")


def test_a_hung_container_times_out_goes_not_ready_and_is_killed(pods: Pods) -> None:
    """SIGSTOP of the container's process group: the probes time out, readiness turns the pod NotReady,
    liveness has it killed; SIGTERM waits on a stopped process, so SIGKILL ends it: 137."""
    pods.create("hung", files={"ready": "200", "live": "200"}, grace=1,
                readinessProbe=http_probe("/ready", failureThreshold=1),
                livenessProbe=http_probe("/live", failureThreshold=3))
    pods.wait_ready("hung", True)
    os.killpg(pods.pid("hung"), signal.SIGSTOP)

    pods.wait_ready("hung", False)
    st = pods.wait_terminated("hung")
    assert (st["phase"], st["containerStatuses"][0]["state"]["terminated"]["exitCode"]) == ("Failed", 137), st
    not_ready = flips(pods.attempts("hung", READINESS))[-1]
    killed = flips(pods.attempts("hung", LIVENESS))[-1]
    failed = [a for a in pods.attempts("hung") if not a.ok and a.kind != STARTUP and a.at <= killed.at]
    assert failed, pods.attempts("hung")
    assert all("timed out" in a.detail for a in failed), failed
    assert (not_ready.ok, killed.ok) == (False, False)
    assert not_ready.at < killed.at


def test_a_startup_probe_that_never_passes_kills_the_container(pods: Pods) -> None:
    pods.create("never", startupProbe=http_probe("/started", failureThreshold=2), readinessProbe=http_probe("/ready"))
    st = pods.wait_terminated("never")
    # The server exits on SIGTERM (Python's default: killed by it), within the grace period: 128 + 15.
    assert (st["phase"], st["containerStatuses"][0]["state"]["terminated"]["exitCode"]) == ("Failed", 143), st
    assert st["containerStatuses"][0]["started"] is False
    attempts = pods.attempts("never")
    assert [(a.kind, a.ok, a.changed) for a in attempts] == [(STARTUP, False, False), (STARTUP, False, True)], \
        attempts
    assert [r for r, _ in pods.events("never")] == ["Unhealthy", "Killing"]


def test_exec_and_tcp_socket_probes(pods: Pods, tmp_path: Path) -> None:
    flag = tmp_path / "flag"
    check = f"import os, sys; sys.exit(0 if os.path.exists({str(flag)!r}) else 1)"
    exec_probe = {"exec": {"command": ["python", "-c", check]}, "periodSeconds": 1, "timeoutSeconds": 5}
    pods.create("other", readinessProbe=exec_probe,
                livenessProbe={"tcpSocket": {"port": PORT}, "periodSeconds": 1, "failureThreshold": 1})
    pods.wait_attempts("other", LIVENESS, 1)
    pods.wait_attempts("other", READINESS, 1)
    assert pods.ready("other") is False
    flag.write_text("")
    pods.wait_ready("other", True)
    flag.unlink()
    pods.wait_ready("other", False)
    down = flips(pods.attempts("other", READINESS))[-1]
    assert down.detail.startswith("exit 1"), down
    assert all(a.ok for a in pods.attempts("other", LIVENESS))
    assert pods.status("other")["phase"] == "Running"
