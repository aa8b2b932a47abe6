# SPDX-License-Identifier: Apache-2.0
"""The autoscaling loop the product ships, end to end on real components: Prometheus records the
fleet's in-flight requests, prometheus-adapter serves them by manifests/samples/prometheus-adapter-rules.yaml
(unchanged), kube-controller-manager's HPA controller reads them (manifests/samples/hpa.yaml) and
writes the EngineCoreSet's /scale, and the API server applies the CRD's rules to that write.

No operator runs: the test plays its part on the status subresource (status.replicas, the committed
size, and status.selector, which /scale reports). A small exporter serves vLLM's per-rank gauges
(`vllm:num_requests_running`/`_waiting`, with vLLM's `engine` label and the `namespace`/`fleet`
labels the chart's PodMonitor adds) and Prometheus computes `corefleet:fleet_in_flight_requests`
from them with a recording rule, as the product's rules do. The control plane is this module's own,
with a 1 s HPA sync period.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import threading
import urllib.error
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
import yaml
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from corefleet_harness.localcluster import LocalControlPlane, resolve_bin_dir
from corefleet_harness.support import wait_until
from corefleet_operator import constants
from metricsstack import (
    FLEET_METRIC,
    MetricsStackError,
    Prometheus,
    PrometheusAdapter,
    current_average,
    hpa_events,
    quantity,
)

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "manifests" / "samples"
FLEET = "qwen3-dense"  # the name in the samples
METRIC = FLEET_METRIC
ECS = f"/apis/{constants.API_VERSION}/namespaces/{{ns}}/{constants.PLURAL}/{FLEET}"
HPA = f"/apis/autoscaling/v2/namespaces/{{ns}}/horizontalpodautoscalers/{FLEET}"
# What the product's recording rules compute (there via per-rank rules), from the exporter's gauges.
RULES = """
groups:
  - name: corefleet-test
    rules:
      - record: corefleet:fleet_in_flight_requests
        expr: sum by (namespace, fleet) (vllm:num_requests_running + vllm:num_requests_waiting)
"""


def load(name: str) -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load((SAMPLES / name).read_text())
    return obj


class RankGauges:
    """An exporter of vLLM's per-rank request gauges on 127.0.0.1, labelled with the fleet and its rank.

    `set` swaps in a whole fleet's values at once, so no scrape sees half an update (a partial sum
    would make the HPA act on a load that never was). Served in the text format 0.0.4 only:
    prometheus_client 0.26 answers Prometheus 2.x's OpenMetrics request with `:` in sample names
    turned into `_` (`vllm_num_requests_running`), which no rule written for vLLM's names matches.
    """

    def __init__(self) -> None:
        self._ranks: dict[tuple[str, str, str], tuple[int, int]] = {}
        self.registry = prometheus_client.CollectorRegistry()
        self.registry.register(self)
        registry = self.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = prometheus_client.generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # no line per scrape on stderr
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, name="rank-gauges", daemon=True).start()
        self.target = f"127.0.0.1:{self.server.server_port}"

    def set(self, namespace: str, ranks: dict[int, tuple[int, int]]) -> int:
        """(running, waiting) per rank of the fleet in `namespace`; returns the fleet's total."""
        others = {k: v for k, v in self._ranks.items() if k[0] != namespace}
        self._ranks = others | {(namespace, FLEET, str(rank)): rw for rank, rw in ranks.items()}
        return sum(r + w for r, w in ranks.values())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        ranks = self._ranks  # one snapshot per scrape
        labels = ["namespace", "fleet", "engine"]
        running = GaugeMetricFamily("vllm:num_requests_running", "Running requests", labels=labels)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Waiting requests", labels=labels)
        for key, (r, w) in ranks.items():
            running.add_metric(list(key), r)
            waiting.add_metric(list(key), w)
        yield from (running, waiting)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---- the module's stack ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalControlPlane]:
    plane = LocalControlPlane(state_dir=tmp_path_factory.mktemp("hpa-control-plane"), bin_dir=resolve_bin_dir(),
                              hpa_sync_seconds=1)
    with plane:
        plane.kubectl("apply", "--server-side", "-f", str(REPO / "manifests" / "crd.yaml"))
        plane.wait_established(constants.CRD_NAME)
        yield plane


@pytest.fixture(scope="module")
def gauges() -> Iterator[RankGauges]:
    exporter = RankGauges()
    yield exporter
    exporter.close()


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory, gauges: RankGauges) -> Iterator[Prometheus]:
    scrape = {"job_name": "corefleet-frontend", "honor_labels": True,
              "static_configs": [{"targets": [gauges.target]}]}
    with Prometheus(tmp_path_factory.mktemp("prometheus"), [scrape], {"corefleet.rules.yml": RULES}) as prom:
        yield prom


@pytest.fixture(scope="module")
def adapter(cp: LocalControlPlane, prometheus: Prometheus,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusAdapter]:
    # The CRD is installed (cp): the adapter resolves enginecoresets.corefleet.io from the rules at start.
    with PrometheusAdapter(cp, prometheus.url, SAMPLES / "prometheus-adapter-rules.yaml",
                           tmp_path_factory.mktemp("adapter")) as served:
        yield served


@pytest.fixture
def ns(cp: LocalControlPlane) -> Iterator[str]:
    name = f"hpa-{uuid.uuid4().hex[:10]}"
    cp.kubectl("create", "namespace", name)
    yield name
    cp.kubectl("delete", "namespace", name, "--wait=false", check=False)


# ---- what the operator and the user would do -------------------------------------------------------
def create_fleet(cp: LocalControlPlane, ns: str, replicas: int) -> None:
    """The sample EngineCoreSet (maxReplicas 4), and the status the operator reports for it."""
    ecs = load("enginecoreset.yaml")
    ecs["spec"]["replicas"] = replicas
    cp.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(ecs))
    commit(cp, ns, replicas)


def commit(cp: LocalControlPlane, ns: str, replicas: int) -> None:
    """The operator's status write once the fleet serves at `replicas` ranks."""
    cp.request("PATCH", ECS.format(ns=ns) + "/status",
               {"status": {"replicas": replicas, "selector": constants.engine_selector(FLEET)}},
               content_type="application/merge-patch+json")


def spec_replicas(cp: LocalControlPlane, ns: str) -> int:
    replicas: int = cp.request("GET", ECS.format(ns=ns))["spec"]["replicas"]
    return replicas


def hpa(cp: LocalControlPlane, ns: str) -> dict[str, Any]:
    obj: dict[str, Any] = cp.request("GET", HPA.format(ns=ns))
    return obj


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in obj.get("status", {}).get("conditions", [])}


def apply_hpa(cp: LocalControlPlane, ns: str, **spec: Any) -> dict[str, Any]:
    obj = copy.deepcopy(load("hpa.yaml"))
    obj["spec"].update(spec)
    cp.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(obj))
    return obj


def served_metric(adapter: PrometheusAdapter, path: str) -> dict[str, Any] | None:
    try:
        obj: dict[str, Any] = adapter.get(path)
    except urllib.error.HTTPError as e:
        if e.code == 404:  # until the adapter's relist has seen the series
            return None
        raise
    return obj


def describe(cp: LocalControlPlane, ns: str) -> str:
    return cp.kubectl("describe", "hpa", "-n", ns, check=False).stdout


# ---- the loop -----------------------------------------------------------------------------------------
def test_hpa_scales_the_fleet_with_its_in_flight_requests(
        cp: LocalControlPlane, adapter: PrometheusAdapter, gauges: RankGauges, ns: str) -> None:
    create_fleet(cp, ns, replicas=1)
    gauges.set(ns, {0: (6, 0)})
    # The adapter serves the recording rule as the EngineCoreSet's metric, by the shipped rules.
    path = f"namespaces/{ns}/{constants.PLURAL}.{constants.GROUP}/{FLEET}/{METRIC}"
    [served] = wait_until(lambda: served_metric(adapter, path), 60, f"{METRIC} on the custom-metrics API",
                          diagnose=adapter.log_tail)["items"]
    assert served["describedObject"] == {"kind": constants.KIND, "namespace": ns, "name": FLEET,
                                         "apiVersion": constants.API_VERSION}
    assert quantity(served["value"]) == 6

    # The sample HPA, with a 5 s scale-down window in place of its 300 s (the test cannot wait 5 min).
    sample = load("hpa.yaml")
    behavior = copy.deepcopy(sample["spec"]["behavior"])
    behavior["scaleDown"]["stabilizationWindowSeconds"] = 5
    apply_hpa(cp, ns, behavior=behavior)
    target = quantity(sample["spec"]["metrics"][0]["object"]["target"]["averageValue"])
    # The HPA reads the metric. Up to 30 s: the controller manager's discovery cache, filled before the
    # CRD was installed, learns about EngineCoreSets only at its next periodic reset.
    wait_until(lambda: current_average(hpa(cp, ns)) == 6, 90, "the HPA to read 6 in-flight requests",
               diagnose=lambda: describe(cp, ns))
    assert spec_replicas(cp, ns) == 1  # 6 per rank is under the target: nothing to do

    # Load rises to 80 in flight: ceil(80 / 32) = 3 ranks.
    total = gauges.set(ns, {0: (40, 10), 1: (20, 10)})
    wait_until(lambda: spec_replicas(cp, ns) == 3, 60, "spec.replicas 3 through /scale",
               diagnose=lambda: describe(cp, ns))
    assert -(-total // target) == 3
    assert any("New size: 3" in m and METRIC in m for m in hpa_events(cp, ns, "SuccessfulRescale"))
    status = hpa(cp, ns)["status"]
    assert status["desiredReplicas"] == 3
    assert current_average(hpa(cp, ns)) == total  # per committed rank: status.replicas is still 1
    commit(cp, ns, 3)  # the operator finished the resize
    wait_until(lambda: current_average(hpa(cp, ns)) == pytest.approx(total / 3, abs=1e-3), 30,
               "the HPA to divide the fleet's load by its 3 ranks", diagnose=lambda: describe(cp, ns))
    assert spec_replicas(cp, ns) == 3  # 26.7 per rank: within the target, stays

    # Load drops to 5: the HPA wants 1 rank but holds 3 for the stabilization window, then scales down.
    gauges.set(ns, {0: (3, 0), 1: (2, 0)})
    def held_at_3() -> dict[str, Any] | None:
        h = hpa(cp, ns)
        held = conditions(h).get("AbleToScale", {}).get("reason") == "ScaleDownStabilized"
        return h if held and spec_replicas(cp, ns) == 3 else None

    stabilized = wait_until(held_at_3, 30, "AbleToScale=ScaleDownStabilized while at 3 ranks", interval=0.1,
                            diagnose=lambda: describe(cp, ns))
    assert current_average(stabilized) == pytest.approx(5 / 3, abs=1e-3)
    wait_until(lambda: spec_replicas(cp, ns) == 1, 30, "spec.replicas 1 after the window",
               diagnose=lambda: describe(cp, ns))
    assert any("New size: 1" in m and "below target" in m for m in hpa_events(cp, ns, "SuccessfulRescale"))


def test_hpa_above_the_fleets_max_replicas_is_refused_on_scale(
        cp: LocalControlPlane, adapter: PrometheusAdapter, gauges: RankGauges, ns: str) -> None:
    create_fleet(cp, ns, replicas=2)  # maxReplicas 4
    fleet_max = load("enginecoreset.yaml")["spec"]["maxReplicas"]
    apply_hpa(cp, ns, maxReplicas=8)
    # 200 in flight: ceil(200 / 32) = 7, capped by the HPA's scale-up rate (from 2: +4) at 6 > 4.
    gauges.set(ns, {0: (100, 0), 1: (64, 36)})

    def refused() -> list[str]:
        return hpa_events(cp, ns, "FailedRescale")

    [message, *_] = wait_until(refused, 90, "a FailedRescale event", diagnose=lambda: describe(cp, ns))
    assert "New size: 6" in message
    assert "replicas must not exceed maxReplicas" in message  # the CRD's CEL rule, applied to /scale
    able = conditions(hpa(cp, ns))["AbleToScale"]
    assert (able["status"], able["reason"]) == ("False", "FailedUpdateScale")
    assert spec_replicas(cp, ns) == 2 < fleet_max
    assert not hpa_events(cp, ns, "SuccessfulRescale")


# ---- the samples ----------------------------------------------------------------------------------------
def test_hpa_sample_targets_the_sample_fleet_within_its_max_replicas(cp: LocalControlPlane, ns: str) -> None:
    h, fleet = load("hpa.yaml"), load("enginecoreset.yaml")
    target = {"apiVersion": constants.API_VERSION, "kind": constants.KIND, "name": fleet["metadata"]["name"]}
    assert h["spec"]["scaleTargetRef"] == target
    assert h["spec"]["metrics"][0]["object"]["describedObject"] == target
    assert h["spec"]["metrics"][0]["object"]["metric"]["name"] == METRIC
    assert h["spec"]["minReplicas"] == 1
    assert h["spec"]["maxReplicas"] == fleet["spec"]["maxReplicas"]
    assert h["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    # Offline, as the chart is checked (test_chart.py), and by the API server, unknown fields refused by both.
    v = subprocess.run([str(Path(sys.executable).with_name("kubernetes-validate")), "--strict", "-k", "1.37.0",
                        str(SAMPLES / "hpa.yaml")], capture_output=True, text=True, check=False, timeout=120)
    assert v.returncode == 0, v.stdout + v.stderr
    assert "passed for resource horizontalpodautoscaler/qwen3-dense" in v.stdout
    r = cp.kubectl("apply", "-n", ns, "--dry-run=server", "--validate=strict", "-f", str(SAMPLES / "hpa.yaml"))
    assert "created (server dry run)" in r.stdout


def test_keda_sample_scales_the_same_fleet_on_the_same_series(prometheus: Prometheus, gauges: RankGauges) -> None:
    keda, h = load("keda-scaledobject.yaml"), load("hpa.yaml")
    assert (keda["apiVersion"], keda["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert keda["spec"]["scaleTargetRef"] == h["spec"]["scaleTargetRef"]
    assert (keda["spec"]["minReplicaCount"], keda["spec"]["maxReplicaCount"]) == \
        (h["spec"]["minReplicas"], h["spec"]["maxReplicas"])
    assert keda["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == h["spec"]["behavior"]
    [trigger] = keda["spec"]["triggers"]
    assert (trigger["type"], trigger["metricType"]) == ("prometheus", "AverageValue")
    assert set(trigger["metadata"]) == {"serverAddress", "query", "threshold"}
    assert trigger["metadata"]["threshold"] == h["spec"]["metrics"][0]["object"]["target"]["averageValue"]
    # Its query, on the real Prometheus, is the fleet's in-flight requests (namespace as in the sample).
    total = gauges.set("default", {0: (7, 2), 1: (4, 0)})
    query = trigger["metadata"]["query"]
    [sample] = prometheus.wait_for(query, lambda r: len(r) == 1 and float(r[0]["value"][1]) == total, 30)
    assert float(sample["value"][1]) == 13


def test_prometheus_that_cannot_start_fails_with_its_command_and_log(tmp_path: Path) -> None:
    bad_rule = "groups:\n  - name: broken\n    rules:\n      - record: a:b\n        expr: sum(\n"
    with pytest.raises(MetricsStackError) as err:
        Prometheus(tmp_path, rules={"broken.yml": bad_rule}).start()
    msg = str(err.value)
    assert msg.startswith("prometheus exited with code 1")
    assert f"--config.file={tmp_path / 'prometheus.yml'}" in msg
    assert "error loading config" in msg  # the log's tail
