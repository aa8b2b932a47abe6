# SPDX-License-Identifier: Apache-2.0
"""Manifests of a fleet's children, as pure functions of the typed spec.

Every builder takes a `FleetRef` (identity plus the parsed `EngineCoreSetSpec`) and a few values
the operator decides (the data-parallel size to build for, the fleet's incarnation, whether a pod
joins a running fleet) and returns a plain JSON-able dict: the whole object, ready for server-side
apply. Builders do no I/O, import neither kopf nor a Kubernetes client (import contract in
pyproject.toml) and never mutate their input: every Kubernetes pass-through value from the spec
(resources, env, tolerations, affinity, ...) is deep-copied into plain dicts and lists.

Topology (DESIGN.md §1): one frontend pod (vLLM API server + corefleet's DPLB client + the engines'
handshake ROUTER + the admin API), one coordinator pod (vLLM's DPCoordinator on fixed ports) and one
pod per data-parallel rank (a headless vLLM engine core). All of them are bare pods with
`restartPolicy: Never`: an engine that restarts cannot rejoin the fleet (vllm-protocol.md §0.1.5),
so a lost pod is a fleet recovery, decided by the operator, never a kubelet restart. Every pod gets
a stable DNS name `<pod>.<fleet>-fleet.<ns>.svc` (hostname + subdomain + the headless Service with
`publishNotReadyAddresses`) because ranks must find the frontend before anything is Ready.

Pods carry two annotations the operator compares with what it would build now:
`ANNOTATION_SPEC_HASH` (`fleet_config_hash`: the configuration every rank must share) and
`ANNOTATION_GENERATION` (which incarnation of the fleet the pod belongs to).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from corefleet_client import commands
from corefleet_client.admin import DRAIN_PATH, LIVE_PATH
from corefleet_client.commands import with_redundant_experts
from corefleet_operator import constants
from corefleet_operator.models import JSON, EngineCoreSetSpec, FleetRef, PodTemplate, to_json

# Names inside the pods (constants.py: a podTemplate is checked against them).
ENGINE_CONTAINER = constants.CONTAINER_ENGINE
COORDINATOR_CONTAINER = constants.CONTAINER_COORDINATOR
FRONTEND_CONTAINER = constants.CONTAINER_FRONTEND
SHM_VOLUME = constants.VOLUME_SHM
ADMIN_TOKEN_VOLUME = constants.VOLUME_ADMIN_TOKEN
HOME_VOLUME = constants.VOLUME_HOME
MODELS_VOLUME = constants.VOLUME_MODELS
TERMINATION_GRACE_SECONDS = 30
PROBE_PERIOD_SECONDS = 10  # startup probes: failureThreshold = ceil(readyTimeoutSeconds / period)
PROBE_TIMEOUT_SECONDS = 5

# Port names (IANA_SVC_NAME: at most 15 characters), shared by container ports and Services.
PORT_HTTP = "http"
PORT_ADMIN = "admin"
PORT_RPC = "rpc"
PORT_HEALTH = "health"
PORT_COORD_FRONT_PUBLISH = "coord-front-pub"
PORT_COORD_BACK_OUTPUT = "coord-back-out"
PORT_COORD_BACK_PUBLISH = "coord-back-pub"
PORT_COORD_STORE = "coord-store"
PORT_ENGINE_INPUT = "engine-in"  # the frontend's sockets the engines connect to: requests, outputs
PORT_ENGINE_OUTPUT = "engine-out"

COORDINATOR_PORTS: tuple[tuple[str, int], ...] = (
    (PORT_COORD_FRONT_PUBLISH, constants.COORDINATOR_FRONT_PUBLISH_PORT),
    (PORT_COORD_BACK_OUTPUT, constants.COORDINATOR_BACK_OUTPUT_PORT),
    (PORT_COORD_BACK_PUBLISH, constants.COORDINATOR_BACK_PUBLISH_PORT),
)

# The containers' commands and arguments come from corefleet_client.commands (local mode runs the same).
ALL_INTERFACES = "0.0.0.0"  # a pod's listeners bind its own IP, whatever it is


# ---- the fleet-wide configuration hash ----------------------------------------------------------
def fleet_config_hash(spec: EngineCoreSetSpec) -> str:
    """16 hex digits of sha256 over everything every rank of a fleet must agree on.

    A pod whose annotation differs from the hash of the current spec was built for another
    configuration and cannot join this fleet. The data-parallel size is not part of it: `replicas`
    resizes the fleet in place, and a pod added by a resize carries the size it joined at in its
    arguments while the others keep theirs. Everything else that shapes a fleet pod is (pods cannot
    be changed in place, and a frontend or coordinator is replaced under running engines only with the
    configuration they were built from, `planner.members`):
    their resources and the startup-probe budget (`readyTimeoutSeconds`); for MoE fleets also the
    elastic-EP maximum (`--elastic-ep-max-dp-size`, on every rank); the model storage and each role's
    pod template, where set. The drain timeout, the frontend Service (type, labels, annotations) and the
    NetworkPolicy switch are not: they change no fleet process. Sections added later enter the payload
    only where set, so that a fleet that does not use them keeps its hash across an operator upgrade
    (and is not recreated by it).
    """
    blob = json.dumps(_config_payload(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# The configuration's parts as a user names them (the keys of `_config_payload`).
CONFIG_SECTION_NAMES: Mapping[str, str] = {
    "model": "model", "image": "image", "engine": "engine", "expertParallel": "expertParallel",
    "maxReplicas": "maxReplicas", "scheduling": "scheduling", "frontendPort": "frontend.port",
    "frontendResources": "frontend.resources", "coordinatorResources": "coordinator.resources",
    "readyTimeoutSeconds": "scaling.readyTimeoutSeconds", "storage": "storage",
    "engineTemplate": "engine.podTemplate", "frontendTemplate": "frontend.podTemplate",
    "coordinatorTemplate": "coordinator.podTemplate", "frontendReplicas": "frontend.replicas",
}


def config_sections(spec: EngineCoreSetSpec) -> dict[str, str]:
    """8 hex digits of sha256 of each part of `fleet_config_hash`'s payload (absent optional parts left out): pods
    carry them (ANNOTATION_CONFIG_SECTIONS), so that a fleet recreated for a new configuration can say which part
    changed (`changed_sections`)."""
    return {key: hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:8]
            for key, value in sorted(_config_payload(spec).items())}


def format_sections(sections: Mapping[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(sections.items()))


def parse_sections(annotation: str) -> dict[str, str]:
    """`format_sections`'s text as a mapping ({} for an empty or broken one)."""
    pairs = [item.partition("=") for item in annotation.split(",") if item]
    return {key: value for key, sep, value in pairs if sep and key and value}


def changed_sections(spec: EngineCoreSetSpec, built: Mapping[str, str]) -> list[str]:
    """The parts of the configuration (user-facing names) in which `spec` differs from the one a pod with the
    sections `built` was built from; [] if the pod carries none (built by an older operator)."""
    if not built:
        return []
    now = config_sections(spec)
    return [CONFIG_SECTION_NAMES.get(key, key) for key in sorted(set(now) | set(built))
            if now.get(key) != built.get(key)]


def _config_payload(spec: EngineCoreSetSpec) -> dict[str, Any]:
    """What `fleet_config_hash` covers, by part."""
    payload: dict[str, Any] = {
        "model": spec.model,
        "image": spec.image,
        "engine": {k: v for k, v in to_json(spec.engine).items() if k != "podTemplate"},  # its own part
        "expertParallel": spec.expertParallel,
        "maxReplicas": spec.max_replicas if spec.expertParallel else None,
        "scheduling": to_json(spec.scheduling),
        "frontendPort": spec.frontend.port,
        "frontendResources": to_json(spec.frontend.resources),
        "coordinatorResources": to_json(spec.coordinator.resources),
        "readyTimeoutSeconds": spec.scaling.readyTimeoutSeconds,
    }
    optional = {
        "storage": spec.storage,
        "engineTemplate": spec.engine.podTemplate,
        "frontendTemplate": spec.frontend.podTemplate,
        "coordinatorTemplate": spec.coordinator.podTemplate,
    }
    payload.update({key: to_json(value) for key, value in optional.items() if value is not None})
    # The engines learn every frontend's sockets when they start: a change of the count recreates the fleet. Left
    # out at 1, so that a fleet from before the field keeps its hash.
    if spec.frontend.replicas != 1:
        payload["frontendReplicas"] = spec.frontend.replicas
    return payload


# ---- pods ---------------------------------------------------------------------------------------
def engine_pod(
    fleet: FleetRef,
    rank: int,
    *,
    dp_size: int,
    frontend_address: str,
    scale_up: bool = False,
    fleet_generation: int = 0,
    num_redundant_experts: int | None = None,
) -> JSON:
    """The pod of data-parallel rank `rank`: one headless vLLM engine core on `tensorParallelSize` GPUs.

    `frontend_address` is the DP master address the engine handshakes with (the frontend pod's DNS
    name). `scale_up` marks a pod added to a running fleet by a live scale-up
    (`VLLM_ELASTIC_EP_SCALE_UP_LAUNCH=1`); pods of a fresh or recreated fleet never carry it.
    `num_redundant_experts` (an MoE scale-up's R', computed by the frontend) goes into the engine's
    `--eplb-config`, merged with the user's (vLLM hashes the EPLB config: every rank must agree).
    """
    _check_size(dp_size)
    if not 0 <= rank < dp_size:
        raise ValueError(f"rank {rank} is outside the fleet of {dp_size} ranks")
    spec = fleet.spec
    tp = spec.engine.tensorParallelSize
    name = constants.engine_name(fleet.name, rank)

    # The launcher's health listener binds 0.0.0.0 by default: no --health-host.
    store_port = _coord_store_port(fleet) if rank == 0 else None
    args = commands.engine_args(
        model=spec.model_path,
        dp_size=dp_size,
        rank=rank,
        dp_address=frontend_address,
        rpc_port=constants.DP_RPC_PORT,
        health_port=constants.ENGINE_HEALTH_PORT,
        coord_store_port=store_port,
        frontend_admin_port=None if spec.expertParallel else constants.FRONTEND_ADMIN_PORT,
        vllm_flags=[
            "--tensor-parallel-size", str(tp),
            "--load-format", spec.engine.loadFormat,
            *_served_model_name(spec),
            *_expert_parallel_flags(spec, dp_size),
            *_user_args(spec, num_redundant_experts),
        ],
    )
    env = _fleet_env()
    if scale_up:
        env.append({"name": constants.ENV_SCALE_UP_LAUNCH, "value": "1"})
    env.extend(_storage_env(spec))
    env.extend(_plain(spec.engine.env))

    resources = _with_default_requests(spec.engine.resources, {"cpu": str(constants.ENGINE_CORE_CPUS + tp)})
    for section in ("limits", "requests"):
        resources.setdefault(section, {})[constants.GPU_RESOURCE] = str(tp)

    container: JSON = {
        "name": ENGINE_CONTAINER,
        "image": spec.image,
        "command": commands.command(commands.ENGINE_MODULE),
        "args": args,
        "env": env,
        "ports": [_container_port(PORT_HEALTH, constants.ENGINE_HEALTH_PORT),
                  *([_container_port(PORT_COORD_STORE, store_port)] if store_port is not None else [])],
        "resources": resources,
        "volumeMounts": [{"name": SHM_VOLUME, "mountPath": constants.SHM_DIR}, *_storage_mounts(spec)],
        # The launcher answers /livez as soon as it runs; /readyz once its engine joined the fleet. The
        # startup probe waits for the join, so readyTimeoutSeconds bounds loading the model and joining:
        # the kubelet kills an engine that has not joined by then.
        # A kill by a failed probe is no removal to drain for (nothing will release the engine): its own short
        # grace period cuts the pre-stop wait (the pod's is for a voluntary removal's drain).
        "startupProbe": {**_http_probe("/readyz", PORT_HEALTH, failures=_startup_failures(spec)),
                         "terminationGracePeriodSeconds": constants.ENGINE_DELETE_GRACE_SECONDS},
        "livenessProbe": {**_http_probe("/livez", PORT_HEALTH, failures=3),
                          "terminationGracePeriodSeconds": constants.ENGINE_DELETE_GRACE_SECONDS},
        "readinessProbe": _http_probe("/readyz", PORT_HEALTH, failures=3, period=5),
    }
    grace = TERMINATION_GRACE_SECONDS
    if not spec.expertParallel:
        # A voluntary removal (an eviction, a delete with this grace period) is drained: the hook waits until the
        # frontend has drained and released the rank (a vacating replacement, asked by the operator), and the
        # grace period leaves the drain its timeout (a template's grace period wins: the hook's wait then ends
        # the margin before it). MoE ranks cannot be replaced one by one: none.
        drain = spec.scaling.drainTimeoutSeconds
        grace = drain + constants.ENGINE_DRAIN_MARGIN_SECONDS
        chosen = spec.engine.podTemplate.spec.terminationGracePeriodSeconds if spec.engine.podTemplate else None
        wait = drain if chosen is None else max(0, min(drain, chosen - constants.ENGINE_DRAIN_MARGIN_SECONDS))
        container["lifecycle"] = {"preStop": {"httpGet": {"path": f"{DRAIN_PATH}?timeout={wait}",
                                                          "port": PORT_HEALTH}}}
    volumes = [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": spec.engine.shmSize}},
               *_storage_volumes(spec)]
    labels = {constants.LABEL_RANK: str(rank)}
    return _pod(fleet, name, constants.ROLE_ENGINE, container, volumes, dp_size, fleet_generation, labels,
                template=spec.engine.podTemplate, grace=grace)


def coordinator_pod(fleet: FleetRef, *, dp_size: int, fleet_generation: int = 0) -> JSON:
    """vLLM's DPCoordinator, run standalone on the three fixed ports the frontend and engines use."""
    _check_size(dp_size)
    spec = fleet.spec
    args = commands.coordinator_args(
        engine_count=dp_size,
        host=ALL_INTERFACES,
        front_publish_port=constants.COORDINATOR_FRONT_PUBLISH_PORT,
        back_output_port=constants.COORDINATOR_BACK_OUTPUT_PORT,
        back_publish_port=constants.COORDINATOR_BACK_PUBLISH_PORT,
        wave_coordination=spec.expertParallel,  # vLLM coordinates request waves only for MoE
    )
    container: JSON = {
        "name": COORDINATOR_CONTAINER,
        "image": spec.image,
        "command": commands.command(commands.COORDINATOR_MODULE),
        "args": args,
        "env": _fleet_env(),
        "ports": [_container_port(name, port) for name, port in COORDINATOR_PORTS],
        "resources": _with_default_requests(spec.coordinator.resources, constants.COORDINATOR_DEFAULT_REQUESTS),
        "readinessProbe": {
            "tcpSocket": {"port": PORT_COORD_FRONT_PUBLISH},
            "periodSeconds": 5,
            "timeoutSeconds": PROBE_TIMEOUT_SECONDS,
            "failureThreshold": 3,
        },
    }
    name = constants.coordinator_name(fleet.name)
    return _pod(fleet, name, constants.ROLE_COORDINATOR, container, [], dp_size, fleet_generation,
                template=spec.coordinator.podTemplate)


def frontend_pod(fleet: FleetRef, *, dp_size: int, coordinator_address: str, fleet_generation: int = 0,
                 num_redundant_experts: int | None = None, attach: bool = False, index: int = 0,
                 detached: frozenset[int] = frozenset()) -> JSON:
    """The vLLM API server with corefleet's DPLB client, the engines' handshake ROUTER and the admin API.

    vLLM's flags mirror the engines' (same model, parallel layout and user args, so the frontend's
    config matches the ranks': max model length, served model name, tokenizer, ...); it runs no
    engine itself (`--data-parallel-size-local 0`) and is the DP master at its own pod IP.
    `num_redundant_experts`: as for `engine_pod` (an MoE fleet recreated at a size it was resized to).
    The engines' sockets on it are at fixed ports under the pod's stable DNS name, so that a replacement
    frontend binds the same and the running engines reconnect to it; `attach`: this pod replaces a lost
    frontend while the engines run (`planner.members`): it re-attaches to them instead of the startup
    handshake (but for the ranks `detached`, whose replacement was in flight: they start Dead). Neither enters
    the configuration hash (pods are created only when missing, so a running
    frontend keeps its arguments). `index`: frontend `index` of `spec.frontend.replicas` (several: each knows every
    frontend's DNS name and its own client index; frontend 0 runs the engines' handshake and drives resizes).
    """
    _check_size(dp_size)
    spec = fleet.spec
    count = spec.frontend.replicas
    if not 0 <= index < count:
        raise ValueError(f"frontend {index} is outside the fleet's {count} frontend(s)")
    name = constants.frontend_name(fleet.name, index)
    addresses = [constants.pod_dns(fleet.name, n, fleet.namespace) for n in constants.frontend_names(fleet.name, count)]
    token_file = f"{constants.ADMIN_TOKEN_DIR}/{constants.ADMIN_TOKEN_KEY}"
    # The launcher's admin listener binds 0.0.0.0 by default: no --admin-host.
    args = commands.frontend_args(
        model=spec.model_path,
        dp_size=dp_size,
        host=ALL_INTERFACES,
        port=spec.frontend.port,
        dp_address=f"$({constants.ENV_POD_IP})",  # expanded by the kubelet
        rpc_port=constants.DP_RPC_PORT,
        admin_port=constants.FRONTEND_ADMIN_PORT,
        admin_token_file=token_file,
        coordinator_address=coordinator_address,
        coordinator_front_publish_port=constants.COORDINATOR_FRONT_PUBLISH_PORT,
        coordinator_back_output_port=constants.COORDINATOR_BACK_OUTPUT_PORT,
        coordinator_back_publish_port=constants.COORDINATOR_BACK_PUBLISH_PORT,
        engine0_address=_engine0_address(fleet),
        coord_store_port=_coord_store_port(fleet),
        engine_ports=(constants.FRONTEND_ENGINE_INPUT_PORT, constants.FRONTEND_ENGINE_OUTPUT_PORT),
        advertise_address=addresses[index],
        frontend_addresses=addresses if count > 1 else (),
        client_index=index,
        policy=[*routing_flags(spec), *hold_flags(spec)],
        attach=attach,
        detached=sorted(detached) if attach else (),
        vllm_flags=[
            "--tensor-parallel-size", str(spec.engine.tensorParallelSize),
            *_served_model_name(spec),
            *_expert_parallel_flags(spec, dp_size),
            *_user_args(spec, num_redundant_experts),
        ],
    )
    container: JSON = {
        "name": FRONTEND_CONTAINER,
        "image": spec.image,
        "command": commands.command(commands.FRONTEND_MODULE),
        "args": args,
        # The engines' extra env (HF_TOKEN, VLLM_* switches) matters to the frontend's config too.
        "env": [*_fleet_env(), *_storage_env(spec), *_plain(spec.engine.env)],
        "ports": [
            _container_port(PORT_HTTP, spec.frontend.port),
            _container_port(PORT_ADMIN, constants.FRONTEND_ADMIN_PORT),
            _container_port(PORT_RPC, constants.DP_RPC_PORT),
            _container_port(PORT_ENGINE_INPUT, constants.FRONTEND_ENGINE_INPUT_PORT),
            _container_port(PORT_ENGINE_OUTPUT, constants.FRONTEND_ENGINE_OUTPUT_PORT),
        ],
        "resources": _with_default_requests(spec.frontend.resources, constants.FRONTEND_DEFAULT_REQUESTS),
        "volumeMounts": [{"name": ADMIN_TOKEN_VOLUME, "mountPath": constants.ADMIN_TOKEN_DIR, "readOnly": True},
                         *_storage_mounts(spec)],
        # vLLM serves HTTP only once every engine has handshaked: as slow as the slowest model load.
        "startupProbe": _http_probe("/health", PORT_HTTP, failures=_startup_failures(spec)),
        "readinessProbe": _http_probe("/health", PORT_HTTP, failures=3, period=5),
        # Not /health (503 while no rank serves: a frontend is not broken by its engines). The admin
        # server's thread answers 503 once vLLM's event loop made no progress for LOOP_STALL_LIMIT_S;
        # three more failed probes and the kubelet restarts a wedged frontend (the fleet recovers).
        "livenessProbe": _http_probe(LIVE_PATH, PORT_ADMIN, failures=3),
    }
    volumes = [{
        "name": ADMIN_TOKEN_VOLUME,
        "secret": {"secretName": constants.admin_secret_name(fleet.name)},
    }, *_storage_volumes(spec)]
    return _pod(fleet, name, constants.ROLE_FRONTEND, container, volumes, dp_size, fleet_generation,
                template=spec.frontend.podTemplate)


# spec.frontend.routing.policy -> the frontend's --routing.
ROUTING_POLICY_FLAGS: Mapping[str, str] = {"LeastLoaded": "least-loaded", "PrefixAffinity": "prefix-affinity"}


def routing_flags(spec: EngineCoreSetSpec) -> list[str]:
    """The frontend's routing flags from `spec.frontend.routing` (the settings only with PrefixAffinity)."""
    routing = spec.frontend.routing
    flags = ["--routing", ROUTING_POLICY_FLAGS[routing.policy]]
    if routing.policy == "PrefixAffinity":
        flags += ["--routing-prefix-tokens", str(routing.prefixTokens),
                  "--routing-balance", f"{routing.loadBoundPercent / 100:g}"]
    return flags


def hold_flags(spec: EngineCoreSetSpec) -> list[str]:
    """The frontend's hold of requests while no rank takes any, from `spec.frontend.hold`."""
    hold = spec.frontend.hold
    return ["--hold-requests", str(hold.maxRequests), "--hold-timeout", str(hold.timeoutSeconds)]


# ---- services, secret, network policy -----------------------------------------------------------
def frontend_service(fleet: FleetRef) -> JSON:
    """The user's endpoint `<fleet>`: HTTP to the frontend pod, with the user's labels and annotations
    (`spec.frontend.service`: a cloud load balancer's settings) under corefleet's."""
    service = fleet.spec.frontend.service
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(fleet, constants.service_name(fleet.name), user_labels=service.labels,
                              annotations=service.annotations),
        "spec": {
            "type": fleet.spec.frontend.service.type,
            "selector": constants.selector_labels(fleet.name, constants.ROLE_FRONTEND),
            "ports": [_service_port(PORT_HTTP, fleet.spec.frontend.port, target=PORT_HTTP)],
        },
    }


def fleet_service(fleet: FleetRef) -> JSON:
    """Headless Service `<fleet>-fleet`: stable DNS for every fleet pod, Ready or not."""
    ports = [_service_port(PORT_RPC, constants.DP_RPC_PORT)]
    ports += [_service_port(name, port) for name, port in COORDINATOR_PORTS]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(fleet, constants.fleet_service_name(fleet.name)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": constants.selector_labels(fleet.name),
            "ports": ports,
        },
    }


def admin_secret(fleet: FleetRef, token: str) -> JSON:
    """Secret `<fleet>-admin` with the frontend admin API's bearer token (as `data`, which the API
    server stores verbatim, so server-side apply round-trips without a diff)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(fleet, constants.admin_secret_name(fleet.name)),
        "type": "Opaque",
        "data": {constants.ADMIN_TOKEN_KEY: base64.b64encode(token.encode()).decode("ascii")},
    }


def network_policy(fleet: FleetRef) -> JSON | None:
    """Ingress rules for the fleet's pods, or None unless `spec.networkPolicy`.

    Fleet pods reach each other on every TCP port (vLLM's data-plane ports are ephemeral); anyone
    reaches the frontend's HTTP port; only the operator's pods (any namespace) reach the admin port.
    One policy selects all fleet pods, so the HTTP port is open on each of them, but only the
    frontend listens there.
    """
    if not fleet.spec.networkPolicy:
        return None
    def fleet_pods() -> JSON:  # a fresh dict per use: no object is shared within the output
        return {"matchLabels": constants.selector_labels(fleet.name)}

    operator_pods = {"matchLabels": {constants.OPERATOR_APP_LABEL: constants.OPERATOR_NAME}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(fleet, constants.network_policy_name(fleet.name)),
        "spec": {
            "podSelector": fleet_pods(),
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": fleet_pods()}], "ports": [{"protocol": "TCP"}]},
                {"ports": [{"protocol": "TCP", "port": fleet.spec.frontend.port}]},
                {
                    "from": [{"namespaceSelector": {}, "podSelector": operator_pods}],
                    "ports": [{"protocol": "TCP", "port": constants.FRONTEND_ADMIN_PORT}],
                },
            ],
        },
    }


def pod_disruption_budgets(fleet: FleetRef, *, dp_size: int, engine_disruptions: int = 1) -> list[JSON]:
    """The fleet's PodDisruptionBudgets: `<fleet>-engines` over the engine pods, `<fleet>-fleet` over the frontend
    and the coordinator.

    A dense fleet's engine rank can be removed voluntarily (a node drain's eviction, a delete with the pod's grace
    period): the frontend stops routing to it, its requests finish, and the rank is replaced in place on another
    node while the others serve (`planner.replace`). So a drain may take `engine_disruptions` rank at a time:
    `minAvailable` is the committed size less that (the caller passes 0 while a resize or a replacement runs:
    one at a time, and never during a resize). An MoE fleet's ranks share collectives that cannot lose a member
    (a lost rank recreates the fleet): its engines' budget allows no disruption. The frontend and the coordinator
    cannot be replaced under running engines yet (a lost one recreates the fleet): their budget allows none.
    `minAvailable` rather than `maxUnavailable`: for that the disruption controller counts the expected pods
    from the controller's /scale, which counts ranks only. `unhealthyPodEvictionPolicy: AlwaysAllow` lets a drain
    evict a pod that is not Ready (it serves nothing, and a broken pod must not block node maintenance).
    """
    disruptions = 0 if fleet.spec.expertParallel else max(0, engine_disruptions)
    engines = max(0, dp_size - disruptions)
    control = 1 + fleet.spec.frontend.replicas if dp_size else 0  # the coordinator and every frontend
    return [
        _budget(fleet, constants.engines_budget_name(fleet.name),
                {"matchLabels": constants.selector_labels(fleet.name, constants.ROLE_ENGINE)}, engines),
        _budget(fleet, constants.fleet_service_name(fleet.name),
                {"matchLabels": constants.selector_labels(fleet.name),
                 "matchExpressions": [{"key": constants.LABEL_ROLE, "operator": "In",
                                       "values": [constants.ROLE_COORDINATOR, constants.ROLE_FRONTEND]}]}, control),
    ]


def _budget(fleet: FleetRef, name: str, selector: JSON, min_available: int) -> JSON:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(fleet, name),
        "spec": {"selector": selector, "minAvailable": min_available, "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    }


# ---- the whole fleet ----------------------------------------------------------------------------
def fleet_objects(fleet: FleetRef, *, admin_token: str, dp_size: int = 0, engine_disruptions: int = 1) -> list[JSON]:
    """The fleet's objects other than pods, which it keeps at any size (also stopped, at 0 ranks):
    the Secret, the Services, the PodDisruptionBudgets and the NetworkPolicy (if any), in that order."""
    objects = [admin_secret(fleet, admin_token), frontend_service(fleet), fleet_service(fleet),
               *pod_disruption_budgets(fleet, dp_size=dp_size, engine_disruptions=engine_disruptions)]
    policy = network_policy(fleet)
    if policy is not None:
        objects.append(policy)
    return objects


def fleet_children(
    fleet: FleetRef,
    *,
    dp_size: int,
    admin_token: str,
    fleet_generation: int = 0,
    scale_up_ranks: frozenset[int] = frozenset(),
    num_redundant_experts: int | None = None,
    engine_disruptions: int = 1,
    frontend_attach: frozenset[int] = frozenset(),
    detached: frozenset[int] = frozenset(),
) -> list[JSON]:
    """Every object of a fleet of `dp_size` ranks, in a stable order: the Secret, the Services, the
    PodDisruptionBudget, the NetworkPolicy (if any), the coordinator, the frontend, then the engines by rank.
    `num_redundant_experts` (MoE): the redundant experts every rank and the frontend start with, if not the
    user's (`status.redundantExperts` of a fleet recreated at a size it was resized to). `frontend_attach`: the
    frontends (by index) that replace lost ones while the engines run (`frontend_pod`'s `attach`), leaving out the
    ranks `detached`."""
    _check_size(dp_size)
    unknown = sorted(r for r in scale_up_ranks if not 0 <= r < dp_size)
    if unknown:
        raise ValueError(f"scale-up ranks {unknown} are outside the fleet of {dp_size} ranks")
    ns = fleet.namespace
    frontend_address = constants.pod_dns(fleet.name, constants.frontend_name(fleet.name), ns)
    coordinator_address = constants.pod_dns(fleet.name, constants.coordinator_name(fleet.name), ns)
    children = fleet_objects(fleet, admin_token=admin_token, dp_size=dp_size, engine_disruptions=engine_disruptions)
    children.append(coordinator_pod(fleet, dp_size=dp_size, fleet_generation=fleet_generation))
    children += [frontend_pod(fleet, dp_size=dp_size, coordinator_address=coordinator_address,
                              fleet_generation=fleet_generation, num_redundant_experts=num_redundant_experts,
                              attach=index in frontend_attach, index=index, detached=detached)
                 for index in range(fleet.spec.frontend.replicas)]
    children += [
        engine_pod(fleet, rank, dp_size=dp_size, frontend_address=frontend_address,
                   scale_up=rank in scale_up_ranks, fleet_generation=fleet_generation,
                   num_redundant_experts=num_redundant_experts)
        for rank in range(dp_size)
    ]
    return children


# ---- helpers ------------------------------------------------------------------------------------
def _check_size(dp_size: int) -> None:
    if dp_size < 1:
        raise ValueError(f"a fleet needs at least one rank, not {dp_size}")


def _with_default_requests(resources: Mapping[str, Any], defaults: Mapping[str, str]) -> JSON:
    """The container's resources (a plain copy) with `defaults` requested for each resource the user
    set neither a request nor a limit for (see constants.FRONTEND_DEFAULT_REQUESTS for why)."""
    out: JSON = _plain(resources)
    limits = out.get("limits") or {}
    for name, quantity in defaults.items():
        if name not in (out.get("requests") or {}) and name not in limits:
            out.setdefault("requests", {})[name] = quantity
    return out


def _plain(value: Any) -> Any:
    """A deep copy as plain dicts and lists (the spec's pass-through types are dict/list subclasses,
    which YAML's safe dumper and JSON patching must not see)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _owner_reference(fleet: FleetRef) -> JSON:
    return {
        "apiVersion": constants.API_VERSION,
        "kind": constants.KIND,
        "name": fleet.name,
        "uid": fleet.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _labels(fleet: FleetRef, role: str | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    labels = {constants.LABEL_MANAGED_BY: constants.MANAGED_BY, **constants.selector_labels(fleet.name, role)}
    labels.update(extra or {})
    return labels


def _metadata(
    fleet: FleetRef,
    name: str,
    role: str | None = None,
    *,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    user_labels: Mapping[str, str] | None = None,
) -> JSON:
    """An object's metadata: corefleet's labels plus `labels`, over the user's `user_labels` (corefleet's win
    on a key both set; the models refuse that anyway)."""
    merged = {**(user_labels or {}), **_labels(fleet, role, labels)}
    meta: JSON = {
        "name": name,
        "namespace": fleet.namespace,
        "labels": {str(k): str(v) for k, v in merged.items()},
        "ownerReferences": [_owner_reference(fleet)],
    }
    if annotations:
        meta["annotations"] = {str(k): str(v) for k, v in annotations.items()}
    return meta


def _scheduling(spec: EngineCoreSetSpec) -> JSON:
    """The pod spec's placement fields, only those the user set."""
    s = spec.scheduling
    out: JSON = {}
    if s.nodeSelector:
        out["nodeSelector"] = _plain(s.nodeSelector)
    if s.tolerations:
        out["tolerations"] = _plain(s.tolerations)
    if s.affinity:
        out["affinity"] = _plain(s.affinity)
    if s.priorityClassName:
        out["priorityClassName"] = s.priorityClassName
    if s.schedulerName:
        out["schedulerName"] = s.schedulerName
    return out


def _pod(
    fleet: FleetRef,
    name: str,
    role: str,
    container: JSON,
    volumes: Iterable[JSON],
    dp_size: int,
    fleet_generation: int,
    labels: Mapping[str, str] | None = None,
    *,
    template: PodTemplate | None = None,
    grace: int = TERMINATION_GRACE_SECONDS,
) -> JSON:
    """A fleet pod around `container`: PodSecurity `restricted` (non-root, seccomp RuntimeDefault, no
    privilege escalation, no capabilities), $HOME on an emptyDir, then the role's `template` merged in."""
    annotations = {
        constants.ANNOTATION_SPEC_HASH: fleet_config_hash(fleet.spec),
        constants.ANNOTATION_GENERATION: str(fleet_generation),
        constants.ANNOTATION_CONFIG_SECTIONS: format_sections(config_sections(fleet.spec)),
    }
    container = {
        **container,
        "volumeMounts": [*container.get("volumeMounts", []),
                         {"name": HOME_VOLUME, "mountPath": constants.RUNTIME_HOME}],
        "securityContext": container_security_context(),
    }
    volumes = [*volumes, {"name": HOME_VOLUME, "emptyDir": {}}]
    spec: JSON = {
        # Never restarted in place: a fleet process that died cannot rejoin (the operator recreates the fleet).
        "restartPolicy": "Never",
        # <name>.<fleet>-fleet.<ns>.svc through the headless Service, before the pod is Ready.
        "hostname": name,
        "subdomain": constants.fleet_service_name(fleet.name),
        # No <SVC>_PORT variables: a Service named e.g. `vllm` would set VLLM_PORT and break vLLM.
        "enableServiceLinks": False,
        # Fleet processes never call the Kubernetes API.
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": grace,
        "securityContext": pod_security_context(),
        "containers": [container],
        **_scheduling(fleet.spec),
        "volumes": volumes,
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _metadata(fleet, name, role, labels=labels, annotations=annotations),
        "spec": spec,
    }
    return merge_template(pod, template) if template is not None else pod


def pod_security_context() -> JSON:
    """Every fleet pod's securityContext: the `restricted` Pod Security Standard's, as the runtime image's user."""
    return {
        "runAsNonRoot": True,
        "runAsUser": constants.RUNTIME_UID,
        "runAsGroup": constants.RUNTIME_GID,
        "fsGroup": constants.RUNTIME_FS_GROUP,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> JSON:
    """Every corefleet container's securityContext (the `restricted` Pod Security Standard's)."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def merge_template(pod: JSON, template: PodTemplate) -> JSON:
    """`pod` (as built, not mutated) with a role's podTemplate merged in (models.TemplatePodSpec says how each
    field merges). The models refuse what would override corefleet's own (its labels, its container's
    command, probes, ...), so here the template only adds to or replaces what a user may set."""
    out: JSON = _plain(pod)
    meta, spec = out["metadata"], out["spec"]
    tmeta = template.metadata
    meta["labels"] = {**_plain(tmeta.labels), **meta["labels"]}
    meta["annotations"] = {**_plain(tmeta.annotations), **meta.get("annotations", {})}
    t = template.spec
    replaced = {
        "imagePullSecrets": t.imagePullSecrets, "serviceAccountName": t.serviceAccountName,
        "automountServiceAccountToken": t.automountServiceAccountToken, "runtimeClassName": t.runtimeClassName,
        "topologySpreadConstraints": t.topologySpreadConstraints,
        "terminationGracePeriodSeconds": t.terminationGracePeriodSeconds, "dnsPolicy": t.dnsPolicy,
        "dnsConfig": t.dnsConfig, "hostAliases": t.hostAliases, "affinity": t.affinity,
        "priorityClassName": t.priorityClassName, "initContainers": t.initContainers,
    }
    for key, value in replaced.items():
        if value is not None:
            spec[key] = _plain(value)
    if t.securityContext is not None:
        spec["securityContext"] = {**spec["securityContext"], **_plain(t.securityContext)}
    if t.nodeSelector:
        spec["nodeSelector"] = {**spec.get("nodeSelector", {}), **_plain(t.nodeSelector)}
    if t.tolerations:
        spec["tolerations"] = [*spec.get("tolerations", []), *_plain(t.tolerations)]
    if t.volumes:
        spec["volumes"] = [*spec["volumes"], *_plain(t.volumes)]
    main = spec["containers"][0]
    for c in t.containers or ():
        given: JSON = to_json(c)
        if c.name != main["name"]:
            spec["containers"].append(given)  # a sidecar (the models refuse another role's container name)
            continue
        for key in ("env", "volumeMounts"):
            if key in given:
                main[key] = [*main.get(key, []), *given[key]]
        if "securityContext" in given:
            main["securityContext"] = {**main["securityContext"], **given["securityContext"]}
        for key in ("envFrom", "imagePullPolicy", "workingDir"):
            if key in given:
                main[key] = given[key]
    return out


def _fleet_env() -> list[JSON]:
    """Every fleet container's first variables: the downward API's, and HOME (on the `home` emptyDir: the
    runtime uid may have no passwd entry in a user's image, and vLLM, torch and the hub cache under it)."""
    return [
        {"name": constants.ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": constants.ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": constants.ENV_POD_NAMESPACE, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": constants.ENV_HOME, "value": constants.RUNTIME_HOME},
    ]


def _storage_volumes(spec: EngineCoreSetSpec) -> list[JSON]:
    """The model storage's volume (engines and frontend), if any."""
    storage = spec.storage
    if storage is None:
        return []
    if storage.pvc is not None:
        source: JSON = {"persistentVolumeClaim": {"claimName": storage.pvc.claimName,
                                                  "readOnly": storage.pvc.readOnly}}
    elif storage.hostPath is not None:
        source = {"hostPath": {"path": storage.hostPath.path, "type": "Directory"}}
    elif storage.image is not None:
        source = {"image": {"reference": storage.image.reference, "pullPolicy": storage.image.pullPolicy}}
    else:
        hub = storage.hub
        assert hub is not None  # exactly one source (models)
        source = ({"persistentVolumeClaim": {"claimName": hub.cache.claimName}} if hub.cache is not None
                  else {"emptyDir": {}})
    return [{"name": MODELS_VOLUME, **source}]


def _storage_mounts(spec: EngineCoreSetSpec) -> list[JSON]:
    """The model storage's mount at `storage.mountPath`: read-only but for a hub cache (the download's)."""
    storage = spec.storage
    if storage is None:
        return []
    mount: JSON = {"name": MODELS_VOLUME, "mountPath": storage.mountPath}
    if storage.pvc is not None and storage.pvc.subPath:
        mount["subPath"] = storage.pvc.subPath
    if storage.hub is None and (storage.pvc is None or storage.pvc.readOnly):
        mount["readOnly"] = True
    return [mount]


def _storage_env(spec: EngineCoreSetSpec) -> list[JSON]:
    """A hub cache: HF_HOME at the mount, and HF_TOKEN from its Secret if one is named."""
    storage = spec.storage
    if storage is None or storage.hub is None:
        return []
    env: list[JSON] = [{"name": constants.ENV_HF_HOME, "value": storage.mountPath}]
    token = storage.hub.tokenSecret
    if token is not None:
        env.append({"name": constants.ENV_HF_TOKEN,
                    "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}}})
    return env


def _served_model_name(spec: EngineCoreSetSpec) -> list[str]:
    """`--served-model-name <spec.model>` where --model is a path under the storage, so that clients keep
    using the name in the spec; not if the user's args name it themselves."""
    if spec.model_path == spec.model:
        return []
    for arg in spec.engine.args:
        if arg.split("=", 1)[0].replace("_", "-") == "--served-model-name":
            return []
    return ["--served-model-name", spec.model]


def _engine0_address(fleet: FleetRef) -> str | None:
    """MoE: the address the frontend advertises to the engines as the DP master (engine rank 0's pod).

    vLLM's INIT names the frontend itself, assuming engine 0 runs beside it; engine 0 binds its DP
    group port there (corefleet_client.vllm_compat, change 2). The name resolves to engine 0's pod
    IP everywhere, inside its own pod too (hostname + subdomain).
    """
    if not fleet.spec.expertParallel:
        return None
    return constants.pod_dns(fleet.name, constants.engine_name(fleet.name, 0), fleet.namespace)


def _coord_store_port(fleet: FleetRef) -> int | None:
    """Elastic EP: the port of the startup's coordination store, which engine rank 0's launcher serves in its
    pod and the frontend advertises to every engine (corefleet_client.coordstore); vLLM's multiprocess launch
    creates none, and every elastic-EP engine opens it at startup at engine 0's address."""
    return constants.COORD_STORE_PORT if fleet.spec.expertParallel else None


def _user_args(spec: EngineCoreSetSpec, num_redundant_experts: int | None) -> list[str]:
    """The user's vLLM args, with the redundant experts set if given (MoE only)."""
    if num_redundant_experts is None or not spec.expertParallel:
        return list(spec.engine.args)
    return with_redundant_experts(spec.engine.args, num_redundant_experts)


def _expert_parallel_flags(spec: EngineCoreSetSpec, dp_size: int) -> list[str]:
    """MoE elastic EP flags, identical on the frontend and every rank. vLLM rejects a maximum below
    the current size, so a fleet built at a size above the spec's maximum (recovering at the last
    committed size while the spec shrank) gets its own size as the maximum."""
    if not spec.expertParallel:
        return []
    return commands.elastic_ep_flags(max(spec.max_replicas, dp_size))


def _startup_failures(spec: EngineCoreSetSpec) -> int:
    return math.ceil(spec.scaling.readyTimeoutSeconds / PROBE_PERIOD_SECONDS)


def _http_probe(path: str, port: str, *, failures: int, period: int = PROBE_PERIOD_SECONDS) -> JSON:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": PROBE_TIMEOUT_SECONDS,
        "failureThreshold": failures,
    }


def _container_port(name: str, port: int) -> JSON:
    return {"name": name, "containerPort": port, "protocol": "TCP"}


def _service_port(name: str, port: int, *, target: str | int | None = None) -> JSON:
    return {"name": name, "port": port, "targetPort": port if target is None else target, "protocol": "TCP"}
