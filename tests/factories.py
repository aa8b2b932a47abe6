# SPDX-License-Identifier: Apache-2.0
"""A small fluent factory for EngineCoreSets in tests.

    fleet = make_ecs("a").replicas(4).tp(2).expert_parallel().arg("--max-model-len=256").obj()

`obj()` parses the spec through the real model (`EngineCoreSetSpec.parse`, so an invalid spec fails
here as it would in the operator) and returns a `FleetRef` in namespace "ns" with a uid derived from
namespace and name (stable across runs). `raw()` returns the EngineCoreSet object as the operator
receives it; `manifest()` the same without server-set fields, to apply to a real API server.
Anything without a helper: `.set("engine.shmSize", "1Gi")`.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from corefleet_operator import constants
from corefleet_operator.models import EngineCoreSetSpec, FleetRef

DEFAULT_MODEL = "corefleet/tiny-llama"
DEFAULT_IMAGE = "ghcr.io/corefleet/runtime:test"


class EcsFactory:
    def __init__(self, name: str, namespace: str = "ns") -> None:
        self._name = name
        self._namespace = namespace
        self._spec: dict[str, Any] = {"model": DEFAULT_MODEL, "image": DEFAULT_IMAGE}

    # -- generic -----------------------------------------------------------------------------
    def set(self, path: str, value: Any) -> EcsFactory:
        """Set a spec field by its dotted path (`"scaling.drainTimeoutSeconds"`)."""
        *parents, leaf = path.split(".")
        node = self._spec
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = copy.deepcopy(value)
        return self

    def namespace(self, namespace: str) -> EcsFactory:
        self._namespace = namespace
        return self

    # -- common fields -----------------------------------------------------------------------
    def model(self, model: str) -> EcsFactory:
        return self.set("model", model)

    def image(self, image: str) -> EcsFactory:
        return self.set("image", image)

    def replicas(self, n: int) -> EcsFactory:
        return self.set("replicas", n)

    def max_replicas(self, n: int) -> EcsFactory:
        return self.set("maxReplicas", n)

    def tp(self, n: int) -> EcsFactory:
        return self.set("engine.tensorParallelSize", n)

    def expert_parallel(self, on: bool = True) -> EcsFactory:
        return self.set("expertParallel", on)

    def arg(self, *args: str) -> EcsFactory:
        """Append extra vLLM flags (spec.engine.args)."""
        engine = self._spec.setdefault("engine", {})
        engine["args"] = [*engine.get("args", []), *args]
        return self

    def env(self, name: str, value: str) -> EcsFactory:
        engine = self._spec.setdefault("engine", {})
        engine["env"] = [*engine.get("env", []), {"name": name, "value": value}]
        return self

    def network_policy(self, on: bool = True) -> EcsFactory:
        return self.set("networkPolicy", on)

    def storage(self, **storage: Any) -> EcsFactory:
        """spec.storage, e.g. `.storage(pvc={"claimName": "weights"})`."""
        return self.set("storage", storage)

    def pod_template(self, role: str, template: dict[str, Any]) -> EcsFactory:
        """spec.<role>.podTemplate (role: engine, frontend or coordinator)."""
        return self.set(f"{role}.podTemplate", template)

    # -- results -----------------------------------------------------------------------------
    @property
    def uid(self) -> str:
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"corefleet-test/{self._namespace}/{self._name}"))

    def spec(self) -> dict[str, Any]:
        """The spec as written (a copy), without defaults."""
        return copy.deepcopy(self._spec)

    def obj(self) -> FleetRef:
        return FleetRef(name=self._name, namespace=self._namespace, uid=self.uid,
                        spec=EngineCoreSetSpec.parse(self._spec))

    def manifest(self) -> dict[str, Any]:
        """The EngineCoreSet to apply to an API server (no server-set metadata)."""
        return {
            "apiVersion": constants.API_VERSION,
            "kind": constants.KIND,
            "metadata": {"name": self._name, "namespace": self._namespace},
            "spec": self.spec(),
        }

    def raw(self) -> dict[str, Any]:
        """The EngineCoreSet as the operator receives it (with uid and generation)."""
        body = self.manifest()
        body["metadata"].update(uid=self.uid, generation=1)
        return body


def make_ecs(name: str, namespace: str = "ns") -> EcsFactory:
    return EcsFactory(name, namespace)


def full_pod_template(container: str) -> dict[str, Any]:
    """A podTemplate with every field a user may set, for the role whose container is `container`."""
    return {
        "metadata": {"labels": {"team": "search", "sidecar.istio.io/inject": "false"},
                     "annotations": {"prometheus.io/scrape": "false", "cost-center": "ml-42"}},
        "spec": {
            "imagePullSecrets": [{"name": "registry"}],
            "serviceAccountName": "inference",
            "automountServiceAccountToken": True,
            "runtimeClassName": "nvidia",
            "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                           "whenUnsatisfiable": "ScheduleAnyway",
                                           "labelSelector": {"matchLabels": {"corefleet.io/fleet": "a"}}}],
            "volumes": [{"name": "extra", "configMap": {"name": "extra"}}, {"name": "logs", "emptyDir": {}}],
            "initContainers": [{"name": "warm", "image": "busybox:1.36", "command": ["true"]}],
            "containers": [
                {"name": container,
                 "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                 "envFrom": [{"configMapRef": {"name": "vllm-env"}}],
                 "volumeMounts": [{"name": "extra", "mountPath": "/etc/extra", "readOnly": True},
                                  {"name": "logs", "mountPath": "/var/log/vllm"}],
                 "securityContext": {"readOnlyRootFilesystem": True},
                 "imagePullPolicy": "Always",
                 "workingDir": "/work"},
                {"name": "log-shipper", "image": "fluent/fluent-bit:3.0", "args": ["-c", "/etc/extra/fb.conf"],
                 "resources": {"requests": {"cpu": "50m"}},
                 "volumeMounts": [{"name": "logs", "mountPath": "/logs", "readOnly": True}]},
            ],
            "securityContext": {"runAsUser": 2000, "supplementalGroups": [3000]},
            "terminationGracePeriodSeconds": 90,
            "dnsPolicy": "ClusterFirst",
            "dnsConfig": {"options": [{"name": "ndots", "value": "2"}]},
            "hostAliases": [{"ip": "10.0.0.9", "hostnames": ["mirror.local"]}],
            "nodeSelector": {"gpu": "h200"},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]}]}}},
            "priorityClassName": "high",
        },
    }
