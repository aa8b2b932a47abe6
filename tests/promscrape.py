# SPDX-License-Identifier: Apache-2.0
"""The chart's ServiceMonitor and PodMonitor as Prometheus scrape configs, for tests without
prometheus-operator.

prometheus-operator turns a PodMonitor into a `kubernetes_sd_configs` job (role pod) that keeps the
pods its selector and port name match, adds namespace/pod/container/job, then applies the monitor's
own relabelings; a ServiceMonitor the same way over endpoints. `pod_monitor_job` does that for a
PodMonitor rendered from the chart, against the test API server, so the e2e scrapes the fleet's pods
with the chart's relabelings as written. The operator runs as a process, not behind a Service, so
`service_monitor_job` gives the ServiceMonitor's endpoint settings (path, honorLabels, relabelings)
to a static target.

Debian's Prometheus (2.42) is built without Kubernetes service discovery (`kubernetes_sd_configs` is
an unknown field there), so `PodDiscovery` serves the API server's pods over Prometheus' HTTP service
discovery with the `__meta_kubernetes_pod_*` labels Kubernetes SD would give them (the ones the
relabelings read), listed from the API server on every refresh.
"""

from __future__ import annotations

import http.server
import re
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from corefleet_client.process import send_json
from corefleet_harness.localcluster import LocalControlPlane

CHART = Path(__file__).resolve().parents[1] / "charts" / "corefleet"
_RELABEL_KEYS = {"sourceLabels": "source_labels", "targetLabel": "target_label", "replacement": "replacement",
                 "regex": "regex", "action": "action", "separator": "separator", "modulus": "modulus"}


def render_chart(helm: str, namespace: str, *sets: str) -> list[dict[str, Any]]:
    """`helm template` of the chart with `--set` values; the rendered objects."""
    argv = [helm, "template", "corefleet", str(CHART), "--namespace", namespace]
    for s in sets:
        argv += ["--set", s]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def one(docs: Sequence[Mapping[str, Any]], kind: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind]
    return dict(doc)


def _label(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _relabelings(endpoint: Mapping[str, Any]) -> list[dict[str, Any]]:
    out = []
    for r in endpoint.get("relabelings", []):
        unknown = set(r) - set(_RELABEL_KEYS)
        assert not unknown, f"relabeling keys the translation does not know: {unknown}"
        out.append({_RELABEL_KEYS[k]: v for k, v in r.items()})
    return out


def _endpoint_settings(endpoint: Mapping[str, Any], interval: str) -> dict[str, Any]:
    # The tests scrape faster than the chart's default interval; everything else is the chart's.
    return {"metrics_path": endpoint.get("path", "/metrics"), "scrape_interval": interval,
            "scrape_timeout": interval, "honor_labels": bool(endpoint.get("honorLabels", False))}


class PodDiscovery:
    """Prometheus HTTP SD of the pods of some namespaces, with Kubernetes SD's role-pod meta labels: one
    target per container port (use as a context manager)."""

    def __init__(self, k8s: LocalControlPlane, namespaces: Sequence[str]) -> None:
        self.k8s, self.namespaces = k8s, list(namespaces)
        discovery = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                send_json(self, 200, discovery.targets())

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/targets"
        self._thread = threading.Thread(target=self._server.serve_forever, name="pod-discovery", daemon=True)

    def targets(self) -> list[dict[str, Any]]:
        out = []
        for ns in self.namespaces:
            for pod in self.k8s.request("GET", f"/api/v1/namespaces/{ns}/pods")["items"]:
                ip = pod.get("status", {}).get("podIP")
                if not ip:
                    continue
                meta = pod["metadata"]
                labels = {"__meta_kubernetes_namespace": ns, "__meta_kubernetes_pod_name": meta["name"],
                          "__meta_kubernetes_pod_ip": ip,
                          "__meta_kubernetes_pod_phase": pod.get("status", {}).get("phase", "")}
                for k, v in meta.get("labels", {}).items():
                    labels[f"__meta_kubernetes_pod_label_{_label(k)}"] = v
                    labels[f"__meta_kubernetes_pod_labelpresent_{_label(k)}"] = "true"
                for c in pod["spec"]["containers"]:
                    for port in c.get("ports", []):
                        out.append({"targets": [f"{ip}:{port['containerPort']}"], "labels": {
                            **labels, "__meta_kubernetes_pod_container_name": c["name"],
                            "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                            "__meta_kubernetes_pod_container_port_number": str(port["containerPort"])}})
        return out

    def __enter__(self) -> PodDiscovery:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def pod_monitor_job(monitor: Mapping[str, Any], discovery_url: str, *, interval: str = "1s") -> dict[str, Any]:
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    relabel: list[dict[str, Any]] = [
        {"action": "keep", "source_labels": [f"__meta_kubernetes_pod_label_{_label(k)}"], "regex": v}
        for k, v in selector.items()
    ]
    relabel += [
        {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": endpoint["port"]},
        {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"target_label": "job", "replacement": f"{monitor['metadata']['namespace']}/{monitor['metadata']['name']}"},
        *_relabelings(endpoint),
    ]
    return {
        "job_name": f"podMonitor/{monitor['metadata']['name']}",
        **_endpoint_settings(endpoint, interval),
        "http_sd_configs": [{"url": discovery_url, "refresh_interval": interval}],
        "relabel_configs": relabel,
    }


def service_monitor_job(monitor: Mapping[str, Any], target: str, *, interval: str = "1s") -> dict[str, Any]:
    [endpoint] = monitor["spec"]["endpoints"]
    return {
        "job_name": f"serviceMonitor/{monitor['metadata']['name']}",
        **_endpoint_settings(endpoint, interval),
        "static_configs": [{"targets": [target]}],
        "relabel_configs": _relabelings(endpoint),
    }
