# SPDX-License-Identifier: Apache-2.0
"""The generated manifests and the Helm chart against a real API server.

Only a real server checks what these tests assert: the CRD is structural and its CEL rules compile,
defaults and printer columns apply, strict field validation names unknown fields, transition rules
make fields immutable, `kubectl scale` goes through /scale, the chart renders objects the server
accepts, and the ServiceAccount can do exactly what rbac.py lists.
"""

from __future__ import annotations

import copy
import itertools
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from corefleet_harness.localcluster import LocalControlPlane
from corefleet_operator import constants, rbac
from helmrun import Helm, helm_runner

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
CHART = REPO / "charts" / "corefleet"
DENSE = MANIFESTS / "samples" / "enginecoreset.yaml"
MOE = MANIFESTS / "samples" / "enginecoreset-moe.yaml"
OPERATOR_SA = f"system:serviceaccount:{constants.OPERATOR_NAMESPACE}:{constants.OPERATOR_NAME}"


def load(path: Path) -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load(path.read_text())
    return obj


def load_all(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind]
    return doc


def ecs(name: str, **spec: Any) -> dict[str, Any]:
    """The dense sample under another name, with top-level spec fields replaced."""
    obj = copy.deepcopy(load(DENSE))
    obj["metadata"] = {"name": name}
    obj["spec"].update(spec)
    return obj


def apply(k8s: LocalControlPlane, namespace: str, obj: dict[str, Any],
          *extra: str) -> subprocess.CompletedProcess[str]:
    return k8s.kubectl("apply", "-n", namespace, *extra, "-f", "-", input=json.dumps(obj), check=False)


@pytest.fixture(scope="module")
def ecs_crd(k8s: LocalControlPlane) -> str:
    k8s.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(MANIFESTS / "crd.yaml"))
    k8s.wait_established(constants.CRD_NAME)
    return constants.CRD_NAME


@pytest.fixture
def helm(k8s: LocalControlPlane, tmp_path: Path) -> Helm:
    """Run the project's helm with its state under the test's temp dir, never in $HOME."""
    return helm_runner(k8s, tmp_path, timeout=120)


# ---- the CRD and the samples --------------------------------------------------------------------
def test_crd_is_established_with_the_generated_schema(k8s: LocalControlPlane, ecs_crd: str) -> None:
    served = json.loads(k8s.kubectl("get", f"crd/{ecs_crd}", "-o", "json").stdout)
    conditions = {c["type"]: c["status"] for c in served["status"]["conditions"]}
    assert conditions["Established"] == "True"
    assert conditions["NamesAccepted"] == "True"
    assert "NonStructuralSchema" not in conditions
    assert served["status"]["acceptedNames"]["shortNames"] == ["ecs"]


@pytest.mark.parametrize("sample", [DENSE, MOE], ids=lambda p: p.name)
def test_samples_pass_server_side_dry_run(k8s: LocalControlPlane, namespace: str, ecs_crd: str,
                                          sample: Path) -> None:
    r = k8s.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(sample), check=False)
    assert r.returncode == 0, r.stderr
    assert "created (server dry run)" in r.stdout
    assert not r.stderr.strip()  # not even a warning


def test_get_ecs_prints_the_printer_columns_and_defaults_apply(k8s: LocalControlPlane, namespace: str,
                                                               ecs_crd: str) -> None:
    k8s.kubectl("apply", "-n", namespace, "-f", str(DENSE))
    out = k8s.kubectl("get", "ecs", "-n", namespace).stdout.splitlines()
    assert out[0].split() == ["NAME", "REPLICAS", "READY", "PHASE", "MODEL", "AGE"]
    header = out[0]
    starts = [header.index(col) for col in header.split()] + [None]
    row = [out[1][a:b].strip() for a, b in itertools.pairwise(starts)]
    # No status yet: READY and PHASE are blank until the operator writes one.
    assert row[:5] == ["qwen3-dense", "2", "", "", "Qwen/Qwen3-8B"]

    stored = json.loads(k8s.kubectl("get", "ecs/qwen3-dense", "-n", namespace, "-o", "json").stdout)["spec"]
    assert stored["expertParallel"] is False
    assert stored["engine"]["loadFormat"] == "auto"
    assert stored["engine"]["shmSize"] == "16Gi"
    assert stored["coordinator"] == {}
    assert stored["scheduling"] == {}
    assert stored["networkPolicy"] is False


INVALID: dict[str, tuple[dict[str, Any], list[str]]] = {
    "replicas-not-an-integer": ({"replicas": "two"}, ["spec.replicas", "must be of type integer"]),
    "replicas-over-max": ({"replicas": 5, "maxReplicas": 4}, ["replicas must not exceed maxReplicas"]),
    "tensor-parallel-zero": ({"engine": {"tensorParallelSize": 0}},
                             ["spec.engine.tensorParallelSize", "greater than or equal to 1"]),
    "unknown-field": ({"replica": 2}, ['unknown field "spec.replica"']),
    "frontend-port-reserved": ({"frontend": {"port": 29550}},
                               ["frontend.port must not be 8001 or 29550: they carry the fleet's admin"]),
    "moe-two-frontends": ({"expertParallel": True, "frontend": {"replicas": 2}},
                          ["frontend.replicas must be 1 with expertParallel: true: vLLM's elastic EP tells only"]),
    "moe-idle": ({"expertParallel": True, "idle": {}}, ["idle is for dense fleets: an MoE fleet"]),
    "idle-two-frontends": ({"idle": {"afterSeconds": 600}, "frontend": {"replicas": 2}},
                           ["idle needs frontend.replicas 1"]),
    "idle-too-soon": ({"idle": {"afterSeconds": 1}}, ["spec.idle.afterSeconds", "greater than or equal to 10"]),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_enginecoresets_are_rejected_with_a_readable_message(k8s: LocalControlPlane, namespace: str,
                                                                      ecs_crd: str, case: str) -> None:
    change, expected = INVALID[case]
    r = apply(k8s, namespace, ecs(case, **change))
    assert r.returncode != 0
    for text in expected:
        assert text in r.stderr
    assert k8s.kubectl("get", "ecs", case, "-n", namespace, check=False).returncode != 0  # nothing stored


@pytest.mark.parametrize("name", ["9lives", "a" * 49])
def test_fleet_names_that_cannot_name_its_children_are_rejected(k8s: LocalControlPlane, namespace: str,
                                                                 ecs_crd: str, name: str) -> None:
    r = apply(k8s, namespace, ecs(name))
    assert r.returncode != 0
    assert "metadata.name must be a DNS label of at most 48 characters starting with a letter" in r.stderr
    assert apply(k8s, namespace, ecs("a" * 48)).returncode == 0


def test_expert_parallel_is_immutable(k8s: LocalControlPlane, namespace: str, ecs_crd: str) -> None:
    assert apply(k8s, namespace, ecs("fleet")).returncode == 0

    r = apply(k8s, namespace, ecs("fleet", expertParallel=True))

    assert r.returncode != 0
    assert "expertParallel is immutable: create a new EngineCoreSet instead" in r.stderr
    # Other fields still change in place.
    assert apply(k8s, namespace, ecs("fleet", replicas=3)).returncode == 0


def test_kubectl_scale_goes_through_the_scale_subresource(k8s: LocalControlPlane, namespace: str,
                                                          ecs_crd: str) -> None:
    k8s.kubectl("apply", "-n", namespace, "-f", str(DENSE))

    k8s.kubectl("scale", "ecs", "qwen3-dense", "-n", namespace, "--replicas", "3")

    scale = k8s.request(
        "GET", f"/apis/{constants.API_VERSION}/namespaces/{namespace}/{constants.PLURAL}/qwen3-dense/scale")
    assert scale["apiVersion"] == "autoscaling/v1"
    assert scale["kind"] == "Scale"
    assert scale["spec"]["replicas"] == 3
    stored = json.loads(k8s.kubectl("get", "ecs/qwen3-dense", "-n", namespace, "-o", "json").stdout)
    assert stored["spec"]["replicas"] == 3
    # The CEL rule also guards /scale: no scaling past the elastic headroom.
    r = k8s.kubectl("scale", "ecs", "qwen3-dense", "-n", namespace, "--replicas", "5", check=False)
    assert r.returncode != 0
    assert "replicas must not exceed maxReplicas" in r.stderr


# ---- the operator's install: plain manifests ------------------------------------------------------
@pytest.fixture(scope="module")
def operator_rbac(k8s: LocalControlPlane) -> Iterator[None]:
    """manifests/rbac.yaml applied for real (in the Namespace from manifests/operator.yaml)."""
    ns = by_kind(load_all((MANIFESTS / "operator.yaml").read_text()), "Namespace")
    k8s.kubectl("apply", "-f", "-", input=json.dumps(ns))
    k8s.kubectl("apply", "-f", str(MANIFESTS / "rbac.yaml"))
    yield
    k8s.kubectl("delete", "-f", str(MANIFESTS / "rbac.yaml"), "--wait=false", check=False)
    k8s.kubectl("delete", "namespace", constants.OPERATOR_NAMESPACE, "--wait=false", check=False)


def can_i(k8s: LocalControlPlane, verb: str, group: str, resource: str) -> bool:
    name, _, sub = resource.partition("/")
    args = ["auth", "can-i", verb, f"{name}.{group}" if group else name, "--all-namespaces",
            f"--as={OPERATOR_SA}"]
    if sub:
        args.append(f"--subresource={sub}")
    r = k8s.kubectl(*args, check=False)
    assert r.stdout.strip() in ("yes", "no"), r
    return r.stdout.strip() == "yes"


def test_service_account_can_do_everything_rbac_py_lists(k8s: LocalControlPlane, ecs_crd: str,
                                                          operator_rbac: None) -> None:
    denied = [(verb, group, resource)
              for p in rbac.PERMISSIONS for group in p.api_groups for resource in p.resources for verb in p.verbs
              if not can_i(k8s, verb, group, resource)]
    assert denied == []


@pytest.mark.parametrize(("verb", "group", "resource"), [
    ("delete", "apiextensions.k8s.io", "customresourcedefinitions"),
    ("create", "apiextensions.k8s.io", "customresourcedefinitions"),
    ("delete", "", "namespaces"),
    ("update", "", "pods"),  # children are written by patch (server-side apply), never update
    ("patch", "", "pods/status"),  # the kubelet's job
    ("create", "rbac.authorization.k8s.io", "clusterroles"),
    ("get", "", "nodes"),
    ("delete", constants.GROUP, "enginecoresets"),  # users delete fleets, the operator never does
])
def test_service_account_cannot_do_more(k8s: LocalControlPlane, ecs_crd: str, operator_rbac: None,
                                        verb: str, group: str, resource: str) -> None:
    assert not can_i(k8s, verb, group, resource)


def test_service_account_token_works_against_the_api(k8s: LocalControlPlane, namespace: str, ecs_crd: str,
                                                     operator_rbac: None) -> None:
    token = k8s.kubectl("create", "token", constants.OPERATOR_NAME, "-n", constants.OPERATOR_NAMESPACE).stdout
    kubeconfig = k8s.kubeconfig_for_token(token.strip(), "corefleet-operator")
    k8s.kubectl("apply", "-n", namespace, "-f", str(DENSE))

    assert k8s.kubectl("get", "ecs", "--all-namespaces", kubeconfig=kubeconfig).returncode == 0
    assert k8s.kubectl("get", "crd", kubeconfig=kubeconfig).returncode == 0
    k8s.kubectl("patch", "ecs", "qwen3-dense", "-n", namespace, "--subresource=status", "--type=merge",
                "-p", json.dumps({"status": {"replicas": 2, "phase": "Pending"}}), kubeconfig=kubeconfig)
    r = k8s.kubectl("get", "nodes", kubeconfig=kubeconfig, check=False)
    assert r.returncode != 0
    assert "Forbidden" in r.stderr


def test_operator_deployment_passes_server_dry_run_under_restricted_pod_security(
        k8s: LocalControlPlane, operator_rbac: None) -> None:
    r = k8s.kubectl("apply", "--dry-run=server", "-f", str(MANIFESTS / "operator.yaml"), check=False)
    assert r.returncode == 0, r.stderr
    assert "deployment.apps/corefleet-operator created (server dry run)" in r.stdout
    assert "PodSecurity" not in r.stderr  # no "would violate PodSecurity restricted" warning


# ---- the Helm chart -----------------------------------------------------------------------------
def test_helm_lint_strict(helm: Helm) -> None:
    r = helm("lint", "--strict", str(CHART))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 chart(s) failed" in r.stdout


def test_helm_template_passes_server_dry_run_and_matches_the_manifests(
        k8s: LocalControlPlane, namespace: str, helm: Helm) -> None:
    r = helm("template", "corefleet", str(CHART), "--namespace", namespace)
    assert r.returncode == 0, r.stderr
    applied = k8s.kubectl("apply", "--dry-run=server", "-f", "-", input=r.stdout, check=False)
    assert applied.returncode == 0, applied.stderr
    assert applied.stdout.count("(server dry run)") == 5, applied.stdout

    chart = load_all(r.stdout)
    assert sorted(d["kind"] for d in chart) == ["ClusterRole", "ClusterRoleBinding", "Deployment", "Service",
                                                "ServiceAccount"]
    assert by_kind(chart, "ClusterRole")["rules"] == rbac.rules()
    assert by_kind(chart, "ClusterRoleBinding")["subjects"] == [
        {"kind": "ServiceAccount", "name": "corefleet-operator", "namespace": namespace}]
    # With its default values, the chart's Deployment is manifests/operator.yaml's (labels aside).
    manifest = by_kind(load_all((MANIFESTS / "operator.yaml").read_text()), "Deployment")
    rendered = by_kind(chart, "Deployment")
    assert rendered["metadata"]["name"] == manifest["metadata"]["name"]
    assert rendered["spec"]["template"]["spec"] == manifest["spec"]["template"]["spec"]
    for key in ("replicas", "strategy"):
        assert rendered["spec"][key] == manifest["spec"][key]
    selector = rendered["spec"]["selector"]["matchLabels"]
    assert selector.items() >= manifest["spec"]["selector"]["matchLabels"].items()
    assert rendered["spec"]["template"]["metadata"]["labels"].items() >= selector.items()


def test_helm_values_reach_the_deployment(helm: Helm) -> None:
    r = helm("template", "corefleet", str(CHART), "--set", "watchNamespaces={team-a,team-b}",
             "--set", "verbose=true", "--set", "image.tag=dev", "--set", "nodeSelector.pool=system",
             "--include-crds")
    assert r.returncode == 0, r.stderr
    docs = load_all(r.stdout)
    [c] = by_kind(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert c["args"] == ["--namespace=team-a", "--namespace=team-b", "--verbose"]
    assert c["image"] == "ghcr.io/corefleet/operator:dev"
    assert by_kind(docs, "Deployment")["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "system"}
    assert by_kind(docs, "CustomResourceDefinition") == load(MANIFESTS / "crd.yaml")
