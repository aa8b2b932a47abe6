# SPDX-License-Identifier: Apache-2.0
"""corefleet's fleet processes: frontend (Kubernetes DPLB client), coordinator, engine, emulator."""

__version__ = "0.1.0"
