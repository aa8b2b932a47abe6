# SPDX-License-Identifier: Apache-2.0
"""The EngineCoreSet API (`corefleet.io/v1alpha1`) as typed, frozen models: the one source of truth.

The CRD's OpenAPI schema is generated from these classes (`corefleet_operator.crd`), and the
operator parses each object's spec into them at the edge (`EngineCoreSetSpec.parse`), so builders
and the planner work on typed values only. Field names are the API's camelCase names.

Kubernetes types we pass through unchanged (resources, env, tolerations, affinity) are kept as
plain mappings and described in the schema by `k8s_schema` with the fields users set most; the API
server validates them again when the pods are created.

Pure module: no kopf, no Kubernetes client, no I/O.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NamedTuple, TypeVar, get_args, get_origin

from corefleet_operator import constants as C

JSON = dict[str, Any]
T = TypeVar("T")


class SpecError(ValueError):
    """A spec the schema let through but corefleet cannot run; `path` names the field."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


def meta(description: str, **schema: Any) -> dict[str, Any]:
    """Field metadata: its description plus extra OpenAPI keywords (minimum, pattern, ...)."""
    return {"description": description, "schema": schema}


# ---- pass-through Kubernetes shapes -----------------------------------------------------------
class K8s:
    """Marker types for Kubernetes objects kept as plain JSON (schema in `k8s_schema`)."""

    class Resources(dict[str, Any]):
        pass

    class EnvList(list[dict[str, Any]]):
        pass

    class Tolerations(list[dict[str, Any]]):
        pass

    class Affinity(dict[str, Any]):
        pass

    class Object(dict[str, Any]):
        """Any Kubernetes object shape (securityContext, a probe, dnsConfig, ...), kept as given."""

    class ObjectList(list[dict[str, Any]]):
        """A list of Kubernetes objects (imagePullSecrets, topologySpreadConstraints, ports, ...)."""

    class Volumes(list[dict[str, Any]]):
        """Pod volumes: each named, the rest of its shape kept as given."""

    class VolumeMounts(list[dict[str, Any]]):
        """A container's volume mounts: each names its volume and path, the rest kept as given."""

    class Containers(list[dict[str, Any]]):
        """Init containers: each named, the rest of its shape kept as given."""


_QUANTITY: JSON = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True,
                   "maxLength": 64}
_RESOURCE_MAP: JSON = {"type": "object", "maxProperties": C.MAX_LIST_ITEMS, "additionalProperties": _QUANTITY}
_NAME: JSON = {"type": "string", "maxLength": C.MAX_NAME_LENGTH}


def _ref(*fields: str, **extra: JSON) -> JSON:
    """An env `valueFrom` source: string fields of bounded length, and `optional`."""
    props: JSON = {f: _NAME for f in fields}
    props.update(extra)
    return {"type": "object", "properties": {**props, "optional": {"type": "boolean"}}}

K8S_SCHEMAS: dict[type, JSON] = {
    K8s.Resources: {
        "type": "object",
        "properties": {"limits": _RESOURCE_MAP, "requests": _RESOURCE_MAP},
    },
    K8s.EnvList: {
        "type": "array",
        "maxItems": C.MAX_ENV_VARS,
        "items": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": C.MAX_ENV_NAME_LENGTH},
                "value": {"type": "string", "maxLength": C.MAX_ENV_VALUE_LENGTH},
                # corev1.EnvVarSource, typed so that every string in it is bounded.
                "valueFrom": {
                    "type": "object",
                    "maxProperties": 1,
                    "properties": {
                        "configMapKeyRef": _ref("name", "key"),
                        "secretKeyRef": _ref("name", "key"),
                        "fieldRef": _ref("apiVersion", "fieldPath"),
                        "resourceFieldRef": _ref("containerName", "resource", divisor=_QUANTITY),
                        "fileKeyRef": _ref("volumeName", "path", "key"),
                    },
                },
            },
        },
    },
    K8s.Tolerations: {
        "type": "array",
        "maxItems": C.MAX_LIST_ITEMS,
        "items": {
            "type": "object",
            "properties": {
                "key": {"type": "string", "maxLength": C.MAX_NAME_LENGTH},
                "operator": {"type": "string", "enum": ["Exists", "Equal"]},
                "value": {"type": "string", "maxLength": C.MAX_NAME_LENGTH},
                "effect": {"type": "string", "enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]},
                "tolerationSeconds": {"type": "integer", "format": "int64"},
            },
        },
    },
    K8s.Affinity: {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    K8s.Object: {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    K8s.ObjectList: {"type": "array", "maxItems": C.MAX_LIST_ITEMS,
                     "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
    K8s.Volumes: {"type": "array", "maxItems": C.MAX_TEMPLATE_VOLUMES, "items": {
        "type": "object", "required": ["name"], "x-kubernetes-preserve-unknown-fields": True,
        "properties": {"name": {"type": "string", "maxLength": C.MAX_LABEL_VALUE_LENGTH}}}},
    K8s.VolumeMounts: {"type": "array", "maxItems": C.MAX_TEMPLATE_VOLUMES, "items": {
        "type": "object", "required": ["name", "mountPath"], "x-kubernetes-preserve-unknown-fields": True,
        "properties": {"name": {"type": "string", "maxLength": C.MAX_LABEL_VALUE_LENGTH},
                       "mountPath": {"type": "string", "maxLength": C.MAX_STRING_LENGTH}}}},
    K8s.Containers: {"type": "array", "maxItems": C.MAX_TEMPLATE_CONTAINERS, "items": {
        "type": "object", "required": ["name"], "x-kubernetes-preserve-unknown-fields": True,
        "properties": {"name": {"type": "string", "maxLength": C.MAX_LABEL_VALUE_LENGTH}}}},
}


# ---- vLLM flags in spec.engine.args that corefleet sets itself -----------------------------------
# The lists are constants.ENGINE_*_FLAGS. `engine_args_problem` is the operator's complete check (it
# knows vLLM's spellings: underscores, abbreviations, glued short values); the CEL rules below refuse
# at admission what a CEL expression can see within the API server's cost budget (exact spellings,
# `=` and two-item values). CEL never refuses what `engine_args_problem` accepts.
_OWNED_FLAGS = frozenset((*C.ENGINE_WIRING_FLAGS, *C.ENGINE_MOE_FLAGS, *C.ENGINE_MOE_NEGATIONS,
                          *C.ENGINE_TENSOR_PARALLEL_FLAGS, *C.ENGINE_LOAD_FORMAT_FLAGS))
_OWNED_LONG_FLAGS = tuple(sorted(f for f in _OWNED_FLAGS if f.startswith("--") and f != "--"))


def _flag_of(arg: str) -> tuple[str, str | None]:
    """(flag, value given in the same item) of an argument that starts with `-`, as vLLM reads it."""
    if arg.startswith("--"):
        key, eq, value = arg.partition("=")
        head, dot, tail = key.partition(".")  # vLLM: underscores are dashes in the name, up to a '.'
        return head.replace("_", "-") + dot + tail, (value if eq else None)
    for short in C.ENGINE_GLUED_SHORT_FLAGS:
        if arg.startswith(short) and arg != short:
            return short, arg[len(short):].removeprefix("=")
    key, eq, value = arg.partition("=")
    return key, (value if eq else None)


def engine_args_problem(args: Sequence[str], *, expert_parallel: bool, tensor_parallel_size: int,
                        load_format: str) -> tuple[int, str] | None:
    """The first item of `args` that conflicts with what corefleet sets, as (index, why); None if none.

    A flag corefleet sets is accepted where it agrees with the spec (the same value, or a MoE switch on
    an expertParallel fleet); wiring flags are refused whatever their value."""
    valued = {**dict.fromkeys(C.ENGINE_TENSOR_PARALLEL_FLAGS, ("engine.tensorParallelSize",
                                                               str(tensor_parallel_size))),
              **dict.fromkeys(C.ENGINE_LOAD_FORMAT_FLAGS, ("engine.loadFormat", load_format))}
    for i, arg in enumerate(args):
        if not arg.startswith("-"):
            continue
        flag, value = _flag_of(arg)
        if flag not in _OWNED_FLAGS and flag.startswith("--") and len(flag) > 2 and "." not in flag:
            meant = [f for f in _OWNED_LONG_FLAGS if f.startswith(flag)]
            if meant:
                return i, (f"{arg} abbreviates {' or '.join(meant)} (vLLM accepts abbreviations), which "
                           "corefleet sets: write the flag in full, where it may agree with the spec")
        if flag in C.ENGINE_WIRING_FLAGS or flag.startswith(C.ENGINE_WIRING_FLAG_PREFIXES):
            return i, f"{flag} is set by corefleet and cannot be overridden"
        if flag in C.ENGINE_MOE_FLAGS or flag in C.ENGINE_MOE_NEGATIONS:
            if value is not None:
                return i, f"{flag} takes no value"
            if flag in C.ENGINE_MOE_FLAGS and not expert_parallel:
                return i, (f"{flag} is set by corefleet on expertParallel fleets only: this fleet is dense "
                           "(expertParallel: false)")
            if flag in C.ENGINE_MOE_NEGATIONS and expert_parallel:
                return i, f"{flag} conflicts with expertParallel: true (corefleet sets {flag.replace('--no-', '--')})"
        if flag in valued:
            source, want = valued[flag]
            if value is None:
                value = args[i + 1] if i + 1 < len(args) else ""
            if value != want:
                return i, (f"{flag} {value!r} disagrees with {source} {want!r}, which corefleet sets it to: "
                           f"set {source} instead")
    return None


def _cel_list(items: Sequence[str]) -> str:
    return "[" + ", ".join(f"'{x}'" for x in items) + "]"


def _cel_str(text: str) -> str:
    """A CEL string literal of `text`."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _cel_flag(arg: str) -> str:
    """CEL: the flag name of item `arg` with underscores as dashes (the value after `=` dropped)."""
    return f"{arg}.replace('_', '-').split('=', 2)[0]"


def _cel_value(args: str) -> str:
    """CEL, inside `args.exists(i, a, ...)`: the value of flag item `a`, after `=` or the next item."""
    return f"(a.contains('=') ? a.split('=', 2)[1] : (i + 1 < size({args}) ? {args}[i + 1] : ''))"


_CEL_WIRING = (f"a.startsWith('-') && ({_cel_flag('a')} in {_cel_list(C.ENGINE_WIRING_FLAGS)}"
               + "".join(f" || {_cel_flag('a')}.startsWith('{p}')" for p in C.ENGINE_WIRING_FLAG_PREFIXES)
               + " || (!a.startsWith('--') && ("
               + " || ".join(f"a.startsWith('{s}')" for s in C.ENGINE_GLUED_SHORT_FLAGS) + ")))")
_CEL_MOE = f"{_cel_flag('a')} in {_cel_list(C.ENGINE_MOE_FLAGS)}"
_CEL_MOE_NEGATION = f"{_cel_flag('a')} in {_cel_list(C.ENGINE_MOE_NEGATIONS)}"


def _cel_disagrees(flags: Sequence[str], want: str) -> str:
    args = "self.engine.args"
    return (f"!has({args}) || !{args}.exists(i, a, a.startsWith('-') && {_cel_flag('a')} in {_cel_list(flags)} && "
            f"{_cel_value(args)} != {want})")


def _cel_message(args: str, predicate: str, text: str) -> str:
    """A messageExpression naming the first offending item of `args` (`predicate` over `a`)."""
    assert "'" not in text, text  # a CEL string literal
    return f"'engine.args: ' + {args}.filter(a, {predicate})[0] + '{text}'"


# ---- pod templates (spec.<role>.podTemplate) ----------------------------------------------------
# A podTemplate is merged into the pod corefleet builds for its role (builders.merge_template). Fields
# corefleet owns are declared in the schema (a structural schema prunes what it does not declare, and a
# pruned field is no refusal) and refused there by CEL, and again by `template_problem` for objects
# stored before the rules existed.
_CONTAINER_NAMES = _cel_list(C.CONTAINER_NAMES)
_RESERVED_VOLUMES = _cel_list(C.RESERVED_VOLUMES)
_ALLOWED_MAIN_FIELDS = ("env", "envFrom", "volumeMounts", "securityContext", "imagePullPolicy", "workingDir")
# Fields of corefleet's own container a template may not set, and why.
_OWNED_CONTAINER_FIELDS: dict[str, str] = {
    "image": "set spec.image",
    "command": "corefleet runs the fleet process (vLLM flags go in spec.engine.args)",
    "args": "corefleet sets the fleet's wiring (vLLM flags go in spec.engine.args)",
    "ports": "the fleet's ports are fixed by corefleet",
    "startupProbe": "corefleet's probes say when a rank has joined (spec.scaling.readyTimeoutSeconds sizes it)",
    "livenessProbe": "corefleet's probes say when a fleet process is broken",
    "readinessProbe": "corefleet's probes say when a rank serves",
    "lifecycle": "corefleet sets the preStop hook that drains a rank",
    "resources": "set spec.<role>.resources (the GPU count is spec.engine.tensorParallelSize)",
    "resizePolicy": "a fleet container is never resized in place",
    "restartPolicy": "a fleet process is never restarted in place",
    "restartPolicyRules": "a fleet process is never restarted in place",
    "volumeDevices": "not supported on corefleet's container",
    "terminationMessagePath": "not supported on corefleet's container",
    "terminationMessagePolicy": "not supported on corefleet's container",
    "stdin": "not supported on corefleet's container",
    "stdinOnce": "not supported on corefleet's container",
    "tty": "not supported on corefleet's container",
}
_MAIN_CONTAINER_TEXT = (f"a podTemplate container named {', '.join(C.CONTAINER_NAMES[:-1])} or "
                        f"{C.CONTAINER_NAMES[-1]} is merged into corefleet's container and may set only "
                        f"{', '.join(_ALLOWED_MAIN_FIELDS)}")
_OWNED_POD_FIELDS: dict[str, str] = {
    "restartPolicy": "corefleet sets Never: a fleet process that died cannot rejoin",
    "hostname": "corefleet names every pod for the fleet's DNS",
    "subdomain": "corefleet sets the fleet's headless Service",
    "enableServiceLinks": "corefleet sets false (a Service named e.g. vllm would set VLLM_PORT and break vLLM)",
}


def _owned_container_rule(name: str, why: str) -> tuple[str, str, str]:
    return (f"!(self.name in {_CONTAINER_NAMES}) || !has(self.{name})",
            f"{_MAIN_CONTAINER_TEXT}: {name} is refused ({why})",
            "'containers[' + self.name + ']' + " + _cel_str(
                f".{name}: refused on corefleet's container ({why}); it may set only "
                f"{', '.join(_ALLOWED_MAIN_FIELDS)}"))


@dataclass(frozen=True)
class TemplateContainer:
    """A container of a podTemplate: merged into corefleet's when named like it, else a sidecar."""

    name: str = field(metadata=meta(
        f"Container name. Named like corefleet's container of the pod ({', '.join(C.CONTAINER_NAMES)}), it is "
        "merged into it; any other name adds a sidecar.", minLength=1, maxLength=C.MAX_LABEL_VALUE_LENGTH))
    image: str | None = field(default=None, metadata=meta("Sidecars only.", maxLength=C.MAX_STRING_LENGTH))
    command: tuple[str, ...] | None = field(default=None, metadata=meta(
        "Sidecars only.", maxItems=C.MAX_LIST_ITEMS, items={"maxLength": C.MAX_ENGINE_ARG_LENGTH}))
    args: tuple[str, ...] | None = field(default=None, metadata=meta(
        "Sidecars only.", maxItems=C.MAX_ENGINE_ARGS, items={"maxLength": C.MAX_ENGINE_ARG_LENGTH}))
    workingDir: str | None = field(default=None, metadata=meta("Working directory.", maxLength=C.MAX_STRING_LENGTH))
    ports: K8s.ObjectList | None = field(default=None, metadata=meta("Sidecars only."))
    envFrom: K8s.ObjectList | None = field(default=None, metadata=meta("Environment from ConfigMaps and Secrets."))
    env: K8s.EnvList | None = field(default=None, metadata=meta(
        "Environment; on corefleet's container appended after its own (which it may not set again)."))
    resources: K8s.Resources | None = field(default=None, metadata=meta("Sidecars only."))
    resizePolicy: K8s.ObjectList | None = field(default=None, metadata=meta("Sidecars only."))
    restartPolicy: str | None = field(default=None, metadata=meta("Sidecars only.", maxLength=32))
    restartPolicyRules: K8s.ObjectList | None = field(default=None, metadata=meta("Sidecars only."))
    volumeMounts: K8s.VolumeMounts | None = field(default=None, metadata=meta(
        "Volume mounts; on corefleet's container appended after its own (not of corefleet's volumes: "
        f"{', '.join(C.RESERVED_VOLUMES)})."))
    volumeDevices: K8s.ObjectList | None = field(default=None, metadata=meta("Sidecars only."))
    livenessProbe: K8s.Object | None = field(default=None, metadata=meta("Sidecars only."))
    readinessProbe: K8s.Object | None = field(default=None, metadata=meta("Sidecars only."))
    startupProbe: K8s.Object | None = field(default=None, metadata=meta("Sidecars only."))
    lifecycle: K8s.Object | None = field(default=None, metadata=meta("Sidecars only."))
    terminationMessagePath: str | None = field(default=None, metadata=meta("Sidecars only.",
                                                                         maxLength=C.MAX_STRING_LENGTH))
    terminationMessagePolicy: str | None = field(default=None, metadata=meta("Sidecars only.", maxLength=32))
    imagePullPolicy: Literal["Always", "IfNotPresent", "Never"] | None = field(default=None, metadata=meta(
        "Image pull policy (of corefleet's container: of spec.image)."))
    securityContext: K8s.Object | None = field(default=None, metadata=meta(
        "Security context; on corefleet's container merged key by key over corefleet's "
        "(allowPrivilegeEscalation: false, capabilities: {drop: [ALL]})."))
    stdin: bool | None = field(default=None, metadata=meta("Sidecars only."))
    stdinOnce: bool | None = field(default=None, metadata=meta("Sidecars only."))
    tty: bool | None = field(default=None, metadata=meta("Sidecars only."))

    CEL_RULES: ClassVar[tuple[tuple[str, str, str], ...]] = (
        *(_owned_container_rule(name, why) for name, why in _OWNED_CONTAINER_FIELDS.items()),
        (f"!(self.name in {_CONTAINER_NAMES}) || !has(self.volumeMounts) || "
         f"!self.volumeMounts.exists(m, m.name in {_RESERVED_VOLUMES})",
         f"volumeMounts of corefleet's container may not mount corefleet's volumes ({', '.join(C.RESERVED_VOLUMES)}): "
         "it mounts them itself",
         f"'containers[' + self.name + '].volumeMounts: ' + self.volumeMounts.filter(m, m.name in "
         f"{_RESERVED_VOLUMES})[0].name + ' is a volume corefleet mounts itself'"),
    )


_FLEET_LABEL = f"k.startsWith('{C.LABEL_PREFIX}') || k == '{C.LABEL_MANAGED_BY}'"  # CEL, over a key k


@dataclass(frozen=True)
class TemplateMetadata:
    labels: Mapping[str, str] = field(default_factory=dict, metadata=meta(
        f"Extra pod labels; not the fleet's ({C.LABEL_PREFIX}*, {C.LABEL_MANAGED_BY}).",
        maxProperties=C.MAX_METADATA_ENTRIES, additionalProperties={"maxLength": C.MAX_LABEL_VALUE_LENGTH}))
    annotations: Mapping[str, str] = field(default_factory=dict, metadata=meta(
        f"Extra pod annotations; not corefleet's ({C.LABEL_PREFIX}*).",
        maxProperties=C.MAX_METADATA_ENTRIES, additionalProperties={"maxLength": C.MAX_ANNOTATION_VALUE_LENGTH}))

    CEL_RULES: ClassVar[tuple[tuple[str, str, str], ...]] = (
        (f"!has(self.labels) || !self.labels.exists(k, {_FLEET_LABEL})",
         f"labels: {C.LABEL_PREFIX}* and {C.LABEL_MANAGED_BY} are the fleet's labels (its selectors), set by corefleet",
         f"'labels: ' + self.labels.filter(k, {_FLEET_LABEL})[0] + "
         "' is a fleet label (its selectors), set by corefleet'"),
        (f"!has(self.annotations) || !self.annotations.exists(k, k.startsWith('{C.LABEL_PREFIX}'))",
         f"annotations: {C.LABEL_PREFIX}* are corefleet's annotations (the operator's bookkeeping)",
         f"'annotations: ' + self.annotations.filter(k, k.startsWith('{C.LABEL_PREFIX}'))[0] + "
         + _cel_str(" is corefleet's annotation (the operator's bookkeeping)")),
    )


@dataclass(frozen=True)
class TemplatePodSpec:
    imagePullSecrets: K8s.ObjectList | None = field(default=None, metadata=meta("Pull secrets (of spec.image too)."))
    serviceAccountName: str | None = field(default=None, metadata=meta(
        "ServiceAccount of the pod (fleet processes never call the Kubernetes API).", maxLength=C.MAX_NAME_LENGTH))
    automountServiceAccountToken: bool | None = field(default=None, metadata=meta(
        "Mount the ServiceAccount's token (corefleet: false)."))
    runtimeClassName: str | None = field(default=None, metadata=meta(
        "RuntimeClass (GPU runtimes often need one, e.g. nvidia).", maxLength=C.MAX_NAME_LENGTH))
    topologySpreadConstraints: K8s.ObjectList | None = field(default=None, metadata=meta(
        "Topology spread constraints."))
    volumes: K8s.Volumes | None = field(default=None, metadata=meta(
        f"Extra volumes, after corefleet's (not named {', '.join(C.RESERVED_VOLUMES)})."))
    initContainers: K8s.Containers | None = field(default=None, metadata=meta(
        f"Init containers (not named {', '.join(C.CONTAINER_NAMES)})."))
    containers: tuple[TemplateContainer, ...] | None = field(default=None, metadata=meta(
        "Merged into corefleet's container where named like it; every other container is a sidecar, "
        "appended after it.", maxItems=C.MAX_TEMPLATE_CONTAINERS))
    securityContext: K8s.Object | None = field(default=None, metadata=meta(
        f"Pod security context, merged key by key over corefleet's (runAsNonRoot, runAsUser/runAsGroup/fsGroup "
        f"{C.RUNTIME_UID}, seccompProfile RuntimeDefault)."))
    terminationGracePeriodSeconds: int | None = field(default=None, metadata=meta(
        "Grace period of the pod's deletion.", minimum=0, maximum=86400))
    dnsPolicy: Literal["ClusterFirst", "ClusterFirstWithHostNet", "Default", "None"] | None = field(
        default=None, metadata=meta("DNS policy (fleet pods find each other through cluster DNS)."))
    dnsConfig: K8s.Object | None = field(default=None, metadata=meta("DNS configuration."))
    hostAliases: K8s.ObjectList | None = field(default=None, metadata=meta("Extra /etc/hosts entries."))
    nodeSelector: Mapping[str, str] | None = field(default=None, metadata=meta(
        "Merged with spec.scheduling.nodeSelector (this one wins on a key both set).",
        maxProperties=C.MAX_LIST_ITEMS, additionalProperties={"maxLength": C.MAX_NAME_LENGTH}))
    tolerations: K8s.Tolerations | None = field(default=None, metadata=meta(
        "Appended to spec.scheduling.tolerations."))
    affinity: K8s.Affinity | None = field(default=None, metadata=meta(
        "Replaces spec.scheduling.affinity for this role's pods."))
    priorityClassName: str | None = field(default=None, metadata=meta(
        "Replaces spec.scheduling.priorityClassName for this role's pods.", maxLength=C.MAX_NAME_LENGTH))
    restartPolicy: str | None = field(default=None, metadata=meta("Refused: corefleet sets it.", maxLength=32))
    hostname: str | None = field(default=None, metadata=meta("Refused: corefleet sets it.",
                                                             maxLength=C.MAX_LABEL_VALUE_LENGTH))
    subdomain: str | None = field(default=None, metadata=meta("Refused: corefleet sets it.",
                                                              maxLength=C.MAX_LABEL_VALUE_LENGTH))
    enableServiceLinks: bool | None = field(default=None, metadata=meta("Refused: corefleet sets it."))

    CEL_RULES: ClassVar[tuple[tuple[str, str, str], ...]] = (
        *((f"!has(self.{name})", f"{name} is refused: {why}", "") for name, why in _OWNED_POD_FIELDS.items()),
        (f"!has(self.volumes) || !self.volumes.exists(v, v.name in {_RESERVED_VOLUMES})",
         # (no messageExpression naming the item: its estimated cost over unknown-field items is too high)
         f"volumes: {', '.join(C.RESERVED_VOLUMES)} are the names of volumes corefleet adds: rename yours", ""),
        (f"!has(self.initContainers) || !self.initContainers.exists(c, c.name in {_CONTAINER_NAMES})",
         f"initContainers: {', '.join(C.CONTAINER_NAMES)} are the names of corefleet's containers: rename yours",
         ""),
    )


@dataclass(frozen=True)
class PodTemplate:
    metadata: TemplateMetadata = field(default_factory=TemplateMetadata, metadata=meta(
        "Labels and annotations added to the pods."))
    spec: TemplatePodSpec = field(default_factory=TemplatePodSpec, metadata=meta(
        "Pod spec fields merged into what corefleet builds."))


def _template_doc(role: str) -> str:
    return (f"Pod template merged into the {role} pod{'s' if role == 'engine' else ''} corefleet builds: labels, "
            "annotations, imagePullSecrets, serviceAccountName, runtimeClassName, topology spread, volumes, init "
            f"containers, sidecars, env and mounts of corefleet's container (named {role}), security contexts, DNS, "
            "node selector, tolerations, affinity, priority. Fields corefleet owns (its container's command, args, "
            "ports, probes, lifecycle, image, resources; the pod's restartPolicy, hostname, subdomain; the fleet's "
            "labels) are refused.")


def _other_roles_rule(container: str) -> tuple[str, str, str]:
    """CEL on a role's spec: its podTemplate names no other role's container (its pods have none)."""
    others = [n for n in C.CONTAINER_NAMES if n != container]
    path = "self.podTemplate.spec.containers"
    return (f"!has(self.podTemplate) || !has({path}) || !{path}.exists(c, c.name in {_cel_list(others)})",
            f"podTemplate.spec.containers: these pods have no {' or '.join(others)} container (corefleet's "
            f"container here is {container}): rename the sidecar", "")


def template_problem(template: PodTemplate, container: str, path: str, *,
                     reserved_env: Sequence[str], mount_paths: Sequence[str]) -> SpecError | None:
    """What the CEL rules refuse in a role's podTemplate (and what they cannot see: env corefleet sets,
    mount paths it uses), as a SpecError naming the field; None if nothing. `container` is the role's
    container name; `reserved_env` the env it sets; `mount_paths` the paths it mounts there."""
    meta_ = template.metadata
    for key in meta_.labels:
        if key.startswith(C.RESERVED_LABEL_PREFIXES) or key in C.RESERVED_LABELS:
            return SpecError(f"{path}.metadata.labels[{key}]", "a fleet label (its selectors), set by corefleet")
    for key in meta_.annotations:
        if key.startswith(C.RESERVED_ANNOTATION_PREFIXES):
            return SpecError(f"{path}.metadata.annotations[{key}]",
                             "corefleet's annotation (the operator's bookkeeping)")
    spec = template.spec
    for name, why in _OWNED_POD_FIELDS.items():
        if getattr(spec, name) is not None:
            return SpecError(f"{path}.spec.{name}", f"refused: {why}")
    for i, volume in enumerate(spec.volumes or ()):
        if volume.get("name") in C.RESERVED_VOLUMES:
            return SpecError(f"{path}.spec.volumes[{i}].name",
                             f"{volume['name']} is the name of a volume corefleet adds")
    for i, init in enumerate(spec.initContainers or ()):
        if init.get("name") in C.CONTAINER_NAMES:
            return SpecError(f"{path}.spec.initContainers[{i}].name",
                             f"{init['name']} is the name of a corefleet container")
    for i, c in enumerate(spec.containers or ()):
        where = f"{path}.spec.containers[{i}]"
        if c.name not in C.CONTAINER_NAMES:
            continue
        if c.name != container:
            return SpecError(f"{where}.name", f"these pods have no {c.name} container (corefleet's container here "
                                              f"is {container}): rename the sidecar")
        for name, why in _OWNED_CONTAINER_FIELDS.items():
            if getattr(c, name) is not None:
                return SpecError(f"{where}.{name}", f"refused on corefleet's container ({why}); it may set only "
                                                    f"{', '.join(_ALLOWED_MAIN_FIELDS)}")
        for j, var in enumerate(c.env or ()):
            if var.get("name") in reserved_env:
                return SpecError(f"{where}.env[{j}].name", f"{var['name']} is set by corefleet")
        for j, mount in enumerate(c.volumeMounts or ()):
            if mount.get("name") in C.RESERVED_VOLUMES:
                return SpecError(f"{where}.volumeMounts[{j}].name",
                                 f"{mount['name']} is a volume corefleet mounts itself")
            if str(mount.get("mountPath", "")).rstrip("/") in mount_paths:
                return SpecError(f"{where}.volumeMounts[{j}].mountPath",
                                 f"{mount['mountPath']} is where corefleet mounts one of its volumes")
    return None


# ---- model storage (spec.storage) -----------------------------------------------------------------
@dataclass(frozen=True)
class PvcStorage:
    claimName: str = field(metadata=meta("The PersistentVolumeClaim (in the fleet's namespace) holding the weights.",
                                         minLength=1, maxLength=C.MAX_NAME_LENGTH))
    subPath: str = field(default="", metadata=meta(
        "Directory inside the volume mounted at mountPath (the whole volume if empty).",
        maxLength=C.MAX_STRING_LENGTH, pattern=r"^$|^[^/]"))
    readOnly: bool = field(default=True, metadata=meta(
        "Mount it read-only (every rank shares it: a ReadOnlyMany or ReadWriteMany claim, or ReadWriteOnce "
        "with every fleet pod on one node)."))


@dataclass(frozen=True)
class HostPathStorage:
    path: str = field(metadata=meta(
        "A directory on every node that may run a fleet pod (a hostPath volume of type Directory, mounted "
        "read-only). hostPath volumes are refused in namespaces that enforce the baseline or restricted "
        "Pod Security Standard.", minLength=2, maxLength=C.MAX_STRING_LENGTH, pattern=r"^(/[^/]+)+/?$"))


@dataclass(frozen=True)
class ImageStorage:
    reference: str = field(metadata=meta("The OCI image or artifact holding the weights.", minLength=1,
                                         maxLength=C.MAX_STRING_LENGTH))
    pullPolicy: Literal["Always", "IfNotPresent", "Never"] = field(default="IfNotPresent", metadata=meta(
        "When the kubelet pulls it."))


@dataclass(frozen=True)
class ClaimRef:
    claimName: str = field(metadata=meta("A PersistentVolumeClaim in the fleet's namespace.", minLength=1,
                                         maxLength=C.MAX_NAME_LENGTH))


@dataclass(frozen=True)
class SecretKeyRef:
    name: str = field(metadata=meta("A Secret in the fleet's namespace.", minLength=1, maxLength=C.MAX_NAME_LENGTH))
    key: str = field(default="token", metadata=meta("Its key holding the token.", minLength=1,
                                                    maxLength=C.MAX_NAME_LENGTH))


@dataclass(frozen=True)
class HubStorage:
    cache: ClaimRef | None = field(default=None, metadata=meta(
        "A ReadWriteMany claim shared by every pod as the Hugging Face cache (HF_HOME), so the model is "
        "downloaded once; without it each pod downloads into an emptyDir at every start."))
    tokenSecret: SecretKeyRef | None = field(default=None, metadata=meta(
        "The hub token (HF_TOKEN) for gated or private models."))


_STORAGE_SOURCES = ("pvc", "hostPath", "image", "hub")


@dataclass(frozen=True)
class StorageSpec:
    pvc: PvcStorage | None = field(default=None, metadata=meta(
        "Weights on a PersistentVolumeClaim shared read-only by every rank."))
    hostPath: HostPathStorage | None = field(default=None, metadata=meta("Weights in a node-local directory."))
    image: ImageStorage | None = field(default=None, metadata=meta(
        "Weights in an OCI image, mounted as a Kubernetes image volume (read-only). Needs Kubernetes 1.31+ with "
        "the ImageVolume feature gate: alpha in 1.31-1.32, beta but off by default in 1.33-1.34, on by default "
        "from 1.35; and a container runtime that supports it (containerd 2.1+, CRI-O 1.31+)."))
    hub: HubStorage | None = field(default=None, metadata=meta(
        "Weights downloaded from the Hugging Face hub (model stays a hub id) into a cache at mountPath "
        "(HF_HOME)."))
    mountPath: str = field(default=C.DEFAULT_STORAGE_MOUNT_PATH, metadata=meta(
        f"Where the weights are mounted in the engine and frontend containers (not the coordinator's). A "
        f"relative model is read from <mountPath>/<model>, and served under the name in spec.model. Neither "
        f"/ nor one of corefleet's paths ({', '.join(C.RESERVED_MOUNT_PATHS)}).",
        maxLength=256, pattern=r"^(/[^/]+)+$"))

    CEL_RULES: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("[" + ", ".join(f"has(self.{s})" for s in _STORAGE_SOURCES) + "].filter(x, x).size() == 1",
         f"storage: set exactly one of {', '.join(_STORAGE_SOURCES)}", ""),
        (f"!(self.mountPath in {_cel_list(C.RESERVED_MOUNT_PATHS)}) && "
         f"!{_cel_list(C.RESERVED_MOUNT_PATHS)}.exists(p, self.mountPath.startsWith(p + '/')) && "
         "!self.mountPath.split('/').exists(s, s == '..' || s == '.')",
         f"storage.mountPath must not be one of corefleet's paths ({', '.join(C.RESERVED_MOUNT_PATHS)}) or inside "
         "one, nor contain . or .. segments", ""),
    )

    @property
    def source(self) -> str:
        """The source set: pvc, hostPath, image or hub."""
        return next(s for s in _STORAGE_SOURCES if getattr(self, s) is not None)

    @property
    def holds_weights(self) -> bool:
        """The weights are files under mountPath (pvc, hostPath, image), not a hub cache."""
        return self.hub is None


# ---- spec -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineSpec:
    tensorParallelSize: int = field(default=1, metadata=meta(
        "GPUs per data-parallel rank (vLLM --tensor-parallel-size); each rank's pod requests this many "
        "nvidia.com/gpu.", minimum=1, maximum=16))
    args: tuple[str, ...] = field(default=(), metadata=meta(
        "Extra vLLM engine flags, appended after corefleet's own; identical on every rank (and the "
        "frontend). Flags corefleet sets itself are accepted only where they agree with the spec: "
        "--tensor-parallel-size/-tp equal to tensorParallelSize, --load-format equal to loadFormat, "
        "--enable-expert-parallel/-ep, --enable-eplb and --enable-elastic-ep on expertParallel fleets "
        "(their --no- forms on dense ones). The fleet's wiring (--data-parallel-*, --headless, "
        "--api-server-count, --elastic-ep-max-dp-size, --nnodes, --node-rank, --master-addr/-port, "
        "--port, --host, --model) is refused.",
        maxItems=C.MAX_ENGINE_ARGS, items={"maxLength": C.MAX_ENGINE_ARG_LENGTH}))
    env: K8s.EnvList = field(default_factory=K8s.EnvList, metadata=meta(
        "Extra environment variables of every engine container (and the frontend)."))
    resources: K8s.Resources = field(default_factory=K8s.Resources, metadata=meta(
        "Resources of each engine container besides the GPUs (nvidia.com/gpu is set from "
        "tensorParallelSize). Unless a cpu request or limit is set here, the container requests "
        "1 + tensorParallelSize CPUs (the engine core's busy loop and one per worker); no CPU limit."))
    loadFormat: str = field(default="auto", metadata=meta(
        "vLLM --load-format (e.g. auto, safetensors, dummy for tests).", minLength=1, maxLength=64))
    shmSize: str = field(default="16Gi", metadata=meta(
        "Size of the /dev/shm memory volume of each engine pod.", pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti)?$",
        maxLength=32))
    podTemplate: PodTemplate | None = field(default=None, metadata=meta(_template_doc("engine")))

    # CEL rules the API server checks on spec.engine: (rule, message, messageExpression).
    CEL_RULES: ClassVar[tuple[tuple[str, str, str], ...]] = (
        _other_roles_rule(C.CONTAINER_ENGINE),
        (f"!has(self.args) || !self.args.exists(a, {_CEL_WIRING})",
         "engine.args must not set the fleet's wiring (--data-parallel-*, --headless, --api-server-count, "
         "--elastic-ep-max-dp-size, --nnodes, --node-rank, --master-addr, --master-port, --port, --host, "
         "--model): corefleet sets it",
         _cel_message("self.args", _CEL_WIRING,
                      " is set by corefleet (the wiring of the fleet) and cannot be overridden")),
    )


@dataclass(frozen=True)
class ServiceSpec:
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = field(default="ClusterIP", metadata=meta(
        "Type of the Service in front of the frontend."))
    annotations: Mapping[str, str] = field(default_factory=dict, metadata=meta(
        f"Annotations of the Service (a cloud load balancer's settings); not corefleet's ({C.LABEL_PREFIX}*).",
        maxProperties=C.MAX_METADATA_ENTRIES, additionalProperties={"maxLength": C.MAX_ANNOTATION_VALUE_LENGTH}))
    labels: Mapping[str, str] = field(default_factory=dict, metadata=meta(
        f"Extra labels of the Service; not the fleet's ({C.LABEL_PREFIX}*, {C.LABEL_MANAGED_BY}).",
        maxProperties=C.MAX_METADATA_ENTRIES, additionalProperties={"maxLength": C.MAX_LABEL_VALUE_LENGTH}))

    CEL_RULES: ClassVar[tuple[tuple[str, str, str], ...]] = TemplateMetadata.CEL_RULES


@dataclass(frozen=True)
class RoutingSpec:
    policy: Literal["LeastLoaded", "PrefixAffinity"] = field(default="PrefixAffinity", metadata=meta(
        "How a frontend picks the rank for a request not pinned to one. LeastLoaded: vLLM's router (the least "
        "loaded rank, ties rotated). PrefixAffinity: requests whose prompts share their leading prefixTokens go to "
        "one rank, whose prefix cache then holds them (rendezvous hashing, the same on every frontend), and the next "
        "turn of a conversation to the rank of the last; a rank takes them only while its load stays within "
        "loadBoundPercent of the mean, past it they spill to the prefix's next rank. Applies to frontend pods "
        "created after the change: delete a frontend pod to apply it now (it is replaced in place, the engines "
        "serve on)."))
    prefixTokens: int = field(default=C.ROUTING_PREFIX_TOKENS, metadata=meta(
        "PrefixAffinity: how many leading prompt tokens (whole KV blocks) pick a prompt's rank.",
        minimum=1, maximum=1 << 20))
    loadBoundPercent: int = field(default=C.ROUTING_LOAD_BOUND_PERCENT, metadata=meta(
        "PrefixAffinity: the most load a rank takes by affinity, in percent of the mean load over the ranks.",
        minimum=100, maximum=1000))


@dataclass(frozen=True)
class HoldSpec:
    maxRequests: int = field(default=C.HOLD_MAX_REQUESTS, metadata=meta(
        "While no rank takes requests (every rank lost or leaving), how many requests may wait at each frontend for "
        "a rank instead of failing at once; past it a request gets 503 with Retry-After. 0: none waits.",
        minimum=0, maximum=1 << 16))
    timeoutSeconds: int = field(default=C.HOLD_TIMEOUT_SECONDS, metadata=meta(
        "How long such a request waits for a rank before it gets 503 with Retry-After.", minimum=0, maximum=3600))


@dataclass(frozen=True)
class FrontendSpec:
    port: int = field(default=8000, metadata=meta(
        "HTTP port of the OpenAI-compatible API.", minimum=1, maximum=65535))
    resources: K8s.Resources = field(default_factory=K8s.Resources, metadata=meta(
        "Resources of the frontend container. Unless set here (a request or a limit), it requests "
        "cpu 2 and memory 4Gi: the API server is the fleet's bottleneck once engines are fast, and "
        "without a CPU request it is starved on a shared node. No CPU limit by default (throttling "
        "stalls every stream)."))
    service: ServiceSpec = field(default_factory=ServiceSpec, metadata=meta("The frontend Service."))
    routing: RoutingSpec = field(default_factory=RoutingSpec, metadata=meta(
        "How the frontends route requests to the ranks."))
    hold: HoldSpec = field(default_factory=HoldSpec, metadata=meta(
        "Requests held while no rank takes requests (a one-rank fleet's engine being replaced, say): served once a "
        "rank does, or answered 503 with Retry-After past these limits; never dropped silently. Applies to frontend "
        "pods created after the change."))
    podTemplate: PodTemplate | None = field(default=None, metadata=meta(_template_doc("frontend")))
    replicas: int = field(default=1, metadata=meta(
        f"Frontend pods, at most {C.MAX_FRONTENDS}, behind the fleet's Service: each one of vLLM's clients of every "
        "engine (its own sockets and client index), for API throughput beyond one process and so that the loss of "
        "one leaves the endpoint answering. Frontend 0 drives every resize through all of them. Dense fleets only "
        "(vLLM's elastic EP tells only its first client of a resize). The engines learn every frontend's address "
        "when they start, so a change recreates the fleet (every engine restarts). With more than one, a lost "
        "engine rank recreates the fleet instead of being replaced alone.", minimum=1, maximum=C.MAX_FRONTENDS))

    CEL_RULES: ClassVar[tuple[tuple[str, str, str], ...]] = (_other_roles_rule(C.CONTAINER_FRONTEND),)


@dataclass(frozen=True)
class CoordinatorSpec:
    resources: K8s.Resources = field(default_factory=K8s.Resources, metadata=meta(
        "Resources of the coordinator container. Unless set here (a request or a limit), it "
        "requests cpu 250m and memory 1Gi."))
    podTemplate: PodTemplate | None = field(default=None, metadata=meta(_template_doc("coordinator")))

    CEL_RULES: ClassVar[tuple[tuple[str, str, str], ...]] = (_other_roles_rule(C.CONTAINER_COORDINATOR),)


@dataclass(frozen=True)
class SchedulingSpec:
    nodeSelector: Mapping[str, str] = field(default_factory=dict, metadata=meta(
        "Node selector of every fleet pod.", maxProperties=C.MAX_LIST_ITEMS,
        additionalProperties={"maxLength": C.MAX_NAME_LENGTH}))
    tolerations: K8s.Tolerations = field(default_factory=K8s.Tolerations, metadata=meta(
        "Tolerations of every fleet pod."))
    affinity: K8s.Affinity = field(default_factory=K8s.Affinity, metadata=meta(
        "Affinity of every fleet pod."))
    priorityClassName: str = field(default="", metadata=meta("PriorityClass of every fleet pod.",
                                                             maxLength=C.MAX_NAME_LENGTH))
    schedulerName: str = field(default="", metadata=meta("Scheduler of every fleet pod (default scheduler if empty).",
                                                         maxLength=C.MAX_NAME_LENGTH))


@dataclass(frozen=True)
class ScalingSpec:
    drainTimeoutSeconds: int = field(default=120, metadata=meta(
        "How long a retiring rank may keep serving its in-flight requests during a scale-down.",
        minimum=0, maximum=86400))
    readyTimeoutSeconds: int = field(default=1800, metadata=meta(
        "How long a new rank may take to load its model and join the fleet.", minimum=30, maximum=86400))
    maxRecoveries: int = field(default=5, metadata=meta(
        "How many recoveries in a row (lost pods recreated, with a growing backoff between them) the "
        "fleet may go through before it is given up: phase Failed, reason RecoveriesExhausted, until "
        "its spec changes. A streak ends after 10 minutes Running.", minimum=0, maximum=1000))


@dataclass(frozen=True)
class IdleSpec:
    afterSeconds: int | None = field(default=None, metadata=meta(
        "Go idle after this many seconds with no request in flight or waiting at the frontend: every rank drains, "
        "then the engine pods are deleted (their GPUs given back) while the frontend and coordinator stay, so the "
        "endpoint keeps answering. Unset: the fleet idles only at replicas 0.", minimum=10, maximum=30 * 86400))
    wakeOnRequest: bool = field(default=True, metadata=meta(
        "A request that arrives while the fleet is idle wakes it (new engine pods join in place at the size it "
        "idled at) and is served once they do; it waits at the frontend meanwhile (frontend.hold). Applies while "
        "replicas > 0; at replicas 0 an autoscaler wakes the fleet by raising replicas."))


@dataclass(frozen=True)
class EngineCoreSetSpec:
    model: str = field(metadata=meta(
        "Model served by every rank: a Hugging Face id, or a path inside the image; with spec.storage (pvc, "
        "hostPath, image) a path relative to storage.mountPath (or an absolute path under it), served under "
        "this name.", minLength=1, maxLength=C.MAX_STRING_LENGTH))
    image: str = field(metadata=meta("Container image with vLLM 0.32.0 and corefleet's runtime.", minLength=1,
                                     maxLength=C.MAX_STRING_LENGTH))
    replicas: int = field(default=1, metadata=meta(
        f"Number of data-parallel ranks (engine pods), at most {C.MAX_REPLICAS}. Changing it resizes the "
        "running fleet.", minimum=0, maximum=C.MAX_REPLICAS))
    maxReplicas: int | None = field(default=None, metadata=meta(
        "Elastic headroom: the largest number of ranks the fleet may grow to without a restart "
        f"(vLLM --elastic-ep-max-dp-size), at most {C.MAX_REPLICAS}. Defaults to replicas.",
        minimum=1, maximum=C.MAX_REPLICAS))
    expertParallel: bool = field(default=False, metadata=meta(
        "MoE model with elastic expert parallelism (needs GPUs, NCCL and EPLB). If false, ranks are "
        "independent dense engines and a resize is a membership change."))
    engine: EngineSpec = field(default_factory=EngineSpec, metadata=meta("The engine pods."))
    frontend: FrontendSpec = field(default_factory=FrontendSpec, metadata=meta("The frontend pods."))
    coordinator: CoordinatorSpec = field(default_factory=CoordinatorSpec, metadata=meta("The coordinator pod."))
    scheduling: SchedulingSpec = field(default_factory=SchedulingSpec, metadata=meta(
        "Placement of every fleet pod."))
    scaling: ScalingSpec = field(default_factory=ScalingSpec, metadata=meta("Resize timeouts."))
    storage: StorageSpec | None = field(default=None, metadata=meta(
        "Where the weights come from: exactly one of a PersistentVolumeClaim, a node-local path, an OCI image "
        "volume, or the Hugging Face hub with a shared cache. Mounted at mountPath in every engine and the "
        "frontend (it needs the tokenizer). Without it, model is a hub id or a path inside the image."))
    idle: IdleSpec | None = field(default=None, metadata=meta(
        "Scale to zero: with it, replicas 0 (an HPA at minReplicas 0, KEDA, kubectl scale) makes the fleet idle "
        "instead of stopping it: no engine pod and no GPU, the frontend and coordinator stay, requests wait at the "
        "frontend and wake it. Dense fleets with one frontend only. Without it, replicas 0 stops the whole fleet."))
    networkPolicy: bool = field(default=False, metadata=meta(
        "Create a NetworkPolicy that lets fleet pods reach each other on any TCP port (vLLM's data-plane "
        "ports are ephemeral), lets anyone reach the frontend's HTTP port, and only the operator its admin "
        "port."))

    # CEL rules the API server checks (rule, message, messageExpression or ""); generated into the CRD.
    CEL_RULES: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("!has(self.maxReplicas) || self.replicas <= self.maxReplicas",
         "replicas must not exceed maxReplicas", ""),
        ("!self.expertParallel || self.frontend.replicas == 1",
         "frontend.replicas must be 1 with expertParallel: true: vLLM's elastic EP tells only its first client "
         "(frontend) of a resize, so the others would route to ranks that left", ""),
        ("!has(self.idle) || !self.expertParallel",
         "idle is for dense fleets: an MoE fleet (expertParallel: true) cannot wake in place from zero ranks (vLLM's "
         "elastic EP would need a fresh expert-parallel group): use replicas 0 without idle to stop it", ""),
        ("!has(self.idle) || self.frontend.replicas == 1",
         "idle needs frontend.replicas 1: an idle fleet's requests wait at its one frontend, which wakes it", ""),
        (f"!(self.frontend.port in [{C.FRONTEND_ADMIN_PORT}, {C.DP_RPC_PORT}])",
         f"frontend.port must not be {C.FRONTEND_ADMIN_PORT} or {C.DP_RPC_PORT}: they carry the fleet's admin "
         "and handshake traffic", ""),
        (f"self.expertParallel || !has(self.engine.args) || !self.engine.args.exists(a, {_CEL_MOE})",
         "engine.args: --enable-expert-parallel, -ep, --enable-eplb and --enable-elastic-ep are set by "
         "corefleet on expertParallel fleets only; this fleet is dense (expertParallel: false)",
         _cel_message("self.engine.args", _CEL_MOE, " is set by corefleet on expertParallel fleets only: "
                      "this fleet is dense (expertParallel: false)")),
        (f"!self.expertParallel || !has(self.engine.args) || !self.engine.args.exists(a, {_CEL_MOE_NEGATION})",
         "engine.args: --no-enable-expert-parallel, --no-enable-eplb and --no-enable-elastic-ep conflict with "
         "expertParallel: true",
         _cel_message("self.engine.args", _CEL_MOE_NEGATION, " conflicts with expertParallel: true")),
        (_cel_disagrees(C.ENGINE_TENSOR_PARALLEL_FLAGS, "string(self.engine.tensorParallelSize)"),
         "engine.args: --tensor-parallel-size/-tp must equal engine.tensorParallelSize (corefleet sets it from "
         "there): set engine.tensorParallelSize instead", ""),
        (_cel_disagrees(C.ENGINE_LOAD_FORMAT_FLAGS, "self.engine.loadFormat"),
         "engine.args: --load-format must equal engine.loadFormat (corefleet sets it from there): set "
         "engine.loadFormat instead", ""),
        ("!has(self.storage) || has(self.storage.hub) || !self.model.startsWith('/') || "
         "self.model.startsWith(self.storage.mountPath + '/')",
         "model: an absolute path must lie under storage.mountPath (or write it relative to it)", ""),
        ("!has(self.storage) || has(self.storage.hub) || !self.model.split('/').exists(s, s == '..')",
         "model: a path in storage must not contain .. segments", ""),
    )
    # CEL rules on the whole object (metadata.name becomes part of child names and DNS labels).
    OBJECT_CEL_RULES: ClassVar[tuple[tuple[str, str], ...]] = (
        ("self.metadata.name.size() <= 48 && self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
         "metadata.name must be a DNS label of at most 48 characters starting with a letter: it names the "
         "fleet's Service and its pods' hostnames"),
    )
    # Fields that cannot change in place (CEL transition rules).
    IMMUTABLE: ClassVar[tuple[str, ...]] = ("expertParallel",)

    @property
    def max_replicas(self) -> int:
        return self.maxReplicas if self.maxReplicas is not None else self.replicas

    @classmethod
    def parse(cls, spec: Mapping[str, Any]) -> EngineCoreSetSpec:
        """Parse a spec dict (as stored by the API server) into the model; raises SpecError."""
        parsed: EngineCoreSetSpec = _parse(cls, spec, "spec", strict=True)
        parsed.validate()
        return parsed

    def validate(self) -> None:
        """Semantic checks the schema cannot express; raises SpecError with the field's path."""
        if self.maxReplicas is not None and self.replicas > self.maxReplicas:
            raise SpecError("spec.replicas", f"{self.replicas} exceeds maxReplicas {self.maxReplicas}")
        problem = engine_args_problem(self.engine.args, expert_parallel=self.expertParallel,
                                      tensor_parallel_size=self.engine.tensorParallelSize,
                                      load_format=self.engine.loadFormat)
        if problem is not None:
            raise SpecError(f"spec.engine.args[{problem[0]}]", problem[1])
        if self.frontend.port in RESERVED_PORTS:
            raise SpecError("spec.frontend.port", f"port {self.frontend.port} is reserved for fleet traffic")
        if self.expertParallel and self.frontend.replicas != 1:
            raise SpecError("spec.frontend.replicas", "must be 1 with expertParallel: true (vLLM's elastic EP tells "
                                                      "only its first client of a resize)")
        if self.idle is not None and self.expertParallel:
            raise SpecError("spec.idle", "is for dense fleets: an MoE fleet (expertParallel: true) cannot wake in "
                                         "place from zero ranks")
        if self.idle is not None and self.frontend.replicas != 1:
            raise SpecError("spec.idle", "needs frontend.replicas 1 (an idle fleet's requests wait at its frontend)")
        reserved_env = self.reserved_env
        for i, var in enumerate(self.engine.env):
            if var.get("name") in reserved_env:
                raise SpecError(f"spec.engine.env[{i}].name", f"{var['name']} is set by corefleet")
        storage = self.storage
        if storage is not None:
            self._validate_storage(storage)
        fixed = (C.RUNTIME_HOME, C.ADMIN_TOKEN_DIR, C.SHM_DIR)
        models = (storage.mountPath,) if storage is not None else ()
        for role, container, template, env, paths in (
                ("engine", C.CONTAINER_ENGINE, self.engine.podTemplate, reserved_env, (*fixed, *models)),
                ("frontend", C.CONTAINER_FRONTEND, self.frontend.podTemplate, reserved_env, (*fixed, *models)),
                ("coordinator", C.CONTAINER_COORDINATOR, self.coordinator.podTemplate, RESERVED_ENV, fixed)):
            if template is not None:
                refused = template_problem(template, container, f"spec.{role}.podTemplate", reserved_env=env,
                                           mount_paths=paths)
                if refused is not None:
                    raise refused
        service = self.frontend.service
        for key in service.labels:
            if key.startswith(C.RESERVED_LABEL_PREFIXES) or key in C.RESERVED_LABELS:
                raise SpecError(f"spec.frontend.service.labels[{key}]", "a fleet label, set by corefleet")
        for key in service.annotations:
            if key.startswith(C.RESERVED_ANNOTATION_PREFIXES):
                raise SpecError(f"spec.frontend.service.annotations[{key}]", "corefleet's annotation")

    def _validate_storage(self, storage: StorageSpec) -> None:
        sources = [s for s in _STORAGE_SOURCES if getattr(storage, s) is not None]
        if len(sources) != 1:
            raise SpecError("spec.storage", f"set exactly one of {', '.join(_STORAGE_SOURCES)}"
                                            + (f", not {' and '.join(sources)}" if sources else ""))
        mount = storage.mountPath
        segments = mount.split("/")
        if mount in C.RESERVED_MOUNT_PATHS or any(mount.startswith(p + "/") for p in C.RESERVED_MOUNT_PATHS) \
                or "." in segments or ".." in segments:
            raise SpecError("spec.storage.mountPath", f"{mount} is one of corefleet's paths "
                                                      f"({', '.join(C.RESERVED_MOUNT_PATHS)}), inside one, or has "
                                                      ". or .. segments")
        if storage.holds_weights:
            if self.model.startswith("/") and not self.model.startswith(mount + "/"):
                raise SpecError("spec.model", f"{self.model} is not under storage.mountPath {mount}")
            if ".." in self.model.split("/"):
                raise SpecError("spec.model", "a path in storage must not contain .. segments")

    @property
    def reserved_env(self) -> tuple[str, ...]:
        """Env names corefleet sets in the engine and frontend containers."""
        if self.storage is not None and self.storage.hub is not None:
            return (*RESERVED_ENV, C.ENV_HF_HOME, *((C.ENV_HF_TOKEN,) if self.storage.hub.tokenSecret else ()))
        return tuple(RESERVED_ENV)

    @property
    def model_path(self) -> str:
        """What vLLM's --model gets: spec.model, or with storage holding the weights its path under mountPath."""
        storage = self.storage
        if storage is None or not storage.holds_weights or self.model.startswith("/"):
            return self.model
        return f"{storage.mountPath}/{self.model}"


@dataclass(frozen=True)
class FleetRef:
    """An EngineCoreSet as the builders and the planner see it: identity plus the parsed spec."""

    name: str
    namespace: str
    uid: str
    spec: EngineCoreSetSpec


RESERVED_ENV = C.RESERVED_ENV
RESERVED_PORTS = (C.FRONTEND_ADMIN_PORT, C.DP_RPC_PORT)


# ---- status -----------------------------------------------------------------------------------
RankPhase = Literal["Pending", "Joining", "Serving", "Draining", "Retired", "Failed"]
FleetPhase = Literal["Pending", "Starting", "Running", "Restarting", "Scaling", "Recovering", "Stopped", "Degraded",
                     "Failed", "Idle", "Waking"]
OperationPhase = Literal["Pending", "Preparing", "Draining", "Committing", "Completed", "Failed"]
OPERATION_DONE: tuple[OperationPhase, ...] = ("Completed", "Failed")
# A member: the coordinator or a frontend, by the name its pod has after the fleet's (`coordinator`, `frontend`,
# `frontend-1`, ...: C.frontend_member).
MemberRole = str
MEMBER_ROLES: tuple[MemberRole, ...] = ("coordinator", "frontend")
MEMBER_PATTERN = rf"^(coordinator|frontend(-[1-{C.MAX_FRONTENDS - 1}])?)$"


@dataclass(frozen=True)
class Condition:
    """metav1.Condition."""

    type: str = field(metadata=meta("Condition type (Available, Progressing, Scaling, Degraded)."))
    status: Literal["True", "False", "Unknown"] = field(metadata=meta("Condition status."))
    reason: str = field(metadata=meta("CamelCase reason.", pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"))
    lastTransitionTime: str = field(metadata=meta("When the status last flipped.", format="date-time"))
    message: str = field(default="", metadata=meta(
        f"Human-readable details (at most {C.MAX_STATUS_MESSAGE} characters).", maxLength=C.MAX_STATUS_MESSAGE))
    observedGeneration: int = field(default=0, metadata=meta("Generation the condition was computed for.",
                                                             minimum=0))

    def __post_init__(self) -> None:
        _bound(self, "message", C.MAX_STATUS_MESSAGE)


@dataclass(frozen=True)
class RankStatus:
    rank: int = field(metadata=meta("Data-parallel rank.", minimum=0))
    pod: str = field(metadata=meta("Pod running the rank."))
    phase: RankPhase = field(metadata=meta("Where the rank is in its life."))
    message: str = field(default="", metadata=meta(
        f"Why, when not Serving (at most {C.MAX_RANK_MESSAGE} characters).", maxLength=C.MAX_RANK_MESSAGE))

    def __post_init__(self) -> None:
        _bound(self, "message", C.MAX_RANK_MESSAGE)


@dataclass(frozen=True)
class FrontendStatus:
    pod: str = field(metadata=meta("The frontend's pod (frontend 0 first)."))
    ready: bool = field(default=False, metadata=meta(
        "Ready: in the fleet's Service endpoints (its /health answers: at least one rank serves through it)."))


@dataclass(frozen=True)
class OperationStatus:
    id: str = field(metadata=meta("Identifier of the resize (the frontend's operation id)."))
    fromReplicas: int = field(metadata=meta("Committed size before.", minimum=0))
    toReplicas: int = field(metadata=meta("Target size.", minimum=0))
    phase: OperationPhase = field(metadata=meta(
        "Phase of the resize: Pending (asked of the frontend), Preparing (new ranks join), Draining "
        "(leaving ranks finish their requests), Committing, then Completed or Failed."))
    startedAt: str | None = field(default=None, metadata=meta("When it started.", format="date-time"))
    finishedAt: str | None = field(default=None, metadata=meta("When it completed or failed.", format="date-time"))
    message: str = field(default="", metadata=meta(
        f"What it is doing, or why it failed (at most {C.MAX_STATUS_MESSAGE} characters).",
        maxLength=C.MAX_STATUS_MESSAGE))
    fleetGeneration: int = field(default=0, metadata=meta("The incarnation of the fleet it resized.", minimum=0))
    replace: tuple[int, ...] = field(default=(), metadata=meta(
        "A replacement in place (fromReplicas == toReplicas): the lost ranks of a dense fleet given new pods while "
        "the other ranks serve on; empty for a resize.", maxItems=C.MAX_REPLICAS))
    members: tuple[MemberRole, ...] = field(default=(), metadata=meta(
        "A replacement in place of the fleet's coordinator and/or frontends (their pods' names after the fleet's: "
        "coordinator, frontend, frontend-1, ...; fromReplicas == toReplicas): new pods, the engines serve on; "
        "empty otherwise.", maxItems=1 + C.MAX_FRONTENDS, items={"pattern": MEMBER_PATTERN}))
    detached: tuple[int, ...] = field(default=(), metadata=meta(
        "A replacement of the frontend or coordinator in place that interrupted a replacement of ranks: those ranks. "
        "Their new pods are deleted (a new frontend attaches to the other engines and starts with these Dead), and "
        "they are replaced again once the members serve; empty otherwise.", maxItems=C.MAX_REPLICAS))
    idle: bool = field(default=False, metadata=meta(
        "Going idle (fromReplicas == toReplicas): the frontend drains every rank and releases its engine; the "
        "engine pods are deleted once it has."))
    wake: bool = field(default=False, metadata=meta(
        "A wake (with replace: every rank): an idle fleet's new engine pods join in place."))
    cancelling: str = field(default="", metadata=meta(
        "A replacement of the coordinator in place that interrupted a replacement of ranks (`detached`) that the "
        "frontend, which lives on, still runs: that replacement's id, which the frontend is told to cancel until the "
        "new coordinator serves; empty otherwise.", maxLength=C.MAX_STATUS_MESSAGE))

    def __post_init__(self) -> None:
        _bound(self, "message", C.MAX_STATUS_MESSAGE)

    @property
    def done(self) -> bool:
        return self.phase in OPERATION_DONE

    @property
    def scale_up(self) -> bool:
        return self.toReplicas > self.fromReplicas


IdleCause = Literal["Quiet", "ReplicasZero"]


@dataclass(frozen=True)
class IdleStatus:
    since: str = field(metadata=meta("When the fleet went idle.", format="date-time"))
    cause: IdleCause = field(default="Quiet", metadata=meta(
        "Why: Quiet (spec.idle.afterSeconds without a request; a request wakes it) or ReplicasZero (spec.replicas "
        "0; replicas > 0 wakes it)."))
    wakeFailures: int = field(default=0, metadata=meta("Wakes that failed since it went idle.", minimum=0))
    retryAt: str | None = field(default=None, metadata=meta(
        "After a failed wake: the next wake does not start before this (the recovery backoff).", format="date-time"))
    message: str = field(default="", metadata=meta(
        f"Why the last wake failed (at most {C.MAX_STATUS_MESSAGE} characters).", maxLength=C.MAX_STATUS_MESSAGE))

    def __post_init__(self) -> None:
        _bound(self, "message", C.MAX_STATUS_MESSAGE)


@dataclass(frozen=True)
class RecoveryStatus:
    attempt: int = field(default=0, metadata=meta(
        "Recoveries in the current streak (reset after 10 minutes Running or a spec change).", minimum=0))
    lostAt: str | None = field(default=None, metadata=meta("When the last loss was seen.", format="date-time"))
    reason: str = field(default="", metadata=meta(
        f"What was lost, and why (at most {C.MAX_STATUS_MESSAGE} characters).", maxLength=C.MAX_STATUS_MESSAGE))
    retryAt: str | None = field(default=None, metadata=meta(
        "When the next recovery may start (backoff).", format="date-time"))
    observedGeneration: int = field(default=0, metadata=meta(
        "The spec generation the streak belongs to.", minimum=0))
    members: int = field(default=0, metadata=meta(
        "Frontend or coordinator losses of the streak replaced in place (the engines serving on); a third one "
        "recreates the fleet.", minimum=0))

    def __post_init__(self) -> None:
        _bound(self, "reason", C.MAX_STATUS_MESSAGE)


@dataclass(frozen=True)
class EngineCoreSetStatus:
    observedGeneration: int = field(default=0, metadata=meta("Generation last reconciled.", minimum=0))
    replicas: int = field(default=0, metadata=meta(
        "Committed data-parallel size: the ranks the fleet serves with once no resize runs.", minimum=0))
    readyReplicas: int = field(default=0, metadata=meta("Ranks serving.", minimum=0))
    selector: str = field(default="", metadata=meta("Label selector of the engine pods (scale subresource)."))
    phase: FleetPhase = field(default="Pending", metadata=meta("Summary of the fleet's state."))
    conditions: tuple[Condition, ...] = field(default=(), metadata=meta("Latest observations.",
                                                                        maxItems=C.MAX_CONDITIONS))
    ranks: tuple[RankStatus, ...] = field(default=(), metadata=meta("Per-rank state.", maxItems=C.MAX_REPLICAS))
    operation: OperationStatus | None = field(default=None, metadata=meta(
        "The resize in flight, else the last one (with its outcome)."))
    recoveries: int = field(default=0, metadata=meta(
        "How many times the fleet was recreated after losing a rank.", minimum=0))
    recovery: RecoveryStatus | None = field(default=None, metadata=meta(
        "The current recovery streak: attempts, backoff and the last loss."))
    fleetGeneration: int = field(default=0, metadata=meta(
        "Incarnation of the fleet: goes up each time all its pods are recreated (a spec change that "
        "needs identical ranks, or a recovery). Every fleet pod carries the incarnation it belongs to.",
        minimum=0))
    endpoint: str = field(default="", metadata=meta("The OpenAI-compatible endpoint (Service URL)."))
    frontends: tuple[FrontendStatus, ...] = field(default=(), metadata=meta(
        "The current incarnation's frontend pods (spec.frontend.replicas) and which of them serve.",
        maxItems=C.MAX_FRONTENDS))
    idle: IdleStatus | None = field(default=None, metadata=meta(
        "While the fleet is idle (spec.idle): since when and why; no engine pod runs, replicas is the size it wakes "
        "to."))
    redundantExperts: int | None = field(default=None, metadata=meta(
        "MoE fleets: the redundant experts (vLLM's num_redundant_experts) at the committed size after the last "
        "in-place resize, as the frontend computed them. Elastic EP keeps the physical experts per rank; a "
        "fleet recreated at this size starts with them, so it can resize as before.", minimum=0))

    # What defines the fleet the stored status describes: which incarnation its pods belong to, its
    # committed size, and the resize it may have in flight. Unreadable, nothing may be acted on.
    IDENTITY: ClassVar[tuple[str, ...]] = ("fleetGeneration", "replicas", "operation")

    def __post_init__(self) -> None:
        if len(self.ranks) > C.MAX_REPLICAS:  # only a status stored before the bound existed
            object.__setattr__(self, "ranks", self.ranks[:C.MAX_REPLICAS])
        if len(self.conditions) > C.MAX_CONDITIONS:
            object.__setattr__(self, "conditions", self.conditions[:C.MAX_CONDITIONS])

    @classmethod
    def parse(cls, status: Mapping[str, Any] | None) -> EngineCoreSetStatus:
        """Parse a stored status field by field (see `parse_report`, which callers that act on it use)."""
        return cls.parse_report(status).status

    @classmethod
    def parse_report(cls, status: Any) -> ParsedStatus:
        """Parse a stored status field by field, never into an empty status because one part is broken.

        Unknown fields are ignored at every level (a status written by a newer release, read after a
        rollback). A broken field reads as its default and is named in `problems`; a broken item of a
        list (a condition, a rank) is left out and named. `identity_unreadable` is True when a field of
        `IDENTITY` is present but broken, or missing from a status that is not empty, or the status is
        not an object at all: the caller must then act on nothing and write nothing. An absent or empty
        status (`None`, `{}`) is a new fleet's: no problems.
        """
        if status is None or (isinstance(status, Mapping) and not status):
            return ParsedStatus(cls(), (), False)
        if not isinstance(status, Mapping):
            return ParsedStatus(cls(), (f"status: must be an object, not {type(status).__name__}",), True)
        problems: list[str] = []
        kwargs: dict[str, Any] = {}
        hints = _hints(cls)
        unreadable = False
        for f in dataclasses.fields(cls):
            if status.get(f.name) is None:
                if f.name in cls.IDENTITY and f.name != "operation":
                    problems.append(f"status.{f.name}: missing")
                    unreadable = True
                continue
            try:
                kwargs[f.name] = _parse_lenient(hints[f.name], status[f.name], f"status.{f.name}", problems)
            except SpecError as e:
                problems.append(str(e))
                unreadable = unreadable or f.name in cls.IDENTITY
        return ParsedStatus(cls(**kwargs), tuple(problems), unreadable)

    def to_json(self) -> JSON:
        out: JSON = to_json(self)
        return out


class ParsedStatus(NamedTuple):
    """`EngineCoreSetStatus.parse_report`'s answer: the status, what could not be read, and whether
    the fleet's identity (`EngineCoreSetStatus.IDENTITY`) is among it."""

    status: EngineCoreSetStatus
    problems: tuple[str, ...]
    identity_unreadable: bool


def _bound(obj: Any, name: str, limit: int) -> None:
    """Truncate a frozen dataclass's string field to `limit` characters (status must fit its schema)."""
    value = getattr(obj, name)
    if len(value) > limit:
        object.__setattr__(obj, name, value[:limit - 1] + "\u2026")


# ---- generic parsing and serialisation --------------------------------------------------------
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _parse(tp: Any, value: Any, path: str, *, strict: bool = False) -> Any:
    """`value` as type `tp`; raises SpecError naming the path. `strict` (a spec) also refuses unknown
    fields and values outside the schema's bounds (`meta` keywords and `K8S_SCHEMAS`), as the API
    server does, for objects stored before a bound existed."""
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, Mapping):
            raise SpecError(path, f"must be an object, not {type(value).__name__}")
        hints = _hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise SpecError(f"{path}.{unknown[0]}", "unknown field")
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in value and value[f.name] is not None:
                if strict:
                    _check_bounds(f.metadata.get("schema", {}), value[f.name], f"{path}.{f.name}")
                kwargs[f.name] = _parse(hints[f.name], value[f.name], f"{path}.{f.name}", strict=strict)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SpecError(f"{path}.{f.name}", "is required")
        return tp(**kwargs)
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return _parse(inner[0], value, path, strict=strict)
    if origin is Literal:
        if value not in get_args(tp):
            raise SpecError(path, f"must be one of {', '.join(map(str, get_args(tp)))}, not {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise SpecError(path, "must be a list")
        item = get_args(tp)[0]
        return tuple(_parse(item, v, f"{path}[{i}]", strict=strict) for i, v in enumerate(value))
    if origin is Mapping or tp is Mapping:
        if not isinstance(value, Mapping) or not all(isinstance(v, str) for v in value.values()):
            raise SpecError(path, "must be a map of strings")
        return dict(value)
    if isinstance(tp, type) and tp in K8S_SCHEMAS:
        base = dict if issubclass(tp, dict) else list
        if not isinstance(value, base):
            raise SpecError(path, f"must be {'an object' if base is dict else 'a list'}")
        if strict:
            _check_bounds(K8S_SCHEMAS[tp], value, path)
        return tp(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(path, "must be a boolean")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(path, "must be an integer")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(path, "must be a string")
        return value
    raise TypeError(f"unsupported type {tp!r} at {path}")


def _check_bounds(schema: Mapping[str, Any], value: Any, path: str) -> None:
    """The size bounds of an OpenAPI schema (maximum, minimum, maxLength, maxItems, maxProperties, and
    those of its items and properties) that `value` breaks, as a SpecError. Types are `_parse`'s job."""
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        if "maximum" in schema and value > schema["maximum"]:
            raise SpecError(path, f"{value} exceeds the maximum {schema['maximum']}")
        if "minimum" in schema and value < schema["minimum"]:
            raise SpecError(path, f"{value} is below the minimum {schema['minimum']}")
    elif isinstance(value, str):
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            raise SpecError(path, f"{len(value)} characters exceed the maximum length {schema['maxLength']}")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            raise SpecError(path, f"{value!r} does not match {schema['pattern']}")
    elif isinstance(value, list | tuple):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            raise SpecError(path, f"{len(value)} items exceed the maximum {schema['maxItems']}")
        for i, item in enumerate(value):
            _check_bounds(schema.get("items", {}), item, f"{path}[{i}]")
    elif isinstance(value, Mapping):
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            raise SpecError(path, f"{len(value)} entries exceed the maximum {schema['maxProperties']}")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = props.get(key, extra if isinstance(extra, Mapping) else {})
            _check_bounds(sub, item, f"{path}.{key}")


def _parse_lenient(tp: Any, value: Any, path: str, problems: list[str]) -> Any:
    """`_parse` for a stored status: unknown fields are ignored, a broken optional field reads as its
    default and a broken list item is left out (each named in `problems`); raises SpecError only
    where nothing can stand in (a broken scalar, a required field)."""
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, Mapping):
            raise SpecError(path, f"must be an object, not {type(value).__name__}")
        hints = _hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            sub = f"{path}.{f.name}"
            if value.get(f.name) is None:
                if required:
                    raise SpecError(sub, "is required")
                continue
            try:
                kwargs[f.name] = _parse_lenient(hints[f.name], value[f.name], sub, problems)
            except SpecError as e:
                if required:
                    raise
                problems.append(str(e))
        return tp(**kwargs)
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return _parse_lenient(inner[0], value, path, problems)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise SpecError(path, "must be a list")
        items = []
        for i, v in enumerate(value):
            try:
                items.append(_parse_lenient(get_args(tp)[0], v, f"{path}[{i}]", problems))
            except SpecError as e:
                problems.append(f"{e} (item left out)")
        return tuple(items)
    return _parse(tp, value, path)


def to_json(obj: Any) -> Any:
    """Model → JSON-able value, leaving out None, empty and default-valued optional parts."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if v is None:
                continue
            out[f.name] = to_json(v)
        return out
    if isinstance(obj, tuple | list):
        return [to_json(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_json(v) for k, v in obj.items()}
    return obj
