#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The gpu tier of issue 11: a real MoE model on real vLLM 0.32.0 (CUDA, NCCL), resized in place 2 -> 3 -> 2
# through corefleet's elastic-EP client (frontend.elastic) and engine 0's coordination stores, as local
# processes (`corefleet up --elastic-ep-max`), one GPU per rank. tests/e2e/test_local.py runs the same
# commands with emulated engines on CPU (vLLM runs EPLB on GPUs only).
#
#   COREFLEET_GPU_MOE_MODEL=/models/DeepSeek-V2-Lite bash hack/gpu-moe-resize.sh
#
# Needs: >= 3 CUDA GPUs (elastic EP runs one rank per GPU: NCCL refuses two ranks on one device), a Python
# with vLLM 0.32.0 built for CUDA (PYTHON, default python3), and the model in a local directory (the model
# must be one vLLM's elastic EP accepts: its routed experts divide over 2 ranks; DeepSeek-V2-Lite, which vLLM's
# own elastic-EP tests use, has 64). Exits non-zero, saying why, when any of it is missing.
#
# ENGINE=emulator runs the same steps with emulated engines, no GPU (how this script was checked here):
#   ENGINE=emulator COREFLEET_GPU_MOE_MODEL=<dir of `python -m corefleet_harness.tinymodel DIR --moe`> \
#     FLAGS="--load-format dummy --max-model-len 256 --enforce-eager" PYTHON=.venv/bin/python bash hack/gpu-moe-resize.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
MODEL=${COREFLEET_GPU_MOE_MODEL:?set COREFLEET_GPU_MOE_MODEL to a local MoE model directory}
PORT=${PORT:-8000}
ENGINE=${ENGINE:-vllm}
FLAGS=${FLAGS:---max-model-len 2048 --trust-remote-code}  # vLLM flags of every process (word-split)
STATE=$(mktemp -d /tmp/corefleet-gpu-moe.XXXXXX)
export PYTHONPATH="$PWD/operator:$PWD/client:$PWD/harness${PYTHONPATH:+:$PYTHONPATH}"
corefleet() { "$PYTHON" -m corefleet_harness.cli "$@"; }
say() { echo "gpu-moe-resize: $*"; }

[ -d "$MODEL" ] || { say "no model directory at $MODEL"; exit 2; }
GPUS=(--gpus-per-rank 1)
if [ "$ENGINE" = emulator ]; then
  GPUS=()
else
"$PYTHON" - <<'EOF' || exit 2
import sys
import torch
import vllm
if not vllm.__version__.startswith("0.32.0") or not torch.cuda.is_available():
    sys.exit(f"needs vLLM 0.32.0 with CUDA, found vLLM {vllm.__version__}, CUDA available: {torch.cuda.is_available()}")
if torch.cuda.device_count() < 3:
    sys.exit(f"needs >= 3 GPUs (one per rank, up to 3 ranks), found {torch.cuda.device_count()}")
print(f"vLLM {vllm.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
EOF
fi

trap 'corefleet down --state-dir "$STATE" >/dev/null 2>&1 || true' EXIT
complete() {
  curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"moe\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16}" \
    | "$PYTHON" -c 'import json, sys; r = json.load(sys.stdin); print("  completion:", repr(r["choices"][0]["text"])); assert r["usage"]["completion_tokens"] > 0'
}
status() { corefleet status --state-dir "$STATE" | sed -n '/RANK/,$p'; }

t0=$(date +%s)
say "up: 2 ranks of $MODEL, elastic EP up to 3"
# shellcheck disable=SC2086  # FLAGS are words
corefleet up --detach --engine "$ENGINE" --model "$MODEL" --replicas 2 --elastic-ep-max 3 "${GPUS[@]}" \
  --port "$PORT" --state-dir "$STATE" --timeout 1200 -- --served-model-name moe $FLAGS
complete
for n in 3 2; do
  say "scale to $n (in place: vLLM's elastic-EP protocol)"
  corefleet scale "$n" --state-dir "$STATE" --timeout 1200
  status
  complete
done
grep -h "RECONFIGURE_FINISHED\|SHUTDOWN_COMPLETE\|completed in" "$STATE/logs/frontend.log"
say "passed in $(( $(date +%s) - t0 )) s; logs in $STATE/logs"
