# SPDX-License-Identifier: Apache-2.0
"""A real node on a real control plane: the kubelet, containerd and runc, the CNI bridge, kube-proxy
and CoreDNS (`corefleet_harness.localnode`), running pods from images built here (hack/images.sh).

The session's real node (tests/e2e/conftest.py `real_node`: one control plane advertising this host's
address, one node) serves this module and test_node_fleet.py; when the session ends it is stopped with pods
still running, and must leave nothing it made on the host (`nodetest.assert_left_nothing`).
"""

from __future__ import annotations

import ipaddress
import json
import re
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from corefleet_harness.localcluster import LocalControlPlane
from corefleet_harness.localnode import PAUSE_IMAGE, LocalNode, host_ip
from corefleet_harness.support import wait_until
from corefleet_operator.constants import GPU_RESOURCE
from nodetest import RealNode

BASE_IMAGE_PREFIX = "corefleet.local/bookworm-python:"


@pytest.fixture(scope="module")
def cluster(real_node: RealNode) -> tuple[LocalControlPlane, LocalNode]:
    return real_node.cp, real_node.node


@pytest.fixture(scope="module")
def base_image(cluster: tuple[LocalControlPlane, LocalNode]) -> str:
    _, node = cluster
    names = node.ctr("images", "list", "--quiet").stdout.split()
    found = [n for n in names if n.startswith(BASE_IMAGE_PREFIX)]
    assert len(found) == 1, names
    return found[0]


@pytest.fixture
def ns(cluster: tuple[LocalControlPlane, LocalNode]) -> Iterator[str]:
    cp, _ = cluster
    name = f"n-{uuid.uuid4().hex[:8]}"
    cp.kubectl("create", "namespace", name)
    yield name
    cp.kubectl("delete", "namespace", name, "--wait=false", check=False)


def apply(cp: LocalControlPlane, ns: str, *objs: dict[str, Any]) -> None:
    items = {"apiVersion": "v1", "kind": "List", "items": list(objs)}
    cp.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(items))


def get_pod(cp: LocalControlPlane, ns: str, name: str) -> dict[str, Any]:
    pod: dict[str, Any] = cp.request("GET", f"/api/v1/namespaces/{ns}/pods/{name}")
    return pod


def wait_ready(cp: LocalControlPlane, ns: str, name: str, timeout: float = 120) -> dict[str, Any]:
    def ready() -> bool:
        conds = {c["type"]: c["status"] for c in get_pod(cp, ns, name).get("status", {}).get("conditions", [])}
        return conds.get("Ready") == "True"

    wait_until(ready, timeout, f"pod {ns}/{name} Ready", interval=0.5, retry_on=(Exception,))
    return get_pod(cp, ns, name)


def wait_succeeded(cp: LocalControlPlane, ns: str, name: str, timeout: float = 120) -> str:
    """Wait until the pod's phase is Succeeded; returns its log (fails with the log if it failed)."""
    def done() -> bool:
        phase = get_pod(cp, ns, name).get("status", {}).get("phase")
        if phase == "Failed":
            log = cp.kubectl("logs", "-n", ns, name, check=False)
            raise AssertionError(f"pod {ns}/{name} failed:\n{log.stdout}{log.stderr}")
        return bool(phase == "Succeeded")

    wait_until(done, timeout, f"pod {ns}/{name} Succeeded", interval=0.5, retry_on=(Exception,),
               fatal=(AssertionError,))
    return cp.kubectl("logs", "-n", ns, name).stdout


def pod(name: str, image: str, command: list[str], **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": image, "imagePullPolicy": "Never", "command": command,
                 **spec.pop("container", {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": spec.pop("labels", {})},
            "spec": {"containers": [container], "terminationGracePeriodSeconds": 2, **spec}}


WEB = ["python3", "-c", "import http.server, os\n"
       "class H(http.server.BaseHTTPRequestHandler):\n"
       "    def do_GET(self):\n"
       "        body = ('hello from ' + os.environ['HOSTNAME']).encode()\n"
       "        self.send_response(200); self.end_headers(); self.wfile.write(body)\n"
       "http.server.ThreadingHTTPServer(('0.0.0.0', 8080), H).serve_forever()\n"]


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return str(r.read().decode())


def client_pod(name: str, image: str, script: str) -> dict[str, Any]:
    return pod(name, image, ["python3", "-c", script], restartPolicy="Never")


# ---- the node ---------------------------------------------------------------------------------------
def test_node_registers_ready_with_its_address_and_gpus(cluster: tuple[LocalControlPlane, LocalNode]) -> None:
    cp, node = cluster
    out = cp.kubectl("get", "nodes", "-o", "wide").stdout
    assert re.search(rf"^{node.name}\s+Ready\s", out, re.M), out
    n = cp.request("GET", f"/api/v1/nodes/{node.name}")
    assert {"type": "InternalIP", "address": host_ip()} in n["status"]["addresses"]
    assert n["status"]["nodeInfo"]["kubeletVersion"] == "v1.37.2"
    assert n["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://1.6")
    assert n["status"]["allocatable"][GPU_RESOURCE] == str(node.gpus)
    assert not [t for t in n["spec"].get("taints") or [] if t["effect"] in ("NoSchedule", "NoExecute")]
    # The images the node runs were imported, never pulled.
    names = node.ctr("images", "list", "--quiet").stdout.split()
    assert PAUSE_IMAGE in names


def test_pod_runs_as_a_container_probed_by_the_kubelet(cluster: tuple[LocalControlPlane, LocalNode],
                                                        base_image: str, ns: str) -> None:
    cp, node = cluster
    apply(cp, ns, pod("web", base_image, WEB, labels={"app": "web"}, container={
        "ports": [{"containerPort": 8080}],
        "readinessProbe": {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1},
        "resources": {"limits": {GPU_RESOURCE: "1"}},
    }))
    p = wait_ready(cp, ns, "web")
    status = p["status"]["containerStatuses"][0]
    assert status["containerID"].startswith("containerd://")
    assert status["containerID"].removeprefix("containerd://") in node.container_ids()
    assert ipaddress.ip_address(p["status"]["podIP"]) in ipaddress.ip_network(node.pod_cidr)
    assert p["spec"]["nodeName"] == node.name
    # The pod's own address is reachable from the host (the bridge), and kubectl logs go through the kubelet.
    assert fetch(f"http://{p['status']['podIP']}:8080/") == "hello from web"
    logs = cp.kubectl("logs", "-n", ns, "web", check=False)
    assert logs.returncode == 0, logs.stderr


def test_service_cluster_ip_and_dns_route_to_the_pod(cluster: tuple[LocalControlPlane, LocalNode],
                                                     base_image: str, ns: str) -> None:
    cp, _ = cluster
    apply(cp, ns,
          pod("web", base_image, WEB, labels={"app": "web"}, hostname="web-0", subdomain="webs",
              container={"readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1}}),
          {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
           "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}},
          {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "webs"},
           "spec": {"clusterIP": "None", "selector": {"app": "web"}, "ports": [{"port": 8080}]}})
    pod_ip = wait_ready(cp, ns, "web")["status"]["podIP"]
    cluster_ip = cp.request("GET", f"/api/v1/namespaces/{ns}/services/web")["spec"]["clusterIP"]
    # From the host, through kube-proxy's rules (the test process is a client like any other).
    wait_until(lambda: fetch(f"http://{cluster_ip}/") == "hello from web-0", 30, "ClusterIP from the host",
               interval=0.1, retry_on=(Exception,))
    # From a pod: the Service's DNS name, its ClusterIP, and the pod's own name under the headless Service.
    script = ("import socket, urllib.request\n"
              f"print('svc', urllib.request.urlopen('http://web.{ns}.svc.cluster.local/', timeout=5).read().decode())\n"
              f"print('ip', urllib.request.urlopen('http://{cluster_ip}/', timeout=5).read().decode())\n"
              f"print('pod', socket.gethostbyname('web-0.webs.{ns}.svc.cluster.local'))\n"
              "print('short', urllib.request.urlopen('http://web/', timeout=5).read().decode())\n")
    apply(cp, ns, client_pod("client", base_image, script))
    log = wait_succeeded(cp, ns, "client")
    assert log.splitlines() == ["svc hello from web-0", "ip hello from web-0", f"pod {pod_ip}",
                                "short hello from web-0"], log


def test_service_account_reaches_the_api_server(cluster: tuple[LocalControlPlane, LocalNode],
                                                base_image: str, ns: str) -> None:
    """Through the `kubernetes` Service (kube-proxy to the advertised address) with the pod's token and CA."""
    cp, _ = cluster
    script = ("import json, ssl, urllib.request\n"
              "d = '/var/run/secrets/kubernetes.io/serviceaccount'\n"
              "token = open(d + '/token').read()\n"
              "ctx = ssl.create_default_context(cafile=d + '/ca.crt')\n"
              "req = urllib.request.Request('https://kubernetes.default.svc/version',"
              " headers={'Authorization': 'Bearer ' + token})\n"
              "print(json.load(urllib.request.urlopen(req, context=ctx, timeout=5))['gitVersion'])\n")
    apply(cp, ns, client_pod("sa", base_image, script))
    assert wait_succeeded(cp, ns, "sa").strip() == "v1.37.2"


def test_a_killed_container_is_restarted_by_the_kubelet(cluster: tuple[LocalControlPlane, LocalNode],
                                                        base_image: str, ns: str) -> None:
    cp, node = cluster
    apply(cp, ns, pod("web", base_image, WEB, container={"readinessProbe": {"tcpSocket": {"port": 8080},
                                                                         "periodSeconds": 1}}))
    first = wait_ready(cp, ns, "web")["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://")
    node.ctr("tasks", "kill", "--signal", "SIGKILL", first)

    def restarted() -> bool:
        s = get_pod(cp, ns, "web")["status"]["containerStatuses"][0]
        return bool(s["restartCount"] == 1 and s["ready"])

    wait_until(restarted, 60, "the container restarted and ready again", interval=0.5, retry_on=(Exception,))
    s = get_pod(cp, ns, "web")["status"]["containerStatuses"][0]
    assert s["lastState"]["terminated"]["exitCode"] == 137
    assert s["containerID"].removeprefix("containerd://") != first
