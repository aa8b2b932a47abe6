# SPDX-License-Identifier: Apache-2.0
"""corefleet's Kubernetes operator: reconciles EngineCoreSets into vLLM engine-core fleets."""

__version__ = "0.1.0"
