# SPDX-License-Identifier: Apache-2.0
"""Model storage, per-role pod templates and PodSecurity `restricted` defaults (issue 27, parts 1-3):
what the model refuses (with the path and why), and how each allowed field reaches the pods. Whole pods
are golden files (test_builders.py: *-template.yaml, engine-pod-storage-*.yaml)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from corefleet_operator import builders, constants
from corefleet_operator.models import EngineCoreSetSpec, SpecError, to_json
from factories import EcsFactory, full_pod_template, make_ecs

ROLES = {"engine": constants.CONTAINER_ENGINE, "frontend": constants.CONTAINER_FRONTEND,
         "coordinator": constants.CONTAINER_COORDINATOR}


def _pods(f: EcsFactory, dp_size: int = 2) -> dict[str, dict[str, Any]]:
    """The fleet's pods by role (engine: rank 0)."""
    objs = builders.fleet_children(f.obj(), dp_size=dp_size, admin_token="t")
    by_role: dict[str, dict[str, Any]] = {}
    for o in objs:
        if o["kind"] == "Pod":
            by_role.setdefault(o["metadata"]["labels"][constants.LABEL_ROLE], o)
    return by_role


def _main(pod: dict[str, Any]) -> dict[str, Any]:
    c: dict[str, Any] = pod["spec"]["containers"][0]
    return c


def _refusal(f: EcsFactory) -> SpecError:
    with pytest.raises(SpecError) as e:
        f.obj()
    return e.value


# ---- PodSecurity restricted -------------------------------------------------------------------------
@pytest.mark.parametrize("role", list(ROLES))
def test_every_fleet_pod_meets_the_restricted_pod_security_standard(role: str) -> None:
    pod = _pods(make_ecs("a").storage(pvc={"claimName": "w"}))[role]
    assert pod["spec"]["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": constants.RUNTIME_UID, "runAsGroup": constants.RUNTIME_GID,
        "fsGroup": constants.RUNTIME_FS_GROUP, "seccompProfile": {"type": "RuntimeDefault"}}
    for c in pod["spec"]["containers"]:
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    # The restricted standard's volume types (no hostPath) and no host namespaces or privileged fields.
    allowed = {"emptyDir", "secret", "persistentVolumeClaim", "configMap", "projected", "downwardAPI", "csi",
               "ephemeral"}
    for volume in pod["spec"]["volumes"]:
        assert set(volume) - {"name"} <= allowed, volume
    assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod["spec"])


@pytest.mark.parametrize("role", list(ROLES))
def test_home_is_a_writable_empty_dir_for_a_uid_without_a_passwd_entry(role: str) -> None:
    pod = _pods(make_ecs("a"))[role]
    env = {e["name"]: e.get("value") for e in _main(pod)["env"]}
    assert env[constants.ENV_HOME] == constants.RUNTIME_HOME
    [mount] = [m for m in _main(pod)["volumeMounts"] if m["name"] == constants.VOLUME_HOME]
    assert mount == {"name": constants.VOLUME_HOME, "mountPath": constants.RUNTIME_HOME}
    assert {"name": constants.VOLUME_HOME, "emptyDir": {}} in pod["spec"]["volumes"]


def test_a_template_may_relax_the_security_contexts_key_by_key() -> None:
    template = {"spec": {"securityContext": {"runAsNonRoot": False, "runAsUser": 0},
                         "containers": [{"name": "engine", "securityContext": {"allowPrivilegeEscalation": True}}]}}
    pod = _pods(make_ecs("a").pod_template("engine", template))["engine"]
    assert pod["spec"]["securityContext"] == {**builders.pod_security_context(), "runAsNonRoot": False,
                                              "runAsUser": 0}
    assert _main(pod)["securityContext"] == {"allowPrivilegeEscalation": True, "capabilities": {"drop": ["ALL"]}}


# ---- storage ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("storage", "volume", "mount"), [
    ({"pvc": {"claimName": "w"}}, {"persistentVolumeClaim": {"claimName": "w", "readOnly": True}},
     {"readOnly": True}),
    ({"pvc": {"claimName": "w", "readOnly": False, "subPath": "x/y"}},
     {"persistentVolumeClaim": {"claimName": "w", "readOnly": False}}, {"subPath": "x/y"}),
    ({"hostPath": {"path": "/mnt/m"}}, {"hostPath": {"path": "/mnt/m", "type": "Directory"}}, {"readOnly": True}),
    ({"image": {"reference": "r/m:1"}}, {"image": {"reference": "r/m:1", "pullPolicy": "IfNotPresent"}},
     {"readOnly": True}),
    ({"hub": {}}, {"emptyDir": {}}, {}),
    ({"hub": {"cache": {"claimName": "c"}}}, {"persistentVolumeClaim": {"claimName": "c"}}, {}),
], ids=["pvc", "pvc-rw-subpath", "hostpath", "image", "hub-emptydir", "hub-cache"])
def test_storage_is_mounted_in_engines_and_frontend_but_not_the_coordinator(
        storage: dict[str, Any], volume: dict[str, Any], mount: dict[str, Any]) -> None:
    pods = _pods(make_ecs("a").storage(**storage, mountPath="/w"))
    for role in ("engine", "frontend"):
        assert {"name": constants.VOLUME_MODELS, **volume} in pods[role]["spec"]["volumes"]
        assert {"name": constants.VOLUME_MODELS, "mountPath": "/w", **mount} in _main(pods[role])["volumeMounts"]
    coordinator = pods["coordinator"]
    assert constants.VOLUME_MODELS not in str(coordinator["spec"]["volumes"])


def _model_flags(pod: dict[str, Any]) -> tuple[str, list[str]]:
    args = _main(pod)["args"]
    model = args[args.index("--") + 1] if "--" in args else args[args.index("--model") + 1]
    served = [args[i + 1] for i, a in enumerate(args) if a == "--served-model-name"]
    return model, served


@pytest.mark.parametrize(("model", "storage", "path", "served"), [
    ("Qwen/Qwen3-8B", None, "Qwen/Qwen3-8B", []),  # no storage: as before
    ("qwen3", {"pvc": {"claimName": "w"}}, "/models/qwen3", ["qwen3"]),
    ("org/m", {"image": {"reference": "r"}, "mountPath": "/w"}, "/w/org/m", ["org/m"]),
    ("/w/m", {"hostPath": {"path": "/d"}, "mountPath": "/w"}, "/w/m", []),  # absolute under the mount: as given
    ("Qwen/Qwen3-8B", {"hub": {}}, "Qwen/Qwen3-8B", []),  # the hub: a hub id
])
def test_model_is_resolved_against_the_storage_and_served_under_its_spec_name(
        model: str, storage: dict[str, Any] | None, path: str, served: list[str]) -> None:
    f = make_ecs("a").model(model)
    if storage is not None:
        f.storage(**storage)
    for role in ("engine", "frontend"):
        assert _model_flags(_pods(f)[role]) == (path, served)


def test_the_users_served_model_name_wins() -> None:
    f = make_ecs("a").model("m").storage(pvc={"claimName": "w"}).arg("--served_model_name=chat")
    for role in ("engine", "frontend"):
        assert _model_flags(_pods(f)[role]) == ("/models/m", [])
        assert _main(_pods(f)[role])["args"][-1] == "--served_model_name=chat"


def test_hub_storage_sets_the_cache_and_the_token() -> None:
    f = make_ecs("a").storage(hub={"tokenSecret": {"name": "hf", "key": "tok"}}, mountPath="/hf")
    for role in ("engine", "frontend"):
        env = {e["name"]: e.get("value", e.get("valueFrom")) for e in _main(_pods(f)[role])["env"]}
        assert env[constants.ENV_HF_HOME] == "/hf"
        assert env[constants.ENV_HF_TOKEN] == {"secretKeyRef": {"name": "hf", "key": "tok"}}
    assert constants.ENV_HF_HOME not in str(_main(_pods(f)["coordinator"])["env"])


@pytest.mark.parametrize(("change", "changes_hash"), [
    (lambda f: f.storage(pvc={"claimName": "w"}), True),
    (lambda f: f.pod_template("engine", {"metadata": {"labels": {"x": "y"}}}), True),
    (lambda f: f.pod_template("frontend", {"spec": {"runtimeClassName": "nvidia"}}), True),
    (lambda f: f.pod_template("coordinator", {"spec": {"priorityClassName": "p"}}), True),
    (lambda f: f.set("frontend.service.annotations", {"a": "b"}), False),  # no fleet process changes
    (lambda f: f.set("frontend.service.labels", {"a": "b"}), False),
])
def test_storage_and_templates_are_part_of_the_fleet_configuration(change: Callable[[EcsFactory], Any],
                                                                   changes_hash: bool) -> None:
    base = builders.fleet_config_hash(make_ecs("a").obj().spec)
    changed = make_ecs("a")
    change(changed)
    assert (builders.fleet_config_hash(changed.obj().spec) != base) is changes_hash


def test_a_fleet_without_the_new_sections_keeps_its_hash() -> None:
    """An operator upgrade must not recreate running fleets: the hash of a spec that sets none of storage
    and podTemplate is the one the previous release computed (pinned)."""
    assert builders.fleet_config_hash(make_ecs("a").replicas(2).obj().spec) == "5fbbae3fdccc2c04"
    moe = make_ecs("a").replicas(2).expert_parallel().max_replicas(4).tp(2).arg("--max-model-len=256").env("A", "b")
    assert builders.fleet_config_hash(moe.set("scheduling.nodeSelector", {"p": "q"}).obj().spec) == "e9e73c24722d6bbb"


@pytest.mark.parametrize(("storage", "model", "path", "text"), [
    ({"pvc": {"claimName": "w"}, "hub": {}}, "m", "spec.storage",
     "exactly one of pvc, hostPath, image, hub, not pvc and hub"),
    ({"mountPath": "/m"}, "m", "spec.storage", "exactly one of"),
    ({"pvc": {"claimName": "w"}, "mountPath": "/home/corefleet/m"}, "m", "spec.storage.mountPath", "corefleet's paths"),
    ({"pvc": {"claimName": "w"}, "mountPath": "/dev/shm"}, "m", "spec.storage.mountPath", "corefleet's paths"),
    ({"pvc": {"claimName": "w"}, "mountPath": "/a/../b"}, "m", "spec.storage.mountPath", ". or .. segments"),
    ({"pvc": {"claimName": "w"}, "mountPath": "/"}, "m", "spec.storage.mountPath", "does not match"),
    ({"pvc": {"claimName": "w"}}, "/elsewhere/m", "spec.model", "not under storage.mountPath /models"),
    ({"pvc": {"claimName": "w"}}, "/modelsx/m", "spec.model", "not under storage.mountPath"),
    ({"image": {"reference": "r"}}, "../etc", "spec.model", ".. segments"),
    ({"hostPath": {"path": "relative"}}, "m", "spec.storage.hostPath.path", "does not match"),
])
def test_storage_that_cannot_work_is_refused(storage: dict[str, Any], model: str, path: str, text: str) -> None:
    e = _refusal(make_ecs("a").model(model).storage(**storage))
    assert e.path == path
    assert text in e.message


@pytest.mark.parametrize("name", [constants.ENV_HF_HOME, constants.ENV_HF_TOKEN])
def test_hub_env_is_corefleets(name: str) -> None:
    e = _refusal(make_ecs("a").storage(hub={"tokenSecret": {"name": "s"}}).env(name, "x"))
    assert e.path == "spec.engine.env[0].name"
    assert make_ecs("a").env(name, "x").obj()  # without hub storage it is the user's


# ---- pod templates: refused --------------------------------------------------------------------------
OWNED_CONTAINER = {
    "image": "x", "command": ["sh"], "args": ["-c"], "ports": [{"containerPort": 1}], "startupProbe": {},
    "livenessProbe": {}, "readinessProbe": {}, "lifecycle": {"preStop": {}}, "resources": {"limits": {"cpu": "1"}},
    "resizePolicy": [], "restartPolicy": "Always", "restartPolicyRules": [], "volumeDevices": [],
    "terminationMessagePath": "/x", "terminationMessagePolicy": "File", "stdin": True, "stdinOnce": True,
    "tty": True,
}


@pytest.mark.parametrize("role", list(ROLES))
@pytest.mark.parametrize("field", list(OWNED_CONTAINER))
def test_each_owned_field_of_corefleets_container_is_refused(role: str, field: str) -> None:
    template = {"spec": {"containers": [{"name": ROLES[role], field: OWNED_CONTAINER[field]}]}}
    e = _refusal(make_ecs("a").pod_template(role, template))
    assert e.path == f"spec.{role}.podTemplate.spec.containers[0].{field}"
    assert "refused on corefleet's container" in e.message


@pytest.mark.parametrize("field", list(OWNED_CONTAINER))
def test_a_sidecar_may_set_what_corefleets_container_may_not(field: str) -> None:
    sidecar = {"name": "side", "image": "busybox", field: copy.deepcopy(OWNED_CONTAINER[field])}
    pod = _pods(make_ecs("a").pod_template("engine", {"spec": {"containers": [sidecar]}}))["engine"]
    assert pod["spec"]["containers"][1] == sidecar


@pytest.mark.parametrize(("template", "path", "text"), [
    ({"spec": {"restartPolicy": "Always"}}, "spec.restartPolicy", "Never"),
    ({"spec": {"hostname": "h"}}, "spec.hostname", "DNS"),
    ({"spec": {"subdomain": "s"}}, "spec.subdomain", "headless Service"),
    ({"spec": {"enableServiceLinks": True}}, "spec.enableServiceLinks", "VLLM_PORT"),
    ({"metadata": {"labels": {"corefleet.io/fleet": "b"}}}, "metadata.labels[corefleet.io/fleet]", "fleet label"),
    ({"metadata": {"labels": {"app.kubernetes.io/managed-by": "me"}}},
     "metadata.labels[app.kubernetes.io/managed-by]", "fleet label"),
    ({"metadata": {"annotations": {"corefleet.io/spec-hash": "x"}}},
     "metadata.annotations[corefleet.io/spec-hash]", "bookkeeping"),
    ({"spec": {"volumes": [{"name": "ok", "emptyDir": {}}, {"name": "dshm", "emptyDir": {}}]}},
     "spec.volumes[1].name", "volume corefleet adds"),
    ({"spec": {"volumes": [{"name": "models", "emptyDir": {}}]}}, "spec.volumes[0].name", "volume corefleet adds"),
    ({"spec": {"initContainers": [{"name": "engine", "image": "x"}]}}, "spec.initContainers[0].name",
     "corefleet container"),
    ({"spec": {"containers": [{"name": "frontend"}]}}, "spec.containers[0].name", "no frontend container"),
    ({"spec": {"containers": [{"name": "engine", "volumeMounts": [{"name": "home", "mountPath": "/h"}]}]}},
     "spec.containers[0].volumeMounts[0].name", "corefleet mounts itself"),
    ({"spec": {"containers": [{"name": "engine", "volumeMounts": [{"name": "x", "mountPath": "/dev/shm"}]}]}},
     "spec.containers[0].volumeMounts[0].mountPath", "where corefleet mounts"),
    ({"spec": {"containers": [{"name": "engine", "env": [{"name": "POD_IP", "value": "x"}]}]}},
     "spec.containers[0].env[0].name", "set by corefleet"),
    ({"spec": {"containers": [{"name": "engine", "env": [{"name": "HOME", "value": "/root"}]}]}},
     "spec.containers[0].env[0].name", "set by corefleet"),
    ({"spec": {"hostNetwork": True}}, "spec.hostNetwork", "unknown field"),  # undeclared: refused, never dropped
])
def test_owned_pod_fields_labels_and_names_are_refused(template: dict[str, Any], path: str, text: str) -> None:
    e = _refusal(make_ecs("a").pod_template("engine", template))
    assert e.path == f"spec.engine.podTemplate.{path}"
    assert text in e.message


def test_a_mount_at_the_storage_path_is_refused() -> None:
    template = {"spec": {"containers": [{"name": "frontend", "volumeMounts": [{"name": "x", "mountPath": "/w/"}]}]}}
    e = _refusal(make_ecs("a").storage(pvc={"claimName": "c"}, mountPath="/w").pod_template("frontend", template))
    assert e.path == "spec.frontend.podTemplate.spec.containers[0].volumeMounts[0].mountPath"


@pytest.mark.parametrize(("field", "key"), [("labels", "corefleet.io/role"), ("labels", "app.kubernetes.io/managed-by"),
                                            ("annotations", "corefleet.io/x")])
def test_the_frontend_service_keeps_the_fleet_labels(field: str, key: str) -> None:
    e = _refusal(make_ecs("a").set(f"frontend.service.{field}", {key: "v"}))
    assert e.path == f"spec.frontend.service.{field}[{key}]"


# ---- pod templates: merged -----------------------------------------------------------------------------
@pytest.mark.parametrize("role", list(ROLES))
def test_a_full_template_reaches_its_roles_pod_and_no_other(role: str) -> None:
    template = full_pod_template(ROLES[role])

    def scheduled() -> EcsFactory:
        return make_ecs("a").set("scheduling", {"nodeSelector": {"pool": "p"}, "tolerations": [
            {"key": "k", "operator": "Exists"}], "affinity": {"podAffinity": {}}})

    plain = _pods(scheduled())
    pods = _pods(scheduled().pod_template(role, template))
    pod, spec = pods[role], pods[role]["spec"]
    t = template["spec"]
    for key in ("imagePullSecrets", "serviceAccountName", "automountServiceAccountToken", "runtimeClassName",
                "topologySpreadConstraints", "initContainers", "terminationGracePeriodSeconds", "dnsPolicy",
                "dnsConfig", "hostAliases", "affinity", "priorityClassName"):
        assert spec[key] == t[key], key
    assert spec["nodeSelector"] == {"pool": "p", **t["nodeSelector"]}
    assert spec["tolerations"] == [{"key": "k", "operator": "Exists"}, *t["tolerations"]]
    assert spec["volumes"][-2:] == t["volumes"]
    assert spec["securityContext"] == {**builders.pod_security_context(), **t["securityContext"]}
    assert pod["metadata"]["labels"].items() >= template["metadata"]["labels"].items()
    assert pod["metadata"]["annotations"].items() >= template["metadata"]["annotations"].items()
    main, given = _main(pod), t["containers"][0]
    assert main["env"][-1] == given["env"][0]
    assert main["env"][:-1] == _main(plain[role])["env"]
    assert main["volumeMounts"] == [*_main(plain[role])["volumeMounts"], *given["volumeMounts"]]
    for key in ("envFrom", "imagePullPolicy", "workingDir"):
        assert main[key] == given[key]
    assert spec["containers"][1:] == t["containers"][1:]  # the sidecar, after corefleet's container
    for key in ("command", "args", "ports", "image", "resources"):
        assert main.get(key) == _main(plain[role]).get(key), key
    assert spec["restartPolicy"] == "Never"
    for other in set(ROLES) - {role}:
        assert pods[other]["spec"] == plain[other]["spec"]  # as before (only the hash annotation differs)


def test_merging_never_mutates_the_spec() -> None:
    fleet = make_ecs("a").pod_template("engine", full_pod_template("engine")).storage(hub={}).obj()
    before = copy.deepcopy(fleet.spec)
    pods = builders.fleet_children(fleet, dp_size=2, admin_token="t")
    for pod in pods:
        for c in pod.get("spec", {}).get("containers", []):
            c.setdefault("env", []).append({"name": "SCRIBBLE"})
            c.setdefault("volumeMounts", []).append({"name": "SCRIBBLE"})
        pod.get("spec", {}).get("volumes", []).append({"name": "SCRIBBLE"})
    assert fleet.spec == before
    assert "SCRIBBLE" not in str(builders.engine_pod(fleet, 0, dp_size=2, frontend_address="f"))


def test_the_frontend_service_carries_the_users_labels_and_annotations() -> None:
    svc = builders.frontend_service(make_ecs("a").set("frontend.service", {
        "annotations": {"lb": "internal"}, "labels": {"team": "t"}}).obj())
    assert svc["metadata"]["annotations"] == {"lb": "internal"}
    assert svc["metadata"]["labels"] == {"team": "t", **builders._labels(make_ecs("a").obj())}


def test_a_full_spec_round_trips_through_its_json() -> None:
    f = make_ecs("a").storage(hub={"cache": {"claimName": "c"}, "tokenSecret": {"name": "t"}})
    for role, container in ROLES.items():
        f.pod_template(role, full_pod_template(container))
    spec = f.obj().spec
    assert EngineCoreSetSpec.parse(to_json(spec)) == spec
