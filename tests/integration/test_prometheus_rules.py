# SPDX-License-Identifier: Apache-2.0
"""The chart's Prometheus rules and Grafana dashboards, checked offline.

promtool (COREFLEET_PROMETHEUS_BIN, from hack/metrics-stack.sh via .corefleet.env) checks and
unit-tests charts/corefleet/files/prometheus-rules.yaml and parses every dashboard expression. Every
metric name must be one corefleet exports or one the installed vLLM 0.32.0 defines (with the
suffix its type gets: counters `_total`, histograms `_bucket`/`_sum`/`_count`), so a dashboard or
alert written for another vLLM version fails here instead of showing "No data". Helm renders the
PrometheusRule and dashboard ConfigMaps from the same files. No cluster is needed; the e2e tests
run the same expressions (tests/promqueries.py) against a Prometheus scraping a live fleet.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml

import promqueries as pq
from corefleet_operator.models import FleetPhase

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "corefleet"

# corefleet's metrics (operator: corefleet_operator/metrics.py; frontend), name -> type.
COREFLEET_METRICS = {
    "corefleet_reconciles": "counter",
    "corefleet_reconcile_duration_seconds": "histogram",
    "corefleet_api_requests": "counter",
    "corefleet_fleets": "gauge",
    "corefleet_fleet_phase": "gauge",
    "corefleet_fleet_recoveries": "gauge",
    "corefleet_fleet_ranks_desired": "gauge",
    "corefleet_fleet_ranks_committed": "gauge",
    "corefleet_fleet_ranks_ready": "gauge",
    "corefleet_fleet_ranks_max": "gauge",
    "corefleet_fleet_resize_in_progress": "gauge",
    "corefleet_resize_operations": "counter",
    "corefleet_resize_duration_seconds": "histogram",
    "corefleet_frontend_rank_state": "gauge",
    "corefleet_frontend_rank_requests_in_flight": "gauge",
    "corefleet_frontend_rank_requests_routed": "counter",
    "corefleet_frontend_rank_requests_aborted": "counter",
    "corefleet_frontend_rank_requests_failed": "counter",
    "corefleet_frontend_rank_stalled": "gauge",
    "corefleet_frontend_rank_stalls": "counter",
    "corefleet_frontend_rank_requests_moved": "counter",
    "corefleet_frontend_rank_requests_routed_by_prefix": "counter",
    "corefleet_frontend_ranks": "gauge",
    "corefleet_frontend_resize_phase": "gauge",
    "corefleet_frontend_requests_waiting": "gauge",
    "corefleet_frontend_requests_held": "counter",
    "corefleet_frontend_requests_hold_refused": "counter",
}
PROMETHEUS_METRICS = {"up"}  # made by Prometheus itself
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
# Labels the expressions may group or match by: the scrape's, corefleet's, the rules' own, and
# vLLM's (checked against its source below).
SCRAPE_LABELS = {"namespace", "fleet", "pod", "job", "instance"}
COREFLEET_LABELS = {"result", "verb", "resource", "code", "phase", "direction", "state", "engine", "le", "quantile",
                    "decision", "reason"}
VLLM_LABELS = {"engine", "model_name", "finished_reason"}

REQUIRED_RECORDS = {"corefleet:rank_in_flight_requests", "corefleet:fleet_in_flight_requests",
                    "corefleet:fleet_in_flight_requests_per_rank", "corefleet:fleet_requests_waiting",
                    "corefleet:fleet_demand_requests"}
REQUIRED_ALERTS = {
    "CorefleetOperatorDown", "CorefleetReconcileErrors", "CorefleetFleetDegraded", "CorefleetFleetFailed",
    "CorefleetRecoveryLoop", "CorefleetRanksNotReady", "CorefleetResizeStuck", "CorefleetResizeFailed",
    "CorefleetRankStalled", "CorefleetRankImbalance", "CorefleetKVCacheNearFull", "CorefleetQueueTimeHigh",
    "CorefleetErrorRate", "CorefleetAtMaxReplicas", "CorefleetWakeSlow", "CorefleetRequestsRefusedByHold",
}
# Phases of a fleet scaled to zero (spec.idle): no engine and no ready rank by design, not a fault.
IDLE_PHASES = ("Idle", "Waking")
# Recording rules whose values the promtool unit tests check (promql_expr_test).
VALUE_TESTED_RECORDS = REQUIRED_RECORDS | {
    "corefleet:fleet_rank_load_skew", "corefleet:fleet_kv_cache_usage_perc:max", "corefleet:fleet_prompt_tokens:rate5m",
    "corefleet:rank_generation_tokens:rate5m", "corefleet:fleet_requests:rate5m",
    "corefleet:fleet_request_failure_ratio:rate5m", "corefleet:operator_reconcile_error_ratio:rate5m",
    "corefleet:fleet_time_to_first_token_seconds:histogram_quantile5m",
    "corefleet:fleet_request_queue_time_seconds:histogram_quantile5m",
}
# Rules that read a counter's raw value on purpose (see the rule's comment).
RAW_COUNTER_OK = {"CorefleetResizeFailed"}


# ---- tools ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def promtool() -> str:
    bin_dir = os.environ.get("COREFLEET_PROMETHEUS_BIN")
    if not bin_dir:
        pytest.fail("COREFLEET_PROMETHEUS_BIN is not set: run `make setup` (or `bash hack/metrics-stack.sh`) and "
                    "source .corefleet.env (`set -a && . ./.corefleet.env && set +a`)")
    path = Path(bin_dir) / "promtool"
    if not os.access(path, os.X_OK):
        pytest.fail(f"no executable promtool in COREFLEET_PROMETHEUS_BIN={bin_dir}: rerun `bash hack/metrics-stack.sh`")
    return str(path)


@pytest.fixture(scope="module")
def helm() -> str:
    k8s_bin = os.environ.get("COREFLEET_K8S_BIN")
    candidates = [Path(k8s_bin) / "helm"] if k8s_bin else []
    if which := shutil.which("helm"):
        candidates.append(Path(which))
    for c in candidates:
        if os.access(c, os.X_OK):
            return str(c)
    pytest.fail("no helm: set COREFLEET_K8S_BIN (source .corefleet.env after `make setup`) or put helm on PATH")


def run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False, timeout=120)


def helm_template(helm: str, tmp_path: Path, *sets: str) -> list[dict[str, Any]]:
    env = {**os.environ, **{v: str(tmp_path / v.lower()) for v in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME",
                                                                   "HELM_DATA_HOME")}}
    args = [helm, "template", "corefleet", str(CHART), "--namespace", "monitoring-test"]
    for s in sets:
        args += ["--set", s]
    r = subprocess.run(args, capture_output=True, text=True, check=False, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


# ---- vLLM's metric names ------------------------------------------------------------------------
def vllm_root() -> Path:
    """The installed vLLM package's directory (found without importing it)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("vLLM is not installed in this environment: run `make setup`")
    root = Path(next(iter(spec.submodule_search_locations)))
    if not (root / "v1" / "metrics" / "loggers.py").is_file():
        pytest.fail(f"no vllm/v1/metrics/loggers.py under {root}: not the vLLM 0.32 layout")
    return root


@functools.cache
def vllm_metrics() -> dict[str, set[str]]:
    """Every "vllm:..." string in the installed vLLM's source -> the metric types (counter, gauge,
    histogram) its definitions suggest (the nearest type word before the name; empty if unsure)."""
    root = vllm_root()
    found: dict[str, set[str]] = {}
    name_re = re.compile(r"[\"'](vllm:[A-Za-z0-9_]+)[\"']")
    kind_re = re.compile(r"counter|gauge|histogram", re.IGNORECASE)
    for path in root.rglob("*.py"):
        text = path.read_text(errors="replace")
        if "vllm:" not in text:
            continue
        for m in name_re.finditer(text):
            kinds = kind_re.findall(text[max(0, m.start() - 300):m.start()])
            found.setdefault(m.group(1), set()).update([kinds[-1].lower()] if kinds else [])
    return found


def check_metric(name: str, where: str, records: set[str], allow_records: bool) -> str | None:
    """An error message if `name` is not a metric that exists, else None."""
    if name.startswith("corefleet:"):
        if not allow_records:
            return f"{where}: uses recording rule {name}; dashboards must work without the PrometheusRule"
        return None if name in records else f"{where}: {name} is no recording rule of prometheus-rules.yaml"
    if name in PROMETHEUS_METRICS:
        return None
    if name.startswith("corefleet_"):
        for base, kind in COREFLEET_METRICS.items():
            if any(name == base + s for s in SUFFIXES[kind]):
                return None
        return f"{where}: {name} is no corefleet metric (with its type's suffix)"
    if name.startswith("vllm:"):
        defined = vllm_metrics()
        candidates = [(name, "")] + [(name[: -len(s)], s) for s in ("_total", "_bucket", "_sum", "_count")
                                      if name.endswith(s)]
        for base, suffix in candidates:
            if base not in defined:
                continue
            kinds = defined[base]
            if not kinds or any(suffix in SUFFIXES[k] for k in kinds):
                return None
            return (f"{where}: {name}: vLLM defines {base} as {'/'.join(sorted(kinds))}, "
                    "exported as " + " or ".join(base + s for k in sorted(kinds) for s in SUFFIXES[k]))
        return f"{where}: {name} is not defined by the installed vLLM (0.32.0)"
    return f"{where}: {name} is neither a corefleet nor a vLLM metric"


def grouping_labels(expr: str) -> set[str]:
    labels: set[str] = set()
    for m in re.finditer(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        labels.update(x.strip() for x in m.group(1).split(",") if x.strip())
    return labels


# ---- the rules ------------------------------------------------------------------------------------
def all_rules() -> list[dict[str, Any]]:
    return [r for g in pq.rule_groups() for r in g["rules"]]


def test_promtool_check_rules(promtool: str) -> None:
    r = run(promtool, "check", "rules", str(pq.RULES_FILE))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_promtool_rule_unit_tests(promtool: str) -> None:
    r = run(promtool, "test", "rules", pq.RULES_TEST_FILE.name, cwd=pq.RULES_TEST_FILE.parent)
    assert r.returncode == 0, r.stdout + r.stderr


def test_rules_have_the_required_names_and_conventions() -> None:
    rules = all_rules()
    records = {r["record"] for r in rules if "record" in r}
    alerts = [r for r in rules if "alert" in r]
    assert records >= REQUIRED_RECORDS
    assert {a["alert"] for a in alerts} == REQUIRED_ALERTS
    for name in records:
        assert re.fullmatch(r"corefleet:[a-z0-9_]+(:[a-z0-9_]+)?", name), f"{name}: not corefleet:level_metric:op"
    for a in alerts:
        assert a["labels"]["severity"] in {"critical", "warning", "info"}, a["alert"]
        assert "for" in a, f"{a['alert']} has no `for`"
        assert {"summary", "description"} <= set(a["annotations"]), a["alert"]
        assert "$labels." in a["annotations"]["description"], f"{a['alert']}: description names no label"
    # prometheus-adapter and the HPA depend on these exact label sets.
    by_name = {r["record"]: r["expr"] for r in rules if "record" in r}
    assert "by (namespace, fleet, engine)" in by_name["corefleet:rank_requests_running"]
    assert "by (namespace, fleet)" in by_name["corefleet:fleet_in_flight_requests"]
    assert "by (namespace, fleet)" in by_name["corefleet:fleet_requests_waiting"]


def test_the_adapter_serves_recording_rules_that_exist() -> None:
    """Each rule of manifests/samples/prometheus-adapter-rules.yaml lists one recording rule of ours, by
    its (namespace, fleet) labels, and serves it under the name the HPA samples ask for."""
    records = {r["record"] for r in all_rules() if "record" in r}
    adapter = yaml.safe_load((REPO / "manifests" / "samples" / "prometheus-adapter-rules.yaml").read_text())["rules"]
    served = {}
    for rule in adapter:
        [record] = pq.metric_names(rule["seriesQuery"])
        assert record in records, f"{rule['seriesQuery']}: no recording rule {record}"
        assert rule["name"]["matches"] == f"^{record}$"
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"},
                                                  "fleet": {"group": "corefleet.io", "resource": "enginecoresets"}}
        served[rule["name"]["as"]] = record
    assert served == {"corefleet_fleet_in_flight_requests": "corefleet:fleet_in_flight_requests",
                      "corefleet_fleet_demand_requests": "corefleet:fleet_demand_requests"}
    for sample in sorted((REPO / "manifests" / "samples").glob("hpa*.yaml")):
        for metric in yaml.safe_load(sample.read_text())["spec"]["metrics"]:
            assert metric["object"]["metric"]["name"] in served, sample.name


def test_alerts_on_readiness_leave_idle_and_waking_fleets_alone() -> None:
    """A fleet scaled to zero has no ready rank and no engine series by design: every alert that reads
    readiness ends in the same exclusion of the Idle and Waking phases (unit-tested both ways in
    prometheus-rules.test.yaml), and a wake has an alert of its own."""
    phases = "|".join(IDLE_PHASES)
    exclusion = ("unless on (namespace, fleet) max by (namespace, fleet) "
                 f'(corefleet_fleet_phase{{job="corefleet-operator", phase=~"{phases}"}}) == 1')
    alerts = {r["alert"]: " ".join(r["expr"].split()) for r in all_rules() if "alert" in r}
    reading_readiness = [name for name, expr in alerts.items() if "corefleet_fleet_ranks_ready" in expr]
    assert reading_readiness
    for name in reading_readiness:
        assert alerts[name].endswith(exclusion), f"{name} does not leave Idle/Waking fleets alone: {alerts[name]}"
    assert alerts["CorefleetWakeSlow"].startswith("max by (namespace, fleet) (corefleet_fleet_phase{"
                                                 'job="corefleet-operator", phase="Waking"})')


def test_every_alert_fires_and_stays_silent_in_the_unit_tests() -> None:
    tests = yaml.safe_load(pq.RULES_TEST_FILE.read_text())["tests"]
    firing: Counter[str] = Counter()
    silent: Counter[str] = Counter()
    value_tested: set[str] = set()
    for t in tests:
        for case in t.get("alert_rule_test", []):
            exp = case.get("exp_alerts") or []
            if exp:
                assert all(e.get("exp_labels") and e.get("exp_annotations") for e in exp), case
                firing[case["alertname"]] += 1
            else:
                silent[case["alertname"]] += 1
        for case in t.get("promql_expr_test", []):
            value_tested |= pq.metric_names(case["expr"])
    for alert in REQUIRED_ALERTS:
        assert firing[alert], f"{alert}: no unit test where it fires"
        assert silent[alert], f"{alert}: no unit test where it stays silent"
    assert value_tested >= VALUE_TESTED_RECORDS, VALUE_TESTED_RECORDS - value_tested


# ---- the dashboards -------------------------------------------------------------------------------
def variable_selectors(dashboard: dict[str, Any]) -> list[str]:
    """The series selectors of the dashboard's label_values(...) variables."""
    out = []
    for var in dashboard["templating"]["list"]:
        if var.get("type") != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", query)
        assert m, f"{dashboard['uid']}: variable {var['name']}: not label_values(selector, label): {query!r}"
        out.append(m.group(1))
    return out


def test_dashboard_structure() -> None:
    dashboards = pq.dashboards()
    assert set(dashboards) == {"corefleet-fleet", "corefleet-operator"}
    uids = [d.get("uid") for d in dashboards.values()]
    assert all(uids), uids
    assert len(set(uids)) == len(uids), uids
    for stem, d in dashboards.items():
        assert d["uid"] == stem, f"{stem}.json: uid {d['uid']!r} should be its file name"
        assert d.get("title"), stem
        assert d.get("schemaVersion", 0) >= 36, stem
        assert d.get("id") is None, f"{stem}: id must be null (Grafana assigns it)"
        variables = {v["name"]: v for v in d["templating"]["list"]}
        ds = variables.get("datasource")
        assert ds, f"{stem}: no datasource variable"
        assert (ds["type"], ds["query"]) == ("datasource", "prometheus"), ds
        ids = [p["id"] for p in d["panels"]]
        assert len(set(ids)) == len(ids), f"{stem}: duplicate panel ids"
        for panel in pq.panels(d):
            where = f"{stem} / {panel.get('title')!r}"
            assert panel.get("title"), f"{stem}: panel {panel.get('id')} has no title"
            assert panel.get("gridPos"), where
            assert panel.get("datasource") == {"type": "prometheus", "uid": "${datasource}"}, where
            targets = panel.get("targets") or []
            assert targets, f"{where}: no targets"
            assert all(t.get("expr", "").strip() for t in targets), f"{where}: empty expr"
            refs = [t.get("refId") for t in targets]
            assert all(refs), f"{where}: refIds {refs}"
            assert len(set(refs)) == len(refs), f"{where}: refIds {refs}"
            assert all(t.get("datasource") == panel["datasource"] for t in targets), where
    fleet_vars = {v["name"] for v in dashboards["corefleet-fleet"]["templating"]["list"]}
    assert {"datasource", "namespace", "fleet"} <= fleet_vars
    rows = [p["title"] for p in dashboards["corefleet-fleet"]["panels"] if p["type"] == "row"]
    assert rows == ["Overview", "Latency SLOs", "Per rank", "Resize and recovery history", "Frontends"], rows
    for _, expr in pq.dashboard_expressions("ns", "fl"):
        assert "$" not in expr, expr


def phase_colors(panel: dict[str, Any]) -> dict[str, str]:
    """phase -> the colour a panel shows it in: a fixed colour, or the colour its value 1 maps to, by field name."""
    colors = {}
    for override in panel["fieldConfig"]["overrides"]:
        assert override["matcher"]["id"] == "byName", override
        for prop in override["properties"]:
            if prop["id"] == "color":
                colors[override["matcher"]["options"]] = prop["value"]["fixedColor"]
            elif prop["id"] == "mappings":
                [mapping] = prop["value"]
                colors[override["matcher"]["options"]] = mapping["options"]["1"]["color"]
    return colors


def test_dashboards_tell_idle_and_waking_from_broken() -> None:
    """A fleet scaled to zero (Idle, Waking) shows in colours of its own, never a fault's (Degraded, Failed) nor
    Running's, wherever a dashboard shows phases; and the requests held at the frontend, and those the hold
    refused, have panels."""
    phases = set(get_args(FleetPhase))
    assert set(IDLE_PHASES) <= phases
    dashboards = pq.dashboards()
    phase_panels = {(stem, p["title"]): p for stem, d in dashboards.items() for p in pq.panels(d)
                    if any("corefleet_fleet_phase" in t["expr"] and "by (phase)" in t["expr"] for t in p["targets"])}
    assert set(phase_panels) == {("corefleet-fleet", "Phase"), ("corefleet-fleet", "Fleet phase"),
                                 ("corefleet-operator", "Fleets by phase")}
    for where, panel in phase_panels.items():
        colors = phase_colors(panel)
        assert set(colors) == phases, f"{where}: phases without a colour: {phases - set(colors)}"
        idle, waking = colors["Idle"], colors["Waking"]
        assert idle != waking, where
        assert not {idle, waking} & {colors["Degraded"], colors["Failed"], colors["Running"]}, (where, colors)
    fleet_exprs = " ".join(t["expr"] for p in pq.panels(dashboards["corefleet-fleet"]) for t in p["targets"])
    for metric in ("corefleet_frontend_requests_waiting", "corefleet_frontend_requests_held_total",
                   "corefleet_frontend_requests_hold_refused_total"):
        assert metric in fleet_exprs, f"the fleet dashboard does not show {metric}"
    overview = [p for p in dashboards["corefleet-fleet"]["panels"] if p["type"] != "row" and p["gridPos"]["y"] == 1]
    assert "Held at the frontend" in [p["title"] for p in overview]
    assert sum(p["gridPos"]["w"] for p in overview) == 24, "the overview's stats fill one row"


def test_dashboard_expressions_parse(promtool: str, tmp_path: Path) -> None:
    """promtool parses each expression (as a recording rule), so a PromQL typo fails here."""
    exprs = pq.dashboard_expressions("ml", "llama", rate_interval="1m", interval="15s")
    for d in pq.dashboards().values():
        exprs += [(f"{d['title']} / variable selector", pq.substitute(s, {"namespace": "ml", "fleet": "llama"}))
                  for s in variable_selectors(d)]
    rules = [{"record": f"dashboard_expr_{i}", "expr": e} for i, (_, e) in enumerate(exprs)]
    path = tmp_path / "dashboards.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    r = run(promtool, "check", "rules", str(path))
    index = "\n".join(f"  dashboard_expr_{i}: {title}: {e}" for i, (title, e) in enumerate(exprs))
    assert r.returncode == 0, f"{r.stdout}{r.stderr}\nexpressions:\n{index}"


# ---- metric and label names -------------------------------------------------------------------------
def test_every_metric_name_exists_in_corefleet_or_vllm_0_32() -> None:
    records = {r["record"] for r in all_rules() if "record" in r}
    errors = []
    used_vllm = set()
    for name, expr in pq.rule_expressions():
        for metric in pq.metric_names(expr):
            if err := check_metric(metric, f"rule {name}", records, allow_records=True):
                errors.append(err)
            used_vllm |= {metric} if metric.startswith("vllm:") else set()
    dashboard_exprs = pq.dashboard_expressions("ml", "llama")
    for d in pq.dashboards().values():
        dashboard_exprs += [(f"{d['title']} / variables", s) for s in variable_selectors(d)]
    for title, expr in dashboard_exprs:
        for metric in pq.metric_names(expr):
            if err := check_metric(metric, f"dashboard {title}", records, allow_records=False):
                errors.append(err)
            used_vllm |= {metric} if metric.startswith("vllm:") else set()
    assert not errors, "\n".join(errors)
    assert used_vllm, "no vLLM metric found: metric_names() is broken"


def test_a_name_vllm_does_not_export_is_refused() -> None:
    """The check itself: names older vLLMs (or other projects' dashboards) use fail it."""
    assert check_metric("vllm:num_requests_running", "t", set(), False) is None
    assert check_metric("vllm:prompt_tokens_total", "t", set(), False) is None
    assert check_metric("vllm:time_to_first_token_seconds_bucket", "t", set(), False) is None
    assert check_metric("vllm:gpu_cache_usage_perc", "t", set(), False)  # removed in vLLM 0.10
    assert check_metric("vllm:avg_generation_throughput_toks_per_s", "t", set(), False)  # V0 only
    assert check_metric("vllm:prompt_tokens", "t", set(), False)  # a counter without _total
    assert check_metric("vllm:time_to_first_token_seconds", "t", set(), False)  # a histogram, bare
    assert check_metric("corefleet_reconciles", "t", set(), False)
    assert check_metric("corefleet:fleet_in_flight_requests", "t", {"corefleet:fleet_in_flight_requests"}, False)


def test_grouping_labels_exist() -> None:
    source = (vllm_root() / "v1" / "metrics" / "loggers.py").read_text()
    for label in VLLM_LABELS:
        assert f'"{label}"' in source, f"vLLM 0.32's loggers.py has no label {label!r}"
    known = SCRAPE_LABELS | COREFLEET_LABELS | VLLM_LABELS
    for title, expr in pq.rule_expressions() + pq.dashboard_expressions("ml", "llama"):
        unknown = grouping_labels(expr) - known
        assert not unknown, f"{title}: groups by unknown labels {unknown}: {expr}"


def test_histograms_and_counters_are_read_with_rate() -> None:
    """Histograms as sum by (le, ...) (rate(..._bucket[...])), counters through rate()/increase()."""
    for title, expr in pq.rule_expressions() + pq.dashboard_expressions("ml", "llama"):
        for metric in pq.metric_names(expr):
            if metric.endswith("_bucket") and not metric.startswith("corefleet:"):
                assert any("le" in by for by in re.findall(r"\bby\s*\(([^)]*)\)", expr)), \
                    f"{title}: buckets not summed by le: {expr}"
            counter = metric.endswith(("_total", "_bucket", "_sum", "_count")) and not metric.startswith("corefleet:")
            if counter and title not in RAW_COUNTER_OK:
                for m in re.finditer(rf"(?<![\w:]){re.escape(metric)}(?![\w:])", expr):
                    assert re.search(r"\b(?:rate|irate|increase)\(\s*$", expr[:m.start()]), \
                        f"{title}: {metric} not read through rate()/increase(): {expr}"


# ---- the chart ------------------------------------------------------------------------------------
def test_helm_renders_the_rules_file_as_a_prometheusrule(helm: str, tmp_path: Path) -> None:
    default = helm_template(helm, tmp_path)
    assert not [d for d in default if d["kind"] in ("PrometheusRule", "ConfigMap")], "both are opt-in"
    docs = helm_template(helm, tmp_path, "prometheusRule.enabled=true", "prometheusRule.labels.release=kps")
    [rule] = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "monitoring-test"
    assert rule["metadata"]["labels"]["release"] == "kps"
    assert rule["spec"] == {"groups": pq.rule_groups()}


def test_helm_renders_one_configmap_per_dashboard(helm: str, tmp_path: Path) -> None:
    docs = helm_template(helm, tmp_path, "dashboards.enabled=true", "dashboards.folder=corefleet",
                         "dashboards.namespace=grafana")
    maps = [d for d in docs if d["kind"] == "ConfigMap"]
    dashboards = pq.dashboards()
    assert len(maps) == len(dashboards)
    rendered = {}
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "corefleet"}
        assert cm["metadata"]["namespace"] == "grafana"
        [(key, text)] = cm["data"].items()
        rendered[key.removesuffix(".json")] = json.loads(text)
    assert rendered == dashboards
    # Another sidecar label, no folder.
    docs = helm_template(helm, tmp_path, "dashboards.enabled=true", "dashboards.label=my_dashboards",
                         "dashboards.labelValue=yes")
    for cm in (d for d in docs if d["kind"] == "ConfigMap"):
        assert cm["metadata"]["labels"]["my_dashboards"] == "yes"
        assert "annotations" not in cm["metadata"]


def test_helm_lint_strict_with_monitoring_enabled(helm: str, tmp_path: Path) -> None:
    env = {**os.environ, **{v: str(tmp_path / v.lower()) for v in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME",
                                                                   "HELM_DATA_HOME")}}
    r = subprocess.run([helm, "lint", "--strict", str(CHART), "--set", "prometheusRule.enabled=true",
                        "--set", "dashboards.enabled=true"], capture_output=True, text=True, check=False,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
