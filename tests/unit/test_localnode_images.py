# SPDX-License-Identifier: Apache-2.0
"""The real node's image store knows an archive's images by the names the archive carries (a rebuilt image keeps
its tag, so what an import adds to containerd's list cannot tell them), and imports only the archives it lacks."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from corefleet_harness.localnode import IMPORTED_MARKER, archive_image_names, sync_images


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


class FakeContainerd:
    """`ctr` for `sync_images`: an image list that imports add the archive's names to."""

    def __init__(self, images: set[str]) -> None:
        self.images = set(images)
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        self.calls.append(args)
        if args[:2] == ("images", "import"):
            self.images |= set(archive_image_names(Path(args[2])))
        elif args[:2] == ("images", "remove"):
            self.images -= set(args[2:])
        return subprocess.CompletedProcess(list(args), 0, "\n".join(sorted(self.images)), "")

    def imports(self) -> list[str]:
        return [Path(c[2]).name for c in self.calls if c[:2] == ("images", "import")]


def _docker(path: Path, *tags: str) -> Path:
    return _archive(path, "manifest.json", [{"Config": "c.json", "RepoTags": list(tags), "Layers": []}])


def test_an_image_store_imports_only_what_it_lacks_and_drops_the_images_of_older_archives(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    base = _docker(tmp_path / "base-1.tar", "corefleet.local/base:1")
    runtime = _docker(tmp_path / "runtime-test-a.tar", "corefleet.local/runtime-test:a")
    ctr = FakeContainerd(set())
    sync_images(ctr, store, [base, runtime])
    assert ctr.imports() == ["base-1.tar", "runtime-test-a.tar"]
    # The next sync (a preload, then the node that takes the store): nothing to import.
    ctr = FakeContainerd(ctr.images)
    sync_images(ctr, store, [base, runtime])
    assert ctr.imports() == []
    # A rebuilt runtime image: only its archive is imported, the old build's tag removed.
    rebuilt = _docker(tmp_path / "runtime-test-b.tar", "corefleet.local/runtime-test:b")
    sync_images(ctr, store, [base, rebuilt])
    assert ctr.imports() == ["runtime-test-b.tar"]
    assert ctr.images == {"corefleet.local/base:1", "corefleet.local/runtime-test:b"}
    assert json.loads((store / IMPORTED_MARKER).read_text()) == {
        "base-1.tar": ["corefleet.local/base:1"], "runtime-test-b.tar": ["corefleet.local/runtime-test:b"]}
    # An image gone from containerd (a store pruned by hand) is imported again, though the marker names it.
    ctr = FakeContainerd({"corefleet.local/base:1"})
    sync_images(ctr, store, [base, rebuilt])
    assert ctr.imports() == ["runtime-test-b.tar"]
