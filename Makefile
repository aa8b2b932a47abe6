# corefleet — README's two commands are `make run` and `make test`.
.PHONY: setup run run-cluster test lint clean-cache

setup:
	bash hack/setup.sh

# The main job: a local fleet (coordinator, frontend, 2 real vLLM CPU engines serving a tiny model) as
# processes on 127.0.0.1, printing its OpenAI endpoint and running until Ctrl-C.
run: setup
	set -a; . ./.corefleet.env; set +a; .venv/bin/corefleet up

# A local Kubernetes control plane with the CRD, a fake GPU node and the operator, until Ctrl-C.
run-cluster: setup
	set -a; . ./.corefleet.env; set +a; .venv/bin/corefleet cluster up

# The whole test suite (lint, types, import contract, unit + integration + e2e). Its setup includes a
# real node's parts and images (root: apt-get, containerd, buildah), which `make run` does not need.
test:
	bash hack/setup.sh --node
	bash hack/test.sh

clean-cache:
	rm -rf $${COREFLEET_CACHE:-$${XDG_CACHE_HOME:-$$HOME/.cache}/corefleet}

.PHONY: generate verify

# Rewrite every generated file (CRD, RBAC, operator Deployment, the chart's copies) from its source.
generate: setup
	.venv/bin/python -m corefleet_operator.generate

# Fail (with a diff) if a generated file is stale; hack/test.sh runs the same check.
verify: setup
	.venv/bin/python -m corefleet_operator.generate --check
