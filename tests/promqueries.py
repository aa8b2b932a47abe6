# SPDX-License-Identifier: Apache-2.0
"""Every PromQL expression corefleet ships: the chart's rules and its Grafana dashboards' panel targets.

tests/integration/test_prometheus_rules.py parses them with promtool and checks their metric names
against vLLM 0.32.0 and corefleet's; the e2e tests run them against a Prometheus that scrapes a live
fleet. Dashboard expressions come with Grafana's variables substituted, so they are plain PromQL.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

CHART_FILES = Path(__file__).resolve().parents[1] / "charts" / "corefleet" / "files"
RULES_FILE = CHART_FILES / "prometheus-rules.yaml"
RULES_TEST_FILE = CHART_FILES / "prometheus-rules.test.yaml"
DASHBOARDS_DIR = CHART_FILES / "dashboards"

# Grafana's variables are $name, ${name} or ${name:format}; the dashboards use no other form.
_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")


def rule_groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = yaml.safe_load(RULES_FILE.read_text())["groups"]
    return groups


def rule_expressions() -> list[tuple[str, str]]:
    """(name, expr) of every recording and alerting rule; a recording rule that exists once per
    `quantile` label is named with it, e.g. `corefleet:fleet_..._seconds:histogram_quantile5m{quantile="0.9"}`."""
    out = []
    for group in rule_groups():
        for rule in group["rules"]:
            name = rule.get("record") or rule["alert"]
            if "record" in rule and (labels := rule.get("labels")):
                name += "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
            out.append((name, rule["expr"].strip()))
    return out


def dashboards() -> dict[str, dict[str, Any]]:
    """file stem -> parsed dashboard JSON."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(DASHBOARDS_DIR.glob("*.json"))}


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those nested in collapsed rows included; rows themselves are left out."""
    out = []
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


def substitute(expr: str, variables: dict[str, str]) -> str:
    """`expr` with Grafana's variables replaced; an unknown variable is an error (a typo)."""

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in variables:
            raise KeyError(f"unknown Grafana variable ${name} in {expr!r}")
        return variables[name]

    return _VARIABLE.sub(repl, expr)


def dashboard_expressions(namespace: str, fleet: str, *, rate_interval: str = "1m", interval: str = "15s",
                          range_: str = "1h") -> list[tuple[str, str]]:
    """("<dashboard title> / <panel title> [refId]", expr) of every panel target, Grafana's variables
    substituted. `rate_interval` stands in for $__rate_interval: 1m works with a 1 s scrape interval
    (Grafana makes it at least 4 scrape intervals)."""
    variables = {"namespace": namespace, "fleet": fleet, "datasource": "prometheus",
                 "__rate_interval": rate_interval, "__interval": interval, "__range": range_}
    out = []
    for dash in dashboards().values():
        for panel in panels(dash):
            for target in panel.get("targets", []):
                title = f"{dash['title']} / {panel.get('title', '')} [{target.get('refId', '')}]"
                out.append((title, substitute(target["expr"], variables)))
    return out


# ---- metric names in an expression ----------------------------------------------------------------
_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
             "offset", "inf", "nan", "atan2"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_TOKEN = re.compile(r"(?P<num>\d[\w.]*)|(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)(?P<call>\s*\()?")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (label matchers, ranges, grouping clauses,
    functions and keywords left out). A regex reading, good for the expressions corefleet writes:
    no `{__name__=...}` selectors."""
    if "__name__" in expr:
        raise ValueError(f"metric_names does not read __name__ matchers: {expr!r}")
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for m in _TOKEN.finditer(text):
        ident = m.group("ident")
        if ident and not m.group("call") and ident.lower() not in _KEYWORDS:
            names.add(ident)
    return names
