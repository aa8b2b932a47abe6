# SPDX-License-Identifier: Apache-2.0
"""The operator's per-fleet series: sizes, phase, resizes counted once, a deleted fleet's series removed."""

from __future__ import annotations

from typing import get_args

from prometheus_client import REGISTRY

from corefleet_operator.metrics import FleetMetrics
from corefleet_operator.models import FleetPhase, OperationStatus


def value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def op(phase: str, frm: int = 2, to: int = 3, *, replace: tuple[int, ...] = ()) -> OperationStatus:
    done = phase in ("Completed", "Failed")
    return OperationStatus(id="r1", fromReplicas=frm, toReplicas=to, phase=phase,  # type: ignore[arg-type]
                           startedAt="2026-12-02T10:00:00+00:00",
                           finishedAt="2026-12-02T10:00:12+00:00" if done else None, replace=replace)


def publish(m: FleetMetrics, fleet: str, operation: OperationStatus | None, phase: str = "Running") -> None:
    m.publish("ns", fleet, phase=phase, desired=3, committed=2, ready=2, maximum=4, recoveries=1,
              operation=operation)


def test_sizes_phase_and_recoveries() -> None:
    m = FleetMetrics(get_args(FleetPhase))
    publish(m, "sizes", None, phase="Scaling")
    assert value("corefleet_fleet_ranks_desired", namespace="ns", fleet="sizes") == 3
    assert value("corefleet_fleet_ranks_committed", namespace="ns", fleet="sizes") == 2
    assert value("corefleet_fleet_ranks_ready", namespace="ns", fleet="sizes") == 2
    assert value("corefleet_fleet_ranks_max", namespace="ns", fleet="sizes") == 4
    assert value("corefleet_fleet_recoveries", namespace="ns", fleet="sizes") == 1
    assert value("corefleet_fleet_phase", namespace="ns", fleet="sizes", phase="Scaling") == 1
    assert value("corefleet_fleet_phase", namespace="ns", fleet="sizes", phase="Running") == 0


def test_a_resize_seen_running_then_done_is_counted_once_with_its_duration() -> None:
    m = FleetMetrics(get_args(FleetPhase))
    publish(m, "grow", op("Preparing"))
    assert value("corefleet_fleet_resize_in_progress", namespace="ns", fleet="grow") == 1
    publish(m, "grow", op("Completed"))
    publish(m, "grow", op("Completed"))  # the next reconciles see it again
    labels = {"namespace": "ns", "fleet": "grow", "direction": "up", "result": "completed"}
    assert value("corefleet_resize_operations_total", **labels) == 1
    assert value("corefleet_resize_duration_seconds_sum", **labels) == 12
    assert value("corefleet_fleet_resize_in_progress", namespace="ns", fleet="grow") == 0


def test_a_resize_already_done_when_first_seen_is_not_counted() -> None:
    """After an operator restart the last operation is in the status: the process that saw it end counted it.
    Every direction and result starts at 0 (an alert on increase() sees the first failure)."""
    m = FleetMetrics(get_args(FleetPhase))
    publish(m, "restarted", op("Failed", 3, 1))
    for direction in ("up", "down", "replace"):
        for result in ("completed", "failed"):
            assert value("corefleet_resize_operations_total", namespace="ns", fleet="restarted", direction=direction,
                         result=result) == 0


def test_directions() -> None:
    m = FleetMetrics(get_args(FleetPhase))
    for fleet, operation in (("d-down", op("Draining", 3, 2)), ("d-replace", op("Preparing", 2, 2, replace=(1,)))):
        publish(m, fleet, operation)
        publish(m, fleet, OperationStatus(**{**operation.__dict__, "phase": "Failed",
                                             "finishedAt": "2026-12-02T10:01:00+00:00"}))
    assert value("corefleet_resize_operations_total", namespace="ns", fleet="d-down", direction="down",
                 result="failed") == 1
    assert value("corefleet_resize_operations_total", namespace="ns", fleet="d-replace", direction="replace",
                 result="failed") == 1


def test_forget_removes_every_series_of_the_fleet() -> None:
    m = FleetMetrics(get_args(FleetPhase))
    publish(m, "gone", op("Preparing"))
    publish(m, "gone", op("Completed"))
    publish(m, "kept", None)
    m.forget("ns", "gone")
    text = "\n".join(f"{s.name}{s.labels}" for family in REGISTRY.collect() for s in family.samples)
    assert "'fleet': 'gone'" not in text
    assert "'fleet': 'kept'" in text
