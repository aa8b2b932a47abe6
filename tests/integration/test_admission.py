# SPDX-License-Identifier: Apache-2.0
"""What the API server refuses at `kubectl apply` (the generated schema's bounds and CEL rules), on a
real one: sizes (issue 9, defect 9) and engine flags corefleet sets itself (defect 10).

Only a real server says whether the CEL rules fit its cost budget (it refuses the CRD otherwise, and
aborts a rule whose evaluation runs past the budget), and whether the largest object the bounds allow
still takes the largest status the operator can write (etcd's request limit).
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from corefleet_harness.localcluster import LocalControlPlane
from corefleet_operator import constants
from corefleet_operator.models import (
    Condition,
    EngineCoreSetSpec,
    EngineCoreSetStatus,
    FrontendStatus,
    OperationStatus,
    RankStatus,
    RecoveryStatus,
    SpecError,
)
from factories import full_pod_template

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "manifests" / "crd.yaml"
DENSE = REPO / "manifests" / "samples" / "enginecoreset.yaml"
NOW = "2026-01-01T00:00:00Z"


@pytest.fixture(scope="module")
def ecs_crd(k8s: LocalControlPlane) -> str:
    r = k8s.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD), check=False)
    assert r.returncode == 0, r.stderr  # a CEL rule over the cost budget makes the server refuse the CRD
    k8s.wait_established(constants.CRD_NAME)
    return constants.CRD_NAME


def ecs(name: str, **spec: Any) -> dict[str, Any]:
    """The dense sample under another name, with top-level spec fields replaced."""
    obj: dict[str, Any] = copy.deepcopy(yaml.safe_load(DENSE.read_text()))
    obj["metadata"] = {"name": name}
    obj["spec"].update(spec)
    return obj


def apply(k8s: LocalControlPlane, namespace: str, obj: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return k8s.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj), check=False)


def model_accepts(obj: dict[str, Any]) -> bool:
    try:
        EngineCoreSetSpec.parse(obj["spec"])
    except SpecError:
        return False
    return True


# ---- defect 9: sizes ----------------------------------------------------------------------------
def test_the_crd_with_its_cel_rules_is_accepted_within_the_cost_budget(k8s: LocalControlPlane,
                                                                      ecs_crd: str) -> None:
    served = json.loads(k8s.kubectl("get", f"crd/{ecs_crd}", "-o", "json").stdout)
    conditions = {c["type"]: c["status"] for c in served["status"]["conditions"]}
    assert conditions["Established"] == "True"
    assert "NonStructuralSchema" not in conditions


SIZES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "replicas-70000": ({"replicas": 70000, "maxReplicas": 70000},
                       ["spec.replicas: Invalid value: 70000", "less than or equal to 512"]),
    "max-replicas-513": ({"maxReplicas": 513}, ["spec.maxReplicas", "less than or equal to 512"]),
    "129-args": ({"engine": {"args": ["--enforce-eager"] * 129}}, ["spec.engine.args", "must have at most 128 items"]),
    "arg-too-long": ({"engine": {"args": ["--x=" + "a" * 1533]}},
                     ["spec.engine.args[0]", "may not be more than 1536 bytes"]),
    "257-env": ({"engine": {"env": [{"name": f"V{i}", "value": "1"} for i in range(257)]}},
                ["spec.engine.env", "must have at most 256 items"]),
    "9-frontends": ({"frontend": {"replicas": 9}}, ["spec.frontend.replicas", "less than or equal to 8"]),
    "0-frontends": ({"frontend": {"replicas": 0}}, ["spec.frontend.replicas", "greater than or equal to 1"]),
}


@pytest.mark.parametrize("case", list(SIZES))
def test_a_size_beyond_its_bound_is_refused_at_apply(k8s: LocalControlPlane, namespace: str, ecs_crd: str,
                                                     case: str) -> None:
    change, expected = SIZES[case]
    obj = ecs(case, **change)
    r = apply(k8s, namespace, obj)
    assert r.returncode != 0
    for text in expected:
        assert text in r.stderr, r.stderr
    assert k8s.kubectl("get", "ecs", case, "-n", namespace, check=False).returncode != 0
    assert not model_accepts(obj)  # the operator refuses what the server would


def test_kubectl_scale_past_the_bound_is_refused(k8s: LocalControlPlane, namespace: str, ecs_crd: str) -> None:
    assert apply(k8s, namespace, ecs("scaled", maxReplicas=512)).returncode == 0
    assert k8s.kubectl("scale", "ecs", "scaled", "-n", namespace, "--replicas", "512").returncode == 0

    r = k8s.kubectl("scale", "ecs", "scaled", "-n", namespace, "--replicas", "70000", check=False)

    assert r.returncode != 0
    assert "less than or equal to 512" in r.stderr, r.stderr
    stored = json.loads(k8s.kubectl("get", "ecs", "scaled", "-n", namespace, "-o", "json").stdout)
    assert stored["spec"]["replicas"] == 512


def test_the_largest_fleet_takes_the_largest_status(k8s: LocalControlPlane, namespace: str, ecs_crd: str) -> None:
    """Every bound at its maximum, then the largest status the model can build: the status write fits
    etcd's request limit, and every CEL rule evaluates over 128 args of 1536 characters within the
    per-call budget. (Server-side apply: a client-side `kubectl apply` copies the spec into an
    annotation, and the API server caps all annotations at 256 KiB, so this spec is too large for it.)"""
    name_pad = "N" * (constants.MAX_ENV_NAME_LENGTH - 4)
    env = [{"name": f"V{i:03}{name_pad}", "value": "x" * constants.MAX_ENV_VALUE_LENGTH}
           for i in range(constants.MAX_ENV_VARS)]
    args = [f"--x{i:03}_" + "_" * (constants.MAX_ENGINE_ARG_LENGTH - 7) for i in range(constants.MAX_ENGINE_ARGS)]
    obj = ecs("largest", replicas=512, maxReplicas=512,
              engine={"args": args, "env": env, "tensorParallelSize": 1},
              frontend={"replicas": constants.MAX_FRONTENDS})
    assert model_accepts(obj)
    r = k8s.kubectl("apply", "--server-side", "-n", namespace, "-f", "-", input=json.dumps(obj), check=False)
    assert r.returncode == 0, r.stderr[-2000:]

    long = "why " * 10_000
    status = EngineCoreSetStatus(
        observedGeneration=1, replicas=512, readyReplicas=0, phase="Recovering",
        ranks=tuple(RankStatus(rank=r, pod=constants.engine_name("largest", r), phase="Failed", message=long)
                    for r in range(constants.MAX_REPLICAS)),
        conditions=tuple(Condition(type=t, status="True", reason="R", lastTransitionTime=NOW, message=long)
                         for t in ("Available", "Progressing", "Scaling", "Degraded")),
        operation=OperationStatus(id="r", fromReplicas=1, toReplicas=512, phase="Failed", message=long),
        recovery=RecoveryStatus(attempt=3, reason=long), fleetGeneration=3,
        frontends=tuple(FrontendStatus(pod=name, ready=False)
                        for name in constants.frontend_names("largest", constants.MAX_FRONTENDS)))
    body = json.dumps({"status": status.to_json()}).encode()
    assert len(body) > 190 * 1024
    k8s.request("PATCH", f"/apis/{constants.API_VERSION}/namespaces/{namespace}/{constants.PLURAL}/largest/status",
                body, content_type="application/merge-patch+json")

    stored = json.loads(k8s.kubectl("get", "ecs", "largest", "-n", namespace, "-o", "json").stdout)
    assert len(stored["status"]["ranks"]) == 512
    assert EngineCoreSetStatus.parse_report(stored["status"]) == (status, (), False)


# ---- defect 10: engine flags --------------------------------------------------------------------
# (args, expertParallel, tensorParallelSize, loadFormat) -> None (admitted) or a text of the refusal.
FLAGS: dict[str, tuple[list[str], bool, int, str, str | None]] = {
    "eplb-on-moe": (["--enable-eplb"], True, 2, "auto", None),
    "ep-switches-on-moe": (["--enable-expert-parallel", "-ep", "--enable-elastic-ep"], True, 1, "auto", None),
    "no-eplb-on-dense": (["--no-enable-eplb"], False, 1, "auto", None),
    "tp-agrees-two-items": (["--tensor-parallel-size", "2"], False, 2, "auto", None),
    "tp-agrees-equals": (["-tp=4"], False, 4, "auto", None),
    "load-format-agrees": (["--load-format", "dummy"], False, 1, "dummy", None),
    "plain-flags": (["--max-model-len=256", "--enforce-eager", "--no-data-parallel-hybrid-lb"], False, 1, "auto",
                    None),
    "eplb-on-dense": (["--max-model-len=8", "--enable-eplb"], False, 1, "auto",
                      "engine.args: --enable-eplb is set by corefleet on expertParallel fleets only: this fleet is "
                      "dense (expertParallel: false)"),
    "ep-on-dense": (["-ep"], False, 1, "auto", "engine.args: -ep is set by corefleet on expertParallel fleets only"),
    "no-eplb-on-moe": (["--no-enable-eplb"], True, 1, "auto",
                       "engine.args: --no-enable-eplb conflicts with expertParallel: true"),
    "tp-disagrees-two-items": (["--tensor-parallel-size", "4"], False, 2, "auto",
                               "engine.args: --tensor-parallel-size/-tp must equal engine.tensorParallelSize"),
    "tp-disagrees-equals": (["--tensor-parallel-size=4"], False, 2, "auto",
                            "--tensor-parallel-size/-tp must equal engine.tensorParallelSize"),
    "tp-disagrees-short": (["-tp", "8"], False, 1, "auto", "--tensor-parallel-size/-tp must equal"),
    "load-format-disagrees": (["--load-format=dummy"], False, 1, "auto",
                              "engine.args: --load-format must equal engine.loadFormat"),
    "dp-size": (["--data-parallel-size=8"], False, 1, "auto",
                "spec.engine: Invalid value: engine.args: --data-parallel-size=8 is set by corefleet (the wiring "
                "of the fleet) and cannot be overridden"),
    "dp-rank-underscores": (["--data_parallel_rank", "1"], False, 1, "auto",
                            "engine.args: --data_parallel_rank is set by corefleet"),
    "dp-short": (["-dpa=10.0.0.1"], False, 1, "auto", "engine.args: -dpa=10.0.0.1 is set by corefleet"),
    "headless": (["--headless"], False, 1, "auto", "engine.args: --headless is set by corefleet"),
    "api-server-count": (["-asc", "2"], False, 1, "auto", "engine.args: -asc is set by corefleet"),
    "elastic-max": (["--elastic-ep-max-dp-size=8"], True, 1, "auto",
                    "engine.args: --elastic-ep-max-dp-size=8 is set by corefleet"),
    "nnodes-glued": (["-n2"], False, 1, "auto", "engine.args: -n2 is set by corefleet"),
    "model": (["--model", "other"], False, 1, "auto", "engine.args: --model is set by corefleet"),
}


@pytest.mark.parametrize("case", list(FLAGS))
def test_engine_flags_are_judged_at_apply(k8s: LocalControlPlane, namespace: str, ecs_crd: str,
                                          case: str) -> None:
    args, moe, tp, load_format, refusal = FLAGS[case]
    obj = ecs(case, expertParallel=moe, engine={"args": args, "tensorParallelSize": tp, "loadFormat": load_format})
    r = apply(k8s, namespace, obj)
    if refusal is None:
        assert r.returncode == 0, r.stderr
        assert model_accepts(obj)  # and the operator runs it
    else:
        assert r.returncode != 0
        assert refusal in r.stderr, r.stderr
        assert k8s.kubectl("get", "ecs", case, "-n", namespace, check=False).returncode != 0
        assert not model_accepts(obj)  # CEL never refuses what the operator would run


def test_a_flag_cel_cannot_see_is_left_to_the_operator(k8s: LocalControlPlane, namespace: str,
                                                       ecs_crd: str) -> None:
    """An abbreviation (argparse's allow_abbrev) is admitted; the operator's model refuses it (InvalidSpec)."""
    obj = ecs("abbrev", engine={"args": ["--headl"]})
    assert apply(k8s, namespace, obj).returncode == 0
    with pytest.raises(SpecError, match=r"--headl abbreviates --headless"):
        EngineCoreSetSpec.parse(obj["spec"])


# ---- issue 27: pod templates and storage ----------------------------------------------------------
# Each field of corefleet's own container a podTemplate may not set, refused at apply with its name.
OWNED_CONTAINER_FIELDS: dict[str, Any] = {
    "image": "x", "command": ["sh"], "args": ["-c"], "ports": [{"containerPort": 1}],
    "startupProbe": {"exec": {"command": ["true"]}}, "livenessProbe": {"exec": {"command": ["true"]}},
    "readinessProbe": {"exec": {"command": ["true"]}}, "lifecycle": {"preStop": {"sleep": {"seconds": 1}}},
    "resources": {"limits": {"cpu": "1"}}, "tty": True, "stdin": True,
}


@pytest.mark.parametrize("role", ["engine", "frontend", "coordinator"])
@pytest.mark.parametrize("field", list(OWNED_CONTAINER_FIELDS))
def test_each_owned_container_field_is_refused_at_apply(k8s: LocalControlPlane, namespace: str, ecs_crd: str,
                                                        role: str, field: str) -> None:
    obj = ecs(f"{role}-{field.lower()}")
    obj["spec"].setdefault(role, {})["podTemplate"] = {
        "spec": {"containers": [{"name": role, field: OWNED_CONTAINER_FIELDS[field]}]}}
    r = apply(k8s, namespace, obj)
    assert r.returncode != 0
    assert f"containers[{role}].{field}: refused on corefleet's container" in r.stderr, r.stderr
    assert not model_accepts(obj)


POD_REFUSALS: dict[str, tuple[dict[str, Any], str]] = {
    "restart-policy": ({"spec": {"restartPolicy": "Always"}}, "restartPolicy is refused: corefleet sets Never"),
    "hostname": ({"spec": {"hostname": "h"}}, "hostname is refused"),
    "subdomain": ({"spec": {"subdomain": "s"}}, "subdomain is refused"),
    "service-links": ({"spec": {"enableServiceLinks": True}}, "enableServiceLinks is refused"),
    "fleet-label": ({"metadata": {"labels": {"corefleet.io/fleet": "other"}}},
                    "labels: corefleet.io/fleet is a fleet label"),
    "managed-by": ({"metadata": {"labels": {"app.kubernetes.io/managed-by": "me"}}},
                   "labels: app.kubernetes.io/managed-by is a fleet label"),
    "annotation": ({"metadata": {"annotations": {"corefleet.io/spec-hash": "x"}}},
                   "annotations: corefleet.io/spec-hash is corefleet's annotation"),
    "volume-name": ({"spec": {"volumes": [{"name": "dshm", "emptyDir": {}}]}},
                    "are the names of volumes corefleet adds"),
    "init-name": ({"spec": {"initContainers": [{"name": "engine", "image": "x"}]}},
                  "are the names of corefleet's containers"),
    "mount-name": ({"spec": {"containers": [
        {"name": "engine", "volumeMounts": [{"name": "home", "mountPath": "/x"}]}]}},
                   "containers[engine].volumeMounts: home is a volume corefleet mounts itself"),
    "other-role": ({"spec": {"containers": [{"name": "frontend"}]}}, "these pods have no frontend or coordinator"),
    "unknown-pod-field": ({"spec": {"hostNetwork": True}},
                          'unknown field "spec.engine.podTemplate.spec.hostNetwork"'),
}


@pytest.mark.parametrize("case", list(POD_REFUSALS))
def test_owned_pod_fields_and_fleet_labels_are_refused_at_apply(k8s: LocalControlPlane, namespace: str,
                                                                ecs_crd: str, case: str) -> None:
    template, refusal = POD_REFUSALS[case]
    obj = ecs(case, engine={"podTemplate": template})
    r = apply(k8s, namespace, obj)
    assert r.returncode != 0
    assert refusal in r.stderr, r.stderr
    assert not model_accepts(obj)


def test_a_full_template_for_every_role_and_service_metadata_are_accepted(k8s: LocalControlPlane, namespace: str,
                                                                         ecs_crd: str) -> None:
    obj = ecs("full", storage={"pvc": {"claimName": "weights"}}, model="qwen3-8b")
    for role in ("engine", "frontend", "coordinator"):
        obj["spec"].setdefault(role, {})["podTemplate"] = full_pod_template(role)
    obj["spec"]["frontend"]["service"] = {"type": "LoadBalancer", "labels": {"team": "t"},
                                          "annotations": {"cloud.example.com/lb-internal": "1"}}
    r = apply(k8s, namespace, obj)
    assert r.returncode == 0, r.stderr
    stored = json.loads(k8s.kubectl("get", "ecs", "full", "-n", namespace, "-o", "json").stdout)["spec"]
    for role in ("engine", "frontend", "coordinator"):
        assert stored[role]["podTemplate"] == full_pod_template(role)  # nothing pruned
    assert stored["storage"] == {"pvc": {"claimName": "weights", "readOnly": True}, "mountPath": "/models"}
    assert EngineCoreSetSpec.parse(stored) == EngineCoreSetSpec.parse(obj["spec"])


STORAGE_REFUSALS: dict[str, tuple[dict[str, Any], str, str]] = {
    "two-sources": ({"pvc": {"claimName": "w"}, "hub": {}}, "m",
                    "storage: set exactly one of pvc, hostPath, image, hub"),
    "no-source": ({"mountPath": "/w"}, "m", "storage: set exactly one of"),
    "mount-in-home": ({"pvc": {"claimName": "w"}, "mountPath": "/home/corefleet/w"}, "m",
                      "storage.mountPath must not be one of corefleet's paths"),
    "model-outside": ({"image": {"reference": "r"}}, "/etc/m",
                      "model: an absolute path must lie under storage.mountPath"),
    "model-dotdot": ({"hostPath": {"path": "/d"}}, "../m", "model: a path in storage must not contain .. segments"),
}


@pytest.mark.parametrize("case", list(STORAGE_REFUSALS))
def test_storage_that_cannot_work_is_refused_at_apply(k8s: LocalControlPlane, namespace: str, ecs_crd: str,
                                                      case: str) -> None:
    storage, model, refusal = STORAGE_REFUSALS[case]
    obj = ecs(case, storage=storage, model=model)
    r = apply(k8s, namespace, obj)
    assert r.returncode != 0
    assert refusal in r.stderr, r.stderr
    assert not model_accepts(obj)


@pytest.mark.parametrize("storage", [{"pvc": {"claimName": "w", "subPath": "hf"}}, {"hostPath": {"path": "/d"}},
                                     {"image": {"reference": "r/m:1"}, "mountPath": "/w"},
                                     {"hub": {"cache": {"claimName": "c"}, "tokenSecret": {"name": "hf"}}}],
                         ids=["pvc", "hostpath", "image", "hub"])
def test_each_storage_kind_is_accepted(k8s: LocalControlPlane, namespace: str, ecs_crd: str,
                                       storage: dict[str, Any]) -> None:
    obj = ecs(f"s-{next(iter(storage)).lower()}", storage=storage, model="m")
    r = apply(k8s, namespace, obj)
    assert r.returncode == 0, r.stderr
    assert model_accepts(obj)
