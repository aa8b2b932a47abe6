# SPDX-License-Identifier: Apache-2.0
"""The command-line shape every fleet program shares: `[corefleet flags] -- <vLLM flags>`.

The command lines are written in one place, `corefleet_client.commands`, for the operator's pods and
local mode alike; `commands.LAUNCHER_ARGS_END` is this module's separator.
"""

from __future__ import annotations

from collections.abc import Sequence

ARGS_END = "--"


def split_launcher_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(corefleet's flags, vLLM's flags): split at the first `--`; no `--` means no vLLM flags."""
    argv = list(argv)
    if ARGS_END not in argv:
        return argv, []
    i = argv.index(ARGS_END)
    return argv[:i], argv[i + 1:]
