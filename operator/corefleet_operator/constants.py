# SPDX-License-Identifier: Apache-2.0
"""The one place for names shared across corefleet: API group, labels, annotations, ports, env.

Names of children are derived from the EngineCoreSet's name, never discovered. Nothing here
imports kopf or a Kubernetes client (checked by the import contract in pyproject.toml).
"""

from __future__ import annotations

from typing import Final

from corefleet_client import commands
from corefleet_client.frontend import hold as frontend_hold
from corefleet_client.frontend import types as frontend_types

# --- API -------------------------------------------------------------------------------------
GROUP: Final = "corefleet.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "EngineCoreSet"
PLURAL: Final = "enginecoresets"
SINGULAR: Final = "enginecoreset"
SHORT_NAMES: Final = ("ecs",)
CRD_NAME: Final = f"{PLURAL}.{GROUP}"

# --- Routing: spec.frontend.routing's defaults are the frontend's own --------------------------
ROUTING_PREFIX_TOKENS: Final = frontend_types.DEFAULT_ROUTING_PREFIX_TOKENS
ROUTING_LOAD_BOUND_PERCENT: Final = round(frontend_types.DEFAULT_ROUTING_BALANCE * 100)

# --- The hold of requests while no rank takes any: spec.frontend.hold's defaults are the frontend's own -----------
HOLD_MAX_REQUESTS: Final = frontend_hold.DEFAULT_HOLD_REQUESTS
HOLD_TIMEOUT_SECONDS: Final = round(frontend_hold.DEFAULT_HOLD_TIMEOUT_S)

# --- Labels and annotations (users cannot override selector labels) ---------------------------
LABEL_PREFIX: Final = f"{GROUP}/"
LABEL_FLEET: Final = f"{LABEL_PREFIX}fleet"
LABEL_ROLE: Final = f"{LABEL_PREFIX}role"
LABEL_RANK: Final = f"{LABEL_PREFIX}rank"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
MANAGED_BY: Final = "corefleet"

ROLE_ENGINE: Final = "engine"
ROLE_COORDINATOR: Final = "coordinator"
ROLE_FRONTEND: Final = "frontend"

# kopf's own bookkeeping lives under our prefix, never in status.
KOPF_ANNOTATION_PREFIX: Final = f"kopf.{GROUP}"
FINALIZER: Final = f"{GROUP}/finalizer"
FIELD_MANAGER: Final = "corefleet-operator"

# --- Resources ---------------------------------------------------------------------------------
GPU_RESOURCE: Final = "nvidia.com/gpu"
# CPU and memory each container requests unless its spec sets a request or a limit for that resource
# (Kubernetes makes a limit the request). A container's CPU request is its cgroup's weight on a
# shared node: without one a fleet pod gets the minimum weight, and any pod that requests CPU starves
# it. The frontend is one API-server process (asyncio loop, tokenizer and detokenizer, ZeroMQ I/O
# threads) that is the fleet's bottleneck once engines are fast: it saturates one core (bench/) and
# needs headroom beside it, hence 2. An engine rank keeps its engine core's busy loop and each of its
# tensor-parallel workers on a core: 1 + tensorParallelSize. The coordinator only relays load
# statistics (every 100 ms). No CPU limits by default: a CFS quota stalls a throttled frontend for the
# rest of each 100 ms period, which every stream it serves feels. Memory: the frontend and the
# coordinator each import vLLM (~0.9 GiB resident); an engine's memory depends on the model, so it
# gets no default.
FRONTEND_DEFAULT_REQUESTS: Final = {"cpu": "2", "memory": "4Gi"}
COORDINATOR_DEFAULT_REQUESTS: Final = {"cpu": "250m", "memory": "1Gi"}
ENGINE_CORE_CPUS: Final = 1  # the engine core's busy loop; plus one per tensor-parallel worker

ANNOTATION_SPEC_HASH: Final = f"{GROUP}/spec-hash"  # hash of the fleet-wide config a pod was built from
ANNOTATION_GENERATION: Final = f"{GROUP}/fleet-generation"  # which incarnation of the fleet a pod belongs to
# The spec-hash's parts, `section=hash,...`: which part of the configuration changed, told when a fleet is recreated.
ANNOTATION_CONFIG_SECTIONS: Final = f"{GROUP}/config-sections"

# --- Ports (fixed, so names and addresses are derived, not discovered) -------------------------
FRONTEND_HTTP_PORT: Final = 8000  # default of spec.frontend.port
FRONTEND_ADMIN_PORT: Final = 8001  # corefleet's authenticated admin API on the frontend
ENGINE_HEALTH_PORT: Final = 8002  # the engine launcher's /livez and /readyz (ready = joined the fleet)

# Removing an engine pod (docs in builders.engine_pod): a voluntary removal (an eviction, a delete with the pod's
# grace period) is drained by the frontend within the pod's grace period, which is the spec's drain timeout plus
# this margin (the release, the engine's own shutdown, the kubelet's last 2 s).
ENGINE_DRAIN_MARGIN_SECONDS: Final = 15
# The operator's own deletes of engine pods (retired, lost, a recovery): nothing will release them, so their pre-stop
# wait is cut short; the engine then gets SIGTERM and the kubelet's minimum of 2 s.
ENGINE_DELETE_GRACE_SECONDS: Final = 3
DP_RPC_PORT: Final = 29550  # the engines' handshake ROUTER on the frontend (--data-parallel-rpc-port)
# The standalone DPCoordinator's three fixed ZMQ endpoints (vLLM binds them to port 0 by default).
COORDINATOR_FRONT_PUBLISH_PORT: Final = 29551  # XPUB: stats and wave state to the frontend
COORDINATOR_BACK_OUTPUT_PORT: Final = 29552  # PULL: engines' stats
COORDINATOR_BACK_PUBLISH_PORT: Final = 29553  # XPUB: wave start to the engines
# Elastic EP (expertParallel): the coordination store of a fleet's startup, served by engine rank 0's
# launcher in its pod (corefleet_client.coordstore) and advertised to every engine in INIT.
COORD_STORE_PORT: Final = 29554
# The engines' sockets on the frontend (requests ROUTER, outputs PULL), fixed so that a replacement frontend
# binds the same ports under the same DNS name and the running engines reconnect to it.
FRONTEND_ENGINE_INPUT_PORT: Final = 29556
FRONTEND_ENGINE_OUTPUT_PORT: Final = 29557
OPERATOR_HEALTH_PORT: Final = 8080
OPERATOR_METRICS_PORT: Final = 9090

# --- Container paths and environment ----------------------------------------------------------
ADMIN_TOKEN_DIR: Final = "/var/run/corefleet/admin"
ADMIN_TOKEN_KEY: Final = "token"  # key in the admin Secret, file name under ADMIN_TOKEN_DIR
ENV_POD_IP: Final = "POD_IP"
ENV_POD_NAME: Final = "POD_NAME"
ENV_POD_NAMESPACE: Final = "POD_NAMESPACE"
ENV_ADMIN_TOKEN_FILE: Final = "COREFLEET_ADMIN_TOKEN_FILE"
ENV_SCALE_UP_LAUNCH: Final = commands.ENV_SCALE_UP_LAUNCH  # only on pods added by a live scale-up
ENV_HOME: Final = "HOME"
ENV_HF_HOME: Final = "HF_HOME"  # spec.storage.hub: the Hugging Face cache, at the storage's mountPath
ENV_HF_TOKEN: Final = "HF_TOKEN"  # spec.storage.hub.tokenSecret

# --- The fleet pods' runtime user and volumes (PodSecurity `restricted` by default) ---------------
# Every fleet pod runs as this uid/gid (images/runtime/Dockerfile's user `corefleet`, home RUNTIME_HOME),
# non-root, seccomp RuntimeDefault; every corefleet container without privilege escalation and with
# all capabilities dropped. A user's image may have no passwd entry for the uid: HOME is set to an
# emptyDir mounted at RUNTIME_HOME (vLLM, torch and Hugging Face write their caches under $HOME/.cache).
RUNTIME_UID: Final = 1000
RUNTIME_GID: Final = 1000
RUNTIME_FS_GROUP: Final = 1000  # group of the pods' volumes (a PVC the uid must read or write)
RUNTIME_HOME: Final = "/home/corefleet"
SHM_DIR: Final = "/dev/shm"
DEFAULT_STORAGE_MOUNT_PATH: Final = "/models"
# Names of the containers corefleet builds (a podTemplate's container of that name is merged into it).
CONTAINER_ENGINE: Final = "engine"
CONTAINER_FRONTEND: Final = "frontend"
CONTAINER_COORDINATOR: Final = "coordinator"
CONTAINER_NAMES: Final = (CONTAINER_ENGINE, CONTAINER_FRONTEND, CONTAINER_COORDINATOR)
# Names of the volumes corefleet adds to fleet pods (a podTemplate may not use them).
VOLUME_SHM: Final = "dshm"  # engines: /dev/shm in memory
VOLUME_ADMIN_TOKEN: Final = "admin-token"  # frontend: the admin Secret
VOLUME_HOME: Final = "home"  # every fleet pod: $HOME (an emptyDir)
VOLUME_MODELS: Final = "models"  # engines and frontend: spec.storage
RESERVED_VOLUMES: Final = (VOLUME_SHM, VOLUME_ADMIN_TOKEN, VOLUME_HOME, VOLUME_MODELS)
# Paths corefleet mounts; spec.storage.mountPath may be neither one of them nor inside one.
RESERVED_MOUNT_PATHS: Final = (SHM_DIR, RUNTIME_HOME, "/var/run/corefleet")
# Pod labels and annotations a podTemplate may not set: the fleet's (selectors, the operator's bookkeeping).
RESERVED_LABEL_PREFIXES: Final = (f"{GROUP}/",)
RESERVED_LABELS: Final = ("app.kubernetes.io/managed-by",)
RESERVED_ANNOTATION_PREFIXES: Final = (f"{GROUP}/",)

# --- Names of a fleet's children (derived from the EngineCoreSet's name) ------------------------


def frontend_member(index: int) -> str:
    """Frontend `index`'s member name (its pod's name after the fleet's): frontend 0 keeps the one-frontend name."""
    return ROLE_FRONTEND if index == 0 else f"{ROLE_FRONTEND}-{index}"


def frontend_name(fleet: str, index: int = 0) -> str:
    """Frontend `index`'s pod (`spec.frontend.replicas`): `NAME-frontend`, then `NAME-frontend-1`, ..."""
    return f"{fleet}-{frontend_member(index)}"


def frontend_names(fleet: str, count: int) -> list[str]:
    return [frontend_name(fleet, i) for i in range(count)]


def coordinator_name(fleet: str) -> str:
    return f"{fleet}-coordinator"


def engine_name(fleet: str, rank: int) -> str:
    return f"{fleet}-engine-{rank}"


def fleet_service_name(fleet: str) -> str:
    """The headless Service giving every fleet pod a stable DNS name."""
    return f"{fleet}-fleet"


def service_name(fleet: str) -> str:
    """The user's endpoint: HTTP to the frontend."""
    return fleet


def admin_secret_name(fleet: str) -> str:
    return f"{fleet}-admin"


def network_policy_name(fleet: str) -> str:
    return f"{fleet}-fleet"


def engines_budget_name(fleet: str) -> str:
    """The PodDisruptionBudget of the engine pods (the frontend's and coordinator's is `fleet_service_name`'s)."""
    return f"{fleet}-engines"


def pod_dns(fleet: str, pod: str, namespace: str) -> str:
    """A fleet pod's DNS name through the headless Service (pod hostname + subdomain)."""
    return f"{pod}.{fleet_service_name(fleet)}.{namespace}.svc"


def selector_labels(fleet: str, role: str | None = None) -> dict[str, str]:
    labels = {LABEL_FLEET: fleet}
    if role is not None:
        labels[LABEL_ROLE] = role
    return labels


def engine_selector(fleet: str) -> str:
    """`status.selector` for the scale subresource: the fleet's engine pods."""
    return f"{LABEL_FLEET}={fleet},{LABEL_ROLE}={ROLE_ENGINE}"


# --- The operator's own install (manifests/ and the Helm chart, generated from one place) -------
OPERATOR_NAME: Final = "corefleet-operator"  # Deployment, ServiceAccount, ClusterRole(Binding)
OPERATOR_NAMESPACE: Final = "corefleet-system"  # namespace of the plain-manifest install
OPERATOR_APP_LABEL: Final = "app.kubernetes.io/name"  # selector label of the operator's pod

# --- Images and the chart's OCI home (one place: generate.py writes them into manifests/, the chart's
# values.yaml and the samples; .github/workflows/release.yml reads them from here to push) -------------
VLLM_VERSION: Final = "0.32.0"  # the one vLLM corefleet speaks to (pyproject's `vllm==`, the runtime's base)
IMAGE_REGISTRY: Final = "ghcr.io/corefleet"
OPERATOR_IMAGE_REPOSITORY: Final = f"{IMAGE_REGISTRY}/operator"  # images/operator/Dockerfile
RUNTIME_IMAGE_REPOSITORY: Final = f"{IMAGE_REGISTRY}/runtime"  # images/runtime/Dockerfile (vLLM's image + corefleet)
CHART_REPOSITORY: Final = f"oci://{IMAGE_REGISTRY}/charts"  # `helm push` target: the chart is <this>/corefleet


# --- Bounds of the EngineCoreSet API (schema and model; CEL costs are estimated from them) --------
# The largest fleet. vLLM's rank identities are 2 bytes (65536 ranks), but every rank is a pod with its
# GPUs, a ZeroMQ peer of the one frontend, and an entry of status.ranks: the whole object (spec,
# metadata with its managedFields, and status) must stay under etcd's 1.5 MiB request limit, or every
# status write fails (413) and the fleet can no longer be reconciled. With the bounds below: status at
# most ~0.25 MiB (512 ranks x (pod name, phase, a 256-char message), 4 conditions and the operation
# and recovery messages at 4 KiB), the spec at most ~0.5 MiB (args 128 x 1536 chars, env 256 x (128 +
# 1024) chars), metadata ~0.1 MiB of managedFields, or at most 256 KiB of annotations (the API
# server's cap; a client-side `kubectl apply` keeps a copy of the spec there): under 1 MiB in all
# (tests/integration/test_admission.py writes the largest status onto the largest spec).
MAX_REPLICAS: Final = 512
# Frontend pods per fleet (spec.frontend.replicas): each is one of vLLM's clients of every engine.
MAX_FRONTENDS: Final = 8
MAX_ENGINE_ARGS: Final = 128  # items of spec.engine.args
MAX_ENGINE_ARG_LENGTH: Final = 1536  # characters of one item (a JSON --compilation-config fits)
MAX_ENV_VARS: Final = 256  # items of spec.engine.env
MAX_ENV_NAME_LENGTH: Final = 128
MAX_ENV_VALUE_LENGTH: Final = 1024  # longer values belong in a ConfigMap or Secret (valueFrom)
MAX_STRING_LENGTH: Final = 1024  # model, image and other free-form spec strings
MAX_NAME_LENGTH: Final = 253  # Kubernetes object names (DNS subdomains) the spec refers to
MAX_LIST_ITEMS: Final = 64  # tolerations, node-selector entries, resource names
MAX_STATUS_MESSAGE: Final = 4096  # a condition's, the operation's or the recovery's message (truncated)
MAX_RANK_MESSAGE: Final = 256  # one rank's message in status.ranks (truncated): 512 of them must fit
MAX_CONDITIONS: Final = 16  # status.conditions
# podTemplate lists CEL rules iterate (the API server estimates a rule's cost from these bounds).
MAX_TEMPLATE_CONTAINERS: Final = 16  # containers and initContainers of one podTemplate
MAX_TEMPLATE_VOLUMES: Final = 64  # volumes of a podTemplate; volumeMounts of one container
MAX_METADATA_ENTRIES: Final = 64  # labels or annotations of a podTemplate or the frontend Service
MAX_LABEL_KEY_LENGTH: Final = 317  # a DNS-subdomain prefix (253), '/', a name (63)
MAX_LABEL_VALUE_LENGTH: Final = 63
MAX_ANNOTATION_VALUE_LENGTH: Final = 4096

# --- vLLM engine flags corefleet sets itself (builders), in the spellings vLLM 0.32.0 accepts --------
# The one source for the operator's validation (models.py) and the CRD's CEL rules (crd.py). vLLM's
# FlexibleArgumentParser also accepts underscores for dashes in a long flag's name and any unambiguous
# abbreviation of a long flag (argparse's allow_abbrev); a short flag takes its value after `=` or, for
# the one-letter ones (-n, -r), glued to it.
# Wiring: what each pod's place in the fleet is made of. Any user value breaks the fleet, whatever it is.
ENGINE_WIRING_FLAGS: Final = (
    "--data-parallel-size", "-dp", "--data-parallel-size-local", "-dpl", "--data-parallel-rank", "-dpn",
    "--data-parallel-start-rank", "-dpr", "--data-parallel-address", "-dpa", "--data-parallel-rpc-port", "-dpp",
    "--data-parallel-backend", "-dpb", "--data-parallel-hybrid-lb", "-dph", "--data-parallel-external-lb", "-dpe",
    "--data-parallel-multi-port-external-lb", "-dpm", "--data-parallel-supervisor-port",
    "--headless", "--api-server-count", "-asc", "--elastic-ep-max-dp-size",
    "--nnodes", "-n", "--node-rank", "-r", "--master-addr", "--master-port",
    "--port", "--host", "--model", "--health-port", "--",
)
ENGINE_WIRING_FLAG_PREFIXES: Final = ("--data-parallel-",)  # every data-parallel flag is wiring
ENGINE_GLUED_SHORT_FLAGS: Final = ("-n", "-r")  # one-letter short flags: `-n2` is `-n 2`
# Set on expertParallel fleets only: there a user's copy agrees, on a dense fleet it conflicts.
ENGINE_MOE_FLAGS: Final = ("--enable-expert-parallel", "-ep", "--enable-eplb", "--enable-elastic-ep")
# Their negations (argparse.BooleanOptionalAction): conflict on an expertParallel fleet, agree on a dense one.
ENGINE_MOE_NEGATIONS: Final = ("--no-enable-expert-parallel", "--no-enable-eplb", "--no-enable-elastic-ep")
# Set from a spec field: a user value agrees when written as corefleet writes it (same string).
ENGINE_TENSOR_PARALLEL_FLAGS: Final = ("--tensor-parallel-size", "-tp")  # = spec.engine.tensorParallelSize
ENGINE_LOAD_FORMAT_FLAGS: Final = ("--load-format",)  # = spec.engine.loadFormat
# Environment variables corefleet sets in fleet containers.
RESERVED_ENV: Final = (ENV_POD_IP, ENV_POD_NAME, ENV_POD_NAMESPACE, ENV_SCALE_UP_LAUNCH, ENV_HOME)
# ... and with spec.storage.hub also these (HF_TOKEN only with a tokenSecret).
RESERVED_HUB_ENV: Final = (ENV_HF_HOME, ENV_HF_TOKEN)
