# SPDX-License-Identifier: Apache-2.0
"""A crash-looping fleet on the real control plane: backoff between recoveries, then Failed for good.

The operator runs as its own process (`fleettest.OperatorProcess`) with its recovery backoff scaled
down (`COREFLEET_RECOVERY_BACKOFF_SCALE=0.2`: 0 s, then 2 s, 4 s, ... instead of 0 s, 10 s, 20 s, ...),
and `podrunner` runs the fleet's pods as processes. Every engine pod runs corefleet's engine emulator
with a flag it refuses, so it exits with status 2 at once, as an engine given a bad flag does; the
frontend and coordinator pods are bound but never started (nothing here needs them to serve). One
fleet serves the module.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from corefleet_harness.emulator import EMULATOR_MODULE
from corefleet_harness.localcluster import LocalControlPlane
from corefleet_harness.support import wait_until
from corefleet_operator import constants, crd, planner
from corefleet_operator.handlers.lifecycle import BACKOFF_SCALE_ENV
from factories import make_ecs
from fleettest import FleetView, OperatorProcess
from podrunner import PodRunner

NAME = "crash"
MAX_RECOVERIES = 2
BACKOFF_SCALE = 0.2
PHASE_TIMEOUT = 120.0


class Setup:
    def __init__(self, k8s: LocalControlPlane, ns: str, runner: PodRunner, operator: OperatorProcess,
                 fleet: FleetView) -> None:
        self.k8s, self.ns, self.runner, self.operator, self.fleet = k8s, ns, runner, operator, fleet

    def condition(self, ctype: str) -> dict[str, Any]:
        return next(c for c in self.fleet.status().get("conditions", []) if c["type"] == ctype)

    def uids(self) -> dict[str, str]:
        return {p["metadata"]["uid"]: n for n, p in self.fleet.pods().items()}


@pytest.fixture(scope="module")
def setup(k8s: LocalControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    k8s.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(crd.crd()))
    k8s.wait_established(constants.CRD_NAME)
    ns = f"r-{uuid.uuid4().hex[:10]}"
    k8s.kubectl("create", "namespace", ns)
    tmp = tmp_path_factory.mktemp("recovery")
    failing_engine = (EMULATOR_MODULE, "--no-such-engine-flag")  # argparse: exit 2 at once
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(BACKOFF_SCALE_ENV, str(BACKOFF_SCALE))  # the operator process inherits it
        with PodRunner(k8s, ns, tmp / "pods", engine=failing_engine) as runner, \
                OperatorProcess(k8s, ns, tmp, resync_seconds=5.0) as operator:
            runner.hold = {constants.frontend_name(NAME), constants.coordinator_name(NAME)}
            ecs = (make_ecs(NAME, ns).replicas(2).set("scaling.maxRecoveries", MAX_RECOVERIES)
                   .set("scaling.readyTimeoutSeconds", 600).manifest())
            k8s.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(ecs))
            yield Setup(k8s, ns, runner, operator, FleetView(k8s, ns, NAME, runner, "unused"))
            operator.check_clean()
            assert not runner.errors, runner.errors
    k8s.kubectl("delete", "pods", "--all", "-n", ns, "--grace-period=0", "--force", "--wait=false", check=False)
    k8s.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_a_crash_looping_fleet_backs_off_then_fails_and_creates_nothing_more(setup: Setup) -> None:
    s = setup
    st = wait_until(lambda: (st := s.fleet.status()).get("phase") == "Failed" and st, PHASE_TIMEOUT,
                    "the fleet to be given up (phase Failed)", diagnose=s.fleet.describe)

    # Every lost incarnation counted: the first two were recovered, the third spent the budget.
    assert st["recoveries"] == MAX_RECOVERIES
    assert st["fleetGeneration"] == MAX_RECOVERIES + 1
    assert st["recovery"]["attempt"] == MAX_RECOVERIES
    assert "exited with 2" in st["recovery"]["reason"]
    degraded = s.condition("Degraded")
    assert degraded["reason"] == "RecoveriesExhausted"
    assert f"gave up after {MAX_RECOVERIES} recoveries in a row" in degraded["message"]
    assert "exited with 2" in degraded["message"]
    # The backoff, in the events: none before the first recovery, 10 s x the scale before the second.
    events = wait_until(lambda: (ev := s.fleet.events()) and any(r == "RecoveriesExhausted" for r, _ in ev) and ev,
                        30, "the RecoveriesExhausted event", diagnose=s.fleet.describe)
    lost = [m for r, m in events if r == "RankLost"]
    assert len(lost) == MAX_RECOVERIES + 1, lost
    assert f"recovery 1 of {MAX_RECOVERIES} now" in lost[0]
    wait = planner.backoff_seconds(2, scale=BACKOFF_SCALE)
    assert f"recovery 2 of {MAX_RECOVERIES} after a backoff of {wait:.0f}s" in lost[1]
    assert "recovery budget spent" in lost[2]
    assert [m for r, m in events if r == "Recovering"]  # the backoff's end: incarnation 3 created
    # Only the engine pods that ended are left (for their logs); the held frontend and coordinator went, and so
    # did an engine that had not exited yet when the fleet was given up.
    pods = wait_until(lambda: (p := s.fleet.pods()) and all(q["status"].get("phase") == "Failed" for q in p.values())
                      and p, 30, "only the ended pods left", diagnose=s.fleet.describe)
    assert set(pods) <= {constants.engine_name(NAME, 0), constants.engine_name(NAME, 1)}
    assert {q["metadata"]["annotations"][constants.ANNOTATION_GENERATION] for q in pods.values()} == {"3"}
    # The last incarnation was created only once the second recovery's backoff was over.
    retry_at = re.search(r"after a backoff of \d+s \(at (\S+Z)\)", lost[1])
    assert retry_at is not None, lost[1]
    assert min(q["metadata"]["creationTimestamp"] for q in pods.values()) >= retry_at.group(1)

    # Given up: nothing is created, however often the operator looks (woken by an annotation, and its resync).
    kept = s.uids()
    s.k8s.kubectl("annotate", "-n", s.ns, f"ecs/{NAME}", "corefleet.io/test-poke=1", "--overwrite")
    deadline = time.monotonic() + 3 * s.operator.resync_seconds

    def unchanged_until_the_deadline() -> bool:
        assert s.uids() == kept
        assert s.fleet.status()["phase"] == "Failed"
        return bool(time.monotonic() > deadline)

    wait_until(unchanged_until_the_deadline, 6 * s.operator.resync_seconds, "three resyncs with nothing created",
               interval=0.5)

    # A spec change starts over (a new streak).
    s.k8s.kubectl("patch", "-n", s.ns, f"ecs/{NAME}", "--type=merge", "-p",
                  json.dumps({"spec": {"scaling": {"maxRecoveries": MAX_RECOVERIES + 1}}}))
    wait_until(lambda: any(q["metadata"]["annotations"][constants.ANNOTATION_GENERATION] == "4"
                           for q in s.fleet.pods().values()), PHASE_TIMEOUT,
               "incarnation 4's pods after the spec change", diagnose=s.fleet.describe)
    assert s.fleet.status()["phase"] != "Failed" or s.fleet.status()["fleetGeneration"] >= 4
