# SPDX-License-Identifier: Apache-2.0
"""A real Kubernetes control plane on 127.0.0.1, for tests and local runs.

etcd, kube-apiserver (token auth, RBAC on), kube-controller-manager and kube-scheduler are started
as child processes on ports picked here, with their state in one directory. By default there is no
kubelet: `add_gpu_node` registers fake nodes with `nvidia.com/gpu` capacity, and `KubeletStandIn`
plays the kubelet's part by moving scheduled pods to Running/Ready. With `node_ip` set, a real node
(`corefleet_harness.localnode`: containerd, kubelet, kube-proxy, CoreDNS) can join it.

The binaries come from `hack/control-plane.sh`, which builds them from the Go module proxy and
caches them outside the repository; its output directory is given here as `bin_dir` (or through
the COREFLEET_K8S_BIN environment variable).

The aggregation layer is on, so an extension API server (prometheus-adapter's custom-metrics API,
which the controller manager's HPA controller reads) can be registered with an `APIService`: the
API server authenticates to it with a `front-proxy-client` certificate of its own front-proxy CA.
Aggregator routing stays off (the default): without kube-proxy the API server must dial an address
it can reach, and the only one a process on 127.0.0.1 has is refused in EndpointSlices (no loopback
endpoints); an `ExternalName` Service naming 127.0.0.1 is resolved by the cluster-IP resolver and
dialed directly.

Failure is loud: a component that exits or does not become ready raises `ControlPlaneError` with
its command line and the tail of its log.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from corefleet_harness.support import free_port, http_get, tail, wait_until
from corefleet_operator.constants import GPU_RESOURCE

logger = logging.getLogger(__name__)

BIN_ENV = "COREFLEET_K8S_BIN"
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
TOOLS = ("kubectl", "helm")
ADMIN_TOKEN = "corefleet-admin-token"  # a static token in system:masters; RBAC holds for all others
FRONT_PROXY_CLIENT = "front-proxy-client"  # the CN the API server presents to extension API servers
# Controllers that need a kubelet, volumes or node IPAM are off (names as in v1.37's --help); the rest
# (garbage collector, namespace, serviceaccount, replicaset, HPA, ...) run as in a real cluster.
DISABLED_CONTROLLERS = (
    "node-ipam-controller",
    "node-lifecycle-controller",
    "persistentvolume-binder-controller",
    "persistentvolume-attach-detach-controller",
    "persistentvolume-expander-controller",
    "ttl-controller",
)
# The controllers among those that a real node needs (`LocalControlPlane.node_ip`): the node
# lifecycle controller lifts the not-ready taint that admission puts on a new node; the volume binder
# binds a PersistentVolumeClaim to its PersistentVolume (a fleet's model storage).
NODE_CONTROLLERS = ("node-lifecycle-controller", "ttl-controller", "persistentvolume-binder-controller")
SERVICE_CIDR = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"  # the first address of SERVICE_CIDR: the `kubernetes` Service


class ControlPlaneError(RuntimeError):
    """A control-plane binary is missing, exited, or did not become ready in time."""


def resolve_bin_dir(bin_dir: Path | str | None = None) -> Path:
    """The directory with the control-plane binaries, checked to be complete."""
    raw = bin_dir if bin_dir is not None else os.environ.get(BIN_ENV)
    if not raw:
        raise ControlPlaneError(
            f"{BIN_ENV} is not set: run `bash hack/control-plane.sh` and set {BIN_ENV} to the "
            "directory it prints (README's commands do this)"
        )
    path = Path(raw)
    missing = [b for b in (*COMPONENTS, *TOOLS) if not os.access(path / b, os.X_OK)]
    if missing:
        raise ControlPlaneError(f"missing control-plane binaries in {path}: {', '.join(missing)}")
    return path


class Component:
    """One child process of a local cluster, with its own log file, checked and stopped by its PID.

    `error` is the exception type its failures raise; the message names the component, its command
    line and the tail of its log. Shared by the control plane, the node (`localnode`) and the tests'
    metrics stack.
    """

    def __init__(self, name: str, argv: Sequence[str], log: Path, *,
                 error: type[RuntimeError] = RuntimeError, env: Mapping[str, str] | None = None) -> None:
        self.name, self.argv, self.log, self.error = name, list(argv), log, error
        self._logfile: IO[bytes] = log.open("wb")
        self.popen = subprocess.Popen(self.argv, stdout=self._logfile, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=None if env is None else dict(env))

    @property
    def pid(self) -> int:
        return self.popen.pid

    def describe(self, problem: str) -> str:
        return f"{self.name} {problem}\ncommand: {shlex.join(self.argv)}\nlog {self.log} (tail):\n{tail(self.log)}"

    def check_alive(self) -> bool:
        """True while it runs; raises `error` (with its log) once it has exited."""
        if self.popen.poll() is not None:
            raise self.error(self.describe(f"exited with code {self.popen.returncode}"))
        return True

    def wait_ready(self, check: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
        """Poll `check` until it holds; a component that dies meanwhile fails at once, with its log."""
        def ready() -> bool:
            return self.check_alive() and check()

        try:
            wait_until(ready, timeout, what, interval=interval, retry_on=(Exception,), fatal=(self.error,))
        except TimeoutError as e:
            raise self.error(self.describe(str(e))) from None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds (the scheduler may ignore SIGTERM)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._logfile.close()



class KubectlError(subprocess.CalledProcessError):
    """A kubectl that failed, saying what kubectl said (a bare CalledProcessError names only the command)."""

    def __str__(self) -> str:
        stderr, stdout = (self.stderr or "").strip(), (self.stdout or "").strip()[:2000]
        return f"{super().__str__()}\nstderr: {stderr}\nstdout: {stdout}"


@dataclass
class LocalControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler on 127.0.0.1.

    Use as a context manager, or call `start()` and `stop()`. `kubeconfig` is a file naming only
    this server, so nothing run against it can reach another cluster.
    """

    state_dir: Path
    bin_dir: Path = field(default_factory=resolve_bin_dir)
    ready_timeout: float = 120.0
    # The HPA controller's sync period (--horizontal-pod-autoscaler-sync-period); None keeps its
    # default (15 s). Its downscale stabilization default (5 min) is left alone: an HPA's
    # `behavior.scaleDown.stabilizationWindowSeconds` overrides it.
    hpa_sync_seconds: float | None = None
    # Set for a real node (`localnode`): the host address that its kubelet and pods reach the API
    # server at. The API server then listens on every address, advertises this one (the `kubernetes`
    # Service's endpoint, through kube-proxy), serves a certificate for it, 127.0.0.1 and the
    # Service's names, and the node controllers (lifecycle: taints; TTL) run. None: 127.0.0.1 only.
    node_ip: str | None = None
    server: str = ""
    _procs: list[Component] = field(default_factory=list, repr=False)

    # ---- paths ------------------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "admin.kubeconfig"

    @property
    def ca_file(self) -> Path:
        return self.state_dir / "certs" / "apiserver.crt"

    @property
    def sa_key(self) -> Path:
        return self.state_dir / "sa.key"

    @property
    def front_proxy_dir(self) -> Path:
        """The front-proxy CA (`ca.crt`) and the API server's client cert/key toward extension API servers."""
        return self.state_dir / "front-proxy"

    def binary(self, name: str) -> str:
        return str(self.bin_dir / name)

    # ---- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> LocalControlPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        """The keys and certificates, then etcd, the API server, the controller manager and the scheduler,
        each waited for before what needs it starts."""
        d = self.state_dir
        self._run(["openssl", "genrsa", "-out", str(self.sa_key), "2048"])
        self._run(["openssl", "rsa", "-in", str(self.sa_key), "-pubout", "-out", str(d / "sa.pub")])
        (d / "tokens.csv").write_text(f"{ADMIN_TOKEN},admin,admin,system:masters\n")
        self._make_front_proxy_certs()
        etcd_url = self._start_etcd()
        self._start_apiserver(etcd_url)
        self._start_controllers()
        logger.info("control plane ready at %s (state %s)", self.server, d)

    def _start_etcd(self) -> str:
        """etcd on a free port, healthy; returns its client URL."""
        d = self.state_dir
        etcd_url = f"http://127.0.0.1:{free_port()}"
        peer_url = f"http://127.0.0.1:{free_port()}"
        etcd = self._spawn(
            "etcd",
            "--name=cp",
            f"--data-dir={d / 'etcd'}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=cp={peer_url}",
            "--unsafe-no-fsync",  # test data only; keeps the 2-core machine's disk out of the way
        )
        self._wait(etcd, lambda: _etcd_healthy(etcd_url), "etcd /health")
        return etcd_url

    def _start_apiserver(self, etcd_url: str) -> None:
        """kube-apiserver on a free port (`server`), ready, and the admin kubeconfig for it."""
        d = self.state_dir
        port = free_port()
        self.server = f"https://127.0.0.1:{port}"
        if self.node_ip:
            self._make_serving_cert(self.node_ip)
            serving = ["--bind-address=0.0.0.0", f"--advertise-address={self.node_ip}",
                       "--kubelet-preferred-address-types=InternalIP",  # node names do not resolve here
                       f"--tls-cert-file={self.ca_file}", f"--tls-private-key-file={d / 'certs' / 'apiserver.key'}"]
        else:
            # The kubernetes Service gets no endpoint: EndpointSlices refuse loopback addresses.
            serving = ["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none"]
        api = self._spawn(
            "kube-apiserver",
            f"--etcd-servers={etcd_url}",
            *serving,
            f"--secure-port={port}",
            f"--cert-dir={d / 'certs'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={d / 'sa.pub'}",
            f"--service-account-signing-key-file={self.sa_key}",
            f"--token-auth-file={d / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            "--profiling=false",
            *self._aggregation_flags(),
        )
        self._wait(api, lambda: self.request("GET", "/readyz", raw=True) == b"ok", "kube-apiserver /readyz")
        self._write_kubeconfig(self.kubeconfig, ADMIN_TOKEN, "admin")

    def _start_controllers(self) -> None:
        """kube-controller-manager and kube-scheduler, both working."""
        kcm = self._spawn(
            "kube-controller-manager",
            f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
            "--leader-elect=false",
            f"--service-account-private-key-file={self.sa_key}",
            f"--root-ca-file={self.ca_file}",
            "--use-service-account-credentials=false",
            "--controllers=*," + ",".join(f"-{c}" for c in DISABLED_CONTROLLERS
                                          if not (self.node_ip and c in NODE_CONTROLLERS)),
            *([f"--horizontal-pod-autoscaler-sync-period={self.hpa_sync_seconds:g}s"]
              if self.hpa_sync_seconds is not None else []),
        )
        sched = self._spawn(
            "kube-scheduler",
            f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
            "--leader-elect=false",
        )
        # The default service account exists once the serviceaccount controller runs: proof that
        # the controller manager is working, and pods can be created from here on.
        self._wait(kcm, lambda: self.exists("/api/v1/namespaces/default/serviceaccounts/default"),
                   "kube-controller-manager (default service account)")
        self._wait(sched, sched.check_alive, "kube-scheduler")

    def stop(self) -> None:
        """Stop every component by PID, in reverse order, each with a timeout and then a kill."""
        while self._procs:
            self._procs.pop().stop()

    @property
    def pids(self) -> dict[str, int]:
        return {p.name: p.pid for p in self._procs}

    def _make_front_proxy_certs(self) -> None:
        """A front-proxy CA and its `front-proxy-client` cert (P-256 keys: ms to make, unlike RSA)."""
        fp = self.front_proxy_dir
        fp.mkdir(parents=True, exist_ok=True)
        new_key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "3650"]
        self._run(["openssl", "req", "-x509", *new_key, "-keyout", str(fp / "ca.key"), "-out", str(fp / "ca.crt"),
                   "-subj", "/CN=corefleet-front-proxy-ca",
                   "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign"])
        self._run(["openssl", "req", "-x509", *new_key, "-keyout", str(fp / "client.key"),
                   "-out", str(fp / "client.crt"), "-subj", f"/CN={FRONT_PROXY_CLIENT}",
                   "-CA", str(fp / "ca.crt"), "-CAkey", str(fp / "ca.key"),
                   "-addext", "basicConstraints=critical,CA:FALSE", "-addext", "extendedKeyUsage=clientAuth"])

    def _make_serving_cert(self, node_ip: str) -> None:
        """A self-signed serving certificate (its own CA, `ca_file`) for every name the server is reached by."""
        certs = self.state_dir / "certs"
        certs.mkdir(parents=True, exist_ok=True)
        names = ["kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local",
                 "localhost"]
        san = ",".join([f"IP:{ip}" for ip in ("127.0.0.1", node_ip, KUBERNETES_SERVICE_IP)]
                       + [f"DNS:{n}" for n in names])
        self._run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                   "-days", "3650", "-keyout", str(certs / "apiserver.key"), "-out", str(self.ca_file),
                   "-subj", "/CN=kube-apiserver", "-addext", f"subjectAltName={san}",
                   "-addext", "basicConstraints=critical,CA:TRUE",
                   "-addext", "keyUsage=critical,digitalSignature,keyCertSign",
                   "-addext", "extendedKeyUsage=serverAuth"])

    def _aggregation_flags(self) -> list[str]:
        fp = self.front_proxy_dir
        return [
            f"--requestheader-client-ca-file={fp / 'ca.crt'}",
            f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-username-headers=X-Remote-User",
            f"--proxy-client-cert-file={fp / 'client.crt'}",
            f"--proxy-client-key-file={fp / 'client.key'}",
        ]

    # ---- helpers for processes --------------------------------------------------------------
    def _run(self, argv: list[str]) -> None:
        r = subprocess.run(argv, capture_output=True, text=True, check=False)
        if r.returncode:
            raise ControlPlaneError(f"`{shlex.join(argv)}` failed ({r.returncode}): {r.stderr[-2000:]}")

    def _spawn(self, name: str, *args: str) -> Component:
        proc = Component(name, [self.binary(name), *args], self.state_dir / f"{name}.log", error=ControlPlaneError)
        self._procs.append(proc)
        return proc

    def _wait(self, p: Component, check: Callable[[], bool], what: str) -> None:
        p.wait_ready(check, self.ready_timeout, what)

    # ---- API access -------------------------------------------------------------------------
    def _ssl(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def request(self, method: str, path: str, body: Any = None, *, token: str = ADMIN_TOKEN,
                content_type: str = "application/json", raw: bool = False) -> Any:
        """One REST call to the API server; JSON in and out. Raises urllib.error.HTTPError."""
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        req = urllib.request.Request(self.server + path, data=data, method=method,
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": content_type})
        with urllib.request.urlopen(req, context=self._ssl(), timeout=30) as r:
            out = r.read()
        return out if raw else json.loads(out)

    def exists(self, path: str) -> bool:
        """GET `path`: False on 404, other errors raised."""
        try:
            self.request("GET", path)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return False
            raise
        return True

    def _write_kubeconfig(self, path: Path, token: str, user: str) -> None:
        path.write_text(json.dumps({  # JSON is valid YAML
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "corefleet-local",
            "clusters": [{"name": "corefleet-local",
                          "cluster": {"server": self.server, "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "corefleet-local", "context": {"cluster": "corefleet-local", "user": user}}],
        }, indent=1))

    def kubeconfig_for_token(self, token: str, name: str) -> Path:
        """A kubeconfig that authenticates with `token` (e.g. a service account's), for RBAC checks."""
        path = self.state_dir / f"{name}.kubeconfig"
        self._write_kubeconfig(path, token, name)
        return path

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                kubeconfig: Path | None = None) -> subprocess.CompletedProcess[str]:
        """Run the project's kubectl against this server only."""
        argv = [self.binary("kubectl"), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args]
        r = subprocess.run(argv, input=input, capture_output=True, text=True, check=False, timeout=120)
        if check and r.returncode:
            raise KubectlError(r.returncode, argv, r.stdout, r.stderr)
        return r

    def wait_established(self, crd: str, timeout: float = 60.0) -> None:
        """Wait until the CustomResourceDefinition `crd` is Established. (`kubectl wait --for=condition=Established`
        fails at once, "accessor error: <nil>", where it reads the CRD before the API server gave it any condition,
        as a busy machine's just applied one can be read.)"""
        def established() -> bool:
            r = self.kubectl("get", f"crd/{crd}", "-o",
                             'jsonpath={.status.conditions[?(@.type=="Established")].status}', check=False)
            return r.returncode == 0 and r.stdout.strip() == "True"

        wait_until(established, timeout, f"CRD {crd} Established", interval=0.2)

    def env(self) -> dict[str, str]:
        """Environment for child processes: this cluster's kubeconfig and the binaries on PATH."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig),
                "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


def _etcd_healthy(url: str) -> bool:
    """etcd's /health says so (its JSON has `"health":"true"`); raises OSError while nothing answers."""
    status, body = http_get(f"{url}/health", 2)
    return status == 200 and b"true" in body


# ---- fake nodes and the kubelet stand-in ----------------------------------------------------
def gpu_node(name: str, gpus: int = 8, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A Node object with `gpus` of `nvidia.com/gpu` and room for plenty of pods."""
    res = {"cpu": "64", "memory": "512Gi", "pods": "250", GPU_RESOURCE: str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
        "spec": {},
        "status": {"capacity": res, "allocatable": res,
                   "conditions": [{"type": "Ready", "status": "True", "reason": "FakeNode",
                                   "message": "registered by corefleet's test harness (no kubelet)"}]},
    }


def add_gpu_node(cp: LocalControlPlane, name: str, gpus: int = 8,
                 labels: Mapping[str, str] | None = None) -> None:
    node = gpu_node(name, gpus, labels)
    created = cp.request("POST", "/api/v1/nodes", node)
    # The API server ignores status on create; set it through the status subresource.
    cp.request("PATCH", f"/api/v1/nodes/{name}/status", {"status": node["status"]},
               content_type="application/merge-patch+json")
    # Admission taints new nodes not-ready; the (disabled) node lifecycle controller would lift it.
    taints = [t for t in created.get("spec", {}).get("taints", []) or []
              if t.get("key") != "node.kubernetes.io/not-ready"]
    cp.request("PATCH", f"/api/v1/nodes/{name}", {"spec": {"taints": taints or None}},
               content_type="application/merge-patch+json")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def running_status(pod: Mapping[str, Any], ip: str, ready: bool = True) -> dict[str, Any]:
    """The status a kubelet would report for `pod` once its containers run."""
    now = _now()
    cond = "True" if ready else "False"
    return {
        "phase": "Running",
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "hostIP": "127.0.0.1",
        "startTime": now,
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
            {"type": "Initialized", "status": "True", "lastTransitionTime": now},
            {"type": "ContainersReady", "status": cond, "lastTransitionTime": now},
            {"type": "Ready", "status": cond, "lastTransitionTime": now},
        ],
        "containerStatuses": [
            {"name": c["name"], "image": c["image"], "imageID": "", "ready": ready, "started": True,
             "restartCount": 0, "state": {"running": {"startedAt": now}}}
            for c in pod["spec"]["containers"]
        ],
    }


def fake_pod_ip(uid: str) -> str:
    h = int(uid.replace("-", ""), 16)
    return f"10.244.{(h >> 8) % 256}.{h % 254 + 1}"


def _list_pods(cp: LocalControlPlane, namespace: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cp.request("GET", f"/api/v1/namespaces/{namespace}/pods")["items"]
    return items


def mark_bound_pods_running(cp: LocalControlPlane, namespace: str, pods: list[dict[str, Any]] | None = None,
                            ip_for: Callable[[Mapping[str, Any]], str] | None = None) -> list[str]:
    """Kubelet stand-in, one pass: every scheduled Pending pod in `namespace` becomes Running/Ready.

    `pods` is the namespace's pod list if the caller has it already. Returns the names moved.
    """
    moved = []
    for pod in _list_pods(cp, namespace) if pods is None else pods:
        if not pod["spec"].get("nodeName") or pod.get("status", {}).get("phase") != "Pending":
            continue
        if pod["metadata"].get("deletionTimestamp"):
            continue
        ip = ip_for(pod) if ip_for else fake_pod_ip(pod["metadata"]["uid"])
        name = pod["metadata"]["name"]
        try:
            cp.request("PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}/status",
                       {"status": running_status(pod, ip)}, content_type="application/merge-patch+json")
        except urllib.error.HTTPError as e:
            if e.code != 404:  # deleted meanwhile
                raise
            continue
        moved.append(name)
    return moved


def finish_pod_deletions(cp: LocalControlPlane, namespace: str,
                         pods: list[dict[str, Any]] | None = None) -> list[str]:
    """Kubelet stand-in: pods being deleted gracefully are removed, as a kubelet does once their
    containers stopped (without it, a pod bound to a node keeps its deletionTimestamp forever)."""
    done = []
    for pod in _list_pods(cp, namespace) if pods is None else pods:
        meta = pod["metadata"]
        if not meta.get("deletionTimestamp"):
            continue
        try:
            cp.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{meta['name']}",
                       {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}})
        except urllib.error.HTTPError as e:
            if e.code not in (404, 409):
                raise
            continue
        done.append(meta["name"])
    return done


def fail_pod(cp: LocalControlPlane, namespace: str, name: str, exit_code: int = 137,
             reason: str = "OOMKilled") -> None:
    """Make a running pod's containers exit, as a kubelet reports it (restartPolicy Never: Failed)."""
    pod = cp.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
    now = _now()
    status = {
        "phase": "Failed",
        "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now}],
        "containerStatuses": [
            {"name": c["name"], "image": c["image"], "imageID": "", "ready": False, "started": False,
             "restartCount": 0, "state": {"terminated": {"exitCode": exit_code, "reason": reason,
                                                         "startedAt": now, "finishedAt": now}}}
            for c in pod["spec"]["containers"]
        ],
    }
    cp.request("PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}/status", {"status": status},
               content_type="application/merge-patch+json")


class KubeletStandIn:
    """A background thread that plays the kubelet for some namespaces: it starts scheduled pods
    (`mark_bound_pods_running`) and completes graceful deletions (`finish_pod_deletions`)."""

    def __init__(self, cp: LocalControlPlane, namespaces: list[str], interval: float = 0.2) -> None:
        self._cp, self._namespaces, self._interval = cp, namespaces, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kubelet-stand-in", daemon=True)
        self.errors: list[BaseException] = []

    def _loop(self) -> None:
        while not self._stop.is_set():
            for ns in self._namespaces:
                try:
                    pods = _list_pods(self._cp, ns)  # one list per pass serves both steps
                    mark_bound_pods_running(self._cp, ns, pods)
                    finish_pod_deletions(self._cp, ns, pods)
                except Exception as e:  # surfaced by stop(); the loop keeps serving
                    self.errors.append(e)
            self._stop.wait(self._interval)

    def __enter__(self) -> KubeletStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
