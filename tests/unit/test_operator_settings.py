# SPDX-License-Identifier: Apache-2.0
"""kopf's bookkeeping stays under corefleet's prefix, and its watches are bounded; the operator's knobs
are read from its environment once, at start-up."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, cast

import kopf
import pytest

from corefleet_operator import constants
from corefleet_operator.handlers.lifecycle import BACKOFF_SCALE_ENV, configure_settings, plan_settings, startup
from corefleet_operator.planner import PlanSettings


def test_kopf_bookkeeping_uses_our_prefix_and_finalizer() -> None:
    settings = kopf.OperatorSettings()
    configure_settings(settings)

    assert settings.persistence.finalizer == "corefleet.io/finalizer"
    progress = settings.persistence.progress_storage
    assert isinstance(progress, kopf.AnnotationsProgressStorage)
    assert progress.prefix == constants.KOPF_ANNOTATION_PREFIX
    diffbase = settings.persistence.diffbase_storage
    assert isinstance(diffbase, kopf.AnnotationsDiffBaseStorage)
    assert diffbase.prefix == constants.KOPF_ANNOTATION_PREFIX
    # No status-based storage: our status is a designed API.
    assert not isinstance(progress, kopf.StatusProgressStorage | kopf.SmartProgressStorage)


def test_watches_and_requests_are_bounded() -> None:
    settings = kopf.OperatorSettings()
    configure_settings(settings)

    assert settings.watching.server_timeout is not None
    assert settings.watching.client_timeout is not None
    assert settings.watching.client_timeout > settings.watching.server_timeout
    assert settings.networking.request_timeout is not None


def test_names_are_derived_from_the_group() -> None:
    assert constants.CRD_NAME == "enginecoresets.corefleet.io"
    assert constants.API_VERSION == "corefleet.io/v1alpha1"
    for label in (constants.LABEL_FLEET, constants.LABEL_ROLE, constants.LABEL_RANK):
        assert label.startswith("corefleet.io/")


def test_the_planners_settings_are_read_from_the_environment_at_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    assert plan_settings({}) == PlanSettings(backoff_scale=1.0)
    monkeypatch.setenv(BACKOFF_SCALE_ENV, "0.2")
    memo = kopf.Memo()
    # kopf's decorator declares the handler as its ActivityFn protocol (every keyword kopf passes); it returns the
    # coroutine function itself, called here with the two arguments it reads.
    handler = cast("Callable[..., Coroutine[Any, Any, None]]", startup)
    asyncio.run(handler(settings=kopf.OperatorSettings(), memo=memo))

    assert memo.plan_settings == PlanSettings(backoff_scale=0.2)  # what every fleet's reconciler is given
