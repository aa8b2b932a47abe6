#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# corefleet's test runner: the tiers in order, each set up first, stopping at the first tier that fails.
#
#   hack/test.sh                 all of: fast, integration, e2e (what `make test` and CI run)
#   hack/test.sh fast            ruff, mypy (strict, all code), import contracts, generated files, unit tests:
#                                no root, no Go, no images (`make check`)
#   hack/test.sh integration     the real control plane, Prometheus, helm (`make test-integration`)
#   hack/test.sh e2e             real fleet processes, a real node (root) (`make test-e2e`)
#   hack/test.sh gpu             the checks that need a GPU with vLLM for CUDA; only where one is lent (`make test-gpu`)
#   hack/test.sh TIER... -- ARGS extra pytest arguments (e.g. `-k resize`, a path inside the tier)
#
# Each tier sets up what it needs (hack/setup.sh, idempotent: quick on a warm machine). With more than one
# tier, what the later tiers need (the control plane's and node's Go builds, the images) is set up in the
# background while the fast tier runs; a failing fast tier stops it. The images are imported into the test
# node's image store beside the integration tier.
# A tier may run in lanes (LANES below; only without extra pytest arguments): a second pytest process runs some
# of its modules beside the others, where those mostly wait (emulated engines, timeouts, control loops) and the
# machine's two cores would otherwise idle; each lane writes its own JUnit report and log.
# A tier fails when a test fails, when pytest collects nothing (a mistyped marker or path is no green run),
# or when a test outlives the tier's per-test timeout (longer than any test's own deadlines, so that their
# diagnostics print first). Every tier writes a JUnit report and the 25 slowest tests; the logs of every
# failed test's processes (fleet, operator, control plane, node) are kept: all in $COREFLEET_TEST_ARTIFACTS
# (default ./test-results), named at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${COREFLEET_VENV:-.venv}
ART=${COREFLEET_TEST_ARTIFACTS:-$PWD/test-results}
export COREFLEET_TEST_ARTIFACTS=$ART

# Seconds a single test (setup and teardown included) may take, per tier.
declare -A TIMEOUT=([fast]=30 [integration]=420 [e2e]=900 [gpu]=1800)
# Lanes: "BESIDE | WITH" - the modules in BESIDE run in a pytest process of their own, beside the modules in
# WITH; once both ended, the rest of the tier runs alone (every module not named, so a new module runs there
# unless placed). An empty WITH: the rest runs beside BESIDE. Measured in CI (2 cores): the real node's
# modules (real vLLM in containers, 570 s) beside the operator-run fleets of emulated engines, whose time is
# mostly waits for join timeouts, the HPA loop and the coordinator's and `cluster up`'s own (about 500 s there);
# not more beside the node (with the local emulated fleets and stock `vllm serve` there too, the machine
# stalled for 15 s at a time: kubelet housekeeping, API calls timing out). Integration: the control-loop
# waits beside the rest.
declare -A LANES=(
  [integration]="tests/integration/test_hpa_loop.py tests/integration/test_podrunner_probes.py
                 tests/integration/test_operator_recovery.py |"
  [e2e]="tests/e2e/test_localnode.py tests/e2e/test_node_fleet.py |
         tests/e2e/test_moe_emulator.py tests/e2e/test_resize_emulator.py tests/e2e/test_observability.py
         tests/e2e/test_coordinator.py tests/e2e/test_up.py"
)
# What each tier needs set up (hack/setup.sh parts).
declare -A NEEDS=([fast]="venv" [integration]="venv cluster" [e2e]="venv cluster node" [gpu]="venv")

tiers=() args=()
while [ $# -gt 0 ]; do
  case $1 in
    --) shift; args=("$@"); break ;;
    fast|integration|e2e|gpu) tiers+=("$1"); shift ;;
    *) echo "test: unknown tier '$1' (fast, integration, e2e, gpu; pytest arguments go after --)" >&2; exit 2 ;;
  esac
done
[ ${#tiers[@]} -gt 0 ] || tiers=(fast integration e2e)

rm -rf "$ART"
mkdir -p "$ART"
t_start=$SECONDS
say() { echo "test: $*"; }
finish() {
  local rc=$?
  [ -z "${bg_pid:-}" ] || kill -- -"$bg_pid" 2>/dev/null || true
  [ -z "${preload_pid:-}" ] || kill -- -"$preload_pid" 2>/dev/null || true
  # A lane still running: interrupted like Ctrl-C, so that its fixtures stop what they started.
  [ -z "${lane_pid:-}" ] || { kill -INT -- -"$lane_pid"; wait "$lane_pid"; } 2>/dev/null || true
  if [ "$rc" -eq 0 ]; then say "passed: ${tiers[*]} in $((SECONDS - t_start)) s"
  else say "FAILED (exit $rc) after $((SECONDS - t_start)) s"; fi
  say "reports and the logs of failed tests: $ART"
  exit "$rc"
}
trap finish EXIT

# The parts every tier asked for, and those the first tier needs now.
all_parts=$(for t in "${tiers[@]}"; do echo "${NEEDS[$t]}"; done | tr ' ' '\n' | awk 'NF && !seen[$0]++' | paste -sd' ' -)
# shellcheck disable=SC2086  # the parts are words
bash hack/setup.sh ${NEEDS[${tiers[0]}]}
rest=$(for p in $all_parts; do [[ " ${NEEDS[${tiers[0]}]} " == *" $p "* ]] || echo "$p"; done | paste -sd' ' -)
bg_pid=""
if [ -n "$rest" ]; then
  say "setting up '$rest' in the background (log: $ART/setup.log)"
  set -m
  # shellcheck disable=SC2086
  bash hack/setup.sh $rest >"$ART/setup.log" 2>&1 &
  bg_pid=$!
  set +m
fi

load_env() {
  # shellcheck disable=SC1091
  set -a; . ./.corefleet.env; set +a
  export PATH="${COREFLEET_K8S_BIN:+$COREFLEET_K8S_BIN:}$PWD/$VENV/bin:$PATH"
}

wait_setup() {
  [ -n "$bg_pid" ] || return 0
  say "waiting for the background set-up"
  if ! wait "$bg_pid"; then
    bg_pid=""
    tail -n 40 "$ART/setup.log" >&2
    say "set-up of '$rest' failed (whole log: $ART/setup.log)"
    return 1
  fi
  bg_pid=""
}

# The test node's image store is filled beside the integration tier (a rebuilt runtime image takes a minute or
# more to import), once hack/setup.sh built the images, and waited for before e2e; if it fails, the e2e tier's
# node imports what it lacks itself.
preload_pid=""
start_preload() {
  [ -z "$preload_pid" ] && [ -n "${COREFLEET_IMAGES:-}" ] && [[ " ${tiers[*]} " == *" e2e "* ]] || return 0
  say "importing the node's images into its image store in the background (log: $ART/preload.log)"
  set -m
  # shellcheck disable=SC2086  # the archives' paths are words
  python -m corefleet_harness.localnode preload ${COREFLEET_IMAGES//:/ } >"$ART/preload.log" 2>&1 &
  preload_pid=$!
  set +m
}
wait_preload() {
  [ -n "$preload_pid" ] || return 0
  say "waiting for the image store's import"
  wait "$preload_pid" || say "the image store's import failed (the e2e node imports the images itself): $ART/preload.log"
  preload_pid=""
}

static_checks() {
  echo "== ruff";    ruff check operator client harness tests bench
  echo "== mypy";    mypy
  echo "== imports"; lint-imports
  echo "== verify";  python -m corefleet_operator.generate --check
}

# pytest on a tier's tests: pytest_lane TIER NAME PYTEST-ARGS...; its report is junit-NAME.xml.
pytest_lane() {
  local tier=$1 name=$2 marker=$1 rc=0
  shift 2
  [ "$tier" != fast ] || marker=unit
  echo "== pytest: $name (marker '$marker', ${TIMEOUT[$tier]} s per test)"
  python -m pytest -m "$marker" --timeout="${TIMEOUT[$tier]}" --durations=25 \
    --junitxml="$ART/junit-$name.xml" -o junit_suite_name="corefleet-$name" "$@" || rc=$?
  # 5: nothing collected. A marker or path that selects nothing is a mistake, never a green run.
  [ "$rc" -ne 5 ] || say "$name: pytest collected no test"
  return "$rc"
}

run_pytest() {
  local tier=$1 lanes=${LANES[$1]:-} beside with rc=0 brc=0 ignore=()
  if [ -z "$lanes" ] || [ ${#args[@]} -gt 0 ]; then
    pytest_lane "$tier" "$tier" "${args[@]}"
    return
  fi
  # shellcheck disable=SC2206  # the modules are words
  beside=(${lanes%%|*}) with=(${lanes#*|})
  for f in "${beside[@]}" "${with[@]}"; do
    [ -f "$f" ] || { say "$tier: lane module $f does not exist (hack/test.sh LANES)"; return 2; }
    ignore+=("--ignore=$f")
  done
  say "$tier: ${beside[*]##*/} in a lane of their own (log: $ART/$tier-beside.log)"
  set -m
  pytest_lane "$tier" "$tier-beside" "${beside[@]}" >"$ART/$tier-beside.log" 2>&1 &
  lane_pid=$!
  set +m
  if [ ${#with[@]} -gt 0 ]; then
    pytest_lane "$tier" "$tier-with" "${with[@]}" || rc=$?
  else
    pytest_lane "$tier" "$tier" tests "${ignore[@]}" || rc=$?
  fi
  wait "$lane_pid" || brc=$?
  lane_pid=""
  echo "== the lane beside: ${beside[*]##*/}"
  cat "$ART/$tier-beside.log"
  [ "$brc" -eq 0 ] || rc=$brc
  if [ "$rc" -eq 0 ] && [ ${#with[@]} -gt 0 ]; then
    pytest_lane "$tier" "$tier" tests "${ignore[@]}" || rc=$?
  fi
  return "$rc"
}

for tier in "${tiers[@]}"; do
  t0=$SECONDS
  if [ "$tier" != "${tiers[0]}" ]; then wait_setup; fi
  load_env
  if [ "$tier" = e2e ]; then start_preload; wait_preload
  elif [ "$tier" != "${tiers[0]}" ]; then start_preload; fi
  if [ "$tier" = fast ]; then static_checks; fi
  if ! run_pytest "$tier"; then
    say "tier '$tier' failed after $((SECONDS - t0)) s; later tiers not run"
    exit 1
  fi
  say "tier '$tier' passed in $((SECONDS - t0)) s"
done
