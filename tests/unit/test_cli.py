# SPDX-License-Identifier: Apache-2.0
"""The `corefleet` command's argument handling (the commands themselves run in e2e)."""

from __future__ import annotations

import pytest

from corefleet_operator import __version__
from corefleet_operator.cli import build_parser, main


def test_up_without_control_plane_binaries_explains_the_fix(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("COREFLEET_K8S_BIN", raising=False)

    rc = main(["up", "--exit-when-ready"])

    assert rc == 2
    assert "hack/control-plane.sh" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == __version__


def test_a_command_is_required() -> None:
    with pytest.raises(SystemExit) as err:
        build_parser().parse_args([])
    assert err.value.code == 2


def test_operator_arguments_pass_through(monkeypatch: pytest.MonkeyPatch) -> None:
    from corefleet_operator import __main__ as operator_main

    seen: list[list[str]] = []
    monkeypatch.setattr(operator_main, "main", lambda argv: seen.append(list(argv)) or 0)

    assert main(["operator", "--namespace", "a", "--verbose"]) == 0
    assert seen == [["--namespace", "a", "--verbose"]]


def test_operator_parser_accepts_namespaces_and_liveness() -> None:
    from corefleet_operator.__main__ import parse_args

    args = parse_args(["-n", "a", "--namespace", "b", "--liveness", ""])
    assert args.namespace == ["a", "b"]
    assert args.liveness == ""
