# SPDX-License-Identifier: Apache-2.0
"""The operator's Prometheus metrics (served by `python -m corefleet_operator --metrics-port`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter("corefleet_reconciles", "Reconciles of an EngineCoreSet, by result", ["result"])
RECONCILE_SECONDS = Histogram("corefleet_reconcile_duration_seconds", "Time of one reconcile",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
API_REQUESTS = Counter("corefleet_api_requests", "Requests to the Kubernetes API by the reconcilers",
                       ["verb", "resource", "code"])
FLEETS = Gauge("corefleet_fleets", "EngineCoreSets with a running reconciler")
FLEET_PHASE = Gauge("corefleet_fleet_phase", "1 for the phase each fleet is in", ["namespace", "name", "phase"])
RECOVERIES = Gauge("corefleet_fleet_recoveries", "status.recoveries of each fleet", ["namespace", "name"])
