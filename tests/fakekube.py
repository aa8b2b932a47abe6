# SPDX-License-Identifier: Apache-2.0
"""A fake API server for the executor's and the reconciler's unit tests: the `kube.Kube` verbs they use,
against a dict of objects, every call recorded in order; writes of chosen names refused."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from corefleet_operator.kube import KubeError

QUOTA = 'pods "a-engine-0" is forbidden: exceeded quota: q, requested: pods=1, used: pods=0, limited: pods=0'


def refused(status: int, message: str) -> KubeError:
    return KubeError("POST", "/api/v1/namespaces/ns/pods", status, json.dumps({"message": message}))


class FakeKube:
    """The Kube verbs the reconciler uses, against a dict of objects; records every call in order."""

    def __init__(self, objects: dict[tuple[str, str], dict[str, Any]] | None = None,
                 refuse: Mapping[str, KubeError] | None = None) -> None:
        self.objects = objects or {}
        self.refuse = dict(refuse or {})  # object name -> the error its write gets
        self.calls: list[tuple[str, str]] = []

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        name = obj["metadata"]["name"]
        self.calls.append(("create", name))
        if name in self.refuse:
            raise self.refuse[name]
        if (obj["kind"], name) in self.objects:
            raise KubeError("POST", "/x", 409, json.dumps({"message": f"{name} already exists"}))
        self.objects[(obj["kind"], name)] = dict(obj)
        return dict(obj)

    async def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        name = obj["metadata"]["name"]
        self.calls.append(("apply", name))
        if name in self.refuse:
            raise self.refuse[name]
        self.objects[(obj["kind"], name)] = dict(obj)
        return dict(obj)

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append(("get", name))
        return self.objects.get((kind, name))

    async def delete(self, api_version: str, kind: str, namespace: str, name: str, uid: str, *,
                     grace_period_seconds: int | None = None) -> bool:
        self.calls.append(("delete" if grace_period_seconds is None else f"delete/{grace_period_seconds}", name))
        return self.objects.pop((kind, name), None) is not None

    async def patch_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        self.calls.append(("status", name))
        return {}
