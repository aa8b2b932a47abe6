#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Run corefleet's checks and test suite: lint (ruff), types (mypy), the import contract, then pytest
# tiers unit + integration + e2e (gpu runs only by hand where an accelerator is lent).
# Extra arguments go to pytest. Expects hack/setup.sh to have run (make test does both).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${COREFLEET_VENV:-.venv}
# shellcheck disable=SC1091
set -a; . ./.corefleet.env; set +a
export PATH="$COREFLEET_K8S_BIN:$PWD/$VENV/bin:$PATH"

echo "== ruff";   ruff check operator client harness tests bench
echo "== mypy";   mypy operator/corefleet_operator client/corefleet_client harness/corefleet_harness
echo "== imports"; lint-imports
echo "== verify"; python -m corefleet_operator.generate --check
echo "== pytest"
rc=0
# The slowest tests are listed at the end: where CI time goes, run after run.
python -m pytest -m "unit or integration or e2e" --durations=40 "$@" || rc=$?
# pytest's 5 means "no tests collected": not a failure of the suite itself.
if [ "$rc" -eq 5 ]; then echo "pytest: no tests collected"; rc=0; fi
exit "$rc"
