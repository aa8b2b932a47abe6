# SPDX-License-Identifier: Apache-2.0
"""The one thin adapter between corefleet and the Kubernetes API.

Server-side apply with a fixed field manager, plain creates (pods, which are never changed in
place), reads of single objects, deletes by name with a UID precondition (forced, with no grace
period, for pods whose node is lost), status merge patches; 404/409 handling and logging in one
place; every request counted (by verb, resource and code) in the operator's metrics. Credentials
come from the `login` it is given (the operator's: `handlers.lifecycle.connection_info`, in-cluster
service account or kubeconfig) and are refreshed on 401.

No kopf here (the executor and the reconciler use this module and never import kopf): kopf's
`ConnectionInfo` is read through the `Credentials` protocol.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import aiohttp

from corefleet_operator import constants, metrics

logger = logging.getLogger(__name__)

# kind -> plural, for the objects corefleet reads and writes.
PLURALS = {
    "Pod": "pods",
    "Service": "services",
    "Secret": "secrets",
    "NetworkPolicy": "networkpolicies",
    "PodDisruptionBudget": "poddisruptionbudgets",
    constants.KIND: constants.PLURAL,
}


class KubeError(RuntimeError):
    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        try:
            detail = json.loads(body).get("message", body)
        except ValueError:
            detail = body
        super().__init__(f"{method} {path}: {status} {detail}")
        self.status = status
        self.detail = detail


def object_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{PLURALS[kind]}"
    return f"{path}/{name}" if name else path


def resource_of(path: str) -> str:
    """`/api/v1/namespaces/ns/pods/p/status` -> `pods/status` (for counting requests)."""
    parts = path.split("?")[0].strip("/").split("/")
    if "namespaces" in parts and len(parts) > parts.index("namespaces") + 2:
        parts = parts[parts.index("namespaces") + 2:]
    else:
        parts = parts[2:] if parts[0] == "api" else parts[3:]
    return "/".join(parts[:1] + parts[2:3])


FilePath = str | bytes | os.PathLike[str] | os.PathLike[bytes]


class Credentials(Protocol):
    """Where the API server is and how to authenticate to it (the fields of kopf's `ConnectionInfo` read here)."""

    @property
    def server(self) -> str: ...
    @property
    def ca_path(self) -> FilePath | None: ...
    @property
    def ca_data(self) -> str | bytes | None: ...
    @property
    def insecure(self) -> bool | None: ...
    @property
    def scheme(self) -> str | None: ...
    @property
    def token(self) -> str | None: ...
    @property
    def certificate_path(self) -> FilePath | None: ...
    @property
    def private_key_path(self) -> FilePath | None: ...


class Kube:
    """An aiohttp client for the API server, created inside kopf's event loop.

    `login` (a blocking call, run off the event loop) gives the credentials, when the first request
    is made and again after a 401; `info`, if given, is used first."""

    def __init__(self, login: Callable[[], Credentials], info: Credentials | None = None, *,
                 timeout: float = 30.0) -> None:
        self._login_call = login
        self._info = info
        self._session: aiohttp.ClientSession | None = None
        # Bounds on each connection's I/O, not on the whole request: when many fleets reconcile at
        # once, requests queue for one of the pool's connections, and a total timeout counted that
        # wait (at 200 fleets, hundreds of reconciles failed with TimeoutError while queued).
        self._timeout = aiohttp.ClientTimeout(sock_connect=timeout, sock_read=timeout)
        self._lock = asyncio.Lock()

    async def _login(self) -> Credentials:
        return await asyncio.to_thread(self._login_call)

    async def _ensure(self) -> aiohttp.ClientSession:
        async with self._lock:
            if self._session is None:
                info = self._info or await self._login()
                self._info = info
                ctx = ssl.create_default_context()
                if info.ca_path:
                    ctx.load_verify_locations(cafile=str(info.ca_path))
                elif info.ca_data:
                    data = info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data
                    ctx.load_verify_locations(cadata=data)
                if info.insecure:
                    ctx.check_hostname = False
                    ctx.verify_mode = ssl.CERT_NONE
                if info.certificate_path and info.private_key_path:
                    ctx.load_cert_chain(str(info.certificate_path), str(info.private_key_path))
                headers = {"Authorization": f"{info.scheme or 'Bearer'} {info.token}"} if info.token else {}
                self._session = aiohttp.ClientSession(
                    base_url=info.server.rstrip("/"), headers=headers, timeout=self._timeout,
                    connector=aiohttp.TCPConnector(ssl=ctx, limit=20),
                )
            return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, path: str, *, body: Any = None, content_type: str = "application/json",
                      params: Mapping[str, str] | None = None) -> dict[str, Any]:
        resource = resource_of(path)
        for attempt in (1, 2):
            session = await self._ensure()
            data = None if body is None else json.dumps(body)
            async with session.request(method, path, data=data, params=params,
                                       headers={"Content-Type": content_type}) as resp:
                text = await resp.text()
                metrics.API_REQUESTS.labels(method, resource, str(resp.status)).inc()
                if resp.status == 401 and attempt == 1 and self._info is not None:
                    logger.info("401 from the API server: logging in again")
                    await self.close()
                    self._info = None
                    continue
                if resp.status >= 400:
                    raise KubeError(method, path, resp.status, text)
                result: dict[str, Any] = json.loads(text) if text else {}
                return result
        raise AssertionError("unreachable")  # pragma: no cover

    # ---- the verbs corefleet uses -------------------------------------------------------------
    async def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply (create or converge) with corefleet's field manager."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        return await self.request("PATCH", path, body=obj, content_type="application/apply-patch+yaml",
                                  params={"fieldManager": constants.FIELD_MANAGER, "force": "true"})

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create (POST): fails with 409 AlreadyExists instead of taking over an object of that name."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta["namespace"])
        return await self.request("POST", path, body=obj, params={"fieldManager": constants.FIELD_MANAGER})

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None if there is none of that name."""
        try:
            return await self.request("GET", object_path(api_version, kind, namespace, name))
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    async def delete(self, api_version: str, kind: str, namespace: str, name: str, uid: str, *,
                     grace_period_seconds: int | None = None) -> bool:
        """Delete exactly this object; False if it was already gone or replaced by another UID.

        `grace_period_seconds=0` on a pod removes it at once, without waiting for its kubelet to
        confirm (for a pod whose node is lost)."""
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        if grace_period_seconds is not None:
            body["gracePeriodSeconds"] = grace_period_seconds
        try:
            await self.request("DELETE", object_path(api_version, kind, namespace, name), body=body)
        except KubeError as e:
            if e.status in (404, 409):  # gone, or the name now belongs to a newer object
                return False
            raise
        return True

    async def patch_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        path = object_path(constants.API_VERSION, constants.KIND, namespace, name) + "/status"
        return await self.request("PATCH", path, body={"status": patch},
                                  content_type="application/merge-patch+json")
