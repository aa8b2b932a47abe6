# SPDX-License-Identifier: Apache-2.0
"""A pytest plugin: the logs of every failed test's processes, kept where the test runner says.

Every process a test starts (fleet pods, the operator, the control plane, the node's components, local
fleets, Prometheus) writes its log as a `*.log` file under pytest's base temporary directory (the tests'
`tmp_path` and `tmp_path_factory` dirs). When a test fails (in setup, call or teardown), each such log
written since the test began is copied (its last `MAX_BYTES`) to
`$COREFLEET_TEST_ARTIFACTS/failed/<test id>/<path under the base temp>`, beside `report.txt` (pytest's
account of the failure). Without COREFLEET_TEST_ARTIFACTS (a plain `pytest` run) nothing is copied: the
base temporary directory itself keeps the logs of the last runs.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

ARTIFACTS_ENV = "COREFLEET_TEST_ARTIFACTS"
MAX_BYTES = 2 << 20  # of each log: its end, where a failure shows
_STARTED = pytest.StashKey[float]()


def _artifacts() -> Path | None:
    where = os.environ.get(ARTIFACTS_ENV)
    return Path(where) if where else None


def _basetemp(config: pytest.Config) -> Path | None:
    factory = getattr(config, "_tmp_path_factory", None)  # set by pytest's tmp_path plugin at configure
    if factory is None:
        return None
    try:
        return Path(factory.getbasetemp())
    except OSError:
        return None


def _test_dir(nodeid: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_")[:180]


def _logs_since(root: Path, since: float) -> Iterator[Path]:
    for path in root.rglob("*.log"):
        try:
            if path.is_file() and path.stat().st_mtime >= since:
                yield path
        except OSError:  # gone meanwhile
            continue


def keep_logs(item: pytest.Item, report: pytest.TestReport) -> Path | None:
    """Copy the logs written since `item` began, and the failure's report; the folder they went to."""
    artifacts, root = _artifacts(), _basetemp(item.config)
    if artifacts is None:
        return None
    dest = artifacts / "failed" / _test_dir(item.nodeid)
    dest.mkdir(parents=True, exist_ok=True)
    with (dest / "report.txt").open("a") as f:
        f.write(f"{item.nodeid} failed in {report.when}\n\n{report.longreprtext}\n\n")
    if root is None:
        return dest
    since = item.stash.get(_STARTED, 0.0) - 1.0
    for log in _logs_since(root, since):
        target = dest / log.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            with log.open("rb") as src:
                size = src.seek(0, os.SEEK_END)
                src.seek(max(0, size - MAX_BYTES))
                target.write_bytes(src.read())
        except OSError:
            continue
    return dest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_STARTED] = time.time()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed:
        dest = keep_logs(item, report)
        if dest is not None:
            report.sections.append(("corefleet logs", f"the logs of this test's processes: {dest}"))
    return report
