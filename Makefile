# corefleet — README's two commands are `make run` and `make test`.
.PHONY: setup run run-cluster check test test-integration test-e2e test-gpu clean-cache generate verify

# The venv (corefleet, its harness, vLLM for CPU) and the control plane with the metrics stack.
setup:
	bash hack/setup.sh

# The main job: a local fleet (coordinator, frontend, 2 real vLLM CPU engines serving a tiny model) as
# processes on 127.0.0.1, printing its OpenAI endpoint and running until Ctrl-C. Sets up only the venv
# (no control plane, no root).
run:
	bash hack/setup.sh venv
	.venv/bin/corefleet up

# A local Kubernetes control plane with the CRD, a fake GPU node and the operator, until Ctrl-C.
run-cluster:
	bash hack/setup.sh venv cluster
	set -a; . ./.corefleet.env; set +a; .venv/bin/corefleet cluster up

# The whole test suite, tier by tier, stopping at the first tier that fails: fast (lint, types, import
# contracts, generated files, unit tests), integration (a real control plane), e2e (real fleets, a real node:
# root). Each tier sets up what it needs; reports and failed tests' logs go to test-results/.
test:
	bash hack/test.sh

# The fast tier alone: no root, no Go, no images (a few minutes, warm).
check:
	bash hack/test.sh fast

test-integration:
	bash hack/test.sh integration

test-e2e:
	bash hack/test.sh e2e

# Only on a machine with a GPU and vLLM 0.32.0 for CUDA (tests/gpu).
test-gpu:
	bash hack/test.sh gpu

clean-cache:
	rm -rf $${COREFLEET_CACHE:-$${XDG_CACHE_HOME:-$$HOME/.cache}/corefleet}

# Rewrite every generated file (CRD, RBAC, operator Deployment, the chart's copies) from its source.
generate:
	bash hack/setup.sh venv
	.venv/bin/python -m corefleet_operator.generate

# Fail (with a diff) if a generated file is stale; the fast tier runs the same check.
verify:
	bash hack/setup.sh venv
	.venv/bin/python -m corefleet_operator.generate --check
