# SPDX-License-Identifier: Apache-2.0
"""Operator start-up: kopf settings that keep kopf's bookkeeping out of our API, the login, and the
operator's edge: what the fleets' reconcilers are given (the API client, the planner's settings read
once from the environment) goes into kopf's memo here."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import kopf

from corefleet_operator import constants
from corefleet_operator.handlers.fleet import QuietWakeups
from corefleet_operator.kube import Kube
from corefleet_operator.planner import PlanSettings

# Tests only: every recovery backoff is multiplied by this (e.g. 0.1: 0, 1 s, 2 s, ...), so that a crash loop
# runs through its budget in seconds. Read from the operator's environment once, at start-up; 1 unless set.
BACKOFF_SCALE_ENV = "COREFLEET_RECOVERY_BACKOFF_SCALE"


def plan_settings(environ: Mapping[str, str]) -> PlanSettings:
    """The planner's settings from the operator's environment."""
    return PlanSettings(backoff_scale=float(environ.get(BACKOFF_SCALE_ENV) or 1.0))


def configure_settings(settings: kopf.OperatorSettings) -> None:
    """Apply corefleet's kopf settings (a plain function, so tests can check it directly)."""
    # Progress and diff-base live in annotations under our own prefix, never in status.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=constants.KOPF_ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=constants.KOPF_ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = constants.FINALIZER
    # Bounded watches and requests: a silent connection never stalls the operator.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    settings.networking.connect_timeout = 30

    # Server-side filtering: the operator only ever receives the children it manages.
    owned = f"{constants.LABEL_MANAGED_BY}={constants.MANAGED_BY}"
    for resource in ("pods", "services", "secrets", "networkpolicies", "poddisruptionbudgets"):
        settings.watching.label_selectors[resource] = owned


def connection_info() -> kopf.ConnectionInfo:
    """Credentials through the Kubernetes client library: in-cluster service account, else kubeconfig.

    Unlike kopf's `login_via_client`, the kubeconfig path is read from $KUBECONFIG when this runs
    (the library reads the variable once, when it is imported). Bearer tokens, client certificates
    and exec/auth-provider plugins all end up in the library's Configuration, read here. Both kopf's
    own connection (`login`) and the reconcilers' API client (`kube.Kube`) log in with it.
    """
    import kubernetes.client
    import kubernetes.config

    cfg = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    except kubernetes.config.ConfigException:
        path = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
        try:
            kubernetes.config.load_kube_config(config_file=path,  # type: ignore[no-untyped-call]
                                               client_configuration=cfg)
        except kubernetes.config.ConfigException as e:
            raise kopf.LoginError(f"no Kubernetes credentials in-cluster or in {path}: {e}") from e
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        scheme=scheme or None,
        token=token or None,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    return connection_info()


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    configure_settings(settings)
    objects_log = logging.getLogger("kopf.objects")
    if not any(isinstance(f, QuietWakeups) for f in objects_log.filters):
        objects_log.addFilter(QuietWakeups())
    memo.kube = Kube(login=connection_info)
    memo.plan_settings = plan_settings(os.environ)  # the one read of the environment's knobs
    memo.wakeups = {}  # (namespace, name) -> the fleet daemon's wake-up event


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    kube = getattr(memo, "kube", None)
    if kube is not None:
        await kube.close()
