# SPDX-License-Identifier: Apache-2.0
"""The real node's image store knows an archive's images by the names the archive carries (a rebuilt image keeps
its tag, so what an import adds to containerd's list cannot tell them)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from corefleet_harness.localnode import archive_image_names


def _archive(path: Path, name: str, content: object) -> Path:
    data = json.dumps(content).encode()
    with tarfile.open(path, "w") as tar:
        layer = tarfile.TarInfo("abc/layer.tar")
        layer.size = 3
        tar.addfile(layer, io.BytesIO(b"xyz"))
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


def test_a_docker_archive_names_its_repo_tags_as_containerd_does(tmp_path: Path) -> None:
    archive = _archive(tmp_path / "a.tar", "manifest.json", [
        {"Config": "c.json", "RepoTags": ["ghcr.io/corefleet/operator:0.1.0", "busybox:1", "library/x:2",
                                          "localhost/y:3"], "Layers": ["abc/layer.tar"]}])
    assert archive_image_names(archive) == ["docker.io/library/busybox:1", "docker.io/library/x:2",
                                            "ghcr.io/corefleet/operator:0.1.0", "localhost/y:3"]


def test_an_oci_archive_names_its_ref_names(tmp_path: Path) -> None:
    archive = _archive(tmp_path / "o.tar", "index.json", {"manifests": [
        {"annotations": {"io.containerd.image.name": "corefleet.local/pause:1"}},
        {"annotations": {"org.opencontainers.image.ref.name": "corefleet.local/base:7"}}]})
    assert archive_image_names(archive) == ["corefleet.local/base:7", "corefleet.local/pause:1"]


@pytest.mark.parametrize("content", [[{"RepoTags": None}], []])
def test_an_untagged_archive_names_nothing(tmp_path: Path, content: object) -> None:
    assert archive_image_names(_archive(tmp_path / "u.tar", "manifest.json", content)) == []
