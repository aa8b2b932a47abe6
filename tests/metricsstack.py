# SPDX-License-Identifier: Apache-2.0
"""A real metrics stack for tests (import as `from metricsstack import ...`): Prometheus, and
prometheus-adapter serving the custom-metrics API to a `LocalControlPlane`.

Autoscaling is only proven by the real chain: Prometheus evaluates the recording rule,
prometheus-adapter maps the series onto an EngineCoreSet by the product's adapter rules, the API
server's aggregation layer proxies `custom.metrics.k8s.io` to it, and kube-controller-manager's HPA
controller reads it and writes /scale. A mock of any link would accept what the real one refuses.

* `Prometheus`: the binary from `hack/metrics-stack.sh` (COREFLEET_PROMETHEUS_BIN) on 127.0.0.1 with
  a given scrape config and rule files, 1 s scrape/evaluation intervals and its storage in a temp dir.
* `PrometheusAdapter`: the binary built by the same script (COREFLEET_ADAPTER_BIN) against a
  control plane and a Prometheus, registered with the `APIService`s of `custom.metrics.k8s.io`
  (v1beta1 and v1beta2: the HPA controller uses the newest the server offers). The API server
  reaches it through an `ExternalName` Service naming 127.0.0.1 (see `localcluster`'s docstring:
  EndpointSlices refuse loopback addresses). The HPA controller and the adapter run with the admin
  credentials (system:masters), so they need no RBAC of their own.

Like the control plane, each component is started by PID with its own log, stopped by PID
(SIGTERM, then SIGKILL), and fails loudly: `MetricsStackError` names the component, its command
and the tail of its log. Missing binaries fail too, never skip.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from corefleet_harness.localcluster import Component, LocalControlPlane
from corefleet_harness.support import free_port, tail, wait_until

PROMETHEUS_BIN_ENV = "COREFLEET_PROMETHEUS_BIN"
ADAPTER_BIN_ENV = "COREFLEET_ADAPTER_BIN"
CUSTOM_METRICS_GROUP = "custom.metrics.k8s.io"
# As in prometheus-adapter's own deploy/manifests: v1beta2 is preferred.
CUSTOM_METRICS_VERSIONS = {"v1beta1": 100, "v1beta2": 200}


# The custom metrics manifests/samples/prometheus-adapter-rules.yaml serves, on the EngineCoreSet: its
# in-flight requests (hpa.yaml), and its demand, those plus the requests held at its frontend, which an
# idle fleet has too (hpa-scale-to-zero.yaml).
FLEET_METRIC = "corefleet_fleet_in_flight_requests"
DEMAND_METRIC = "corefleet_fleet_demand_requests"


def quantity(q: str) -> float:
    """A Kubernetes quantity as the HPA writes metric values (DecimalSI: plain, `m` or `k`)."""
    scale = {"m": 1e-3, "k": 1e3}.get(q[-1:], 1.0)
    return float(q[:-1] if q[-1:] in ("m", "k") else q) * scale


def current_average(hpa: Mapping[str, Any], metric: str = FLEET_METRIC) -> float | None:
    """An HPA's current value of an Object metric, per rank (status.currentMetrics); None before it reads one."""
    for m in hpa.get("status", {}).get("currentMetrics") or []:
        if m["type"] == "Object" and m["object"]["metric"]["name"] == metric:
            return quantity(m["object"]["current"]["averageValue"])
    return None


def hpa_events(cp: LocalControlPlane, ns: str, reason: str) -> list[str]:
    """The messages of the namespace's HPA events with `reason` (SuccessfulRescale, FailedRescale, ...)."""
    events = cp.request("GET", f"/api/v1/namespaces/{ns}/events")["items"]
    return [e["message"] for e in events
            if e["involvedObject"]["kind"] == "HorizontalPodAutoscaler" and e["reason"] == reason]


class MetricsStackError(RuntimeError):
    """A metrics-stack binary is missing, exited, or did not become ready in time."""


def binary(env: str, name: str) -> Path:
    """`name` in the directory `hack/metrics-stack.sh` printed as `env=DIR`, checked to be executable."""
    raw = os.environ.get(env)
    if not raw:
        raise MetricsStackError(f"{env} is not set: run `bash hack/metrics-stack.sh` (or `make setup`) and "
                                f"source .corefleet.env")
    path = Path(raw) / name
    if not os.access(path, os.X_OK):
        raise MetricsStackError(f"{path} is missing or not executable: run `bash hack/metrics-stack.sh`")
    return path


class Prometheus:
    """A real Prometheus on 127.0.0.1; use as a context manager.

    `scrape_configs` are Prometheus `scrape_configs` entries; `rules` maps rule-file names to their
    text (written beside the config). Scrapes and rule evaluations run every `interval`; the first
    scrape comes about 5 s after start (Prometheus batches service-discovery updates that long).
    """

    def __init__(self, work_dir: Path, scrape_configs: Sequence[Mapping[str, Any]] = (),
                 rules: Mapping[str, str] | None = None, interval: str = "1s",
                 ready_timeout: float = 60.0) -> None:
        self.work_dir, self.ready_timeout = work_dir, ready_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = {
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "rule_files": sorted(rules or {}),
            "scrape_configs": [dict(c) for c in scrape_configs],
        }
        self._rules = dict(rules or {})
        self._proc: Component | None = None

    def __enter__(self) -> Prometheus:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        for name, text in self._rules.items():
            (self.work_dir / name).write_text(text)
        config = self.work_dir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self._proc = Component("prometheus", [
            str(binary(PROMETHEUS_BIN_ENV, "prometheus")),
            f"--config.file={config}",
            f"--storage.tsdb.path={self.work_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=info",
        ], self.work_dir / "prometheus.log", error=MetricsStackError)
        try:
            self._proc.wait_ready(lambda: self._get("/-/ready") is not None, self.ready_timeout, "prometheus /-/ready",
                                  interval=0.2)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.stop()

    def log_tail(self) -> str:
        return tail(self.work_dir / "prometheus.log")

    def _get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            body: bytes = r.read()
            return body

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector `expr` evaluates to now (the HTTP API's `data.result`)."""
        try:
            body = json.loads(self._get("/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
        except urllib.error.HTTPError as e:  # 400/422: a bad expression; name it and say why
            raise MetricsStackError(f"prometheus rejected {expr!r}: {e.read().decode(errors='replace')}") from None
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_for(self, expr: str, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float,
                 what: str = "") -> list[dict[str, Any]]:
        """Poll `query(expr)` until `predicate` holds for its result (returned); fails with the last result."""
        last: list[dict[str, Any]] = []

        def check() -> bool:
            nonlocal last
            assert self._proc is not None
            self._proc.check_alive()
            last = self.query(expr)
            return predicate(last)

        try:
            wait_until(check, timeout, what or expr, interval=0.2, retry_on=(Exception,),
                       fatal=(MetricsStackError,))
        except TimeoutError as e:
            raise MetricsStackError(f"prometheus: {e}; last result of {expr!r}: {last}\n"
                                    f"log (tail):\n{self.log_tail()}") from None
        return last


class PrometheusAdapter:
    """prometheus-adapter serving `custom.metrics.k8s.io` on `cp`, from `prometheus_url`, by `rules`.

    The CRDs the rules name must be installed first: the adapter resolves them when it starts.
    `stop()` deletes the APIServices before the process: an unavailable aggregated API breaks
    discovery for every client (and blocks namespace deletion).
    """

    def __init__(self, cp: LocalControlPlane, prometheus_url: str, rules: Path, work_dir: Path,
                 namespace: str = "custom-metrics", relist_interval: str = "2s",
                 ready_timeout: float = 90.0) -> None:
        self.cp, self.prometheus_url, self.rules, self.work_dir = cp, prometheus_url, rules, work_dir
        self.namespace, self.relist_interval, self.ready_timeout = namespace, relist_interval, ready_timeout
        self.port = free_port()
        self._proc: Component | None = None
        self._registered: list[str] = []

    def __enter__(self) -> PrometheusAdapter:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        kubeconfig = str(self.cp.kubeconfig)
        self._proc = Component("prometheus-adapter", [
            str(binary(ADAPTER_BIN_ENV, "adapter")),
            f"--config={self.rules}",
            f"--prometheus-url={self.prometheus_url}",
            f"--metrics-relist-interval={self.relist_interval}",
            "--metrics-max-age=1m",  # series seen in the last minute are listed (>= the relist interval)
            "--bind-address=127.0.0.1",
            f"--secure-port={self.port}",
            f"--cert-dir={self.work_dir / 'certs'}",
            f"--lister-kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--v=2",
        ], self.work_dir / "adapter.log", error=MetricsStackError)
        try:
            self._proc.wait_ready(self._serving, self.ready_timeout, "prometheus-adapter /readyz", interval=0.2)
            self._register()
            self._proc.wait_ready(self._aggregated, self.ready_timeout,
                                  f"/apis/{CUSTOM_METRICS_GROUP} through the API server", interval=0.2)
        except BaseException:
            self.stop()
            raise

    def _serving(self) -> bool:
        """The adapter's own /readyz (TLS with its self-signed cert; /readyz needs no credentials)."""
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        with urllib.request.urlopen(f"https://127.0.0.1:{self.port}/readyz", context=ctx, timeout=5) as r:
            return bool(r.status == 200)

    def _register(self) -> None:
        """Namespace, ExternalName Service -> 127.0.0.1, and one APIService per served version."""
        objs: list[dict[str, Any]] = [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.namespace}},
            {"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": "prometheus-adapter", "namespace": self.namespace},
             # The cluster-IP resolver of the aggregator dials an ExternalName as given.
             "spec": {"type": "ExternalName", "externalName": "127.0.0.1",
                      "ports": [{"name": "https", "port": self.port, "protocol": "TCP"}]}},
        ]
        for version, priority in CUSTOM_METRICS_VERSIONS.items():
            name = f"{version}.{CUSTOM_METRICS_GROUP}"
            self._registered.append(name)
            objs.append({
                "apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService", "metadata": {"name": name},
                "spec": {"group": CUSTOM_METRICS_GROUP, "version": version,
                         "service": {"name": "prometheus-adapter", "namespace": self.namespace, "port": self.port},
                         "insecureSkipTLSVerify": True,  # the adapter's cert is self-signed
                         "groupPriorityMinimum": 100, "versionPriority": priority}})
        self.cp.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}))

    def _aggregated(self) -> bool:
        for version in CUSTOM_METRICS_VERSIONS:
            self.cp.request("GET", f"/apis/{CUSTOM_METRICS_GROUP}/{version}")
        return all(self._available(name) for name in self._registered)

    def _available(self, name: str) -> bool:
        svc = self.cp.request("GET", f"/apis/apiregistration.k8s.io/v1/apiservices/{name}")
        conds = {c["type"]: c["status"] for c in svc.get("status", {}).get("conditions", [])}
        return conds.get("Available") == "True"

    def stop(self) -> None:
        for name in self._registered:
            self.cp.kubectl("delete", "apiservice", name, "--ignore-not-found", "--wait=false", check=False)
        self._registered.clear()
        if self._proc is not None:
            self._proc.stop()

    def log_tail(self) -> str:
        return tail(self.work_dir / "adapter.log")

    def get(self, path: str) -> Any:
        """GET `/apis/custom.metrics.k8s.io/v1beta2/<path>` through the API server (JSON)."""
        return self.cp.request("GET", f"/apis/{CUSTOM_METRICS_GROUP}/v1beta2/{path.lstrip('/')}")
