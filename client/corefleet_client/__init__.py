# SPDX-License-Identifier: Apache-2.0
"""corefleet's fleet processes: frontend (Kubernetes DPLB client), coordinator, engine launcher and engine core."""

__version__ = "0.1.0"
