#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Install (or find cached) what a real node of corefleet's e2e tier needs besides the control plane:
#   kubelet, kube-proxy          built with the control plane, same release (hack/control-plane.sh),
#   containerd, runc, iptables,  from Debian (apt-get install; the system's containerd service is
#   conntrack                    never started: tests run their own, with their own root and socket),
#   debootstrap, buildah         the same, to build images without a registry (hack/images.sh),
#   CNI plugins                  bridge, host-local, loopback, portmap from containernetworking/plugins,
#   coredns                      cluster DNS (its `kubernetes` plugin reads the test API server),
# the last two built from their Go modules through a wrapper module (hack/lib.sh) and cached outside
# the repository, keyed by version, so a warm machine builds nothing. Prints one `NAME=DIR` line per
# part on stdout, for .corefleet.env (COREFLEET_CNI_BIN, COREFLEET_COREDNS_BIN); logs go to stderr.
# `node.sh --packages` installs the Debian packages only (what hack/images.sh needs) and prints nothing.
#
# Env: COREFLEET_CACHE (default ~/.cache/corefleet), CNI_PLUGINS_VERSION, COREDNS_VERSION.
set -euo pipefail

CNI=${CNI_PLUGINS_VERSION:-v1.10.0}
COREDNS=${COREDNS_VERSION:-v1.12.0}
CACHE=${COREFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/corefleet}
CNI_OUT=$CACHE/cni-plugins-$CNI
COREDNS_OUT=$CACHE/coredns-$COREDNS
DEBS=(containerd runc iptables conntrack debootstrap buildah)

log() { echo "node: $*" >&2; }
# shellcheck source=hack/lib.sh
. "$(dirname "$0")/lib.sh"

mkdir -p "$CACHE"

# ---- Debian packages ----------------------------------------------------------------------------
missing=()
for p in "${DEBS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" -eq 0 ] || { log "need root to apt-get install ${missing[*]}"; exit 1; }
  log "apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # No service starts at install (policy-rc.d 101), whatever init the machine has.
  policy=/usr/sbin/policy-rc.d
  restore_policy=""
  if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod 0755 "$policy"; restore_policy=1; fi
  # (setup.sh installs vLLM meanwhile, which may apt-get libnuma1: wait for apt's locks rather than fail)
  lock=(-o DPkg::Lock::Timeout=600)
  if ! apt-get "${lock[@]}" install -y -q --no-install-recommends "${missing[@]}" >&2; then
    # Package lists may be missing or stale: refresh them once and retry.
    apt-get "${lock[@]}" update -q >&2
    apt-get "${lock[@]}" install -y -q --no-install-recommends "${missing[@]}" >&2
  fi
  [ -z "$restore_policy" ] || rm -f "$policy"
fi
for b in containerd ctr runc iptables-restore conntrack debootstrap buildah; do
  command -v "$b" >/dev/null || [ -x "/usr/sbin/$b" ] || { log "$b not found after installing ${DEBS[*]}"; exit 1; }
done
[ "${1:-}" != "--packages" ] || exit 0

# ---- CNI plugins ----------------------------------------------------------------------------------
if ! [ -x "$CNI_OUT/bridge" ] || ! [ -x "$CNI_OUT/host-local" ] || ! [ -x "$CNI_OUT/loopback" ] \
   || ! [ -x "$CNI_OUT/portmap" ]; then
  log "building the CNI plugins $CNI from the Go module proxy"
  m=github.com/containernetworking/plugins
  go_tools_build "$CNI_OUT" "$m" "$CNI" \
    "$m/plugins/main/bridge" "$m/plugins/ipam/host-local" "$m/plugins/main/loopback" "$m/plugins/meta/portmap"
fi
echo "COREFLEET_CNI_BIN=$CNI_OUT"

# ---- CoreDNS ----------------------------------------------------------------------------------------
if ! [ -x "$COREDNS_OUT/coredns" ]; then
  log "building CoreDNS $COREDNS from the Go module proxy (about 3 min when cold)"
  go_tools_build "$COREDNS_OUT" github.com/coredns/coredns "$COREDNS" github.com/coredns/coredns
  "$COREDNS_OUT/coredns" -version >&2
fi
echo "COREFLEET_COREDNS_BIN=$COREDNS_OUT"
