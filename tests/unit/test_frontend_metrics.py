# SPDX-License-Identifier: Apache-2.0
"""The frontend's corefleet_frontend_* series: read from the Fleet at scrape time, none for a rank that left."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from corefleet_client.admin import RankState, ResizePhase, ResizeRequest
from corefleet_client.frontend.fleet import Fleet
from corefleet_client.frontend.metrics import FleetCollector
from standins import IdleView, RecordingRunner


class Busy(IdleView):
    """A LoadView with 3 requests in flight on rank 1, none elsewhere."""

    def lb_counts(self, rank: int) -> tuple[int, int, float]:
        return (1, 2, 0.5) if rank == 1 else (0, 0, 0.0)

    def in_flight(self, rank: int) -> int:
        return 3 if rank == 1 else 0


def scrape(fleet: Fleet) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(FleetCollector(fleet))
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def serving_fleet(size: int) -> Fleet:
    fleet = Fleet("tiny", size)
    for r in range(size):
        fleet.set_rank(r, RankState.SERVING)
    fleet.serving(Busy(), RecordingRunner())
    return fleet


def test_per_rank_series_state_in_flight_and_counters() -> None:
    fleet = serving_fleet(2)
    fleet.record(1).requests_total = 7
    fleet.record(1).aborts_total = 2
    fleet.record(0).failed_total = 1
    fleet.set_rank(0, RankState.UNRESPONSIVE, "no answer")
    got = scrape(fleet)
    assert got[("corefleet_frontend_rank_state", (("engine", "0"), ("state", "Unresponsive")))] == 1
    assert got[("corefleet_frontend_rank_state", (("engine", "0"), ("state", "Serving")))] == 0
    assert got[("corefleet_frontend_rank_state", (("engine", "1"), ("state", "Serving")))] == 1
    assert got[("corefleet_frontend_rank_requests_in_flight", (("engine", "1"),))] == 3
    assert got[("corefleet_frontend_rank_requests_routed_total", (("engine", "1"),))] == 7
    assert got[("corefleet_frontend_rank_requests_aborted_total", (("engine", "1"),))] == 2
    assert got[("corefleet_frontend_rank_requests_failed_total", (("engine", "0"),))] == 1
    assert got[("corefleet_frontend_ranks", ())] == 2
    assert got[("corefleet_frontend_resize_phase", (("phase", "Idle"),))] == 1
    assert got[("corefleet_frontend_rank_stalled", (("engine", "1"),))] == 0


def test_a_stalled_rank_shows_while_it_is_and_counts_each_stall() -> None:
    fleet = serving_fleet(2)
    fleet.set_stalled(1, "no step ended for 3.2s")
    fleet.set_stalled(1, "no step ended for 4.0s")  # still the same stall
    got = scrape(fleet)
    assert got[("corefleet_frontend_rank_stalled", (("engine", "1"),))] == 1
    assert got[("corefleet_frontend_rank_stalls_total", (("engine", "1"),))] == 1
    assert got[("corefleet_frontend_rank_state", (("engine", "1"), ("state", "Serving")))] == 1
    fleet.set_stalled(1, "")
    fleet.set_stalled(1, "again")
    fleet.set_stalled(1, "")
    got = scrape(fleet)
    assert got[("corefleet_frontend_rank_stalled", (("engine", "1"),))] == 0
    assert got[("corefleet_frontend_rank_stalls_total", (("engine", "1"),))] == 2
    fleet.record(1).moved_total = 3
    assert scrape(fleet)[("corefleet_frontend_rank_requests_moved_total", (("engine", "1"),))] == 3


def test_prefix_affinity_decisions_show_per_rank() -> None:
    fleet = serving_fleet(2)
    fleet.record(0).new_prefix_total = 1
    fleet.record(0).affinity_total = 5
    fleet.record(0).spilled_total = 2
    got = scrape(fleet)
    by_prefix = "corefleet_frontend_rank_requests_routed_by_prefix_total"
    assert got[(by_prefix, (("decision", "new"), ("engine", "0")))] == 1
    assert got[(by_prefix, (("decision", "affinity"), ("engine", "0")))] == 5
    assert got[(by_prefix, (("decision", "spill"), ("engine", "0")))] == 2
    assert got[(by_prefix, (("decision", "affinity"), ("engine", "1")))] == 0


def test_a_running_resize_shows_its_phase() -> None:
    fleet = serving_fleet(2)
    fleet.start_resize(ResizeRequest(id="up", replicas=3, join_timeout_s=60))
    fleet.update_resize("up", phase=ResizePhase.PREPARING)
    got = scrape(fleet)
    assert got[("corefleet_frontend_resize_phase", (("phase", "Preparing"),))] == 1
    assert got[("corefleet_frontend_resize_phase", (("phase", "Idle"),))] == 0
    fleet.finish_resize("up", error="did not join", fleet_intact=True)
    assert scrape(fleet)[("corefleet_frontend_resize_phase", (("phase", "Idle"),))] == 1


def test_a_retired_rank_has_no_series() -> None:
    fleet = serving_fleet(3)
    fleet.record(2).requests_total = 4
    assert ("corefleet_frontend_rank_requests_routed_total", (("engine", "2"),)) in scrape(fleet)
    fleet.set_rank(2, RankState.RETIRED, "retired by resize down")
    fleet.commit_size(2)
    got = scrape(fleet)
    assert not [key for key in got if ("engine", "2") in key[1]]
    assert got[("corefleet_frontend_ranks", ())] == 2
    assert {dict(key[1])["engine"] for key in got if key[0] == "corefleet_frontend_rank_requests_in_flight"} == \
        {"0", "1"}
