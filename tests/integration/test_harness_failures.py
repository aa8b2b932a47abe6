# SPDX-License-Identifier: Apache-2.0
"""The harness fails loudly, naming the command and its log, when a component cannot start."""

from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
import uuid
from pathlib import Path

import pytest

from corefleet_harness.localcluster import (
    COMPONENTS,
    TOOLS,
    ControlPlaneError,
    LocalControlPlane,
    resolve_bin_dir,
)
from corefleet_harness.localnode import sweep_dead_nodes


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


def _nat_chains() -> str:
    return subprocess.run(["iptables-save", "-t", "nat"], check=True, capture_output=True, text=True).stdout


def test_what_a_node_killed_before_its_stop_left_is_swept_by_the_next_one(tmp_path: Path) -> None:
    """A test run killed mid-node leaves its run dir, mounts, the CNI's NAT chains and pods' network
    namespaces; a later node's `stop()` must not count them as its own leftovers, and its start sweeps them."""
    tag = uuid.uuid4().hex[:8]
    network, chain, netns = f"corefleet-t{tag}", f"CNI-test-{tag}", f"cni-test-{tag}"
    root = tmp_path / "run"
    dead, live = root / "cf-node-dead", root / "cf-node-live"
    for d in (dead, live):
        d.mkdir(parents=True)
    with socket.socket(socket.AF_UNIX) as s:  # a containerd that is gone: its socket stays, nobody listens
        s.bind(str(dead / "containerd.sock"))
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(live / "containerd.sock"))
    listener.listen()
    shm = dead / "state" / "shm"
    shm.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(shm)], check=True)
    comment = f'name: "{network}" id: "{tag}"'
    for argv in (["-N", chain],
                 ["-A", chain, "-d", "10.254.0.0/24", "-j", "ACCEPT", "-m", "comment", "--comment", comment],
                 ["-A", "POSTROUTING", "-s", "10.254.0.9", "-j", chain, "-m", "comment", "--comment", comment]):
        subprocess.run(["iptables", "-t", "nat", *argv], check=True)
    subprocess.run(["ip", "netns", "add", netns], check=True)
    try:
        # Another node still lives: only the dead one's run dir (and its mount) go; the chains and network
        # namespaces may be the live node's.
        swept = sweep_dead_nodes(network, str(root))
        assert swept == [f"run dir {dead}"]
        assert not dead.exists()
        assert live.exists()
        assert str(shm) not in Path("/proc/self/mountinfo").read_text()
        assert chain in _nat_chains()
        assert netns in os.listdir("/run/netns")

        listener.close()  # now no node lives: what the network's pods left is a dead node's
        swept = sweep_dead_nodes(network, str(root))
        assert {f"run dir {live}", f"iptables nat chain {chain}", f"netns {netns}"} <= set(swept)
        assert chain not in _nat_chains()
        assert netns not in os.listdir("/run/netns")
        assert list(root.iterdir()) == []
    finally:
        listener.close()
        subprocess.run(["umount", "-l", str(shm)], check=False, capture_output=True)
        subprocess.run(["iptables", "-t", "nat", "-D", "POSTROUTING", "-s", "10.254.0.9", "-j", chain, "-m", "comment",
                        "--comment", comment], check=False, capture_output=True)
        subprocess.run(["iptables", "-t", "nat", "-F", chain], check=False, capture_output=True)
        subprocess.run(["iptables", "-t", "nat", "-X", chain], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "delete", netns], check=False, capture_output=True)
