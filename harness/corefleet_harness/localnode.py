# SPDX-License-Identifier: Apache-2.0
"""A real node for a `LocalControlPlane`: containerd, the kubelet, kube-proxy and cluster DNS.

Pods bound to it run as containers (runc, from images imported into its containerd), get addresses
from a CNI bridge, reach Services through kube-proxy's iptables rules, and resolve Service and pod
names through CoreDNS, whose `kubernetes` plugin reads the same API server. Needs root (network
namespaces, iptables, mounts), and the binaries that `hack/control-plane.sh` (kubelet, kube-proxy)
and `hack/node.sh` (containerd and runc from Debian; CNI plugins and CoreDNS built from their Go
modules) install.

The control plane must be started with `node_ip` set (the address pods and the kubelet reach it
at: this host's, `host_ip()`), so the `kubernetes` Service has an endpoint and pods' service
accounts work.

Layout, all private to this node (never the system's containerd, CNI configuration or sockets):
`state_dir` holds logs, configs, containerd's root, the kubelet's root and the CNI IPAM state;
`run_dir` (a short path under /run, as unix socket paths are limited to 108 bytes) holds containerd's
socket and state. The bridge is named `bridge` (default `cf0`), the CNI network `corefleet-<bridge>`.

The node advertises `gpus` of `nvidia.com/gpu` (patched into its status, as "advertising extended
resources" does; no device plugin), so the operator's GPU pods schedule on it; containers get no
GPU, which the emulator and vLLM on CPU do not need.

CoreDNS runs as a process on this host (not a pod), listening on `node_ip`; the `kube-system/kube-dns`
Service (ClusterIP `dns_ip`, the kubelet's clusterDNS) has an EndpointSlice naming it, so queries
from pods go through kube-proxy like on a real cluster.

`stop()` (and a failed `start()`) undoes everything: the pods on the node are deleted and the kubelet
tears their sandboxes down (CNI DEL), then kube-proxy, CoreDNS, the kubelet and containerd stop by
PID; what remains (containers, shims, mounts, network namespaces, the bridge, CNI and kube-proxy
iptables chains) is removed and reported in `leftovers`. Sysctls it changed are restored, and
containerd's root (images and container file systems) is deleted; the logs stay. A component that
fails raises `NodeError` with its command line and log tail.

A node killed before its `stop()` (its test run was) leaves the same things behind. The next node
to start sweeps what no live node owns (`sweep_dead_nodes`): run directories whose containerd no
longer answers, with their mounts and shims, and, when no node lives, the CNI network's NAT chains
and the empty network namespaces of its pods; it logs what it removed. Only what this node made is
reported in its `leftovers`: chains a live node already had when it started are not this node's.

`image_store`: a directory that outlives the node, for containerd's root (its content store and
snapshots): an image archive imported once (archives are named by their content hash) is not imported
again by the next node that uses the store, a new build of an image shares the unchanged layers with
the old one (only the new ones are written), images of archives no longer asked for are removed (their
layers go with containerd's garbage collection), and the store holds no container after `stop()`. A
vLLM image is 6.7 GB: importing it and deleting its root again cost minutes of every test run. One node
at a time holds the store (a lock file); a node that finds it taken uses a root of its own in
`state_dir`, as without a store. `preload_images` (`python -m corefleet_harness.localnode preload`, which
hack/test.sh runs beside the integration tier) imports into the store without a node, so that the import
of a rebuilt image runs beside other work rather than in the first e2e test that starts a node.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
import urllib.error
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corefleet_harness.localcluster import Component, LocalControlPlane
from corefleet_harness.support import free_port, http_get, wait_until
from corefleet_operator.constants import GPU_RESOURCE

logger = logging.getLogger(__name__)

CNI_BIN_ENV = "COREFLEET_CNI_BIN"
COREDNS_BIN_ENV = "COREFLEET_COREDNS_BIN"
CNI_PLUGINS = ("bridge", "host-local", "loopback", "portmap")
NODE_COMPONENTS = ("kubelet", "kube-proxy")  # in the control plane's bin dir
HOST_TOOLS = ("containerd", "containerd-shim-runc-v2", "ctr", "runc", "iptables-save", "iptables-restore",
              "ip", "conntrack")
RUN_ROOT = "/run"  # run directories (containerd's socket and state): short paths, as unix socket paths are limited
PAUSE_IMAGE = "corefleet.local/pause:1"  # built by hack/images.sh (images/pause)
CLUSTER_DOMAIN = "cluster.local"
# The sysctls a node needs: forwarding between the bridge and the host, and bridged traffic through
# iptables (kube-proxy's rules for pod-to-Service traffic on the same bridge).
SYSCTLS = {"net/ipv4/ip_forward": "1", "net/bridge/bridge-nf-call-iptables": "1"}
# Kernel tunables the kubelet sets at start (vm.overcommit_memory=1, kernel.panic=10, ...): saved
# before and restored after, so a test node leaves the host's kernel settings as it found them.
KUBELET_SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                   "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")


class NodeError(RuntimeError):
    """A node component is missing, exited, did not become ready, or could not be cleaned up."""


def host_ip() -> str:
    """This host's primary IPv4 address (the source address of its default route)."""
    r = subprocess.run(["ip", "-4", "-o", "route", "get", "1.1.1.1"], capture_output=True, text=True, check=False)
    m = re.search(r"\bsrc (\d+\.\d+\.\d+\.\d+)", r.stdout)
    if not m:
        raise NodeError(f"no IPv4 default route to take this host's address from: {r.stdout or r.stderr}")
    return m.group(1)


def _bin_dir(env: str, names: Sequence[str], script: str) -> Path:
    raw = os.environ.get(env)
    if not raw:
        raise NodeError(f"{env} is not set: run `bash {script}` (or `make setup`) and source .corefleet.env")
    path = Path(raw)
    missing = [n for n in names if not os.access(path / n, os.X_OK)]
    if missing:
        raise NodeError(f"missing in {path}: {', '.join(missing)} (run `bash {script}`)")
    return path


def _run(argv: Sequence[str], *, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(argv), capture_output=True, text=True, check=False, timeout=timeout)
    if check and r.returncode:
        raise NodeError(f"`{' '.join(argv)}` failed ({r.returncode}): {(r.stderr or r.stdout)[-2000:]}")
    return r


@dataclass
class LocalNode:
    """One real node registered with `cp`; use as a context manager, or `start()` and `stop()`."""

    cp: LocalControlPlane
    state_dir: Path
    name: str = "node-0"
    images: Sequence[Path] = ()  # image archives (docker-archive or OCI) to import into containerd
    image_store: Path | None = None  # containerd's root, kept between nodes (see the module docstring)
    gpus: int = 8
    pod_cidr: str = "10.244.0.0/24"
    dns_ip: str = "10.96.0.10"
    bridge: str = "cf0"
    ready_timeout: float = 180.0
    leftovers: list[str] = field(default_factory=list)
    run_dir: Path = field(init=False)
    _procs: list[Component] = field(default_factory=list, repr=False)
    _sysctls: dict[str, str] = field(default_factory=dict, repr=False)
    _netns_before: set[str] = field(default_factory=set, repr=False)
    _chains_before: set[str] = field(default_factory=set, repr=False)  # another live node's, on this network
    _store_lock: int | None = field(default=None, repr=False)  # the image store's lock file, while held
    kubelet_port: int = 0
    dns_port: int = 0

    # ---- paths and tools -------------------------------------------------------------------
    @property
    def socket(self) -> Path:
        return self.run_dir / "containerd.sock"

    @property
    def network(self) -> str:
        return f"corefleet-{self.bridge}"

    @property
    def node_ip(self) -> str:
        if not self.cp.node_ip:
            raise NodeError("the control plane was started without node_ip: pods could not reach it")
        return self.cp.node_ip

    def ctr(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """`ctr` against this node's containerd, in the kubelet's namespace (k8s.io)."""
        return _run(["ctr", "--address", str(self.socket), "--namespace", "k8s.io", *args], check=check,
                    timeout=timeout)

    def container_ids(self) -> list[str]:
        """The IDs of the containers (pod sandboxes included) containerd holds for the kubelet."""
        return self.ctr("containers", "list", "--quiet").stdout.split()

    def running_tasks(self) -> list[str]:
        out = self.ctr("tasks", "list").stdout.splitlines()[1:]
        return [line.split()[0] for line in out if line.split() and line.split()[-1] == "RUNNING"]

    # ---- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> LocalNode:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._preflight()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        swept = sweep_dead_nodes(self.network)
        if swept:
            logger.warning("node %s: removed what nodes killed before their stop left: %s", self.name,
                           "; ".join(swept))
        self.run_dir = Path(tempfile.mkdtemp(prefix="cf-node-", dir=RUN_ROOT))
        self._netns_before = self._netns()
        self._chains_before = _cni_chains(self.network)
        try:
            self._set_sysctls()
            self._start_containerd()
            self._import_images()
            self._start_kubelet()
            self._start_kube_proxy()
            self._start_dns()
        except BaseException:
            self.stop()
            raise
        logger.info("node %s ready (%s, state %s)", self.name, self.node_ip, self.state_dir)

    def _preflight(self) -> None:
        if os.geteuid() != 0:
            raise NodeError("a real node needs root (network namespaces, iptables, mounts)")
        missing = [t for t in HOST_TOOLS if shutil.which(t) is None]
        if missing:
            raise NodeError(f"not on PATH: {', '.join(missing)} (run `bash hack/node.sh`: Debian's containerd, "
                            "runc, iptables, conntrack)")
        missing = [c for c in NODE_COMPONENTS if not os.access(self.cp.bin_dir / c, os.X_OK)]
        if missing:
            raise NodeError(f"missing in {self.cp.bin_dir}: {', '.join(missing)} (run `bash hack/control-plane.sh`)")
        self.cni_bin = _bin_dir(CNI_BIN_ENV, CNI_PLUGINS, "hack/node.sh")
        self.coredns_bin = _bin_dir(COREDNS_BIN_ENV, ("coredns",), "hack/node.sh")

    def _spawn(self, name: str, argv: Sequence[str]) -> Component:
        proc = Component(name, argv, self.state_dir / f"{name}.log", error=NodeError)
        self._procs.append(proc)
        return proc

    def _set_sysctls(self) -> None:
        for key in KUBELET_SYSCTLS:
            path = Path("/proc/sys") / key
            if path.exists():
                self._sysctls[key] = path.read_text().strip()
        for key, want in SYSCTLS.items():
            path = Path("/proc/sys") / key
            old = path.read_text().strip()
            if old != want:
                self._sysctls[key] = old
                path.write_text(want)

    # ---- containerd ----------------------------------------------------------------------------
    @property
    def containerd_root(self) -> Path:
        return self.image_store if self._store_lock is not None and self.image_store else self.state_dir / "containerd"

    def _take_store(self) -> None:
        """Hold the image store for this node, unless another node holds it (then the root is private)."""
        if self.image_store is None:
            return
        fd = lock_store(self.image_store)
        if fd is None:
            logger.warning("node %s: image store %s is in use by another node: a private root in %s",
                           self.name, self.image_store, self.state_dir)
            return
        self._store_lock = fd

    def _release_store(self) -> None:
        if self._store_lock is not None:
            os.close(self._store_lock)  # closing the descriptor drops the lock
            self._store_lock = None

    def _import_images(self) -> None:
        sync_images(self.ctr, self.containerd_root, self.images)

    def _remove_containers(self) -> None:
        """Delete every container the store holds (the kubelet's, already stopped), so none outlives the node."""
        ids = self.ctr("containers", "list", "--quiet", check=False).stdout.split()
        if ids:
            self.ctr("containers", "delete", *ids, check=False)

    def _start_containerd(self) -> None:
        d = self.state_dir
        self._take_store()
        (d / "cni" / "net.d").mkdir(parents=True, exist_ok=True)
        (d / "cni" / "net.d" / "10-corefleet.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0",
            "name": self.network,
            "plugins": [
                {"type": "bridge", "bridge": self.bridge, "isGateway": True, "ipMasq": True, "hairpinMode": True,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": self.pod_cidr}]],
                          "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(d / "cni" / "ipam")}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }, indent=1))
        config = d / "containerd.toml"
        config.write_text(textwrap.dedent(f"""\
            version = 2
            root = "{self.containerd_root}"
            state = "{self.run_dir / 'state'}"
            [grpc]
              address = "{self.socket}"
            [plugins."io.containerd.grpc.v1.cri"]
              sandbox_image = "{PAUSE_IMAGE}"
              enable_selinux = false
              # No container's oom_score_adj below containerd's own: the kubelet asks -998 for
              # sandboxes, and lowering it needs CAP_SYS_RESOURCE, which this machine kind's root lacks.
              restrict_oom_score_adj = true
              [plugins."io.containerd.grpc.v1.cri".cni]
                bin_dir = "{self.cni_bin}"
                conf_dir = "{d / 'cni' / 'net.d'}"
              [plugins."io.containerd.grpc.v1.cri".containerd]
                snapshotter = "overlayfs"
                default_runtime_name = "runc"
                [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
                  runtime_type = "io.containerd.runc.v2"
            """))
        proc = self._spawn("containerd", ["containerd", "--config", str(config)])
        proc.wait_ready(lambda: self.ctr("version", timeout=10).returncode == 0, self.ready_timeout,
                        "containerd answering on its socket")
        self._remove_containers()  # a node that was killed may have left some in the store

    # ---- kubelet -----------------------------------------------------------------------------
    def _start_kubelet(self) -> None:
        d = self.state_dir
        self.kubelet_port = free_port()
        healthz = free_port()
        resolv = d / "resolv.conf"  # the upstream servers CoreDNS and host-network pods use
        shutil.copyfile("/etc/resolv.conf", resolv)
        config = d / "kubelet.yaml"
        config.write_text(json.dumps({
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # The API server reaches the kubelet (logs, exec) without a client certificate: a test node.
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "address": self.node_ip,
            "port": self.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": healthz,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "cgroupDriver": "cgroupfs",
            "failCgroupV1": False,  # this machine kind mounts cgroup v1 (its own init holds the memory controller)
            "failSwapOn": False,
            "clusterDNS": [self.dns_ip],
            "clusterDomain": CLUSTER_DOMAIN,
            "resolvConf": str(resolv),
            "podCIDR": self.pod_cidr,
            "podLogsDir": str(d / "pod-logs"),  # not the host's /var/log/pods
            "registerNode": True,
            "serializeImagePulls": False,
            "imageGCHighThresholdPercent": 100,  # images are imported, never pulled: never collect them
            "imageGCLowThresholdPercent": 99,
            # A shared test machine's disk may be fuller than a node's defaults tolerate.
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                             "nodefs.inodesFree": "1%"},
            "nodeStatusUpdateFrequency": "2s",
            "syncFrequency": "5s",
            "fileCheckFrequency": "5s",
            "shutdownGracePeriod": "0s",
            "oomScoreAdj": 0,  # its own (default -999): root here has no CAP_SYS_RESOURCE to lower it
        }, indent=1))
        proc = self._spawn("kubelet", [
            str(self.cp.bin_dir / "kubelet"),
            f"--config={config}",
            f"--kubeconfig={self.cp.kubeconfig}",
            f"--root-dir={d / 'kubelet'}",
            f"--cert-dir={d / 'kubelet-pki'}",
            f"--hostname-override={self.name}",
            f"--node-ip={self.node_ip}",
            "--v=2",
        ])
        proc.wait_ready(self._node_ready, self.ready_timeout, f"node {self.name} Ready")
        # Advertise the GPUs (an extended resource with no device plugin: the scheduler counts it,
        # the kubelet admits pods against it and allocates nothing).
        self.cp.request("PATCH", f"/api/v1/nodes/{self.name}/status",
                        {"status": {"capacity": {GPU_RESOURCE: str(self.gpus)}}},
                        content_type="application/merge-patch+json")
        proc.wait_ready(lambda: self._allocatable().get(GPU_RESOURCE) == str(self.gpus), self.ready_timeout,
                        f"node {self.name} allocatable {GPU_RESOURCE}")

    def _node(self) -> dict[str, Any]:
        node: dict[str, Any] = self.cp.request("GET", f"/api/v1/nodes/{self.name}")
        return node

    def _allocatable(self) -> dict[str, str]:
        alloc: dict[str, str] = self._node().get("status", {}).get("allocatable", {})
        return alloc

    def _node_ready(self) -> bool:
        try:
            node = self._node()
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return False
            raise
        ready = [c for c in node.get("status", {}).get("conditions", []) if c["type"] == "Ready"]
        taints = [t["key"] for t in node.get("spec", {}).get("taints") or []]
        return bool(ready) and ready[0]["status"] == "True" and "node.kubernetes.io/not-ready" not in taints

    # ---- kube-proxy --------------------------------------------------------------------------
    def _kube_proxy_argv(self, *extra: str) -> list[str]:
        return [str(self.cp.bin_dir / "kube-proxy"), "--proxy-mode=iptables", *extra]

    def _start_kube_proxy(self) -> None:
        healthz = free_port()
        proc = self._spawn("kube-proxy", self._kube_proxy_argv(
            f"--kubeconfig={self.cp.kubeconfig}",
            f"--hostname-override={self.name}",
            f"--cluster-cidr={self.pod_cidr}",
            f"--healthz-bind-address=127.0.0.1:{healthz}",
            f"--metrics-bind-address=127.0.0.1:{free_port()}",
            # Leave the host's conntrack sysctls and route_localnet alone (0: as they are).
            "--conntrack-max-per-core=0",
            "--conntrack-tcp-timeout-established=0",
            "--conntrack-tcp-timeout-close-wait=0",
            "--iptables-localhost-nodeports=false",
            "--iptables-sync-period=2s",
            "--oom-score-adj=0",  # as the kubelet's
            "--v=2",
        ))
        proc.wait_ready(lambda: http_get(f"http://127.0.0.1:{healthz}/healthz", 2)[0] == 200, self.ready_timeout,
                        "kube-proxy /healthz")

    # ---- cluster DNS -------------------------------------------------------------------------
    def _start_dns(self) -> None:
        d = self.state_dir
        self.dns_port = free_port()
        ready = free_port()
        corefile = d / "Corefile"
        corefile.write_text(textwrap.dedent(f"""\
            .:{self.dns_port} {{
                bind {self.node_ip}
                errors
                ready 127.0.0.1:{ready}
                kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
                    kubeconfig {self.cp.kubeconfig} corefleet-local
                    pods insecure
                    fallthrough in-addr.arpa ip6.arpa
                }}
                forward . {d / 'resolv.conf'}
                cache 2
            }}
            """))
        proc = self._spawn("coredns", [str(self.coredns_bin / "coredns"), "-conf", str(corefile)])
        ports = [{"name": "dns", "port": self.dns_port, "protocol": "UDP"},
                 {"name": "dns-tcp", "port": self.dns_port, "protocol": "TCP"}]
        self.cp.request("POST", "/api/v1/namespaces/kube-system/services", {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "kube-dns", "labels": {"k8s-app": "kube-dns"}},
            "spec": {"clusterIP": self.dns_ip, "ports": [
                {"name": "dns", "port": 53, "targetPort": self.dns_port, "protocol": "UDP"},
                {"name": "dns-tcp", "port": 53, "targetPort": self.dns_port, "protocol": "TCP"}]},
        })
        self.cp.request("POST", "/apis/discovery.k8s.io/v1/namespaces/kube-system/endpointslices", {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "kube-dns-host", "labels": {"kubernetes.io/service-name": "kube-dns"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [self.node_ip], "conditions": {"ready": True}}],
            "ports": ports,
        })
        proc.wait_ready(lambda: http_get(f"http://127.0.0.1:{ready}/ready", 2)[0] == 200, self.ready_timeout,
                        "coredns /ready")

    # ---- stopping ----------------------------------------------------------------------------
    def stop(self) -> None:
        """Delete the node's pods (the kubelet tears their sandboxes down), stop every component, sweep."""
        names = [p.name for p in self._procs]
        if "kubelet" in names and "containerd" in names:
            self._drain()
        while self._procs:
            p = self._procs.pop()
            if p.name == "containerd":
                self._remove_containers()  # the kubelet is gone: none of its containers outlives the node
            p.stop(timeout=20)
            if p.name == "kube-proxy":
                # Remove kube-proxy's iptables chains (KUBE-*).
                r = _run(self._kube_proxy_argv("--cleanup"), check=False)
                if r.returncode:
                    self.leftovers.append(f"kube-proxy --cleanup failed: {r.stderr[-500:]}")
        if hasattr(self, "run_dir"):
            self._sweep()
        for key, old in self._sysctls.items():
            path = Path("/proc/sys") / key
            if path.read_text().strip() != old:
                path.write_text(old)
        self._sysctls.clear()
        self._release_store()
        if self.leftovers:
            logger.warning("node %s: cleaned up after the components: %s", self.name, "; ".join(self.leftovers))

    def _drain(self) -> None:
        """Force-delete the pods bound to this node and wait until the kubelet has stopped their containers."""
        try:
            pods = self.cp.request("GET", f"/api/v1/pods?fieldSelector=spec.nodeName={self.name}")["items"]
            for pod in pods:
                meta = pod["metadata"]
                try:
                    self.cp.request("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
                                              "?gracePeriodSeconds=0")
                except urllib.error.HTTPError as e:
                    if e.code != 404:
                        raise
            wait_until(lambda: not self.running_tasks(), 60, "the kubelet stopping the node's containers",
                       interval=0.5, retry_on=(Exception,))
        except Exception as e:  # keep stopping; the sweep below removes what is left
            self.leftovers.append(f"drain: {e}")

    def _sweep(self) -> None:
        # Containers the kubelet left, and their shims: containerd is gone, so kill the shims (each
        # names this node's socket on its command line) and their children.
        self.leftovers += _kill_processes_naming(str(self.socket), str(self.run_dir))
        # Mounts under this node's own directories (sandboxes' shm, volumes' tmpfs the kubelet had no
        # time to unmount), deepest first: expected after a stop, so not reported.
        _unmount_under(str(self.state_dir.resolve()), str(self.run_dir))
        # Network namespaces the CNI set up for pods that were not torn down.
        for ns in sorted(self._netns() - self._netns_before):
            _run(["ip", "netns", "delete", ns], check=False)
            self.leftovers.append(f"netns {ns}")
        if _run(["ip", "link", "show", self.bridge], check=False).returncode == 0:
            _run(["ip", "link", "delete", self.bridge], check=False)
        self._sweep_cni_iptables()
        self._sweep_kube_iptables()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        # A private containerd root: the imported images and the containers' file systems (GBs with a vLLM
        # image, on every run); an image store stays for the next node. The logs stay in state_dir.
        shutil.rmtree(self.state_dir / "containerd", ignore_errors=True)

    def _sweep_cni_iptables(self) -> None:
        """Remove the NAT chains the bridge plugin's ipMasq made for this node's pods (if a DEL never ran)."""
        ours = _cni_chains(self.network) - self._chains_before
        for chain in sorted(_remove_chains("iptables", "nat", ours.__contains__)):
            self.leftovers.append(f"iptables nat chain {chain}")

    @staticmethod
    def _sweep_kube_iptables() -> None:
        """Remove the KUBE-* chains of the kubelet (KUBE-FIREWALL, canaries, hints) that no cleanup removes.

        kube-proxy's own (KUBE-SERVICES, ...) are gone after its --cleanup; these are the kubelet's,
        made at every start, in IPv4 and IPv6. Expected, so not reported.
        """
        for cmd in ("iptables", "ip6tables"):
            for table in ("filter", "nat", "mangle"):
                _remove_chains(cmd, table, lambda c: c.startswith("KUBE-"))

    @staticmethod
    def _netns() -> set[str]:
        try:
            return set(os.listdir("/run/netns"))
        except FileNotFoundError:
            return set()


def default_image_store() -> Path:
    """Where the test nodes keep containerd's root between runs: corefleet's cache (COREFLEET_CACHE, else
    ~/.cache/corefleet, as hack/images.sh's), beside the image archives."""
    cache = os.environ.get("COREFLEET_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") \
        / "corefleet"
    return Path(cache) / "node-containerd"


def lock_store(store: Path) -> int | None:
    """Take the image store's lock (a file beside it): the descriptor that holds it (closing it drops the lock),
    or None if another holder has it."""
    store.mkdir(parents=True, exist_ok=True)
    fd = os.open(store.parent / f".{store.name}.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


IMPORTED_MARKER = "corefleet-imported.json"  # in containerd's root: archive name -> the image names it gave


def sync_images(ctr: Callable[..., subprocess.CompletedProcess[str]], root: Path, images: Sequence[Path]) -> None:
    """Through `ctr` (a containerd on `root`, namespace k8s.io): import the archives not imported into `root`
    yet (by archive name, which carries the content hash), remove the images of archives not asked for."""
    marker = root / IMPORTED_MARKER
    try:
        imported: dict[str, list[str]] = json.loads(marker.read_text())
    except (OSError, ValueError):
        imported = {}
    wanted = {archive.name: archive for archive in images}
    names = set(ctr("images", "list", "--quiet").stdout.split())
    for name, archive in wanted.items():
        if imported.get(name) and set(imported[name]) <= names:
            continue
        started = time.monotonic()
        ctr("images", "import", str(archive), timeout=900)
        logger.info("imported %s in %.0f s", archive.name, time.monotonic() - started)
        imported[name] = archive_image_names(archive)  # a rebuilt image keeps its tag: the tag is the archive's
        names = set(ctr("images", "list", "--quiet").stdout.split())
    keep = {image for name in wanted for image in imported.get(name, [])}
    stale = sorted(names - keep)
    if stale:  # an older build's tags: their layers go with containerd's garbage collection
        ctr("images", "remove", *stale)
    imported = {name: imported[name] for name in wanted if name in imported}
    marker.write_text(json.dumps(imported, indent=1))


def preload_images(store: Path, images: Sequence[Path], timeout: float = 60.0) -> bool:
    """Import `images` into the image store `store` now, with a containerd of its own (no node, no CRI), so that
    the next node that takes the store finds them there (hack/test.sh runs this beside the integration tier: a
    rebuilt vLLM image costs a minute or more to import). False, having done nothing, if a node holds the
    store."""
    fd = lock_store(store)
    if fd is None:
        logger.warning("image store %s is in use by a node: nothing preloaded", store)
        return False
    try:
        with tempfile.TemporaryDirectory(prefix="cf-preload-", dir="/run") as run:
            socket = Path(run) / "containerd.sock"
            config = Path(run) / "containerd.toml"
            config.write_text(textwrap.dedent(f"""\
                version = 2
                root = "{store}"
                state = "{Path(run) / 'state'}"
                disabled_plugins = ["io.containerd.grpc.v1.cri"]
                [grpc]
                  address = "{socket}"
                """))

            def ctr(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
                return _run(["ctr", "--address", str(socket), "--namespace", "k8s.io", *args], check=check,
                            timeout=timeout)

            proc = Component("containerd", ["containerd", "--config", str(config)], Path(run) / "containerd.log",
                             error=NodeError)
            try:
                proc.wait_ready(lambda: ctr("version", timeout=10).returncode == 0, timeout,
                                "containerd answering on its socket")
                sync_images(ctr, store, images)
            finally:
                proc.stop(timeout=30)
        return True
    finally:
        os.close(fd)  # closing the descriptor drops the lock


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m corefleet_harness.localnode preload [--store DIR] ARCHIVE...`: `preload_images` (the store:
    `default_image_store()` unless named)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m corefleet_harness.localnode")
    sub = parser.add_subparsers(dest="command", required=True)
    preload = sub.add_parser("preload", help="import image archives into a test node's image store")
    preload.add_argument("--store", type=Path, default=None)
    preload.add_argument("archives", type=Path, nargs="+")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="preload: %(message)s")
    preload_images(args.store or default_image_store(), args.archives)
    return 0


def archive_image_names(archive: Path) -> list[str]:
    """The image names an archive holds (docker-archive: manifest.json's RepoTags; OCI: index.json's ref names),
    as containerd names them (a name without a registry is Docker Hub's)."""
    names: list[str] = []
    with tarfile.open(archive) as tar:
        for member in tar:
            if member.name.lstrip("./") not in ("manifest.json", "index.json"):
                continue
            f = tar.extractfile(member)
            data = json.load(f) if f is not None else {}
            if member.name.lstrip("./") == "manifest.json":
                names += [tag for image in data for tag in image.get("RepoTags") or []]
            else:
                names += [m.get("annotations", {}).get("io.containerd.image.name")
                          or m.get("annotations", {}).get("org.opencontainers.image.ref.name", "")
                          for m in data.get("manifests", [])]
    return sorted({_containerd_name(n) for n in names if n})


def _containerd_name(name: str) -> str:
    first = name.split("/", 1)[0]
    if "/" in name and ("." in first or ":" in first or first == "localhost"):
        return name
    return f"docker.io/{name}" if "/" in name else f"docker.io/library/{name}"


def _cni_chains(network: str) -> set[str]:
    """The NAT chains the bridge plugin's ipMasq made for pods of `network` (their rules name it)."""
    rules = _run(["iptables-save", "-t", "nat"], check=False).stdout.splitlines()
    marker = f'name: \\"{network}\\"'
    return {m.group(1) for line in rules if marker in line for m in [re.match(r"-A (CNI-\S+) ", line)] if m}


def _answers(sock: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        try:
            s.connect(str(sock))
        except OSError:
            return False
    return True


def sweep_dead_nodes(network: str, run_root: str = RUN_ROOT) -> list[str]:
    """Remove what nodes killed before their `stop()` left on this host, and return what was removed.

    A node's run directory (`<run_root>/cf-node-*`) whose containerd no longer answers is dead: the shims
    naming it are killed, the mounts under it unmounted and it is deleted. When no node lives any more,
    the NAT chains of `network` and the network namespaces of its pods (`cni-*`, with no process left
    in them) can only be dead nodes' too, and go.
    """
    swept: list[str] = []
    live = 0
    for d in sorted(Path(run_root).glob("cf-node-*")):
        if _answers(d / "containerd.sock"):
            live += 1
            continue
        swept += _kill_processes_naming(str(d))
        _unmount_under(str(d))
        shutil.rmtree(d, ignore_errors=True)
        swept.append(f"run dir {d}")
    if live:
        return swept
    chains = _cni_chains(network)
    swept += [f"iptables nat chain {c}" for c in sorted(_remove_chains("iptables", "nat", chains.__contains__))]
    for ns in sorted(LocalNode._netns()):
        if ns.startswith("cni-") and not _run(["ip", "netns", "pids", ns], check=False).stdout.strip():
            _run(["ip", "netns", "delete", ns], check=False)
            swept.append(f"netns {ns}")
    return swept


def _kill_processes_naming(*paths: str) -> list[str]:
    """Kill every process (and its children) whose command line names one of `paths`; what was killed."""
    killed = []
    for pid, cmd in _processes():
        if any(path in cmd for path in paths):
            killed.append(f"process {pid}: {cmd[:120]}")
            _kill_tree(pid)
    return killed


def _unmount_under(*roots: str) -> None:
    """Unmount (lazily) whatever is mounted under `roots`, deepest first."""
    for target in sorted(_mounts(roots), key=len, reverse=True):
        _run(["umount", "-l", target], check=False)


def _processes() -> list[tuple[int, str]]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            out.append((int(entry), cmd))
    return out


def _kill_tree(pid: int) -> None:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        kids = [int(c) for c in children.read_text().split()]
    except OSError:
        kids = []
    for kid in kids:
        _kill_tree(kid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _mounts(roots: Sequence[str]) -> list[str]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        target = line.split()[4].replace("\\040", " ")
        if any(target == r or target.startswith(r + "/") for r in roots):
            out.append(target)
    return out


def _remove_chains(cmd: str, table: str, match: Callable[[str], bool]) -> set[str]:
    """Delete the chains of `table` whose names `match` (and every rule jumping to them); returns their names."""
    saved = _run([f"{cmd}-save", "-t", table], check=False).stdout.splitlines()
    chains = {line[1:].split()[0] for line in saved if line.startswith(":") and match(line[1:].split()[0])}
    for line in saved:  # jumps into them from chains that stay
        m = re.match(r"-A (\S+) (.*)$", line)
        if m and m.group(1) not in chains and any(re.search(rf"-j {re.escape(c)}(\s|$)", m.group(2))
                                                  for c in chains):
            _run([cmd, "-t", table, "-D", m.group(1), *shlex.split(m.group(2))], check=False)
    for chain in chains:
        _run([cmd, "-t", table, "-F", chain], check=False)
    for chain in chains:
        _run([cmd, "-t", table, "-X", chain], check=False)
    return chains


if __name__ == "__main__":
    sys.exit(main())
