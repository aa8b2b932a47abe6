# SPDX-License-Identifier: Apache-2.0
"""The harness's pure parts: fake GPU nodes and the status the kubelet stand-in reports."""

from __future__ import annotations

from corefleet_harness.localcluster import fake_pod_ip, gpu_node, running_status


def test_gpu_node_has_gpu_capacity_and_is_ready() -> None:
    node = gpu_node("n1", gpus=4, labels={"pool": "h200"})

    assert node["metadata"]["labels"] == {"kubernetes.io/hostname": "n1", "pool": "h200"}
    assert node["status"]["capacity"]["nvidia.com/gpu"] == "4"
    assert node["status"]["allocatable"] == node["status"]["capacity"]
    assert [c["type"] for c in node["status"]["conditions"] if c["status"] == "True"] == ["Ready"]


def test_running_status_covers_every_container_and_ip() -> None:
    pod = {"spec": {"containers": [{"name": "engine", "image": "img:1"}, {"name": "sidecar", "image": "img:2"}]}}

    st = running_status(pod, "10.0.0.7")

    assert st["phase"] == "Running"
    assert st["podIP"] == "10.0.0.7"
    assert st["podIPs"] == [{"ip": "10.0.0.7"}]
    assert [c["name"] for c in st["containerStatuses"]] == ["engine", "sidecar"]
    assert all(c["ready"] and "running" in c["state"] for c in st["containerStatuses"])
    assert {c["type"]: c["status"] for c in st["conditions"]}["Ready"] == "True"


def test_running_but_not_ready_status() -> None:
    st = running_status({"spec": {"containers": [{"name": "e", "image": "i"}]}}, "10.0.0.8", ready=False)
    assert {c["type"]: c["status"] for c in st["conditions"]}["Ready"] == "False"
    assert st["containerStatuses"][0]["ready"] is False


def test_fake_pod_ip_is_stable_and_distinct() -> None:
    a = fake_pod_ip("0d5a1e6e-1b7e-4a0e-9d53-6c9d0e1f2a3b")
    b = fake_pod_ip("0d5a1e6e-1b7e-4a0e-9d53-6c9d0e1f2a3c")
    assert a == fake_pod_ip("0d5a1e6e-1b7e-4a0e-9d53-6c9d0e1f2a3b")
    assert a != b
    assert a.startswith("10.244.")
    assert 1 <= int(a.rsplit(".", 1)[1]) <= 254
