# SPDX-License-Identifier: Apache-2.0
"""The operator, running in-process (kopf), against the real control plane.

Each test gets its own namespace and its own operator watching only that namespace; the kubelet
stand-in starts the pods the scheduler binds and completes their deletions. Every test ends by
asserting that the operator raised nothing and logged no traceback.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kopf.testing import KopfRunner

from clusterview import ClusterView, running_operator
from corefleet_harness.localcluster import KubeletStandIn, LocalControlPlane, fail_pod
from corefleet_operator import crd

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def ecs_crd(k8s: LocalControlPlane) -> None:
    k8s.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(crd.crd()))
    k8s.wait_established("enginecoresets.corefleet.io")


@pytest.fixture
def operator(k8s: LocalControlPlane, ecs_crd: None, namespace: str,
             kubelet: KubeletStandIn) -> Iterator[KopfRunner]:
    with running_operator(namespace) as runner:
        yield runner


class Cluster(ClusterView):
    """Reads for assertions, through the admin kubeconfig."""

    def pods(self, fleet: str) -> dict[str, dict[str, Any]]:
        items = self.get(f"/api/v1/namespaces/{self.ns}/pods?labelSelector=corefleet.io/fleet={fleet}")["items"]
        return {p["metadata"]["name"]: p for p in items}

    def events(self, reason: str) -> list[str]:
        items = self.get(f"/api/v1/namespaces/{self.ns}/events")["items"]
        return [e["message"] for e in items if e["reason"] == reason]


@pytest.fixture
def cluster(k8s: LocalControlPlane, namespace: str) -> Cluster:
    return Cluster(k8s, namespace)


def test_sample_becomes_a_complete_fleet_with_status(cluster: Cluster, operator: KopfRunner) -> None:
    cluster.apply(cluster.make("llm").replicas(2).arg("--max-model-len=256").manifest())

    ecs = cluster.wait_running("llm", 2)

    pods = cluster.pods("llm")
    assert sorted(pods) == ["llm-coordinator", "llm-engine-0", "llm-engine-1", "llm-frontend"]
    engine = pods["llm-engine-1"]
    assert engine["metadata"]["ownerReferences"][0]["uid"] == ecs["metadata"]["uid"]
    assert engine["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    args = engine["spec"]["containers"][0]["args"]
    assert args[args.index("--data-parallel-start-rank") + 1] == "1"
    assert args[-1] == "--max-model-len=256"
    assert engine["spec"]["restartPolicy"] == "Never"
    for svc in ("llm", "llm-fleet"):
        cluster.get(f"/api/v1/namespaces/{cluster.ns}/services/{svc}")
    assert cluster.get(f"/api/v1/namespaces/{cluster.ns}/services/llm-fleet")["spec"]["clusterIP"] == "None"
    cluster.get(f"/api/v1/namespaces/{cluster.ns}/secrets/llm-admin")
    st = ecs["status"]
    assert st["observedGeneration"] == ecs["metadata"]["generation"]
    assert st["selector"] == "corefleet.io/fleet=llm,corefleet.io/role=engine"
    assert st["endpoint"] == f"http://llm.{cluster.ns}.svc:8000/v1"
    assert [(r["rank"], r["phase"]) for r in st["ranks"]] == [(0, "Serving"), (1, "Serving")]
    conditions = {c["type"]: c for c in st["conditions"]}
    assert conditions["Available"]["status"] == "True"
    assert conditions["Progressing"]["status"] == "False"
    assert re.fullmatch(r"[A-Z][A-Za-z]+", conditions["Available"]["reason"])
    # kopf's bookkeeping stays out of status and under our prefix.
    assert set(st) <= {"observedGeneration", "replicas", "readyReplicas", "selector", "phase", "conditions",
                       "ranks", "recoveries", "fleetGeneration", "endpoint", "operation", "frontends"}
    assert st["frontends"] == [{"pod": "llm-frontend", "ready": True}]
    assert ecs["metadata"]["finalizers"] == ["corefleet.io/finalizer"]
    assert not [k for k in ecs["metadata"].get("annotations", {}) if k.startswith("kopf.zalando.org")]
    assert cluster.events("FleetReady")

    table = cluster.k8s.kubectl("get", "ecs", "-n", cluster.ns).stdout.splitlines()
    assert table[0].split() == ["NAME", "REPLICAS", "READY", "PHASE", "MODEL", "AGE"]
    assert table[1].split()[:5] == ["llm", "2", "2", "Running", "corefleet/tiny-llama"]


def test_two_frontends_are_two_pods_that_each_know_both_and_status_tells_which_serve(
        cluster: Cluster, operator: KopfRunner) -> None:
    """spec.frontend.replicas: 2 (issue 25): `NAME-frontend` and `NAME-frontend-1`, each with both frontends' DNS
    names and its own client index, behind the one Service; a MoE fleet with two is refused at admission."""
    cluster.apply(cluster.make("k2").replicas(2).set("frontend.replicas", 2).manifest())
    ecs = cluster.wait_running("k2", 2)
    pods = cluster.pods("k2")
    assert sorted(pods) == ["k2-coordinator", "k2-engine-0", "k2-engine-1", "k2-frontend", "k2-frontend-1"]
    dns = [f"k2-frontend.k2-fleet.{cluster.ns}.svc", f"k2-frontend-1.k2-fleet.{cluster.ns}.svc"]
    for index, name in enumerate(("k2-frontend", "k2-frontend-1")):
        args = pods[name]["spec"]["containers"][0]["args"]
        assert args[args.index("--frontend-addresses") + 1] == ",".join(dns)
        assert args[args.index("--client-index") + 1] == str(index)
    assert ecs["status"]["frontends"] == [{"pod": "k2-frontend", "ready": True}, {"pod": "k2-frontend-1",
                                                                                  "ready": True}]
    service = cluster.get(f"/api/v1/namespaces/{cluster.ns}/services/k2")
    assert service["spec"]["selector"] == {"corefleet.io/fleet": "k2", "corefleet.io/role": "frontend"}
    refused = cluster.k8s.kubectl("apply", "-n", cluster.ns, "-f", "-", check=False, input=json.dumps(
        cluster.make("moe").replicas(2).expert_parallel().set("frontend.replicas", 2).manifest()))
    assert refused.returncode != 0
    assert "frontend.replicas must be 1 with expertParallel: true" in refused.stderr


def test_kubectl_scale_starts_an_in_place_resize(cluster: Cluster, operator: KopfRunner) -> None:
    """`kubectl scale` (the scale subresource) becomes a resize in place: recorded in status.operation,
    exactly the new ranks' pods created, nothing else touched. With no frontend process here (the
    kubelet stand-in runs nothing) the resize waits for the frontend; e2e tests carry it out."""
    cluster.apply(cluster.make("s").replicas(1).manifest())
    cluster.wait_running("s", 1)
    before = {n: p["metadata"]["uid"] for n, p in cluster.pods("s").items()}

    cluster.k8s.kubectl("scale", "ecs", "s", "-n", cluster.ns, "--replicas=3")

    def resizing() -> bool:
        op = cluster.ecs("s").get("status", {}).get("operation") or {}
        return (op.get("fromReplicas"), op.get("toReplicas")) == (1, 3) and \
            {"s-engine-1", "s-engine-2"} <= set(cluster.pods("s"))

    cluster.wait("a resize 1 -> 3 with the new ranks' pods", resizing)
    ecs = cluster.ecs("s")
    assert ecs["status"]["phase"] == "Scaling"
    assert ecs["status"]["operation"]["phase"] == "Pending"  # the frontend has not taken it (there is none)
    pods = cluster.pods("s")
    assert {n: pods[n]["metadata"]["uid"] for n in before} == before  # nothing recreated
    args = pods["s-engine-2"]["spec"]["containers"][0]["args"]
    assert args[args.index("--data-parallel-size") + 1] == "3"
    scale = cluster.get(f"/apis/corefleet.io/v1alpha1/namespaces/{cluster.ns}/enginecoresets/s/scale")
    assert (scale["spec"]["replicas"], scale["status"]["replicas"]) == (3, 1)  # committed only once it completes
    assert scale["status"]["selector"] == "corefleet.io/fleet=s,corefleet.io/role=engine"
    cluster.wait("a ResizeStarted event", lambda: any("1 -> 3 ranks in place" in m
                                                        for m in cluster.events("ResizeStarted")))


def test_deleted_child_is_recreated(cluster: Cluster, operator: KopfRunner) -> None:
    cluster.apply(cluster.make("d").replicas(1).manifest())
    cluster.wait_running("d", 1)
    old = cluster.get(f"/api/v1/namespaces/{cluster.ns}/services/d")["metadata"]["uid"]

    cluster.k8s.kubectl("delete", "service", "d", "-n", cluster.ns)

    def recreated() -> bool:
        return bool(cluster.get(f"/api/v1/namespaces/{cluster.ns}/services/d")["metadata"]["uid"] != old)
    cluster.wait("Service d recreated", recreated)
    assert any("Service d was missing" in m for m in cluster.events("Repaired"))
    assert cluster.ecs("d")["status"]["recoveries"] == 0


def test_edited_child_is_put_back_as_specified(cluster: Cluster, operator: KopfRunner) -> None:
    cluster.apply(cluster.make("e").replicas(1).manifest())
    cluster.wait_running("e", 1)
    path = f"/api/v1/namespaces/{cluster.ns}/services/e"
    port = cluster.get(path)["spec"]["ports"][0]

    cluster.k8s.kubectl("patch", "service", "e", "-n", cluster.ns, "--type=json", "-p", json.dumps(
        [{"op": "replace", "path": "/spec/ports/0/targetPort", "value": 9999}]))

    cluster.wait("Service e put back", lambda: cluster.get(path)["spec"]["ports"][0] == port)
    assert any("Service e was changed" in m for m in cluster.events("Repaired"))


def test_failed_engine_pod_recovers_the_fleet(cluster: Cluster, operator: KopfRunner) -> None:
    # An MoE fleet: its ranks share collectives, so a lost rank recreates the whole fleet. (A dense
    # fleet replaces the rank in place, through its frontend: tests/e2e/test_resize_emulator.py.)
    cluster.apply(cluster.make("f").replicas(2).expert_parallel().manifest())
    cluster.wait_running("f", 2)
    old_uids = {p["metadata"]["uid"] for p in cluster.pods("f").values()}

    fail_pod(cluster.k8s, cluster.ns, "f-engine-1")

    cluster.wait("recovery counted", lambda: cluster.ecs("f")["status"].get("recoveries") == 1)
    ecs = cluster.wait_running("f", 2)
    assert ecs["status"]["recoveries"] == 1
    assert ecs["status"]["fleetGeneration"] == 2
    assert not old_uids & {p["metadata"]["uid"] for p in cluster.pods("f").values()}
    lost = cluster.events("RankLost")
    assert any("rank 1 (pod f-engine-1) failed: container engine exited with 137 (OOMKilled)" in m for m in lost)


def test_deleting_the_enginecoreset_leaves_no_child(cluster: Cluster, operator: KopfRunner) -> None:
    cluster.apply(cluster.make("g").replicas(2).network_policy().manifest())
    cluster.wait_running("g", 2)

    cluster.k8s.kubectl("delete", "ecs", "g", "-n", cluster.ns, "--wait=true", "--timeout=60s")

    def nothing_left() -> bool:
        ns = cluster.ns
        left = [*cluster.pods("g"),
                *(s["metadata"]["name"] for s in cluster.get(f"/api/v1/namespaces/{ns}/services")["items"]),
                *(s["metadata"]["name"] for s in cluster.get(f"/api/v1/namespaces/{ns}/secrets")["items"]
                  if s["metadata"]["name"].startswith("g-")),
                *(n["metadata"]["name"] for n in
                  cluster.get(f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies")["items"])]
        return not left
    cluster.wait("garbage collection of every child", nothing_left)


def test_semantic_error_is_a_condition_and_other_fleets_keep_working(
        cluster: Cluster, operator: KopfRunner) -> None:
    # CEL refuses the wiring flags it can see whole at admission (tests/integration/test_admission.py); an
    # abbreviation, which vLLM's parser accepts, gets through and is refused by the operator.
    cluster.apply(cluster.make("bad").replicas(1).arg("--headl").manifest())
    cluster.apply(cluster.make("good").replicas(1).manifest())

    def invalid() -> bool:
        conditions: list[dict[str, Any]] = cluster.ecs("bad").get("status", {}).get("conditions", [])
        conds = {c["type"]: c for c in conditions}
        return conds.get("Degraded", {}).get("reason") == "InvalidSpec"
    cluster.wait("InvalidSpec condition", invalid)
    cluster.wait_running("good", 1)

    bad = cluster.ecs("bad")
    degraded = next(c for c in bad["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["message"] == ("spec.engine.args[0]: --headl abbreviates --headless (vLLM accepts "
                                   "abbreviations), which corefleet sets: write the flag in full, where it "
                                   "may agree with the spec")
    assert bad["status"]["phase"] == "Failed"
    assert cluster.pods("bad") == {}
    assert cluster.events("InvalidSpec") == [degraded["message"]]


def test_operator_with_only_the_manifest_rbac_meets_no_forbidden(
        k8s: LocalControlPlane, ecs_crd: None, namespace: str, kubelet: KubeletStandIn,
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator runs on a service-account token bound by manifests/rbac.yaml, not as admin."""
    k8s.kubectl("create", "namespace", "corefleet-system", check=False)  # exists if another test made it
    k8s.kubectl("apply", "-f", str(REPO / "manifests" / "rbac.yaml"))
    token = k8s.kubectl("create", "token", "corefleet-operator", "-n", "corefleet-system").stdout.strip()
    monkeypatch.setenv("KUBECONFIG", str(k8s.kubeconfig_for_token(token, "corefleet-operator")))

    args = ["run", "--standalone", f"--namespace={namespace}", "-m", "corefleet_operator.handlers"]
    with KopfRunner(args, timeout=60) as runner:
        cluster.apply(cluster.make("rbac").replicas(2).network_policy().manifest())
        cluster.wait_running("rbac", 2)
        cluster.k8s.kubectl("delete", "service", "rbac", "-n", namespace)
        cluster.wait("Service recreated under the operator's own RBAC",
                     lambda: cluster.get(f"/api/v1/namespaces/{namespace}/services")["items"] != [])

    assert runner.exception is None
    assert runner.exit_code == 0
    assert "Traceback" not in runner.output
    assert "Forbidden" not in runner.output
    assert " 403" not in runner.output
