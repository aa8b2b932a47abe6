# SPDX-License-Identifier: Apache-2.0
"""The operator's Prometheus metrics (served by `python -m corefleet_operator --metrics-port`).

Names follow Prometheus' conventions (base units, `_total` counters: prometheus_client adds the
suffix). Per-fleet series carry `namespace` and `fleet`; the chart's ServiceMonitor scrapes them with
honor_labels so these labels are the fleet's, not the operator pod's. A deleted fleet's series are
removed (`FleetMetrics.forget`). The alerts, recording rules and dashboards that read these names live
in charts/corefleet/files/ and are tested against a live Prometheus.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

from corefleet_operator.models import OperationStatus

RECONCILES = Counter("corefleet_reconciles", "Reconciles of an EngineCoreSet, by result", ["result"])
for _result in ("ok", "error"):
    RECONCILES.labels(_result)  # both from 0: an error ratio has data before the first error
RECONCILE_SECONDS = Histogram("corefleet_reconcile_duration_seconds", "Time of one reconcile",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
API_REQUESTS = Counter("corefleet_api_requests", "Requests to the Kubernetes API by the reconcilers",
                       ["verb", "resource", "code"])
FLEETS = Gauge("corefleet_fleets", "EngineCoreSets with a running reconciler")

_FLEET = ["namespace", "fleet"]
FLEET_PHASE = Gauge("corefleet_fleet_phase", "1 for the phase each fleet is in, 0 for the others",
                    [*_FLEET, "phase"])
RECOVERIES = Gauge("corefleet_fleet_recoveries", "status.recoveries: times the fleet was recreated after a loss",
                   _FLEET)
RANKS_DESIRED = Gauge("corefleet_fleet_ranks_desired", "spec.replicas: the data-parallel size asked for", _FLEET)
RANKS_COMMITTED = Gauge("corefleet_fleet_ranks_committed", "status.replicas: the size the fleet is committed to",
                        _FLEET)
RANKS_READY = Gauge("corefleet_fleet_ranks_ready", "status.readyReplicas: ranks serving", _FLEET)
RANKS_MAX = Gauge("corefleet_fleet_ranks_max", "spec.maxReplicas: the largest size the fleet may be resized to",
                  _FLEET)
RESIZE_IN_PROGRESS = Gauge("corefleet_fleet_resize_in_progress", "1 while a resize operation of the fleet runs",
                           _FLEET)
RESIZES = Counter("corefleet_resize_operations", "Resize operations finished, by direction (up, down, replace) "
                  "and result (completed, failed)", [*_FLEET, "direction", "result"])
RESIZE_SECONDS = Histogram("corefleet_resize_duration_seconds", "Time from a resize's start to its end",
                           [*_FLEET, "direction", "result"],
                           buckets=(1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 3600))

DIRECTIONS = ("up", "down", "replace")
RESULTS = ("completed", "failed")
_PER_FLEET: tuple[Gauge, ...] = (RECOVERIES, RANKS_DESIRED, RANKS_COMMITTED, RANKS_READY, RANKS_MAX,
                                 RESIZE_IN_PROGRESS)


def direction(operation: OperationStatus) -> str:
    """up, down, or replace (new pods for lost ranks, or for the frontend and/or coordinator, at the same size)."""
    if operation.replace or operation.members:
        return "replace"
    return "up" if operation.scale_up else "down"


def _seconds_between(start: str | None, end: str | None) -> float | None:
    try:
        if not start or not end:
            return None
        return max(0.0, (datetime.datetime.fromisoformat(end) - datetime.datetime.fromisoformat(start))
                   .total_seconds())
    except ValueError:
        return None


class FleetMetrics:
    """Publishes one operator's view of its fleets. A resize is counted once, when this process sees it
    go from running to finished: one already finished when first seen (the operator restarted, or a
    fleet it took over) was counted, if at all, by the process that saw it finish."""

    def __init__(self, phases: Iterable[str]) -> None:
        self.phases = tuple(phases)
        self._running: dict[tuple[str, str], str | None] = {}  # fleet -> id of the resize seen running

    def publish(self, namespace: str, fleet: str, *, phase: str, desired: int, committed: int, ready: int,
                maximum: int, recoveries: int, operation: OperationStatus | None) -> None:
        key = (namespace, fleet)
        for p in self.phases:
            FLEET_PHASE.labels(namespace, fleet, p).set(1 if phase == p else 0)
        RANKS_DESIRED.labels(namespace, fleet).set(desired)
        RANKS_COMMITTED.labels(namespace, fleet).set(committed)
        RANKS_READY.labels(namespace, fleet).set(ready)
        RANKS_MAX.labels(namespace, fleet).set(maximum)
        RECOVERIES.labels(namespace, fleet).set(recoveries)
        running = operation is not None and not operation.done
        RESIZE_IN_PROGRESS.labels(namespace, fleet).set(1 if running else 0)
        if key not in self._running:  # first seen: every count starts at 0, so rate() and increase() see the first
            for d in DIRECTIONS:
                for result in RESULTS:
                    RESIZES.labels(namespace, fleet, d, result)
        was = self._running.get(key)
        if operation is not None and operation.done and was == operation.id:
            result = "completed" if operation.phase == "Completed" else "failed"
            RESIZES.labels(namespace, fleet, direction(operation), result).inc()
            took = _seconds_between(operation.startedAt, operation.finishedAt)
            if took is not None:
                RESIZE_SECONDS.labels(namespace, fleet, direction(operation), result).observe(took)
        self._running[key] = operation.id if running and operation is not None else None

    def forget(self, namespace: str, fleet: str) -> None:
        """Drop a deleted fleet's series."""
        self._running.pop((namespace, fleet), None)
        with contextlib.suppress(KeyError):
            for p in self.phases:
                FLEET_PHASE.remove(namespace, fleet, p)
        for gauge in _PER_FLEET:
            with contextlib.suppress(KeyError):
                gauge.remove(namespace, fleet)
        for family in (RESIZES, RESIZE_SECONDS):
            for labels in [values for values in list(family._metrics) if values[:2] == (namespace, fleet)]:
                family.remove(*labels)

