# SPDX-License-Identifier: Apache-2.0
"""Observability on a running fleet, against a real Prometheus.

The control plane is real. The operator is installed by `helm install` of charts/corefleet (its
service account, ClusterRole and binding; the Deployment's pod, in a namespace no pod runner serves,
stays unscheduled) and runs as a process with that service account's token and its metrics endpoint
on, so every test here also shows the chart's RBAC is enough (no Forbidden in its log). `podrunner`
runs the fleet's pods (real-vLLM frontend and coordinator, emulated engines). Prometheus (Debian's binary)
scrapes the operator with the chart's ServiceMonitor settings and the fleet's frontend, found from
the API server's pods, with the chart's PodMonitor relabelings (tests/promscrape.py), and
evaluates the chart's PrometheusRule as rendered by `helm template`. One fleet serves the module,
from 1 rank with headroom to 3:

* the targets are up and the series carry the labels the rules and dashboards group by;
* a resize up and down is counted once per direction with its duration, and afterwards no series of
  the retired rank is left, neither vLLM's nor corefleet's nor a recording rule's;
* every dashboard panel query and every recording and alert rule's query returns data for the fleet
  (an alert's condition is checked on its signal, the expression without its threshold);
* the HPA loop: prometheus-adapter (built from its Go module) serves the recording rule
  `corefleet:fleet_in_flight_requests` by manifests/samples/prometheus-adapter-rules.yaml, the
  controller manager's HPA controller reads it for manifests/samples/hpa.yaml and scales the
  EngineCoreSet through /scale; the operator resizes the fleet in place, up under load and back down
  once the load stopped and the (shortened) stabilization window passed.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from corefleet_harness.emulator import EMULATOR_MODULE
from corefleet_harness.localcluster import LocalControlPlane
from corefleet_harness.support import free_port, wait_until
from corefleet_harness.tinymodel import write_tiny_model
from factories import make_ecs
from fleettest import FleetView, Load, OperatorProcess, ResizeWatch, ecs_engine_args
from metricsstack import Prometheus, PrometheusAdapter, current_average, hpa_events
from podrunner import PodRunner
from promqueries import dashboard_expressions, rule_expressions
from promscrape import CHART, PodDiscovery, one, pod_monitor_job, render_chart, service_monitor_job

pytestmark = pytest.mark.e2e

NAME = "obs"
SERVED = "tiny"
TOKEN_DELAY_MS = 10
SETTLE = 240.0
# The startup-probe and join budget: no test here is about a rank that fails to join, and an emulated
# engine imports vLLM for its wire types (13-40 s alone; more on a busy machine).
READY_TIMEOUT = 300
QUERY_WAIT = 90.0  # rates and quantiles need a few scrapes of traffic; rules one evaluation more
SAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "samples"
HPA_TARGET = 2  # in-flight requests per rank; the load keeps about 6 in flight
HPA_WINDOW = 20  # seconds of scale-down stabilization (the sample's 300, shortened for the test)


@dataclass
class Identity:
    """The operator's identity as the chart installs it."""

    release: str
    namespace: str  # the release's
    service_account: str
    kubeconfig: Path  # a token of that service account


@contextlib.contextmanager
def helm_installed(k8s: LocalControlPlane, watched: str, tmp: Path) -> Iterator[Identity]:
    """`helm install` of the chart (a release name of its own: its ClusterRole is cluster-wide), watching
    `watched`; the CRD is the session's (crd_installed). Uninstalled at the end."""
    release, system = f"cf-{uuid.uuid4().hex[:6]}", f"{watched}-system"
    env = {**k8s.env(), **{v: str(tmp / "helm" / v.lower()) for v in
                           ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME")}}

    def helm(*args: str) -> None:
        r = subprocess.run([k8s.binary("helm"), *args], env=env, capture_output=True, text=True, check=False,
                           timeout=180)
        assert r.returncode == 0, f"helm {' '.join(args)}: {r.stdout}{r.stderr}"

    helm("install", release, str(CHART), "--namespace", system, "--create-namespace", "--skip-crds",
         "--set", f"watchNamespaces={{{watched}}}")
    try:
        sa = f"{release}-operator"
        token = k8s.kubectl("create", "token", sa, "-n", system, "--duration=3h").stdout.strip()
        yield Identity(release, system, sa, k8s.kubeconfig_for_token(token, sa))
    finally:
        helm("uninstall", release, "--namespace", system)
        k8s.kubectl("delete", "namespace", system, "--wait=false", check=False)


class Setup:
    def __init__(self, k8s: LocalControlPlane, ns: str, runner: PodRunner, operator: OperatorProcess,
                 fleet: FleetView, prom: Prometheus, identity: Identity) -> None:
        self.k8s, self.ns, self.runner, self.operator, self.fleet, self.prom = k8s, ns, runner, operator, fleet, prom
        self.identity = identity

    def load(self, workers: int = 2) -> Load:
        return Load(f"http://{self.fleet.frontend_ip()}:8000", SERVED, workers=workers, max_tokens=24).start()

    def series(self, expr: str) -> list[dict[str, str]]:
        return [r["metric"] for r in self.prom.query(expr)]

    def value(self, expr: str) -> float | None:
        result = self.prom.query(expr)
        assert len(result) <= 1, f"{expr}: more than one series: {result}"
        return float(result[0]["value"][1]) if result else None


@pytest.fixture(scope="module")
def setup(k8s: LocalControlPlane, crd_installed: None, module_namespace: str,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    ns = module_namespace
    tmp = tmp_path_factory.mktemp("observability")
    model = write_tiny_model(tmp / "tiny")
    docs = render_chart(k8s.binary("helm"), ns, "metrics.serviceMonitor.enabled=true",
                        "fleetMonitoring.podMonitor.enabled=true", "prometheusRule.enabled=true")
    # The PrometheusRule's groups, as prometheus-operator hands them to Prometheus.
    rules = {"corefleet-rules.yaml": yaml.safe_dump({"groups": one(docs, "PrometheusRule")["spec"]["groups"]})}
    metrics_port = free_port()
    discovery = PodDiscovery(k8s, [ns])
    scrape = [
        service_monitor_job(one(docs, "ServiceMonitor"), f"127.0.0.1:{metrics_port}"),
        pod_monitor_job(one(docs, "PodMonitor"), discovery.url),
    ]
    emulator = (EMULATOR_MODULE, "--token-delay-ms", str(TOKEN_DELAY_MS))
    with discovery, helm_installed(k8s, ns, tmp) as identity, \
            PodRunner(k8s, ns, tmp / "pods", engine=emulator) as runner, \
            OperatorProcess(k8s, ns, tmp, metrics_port=metrics_port, kubeconfig=identity.kubeconfig) as operator, \
            Prometheus(tmp / "prometheus", scrape_configs=scrape, rules=rules) as prom:
        ecs = (make_ecs(NAME, ns).model(str(model)).replicas(1).max_replicas(3).tp(1)
               .set("engine.loadFormat", "dummy").set("scaling.readyTimeoutSeconds", READY_TIMEOUT)
               .set("scaling.drainTimeoutSeconds", 60).arg(*ecs_engine_args(SERVED)).manifest())
        k8s.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(ecs))
        fleet = FleetView(k8s, ns, NAME, runner, SERVED)
        fleet.wait_settled(1, SETTLE)
        yield Setup(k8s, ns, runner, operator, fleet, prom, identity)
        operator.check_clean()
        log = operator.output()
        assert "Forbidden" not in log, log[-4000:]
        assert " 403" not in log, log[-4000:]
        assert not runner.errors, runner.errors


def test_targets_are_up_with_the_labels_rules_group_by(setup: Setup) -> None:
    s = setup
    for job in ("corefleet-operator", "corefleet-frontend"):
        def scraped(job: str = job) -> bool:
            return s.value(f'up{{job="{job}"}}') == 1

        wait_until(scraped, QUERY_WAIT, f"Prometheus to scrape {job}")
    # The frontend's series: vLLM's per rank, with the fleet, namespace and pod from the PodMonitor.
    [running] = s.series('vllm:num_requests_running{job="corefleet-frontend"}')
    assert {k: running[k] for k in ("namespace", "fleet", "pod", "engine")} == \
        {"namespace": s.ns, "fleet": NAME, "pod": f"{NAME}-frontend", "engine": "0"}
    assert s.value(f'corefleet_frontend_rank_state{{fleet="{NAME}", engine="0", state="Serving"}}') == 1
    # The operator's: honor_labels keeps the fleet's namespace and name.
    fleet = f'namespace="{s.ns}", fleet="{NAME}"'
    wait_until(lambda: s.value(f'corefleet_fleet_phase{{{fleet}, phase="Running"}}') == 1, QUERY_WAIT,
               "the operator's phase of the fleet: Running")
    assert s.value(f"sum(corefleet_fleet_phase{{{fleet}}})") == 1  # one phase at a time
    for size in ("desired", "committed", "ready", "max"):
        assert s.value(f"corefleet_fleet_ranks_{size}{{{fleet}}}") == (3 if size == "max" else 1), size


def test_a_resize_is_counted_and_a_retired_rank_leaves_no_series(setup: Setup) -> None:
    s = setup
    s.fleet.scale(1)  # where it starts (the HPA test ends at 1 too)
    s.fleet.wait_settled(1, SETTLE)
    fleet = f'namespace="{s.ns}", fleet="{NAME}"'

    def counted(direction: str, series: str = "corefleet_resize_operations_total") -> float:
        return s.value(f'{series}{{{fleet}, direction="{direction}", result="completed"}}') or 0.0

    before = {d: (counted(d), counted(d, "corefleet_resize_duration_seconds_count")) for d in ("up", "down")}
    load = s.load()
    try:
        with ResizeWatch(s.fleet):
            s.fleet.scale(2)
            s.fleet.wait_settled(2, SETTLE)
        wait_until(lambda: s.value(f'sum(corefleet_frontend_rank_requests_routed_total{{fleet="{NAME}", engine="1"}})')
                   or 0 > 0, QUERY_WAIT, "Prometheus to see requests routed to rank 1")
        wait_until(lambda: s.value(f'corefleet:rank_in_flight_requests{{fleet="{NAME}", engine="1"}}') is not None,
                   QUERY_WAIT, "the per-rank recording rule for rank 1")
        with ResizeWatch(s.fleet):
            s.fleet.scale(1)
            s.fleet.wait_settled(1, SETTLE)
    finally:
        load.stop()
    assert not load.failures(), load.summary()

    for direction in ("up", "down"):
        ops, durations = before[direction]

        def one_more(d: str = direction, ops: float = ops) -> bool:
            return counted(d) == ops + 1

        wait_until(one_more, QUERY_WAIT, f"one more completed {direction} resize counted")
        assert counted(direction, "corefleet_resize_duration_seconds_count") == durations + 1
    assert s.value(f"corefleet_fleet_resize_in_progress{{{fleet}}}") == 0
    # Rank 1 left: its series go stale with the next scrape (and the rules' with the next evaluation).
    retired = f'{{fleet="{NAME}", engine="1"}}'
    wait_until(lambda: not s.series(retired), QUERY_WAIT, "no series of retired rank 1",
               diagnose=lambda: f"left: {sorted({m['__name__'] for m in s.series(retired)})}")
    assert s.series(f'{{fleet="{NAME}", engine="0"}}'), "rank 0's series went too"


# A binary operator's vector matching: on/ignoring (labels), group_left/group_right (labels).
MATCHING = r"( (on|ignoring) ?\([^)]*\))?( (group_left|group_right)( ?\([^)]*\))?)?"


def signals(expr: str) -> list[str]:
    """An alert's condition without its thresholds: the queries that must return data for a running fleet.

    `absent(X)` -> X; `A > 0.9` -> A; `A and B` (or `unless`, `or`) -> the signals of each side. Only
    top-level operators (outside parentheses, braces and brackets) are split."""
    expr = " ".join(expr.split())
    if expr.startswith("(") and expr.endswith(")") and _balanced(expr[1:-1]):
        return signals(expr[1:-1].strip())
    m = re.fullmatch(r"absent\((.*)\)", expr)
    if m and _balanced(m.group(1)):
        return signals(m.group(1))
    parts = _split_top(expr, r" (and|unless|or)" + MATCHING + " ")
    if len(parts) > 1:
        return [sig for p in parts for sig in signals(p)]
    parts = _split_top(expr, r" (>=|<=|==|!=|>|<)( bool)?" + MATCHING + " ")
    if len(parts) == 2:
        return [p for p in parts if not re.fullmatch(r"[0-9.e+-]+", p.strip())]
    return [expr]


def _balanced(expr: str) -> bool:
    depth = 0
    for c in expr:
        depth += (c in "([{") - (c in ")]}")
        if depth < 0:
            return False
    return depth == 0


def _split_top(expr: str, pattern: str) -> list[str]:
    depth, cuts, i = 0, [], 0
    while i < len(expr):
        c = expr[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            m = re.match(pattern, expr[i:])
            if m:
                cuts.append((i, i + m.end()))
                i += m.end()
                continue
        i += 1
    if not cuts:
        return [expr]
    out, start = [], 0
    for a, b in cuts:
        out.append(expr[start:a])
        start = b
    return [*out, expr[start:]]


def test_every_dashboard_and_rule_query_returns_data(setup: Setup) -> None:
    s = setup
    queries = [(f"dashboard {title}", expr) for title, expr in dashboard_expressions(s.ns, NAME)]
    queries += [(f"rule {name}", sig) for name, expr in rule_expressions() for sig in signals(expr)]
    assert queries
    load = s.load(workers=3)
    try:
        empty: list[str] = []
        for what, expr in queries:
            def has_data(expr: str = expr) -> bool:
                return bool(s.prom.query(expr))

            try:
                wait_until(has_data, QUERY_WAIT, f"{what}: {expr}")
            except AssertionError:
                empty.append(f"{what}: {expr}")
    finally:
        load.stop()
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_signals_of_an_alert() -> None:
    assert signals('absent(up{job="corefleet-operator"} == 1)') == ['up{job="corefleet-operator"}']
    assert signals('max by (fleet) (x{a="b>c"}) > 0.9') == ['max by (fleet) (x{a="b>c"})']
    assert signals("a > 0 and on(fleet) b == 0") == ["a", "b"]
    assert signals("a and on (fleet, engine) b") == ["a", "b"]
    assert signals("a >= on (fleet) group_left b") == ["a", "b"]
    assert signals("(a >= on (fleet) b) and c > 1") == ["a", "b", "c"]
    assert signals("(a) / (b)") == ["(a) / (b)"]
    assert signals("rate(x[5m]) > bool 1") == ["rate(x[5m])"]
    assert signals("absent(a) or absent(b)") == ["a", "b"]


class Timeline:
    """What happened when, relative to its start: kept for the failure message (and `-s` runs)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.lines: list[str] = []

    def mark(self, what: str) -> None:
        self.lines.append(f"{time.monotonic() - self.t0:7.1f}s  {what}")
        print(self.lines[-1])

    def __str__(self) -> str:
        return "\n".join(self.lines)


def hpa_manifest() -> dict[str, Any]:
    """manifests/samples/hpa.yaml for this fleet: its name, its maxReplicas (3), a low target (the emulated
    fleet is small) and a short scale-down window; metric, target type and behavior's shape as shipped."""
    hpa: dict[str, Any] = copy.deepcopy(yaml.safe_load((SAMPLES / "hpa.yaml").read_text()))
    hpa["metadata"]["name"] = NAME
    hpa["spec"]["scaleTargetRef"]["name"] = NAME
    hpa["spec"]["maxReplicas"] = 3
    [metric] = hpa["spec"]["metrics"]
    metric["object"]["describedObject"]["name"] = NAME
    metric["object"]["target"]["averageValue"] = str(HPA_TARGET)
    hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] = HPA_WINDOW
    return hpa


def test_hpa_scales_the_fleet_up_under_load_and_back_down(setup: Setup, tmp_path: Path) -> None:
    s = setup
    tl = Timeline()
    hpa_path = f"/apis/autoscaling/v2/namespaces/{s.ns}/horizontalpodautoscalers/{NAME}"

    def hpa() -> dict[str, Any]:
        obj: dict[str, Any] = s.k8s.request("GET", hpa_path)
        return obj

    def rescales() -> list[str]:
        return hpa_events(s.k8s, s.ns, "SuccessfulRescale")

    def explain() -> str:
        return (f"timeline:\n{tl}\nHPA status: {json.dumps(hpa().get('status'), indent=1)}\n"
                f"events: {rescales()}\n{s.k8s.kubectl('describe', 'hpa', '-n', s.ns, check=False).stdout}")

    with PrometheusAdapter(s.k8s, s.prom.url, SAMPLES / "prometheus-adapter-rules.yaml", tmp_path / "adapter"):
        s.k8s.kubectl("apply", "-n", s.ns, "-f", "-", input=json.dumps(hpa_manifest()))
        tl.mark("HPA applied (target 2 in flight per rank, maxReplicas 3, scale-down window 20 s)")
        # Idle, the HPA reads the metric (0 per rank) and keeps the fleet at 1.
        wait_until(lambda: current_average(hpa()) is not None, 120, "the HPA to read the fleet's metric",
                   diagnose=explain)
        tl.mark(f"HPA reads the metric: {current_average(hpa()):g} per rank; "
                f"spec.replicas {s.fleet.ecs()['spec']['replicas']}")
        load = s.load(workers=6)
        try:
            wait_until(lambda: s.fleet.ecs()["spec"]["replicas"] > 1, 120, "the HPA to scale the fleet up",
                       diagnose=explain)
            tl.mark(f"spec.replicas {s.fleet.ecs()['spec']['replicas']} through /scale; HPA events {rescales()}")
            wait_until(lambda: s.fleet.ecs()["spec"]["replicas"] == 3, 120, "the HPA to reach maxReplicas 3",
                       diagnose=explain)
            s.fleet.wait_settled(3, SETTLE)
            tl.mark("the fleet serves at 3 ranks (in place)")
            served = s.fleet.admin().fleet()
            wait_until(lambda: all(r.requests_total > 0 for r in s.fleet.admin().fleet().ranks), 60,
                       "every rank, the new ones too, to serve requests")
            tl.mark(f"every rank served requests ({[r.requests_total for r in served.ranks]} when settled)")
        finally:
            load.stop()
        tl.mark(f"load stopped: {len(load.outcomes)} requests, {len(load.failures())} failed")
        assert not load.failures(), load.summary()
        wait_until(lambda: s.fleet.ecs()["spec"]["replicas"] == 1, HPA_WINDOW + 120,
                   "the HPA to scale the fleet back down after the stabilization window", diagnose=explain)
        tl.mark(f"spec.replicas 1 through /scale; HPA events {rescales()}")
        s.fleet.wait_settled(1, SETTLE)
        tl.mark("the fleet serves at 1 rank")
        s.k8s.kubectl("delete", "hpa", NAME, "-n", s.ns)
    ups = [m for m in rescales() if "above target" in m]
    downs = [m for m in rescales() if "below target" in m or "All metrics below target" in m]
    assert ups, explain()
    assert downs, explain()


def test_the_charts_service_account_can_do_what_the_operator_needs_and_no_more(setup: Setup) -> None:
    """The operator ran every test above under the chart's identity (no Forbidden: checked at teardown);
    `kubectl auth can-i` shows what that identity may not do."""
    s, who = setup, setup.identity
    as_sa = f"--as=system:serviceaccount:{who.namespace}:{who.service_account}"

    def can(*args: str) -> bool:
        r = s.k8s.kubectl("auth", "can-i", *args, as_sa, check=False)
        return r.stdout.strip() == "yes"

    for allowed in (("create", "pods", "-n", s.ns),
                    ("patch", "enginecoresets.corefleet.io", "--subresource=status", "-n", s.ns),
                    ("create", "events", "-n", s.ns), ("create", "secrets", "-n", s.ns)):
        assert can(*allowed), allowed
    for refused in (("delete", "customresourcedefinitions"), ("create", "clusterrolebindings"),
                    ("create", "deployments", "-n", s.ns), ("delete", "nodes"),
                    ("create", "pods", "--subresource=exec", "-n", s.ns), ("delete", "enginecoresets.corefleet.io"),
                    ("impersonate", "serviceaccounts"), ("*", "*")):
        assert not can(*refused), refused
    listing = s.k8s.kubectl("auth", "can-i", "--list", "-n", s.ns, as_sa).stdout
    print(listing)
    assert "enginecoresets.corefleet.io" in listing
