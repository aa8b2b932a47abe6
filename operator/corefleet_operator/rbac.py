# SPDX-License-Identifier: Apache-2.0
"""Every Kubernetes permission the operator uses, in one list, with the reason for each.

`PERMISSIONS` is the one source of truth for the operator's RBAC: `corefleet_operator.generate`
builds manifests/rbac.yaml and the Helm chart's ClusterRole from it, and the integration tests
check each entry with `kubectl auth can-i` as the operator's service account. A new API call in
the operator needs a line here (and `python -m corefleet_operator.generate`), nothing else.

Pure module: no kopf, no Kubernetes client, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from corefleet_operator import constants

JSON = dict[str, Any]

READ = ("get", "list", "watch")
# Children are written by server-side apply (PATCH with a field manager); create is for the
# first write of objects the operator names itself, delete for retired ranks and cleanup.
OWN = (*READ, "create", "patch", "delete")


@dataclass(frozen=True)
class Permission:
    """One ClusterRole rule: `verbs` on `resources` of `api_groups` ("" is the core group)."""

    api_groups: tuple[str, ...]
    resources: tuple[str, ...]
    verbs: tuple[str, ...]
    why: str

    def rule(self) -> JSON:
        """The rule as it appears in a ClusterRole."""
        return {"apiGroups": list(self.api_groups), "resources": list(self.resources), "verbs": list(self.verbs)}


PERMISSIONS: tuple[Permission, ...] = (
    # ---- kopf itself ----------------------------------------------------------------------------
    Permission(("apiextensions.k8s.io",), ("customresourcedefinitions",), ("list", "watch"),
               "kopf scans CRDs to resolve the resources it serves"),
    Permission(("",), ("namespaces",), ("list", "watch"),
               "kopf lists namespaces, also when started with --namespace"),
    Permission(("",), ("events",), ("create", "patch"),
               "kopf posts events about handled objects (core API)"),
    Permission(("events.k8s.io",), ("events",), ("create", "patch"),
               "the same events through the newer events.k8s.io API (kopf 1.45 uses the core one)"),
    # ---- the EngineCoreSet API ------------------------------------------------------------------
    Permission((constants.GROUP,), (constants.PLURAL,), (*READ, "patch", "update"),
               "watch EngineCoreSets; patch the finalizer and kopf's annotations"),
    Permission((constants.GROUP,), (f"{constants.PLURAL}/status",), ("get", "patch", "update"),
               "write each EngineCoreSet's status once per reconcile"),
    Permission((constants.GROUP,), (f"{constants.PLURAL}/scale",), ("get",),
               "read the scale subresource (what kubectl scale and an HPA see)"),
    # ---- children a fleet owns ------------------------------------------------------------------
    Permission(("",), ("pods",), OWN,
               "one pod per data-parallel rank, plus the frontend and the coordinator (a pod stuck "
               "terminating on a lost node is deleted with no grace period)"),
    Permission(("",), ("pods/status",), ("get",),
               "read rank readiness reported by the kubelet"),
    Permission(("",), ("services",), OWN,
               "the frontend Service and the headless fleet Service"),
    Permission(("",), ("secrets",), OWN,
               "the bearer token of the frontend's admin API"),
    Permission(("networking.k8s.io",), ("networkpolicies",), OWN,
               "the optional fleet NetworkPolicy (spec.networkPolicy)"),
    Permission(("policy",), ("poddisruptionbudgets",), OWN,
               "the fleet's PodDisruptionBudget: a node drain evicts no healthy fleet pod"),
)


def rules() -> list[JSON]:
    """The ClusterRole's rules, one per permission, in the order above."""
    return [p.rule() for p in PERMISSIONS]


def service_account(namespace: str = constants.OPERATOR_NAMESPACE) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": constants.OPERATOR_NAME, "namespace": namespace, "labels": labels()},
    }


def cluster_role() -> JSON:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": constants.OPERATOR_NAME, "labels": labels()},
        "rules": rules(),
    }


def cluster_role_binding(namespace: str = constants.OPERATOR_NAMESPACE) -> JSON:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": constants.OPERATOR_NAME, "labels": labels()},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": constants.OPERATOR_NAME},
        "subjects": [{"kind": "ServiceAccount", "name": constants.OPERATOR_NAME, "namespace": namespace}],
    }


def labels() -> dict[str, str]:
    """Labels of every object of the operator's own install."""
    return {constants.OPERATOR_APP_LABEL: constants.OPERATOR_NAME, "app.kubernetes.io/part-of": "corefleet"}
