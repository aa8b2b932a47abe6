# SPDX-License-Identifier: Apache-2.0
"""The Helm chart's monitoring, values schema and options, rendered by the real helm binary and checked
offline by kubernetes-validate (the chart against a real API server: test_manifests.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from corefleet_harness.localcluster import resolve_bin_dir
from corefleet_operator import builders, constants
from factories import make_ecs

pytestmark = pytest.mark.integration

CHART = Path(__file__).resolve().parents[2] / "charts" / "corefleet"
EVERYTHING = ("metrics.serviceMonitor.enabled=true", "fleetMonitoring.podMonitor.enabled=true",
              "prometheusRule.enabled=true", "dashboards.enabled=true", "podDisruptionBudget.enabled=true")
Helm = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def helm(tmp_path: Path) -> Helm:
    """The project's helm, its state under the test's temp dir (never $HOME), no cluster needed."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[var] = str(tmp_path / var.lower())

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(resolve_bin_dir() / "helm"), *args], env=env, capture_output=True, text=True,
                              check=False, timeout=120)

    return run


def template(helm: Helm, *sets: str, extra: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    argv = ["template", "corefleet", str(CHART), "--namespace", "corefleet-system", *extra]
    for s in sets:
        argv += ["--set", s]
    r = helm(*argv)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def kinds(docs: list[dict[str, Any]]) -> list[str]:
    return sorted(d["kind"] for d in docs)


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind]
    return doc


def test_lint_strict_with_every_option_on(helm: Helm) -> None:
    argv = ["lint", "--strict", str(CHART)]
    for s in EVERYTHING:
        argv += ["--set", s]
    r = helm(*argv)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 chart(s) failed" in r.stdout


@pytest.mark.parametrize("sets", [(), EVERYTHING], ids=["defaults", "everything"])
def test_rendered_chart_passes_kubernetes_validate_strict(helm: Helm, sets: tuple[str, ...], tmp_path: Path) -> None:
    argv = ["template", "corefleet", str(CHART), "--namespace", "corefleet-system", "--include-crds"]
    for s in sets:
        argv += ["--set", s]
    r = helm(*argv)
    assert r.returncode == 0, r.stderr
    validate = Path(subprocess.run(["which", "kubernetes-validate"], capture_output=True, text=True,
                                   check=True).stdout.strip())
    v = subprocess.run([str(validate), "--strict", "-k", "1.37.0", "-"], input=r.stdout, capture_output=True,
                       text=True, check=False, timeout=300)
    assert v.returncode == 0, v.stdout + v.stderr
    assert "ERROR" not in v.stdout + v.stderr
    # It checks the built-in kinds (the prometheus-operator kinds it cannot): each was validated.
    builtin = [d for d in yaml.safe_load_all(r.stdout) if d and "." not in d["apiVersion"].split("/")[0]]
    for doc in builtin:
        assert f"{doc['kind'].lower()}/{doc['metadata']['name']}" in v.stdout, v.stdout


@pytest.mark.parametrize(("values", "message"), [
    ("metrics:\n  port: metrics\n", "at '/metrics/port': got string, want integer"),
    ("metrics:\n  port: 70000\n", "at '/metrics/port'"),
    ("image:\n  pullPolicy: Sometimes\n", "at '/image/pullPolicy'"),
    ("watchNamespaces: team-a\n", "at '/watchNamespaces': got string, want array"),
    ("metric:\n  port: 9100\n", "'metric' not allowed"),  # a misspelt key is refused, not ignored
    ("fleetMonitoring:\n  podMonitor:\n    interval: 15\n", "at '/fleetMonitoring/podMonitor/interval'"),
    ("podDisruptionBudget:\n  maxUnavailable: 2\n", "at '/podDisruptionBudget/maxUnavailable'"),
    ("dashboards:\n  labelValue: 1\n", "at '/dashboards/labelValue': got number, want string"),
    ("prometheusRule:\n  labels:\n    release: 7\n", "at '/prometheusRule/labels/release'"),
], ids=["port-name", "port-range", "pull-policy", "namespaces-not-a-list", "unknown-key", "interval-number",
        "pdb", "dashboard-label-value", "rule-label-value"])
def test_bad_values_are_refused_with_their_path(helm: Helm, tmp_path: Path, values: str, message: str) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(values)
    r = helm("template", "corefleet", str(CHART), "-f", str(bad))
    assert r.returncode != 0, r.stdout
    assert "values don't meet the specifications of the schema" in r.stderr, r.stderr
    assert message in r.stderr, r.stderr


def test_a_service_monitor_without_its_service_is_refused(helm: Helm) -> None:
    r = helm("template", "corefleet", str(CHART), "--set", "metrics.serviceMonitor.enabled=true",
             "--set", "metrics.service.enabled=false")
    assert r.returncode != 0
    assert "metrics.serviceMonitor.enabled needs metrics.service.enabled" in r.stderr, r.stderr


def test_metrics_port_service_and_service_monitor_agree(helm: Helm) -> None:
    docs = template(helm, "metrics.serviceMonitor.enabled=true")
    deployment = one(docs, "Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == constants.OPERATOR_METRICS_PORT  # the operator's default: no flag needed
    assert "args" not in container
    service = one(docs, "Service")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["ports"] == [{"name": "metrics", "port": constants.OPERATOR_METRICS_PORT,
                                         "targetPort": "metrics", "protocol": "TCP"}]
    monitor = one(docs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics"
    assert endpoint["honorLabels"] is True

    moved = template(helm, "metrics.port=9100")
    [container] = one(moved, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["--metrics-port=9100"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"] == 9100
    assert one(moved, "Service")["spec"]["ports"][0]["port"] == 9100


def test_pod_monitor_selects_the_frontend_pods_the_operator_builds(helm: Helm) -> None:
    monitor = one(template(helm, "fleetMonitoring.podMonitor.enabled=true"), "PodMonitor")
    pod = builders.frontend_pod(make_ecs("f").obj(), dp_size=2, coordinator_address="c")
    labels = pod["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    [container] = pod["spec"]["containers"]
    assert endpoint["port"] in {p["name"] for p in container["ports"]}
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    fleet_label = "__meta_kubernetes_pod_label_" + constants.LABEL_FLEET.replace(".", "_").replace("/", "_")
    assert {"sourceLabels": [fleet_label], "targetLabel": "fleet"} in endpoint["relabelings"]
    only = one(template(helm, "fleetMonitoring.podMonitor.enabled=true",
                        "fleetMonitoring.podMonitor.namespaces={team-a}"), "PodMonitor")
    assert only["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}


def test_pod_disruption_budget_selects_the_operator(helm: Helm) -> None:
    assert "PodDisruptionBudget" not in kinds(template(helm))
    docs = template(helm, "podDisruptionBudget.enabled=true")
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= \
        one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"].items()


def test_notes_say_what_to_do_next(helm: Helm) -> None:
    r = helm("install", "corefleet", str(CHART), "--dry-run=client", "--namespace", "corefleet-system")
    assert r.returncode == 0, r.stderr
    notes = r.stdout[r.stdout.index("NOTES:"):]
    for text in ("rollout status deployment/corefleet-operator",
                 "kubectl apply -f manifests/samples/enginecoreset.yaml",
                 "kubectl scale ecs", "Service corefleet-operator-metrics, port 9090",
                 "--set metrics.serviceMonitor.enabled=true"):
        assert text in notes, notes
