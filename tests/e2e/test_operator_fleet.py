# SPDX-License-Identifier: Apache-2.0
"""An operator-run fleet of real vLLM engines: served, resized in place under load, recovered.

The control plane is real, the operator runs as its own process, and `podrunner.PodRunner` runs
each pod's command as a local process on its own loopback address and reports it Running, Ready
(through the pod's own readinessProbe) and Failed as a kubelet would. The engines are real vLLM
(the tiny model, dummy weights, on CPU). One fleet serves the module; the last test breaks it.

Heavy (real vLLM, up to 3 engines, ~9 GiB): on shared machines run the e2e tier under
`flock /tmp/corefleet-heavy.lock`.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from corefleet_client.admin import RankState
from corefleet_client.tinymodel import VLLM_CPU_FLAGS, write_tiny_model
from corefleet_operator import constants
from corefleet_operator.localcluster import LocalControlPlane
from factories import make_ecs
from fleettest import FleetView, Load, OperatorProcess, PinnedStream, ResizeWatch, spread_engines_over_cpus, wait_for
from podrunner import PodRunner

pytestmark = pytest.mark.e2e

NAME = "llm"
SERVED = "tiny"
START_TIMEOUT = 600.0  # real vLLM engines starting on a 2-core machine, up to 3 at once with load running
CONTEXT = 2048  # long enough for a request that stays in flight for seconds


def engine_flags() -> list[str]:
    """VLLM_CPU_FLAGS without `--load-format dummy`: corefleet sets --load-format (spec.engine.loadFormat)."""
    flags = list(VLLM_CPU_FLAGS)
    i = flags.index("--load-format")
    del flags[i:i + 2]
    flags[flags.index("--max-model-len") + 1] = str(CONTEXT)
    return [*flags, "--served-model-name", SERVED]


class Setup:
    def __init__(self, k8s: LocalControlPlane, ns: str, runner: PodRunner, operator: OperatorProcess,
                 fleet: FleetView) -> None:
        self.k8s, self.ns, self.runner, self.operator, self.fleet = k8s, ns, runner, operator, fleet

    def settle(self, replicas: int, timeout: float = START_TIMEOUT) -> None:
        self.fleet.wait_settled(replicas, timeout, interval=0.5)

    def completion(self) -> dict[str, Any]:
        body = json.dumps({"model": SERVED, "prompt": "Hello", "max_tokens": 8}).encode()
        req = urllib.request.Request(f"http://{self.fleet.frontend_ip()}:8000/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
            out: dict[str, Any] = json.loads(r.read())
        assert out["model"] == SERVED, out
        assert out["usage"]["completion_tokens"] > 0, out
        return out


@pytest.fixture(scope="module")
def setup(k8s: LocalControlPlane, crd_installed: None, module_namespace: str,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("operator-fleet")
    model = write_tiny_model(tmp / "tiny-llama")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    with PodRunner(k8s, module_namespace, tmp / "pods", extra_env=spread_engines_over_cpus) as runner, \
            OperatorProcess(k8s, module_namespace, tmp) as operator:
        ecs = (make_ecs(NAME, module_namespace).model(str(model)).replicas(2).max_replicas(3).tp(1)
               .set("engine.loadFormat", "dummy").set("scaling.readyTimeoutSeconds", int(START_TIMEOUT))
               .set("scaling.drainTimeoutSeconds", 60).arg(*engine_flags()).manifest())
        k8s.kubectl("apply", "-n", module_namespace, "-f", "-", input=json.dumps(ecs))  # schema and CEL accept it
        s = Setup(k8s, module_namespace, runner, operator, FleetView(k8s, module_namespace, NAME, runner, SERVED))
        s.settle(2)
        yield s
        operator.check_clean()
        assert not runner.errors, runner.errors


def test_real_vllm_fleet_serves(setup: Setup) -> None:
    s = setup
    s.completion()
    fleet = s.fleet.admin().fleet()
    assert [(r.rank, r.state) for r in fleet.ranks] == [(0, RankState.SERVING), (1, RankState.SERVING)], fleet
    st = s.fleet.status()
    assert (st["replicas"], st["readyReplicas"], st["recoveries"], st["fleetGeneration"]) == (2, 2, 0, 1), st
    assert s.fleet.get_ecs().split("\n")[1].split()[:4] == [NAME, "2", "2", "Running"]


def test_real_vllm_fleet_resizes_2_3_2_in_place_under_load(setup: Setup) -> None:
    s = setup
    survivors = {r: s.fleet.engine_pid(r) for r in (0, 1)}
    pods = s.fleet.pods()
    uids = {name: p["metadata"]["uid"] for name, p in pods.items()}
    events_before = len(s.fleet.events())
    # A client that keeps sending, with a second between requests. (vLLM's CPU worker busy-polls for its next
    # step for 1 s after each one, so under a denser load the two engines keep both cores of this machine
    # busy and the new engine takes minutes to start instead of about one.)
    load = Load(f"http://{s.fleet.frontend_ip()}:8000", SERVED, workers=1, max_tokens=8, pause_s=1.0).start()
    columns: list[list[str]] = []
    try:
        with ResizeWatch(s.fleet) as up:
            t0 = time.monotonic()
            s.fleet.scale(3)
            wait_for(lambda: s.fleet.status().get("phase") == "Scaling", 30, "phase Scaling")
            columns.append(s.fleet.get_ecs().split("\n")[1].split()[:4])
            s.settle(3)
            up_took = time.monotonic() - t0
        columns.append(s.fleet.get_ecs().split("\n")[1].split()[:4])

        def new_rank_served() -> int:
            return s.fleet.admin().fleet().rank(2).requests_total

        served = wait_for(new_rank_served, 60, "rank 2 to serve requests")
        # A long request on the leaving rank: the drain lets it finish.
        long = PinnedStream(f"http://{s.fleet.frontend_ip()}:8000", SERVED, rank=2, max_tokens=CONTEXT - 64)
        assert long.first_token.wait(60)
        with ResizeWatch(s.fleet) as down:
            t0 = time.monotonic()
            s.fleet.scale(2)
            s.settle(2, timeout=120)
            down_took = time.monotonic() - t0
    finally:
        load.stop()
    columns.append(s.fleet.get_ecs().split("\n")[1].split()[:4])
    assert long.result() == (True, "finish_reason length")
    print(f"2 -> 3 settled in {up_took:.1f} s, 3 -> 2 in {down_took:.1f} s; rank 2 served {served} request(s) "
          f"before it was retired; load: {load.summary()}; survivors' engine pids {survivors}; "
          f"operation phases up {up.phases}, down {down.phases}; kubectl get ecs {columns}; rank 2 retired at "
          f"{down.retired_at.get(2)}, its pod deleted at {down.deleted_at.get(constants.engine_name(NAME, 2))} "
          f"(monotonic s); events {[r for r, _ in s.fleet.events()[events_before:]]}")

    # No request failed, and the surviving ranks are the same processes in the same pods.
    assert len(load.outcomes) > 10, load.summary()
    assert {o.kind for o in load.outcomes} == {"stream", "plain"}
    assert not load.failures(), load.summary()
    assert {r: s.fleet.engine_pid(r) for r in (0, 1)} == survivors
    after = s.fleet.uids()
    assert after == {n: u for n, u in uids.items()}, "a surviving pod was recreated"
    # The status went through the resize's phases; the retired pod went only once the frontend retired it.
    assert "Preparing" in up.phases, up.phases
    assert up.phases[-1] == "Completed", up.phases
    assert "Draining" in down.phases, down.phases
    assert down.phases[-1] == "Completed", down.phases
    assert 2 in down.retired_at, down.retired_at
    assert down.retired_at[2] <= down.deleted_at[constants.engine_name(NAME, 2)]
    assert columns == [[NAME, "3", "2", "Scaling"], [NAME, "3", "3", "Running"], [NAME, "2", "2", "Running"]], \
        columns
    st = s.fleet.status()
    assert (st["replicas"], st["recoveries"], st["fleetGeneration"]) == (2, 0, 1), st
    # `kubectl describe ecs` tells the story, in order.
    # The operator posts a plan's events just after it wrote the status: wait for the last one.
    def story_told() -> list[tuple[str, str]] | None:
        story = s.fleet.events()[events_before:]
        return story if [reason for reason, _ in story].count("ResizeCompleted") >= 2 else None

    story = wait_for(story_told, 30, "the second ResizeCompleted event", on_timeout=s.fleet.describe)
    main = [reason for reason, _ in story if reason in ("ResizeStarted", "RankRetired", "ResizeCompleted", "RankLost")]
    assert main == ["ResizeStarted", "ResizeCompleted", "ResizeStarted", "RankRetired", "ResizeCompleted"], story
    assert "2 -> 3 ranks in place" in story[0][1], story


def test_operator_fleet_replaces_a_killed_engine_in_place(setup: Setup) -> None:
    """A dense rank dies outside a resize: its pod is replaced in place (a new real vLLM engine joins under
    rank 1 through the handshake) while the frontend, the coordinator and rank 0 serve on."""
    s = setup
    s.settle(2)
    before = s.fleet.status()
    old_uids = s.fleet.uids()
    victim = constants.engine_name(NAME, 1)
    os.killpg(s.fleet.engine_pid(1), signal.SIGKILL)  # as a container would die

    wait_for(lambda: (s.fleet.status().get("operation") or {}).get("replace") == [1], 60,
             "a replacement of rank 1", on_timeout=s.fleet.describe)
    assert s.fleet.status()["phase"] == "Degraded"
    s.settle(2)
    st = s.fleet.status()
    assert (st["recoveries"], st["fleetGeneration"]) == (before["recoveries"] + 1, before["fleetGeneration"]), st
    assert st["operation"]["phase"] == "Completed", st
    uids = s.fleet.uids()
    assert uids[victim] != old_uids[victim]
    assert {n: u for n, u in uids.items() if n != victim} == {n: u for n, u in old_uids.items() if n != victim}
    events = s.fleet.events()
    lost = [m for reason, m in events if reason == "RankLost"]
    assert any(f"rank 1 (pod {NAME}-engine-1) failed" in m and "137" in m and "replacing rank 1 in place" in m
               for m in lost), lost
    assert any(reason == "RankReplaced" and st["operation"]["id"] in m for reason, m in events), events
    assert [r.state for r in s.fleet.admin().fleet().ranks] == [RankState.SERVING] * 2
    s.completion()


def test_a_hung_engine_is_marked_not_ready_then_killed_by_its_liveness_probe(setup: Setup) -> None:
    """SIGSTOP of rank 1's process group (launcher and engine core, as a hung node or a debugger would
    leave them): its pod's probes time out, readiness marks it NotReady, and its liveness probe has it
    killed (SIGTERM stays pending on a stopped process: SIGKILL after the grace period, exit 137) unless
    the operator deleted the hung rank's pod first (the frontend reported it Unresponsive too long); then
    the operator replaces rank 1 in place. Rank 0 serves a client pinned to it without a failure
    throughout, the frontend stays Ready, and the frontend, coordinator and rank 0 keep their pods."""
    s = setup
    s.settle(2)
    before = s.fleet.status()
    pods = s.fleet.pods()
    uid = {name: p["metadata"]["uid"] for name, p in pods.items()}
    rank0, rank1 = (uid[constants.engine_name(NAME, r)] for r in (0, 1))
    frontend = uid[constants.frontend_name(NAME)]

    def flip(pod_uid: str, kind: str) -> float | None:
        """When that pod's `kind` probe last turned to failure (monotonic), if it did."""
        return next((a.at for a in reversed(list(s.runner.probe_log))
                     if a.uid == pod_uid and a.kind == kind and a.changed and not a.ok), None)

    def rank1_ended() -> tuple[float, str] | None:
        """(when, how) rank 1's container ended: its exit code as the runner reported it, or deleted."""
        if rank1 in s.runner.exits:
            at, code = s.runner.exits[rank1]
            return at, f"exit {code}"
        if all(p.uid != rank1 or p.pod["metadata"].get("deletionTimestamp") for p in list(s.runner.pods.values())):
            return time.monotonic(), "deleted by the operator"
        return None

    pinned = Load(f"http://{s.fleet.frontend_ip()}:8000", SERVED, workers=1, max_tokens=8, pause_s=0.5,
                  headers={"X-data-parallel-rank": "0"}).start()
    try:
        wait_for(lambda: len(pinned.outcomes) >= 2, 120, "the pinned client's first answers")
        stopped_at = time.monotonic()
        os.killpg(s.fleet.engine_pid(1), signal.SIGSTOP)
        not_ready_at: float = wait_for(lambda: flip(rank1, "readiness"), 120, "rank 1 NotReady",
                                       on_timeout=s.fleet.describe)
        ended_at, how = wait_for(rank1_ended, 180, "rank 1's end", interval=0.1, on_timeout=s.fleet.describe)
        kill_at = flip(rank1, "liveness")
        s.settle(2)
        recovered_at = time.monotonic()
    finally:
        pinned.stop()
    after = s.fleet.pods()
    kept = {name for name, p in after.items() if uid.get(name) == p["metadata"]["uid"]}
    in_place = constants.engine_name(NAME, 0) in kept
    until_end = [o for o in pinned.outcomes if o.started + o.latency < ended_at]
    served_while_hung = [o for o in until_end if o.started >= stopped_at and o.ok]
    frontend_not_ready = flip(frontend, "readiness")
    frontend_seen = f"after {frontend_not_ready - stopped_at:.1f} s" if frontend_not_ready else "never"
    recovery = f"in place, kept {sorted(kept)}" if in_place else "recreated whole"
    print(f"rank 1 SIGSTOPped: NotReady after {not_ready_at - stopped_at:.1f} s; liveness kill "
          f"{f'decided after {kill_at - stopped_at:.1f} s' if kill_at else 'never decided'}; ended ({how}) after "
          f"{ended_at - stopped_at:.1f} s; fleet Running at 2 again {recovered_at - ended_at:.1f} s later "
          f"({recovered_at - stopped_at:.1f} s in all), {recovery}; "
          f"rank 0 served {len(served_while_hung)} pinned request(s) while rank 1 hung; frontend NotReady "
          f"{frontend_seen}; pinned load: {pinned.summary()}; status recoveries {before['recoveries']} -> "
          f"{s.fleet.status()['recoveries']}, fleetGeneration {before['fleetGeneration']} -> "
          f"{s.fleet.status()['fleetGeneration']}")

    assert stopped_at < not_ready_at < ended_at
    if how.startswith("exit"):  # the kubelet's liveness kill: SIGTERM pending on the stopped group, then SIGKILL
        assert how == "exit 137", how
        assert kill_at is not None
        assert not_ready_at < kill_at < ended_at
        kubelet = [(e["reason"], e["message"]) for e in
                   s.k8s.request("GET", f"/api/v1/namespaces/{s.ns}/events")["items"]
                   if e["involvedObject"].get("uid") == rank1]
        assert ("Killing", "Container engine failed liveness probe, will be restarted") in kubelet, kubelet
        lost = [m for reason, m in s.fleet.events() if reason == "RankLost"]
        assert any(f"rank 1 (pod {NAME}-engine-1) failed" in m and "137" in m for m in lost), lost
    assert served_while_hung, pinned.summary()
    # Rank 0 served its pinned client without a failure while rank 1 hung, and throughout if the recovery kept it.
    assert not [o for o in (pinned.outcomes if in_place else until_end) if not o.ok], pinned.summary()
    assert flip(rank0, "readiness") is None or flip(rank0, "readiness") > ended_at  # Ready while rank 1 hung
    assert constants.engine_name(NAME, 1) not in kept
    # Replaced in place: one loss counted, the same incarnation, the survivors' pods kept, the endpoint Ready.
    assert in_place, recovery
    assert kept == {constants.frontend_name(NAME), constants.coordinator_name(NAME), constants.engine_name(NAME, 0)}
    assert frontend_not_ready is None, frontend_seen
    st = s.fleet.status()
    assert (st["recoveries"], st["fleetGeneration"]) == (before["recoveries"] + 1, before["fleetGeneration"]), st
    assert (st["operation"]["phase"], st["operation"]["replace"]) == ("Completed", [1]), st
    events = s.fleet.events()
    assert any(reason == "RankLost" and "replacing rank 1 in place" in m for reason, m in events), events
    assert any(reason == "RankReplaced" and st["operation"]["id"] in m for reason, m in events), events
    s.completion()
