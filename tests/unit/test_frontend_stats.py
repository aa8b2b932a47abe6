# SPDX-License-Identifier: Apache-2.0
"""Stat loggers that follow the fleet's ranks (frontend.stats): values carried over a rebuild, records
of unknown ranks dropped."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from corefleet_client.frontend.stats import FleetStatLoggers, carry_over


def collectors(registry: CollectorRegistry) -> dict[str, Any]:
    labels = ["model_name", "engine"]
    return {
        "vllm:request_success": Counter("vllm:request_success", "d", [*labels, "finished_reason"],
                                        registry=registry),
        "vllm:num_requests_running": Gauge("vllm:num_requests_running", "d", labels, registry=registry),
        "vllm:e2e_request_latency_seconds": Histogram("vllm:e2e_request_latency_seconds", "d", labels,
                                                      buckets=(0.1, 1.0), registry=registry),
        "vllm:admission_rejections": Counter("vllm:admission_rejections", "d", registry=registry),
    }


def test_values_of_the_ranks_that_stay_are_carried_over() -> None:
    old_registry, new_registry = CollectorRegistry(), CollectorRegistry()
    old = collectors(old_registry)
    for engine in ("0", "1", "2"):
        old["vllm:request_success"].labels("tiny", engine, "length").inc(10 + int(engine))
        old["vllm:num_requests_running"].labels("tiny", engine).set(3)
        for seconds in (0.05, 0.5, 5.0):
            old["vllm:e2e_request_latency_seconds"].labels("tiny", engine).observe(seconds)
    old["vllm:admission_rejections"].inc(4)
    new = collectors(new_registry)

    copied = carry_over(old, new, ranks={"0", "1"})  # rank 2 left

    assert copied == 2 * 3 + 1
    text = generate_latest(new_registry).decode()
    assert 'vllm:request_success_total{engine="1",finished_reason="length",model_name="tiny"} 11.0' in text
    assert 'vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="tiny"} 2.0' in text
    assert 'vllm:e2e_request_latency_seconds_count{engine="0",model_name="tiny"} 3.0' in text
    assert 'vllm:e2e_request_latency_seconds_sum{engine="0",model_name="tiny"} 5.55' in text
    assert "vllm:admission_rejections_total 4.0" in text
    assert 'engine="2"' not in text  # the retired rank's series are gone


class Manager:
    def __init__(self) -> None:
        self.records: list[int | None] = []

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int | None = None) -> None:
        self.records.append(engine_idx)


def test_records_of_ranks_outside_the_fleet_are_dropped() -> None:
    manager = Manager()
    loggers = FleetStatLoggers(manager, 2, {})
    for engine in (0, 1, 2, None):
        loggers.record(None, None, engine_idx=engine)
    assert manager.records == [0, 1, None]
    assert loggers.dropped == 1
    assert loggers.engine_indexes == [0, 1]
