# SPDX-License-Identifier: Apache-2.0
"""kopf handlers: thin adapters from kopf's callbacks to corefleet's pure core.

Importing this package registers the handlers with kopf's default registry.
"""

from __future__ import annotations

from corefleet_operator.handlers import fleet, lifecycle

__all__ = ["fleet", "lifecycle"]
