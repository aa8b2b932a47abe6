# SPDX-License-Identifier: Apache-2.0
"""corefleet's harness: what only tests, benchmarks and local demos need, never the product.

A local Kubernetes control plane (`localcluster`) and a real node for it (`localnode`), the engine
emulator (`emulator`, a wire-level test double of a vLLM engine core), the tiny test model
(`tinymodel`), local fleet mode (`local`: `corefleet up/scale/status/down`), the `corefleet` command
(`cli`) and the waiting, port and HTTP helpers that tests and harness share (`support`). It imports
the product (`corefleet_operator`, `corefleet_client`); the product never imports it (an import-linter
contract), and the product images do not carry it (it is a distribution of its own, harness/pyproject.toml).
"""

__version__ = "0.1.0"
