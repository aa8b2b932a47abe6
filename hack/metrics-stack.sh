#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Fetch (or find cached) the metrics stack of corefleet's observability tests:
#   prometheus, promtool      from Debian bookworm's prometheus package (extracted, not installed:
#                             no service is started and the system is untouched),
#   adapter                   prometheus-adapter (the custom-metrics API the HPA controller reads),
#                             built from its Go module through a wrapper module (hack/lib.sh).
# Each part lands in its own directory of the cache outside the repository, keyed by version, so a
# warm machine fetches and builds nothing. Prints one `NAME=DIR` line per part on stdout, for
# .corefleet.env (COREFLEET_PROMETHEUS_BIN, COREFLEET_ADAPTER_BIN); all logs go to stderr.
#
# Env: COREFLEET_CACHE (default ~/.cache/corefleet), PROMETHEUS_DEB_VERSION, PROMETHEUS_ADAPTER_VERSION.
set -euo pipefail

PROM=${PROMETHEUS_DEB_VERSION:-2.42.0+ds-5+deb12u1}
CACHE=${COREFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/corefleet}
OUT=$CACHE/metrics-prometheus-${PROM//[^A-Za-z0-9.]/_}
ADAPTER=${PROMETHEUS_ADAPTER_VERSION:-v0.12.0}   # its go.mod 'go' line (1.22) must be <= the local Go
ADAPTER_OUT=$CACHE/prometheus-adapter-$ADAPTER

log() { echo "metrics-stack: $*" >&2; }
# shellcheck source=hack/lib.sh
. "$(dirname "$0")/lib.sh"

mkdir -p "$CACHE"

fetch_prometheus() {
  local tmp
  tmp=$(mktemp -d "$CACHE/.fetch-prometheus-XXXXXX")
  trap 'rm -rf "$tmp"' RETURN
  log "fetching Debian's prometheus $PROM"
  # apt's sandbox user cannot write to a root-owned temp dir; the download is checked by apt either way.
  chmod 0777 "$tmp"
  if ! (cd "$tmp" && apt-get download -q "prometheus=$PROM" >&2); then
    log "apt-get download failed; updating the package index and trying once more"
    apt-get update -q >&2 || true
    (cd "$tmp" && apt-get download -q "prometheus=$PROM" >&2) || {
      log "apt-get download prometheus=$PROM failed: Debian bookworm's package index is needed"; return 1; }
  fi
  dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/root"
  mkdir -p "$OUT.tmp"
  cp "$tmp/root/usr/bin/prometheus" "$tmp/root/usr/bin/promtool" "$OUT.tmp/"
  "$OUT.tmp/prometheus" --version >&2
  rm -rf "$OUT"; mv "$OUT.tmp" "$OUT"
}

if ! [ -x "$OUT/prometheus" ] || ! [ -x "$OUT/promtool" ]; then
  fetch_prometheus
fi
echo "COREFLEET_PROMETHEUS_BIN=$OUT"

build_adapter() {
  log "building prometheus-adapter $ADAPTER from the Go module proxy"
  go_tools_build "$ADAPTER_OUT.tmp" sigs.k8s.io/prometheus-adapter "$ADAPTER" \
    sigs.k8s.io/prometheus-adapter/cmd/adapter
  # `--help` exits non-zero (pflag's ErrHelp ends in klog.Fatal): check that it printed the flags.
  local help
  help=$("$ADAPTER_OUT.tmp/adapter" --help 2>&1 || true)
  grep -q -- '--prometheus-url' <<<"$help" || { log "the built adapter does not run: $help"; return 1; }
  rm -rf "$ADAPTER_OUT"; mv "$ADAPTER_OUT.tmp" "$ADAPTER_OUT"
}

if ! [ -x "$ADAPTER_OUT/adapter" ]; then
  build_adapter
fi
echo "COREFLEET_ADAPTER_BIN=$ADAPTER_OUT"
