# SPDX-License-Identifier: Apache-2.0
"""The one place for names shared across corefleet: API group, labels, annotations, ports, env.

Names of children are derived from the EngineCoreSet's name, never discovered. Nothing here
imports kopf or a Kubernetes client (checked by the import contract in pyproject.toml).
"""

from __future__ import annotations

from typing import Final

# --- API -------------------------------------------------------------------------------------
GROUP: Final = "corefleet.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "EngineCoreSet"
PLURAL: Final = "enginecoresets"
SINGULAR: Final = "enginecoreset"
SHORT_NAMES: Final = ("ecs",)
CRD_NAME: Final = f"{PLURAL}.{GROUP}"

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

# --- Ports (fixed, so names and addresses are derived, not discovered) -------------------------
FRONTEND_HTTP_PORT: Final = 8000
FRONTEND_ADMIN_PORT: Final = 8001
DP_RPC_PORT: Final = 29550  # the engines' handshake ROUTER on the frontend (--data-parallel-rpc-port)
OPERATOR_HEALTH_PORT: Final = 8080
OPERATOR_METRICS_PORT: Final = 9090
