# SPDX-License-Identifier: Apache-2.0
"""The fleet's frontend: vLLM's OpenAI API server over corefleet's Kubernetes DPLB client, plus the admin API.

Run it as `python -m corefleet_client.frontend`; `client` holds the engine-core client, `adminserver`
the authenticated admin API (contract: `corefleet_client.admin`).
"""
