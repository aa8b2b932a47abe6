# SPDX-License-Identifier: Apache-2.0
"""Helpers for tests that drive a command as a user would (import as `from procs import ...`)."""

from __future__ import annotations

import subprocess
import threading


def read_lines_until(proc: subprocess.Popen[str], marker: str, timeout: float) -> list[str]:
    """Stdout lines up to the first that contains `marker` (fails at the deadline or when the output ends)."""
    lines: list[str] = []
    found = threading.Event()

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if marker in line:
                found.set()
                return

    threading.Thread(target=reader, daemon=True).start()
    assert found.wait(timeout), f"no line with {marker!r} within {timeout} s; got {lines}"
    return lines
