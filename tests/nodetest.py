# SPDX-License-Identifier: Apache-2.0
"""Helpers for tests on a real node (`corefleet_harness.localnode`; import as `from nodetest import ...`).

* `image_archives`: the image archives hack/images.sh built (COREFLEET_IMAGES in .corefleet.env), by name;
* `image_store`: where the test nodes keep containerd's root between runs (the cache, beside the archives);
* `node_cluster`: a control plane that advertises this host's address, with one real node;
* `RealNode`: the e2e session's node (tests/e2e/conftest.py `real_node`);
* `assert_left_nothing`: what a stopped node must not leave on the host.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from corefleet_harness.localcluster import LocalControlPlane, resolve_bin_dir
from corefleet_harness.localnode import LocalNode, default_image_store, host_ip

IMAGES_ENV = "COREFLEET_IMAGES"


def image_archives(*names: str) -> list[Path]:
    """The archives `<name>-<content hash>.tar` of the images named (each exactly once), in that order."""
    raw = os.environ.get(IMAGES_ENV)
    assert raw, f"{IMAGES_ENV} is not set: run `bash hack/setup.sh node` and source .corefleet.env"
    paths = [Path(p) for p in raw.split(os.pathsep)]
    picked = []
    for name in names:
        found = [p for p in paths if p.name.rsplit("-", 1)[0] == name]
        assert len(found) == 1, f"image {name!r}: {found or 'not'} in {IMAGES_ENV}={raw}"
        assert found[0].is_file(), f"image archive missing (rerun hack/images.sh): {found[0]}"
        picked.append(found[0])
    return picked


def image_store() -> Path:
    """containerd's root for the test nodes, kept between runs in corefleet's cache (hack/test.sh preloads it)."""
    return default_image_store()


@contextlib.contextmanager
def node_cluster(state_dir: Path, images: list[Path],
                 store: Path | None = None) -> Iterator[tuple[LocalControlPlane, LocalNode]]:
    """A control plane advertising this host's address, and a real node on it with `images` imported."""
    cp = LocalControlPlane(state_dir=state_dir / "cp", bin_dir=resolve_bin_dir(), node_ip=host_ip())
    with cp, LocalNode(cp, state_dir / "node", images=images, image_store=store) as node:
        yield cp, node


@dataclass
class RealNode:
    """The session's real node (`corefleet_harness.localnode`) and the control plane it is registered with."""

    cp: LocalControlPlane
    node: LocalNode
    state_dir: Path


def assert_left_nothing(node: LocalNode, run_dir: Path) -> None:
    """After `node.stop()`: nothing it made is left on the host (its logs and its image store stay)."""
    state = node.state_dir
    assert node.leftovers == [], node.leftovers  # the drain tore every sandbox down; nothing needed sweeping
    assert subprocess.run(["ip", "link", "show", node.bridge], capture_output=True).returncode != 0
    for cmd in ("iptables-save", "ip6tables-save"):  # kube-proxy's chains, the kubelet's, the CNI's
        rules = subprocess.run([cmd], capture_output=True, text=True, check=True).stdout
        assert "KUBE-" not in rules
        assert node.network not in rules
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(state.resolve()) not in mounts
    assert str(run_dir) not in mounts
    if node.image_store is not None:
        assert str(node.image_store.resolve()) not in mounts
    assert not run_dir.exists()
    assert not (state / "containerd").exists()  # a private root (images, container file systems) is deleted
    assert (state / "kubelet.log").is_file()  # the logs stay
    procs = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert str(run_dir) not in procs
