# SPDX-License-Identifier: Apache-2.0
"""corefleet's own series on the frontend's `/metrics`, beside vLLM's.

vLLM's series say what each engine does (`engine` = the DP rank); these say what the frontend does
with each rank: its state in the fleet, the requests it routed there and has in flight, the ones
aborted or failed, the committed size and the phase of a resize. They are read from the `Fleet` at
scrape time (a collector, not values kept up to date), so a rank that has left the fleet (Retired, or
Failed to join) has no series from the next scrape on, and nothing is counted twice.

The engine label is the rank as vLLM writes it ("0", "1", ...), so the two sets join on it.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from corefleet_client.admin import RankState, ResizePhase
from corefleet_client.frontend.fleet import Fleet
from corefleet_client.frontend.hold import Hold, HoldCounts
from corefleet_client.frontend.types import Decision

PREFIX = "corefleet_frontend_"
IDLE = "Idle"  # the resize phase when none runs
# Ranks that are not members: their series go (vLLM's are dropped at the same point, frontend.stats).
GONE = (RankState.RETIRED, RankState.FAILED)
MEMBER_STATES = tuple(s for s in RankState if s not in GONE)
RESIZE_PHASES = (IDLE, *(p.value for p in ResizePhase if not p.terminal))


class FleetCollector(Collector):
    """The `corefleet_frontend_*` families of one frontend's fleet."""

    def __init__(self, fleet: Fleet, hold: Hold | None = None) -> None:
        self._fleet = fleet
        self._hold = hold

    def describe(self) -> list[Metric]:
        return []  # families are computed per scrape; nothing to check against at registration

    def collect(self) -> Iterator[Metric]:
        snap = self._fleet.snapshot()
        engine = ["engine"]
        state = GaugeMetricFamily(f"{PREFIX}rank_state", "1 for the state the rank is in (Joining, Serving, "
                                  "Draining, Unresponsive, Dead), 0 for the others", labels=[*engine, "state"])
        in_flight = GaugeMetricFamily(f"{PREFIX}rank_requests_in_flight",
                                      "Requests routed to the rank and not finished yet", labels=engine)
        routed = CounterMetricFamily(f"{PREFIX}rank_requests_routed", "Requests routed to the rank", labels=engine)
        aborted = CounterMetricFamily(f"{PREFIX}rank_requests_aborted",
                                      "Requests on the rank aborted by their client", labels=engine)
        failed = CounterMetricFamily(f"{PREFIX}rank_requests_failed",
                                     "Requests on the rank that got an error because the rank was lost",
                                     labels=engine)
        stalled = GaugeMetricFamily(f"{PREFIX}rank_stalled", "1 while the rank is Stalled: it ended no step within "
                                    "its stall bound, new requests go to the other ranks", labels=engine)
        stalls = CounterMetricFamily(f"{PREFIX}rank_stalls", "Times the rank turned Stalled", labels=engine)
        moved = CounterMetricFamily(f"{PREFIX}rank_requests_moved", "Requests moved to other ranks while the rank was "
                                    "Stalled, before they started", labels=engine)
        by_prefix = CounterMetricFamily(f"{PREFIX}rank_requests_routed_by_prefix", "Requests routed to the rank by "
                                        "prefix affinity: a prefix new to the frontend (new), to the rank holding "
                                        "their prefix (affinity), or because that rank was over its load bound (spill)",
                                        labels=[*engine, "decision"])
        for rank in snap.ranks:
            if rank.state in GONE:
                continue
            label = str(rank.rank)
            for s in MEMBER_STATES:
                state.add_metric([label, s.value], 1.0 if rank.state == s else 0.0)
            in_flight.add_metric([label], rank.in_flight)
            routed.add_metric([label], rank.requests_total)
            aborted.add_metric([label], rank.aborts_total)
            failed.add_metric([label], rank.failed_total)
            stalled.add_metric([label], 1.0 if rank.stalled else 0.0)
            stalls.add_metric([label], rank.stalls_total)
            moved.add_metric([label], rank.moved_total)
            by_prefix.add_metric([label, Decision.NEW.value], rank.new_prefix_total)
            by_prefix.add_metric([label, Decision.AFFINITY.value], rank.affinity_total)
            by_prefix.add_metric([label, Decision.SPILL.value], rank.spilled_total)
        yield from (state, in_flight, routed, aborted, failed, stalled, stalls, moved, by_prefix)
        yield GaugeMetricFamily(f"{PREFIX}ranks", "The committed data-parallel size", value=snap.data_parallel_size)
        if self._hold is not None:
            yield from hold_families(self._hold.counts)
        op = snap.resize
        current = IDLE if op is None or op.phase.terminal else op.phase.value
        phase = GaugeMetricFamily(f"{PREFIX}resize_phase", "1 for the phase of the resize that runs (Idle: none)",
                                  labels=["phase"])
        for p in RESIZE_PHASES:
            phase.add_metric([p], 1.0 if p == current else 0.0)
        yield phase


def hold_families(counts: HoldCounts) -> Iterator[Metric]:
    """The requests held while no rank takes requests (`frontend.hold`)."""
    yield GaugeMetricFamily(f"{PREFIX}requests_waiting", "Requests waiting for a rank that takes requests (none does "
                            "now): what an autoscaler can wake the fleet on", value=counts.waiting)
    yield CounterMetricFamily(f"{PREFIX}requests_held", "Requests that waited for a rank that takes requests, "
                              "served or refused", value=counts.held_total)
    refused = CounterMetricFamily(f"{PREFIX}requests_hold_refused", "Requests answered 503 with Retry-After because "
                                  "no rank took requests: the wait limit was full (full), or none came within the "
                                  "hold timeout (timeout)", labels=["reason"])
    for reason, total in counts.refused_total.items():
        refused.add_metric([reason.value], total)
    yield refused
