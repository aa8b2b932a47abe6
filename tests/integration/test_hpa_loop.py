# SPDX-License-Identifier: Apache-2.0
"""The autoscaling loop the product ships, end to end on real components: Prometheus records the
fleet's in-flight requests, prometheus-adapter serves them by manifests/samples/prometheus-adapter-rules.yaml
(unchanged), kube-controller-manager's HPA controller reads them (manifests/samples/hpa.yaml) and
writes the EngineCoreSet's /scale, and the API server applies the CRD's rules to that write.

No operator runs: the test plays its part on the status subresource (status.replicas, the committed
size, and status.selector, which /scale reports) and on the series (an idle fleet's engines, and so
their series, are gone). A small exporter serves vLLM's per-rank gauges (`vllm:num_requests_running`/
`_waiting`, with vLLM's `engine` label) and the frontend's `corefleet_frontend_requests_waiting` (requests
held while no rank takes them), with the `namespace`/`fleet`/`pod` labels the chart's PodMonitor adds, and
Prometheus evaluates the chart's own recording rules (charts/corefleet/files/prometheus-rules.yaml) on
them: `corefleet:fleet_in_flight_requests` for hpa.yaml, `corefleet:fleet_demand_requests` for
hpa-scale-to-zero.yaml (minReplicas 0). The control plane is this module's own, with a 1 s HPA sync
period; its Kubernetes (1.37) has the HPAScaleToZero feature gate on by default, so it runs without
feature-gate flags.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import threading
import urllib.error
import uuid
from collections.abc import Callable, Iterator
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
    DEMAND_METRIC,
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
RULES_FILE = REPO / "charts" / "corefleet" / "files" / "prometheus-rules.yaml"
ECS = f"/apis/{constants.API_VERSION}/namespaces/{{ns}}/{constants.PLURAL}/{FLEET}"
HPA = f"/apis/autoscaling/v2/namespaces/{{ns}}/horizontalpodautoscalers/{FLEET}"


def load(name: str) -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load((SAMPLES / name).read_text())
    return obj


class RankGauges:
    """An exporter of vLLM's per-rank request gauges on 127.0.0.1, labelled with the fleet and its rank,
    and of the requests its frontend holds (`corefleet_frontend_requests_waiting`).

    `set` swaps in a whole fleet's values at once, so no scrape sees half an update (a partial sum
    would make the HPA act on a load that never was). Served in the text format 0.0.4 only:
    prometheus_client 0.26 answers Prometheus 2.x's OpenMetrics request with `:` in sample names
    turned into `_` (`vllm_num_requests_running`), which no rule written for vLLM's names matches.
    """

    def __init__(self) -> None:
        # (namespace, fleet, engine) -> (running, waiting); (namespace, fleet, frontend pod) -> requests held.
        # One tuple, swapped whole: a scrape reads both parts of the same update.
        self._state: tuple[dict[tuple[str, str, str], tuple[int, int]], dict[tuple[str, str, str], int]] = ({}, {})
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

    def set(self, namespace: str, ranks: dict[int, tuple[int, int]], held: int = 0) -> int:
        """(running, waiting) per rank of the fleet in `namespace` (none: an idle fleet, its engines gone)
        and the requests its frontend holds; returns the fleet's demand (all of them)."""
        old_ranks, old_held = self._state
        ranks_now = {k: v for k, v in old_ranks.items() if k[0] != namespace}
        held_now = {k: v for k, v in old_held.items() if k[0] != namespace}
        ranks_now |= {(namespace, FLEET, str(rank)): rw for rank, rw in ranks.items()}
        held_now[(namespace, FLEET, f"{FLEET}-frontend")] = held
        self._state = (ranks_now, held_now)
        return sum(r + w for r, w in ranks.values()) + held

    def collect(self) -> Iterator[GaugeMetricFamily]:
        ranks, held = self._state  # one snapshot per scrape
        labels = ["namespace", "fleet", "engine"]
        running = GaugeMetricFamily("vllm:num_requests_running", "Running requests", labels=labels)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Waiting requests", labels=labels)
        for key, (r, w) in ranks.items():
            running.add_metric(list(key), r)
            waiting.add_metric(list(key), w)
        frontend = GaugeMetricFamily("corefleet_frontend_requests_waiting", "Requests waiting for a rank",
                                     labels=["namespace", "fleet", "pod"])
        for key, n in held.items():
            frontend.add_metric(list(key), n)
        yield from (running, waiting, frontend)

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
    with Prometheus(tmp_path_factory.mktemp("prometheus"), [scrape],
                    {"corefleet.rules.yml": RULES_FILE.read_text()}) as prom:
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
def create_fleet(cp: LocalControlPlane, ns: str, replicas: int, **spec: Any) -> None:
    """The sample EngineCoreSet (maxReplicas 4), and the status the operator reports for it."""
    ecs = load("enginecoreset.yaml")
    ecs["spec"] |= {"replicas": replicas, **spec}
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


def apply_hpa(cp: LocalControlPlane, ns: str, sample: str = "hpa.yaml", **spec: Any) -> dict[str, Any]:
    obj = copy.deepcopy(load(sample))
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


def rescaled(cp: LocalControlPlane, ns: str, *parts: str) -> str:
    """The HPA's SuccessfulRescale event whose message has every one of `parts` (events are posted after the
    scale write, asynchronously: waited for)."""
    def found() -> str | None:
        return next((m for m in hpa_events(cp, ns, "SuccessfulRescale") if all(p in m for p in parts)), None)

    return wait_until(found, 30, f"a SuccessfulRescale event with {parts}",
                      diagnose=lambda: f"events: {hpa_events(cp, ns, 'SuccessfulRescale')}")


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


def test_hpa_at_min_replicas_0_idles_the_fleet_and_a_held_request_wakes_it(
        cp: LocalControlPlane, adapter: PrometheusAdapter, gauges: RankGauges, prometheus: Prometheus,
        ns: str) -> None:
    """hpa-scale-to-zero.yaml: no demand -> spec.replicas 0 (the fleet idles: engines and their series go,
    the frontend stays and its demand reads 0, so the HPA keeps reading it at zero); a request held at
    the frontend -> the HPA writes spec.replicas >= 1 (the operator wakes the fleet)."""
    version = cp.request("GET", "/version")
    assert (int(version["major"]), int(version["minor"].rstrip("+"))) >= (1, 37), (
        f"Kubernetes {version['gitVersion']}: HPAScaleToZero is alpha (off) before 1.37; this control plane "
        "would need --feature-gates=HPAScaleToZero=true on kube-apiserver and kube-controller-manager")
    create_fleet(cp, ns, replicas=1, idle={})  # spec.idle: replicas 0 idles it; 1 committed rank
    gauges.set(ns, {0: (0, 0)})  # one rank serving, no request: demand 0
    demand = f"namespaces/{ns}/{constants.PLURAL}.{constants.GROUP}/{FLEET}/{DEMAND_METRIC}"
    wait_until(lambda: served_metric(adapter, demand), 60, f"{DEMAND_METRIC} on the custom-metrics API",
               diagnose=adapter.log_tail)

    # The sample, with a 1 s scale-down window in place of its 300 s.
    sample = load("hpa-scale-to-zero.yaml")
    behavior = copy.deepcopy(sample["spec"]["behavior"])
    behavior["scaleDown"]["stabilizationWindowSeconds"] = 1
    apply_hpa(cp, ns, "hpa-scale-to-zero.yaml", behavior=behavior)
    wait_until(lambda: spec_replicas(cp, ns) == 0, 90, "spec.replicas 0 through /scale",
               diagnose=lambda: describe(cp, ns))
    rescaled(cp, ns, "New size: 0", "All metrics below target")
    scaled_to_zero = wait_until(lambda: conditions(hpa(cp, ns)).get("ScaledToZero", {}).get("status") == "True",
                                30, "ScaledToZero=True", diagnose=lambda: describe(cp, ns))
    assert scaled_to_zero

    # The operator idles the fleet: its engine is deleted, so vLLM's series and the in-flight rule go;
    # the frontend stays, holding nothing. status.replicas stays 1, the size it wakes to.
    gauges.set(ns, {})
    prometheus.wait_for(f'corefleet:fleet_in_flight_requests{{namespace="{ns}"}}', lambda r: not r, 30,
                        "no in-flight series for the idle fleet")
    [idle] = prometheus.wait_for(f'corefleet:fleet_demand_requests{{namespace="{ns}"}}', lambda r: len(r) == 1, 30,
                                 "the idle fleet's demand")
    assert float(idle["value"][1]) == 0
    [served] = wait_until(lambda: served_metric(adapter, demand), 30, f"{DEMAND_METRIC} of the idle fleet",
                          diagnose=adapter.log_tail)["items"]
    assert quantity(served["value"]) == 0
    # At zero the HPA still reads it (it scaled to zero itself): scaling stays active, no metric error.
    active = conditions(hpa(cp, ns)).get("ScalingActive", {})
    assert (active.get("status"), active.get("reason")) == ("True", "ValidMetricFound"), describe(cp, ns)
    assert not hpa_events(cp, ns, "FailedGetObjectMetric")
    assert spec_replicas(cp, ns) == 0

    # A request arrives and waits at the frontend: no engine series at all, demand 1.
    assert gauges.set(ns, {}, held=1) == 1
    wait_until(lambda: spec_replicas(cp, ns) >= 1, 60, "spec.replicas >= 1 for a held request",
               diagnose=lambda: describe(cp, ns))
    assert spec_replicas(cp, ns) == 1  # ceil(1 / 32)
    # (The controller words an Object metric's reason "external metric <name>(nil) above target".)
    rescaled(cp, ns, "New size: 1", DEMAND_METRIC, "above target")
    woke = wait_until(lambda: conditions(hpa(cp, ns)).get("ScaledToZero", {}).get("status") == "False", 30,
                      "ScaledToZero=False after the wake", diagnose=lambda: describe(cp, ns))
    assert woke


# ---- the samples ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("sample", "min_replicas", "metric"), [("hpa.yaml", 1, METRIC),
                                                              ("hpa-scale-to-zero.yaml", 0, DEMAND_METRIC)])
def test_hpa_samples_target_the_sample_fleet_within_its_max_replicas(
        cp: LocalControlPlane, ns: str, sample: str, min_replicas: int, metric: str) -> None:
    h, fleet = load(sample), load("enginecoreset.yaml")
    target = {"apiVersion": constants.API_VERSION, "kind": constants.KIND, "name": fleet["metadata"]["name"]}
    assert h["spec"]["scaleTargetRef"] == target
    assert h["spec"]["metrics"][0]["object"]["describedObject"] == target
    assert h["spec"]["metrics"][0]["object"]["metric"]["name"] == metric
    assert h["spec"]["minReplicas"] == min_replicas
    assert h["spec"]["maxReplicas"] == fleet["spec"]["maxReplicas"]
    assert h["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    assert h["spec"]["metrics"][0]["object"]["target"] == load("hpa.yaml")["spec"]["metrics"][0]["object"]["target"]
    # Offline, as the chart is checked (test_chart.py), and by the API server, unknown fields refused by both
    # (minReplicas 0: the API server's HPAScaleToZero gate, on by default in 1.37).
    v = subprocess.run([str(Path(sys.executable).with_name("kubernetes-validate")), "--strict", "-k", "1.37.0",
                        str(SAMPLES / sample)], capture_output=True, text=True, check=False, timeout=120)
    assert v.returncode == 0, v.stdout + v.stderr
    assert "passed for resource horizontalpodautoscaler/qwen3-dense" in v.stdout
    r = cp.kubectl("apply", "-n", ns, "--dry-run=server", "--validate=strict", "-f", str(SAMPLES / sample))
    assert "created (server dry run)" in r.stdout


def test_keda_sample_scales_the_fleet_to_zero_on_the_same_series(prometheus: Prometheus, gauges: RankGauges) -> None:
    keda, h = load("keda-scaledobject.yaml"), load("hpa-scale-to-zero.yaml")
    assert (keda["apiVersion"], keda["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert keda["spec"]["scaleTargetRef"] == h["spec"]["scaleTargetRef"]
    assert (keda["spec"]["minReplicaCount"], keda["spec"]["maxReplicaCount"]) == \
        (h["spec"]["minReplicas"], h["spec"]["maxReplicas"]) == (0, 4)
    # KEDA itself scales 0 <-> 1: to 0 after cooldownPeriod with the trigger inactive, as the HPA's window.
    assert keda["spec"]["cooldownPeriod"] == h["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"]
    assert keda["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == h["spec"]["behavior"]
    [trigger] = keda["spec"]["triggers"]
    assert (trigger["type"], trigger["metricType"]) == ("prometheus", "AverageValue")
    assert set(trigger["metadata"]) == {"serverAddress", "query", "threshold", "activationThreshold"}
    assert trigger["metadata"]["threshold"] == h["spec"]["metrics"][0]["object"]["target"]["averageValue"]
    assert trigger["metadata"]["activationThreshold"] == "0"  # active (woken) by one request: demand > 0
    # Its query, on the real Prometheus, is the fleet's demand (namespace as in the sample): in flight
    # and held while it serves, ...
    query = trigger["metadata"]["query"]

    def value_is(total: float) -> Callable[[list[dict[str, Any]]], bool]:
        return lambda r: len(r) == 1 and float(r[0]["value"][1]) == total

    total = gauges.set("default", {0: (7, 2), 1: (4, 0)}, held=1)
    prometheus.wait_for(query, value_is(total), 30)
    assert total == 14
    # ... 0 once idle (no engine series; not missing: KEDA reads 0, inactive) and 2 with two requests held.
    assert gauges.set("default", {}) == 0
    prometheus.wait_for(query, value_is(0), 30, "an idle fleet's demand: 0")
    assert gauges.set("default", {}, held=2) == 2
    prometheus.wait_for(query, value_is(2), 30, "an idle fleet's demand with 2 requests held")


def test_prometheus_that_cannot_start_fails_with_its_command_and_log(tmp_path: Path) -> None:
    bad_rule = "groups:\n  - name: broken\n    rules:\n      - record: a:b\n        expr: sum(\n"
    with pytest.raises(MetricsStackError) as err:
        Prometheus(tmp_path, rules={"broken.yml": bad_rule}).start()
    msg = str(err.value)
    assert msg.startswith("prometheus exited with code 1")
    assert f"--config.file={tmp_path / 'prometheus.yml'}" in msg
    assert "error loading config" in msg  # the log's tail
