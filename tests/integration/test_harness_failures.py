# SPDX-License-Identifier: Apache-2.0
"""The harness fails loudly, naming the command and its log, when a component cannot start."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from corefleet_harness.localcluster import (
    COMPONENTS,
    TOOLS,
    ControlPlaneError,
    LocalControlPlane,
    resolve_bin_dir,
)


def fake_bin_dir(tmp_path: Path, etcd_script: str) -> Path:
    d = tmp_path / "bin"
    d.mkdir()
    for name in (*COMPONENTS, *TOOLS):
        f = d / name
        f.write_text(etcd_script if name == "etcd" else "#!/bin/sh\nexit 0\n")
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    return d


def test_component_that_exits_fails_with_command_and_log(tmp_path: Path) -> None:
    bins = fake_bin_dir(tmp_path, "#!/bin/sh\necho 'etcd: cannot bind the listener' >&2\nexit 3\n")
    cp = LocalControlPlane(state_dir=tmp_path / "state", bin_dir=bins, ready_timeout=30)

    with pytest.raises(ControlPlaneError) as err:
        cp.start()

    msg = str(err.value)
    assert "etcd exited with code 3" in msg
    assert f"command: {bins / 'etcd'} --name=cp" in msg
    assert "cannot bind the listener" in msg
    assert cp.pids == {}


def test_component_that_never_gets_ready_times_out_with_log(tmp_path: Path) -> None:
    bins = fake_bin_dir(tmp_path, "#!/bin/sh\necho 'etcd: waiting for quorum'\nexec sleep 600\n")
    cp = LocalControlPlane(state_dir=tmp_path / "state", bin_dir=bins, ready_timeout=1)

    with pytest.raises(ControlPlaneError) as err:
        cp.start()

    msg = str(err.value)
    assert "etcd /health" in msg
    assert "not done after 1 s" in msg
    assert "waiting for quorum" in msg
    assert cp.pids == {}  # the hanging etcd was stopped


def test_missing_binaries_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COREFLEET_K8S_BIN", raising=False)
    with pytest.raises(ControlPlaneError, match=re.escape("hack/control-plane.sh")):
        resolve_bin_dir()
    d = fake_bin_dir(tmp_path, "#!/bin/sh\n")
    os.remove(d / "kube-scheduler")
    with pytest.raises(ControlPlaneError, match=r"missing control-plane binaries .*: kube-scheduler"):
        resolve_bin_dir(d)
