# SPDX-License-Identifier: Apache-2.0
"""Proof tests of the harness against the real control plane (regression tests of the harness).

Each asserts something only a real API server, controller manager or scheduler does: a mock would
accept the invalid pod, never schedule, and never collect garbage.
"""

from __future__ import annotations

import json
import urllib.error
from typing import Any

import pytest

from corefleet_harness.localcluster import KubeletStandIn, LocalControlPlane
from corefleet_harness.support import wait_until

GROUP = "harness.corefleet.io"
WIDGET_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"widgets.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [{
            "name": "v1",
            "served": True,
            "storage": True,
            "schema": {"openAPIV3Schema": {
                "type": "object",
                "properties": {
                    "spec": {"type": "object", "properties": {
                        "replicas": {"type": "integer", "minimum": 0, "maximum": 10}}},
                    "status": {"type": "object", "properties": {
                        "replicas": {"type": "integer"}, "selector": {"type": "string"}}},
                },
            }},
            "subresources": {
                "status": {},
                "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                          "labelSelectorPath": ".status.selector"},
            },
        }],
    },
}


@pytest.fixture(scope="module")
def widget_crd(k8s: LocalControlPlane) -> str:
    k8s.kubectl("apply", "-f", "-", input=json.dumps(WIDGET_CRD))
    k8s.wait_established(f"widgets.{GROUP}")
    return f"widgets.{GROUP}"


def pod(name: str, gpus: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "engine", "image": "vllm/vllm-openai:v0.32.0",
                                 "resources": {"limits": {"nvidia.com/gpu": gpus}}}]},
    }


def test_crd_scale_subresource_works_with_kubectl_scale(k8s: LocalControlPlane, namespace: str,
                                                        widget_crd: str) -> None:
    k8s.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps({
        "apiVersion": f"{GROUP}/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {"replicas": 1}}))

    k8s.kubectl("scale", "-n", namespace, "widget/w", "--replicas=3")

    obj = json.loads(k8s.kubectl("get", "-n", namespace, "widget/w", "-o", "json").stdout)
    assert obj["spec"]["replicas"] == 3
    scale = k8s.request("GET", f"/apis/{GROUP}/v1/namespaces/{namespace}/widgets/w/scale")
    assert scale["kind"] == "Scale"
    assert scale["apiVersion"] == "autoscaling/v1"
    assert scale["spec"]["replicas"] == 3
    # The schema's maximum still holds through /scale.
    r = k8s.kubectl("scale", "-n", namespace, "widget/w", "--replicas=11", check=False)
    assert r.returncode != 0
    assert "less than or equal to 10" in r.stderr


def test_crd_schema_rejects_wrong_types(k8s: LocalControlPlane, namespace: str, widget_crd: str) -> None:
    r = k8s.kubectl("apply", "-n", namespace, "-f", "-", check=False, input=json.dumps({
        "apiVersion": f"{GROUP}/v1", "kind": "Widget", "metadata": {"name": "bad"},
        "spec": {"replicas": "two"}}))
    assert r.returncode != 0
    assert "spec.replicas" in r.stderr
    assert "integer" in r.stderr


def test_pod_with_fractional_gpu_count_is_rejected(k8s: LocalControlPlane, namespace: str) -> None:
    with pytest.raises(urllib.error.HTTPError) as err:
        k8s.request("POST", f"/api/v1/namespaces/{namespace}/pods", pod("fractional", "1.5"))
    assert err.value.code == 422
    body = json.loads(err.value.read())
    assert body["reason"] == "Invalid"
    assert "must be an integer" in body["message"]


def test_scheduler_binds_what_fits_and_leaves_too_large_gpu_pod_pending(
        k8s: LocalControlPlane, namespace: str, kubelet: KubeletStandIn) -> None:
    k8s.request("POST", f"/api/v1/namespaces/{namespace}/pods", pod("fits", "4"))
    k8s.request("POST", f"/api/v1/namespaces/{namespace}/pods", pod("too-big", "16"))

    def get(name: str) -> dict[str, Any]:
        obj: dict[str, Any] = k8s.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
        return obj

    # The scheduler binds the 4-GPU pod to a fake node; the kubelet stand-in makes it Running/Ready.
    wait_until(lambda: get("fits")["status"].get("phase") == "Running", 60, "4-GPU pod Running",
               interval=0.1, retry_on=(Exception,))
    fits = get("fits")
    assert fits["spec"]["nodeName"].startswith("gpu-node-")
    assert fits["status"]["podIP"]
    assert {c["type"]: c["status"] for c in fits["status"]["conditions"]}["Ready"] == "True"

    def unschedulable_reported() -> bool:
        events = k8s.request("GET", f"/api/v1/namespaces/{namespace}/events")["items"]
        return any(e["involvedObject"]["name"] == "too-big" and e["reason"] == "FailedScheduling"
                   and "Insufficient nvidia.com/gpu" in e["message"] for e in events)

    wait_until(unschedulable_reported, 60, "FailedScheduling event for the 16-GPU pod",
               interval=0.1, retry_on=(Exception,))
    too_big = get("too-big")
    assert too_big["status"]["phase"] == "Pending"
    assert not too_big["spec"].get("nodeName")
    scheduled = {c["type"]: c for c in too_big["status"]["conditions"]}["PodScheduled"]
    assert scheduled["status"] == "False"
    assert scheduled["reason"] == "Unschedulable"


def test_deleting_owner_garbage_collects_owned_object(k8s: LocalControlPlane, namespace: str) -> None:
    base = f"/api/v1/namespaces/{namespace}/configmaps"
    owner = k8s.request("POST", base, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}})
    k8s.request("POST", base, {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "owned", "ownerReferences": [{
            "apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}]}})

    k8s.kubectl("delete", "-n", namespace, "configmap/owner")

    def owned_gone() -> bool:
        try:
            k8s.request("GET", f"{base}/owned")
        except urllib.error.HTTPError as e:
            return e.code == 404
        return False

    wait_until(owned_gone, 60, "garbage collection of the owned ConfigMap", interval=0.1, retry_on=(Exception,))


def test_rbac_is_enforced_for_service_accounts(k8s: LocalControlPlane, namespace: str) -> None:
    k8s.kubectl("create", "serviceaccount", "nobody", "-n", namespace)
    token = k8s.kubectl("create", "token", "nobody", "-n", namespace).stdout.strip()
    kubeconfig = k8s.kubeconfig_for_token(token, f"nobody-{namespace}")

    r = k8s.kubectl("get", "pods", "-n", namespace, kubeconfig=kubeconfig, check=False)
    assert r.returncode != 0
    assert "Forbidden" in r.stderr
    assert f"system:serviceaccount:{namespace}:nobody" in r.stderr

    k8s.kubectl("create", "role", "pod-reader", "--verb=get,list", "--resource=pods", "-n", namespace)
    k8s.kubectl("create", "rolebinding", "nobody-reads", "--role=pod-reader",
                f"--serviceaccount={namespace}:nobody", "-n", namespace)
    wait_until(lambda: k8s.kubectl("get", "pods", "-n", namespace, kubeconfig=kubeconfig,
                                   check=False).returncode == 0, 30, "role binding takes effect",
               interval=0.1, retry_on=(Exception,))
