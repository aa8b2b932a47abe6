# SPDX-License-Identifier: Apache-2.0
"""Operator start-up: kopf settings that keep kopf's bookkeeping out of our API."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from corefleet_operator import constants
from corefleet_operator.handlers.fleet import QuietWakeups
from corefleet_operator.kube import Kube, connection_info


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


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    return connection_info()


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    configure_settings(settings)
    objects_log = logging.getLogger("kopf.objects")
    if not any(isinstance(f, QuietWakeups) for f in objects_log.filters):
        objects_log.addFilter(QuietWakeups())
    memo.kube = Kube()
    memo.wakeups = {}  # (namespace, name) -> the fleet daemon's wake-up event


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    kube = getattr(memo, "kube", None)
    if kube is not None:
        await kube.close()
