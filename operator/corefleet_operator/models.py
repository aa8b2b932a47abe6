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
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar, get_args, get_origin

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


_QUANTITY: JSON = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}

K8S_SCHEMAS: dict[type, JSON] = {
    K8s.Resources: {
        "type": "object",
        "properties": {
            "limits": {"type": "object", "additionalProperties": _QUANTITY},
            "requests": {"type": "object", "additionalProperties": _QUANTITY},
        },
    },
    K8s.EnvList: {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "value": {"type": "string"},
                "valueFrom": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            },
        },
    },
    K8s.Tolerations: {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "key": {"type": "string"},
                "operator": {"type": "string", "enum": ["Exists", "Equal"]},
                "value": {"type": "string"},
                "effect": {"type": "string", "enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]},
                "tolerationSeconds": {"type": "integer", "format": "int64"},
            },
        },
    },
    K8s.Affinity: {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
}


# ---- spec -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineSpec:
    tensorParallelSize: int = field(default=1, metadata=meta(
        "GPUs per data-parallel rank (vLLM --tensor-parallel-size); each rank's pod requests this many "
        "nvidia.com/gpu.", minimum=1, maximum=16))
    args: tuple[str, ...] = field(default=(), metadata=meta(
        "Extra vLLM engine flags, appended after corefleet's own; identical on every rank."))
    env: K8s.EnvList = field(default_factory=K8s.EnvList, metadata=meta(
        "Extra environment variables of every engine container."))
    resources: K8s.Resources = field(default_factory=K8s.Resources, metadata=meta(
        "Resources of each engine container besides the GPUs (nvidia.com/gpu is set from "
        "tensorParallelSize). Unless a cpu request or limit is set here, the container requests "
        "1 + tensorParallelSize CPUs (the engine core's busy loop and one per worker); no CPU limit."))
    loadFormat: str = field(default="auto", metadata=meta(
        "vLLM --load-format (e.g. auto, safetensors, dummy for tests).", minLength=1))
    shmSize: str = field(default="16Gi", metadata=meta(
        "Size of the /dev/shm memory volume of each engine pod.", pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti)?$"))


@dataclass(frozen=True)
class ServiceSpec:
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = field(default="ClusterIP", metadata=meta(
        "Type of the Service in front of the frontend."))


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


@dataclass(frozen=True)
class CoordinatorSpec:
    resources: K8s.Resources = field(default_factory=K8s.Resources, metadata=meta(
        "Resources of the coordinator container. Unless set here (a request or a limit), it "
        "requests cpu 250m and memory 1Gi."))


@dataclass(frozen=True)
class SchedulingSpec:
    nodeSelector: Mapping[str, str] = field(default_factory=dict, metadata=meta(
        "Node selector of every fleet pod."))
    tolerations: K8s.Tolerations = field(default_factory=K8s.Tolerations, metadata=meta(
        "Tolerations of every fleet pod."))
    affinity: K8s.Affinity = field(default_factory=K8s.Affinity, metadata=meta(
        "Affinity of every fleet pod."))
    priorityClassName: str = field(default="", metadata=meta("PriorityClass of every fleet pod."))
    schedulerName: str = field(default="", metadata=meta("Scheduler of every fleet pod (default scheduler if empty)."))


@dataclass(frozen=True)
class ScalingSpec:
    drainTimeoutSeconds: int = field(default=120, metadata=meta(
        "How long a retiring rank may keep serving its in-flight requests during a scale-down.",
        minimum=0, maximum=86400))
    readyTimeoutSeconds: int = field(default=1800, metadata=meta(
        "How long a new rank may take to load its model and join the fleet.", minimum=30, maximum=86400))


@dataclass(frozen=True)
class EngineCoreSetSpec:
    model: str = field(metadata=meta(
        "Model served by every rank (a Hugging Face id or a path inside the image).", minLength=1))
    image: str = field(metadata=meta("Container image with vLLM 0.32.0 and corefleet's runtime.", minLength=1))
    replicas: int = field(default=1, metadata=meta(
        "Number of data-parallel ranks (engine pods). Changing it resizes the running fleet.",
        minimum=0))
    maxReplicas: int | None = field(default=None, metadata=meta(
        "Elastic headroom: the largest number of ranks the fleet may grow to without a restart "
        "(vLLM --elastic-ep-max-dp-size). Defaults to replicas.", minimum=1))
    expertParallel: bool = field(default=False, metadata=meta(
        "MoE model with elastic expert parallelism (needs GPUs, NCCL and EPLB). If false, ranks are "
        "independent dense engines and a resize is a membership change."))
    engine: EngineSpec = field(default_factory=EngineSpec, metadata=meta("The engine pods."))
    frontend: FrontendSpec = field(default_factory=FrontendSpec, metadata=meta("The frontend pod."))
    coordinator: CoordinatorSpec = field(default_factory=CoordinatorSpec, metadata=meta("The coordinator pod."))
    scheduling: SchedulingSpec = field(default_factory=SchedulingSpec, metadata=meta(
        "Placement of every fleet pod."))
    scaling: ScalingSpec = field(default_factory=ScalingSpec, metadata=meta("Resize timeouts."))
    networkPolicy: bool = field(default=False, metadata=meta(
        "Create a NetworkPolicy that lets fleet pods reach each other on any TCP port (vLLM's data-plane "
        "ports are ephemeral), lets anyone reach the frontend's HTTP port, and only the operator its admin "
        "port."))

    # CEL rules the API server checks (rule, message); generated into the CRD.
    CEL_RULES: ClassVar[tuple[tuple[str, str], ...]] = (
        ("!has(self.maxReplicas) || self.replicas <= self.maxReplicas",
         "replicas must not exceed maxReplicas"),
        ("!(self.frontend.port in [8001, 29550])",
         "frontend.port must not be 8001 or 29550: they carry the fleet's admin and handshake traffic"),
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
        parsed: EngineCoreSetSpec = _parse(cls, spec, "spec")
        parsed.validate()
        return parsed

    def validate(self) -> None:
        """Semantic checks the schema cannot express; raises SpecError with the field's path."""
        if self.maxReplicas is not None and self.replicas > self.maxReplicas:
            raise SpecError("spec.replicas", f"{self.replicas} exceeds maxReplicas {self.maxReplicas}")
        reserved = _reserved_flag(self.engine.args)
        if reserved:
            raise SpecError("spec.engine.args", f"{reserved} is set by corefleet and cannot be overridden")
        if self.frontend.port in RESERVED_PORTS:
            raise SpecError("spec.frontend.port", f"port {self.frontend.port} is reserved for fleet traffic")
        for i, var in enumerate(self.engine.env):
            if var.get("name") in RESERVED_ENV:
                raise SpecError(f"spec.engine.env[{i}].name", f"{var['name']} is set by corefleet")


@dataclass(frozen=True)
class FleetRef:
    """An EngineCoreSet as the builders and the planner see it: identity plus the parsed spec."""

    name: str
    namespace: str
    uid: str
    spec: EngineCoreSetSpec


# vLLM flags corefleet sets per rank; a user value would break the fleet's wiring.
RESERVED_FLAGS = (
    "--data-parallel-size", "-dp", "--data-parallel-size-local", "-dpl", "--data-parallel-rank", "-dpn",
    "--data-parallel-start-rank", "-dpr", "--data-parallel-address", "-dpa", "--data-parallel-rpc-port",
    "-dpp", "--headless", "--tensor-parallel-size", "-tp", "--port", "--host", "--elastic-ep-max-dp-size",
    "--enable-elastic-ep", "--api-server-count", "--load-format", "--enable-expert-parallel", "-ep",
    "--enable-eplb", "--data-parallel-backend", "-dpb", "--data-parallel-hybrid-lb", "--data-parallel-external-lb",
    "--nnodes", "--node-rank", "--master-addr", "--model", "--health-port", "--",
)
RESERVED_ENV = ("POD_IP", "POD_NAME", "POD_NAMESPACE", "VLLM_ELASTIC_EP_SCALE_UP_LAUNCH")
RESERVED_PORTS = (8001, 29550)


def _reserved_flag(args: tuple[str, ...]) -> str | None:
    for a in args:
        flag = a.split("=", 1)[0]
        if flag in RESERVED_FLAGS:
            return flag
    return None


# ---- status -----------------------------------------------------------------------------------
RankPhase = Literal["Pending", "Joining", "Serving", "Draining", "Retired", "Failed"]
FleetPhase = Literal["Pending", "Starting", "Running", "Restarting", "Scaling", "Recovering", "Stopped", "Degraded",
                     "Failed"]
OperationPhase = Literal["Pending", "Preparing", "Draining", "Committing", "Completed", "Failed"]
OPERATION_DONE: tuple[OperationPhase, ...] = ("Completed", "Failed")


@dataclass(frozen=True)
class Condition:
    """metav1.Condition."""

    type: str = field(metadata=meta("Condition type (Available, Progressing, Scaling, Degraded)."))
    status: Literal["True", "False", "Unknown"] = field(metadata=meta("Condition status."))
    reason: str = field(metadata=meta("CamelCase reason.", pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"))
    lastTransitionTime: str = field(metadata=meta("When the status last flipped.", format="date-time"))
    message: str = field(default="", metadata=meta("Human-readable details."))
    observedGeneration: int = field(default=0, metadata=meta("Generation the condition was computed for.",
                                                             minimum=0))


@dataclass(frozen=True)
class RankStatus:
    rank: int = field(metadata=meta("Data-parallel rank.", minimum=0))
    pod: str = field(metadata=meta("Pod running the rank."))
    phase: RankPhase = field(metadata=meta("Where the rank is in its life."))
    message: str = field(default="", metadata=meta("Why, when not Serving."))


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
    message: str = field(default="", metadata=meta("What it is doing, or why it failed."))
    fleetGeneration: int = field(default=0, metadata=meta("The incarnation of the fleet it resized.", minimum=0))

    @property
    def done(self) -> bool:
        return self.phase in OPERATION_DONE

    @property
    def scale_up(self) -> bool:
        return self.toReplicas > self.fromReplicas


@dataclass(frozen=True)
class EngineCoreSetStatus:
    observedGeneration: int = field(default=0, metadata=meta("Generation last reconciled.", minimum=0))
    replicas: int = field(default=0, metadata=meta(
        "Committed data-parallel size: the ranks the fleet serves with once no resize runs.", minimum=0))
    readyReplicas: int = field(default=0, metadata=meta("Ranks serving.", minimum=0))
    selector: str = field(default="", metadata=meta("Label selector of the engine pods (scale subresource)."))
    phase: FleetPhase = field(default="Pending", metadata=meta("Summary of the fleet's state."))
    conditions: tuple[Condition, ...] = field(default=(), metadata=meta("Latest observations."))
    ranks: tuple[RankStatus, ...] = field(default=(), metadata=meta("Per-rank state."))
    operation: OperationStatus | None = field(default=None, metadata=meta(
        "The resize in flight, else the last one (with its outcome)."))
    recoveries: int = field(default=0, metadata=meta(
        "How many times the fleet was recreated after losing a rank.", minimum=0))
    fleetGeneration: int = field(default=0, metadata=meta(
        "Incarnation of the fleet: goes up each time all its pods are recreated (a spec change that "
        "needs identical ranks, or a recovery). Every fleet pod carries the incarnation it belongs to.",
        minimum=0))
    endpoint: str = field(default="", metadata=meta("The OpenAI-compatible endpoint (Service URL)."))

    @classmethod
    def parse(cls, status: Mapping[str, Any] | None) -> EngineCoreSetStatus:
        """Parse a stored status; unknown or broken content reads as an empty status."""
        try:
            parsed: EngineCoreSetStatus = _parse(cls, status or {}, "status")
            return parsed
        except SpecError:
            return cls()

    def to_json(self) -> JSON:
        out: JSON = to_json(self)
        return out


# ---- generic parsing and serialisation --------------------------------------------------------
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _parse(tp: Any, value: Any, path: str) -> Any:
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
                kwargs[f.name] = _parse(hints[f.name], value[f.name], f"{path}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SpecError(f"{path}.{f.name}", "is required")
        return tp(**kwargs)
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return _parse(inner[0], value, path)
    if origin is Literal:
        if value not in get_args(tp):
            raise SpecError(path, f"must be one of {', '.join(map(str, get_args(tp)))}, not {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise SpecError(path, "must be a list")
        item = get_args(tp)[0]
        return tuple(_parse(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is Mapping or tp is Mapping:
        if not isinstance(value, Mapping) or not all(isinstance(v, str) for v in value.values()):
            raise SpecError(path, "must be a map of strings")
        return dict(value)
    if isinstance(tp, type) and tp in K8S_SCHEMAS:
        base = dict if issubclass(tp, dict) else list
        if not isinstance(value, base):
            raise SpecError(path, f"must be {'an object' if base is dict else 'a list'}")
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
