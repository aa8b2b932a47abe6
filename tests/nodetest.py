# SPDX-License-Identifier: Apache-2.0
"""Helpers for tests on a real node (`corefleet_harness.localnode`; import as `from nodetest import ...`).

* `image_archives`: the image archives hack/images.sh built (COREFLEET_IMAGES in .corefleet.env), by name;
* `node_cluster`: a control plane that advertises this host's address, with one real node.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from corefleet_harness.localcluster import LocalControlPlane, resolve_bin_dir
from corefleet_harness.localnode import LocalNode, host_ip

IMAGES_ENV = "COREFLEET_IMAGES"


def image_archives(*names: str) -> list[Path]:
    """The archives `<name>-<content hash>.tar` of the images named (each exactly once), in that order."""
    raw = os.environ.get(IMAGES_ENV)
    assert raw, f"{IMAGES_ENV} is not set: run `bash hack/images.sh` (make setup) and source .corefleet.env"
    paths = [Path(p) for p in raw.split(os.pathsep)]
    picked = []
    for name in names:
        found = [p for p in paths if p.name.rsplit("-", 1)[0] == name]
        assert len(found) == 1, f"image {name!r}: {found or 'not'} in {IMAGES_ENV}={raw}"
        assert found[0].is_file(), f"image archive missing (rerun hack/images.sh): {found[0]}"
        picked.append(found[0])
    return picked


@contextlib.contextmanager
def node_cluster(state_dir: Path, images: list[Path]) -> Iterator[tuple[LocalControlPlane, LocalNode]]:
    """A control plane advertising this host's address, and a real node on it with `images` imported."""
    cp = LocalControlPlane(state_dir=state_dir / "cp", bin_dir=resolve_bin_dir(), node_ip=host_ip())
    with cp, LocalNode(cp, state_dir / "node", images=images) as node:
        yield cp, node
