# SPDX-License-Identifier: Apache-2.0
"""Fleets on a real node: the operator installed by Helm, every pod a container, traffic through a Service.

The session's real node (tests/e2e/conftest.py `real_node`: a control plane advertising this host's address
and one node, `corefleet_harness.localnode`: containerd and runc, the kubelet, kube-proxy, CoreDNS; shared
with test_localnode.py) runs the module's pods, from images built here by hack/images.sh from the project's
Dockerfiles: the operator image, and the runtime image on a vLLM-for-CPU base with the test layer on it
(tests/images/runtime-test: the tiny model, since an EngineCoreSet's model is a path inside its image and no
model hub is reachable here, and the engine emulator behind a switch).

* `helm install` of charts/corefleet with its defaults (CRD included): the operator runs as the chart's
  Deployment, in a container, under the chart's service account, reaching the API server through the
  `kubernetes` Service; `kubectl auth can-i` shows what it may not do, and after every test its log has no
  Forbidden, 403 or traceback;
* manifests/samples/enginecoreset.yaml, with the image, model, engine flags and resources this 2-core
  machine can run: real vLLM engines, frontend and coordinator as containers, probed by the kubelet;
  completions through the frontend Service's ClusterIP (kube-proxy's rules), from the host and from a pod
  by the Service's DNS name;
* the frontend's and the coordinator's containers killed are replaced in place, the engines untouched;
* the same sample with emulator engines (the runtime-test image's switch) beside it: it serves, and an
  engine hung (SIGSTOP to its processes) is marked NotReady and killed by the kubelet's probes and replaced
  in place by the operator while rank 0 serves on;
* last, the real vLLM fleet with two frontends (`spec.frontend.replicas: 2`, which recreates it): one frontend's
  container killed under load fails only what was on it while the other answers, and it is replaced in place;
  an engine container killed (SIGKILL through containerd) is replaced in place through both frontends (both
  route to the new engine); resized 2 -> 3 -> 2 in place under load through the ClusterIP: no request fails,
  both frontends route to rank 2 while it serves, long requests on it finish in its drain, the surviving ranks
  keep their containers.

The process runner (tests/podrunner.py) stays for what a container cannot give a test: other e2e modules
run many fleets, swap in the emulator per pod and hold pods unstarted, on one machine, within CI's time.

Heavy (real vLLM, up to 3 engines, ~9 GiB): on shared machines run the e2e tier under
`flock /tmp/corefleet-heavy.lock`.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from corefleet_client.admin import RankState, ResizePhase
from corefleet_harness.localcluster import LocalControlPlane
from corefleet_harness.localnode import LocalNode
from corefleet_harness.support import wait_until
from corefleet_harness.tinymodel import write_tiny_model
from corefleet_operator import builders, constants
from corefleet_operator.generate import OPERATOR_IMAGE
from fleettest import FleetView, Load, LongStreams, ResizeWatch, ecs_engine_args
from nodetest import RealNode

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "corefleet"
SAMPLE = ROOT / "manifests" / "samples" / "enginecoreset.yaml"
RELEASE, SYSTEM, NS, EMU_NS = "corefleet", "corefleet-system", "llm", "emu"
MODEL, SERVED = "/models/tiny-llama", "tiny"  # tests/images/runtime-test (the emulator fleet's)
# The real vLLM fleet's weights: a PersistentVolumeClaim on a hostPath PersistentVolume (the node is this host)
# holding the tiny model under a name the image does not have, mounted at /models over the image's own.
PVC_MODEL, CLAIM, VOLUME = "tiny-pvc", "models", "corefleet-test-models"
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted",
              "pod-security.kubernetes.io/enforce-version": "latest"}
TEST_IMAGE_PREFIX = "corefleet.local/runtime-test:"
CONTEXT = 8192  # the test image's tiny model (the emulator fleet's frontend reads it)
# The tiny model this module writes to the PVC, served by the real vLLM fleet: a longer context for LONG_TOKENS.
PVC_CONTEXT = 16384
# Long requests pinned to the leaving rank: about 20 s and 10 s on these CPUs (a token costs more the longer the
# sequence), more than the scale-down takes to reach the frontend (a kubectl patch, the operator's reconcile, the
# admin API call), within the drain timeout below. Two kept in flight, of different lengths (`LongStreams`). (At 8128
# tokens a stream lasted 11 s, and CI starved the test's own process for as long: the streams ended unreplaced and
# the drain, when it came, found nothing in flight. At 16320 the drain took a minute.)
LONG_TOKENS = (12000, 7200)
DRAIN_TIMEOUT = 120
START_TIMEOUT = 600.0  # real vLLM engines starting as containers on a 2-core machine, up to 3 at once


def sample(image: str, *, emulator: bool = False) -> dict[str, Any]:
    """The sample EngineCoreSet with what this machine can run: the test image and model, small requests."""
    ecs: dict[str, Any] = yaml.safe_load(SAMPLE.read_text())
    spec = ecs["spec"]
    small = {"requests": {"cpu": "100m", "memory": "512Mi"}}
    spec.update(image=image, model=MODEL, replicas=2, maxReplicas=3)
    if not emulator:
        spec.update(model=PVC_MODEL, storage={"pvc": {"claimName": CLAIM}})
    spec["engine"].update(args=ecs_engine_args(SERVED, CONTEXT if emulator else PVC_CONTEXT), loadFormat="dummy",
                          resources=small, shmSize="1Gi")
    if emulator:
        spec["engine"]["env"] = [{"name": "COREFLEET_TEST_ENGINE", "value": "emulator"},
                                 {"name": "COREFLEET_TEST_EMULATOR_ARGS", "value": "--token-delay-ms 20"}]
    # A frontend weighs twice an engine in the CPU scheduler (the sample asks 2 CPUs for it, 4 for an engine): with
    # 100m each, the engines' busy polling starved a frontend's admin thread for over 5 s in CI.
    spec["frontend"]["resources"] = {"requests": {"cpu": "200m", "memory": "512Mi"}}
    spec["coordinator"] = {"resources": small}
    # The emulator fleet resizes nothing; its hung-engine test waits out the pod's grace period (the drain timeout
    # + 15 s: a container stopped as a whole ignores SIGTERM, and the kubelet's kill of the pod takes the pod's grace
    # period, not the liveness probe's), so its drain timeout is short.
    drain = 15 if emulator else DRAIN_TIMEOUT
    spec["scaling"].update(readyTimeoutSeconds=int(START_TIMEOUT), drainTimeoutSeconds=drain)
    # Requests held while the idle fleet wakes wait for real engines to start as containers here (see IDLE_WAKE_*).
    spec["frontend"]["hold"] = {"timeoutSeconds": int(START_TIMEOUT)}
    return ecs


class Setup:
    def __init__(self, cp: LocalControlPlane, node: LocalNode, fleet: FleetView, operator_pod: str, image: str) -> None:
        self.cp, self.node, self.fleet, self.operator_pod, self.image = cp, node, fleet, operator_pod, image
        self.created_s = 0.0  # the real vLLM fleet's creation, apply to settled: what a whole-fleet recreation costs

    def url(self, fleet: FleetView | None = None) -> str:
        """The fleet's OpenAI endpoint through its Service's ClusterIP."""
        f = fleet or self.fleet
        svc = self.cp.request("GET", f"/api/v1/namespaces/{f.ns}/services/{f.name}")
        return f"http://{svc['spec']['clusterIP']}:{constants.FRONTEND_HTTP_PORT}"

    def settle(self, replicas: int, timeout: float = START_TIMEOUT) -> None:
        self.fleet.wait_settled(replicas, timeout, interval=0.5)

    def operator_log(self) -> str:
        return self.cp.kubectl("logs", "-n", SYSTEM, self.operator_pod).stdout

    def container_id(self, pod: str, fleet: FleetView | None = None) -> str:
        """The containerd ID of the pod's (only) container."""
        [status] = (fleet or self.fleet).pods()[pod]["status"]["containerStatuses"]
        cid: str = status["containerID"]
        assert cid.startswith("containerd://"), status
        return cid.removeprefix("containerd://")

    def container_pids(self, pod: str, fleet: FleetView | None = None) -> list[int]:
        """The host PIDs of every process in the pod's container (`ctr tasks ps`)."""
        out = self.node.ctr("tasks", "ps", self.container_id(pod, fleet)).stdout.splitlines()[1:]
        return [int(line.split()[0]) for line in out if line.split()]

    def pod_events(self, uid: str, fleet: FleetView | None = None) -> list[tuple[str, str]]:
        """(reason, message) of the kubelet's events on the pod with this UID."""
        items = self.cp.request("GET", f"/api/v1/namespaces/{(fleet or self.fleet).ns}/events")["items"]
        return [(e["reason"], e["message"]) for e in items if e["involvedObject"].get("uid") == uid]


def completion(url: str, max_tokens: int = 8, headers: dict[str, str] | None = None) -> dict[str, Any]:
    body = json.dumps({"model": SERVED, "prompt": "Hello", "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        out: dict[str, Any] = json.loads(r.read())
    assert out["model"] == SERVED, out
    assert out["usage"]["completion_tokens"] > 0, out
    return out


def node_state(cp: LocalControlPlane) -> str:
    return cp.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout


def restricted_namespace(cp: LocalControlPlane, name: str) -> None:
    """A namespace that enforces the PodSecurity `restricted` standard (the API server's built-in admission)."""
    cp.kubectl("create", "namespace", name)
    cp.kubectl("label", "namespace", name, *(f"{k}={v}" for k, v in RESTRICTED.items()))


def model_volume(cp: LocalControlPlane, directory: Path) -> None:
    """The tiny model on a hostPath PersistentVolume, bound to the claim CLAIM in NS (read-only, every rank)."""
    write_tiny_model(directory / PVC_MODEL, context=PVC_CONTEXT)
    for path in (directory, *directory.rglob("*")):  # readable by the fleet's uid 1000
        path.chmod(0o755 if path.is_dir() else 0o644)
    pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": VOLUME},
          "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"],
                   "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "corefleet-test",
                   "hostPath": {"path": str(directory), "type": "Directory"}}}
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": CLAIM},
           "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "corefleet-test", "volumeName": VOLUME,
                    "resources": {"requests": {"storage": "1Gi"}}}}
    cp.kubectl("apply", "-f", "-", input=json.dumps(pv))
    cp.kubectl("apply", "-n", NS, "-f", "-", input=json.dumps(pvc))


@pytest.fixture(scope="module")
def setup(real_node: RealNode, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("node-fleet")
    cp, node = real_node.cp, real_node.node
    # Outside pytest's temporary directory, which only root may enter.
    models = Path(tempfile.mkdtemp(prefix="corefleet-test-models-", dir="/var/tmp"))
    restricted_namespace(cp, SYSTEM)
    [image] = [n for n in node.ctr("images", "list", "--quiet").stdout.split() if n.startswith(TEST_IMAGE_PREFIX)]
    env = {**cp.env(), **{v: str(tmp / "helm" / v.lower()) for v in
                          ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME")}}
    # The chart with its defaults: the CRD from crds/, the operator image the chart names.
    r = subprocess.run([cp.binary("helm"), "install", RELEASE, str(CHART), "--namespace", SYSTEM,
                        "--create-namespace", "--wait", "--timeout", "5m"],
                       env=env, capture_output=True, text=True, check=False, timeout=360)
    assert r.returncode == 0, f"helm install: {r.stdout}{r.stderr}\n{node_state(cp)}"
    [operator_pod] = [p["metadata"]["name"] for p in
                      cp.request("GET", f"/api/v1/namespaces/{SYSTEM}/pods")["items"]]

    def operator_ready() -> bool:
        pod = cp.request("GET", f"/api/v1/namespaces/{SYSTEM}/pods/{operator_pod}")
        return any(c["ready"] for c in pod["status"].get("containerStatuses", []))

    wait_until(operator_ready, 120, "the operator's container Ready", interval=0.5,
               diagnose=lambda: cp.kubectl("logs", "-n", SYSTEM, operator_pod, "--tail=40", check=False).stdout)
    restricted_namespace(cp, NS)
    model_volume(cp, models)
    ecs = sample(image)
    applied = time.monotonic()
    cp.kubectl("apply", "-n", NS, "-f", "-", input=json.dumps(ecs))  # schema and CEL accept it
    s = Setup(cp, node, FleetView(cp, NS, ecs["metadata"]["name"], None, SERVED), operator_pod, image)
    s.settle(2)
    s.created_s = time.monotonic() - applied
    try:
        yield s
    finally:  # the node is the session's: the module's fleets and operator go (pods at once, no grace)
        for ns in (SYSTEM, NS, EMU_NS):
            cp.kubectl("delete", "pods", "--all", "-n", ns, "--grace-period=0", "--force", "--wait=false",
                       check=False)
            cp.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        cp.kubectl("delete", "pv", VOLUME, "--wait=false", check=False)
        shutil.rmtree(models, ignore_errors=True)


@pytest.fixture(scope="module")
def emu(setup: Setup) -> FleetView:
    """The sample with emulator engines (`COREFLEET_TEST_ENGINE=emulator`), in its own namespace, beside the
    real vLLM fleet: made by the first test that asks for it, kept for the module."""
    s = setup
    ecs = sample(s.image, emulator=True)
    restricted_namespace(s.cp, EMU_NS)
    s.cp.kubectl("apply", "-n", EMU_NS, "-f", "-", input=json.dumps(ecs))
    fleet = FleetView(s.cp, EMU_NS, ecs["metadata"]["name"], None, SERVED)
    fleet.wait_settled(2, 300, interval=0.5)
    return fleet


@pytest.fixture(autouse=True)
def _operator_log_clean(setup: Setup) -> Iterator[None]:
    """After every test: the operator, running under the chart's RBAC, logged no Forbidden, 403 or traceback."""
    yield
    log = setup.operator_log()
    assert "Forbidden" not in log, log[-4000:]
    assert " 403" not in log, log[-4000:]
    assert "Traceback" not in log, log[-4000:]


def test_operator_runs_from_the_chart_in_a_container_under_its_service_account(setup: Setup) -> None:
    s = setup
    pod = s.cp.request("GET", f"/api/v1/namespaces/{SYSTEM}/pods/{s.operator_pod}")
    assert pod["spec"]["serviceAccountName"] == f"{RELEASE}-operator"
    assert pod["spec"]["nodeName"] == s.node.name
    [status] = pod["status"]["containerStatuses"]
    assert status["image"] == OPERATOR_IMAGE, status
    assert status["ready"], status
    assert status["containerID"].removeprefix("containerd://") in s.node.container_ids()
    # What the chart's ClusterRole gives it, and what it does not.
    sa = f"system:serviceaccount:{SYSTEM}:{RELEASE}-operator"
    for verb, what, want in (("patch", "enginecoresets.corefleet.io/status", "yes"), ("delete", "pods", "yes"),
                             ("delete", "nodes", "no"), ("create", "clusterrolebindings", "no"),
                             ("delete", "customresourcedefinitions", "no"), ("get", "secrets", "yes")):
        r = s.cp.kubectl("auth", "can-i", verb, what, "-n", NS, "--as", sa, check=False)
        assert r.stdout.strip() == want, (verb, what, r.stdout, r.stderr)


def test_sample_fleet_runs_as_containers_and_serves_through_its_cluster_ip(setup: Setup) -> None:
    s = setup
    name = s.fleet.name
    pods = s.fleet.pods()
    assert set(pods) == {constants.frontend_name(name), constants.coordinator_name(name),
                         *(constants.engine_name(name, r) for r in (0, 1))}
    ids = s.node.container_ids()
    for pod in pods:
        assert pods[pod]["spec"]["nodeName"] == s.node.name
        assert s.container_id(pod) in ids, pod
    wide = s.cp.kubectl("get", "pods", "-n", NS, "-o", "wide").stdout
    assert wide.count(" Running ") == 4, wide
    # In a namespace that enforces PodSecurity `restricted`, every process of every fleet container runs as the
    # runtime image's non-root user.
    labels = s.cp.request("GET", f"/api/v1/namespaces/{NS}")["metadata"]["labels"]
    assert RESTRICTED.items() <= labels.items(), labels
    for pod in pods:
        for pid in s.container_pids(pod):
            with open(f"/proc/{pid}/status") as f:
                uids = next(line.split()[1:] for line in f if line.startswith("Uid:"))
            assert set(uids) == {str(constants.RUNTIME_UID)}, (pod, pid, uids)
    # The weights come from the claim, mounted read-only at /models in every engine and the frontend: the model
    # exists nowhere else (the image has /models/tiny-llama only, and the mount hides even that).
    for pod in pods:
        mounts = {v["name"]: v for v in pods[pod]["spec"].get("volumes", [])}
        container = pods[pod]["spec"]["containers"][0]
        if pod == constants.coordinator_name(name):
            assert constants.VOLUME_MODELS not in mounts
            continue
        assert mounts[constants.VOLUME_MODELS]["persistentVolumeClaim"] == {"claimName": CLAIM, "readOnly": True}
        assert f"/models/{PVC_MODEL}" in container["args"], container["args"]
    st = s.fleet.status()
    assert (st["phase"], st["replicas"], st["readyReplicas"], st["recoveries"]) == ("Running", 2, 2, 0), st
    assert s.fleet.get_ecs().split("\n")[1].split()[:4] == [name, "2", "2", "Running"]
    # From the host, through kube-proxy's rules for the ClusterIP.
    completion(s.url())
    fleet = s.fleet.admin().fleet()
    assert [(r.rank, r.state) for r in fleet.ranks] == [(0, RankState.SERVING), (1, RankState.SERVING)], fleet
    # From a pod, by the Service's DNS name.
    script = ("import json, urllib.request\n"
              f"body = json.dumps({{'model': '{SERVED}', 'prompt': 'Hi', 'max_tokens': 4}}).encode()\n"
              f"req = urllib.request.Request('http://{name}.{NS}.svc.cluster.local:8000/v1/completions',"
              " data=body, headers={'Content-Type': 'application/json'})\n"
              "print(json.load(urllib.request.urlopen(req, timeout=60))['usage']['completion_tokens'])\n")
    client = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "client"},
              "spec": {"restartPolicy": "Never", "securityContext": builders.pod_security_context(),
                       "containers": [{"name": "c", "image": s.image, "imagePullPolicy": "Never",
                                       "command": ["python", "-c", script],
                                       "securityContext": builders.container_security_context()}]}}
    s.cp.kubectl("apply", "-n", NS, "-f", "-", input=json.dumps(client))

    def done() -> bool:
        phase = s.cp.request("GET", f"/api/v1/namespaces/{NS}/pods/client").get("status", {}).get("phase")
        assert phase != "Failed", s.cp.kubectl("logs", "-n", NS, "client", check=False).stdout
        return bool(phase == "Succeeded")

    wait_until(done, 120, "the client pod's completion", interval=0.5)
    assert int(s.cp.kubectl("logs", "-n", NS, "client").stdout.strip()) > 0
    s.cp.kubectl("delete", "pod", "-n", NS, "client", "--wait=false")


def started_at(s: Setup, pod: str) -> float:
    """When the pod's container started (the kubelet's startedAt, whole seconds), on time.monotonic()'s clock."""
    [status] = s.fleet.pods()[pod]["status"]["containerStatuses"]
    stamp = status["state"]["running"]["startedAt"]
    wall = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    return wall - (time.time() - time.monotonic())


def kill_member_under_load(s: Setup, pod: str, replaced: str) -> tuple[Load, tuple[float, float], dict[str, Any]]:
    """Under a closed-loop load through the ClusterIP: SIGKILL the member's container (through containerd, as the OOM
    killer would); wait until the operator replaced it in place (event `replaced`), the fleet settled and more requests
    were served. The engines' containers, their processes and every other pod are the same throughout. Returns the
    load, when the kill was sent and when the container was seen stopped (time.monotonic(), as the load's), and
    what the test measured."""
    fleet = s.fleet
    fleet.at(2, START_TIMEOUT, interval=0.5)
    engines = [constants.engine_name(fleet.name, r) for r in (0, 1)]
    containers = {e: s.container_id(e) for e in engines}
    pids = {e: s.container_pids(e) for e in engines}
    uids, before = fleet.uids(), s.fleet.status()
    events = len(fleet.events())
    load = Load(s.url(), SERVED, workers=2, max_tokens=8, pause_s=0.1).start()
    try:
        wait_until(lambda: sum(o.ok for o in load.outcomes) >= 10, 120, "the load to be served", diagnose=load.summary)
        victim = s.container_id(pod)
        killed = time.monotonic()
        s.node.ctr("tasks", "kill", "--signal", "SIGKILL", victim)
        # From here on no request can be served by the killed process (one sent just before may have been).
        dead = wait_until(lambda: not task_running(s, victim) and time.monotonic(), 30, f"{pod}'s container to stop",
                          interval=0.05)
        wait_until(lambda: any(r == replaced for r, _ in fleet.events()[events:]), 300, f"{pod} replaced ({replaced})",
                   interval=0.5, diagnose=fleet.describe)
        replaced_at = time.monotonic()
        s.settle(2)
        n = sum(o.ok for o in load.outcomes)
        wait_until(lambda: sum(o.ok for o in load.outcomes) >= n + 10, 120, "requests served after the replacement",
                   diagnose=load.summary)
    finally:
        load.stop()
    uids_after = fleet.uids()
    assert uids_after[pod] != uids[pod]
    assert {n: u for n, u in uids_after.items() if n != pod} == {n: u for n, u in uids.items() if n != pod}
    assert {e: s.container_id(e) for e in engines} == containers  # no engine restarted: same containers,
    assert {e: s.container_pids(e) for e in engines} == pids  # the same processes
    story = fleet.events()[events:]
    assert [r for r, _ in story if r in ("MemberLost", replaced)] == ["MemberLost", replaced], story
    assert not [r for r, _ in story if r in ("Recovering", "Restarting", "RankLost")], story
    st = fleet.status()
    assert (st["fleetGeneration"], st["recoveries"], st["phase"]) == \
        (before["fleetGeneration"], before["recoveries"] + 1, "Running"), st
    return load, (killed, dead), {"replaced_s": round(replaced_at - killed, 1)}


def task_running(s: Setup, container: str) -> bool:
    """Whether containerd still runs the container's task (`ctr tasks ls`: TASK PID STATUS)."""
    return any(line.split()[:1] == [container] and "RUNNING" in line
               for line in s.node.ctr("tasks", "ls").stdout.splitlines())


def test_a_killed_frontend_container_is_replaced_and_reattaches_to_the_running_engines(setup: Setup) -> None:
    """Issue 25: the frontend's container killed under load. The engines keep their containers and processes (their
    weights and KV cache); the new frontend re-attaches to them (`--attach`) and the endpoint serves again after the
    frontend's own start plus the operator's part, not a fleet's start; the requests the dead frontend had in flight
    end with an error their client sees, and every request after the first one served again succeeds."""
    s = setup
    pod = constants.frontend_name(s.fleet.name)
    load, (killed, dead), measured = kill_member_under_load(s, pod, "FrontendReplaced")
    served_again = [o for o in load.outcomes if o.ok and o.started >= dead]
    back = min(o.started + o.latency for o in served_again)  # the endpoint's first answer again
    first_ok_start = min(o.started for o in served_again)
    after = [o for o in load.outcomes if o.started >= first_ok_start]
    timeline = [(round(o.started - killed, 2), round(o.latency, 2), o.kind, o.ok, o.detail[:80])
                for o in load.outcomes if o.started >= first_ok_start - 3]
    assert all(o.ok for o in after), f"{load.summary()}; from 3 s before the first served again: {timeline[:40]}"
    failed = load.failures()
    assert failed, load.summary()  # requests in flight or sent while no frontend served: they saw an error
    assert all(o.started < first_ok_start for o in failed), load.summary()
    own_start = back - started_at(s, pod)  # the new frontend's container start to its first answer
    measured.update(kill_to_serving_s=round(back - killed, 1), frontend_own_start_s=round(own_start, 1),
                    operator_part_s=round(back - killed - own_start, 1), fleet_creation_s=round(s.created_s, 1),
                    failed=len(failed), served=sum(o.ok for o in load.outcomes))
    print(f"frontend killed under load: {measured}; failures: {Counter(o.detail[:60] for o in failed).most_common(4)}")
    # What a whole-fleet recreation took before (the fleet's creation) is far more than this replacement.
    assert back - killed < s.created_s, measured
    logs = "".join(s.cp.kubectl("logs", "-n", NS, constants.engine_name(s.fleet.name, r)).stdout for r in (0, 1))
    assert logs.count("re-attached: aborted the") == 2, logs[-3000:]  # each engine dropped the dead one's requests
    assert [r.state for r in s.fleet.admin().fleet().ranks] == [RankState.SERVING] * 2


def test_a_killed_coordinator_container_is_replaced_and_no_request_fails(setup: Setup) -> None:
    """Issue 25: the coordinator's container killed under load: no request fails, no engine restarts, and the new
    coordinator takes every engine's subscription and publishes again."""
    s = setup
    pod = constants.coordinator_name(s.fleet.name)
    load, _, measured = kill_member_under_load(s, pod, "CoordinatorReplaced")
    print(f"coordinator killed under load: {measured}; {load.summary()}")
    assert not load.failures(), load.summary()
    subscribed = "All engine subscriptions received by DP coordinator"
    wait_until(lambda: subscribed in s.cp.kubectl("logs", "-n", NS, pod).stdout, 60,
               "the new coordinator to take every engine's subscription", diagnose=s.fleet.describe)
    completion(s.url())


def test_a_frontend_killed_mid_scale_up_is_replaced_and_the_resize_rolled_back_then_run_again(setup: Setup) -> None:
    """Issue 25: the frontend's container killed during a scale-up 2 -> 3 while rank 2's engine starts (Preparing):
    the resize lived in it and is rolled back (rank 2's pod goes), the frontend is replaced in place and re-attaches
    to ranks 0 and 1, whose containers and processes never change, and the resize runs again, as `replicas` still
    asks; one recovery, no new incarnation. (The scale-down's half, finished at its new size, is the planner's
    simulation: on this 2-core node a drain cannot be held open reliably, the whole node stalling for seconds.)"""
    s = setup
    name = s.fleet.name
    s.fleet.at(2, START_TIMEOUT, interval=0.5)
    engines = [constants.engine_name(name, r) for r in (0, 1)]
    containers, pids = {e: s.container_id(e) for e in engines}, {e: s.container_pids(e) for e in engines}
    before = s.fleet.status()
    events = len(s.fleet.events())
    s.fleet.scale(3)
    s.fleet.wait_operation("Preparing", timeout=START_TIMEOUT)
    s.node.ctr("tasks", "kill", "--signal", "SIGKILL", s.container_id(constants.frontend_name(name)))
    wait_until(lambda: any(r == "FrontendReplaced" for r, _ in s.fleet.events()[events:]), 300,
               "the frontend replaced in place", interval=0.5, diagnose=s.fleet.describe)
    s.settle(3)
    story = s.fleet.events()[events:]
    told = {reason: message for reason, message in story}
    assert "rolled back to 2 ranks" in told.get("ResizeFailed", ""), story
    assert "MemberLost" in told, story
    assert "the fleet serves at 3 ranks" in told.get("ResizeCompleted", ""), story  # run again
    assert not {"Recovering", "Restarting", "RankLost"} & set(told), story
    assert {e: s.container_id(e) for e in engines} == containers
    assert {e: s.container_pids(e) for e in engines} == pids
    st = s.fleet.status()
    assert (st["replicas"], st["fleetGeneration"], st["recoveries"]) == \
        (3, before["fleetGeneration"], before["recoveries"] + 1), st
    assert [r.state for r in s.fleet.admin().fleet().ranks] == [RankState.SERVING] * 3
    completion(s.url())


IDLE_WAKE_REQUESTS = 50
IDLE_AFTER_S = 10


def held_stream(url: str, sent: float) -> tuple[bool, float, str]:
    """One streamed completion sent to an idle fleet: whether it was served whole, when its first token came
    (seconds after `sent`), and what went wrong if not."""
    body = json.dumps({"model": SERVED, "prompt": "Hello", "max_tokens": 8, "stream": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    first = -1.0
    try:
        with urllib.request.urlopen(req, timeout=START_TIMEOUT + 60) as r:
            for line in r:
                if line.startswith(b"data: {") and first < 0:
                    first = time.time() - sent
                if line.strip() == b"data: [DONE]":
                    return first >= 0, first, ""
    except (OSError, ValueError) as e:
        return False, first, f"{type(e).__name__}: {e}"
    return False, first, "the stream ended without [DONE]"


def epoch(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def test_an_idle_fleet_gives_its_engines_back_keeps_its_endpoint_and_50_held_requests_wake_it(setup: Setup) -> None:
    """Issue 28: with `spec.idle.afterSeconds`, the quiet fleet drains and its engine pods go (their resources
    given back), the frontend and coordinator containers stay; then 50 concurrent requests arrive at the Service:
    they wait at the frontend, the operator wakes the fleet (new engine pods, joined in place), and every request is
    served. corefleet's own time (the request to the engine pods' creation, and the engines serving to the first
    token) is measured beside the engines' own start (container start to serving). A resize after it (2 -> 1) leaves
    the surviving rank's container."""
    s = setup
    f = s.fleet
    name = f.name
    f.scale(2)
    s.settle(2)
    members = {n: p["metadata"]["uid"] for n, p in f.pods().items() if "engine" not in n}
    events = len(f.events())
    s.cp.kubectl("patch", "ecs", name, "-n", NS, "--type=merge", "-p",
                 json.dumps({"spec": {"idle": {"afterSeconds": IDLE_AFTER_S}}}))
    try:
        def idle() -> bool:
            return f.status().get("phase") == "Idle" and not any("engine" in n for n in f.pods())

        wait_until(idle, 240, "the fleet idle, its engine pods gone", interval=0.5, diagnose=f.describe)
        st = f.status()
        assert {n: p["metadata"]["uid"] for n, p in f.pods().items()} == members  # the endpoint's pods stay
        assert st["idle"]["cause"] == "Quiet", st
        assert (st["readyReplicas"], st["replicas"]) == (0, 2), st
        assert {c["type"]: c["reason"] for c in st["conditions"]}["Available"] == "Idle", st
        told = [r for r, _ in f.events()[events:]]
        assert {"FleetIdling", "FleetIdle"} <= set(told), told
        fleet_view = f.admin().fleet()
        assert [r.state for r in fleet_view.ranks] == [RankState.IDLE] * 2
        assert fleet_view.requests_waiting == 0

        url = s.url()
        sent = time.time()
        with concurrent.futures.ThreadPoolExecutor(IDLE_WAKE_REQUESTS) as pool:
            futures = [pool.submit(held_stream, url, sent) for _ in range(IDLE_WAKE_REQUESTS)]
            results = [fut.result() for fut in futures]
        failed = [why for ok, _, why in results if not ok]
        assert not failed, Counter(failed).most_common(3)
        first_token = min(t for _, t, _ in results)

        # Running once the new pods are Ready too (the kubelet's readiness probe, after the frontend serves on them).
        wait_until(lambda: f.status().get("phase") == "Running", 120, "the fleet Running", interval=0.5,
                   diagnose=f.describe)
        st = f.status()
        assert (st["replicas"], st.get("idle")) == (2, None), st
        pods = f.pods()
        assert {n: p["metadata"]["uid"] for n, p in pods.items() if "engine" not in n} == members
        engines = [pods[constants.engine_name(name, r)] for r in (0, 1)]
        created = max(epoch(p["metadata"]["creationTimestamp"]) for p in engines)  # whole seconds
        container = max(epoch(p["status"]["containerStatuses"][0]["state"]["running"]["startedAt"]) for p in engines)
        serving = max(r.since or 0.0 for r in f.admin().fleet().ranks)  # the last rank serving (the frontend's clock)
        told = [r for r, _ in f.events()[events:]]
        assert (told.count("FleetWaking"), told.count("FleetAwake")) == (1, 1), told
        assert not {"RankLost", "MemberLost", "Recovering", "WakeFailed"} & set(told), told
        measured = {"first_token_s": round(first_token, 2), "to_pods_created_s": round(created - sent, 2),
                    "container_start_s": round(container - created, 2),
                    "engines_own_start_s": round(serving - container, 2),
                    "serving_to_first_token_s": round(sent + first_token - serving, 2)}
        print(f"idle fleet woken by {IDLE_WAKE_REQUESTS} requests: {measured}")
        # corefleet's part: noticing the held requests and creating the pods (creationTimestamp: whole seconds, so up
        # to 1 s more), then releasing the held requests once a rank serves.
        assert measured["to_pods_created_s"] + measured["serving_to_first_token_s"] <= 2.0, measured
        completion(url)
        # The woken ranks are members like any: a later resize (2 -> 1, in place) leaves the survivor's container.
        survivor = constants.engine_name(name, 0)
        survivor_container = s.container_id(survivor)
        f.scale(1)
        s.settle(1)
        assert s.container_id(survivor) == survivor_container
        assert {n: p["metadata"]["uid"] for n, p in f.pods().items() if "engine" not in n} == members
        completion(url)
    finally:
        s.cp.kubectl("patch", "ecs", name, "-n", NS, "--type=json", "-p",
                     json.dumps([{"op": "remove", "path": "/spec/idle"}]), check=False)
    s.settle(f.status()["replicas"])


def test_the_sample_with_emulator_engines_runs_as_containers_and_serves(setup: Setup, emu: FleetView) -> None:
    """The same sample, engines replaced by the emulator (the test image's switch, as another image would):
    Running as containers on the node, a completion through its ClusterIP."""
    s = setup
    victim = constants.engine_name(emu.name, 1)
    logs = s.cp.kubectl("logs", "-n", EMU_NS, victim).stdout
    assert "corefleet_harness.emulator" in logs, logs[-2000:]  # the emulator, not vLLM, serves this rank
    ids = s.node.container_ids()
    assert all(s.container_id(pod, emu) in ids for pod in emu.pods())
    out = completion(s.url(emu), max_tokens=16)
    assert out["usage"]["completion_tokens"] == 16, out
    assert [r.state for r in emu.admin().fleet().ranks] == [RankState.SERVING] * 2


def test_a_hung_engine_is_marked_not_ready_then_killed_by_the_kubelets_liveness_probe(setup: Setup,
                                                                                     emu: FleetView) -> None:
    """SIGSTOP to every process of rank 1's container (as a hung node or a debugger would leave them): the
    kubelet's readiness probe marks the pod NotReady, its liveness probe has the container killed (SIGTERM
    stays pending on a stopped process: SIGKILL after the grace period, exit 137) unless the operator deleted
    the hung rank's pod first (the frontend reported it Unresponsive too long); then the operator replaces
    rank 1 in place. Rank 0 serves a client pinned to it throughout, through the ClusterIP, and the frontend,
    coordinator and rank 0 keep their pods. On the emulator fleet: what hangs here is the kubelet's, the
    frontend's and the operator's business, and a new emulated engine starts in a second where a real vLLM
    engine takes one to two minutes (a killed real vLLM engine container is replaced in place above)."""
    s, fleet = setup, emu
    name = fleet.name
    fleet.wait_settled(2, 300, interval=0.5)
    before, uid = fleet.status(), fleet.uids()
    victim = constants.engine_name(name, 1)
    rank1 = uid[victim]

    def ready(pod: str) -> bool | None:
        p = fleet.pods().get(pod)
        if p is None or p["metadata"]["uid"] != uid[pod]:
            return None
        return {c["type"]: c["status"] for c in p["status"].get("conditions", [])}.get("Ready") == "True"

    def rank1_ended() -> str | None:
        """How rank 1's container ended: its exit code as the kubelet reported it, or its pod deleted."""
        p = fleet.pods().get(victim)
        if p is None or p["metadata"]["uid"] != rank1 or p["metadata"].get("deletionTimestamp"):
            return "deleted by the operator"
        term = p["status"]["containerStatuses"][0]["state"].get("terminated")
        return f"exit {term['exitCode']}" if term else None

    pinned = Load(s.url(fleet), SERVED, workers=1, max_tokens=8, pause_s=0.5,
                  headers={"X-data-parallel-rank": "0"}).start()
    try:
        wait_until(lambda: len(pinned.outcomes) >= 2, 120, "the pinned client's first answers")
        pids = s.container_pids(victim, fleet)
        stopped_at = time.monotonic()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: ready(victim) is False, 120, "rank 1 NotReady", interval=0.5, diagnose=fleet.describe)
        not_ready_at = time.monotonic()
        how = wait_until(rank1_ended, 240, "rank 1's end", interval=0.5, diagnose=fleet.describe)
        ended_at = time.monotonic()
        fleet.wait_settled(2, 300, interval=0.5)
        recovered_at = time.monotonic()
    finally:
        pinned.stop()
    after = fleet.uids()
    kept = {pod for pod, u in after.items() if uid.get(pod) == u}
    until_end = [o for o in pinned.outcomes if o.started + o.latency < ended_at]
    served_while_hung = [o for o in until_end if o.started >= stopped_at and o.ok]
    kubelet = s.pod_events(rank1, fleet)
    print(f"rank 1 SIGSTOPped ({len(pids)} processes): NotReady seen after {not_ready_at - stopped_at:.1f} s; "
          f"ended ({how}) seen after {ended_at - stopped_at:.1f} s; fleet Running at 2 again "
          f"{recovered_at - ended_at:.1f} s later; kept {sorted(kept)}; rank 0 served {len(served_while_hung)} "
          f"pinned request(s) while rank 1 hung; pinned load: {pinned.summary()}; kubelet events on rank 1 "
          f"{sorted({r for r, _ in kubelet})}")

    if how.startswith("exit"):  # the kubelet's liveness kill: SIGTERM pending on the stopped processes, then SIGKILL
        assert how == "exit 137", how
        # restartPolicy Never and one container: the kubelet kills the whole pod, with the words of a pod kill
        # (kubelet 1.37, computePodActions: KillPod); the liveness failure is in its Unhealthy events.
        assert ("Killing", "Stopping container engine") in kubelet, kubelet
        assert any(r == "Unhealthy" and m.startswith("Liveness probe failed") for r, m in kubelet), kubelet
    assert any(r == "Unhealthy" and m.startswith("Readiness probe failed") for r, m in kubelet), kubelet
    assert served_while_hung, pinned.summary()
    assert not [o for o in pinned.outcomes if not o.ok], pinned.summary()  # rank 0 served throughout
    # Replaced in place: one loss counted, the same incarnation, the survivors' pods kept, the frontend Ready.
    assert kept == {constants.frontend_name(name), constants.coordinator_name(name), constants.engine_name(name, 0)}
    assert ready(constants.frontend_name(name))
    assert ready(constants.engine_name(name, 0))
    st = fleet.status()
    assert (st["recoveries"], st["fleetGeneration"]) == (before["recoveries"] + 1, before["fleetGeneration"]), st
    assert (st["operation"]["phase"], st["operation"]["replace"]) == ("Completed", [1]), st
    events = fleet.events()
    assert any(reason == "RankLost" and f"rank 1 (pod {victim})" in m and "replacing rank 1 in place" in m
               for reason, m in events), events
    assert any(reason == "RankReplaced" and st["operation"]["id"] in m for reason, m in events), events
    completion(s.url(fleet))


# ---- two frontends (spec.frontend.replicas: 2), last: the module's real vLLM fleet is recreated with them ----------
FOLLOWER_WINDOW_S = 10.0  # after a frontend's container dies: the kubelet, the endpoint controller and kube-proxy
# take its pod out of the Service (until then a new connection kube-proxy sends to it is refused)


@pytest.fixture
def two_frontends(setup: Setup) -> Setup:
    """The real vLLM fleet with two frontends: `spec.frontend.replicas: 2` recreates it (the engines learn every
    frontend's address when they start), once, by the first test that asks."""
    s = setup
    if s.fleet.frontends() != 2:
        events, gen = len(s.fleet.events()), s.fleet.status()["fleetGeneration"]
        t0 = time.monotonic()
        s.cp.kubectl("patch", "ecs", s.fleet.name, "-n", NS, "--type=merge", "-p",
                     json.dumps({"spec": {"replicas": 2, "frontend": {"replicas": 2}}}))
        wait_until(lambda: s.fleet.status().get("fleetGeneration") == gen + 1, 120, "a new incarnation",
                   interval=0.5, diagnose=s.fleet.describe)
        s.settle(2)
        print(f"frontend.replicas 1 -> 2: the fleet recreated in {time.monotonic() - t0:.1f} s")
        told = [m for r, m in s.fleet.events()[events:] if r == "Restarting"]
        assert any("spec changed (frontend.replicas): recreating all ranks" in m for m in told), told
    st = s.fleet.status()
    assert [(f["pod"], f["ready"]) for f in st["frontends"]] == [
        (constants.frontend_name(s.fleet.name, i), True) for i in range(2)], st
    return s


def requests_on(fleet: FleetView, index: int) -> dict[int, int]:
    """Requests frontend `index` sent to each rank it knows."""
    return {r.rank: r.requests_total for r in fleet.admin(index).fleet().ranks}


def test_two_frontends_one_killed_fails_only_its_requests_and_its_replacement_takes_traffic_again(
        two_frontends: Setup) -> None:
    """Issue 25: frontend 1's container killed under load through the Service: frontend 0 keeps answering, only
    requests on the dead one (in flight, or sent to it before it left the Service's endpoints) fail, the operator
    replaces it in place (attaching with its client index) and it takes traffic again; no engine restarts."""
    s = two_frontends
    name, pod = s.fleet.name, constants.frontend_name(s.fleet.name, 1)
    s.fleet.at(2, START_TIMEOUT, interval=0.5)
    engines = [constants.engine_name(name, r) for r in (0, 1)]
    containers, pids = {e: s.container_id(e) for e in engines}, {e: s.container_pids(e) for e in engines}
    uids, before, events = s.fleet.uids(), s.fleet.status(), len(s.fleet.events())
    # Two clients, a fifth of a second between requests: frontend 0 alone keeps serving them while the new frontend
    # 1 imports vLLM on the same two cores (with a denser load that import takes over a minute).
    load = Load(s.url(), SERVED, workers=2, max_tokens=8, pause_s=0.2).start()
    try:
        wait_until(lambda: sum(o.ok for o in load.outcomes) >= 10 and sum(requests_on(s.fleet, 1).values()) > 0,
                   120, "the load served by both frontends", diagnose=load.summary)
        victim = s.container_id(pod)
        killed = time.monotonic()
        s.node.ctr("tasks", "kill", "--signal", "SIGKILL", victim)
        dead = wait_until(lambda: not task_running(s, victim) and time.monotonic(), 30, "frontend 1's container "
                          "to stop", interval=0.05)
        wait_until(lambda: any(r == "FrontendReplaced" for r, _ in s.fleet.events()[events:]), 300,
                   "frontend 1 replaced", interval=0.5, diagnose=s.fleet.describe)
        replaced = time.monotonic()
        s.settle(2)
        wait_until(lambda: sum(requests_on(s.fleet, 1).values()) >= 4, 120, "the new frontend 1 taking traffic",
                   interval=0.5, diagnose=load.summary)
    finally:
        load.stop()
    failed = load.failures()
    meanwhile = [o for o in load.outcomes if o.ok and dead < o.started < replaced]
    print(f"frontend 1 of 2 killed under load: replaced after {replaced - killed:.1f} s (its new container started "
          f"{started_at(s, pod) - killed:.1f} s after the kill); {len(meanwhile)} served "
          f"meanwhile; failed {[(round(o.started - dead, 2), o.detail[:60]) for o in failed]}; {load.summary()}")
    assert meanwhile, load.summary()  # the Service kept answering through frontend 0
    assert all(o.started < dead + FOLLOWER_WINDOW_S for o in failed), load.summary()
    assert len(failed) <= len(load.outcomes) // 10, load.summary()
    assert {e: s.container_id(e) for e in engines} == containers
    assert {e: s.container_pids(e) for e in engines} == pids
    uids_after = s.fleet.uids()
    assert {n: u for n, u in uids_after.items() if n != pod} == {n: u for n, u in uids.items() if n != pod}
    story = s.fleet.events()[events:]
    assert [r for r, _ in story if r in ("MemberLost", "FrontendReplaced")] == ["MemberLost", "FrontendReplaced"]
    assert not [r for r, _ in story if r in ("Recovering", "Restarting", "RankLost")], story
    st = s.fleet.status()
    assert (st["fleetGeneration"], st["recoveries"]) == (before["fleetGeneration"], before["recoveries"] + 1), st
    logs = "".join(s.cp.kubectl("logs", "-n", NS, e).stdout for e in engines)
    assert logs.count("Frontend 1 re-attached: aborted the") == 2, logs[-3000:]


def test_a_killed_engine_container_is_replaced_in_place_through_both_frontends(two_frontends: Setup) -> None:
    """SIGKILL to rank 1's main process through containerd: the container dies with 137, the pod ends
    Failed (restartPolicy Never), and the operator replaces the rank in place while the rest serve on. With two
    frontends: frontend 0 runs the new engine's handshake and drives frontend 1 through its part, and both route to
    the new engine afterwards; no other pod changes."""
    s = two_frontends
    s.fleet.at(2, START_TIMEOUT, interval=0.5)
    victim = constants.engine_name(s.fleet.name, 1)
    before, old_uids = s.fleet.status(), s.fleet.uids()
    s.node.ctr("tasks", "kill", "--signal", "SIGKILL", s.container_id(victim))
    wait_until(lambda: (s.fleet.status().get("operation") or {}).get("replace") == [1], 120,
               "a replacement of rank 1", interval=0.5, diagnose=s.fleet.describe)
    s.settle(2)
    st = s.fleet.status()
    assert (st["recoveries"], st["fleetGeneration"]) == (before["recoveries"] + 1, before["fleetGeneration"]), st
    assert st["operation"]["phase"] == "Completed", st
    uids = s.fleet.uids()
    assert uids[victim] != old_uids[victim]
    assert {n: u for n, u in uids.items() if n != victim} == {n: u for n, u in old_uids.items() if n != victim}
    events = s.fleet.events()
    # Whoever saw it first: the frontend (the engine's connection lost) or the kubelet (the pod Failed, 137).
    lost = [m for reason, m in events if reason == "RankLost"]
    assert any(f"rank 1 (pod {victim})" in m and "replacing rank 1 in place" in m for m in lost), lost
    assert any(reason == "RankReplaced" and st["operation"]["id"] in m for reason, m in events), events
    part = s.fleet.admin(1).resize(st["operation"]["id"])
    assert part is not None
    assert (part.follower, part.replace, part.phase) == (True, (1,), ResizePhase.COMPLETED), part
    for index in (0, 1):
        assert [r.state for r in s.fleet.admin(index).fleet().ranks] == [RankState.SERVING] * 2
    # Both frontends route to the new engine: requests pinned to rank 1 through the Service (kube-proxy picks a
    # frontend for each connection) until each frontend sent some.
    sent = {i: requests_on(s.fleet, i).get(1, 0) for i in (0, 1)}

    def both_route_to_rank_1() -> bool:
        completion(s.url(), headers={"X-data-parallel-rank": "1"})
        return all(requests_on(s.fleet, i).get(1, 0) > sent[i] for i in (0, 1))

    wait_until(both_route_to_rank_1, 120, "both frontends sending requests to the new rank 1", interval=0.1)


def operator_container(s: Setup) -> tuple[str, int]:
    """The operator pod's container: its containerd ID and restart count."""
    [status] = s.cp.request("GET", f"/api/v1/namespaces/{SYSTEM}/pods/{s.operator_pod}")["status"]["containerStatuses"]
    return str(status.get("containerID", "")).removeprefix("containerd://"), int(status["restartCount"])


def test_frontend_0_killed_mid_replacement_of_a_rank_is_replaced_and_the_rank_replaced_again(
        two_frontends: Setup) -> None:
    """Issue 25: rank 1's engine container killed, then frontend 0's while rank 1's new engine starts (the
    replacement Preparing, run by frontend 0, frontend 1 following): the replacement is rolled back (rank 1's new pod
    goes), frontend 0 is replaced in place and re-attaches to the other ranks with rank 1 left out (Dead), frontend
    1's part of the old replacement is orphaned by it and fails, then rank 1 is replaced again through both. The
    operator's container is killed too while frontend 0 is being replaced: the restarted operator carries the
    operation on from the status. The other engines' containers and processes, and frontend 1's, never change; no
    new incarnation."""
    s = two_frontends
    name = s.fleet.name
    size = s.fleet.status()["replicas"]
    victim = constants.engine_name(name, 1)
    stays = [constants.engine_name(name, r) for r in range(size) if r != 1] + [constants.coordinator_name(name),
                                                                                constants.frontend_name(name, 1)]
    containers, pids = {p: s.container_id(p) for p in stays}, {p: s.container_pids(p) for p in stays}
    before, old_uid = s.fleet.status(), s.fleet.uids()[victim]
    events = len(s.fleet.events())
    s.node.ctr("tasks", "kill", "--signal", "SIGKILL", s.container_id(victim))

    def new_engine_starting() -> bool:
        op = s.fleet.status().get("operation") or {}
        uid = s.fleet.uids().get(victim)
        return op.get("replace") == [1] and op.get("phase") == "Preparing" and uid not in (None, old_uid) \
            and s.fleet.admin(1).resize(str(op.get("id"))) is not None  # frontend 1 runs its part

    wait_until(new_engine_starting, 120, "rank 1's replacement with its new pod, frontend 1 following",
               interval=0.2, diagnose=s.fleet.describe)
    interrupted = s.fleet.status()["operation"]["id"]
    s.node.ctr("tasks", "kill", "--signal", "SIGKILL", s.container_id(constants.frontend_name(name)))
    killed = time.monotonic()
    wait_until(lambda: (s.fleet.status().get("operation") or {}).get("detached") == [1], 120,
               "the frontend's replacement, leaving rank 1 out", interval=0.2, diagnose=s.fleet.describe)
    # kopf posts a pass's events after its status write, from a queue that a SIGKILL loses: the operator is killed
    # once they are out, while the frontend's replacement still runs (its new pod takes ~25 s to be Ready).
    wait_until(lambda: "MemberLost" in {r for r, _ in s.fleet.events()[events:]}, 60, "the MemberLost event",
               interval=0.2, diagnose=s.fleet.describe)
    operator, restarts = operator_container(s)
    s.node.ctr("tasks", "kill", "--signal", "SIGKILL", operator)  # the kubelet restarts it (10 s back-off)
    wait_until(lambda: operator_container(s)[1] > restarts, 120, "the operator's container restarted", interval=0.5)
    marks: dict[str, float] = {}

    def replaced_again() -> bool:
        seen = {r for r, _ in s.fleet.events()[events:]}
        for reason in ("FrontendReplaced", "RankReplaced"):
            if reason in seen:
                marks.setdefault(reason, time.monotonic() - killed)
        return "RankReplaced" in seen

    wait_until(replaced_again, 600, "rank 1 replaced again after the frontend", interval=0.5, diagnose=s.fleet.describe)
    s.settle(size)
    print(f"frontend killed mid-replacement (and the operator restarted): frontend replaced after "
          f"{marks.get('FrontendReplaced', -1):.1f}s, rank 1 replaced again after {marks['RankReplaced']:.1f}s")
    story = s.fleet.events()[events:]
    reasons = [r for r, _ in story]
    told = {reason: message for reason, message in story}
    assert f"replacement {interrupted} of rank 1 rolled back" in told.get("ResizeFailed", ""), story
    order = [r for r in reasons if r in ("MemberLost", "FrontendReplaced", "RankReplacementResumed", "RankReplaced")]
    assert order == ["MemberLost", "FrontendReplaced", "RankReplacementResumed", "RankReplaced"], story
    assert not {"Recovering", "Restarting"} & set(reasons), story
    assert not [m for r, m in story if r == "RankLost" and "recreating" in m], story
    assert {p: s.container_id(p) for p in stays} == containers
    assert {p: s.container_pids(p) for p in stays} == pids
    st = s.fleet.status()
    assert (st["replicas"], st["fleetGeneration"], st["recoveries"], st["phase"]) == \
        (size, before["fleetGeneration"], before["recoveries"] + 2, "Running"), st
    log = s.cp.kubectl("logs", "-n", NS, constants.frontend_name(name)).stdout
    assert f"Re-attached to {size - 1} running engine(s); rank 1 left out, Dead until replaced" in log, log[-3000:]
    part = s.fleet.admin(1).resize(interrupted)
    assert part is not None
    assert (part.follower, part.phase) == (True, ResizePhase.FAILED), part
    assert "frontend 0 that drove it is gone" in part.error, part
    for index in (0, 1):
        assert [r.state for r in s.fleet.admin(index).fleet().ranks] == [RankState.SERVING] * size
    # Both frontends route to the new rank 1: requests pinned to it through the Service (kube-proxy picks a frontend
    # for each connection) until each frontend sent some.
    sent = {i: requests_on(s.fleet, i).get(1, 0) for i in (0, 1)}

    def both_route_to_rank_1() -> bool:
        completion(s.url(), headers={"X-data-parallel-rank": "1"})
        return all(requests_on(s.fleet, i).get(1, 0) > sent[i] for i in (0, 1))

    wait_until(both_route_to_rank_1, 120, "both frontends sending requests to the new rank 1", interval=0.1)


def test_real_vllm_fleet_with_two_frontends_resizes_2_3_2_in_place_under_load(two_frontends: Setup) -> None:
    """2 -> 3 -> 2 through the ClusterIP, with two frontend pods behind it (frontend 0 drives each resize through
    both, issue 25): no request fails, the surviving ranks keep their containers and pods, every frontend routes to
    rank 2 while it serves and neither knows it once it retired, and long requests on rank 2 finish in its drain."""
    s = two_frontends
    name = s.fleet.name
    s.fleet.at(2, START_TIMEOUT, interval=0.5)
    survivors = {r: s.container_id(constants.engine_name(name, r)) for r in (0, 1)}
    uids, before = s.fleet.uids(), s.fleet.status()
    events_before = len(s.fleet.events())
    # A client that keeps sending through the ClusterIP, with a second between requests. (vLLM's CPU worker
    # busy-polls for its next step for 1 s after each one: under a denser load the engines keep both cores of
    # this machine busy and the new engine takes minutes to start instead of about one.)
    load = Load(s.url(), SERVED, workers=1, max_tokens=8, pause_s=1.0).start()
    columns: list[list[str]] = []
    longs: LongStreams | None = None
    try:
        with ResizeWatch(s.fleet) as up:
            t0 = time.monotonic()
            s.fleet.scale(3)
            wait_until(lambda: s.fleet.status().get("phase") == "Scaling", 30, "phase Scaling")
            columns.append(s.fleet.get_ecs().split("\n")[1].split()[:4])
            s.settle(3)
            up_took = time.monotonic() - t0
        columns.append(s.fleet.get_ecs().split("\n")[1].split()[:4])
        # Every frontend routes to the new rank (each counts what it sent there).
        served = wait_until(lambda: all(requests_on(s.fleet, i).get(2, 0) > 0 for i in range(2))
                            and sum(requests_on(s.fleet, i)[2] for i in range(2)), 120,
                            "both frontends routing to rank 2", diagnose=load.summary)
        with ResizeWatch(s.fleet) as down:
            # Long requests on the leaving rank, kept in flight (each that ends replaced at once) until the rank
            # refuses a new one: the drain lets those it took finish. The scale-down is sent once the frontends
            # count one in flight there. (Kept, not sent once: on this saturated machine the operator, whose pod
            # requests little CPU, may take longer to act than a long request lasts.)
            longs = LongStreams(s.url(), SERVED, rank=2, lengths=LONG_TOKENS)
            wait_until(lambda: longs.started() >= len(LONG_TOKENS), 60, "the long streams' first tokens")
            in_flight = wait_until(lambda: sum(s.fleet.admin(i).fleet().rank(2).in_flight for i in range(2)), 30,
                                   "a frontend to count a long request in flight on rank 2", interval=0.05,
                                   diagnose=lambda: f"the long streams' outcomes (None: still streaming): "
                                                    f"{[long.outcome for long in longs.streams]}")
            t0 = time.monotonic()
            s.fleet.scale(2)
            s.settle(2, timeout=180)
            down_took = time.monotonic() - t0
    finally:
        load.stop()
        if longs is not None:
            longs.stop()
    columns.append(s.fleet.get_ecs().split("\n")[1].split()[:4])
    served_long, refused_long = longs.served(), longs.refused()
    assert [long.result() for long in served_long] == [(True, "finish_reason length")] * len(served_long)
    # Those sent once the drain began were refused at once, with the reason: the rank is being retired, or (sent just
    # after the last long one ended the drain, and reaching a frontend that had committed already) it is gone.
    assert all("being retired" in long.result()[1] or "data_parallel_rank 2 is out of range" in long.result()[1]
               for long in refused_long), [r.outcome for r in refused_long]
    print(f"2 -> 3 settled in {up_took:.1f} s, 3 -> 2 in {down_took:.1f} s; rank 2 served {served} request(s) "
          f"before it was retired, {in_flight} long one(s) in flight at the scale-down ({len(served_long)} served, "
          f"{len(refused_long)} refused in its drain); load: {load.summary()}; "
          f"operation phases up {up.phases}, down {down.phases}; "
          f"kubectl get ecs {columns}; events {[r for r, _ in s.fleet.events()[events_before:]]}")

    # No request failed, and the surviving ranks are the same containers in the same pods.
    assert len(load.outcomes) > 10, load.summary()
    assert {o.kind for o in load.outcomes} == {"stream", "plain"}
    assert not load.failures(), load.summary()
    assert {r: s.container_id(constants.engine_name(name, r)) for r in (0, 1)} == survivors
    assert s.fleet.uids() == uids, "a surviving pod was recreated"
    assert "Preparing" in up.phases, up.phases
    assert up.phases[-1] == "Completed", up.phases
    # The drain: every frontend stopped routing to rank 2 and waited for what it had in flight there. Where one had
    # some when the drain began, the drain lasted until they ended, and the status showed it. Where none had any (the
    # long streams between one ending and its replacement, the operator slow to act on this machine: 11 s once), it
    # ends at once, before a status write can show it.
    logs = [s.cp.kubectl("logs", "-n", NS, constants.frontend_name(name, i)).stdout for i in range(2)]
    at_drain = [re.search(r"Rank 2: Draining \((\d+) request\(s\) in flight\)", text) for text in logs]
    assert all(at_drain), [text[-2000:] for text in logs]
    if any(int(m.group(1)) for m in at_drain if m):
        # (the operator's ResizeDraining event comes with the status write of that phase: the watch's samples, 0.1 s
        # apart, can miss a short Draining on this saturated machine, as a fresh-clone CI's did)
        told = [r for r, _ in s.fleet.events()[events_before:]]
        assert "Draining" in down.phases or "ResizeDraining" in told, \
            (down.phases, told, down.errors[-5:], [m.group(0) for m in at_drain if m])
    assert down.phases[-1] == "Completed", down.phases
    assert 2 in down.retired_at, down.retired_at
    assert down.retired_at[2] <= down.deleted_at[constants.engine_name(name, 2)]
    assert columns == [[name, "3", "2", "Scaling"], [name, "3", "3", "Running"], [name, "2", "2", "Running"]], columns
    for i in range(2):  # rank 2 retired on every frontend
        assert sorted(requests_on(s.fleet, i)) == [0, 1], i
    log = logs[1]
    for what in ("Prepared: waiting for frontend 0's commit", "Committing: adding rank 2",
                 "Committing: removing rank 2"):
        assert what in log, log[-3000:]
    st = s.fleet.status()
    assert (st["replicas"], st["recoveries"]) == (2, before["recoveries"]), st

    def story_told() -> list[tuple[str, str]] | None:
        """The events since the resize began, once the second ResizeCompleted was posted (just after the status)."""
        story = s.fleet.events()[events_before:]
        return story if [reason for reason, _ in story].count("ResizeCompleted") >= 2 else None

    story = wait_until(story_told, 30, "the second ResizeCompleted event", diagnose=s.fleet.describe)
    main = [reason for reason, _ in story if reason in ("ResizeStarted", "RankRetired", "ResizeCompleted", "RankLost")]
    assert main == ["ResizeStarted", "ResizeCompleted", "ResizeStarted", "RankRetired", "ResizeCompleted"], story
