# SPDX-License-Identifier: Apache-2.0
"""AsyncLLM's stat loggers for a fleet whose ranks change while it serves.

vLLM builds one `StatLoggerManager` for the engine indexes it starts with, and its Prometheus
logger keeps per-engine label children for exactly those: a record for another index raises in
AsyncLLM's output handler, which fails every request and takes the frontend down (vLLM 0.32.0
`v1/metrics/loggers.py` `PrometheusStatLogger.record`, `v1/engine/async_llm.py` output_handler).
Its own elastic path rebuilds the manager after a scale-up and thereby resets every counter and
histogram (a "TODO" upstream), and never drops a removed rank's series.

`FleetStatLoggers` stands in for the manager (AsyncLLM reads it through `logger_manager` and the
output handler's `_logger_ref`):

* `record` drops stats of an engine index outside the fleet's ranks instead of raising: a new rank
  before it is committed, or a retired rank's last outputs;
* `resize(n)` builds vLLM's manager anew for ranks 0..n-1 and carries every vLLM collector's
  values over for the ranks that stay (counters and histograms continue instead of resetting);
  the series of ranks that left are gone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import REGISTRY
from vllm.v1.metrics.loggers import StatLoggerManager

logger = logging.getLogger("corefleet.frontend")

VLLM_METRIC_PREFIX = "vllm:"
ENGINE_LABEL = "engine"
# The value holders prometheus_client's metric children keep (Counter/Gauge: _value; Histogram:
# _sum and _buckets; Summary: _count and _sum), and the creation time of counters.
_VALUES = ("_value", "_sum", "_count")


def vllm_collectors() -> dict[str, Any]:
    """The vLLM collectors registered now, by metric name."""
    out = {}
    for collector in list(REGISTRY._collector_to_names):
        name = getattr(collector, "_name", "")
        if isinstance(name, str) and name.startswith(VLLM_METRIC_PREFIX):
            out[name] = collector
    return out


def _copy_values(old: Any, new: Any) -> None:
    for attr in _VALUES:
        src, dst = getattr(old, attr, None), getattr(new, attr, None)
        if src is not None and dst is not None:
            dst.set(src.get())
    old_buckets, new_buckets = getattr(old, "_buckets", None), getattr(new, "_buckets", None)
    if old_buckets is not None and new_buckets is not None and \
            getattr(old, "_upper_bounds", None) == getattr(new, "_upper_bounds", None):
        for src, dst in zip(old_buckets, new_buckets, strict=True):
            dst.set(src.get())
    if hasattr(old, "_created") and hasattr(new, "_created"):
        new._created = old._created


def carry_over(old: dict[str, Any], new: dict[str, Any], ranks: set[str]) -> int:
    """Copy each old collector's values into the new collector of the same name and kind, for the
    label sets whose `engine` is still a rank (or that have no engine label); how many were copied."""
    copied = 0
    for name, new_collector in new.items():
        old_collector = old.get(name)
        if old_collector is None or old_collector is new_collector or type(old_collector) is not type(new_collector):
            continue
        labelnames = tuple(getattr(old_collector, "_labelnames", ()))
        if labelnames != tuple(getattr(new_collector, "_labelnames", ())):
            continue
        if not labelnames:
            _copy_values(old_collector, new_collector)
            copied += 1
            continue
        engine_at = labelnames.index(ENGINE_LABEL) if ENGINE_LABEL in labelnames else None
        for labelvalues, child in list(getattr(old_collector, "_metrics", {}).items()):
            if engine_at is not None and labelvalues[engine_at] not in ranks:
                continue
            _copy_values(child, new_collector.labels(*labelvalues))
            copied += 1
    return copied


class FleetStatLoggers:
    """AsyncLLM's `logger_manager` for the fleet's current ranks (see the module docstring)."""

    def __init__(self, manager: StatLoggerManager, ranks: int, rebuild: dict[str, Any]) -> None:
        self._manager = manager
        self._ranks = frozenset(range(ranks))
        self._rebuild = rebuild  # StatLoggerManager's keyword arguments besides engine_idxs
        self.dropped = 0  # records of engine indexes outside the fleet
        # Told of each rank's finished requests (vLLM's FinishedRequestStats): their prefill cost, for the rank's stall
        # bound (`frontend.progress`).
        self.finished: Callable[[int, list[Any]], None] | None = None

    @property
    def engine_indexes(self) -> list[int]:
        return sorted(self._ranks)

    def resize(self, ranks: int) -> None:
        """vLLM's loggers for ranks 0..ranks-1, with the values of the ranks that stay."""
        old = vllm_collectors()
        manager = StatLoggerManager(engine_idxs=list(range(ranks)), **self._rebuild)
        copied = carry_over(old, vllm_collectors(), {str(r) for r in range(ranks)})
        manager.log_engine_initialized()
        self._manager, self._ranks = manager, frozenset(range(ranks))
        logger.info("Stat loggers rebuilt for %d rank(s); %d metric series carried over", ranks, copied)

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int | None = None) -> None:
        if (engine_idx or 0) not in self._ranks:
            self.dropped += 1
            return
        finished = getattr(iteration_stats, "finished_requests", None)
        if finished and self.finished is not None:
            self.finished(engine_idx or 0, finished)
        self._manager.record(scheduler_stats, iteration_stats, mm_cache_stats=mm_cache_stats, engine_idx=engine_idx)

    def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
        self._manager.record_sleep_state(sleep, level)

    def record_admission_rejection(self, reason: str) -> None:
        self._manager.record_admission_rejection(reason)

    def log(self) -> None:
        self._manager.log()

    def log_engine_initialized(self) -> None:
        self._manager.log_engine_initialized()
