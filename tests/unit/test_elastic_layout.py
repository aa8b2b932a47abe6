# SPDX-License-Identifier: Apache-2.0
"""Elastic EP's expert layout across resizes: the frontend's check of a new size (`ExpertLayout`,
`Fleet.start_resize`) and the operator's `--eplb-config` for a new rank (`commands.with_redundant_experts`,
which the operator's builders call).

Both must agree with vLLM 0.32.0, so each is also checked against vLLM's own code: the size check
against `DPLBAsyncMPClient.prepare_elastic_ep` (run on a stand-in client, no engine), the argument
rewrite against `FlexibleArgumentParser` (which folds the dotted `--eplb-config.KEY` forms into a
last `--eplb-config`). vLLM is imported only by those checks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any

import pytest

from corefleet_client import commands
from corefleet_client.admin import RankState, ResizeOperation, ResizePhase, ResizeRequest
from corefleet_client.frontend.fleet import ExpertLayout, Fleet
from corefleet_client.frontend.types import ResizeRefused
from standins import IdleView, RecordingRunner

EPLB = "--eplb-config"


# ---- ExpertLayout: R' = (E + R) * to // frm - E ------------------------------------------------------
@pytest.mark.parametrize(("experts", "redundant", "frm", "to", "expected"), [
    (4, 0, 2, 4, 4),  # twice the ranks, twice the physical experts
    (4, 4, 4, 2, 0),  # back down: the redundant ones go first
    (8, 0, 2, 3, 4),  # 4 physical experts per rank
    (4, 4, 4, 3, 2),
    (6, 2, 4, 3, 0),  # 8 * 3 // 4 - 6
    (4, 0, 2, 2, 0),
])
def test_redundant_at(experts: int, redundant: int, frm: int, to: int, expected: int) -> None:
    assert ExpertLayout(experts, redundant, max_size=8).redundant_at(frm, to) == expected


@pytest.mark.parametrize(("experts", "redundant", "frm", "to", "minimum"), [
    (4, 0, 2, 1, 2),
    (8, 0, 4, 3, 4),
    (6, 2, 4, 2, 3),  # 8 * 2 // 4 - 6 < 0; ceil(6 * 4 / 8) = 3
])
def test_redundant_at_refuses_below_the_minimum(experts: int, redundant: int, frm: int, to: int,
                                                minimum: int) -> None:
    with pytest.raises(ValueError, match=f"minimum is {minimum}"):
        ExpertLayout(experts, redundant, max_size=8).redundant_at(frm, to)


def test_redundant_at_refuses_above_the_maximum() -> None:
    layout = ExpertLayout(4, 0, max_size=4)
    assert layout.redundant_at(2, 4) == 4  # the maximum itself is fine
    with pytest.raises(ValueError, match="--elastic-ep-max-dp-size"):
        layout.redundant_at(2, 5)


@pytest.fixture(scope="module")
def vllm_prepare() -> Callable[[int, int, int, int, int], tuple[int, int] | str]:
    """vLLM's `prepare_elastic_ep` on a stand-in client: (size, R') it prepares, or its ValueError's text."""
    from vllm.v1.engine.core_client import DPLBAsyncMPClient

    def prepare(experts: int, redundant: int, max_size: int, frm: int, to: int) -> tuple[int, int] | str:
        async def noop(*args: Any) -> None:
            pass

        client = SimpleNamespace(
            _prepared_elastic_ep=None,
            core_engines=[b"e"] * frm,
            vllm_config=SimpleNamespace(
                parallel_config=SimpleNamespace(
                    data_parallel_backend="ray", elastic_ep_max_dp_size=max_size,
                    eplb_config=SimpleNamespace(num_redundant_experts=redundant)),
                model_config=SimpleNamespace(get_num_experts=lambda: experts)),
            _prepare_scale_up_elastic_ep=noop,
            _prepare_scale_down_elastic_ep=noop,
        )
        try:
            asyncio.run(DPLBAsyncMPClient.prepare_elastic_ep(client, to))
        except ValueError as e:
            return str(e)
        prepared: tuple[int, int] = client._prepared_elastic_ep
        return prepared

    return prepare


def test_redundant_at_mirrors_vllm(vllm_prepare: Callable[[int, int, int, int, int], tuple[int, int] | str]) -> None:
    """Every resize of small layouts: the same R', or a refusal for the same reason (the same minimum)."""
    max_size = 6
    for experts in (2, 4, 6, 8):
        for frm in range(1, max_size + 1):
            for redundant in (0, 1, 2, 4):
                if (experts + redundant) % frm:  # vLLM requires whole physical experts per rank
                    continue
                for to in range(1, max_size + 2):
                    if to == frm:
                        continue
                    case = (experts, redundant, frm, to)
                    expected = vllm_prepare(experts, redundant, max_size, frm, to)
                    layout = ExpertLayout(experts, redundant, max_size)
                    if isinstance(expected, tuple):
                        assert (to, layout.redundant_at(frm, to)) == expected, case
                        continue
                    with pytest.raises(ValueError, match="Cannot scale to data_parallel_size") as e:
                        layout.redundant_at(frm, to)
                    if "minimum is" in expected:
                        minimum = expected.split("minimum is ")[1]
                        assert f"minimum is {minimum}:" in str(e.value), case
                    else:
                        assert "--elastic-ep-max-dp-size" in expected, case
                        assert "--elastic-ep-max-dp-size" in str(e.value), case


# ---- Fleet.start_resize of an MoE fleet ----------------------------------------------------------------
def moe_fleet(size: int, experts: ExpertLayout | None) -> tuple[Fleet, RecordingRunner]:
    """A serving MoE fleet of `size` ranks and the runner its resizes are handed to."""
    fleet, runner = Fleet("m", size), RecordingRunner()
    fleet.moe = True
    fleet.experts = experts
    fleet.serving(IdleView(), runner)
    return fleet, runner


def refusal(fleet: Fleet, request: ResizeRequest) -> ResizeRefused:
    with pytest.raises(ResizeRefused) as e:
        fleet.start_resize(request)
    return e.value


def test_scale_up_carries_the_new_redundant_experts() -> None:
    fleet, runner = moe_fleet(2, ExpertLayout(4, 0, 4))

    started, op = fleet.start_resize(ResizeRequest(id="r1", replicas=4))

    assert started
    assert (op.from_replicas, op.to_replicas, op.phase) == (2, 4, ResizePhase.PENDING)
    assert op.num_redundant_experts == 4
    assert [(r.rank, r.state) for r in op.ranks] == [(2, RankState.JOINING), (3, RankState.JOINING)]
    assert runner.runs == ["r1"]
    assert fleet.resize("r1") == op
    # A retry of the same request is the same operation, not a second run.
    assert fleet.start_resize(ResizeRequest(id="r1", replicas=4)) == (False, op)
    assert runner.runs == ["r1"]


def test_scale_down_carries_the_new_redundant_experts() -> None:
    fleet, runner = moe_fleet(4, ExpertLayout(4, 4, 4))

    _, op = fleet.start_resize(ResizeRequest(id="r1", replicas=2))

    assert op.num_redundant_experts == 0
    assert [r.rank for r in op.ranks] == [2, 3]
    assert runner.runs == ["r1"]


def test_dense_fleet_has_no_redundant_experts() -> None:
    fleet, runner = Fleet("m", 2), RecordingRunner()
    fleet.serving(IdleView(), runner)

    _, op = fleet.start_resize(ResizeRequest(id="r1", replicas=3))

    assert op.num_redundant_experts is None
    assert runner.runs == ["r1"]


@pytest.mark.parametrize(("layout", "replicas", "words"), [
    (ExpertLayout(4, 0, 4), 1, "minimum is 2"),
    (ExpertLayout(4, 0, 4), 5, "--elastic-ep-max-dp-size"),
    (None, 4, "elastic EP"),
])
def test_refused_sizes_are_400_and_start_nothing(layout: ExpertLayout | None, replicas: int, words: str) -> None:
    fleet, runner = moe_fleet(2, layout)

    refused = refusal(fleet, ResizeRequest(id="r2", replicas=replicas))

    assert refused.status == HTTPStatus.BAD_REQUEST
    assert words in refused.message
    assert words in str(refused)
    assert runner.runs == []
    assert fleet.resize("r2") is None
    assert fleet.current_resize() is None
    assert fleet.size == 2


def test_operation_json_keeps_the_redundant_experts() -> None:
    fleet, _ = moe_fleet(2, ExpertLayout(4, 0, 4))
    _, op = fleet.start_resize(ResizeRequest(id="r1", replicas=4))

    wire = json.loads(json.dumps(op.to_json()))

    assert wire["num_redundant_experts"] == 4
    assert ResizeOperation.from_json(wire) == op


@pytest.mark.parametrize("redundant", [None, 0])
def test_operation_json_keeps_none_and_zero_apart(redundant: int | None) -> None:
    op = ResizeOperation(id="r1", from_replicas=4, to_replicas=2, phase=ResizePhase.PENDING,
                         num_redundant_experts=redundant)
    assert ResizeOperation.from_json(json.loads(json.dumps(op.to_json()))).num_redundant_experts == redundant


def test_operation_json_without_the_field_reads_as_none() -> None:
    """An older frontend's operation has no num_redundant_experts."""
    op = ResizeOperation.from_json({"id": "r1", "from_replicas": 2, "to_replicas": 3, "phase": "Pending"})
    assert op.num_redundant_experts is None


# ---- commands.with_redundant_experts -----------------------------------------------------------------
def split_eplb(args: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """(the arguments before the one trailing `--eplb-config JSON`, that JSON), checking there is just one."""
    assert [a for a in args if a.startswith(EPLB)] == [EPLB], args
    assert list(args[-2:-1]) == [EPLB], args
    return list(args[:-2]), json.loads(args[-1])


CASES: list[tuple[str, list[str], list[str], dict[str, Any]]] = [
    ("none", ["--max-model-len", "1024", "--enable-eplb"],
     ["--max-model-len", "1024", "--enable-eplb"], {}),
    ("json", ["--max-model-len", "1024", EPLB, '{"window_size": 100, "num_redundant_experts": 2}', "--enable-eplb"],
     ["--max-model-len", "1024", "--enable-eplb"], {"window_size": 100}),
    ("json=", [f'{EPLB}={{"window_size": 100, "num_redundant_experts": 2}}', "--max-model-len=1024"],
     ["--max-model-len=1024"], {"window_size": 100}),
    ("dotted", [f"{EPLB}.window_size", "100", "--max-model-len", "1024", f"{EPLB}.step_interval=10"],
     ["--max-model-len", "1024"], {"window_size": 100, "step_interval": 10}),
    ("dotted-redundant", ["--enable-eplb", f"{EPLB}.num_redundant_experts", "2", f"{EPLB}.log_balancedness=true"],
     ["--enable-eplb"], {"log_balancedness": True}),
    # vLLM's parser appends the dotted keys as a last --eplb-config, which replaces the JSON one whole.
    ("json-and-dotted", [EPLB, '{"window_size": 100, "num_redundant_experts": 2}', "--enable-eplb",
                         f"{EPLB}.step_interval=10", f"{EPLB}.policy", "default"],
     ["--enable-eplb"], {"step_interval": 10, "policy": "default"}),
    ("json-twice", [EPLB, '{"window_size": 100}', EPLB, '{"step_interval": 10}'],
     [], {"step_interval": 10}),
    # A size suffix in a dotted value: vLLM reads it (1k -> 1000); the rewrite leaves it to vLLM.
    ("dotted-suffix", [f"{EPLB}.window_size", "1k", "--enable-eplb"], ["--enable-eplb"], {"window_size": 1000}),
]


@pytest.mark.parametrize(("args", "others", "config"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
@pytest.mark.parametrize("redundant", [0, 4])
def test_with_redundant_experts(args: list[str], others: list[str], config: dict[str, Any], redundant: int) -> None:
    before = list(args)

    out = commands.with_redundant_experts(args, redundant)

    assert args == before  # the caller's list is not changed
    if any(a.startswith(f"{EPLB}.") for a in args):  # dotted: vLLM folds them, R joins them as one more
        key = f"{EPLB}.num_redundant_experts"
        assert out[-2:] == [key, str(redundant)], out
        assert key not in [a.partition("=")[0] for a in out[:-2]], out
        assert [a for a in out[:-2] if not a.startswith(EPLB)][:len(others)] == [
            a for a in args if not a.startswith(EPLB)][:len(others)]
        return
    rest, eplb = split_eplb(out)
    assert rest == others  # the other arguments keep their order
    assert eplb == {**config, "num_redundant_experts": redundant}
    assert type(eplb["num_redundant_experts"]) is int


@pytest.fixture(scope="module")
def vllm_parse() -> Callable[[Sequence[str]], dict[str, Any]]:
    """The namespace vLLM's FlexibleArgumentParser makes of the CASES' arguments (`--eplb-config` as vLLM types it)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    parser.add_argument(EPLB, type=json.loads)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--enable-eplb", action="store_true")
    return lambda args: vars(parser.parse_args(list(args)))


@pytest.mark.parametrize("args", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_with_redundant_experts_reads_as_vllm_does(vllm_parse: Callable[[Sequence[str]], dict[str, Any]],
                                                   args: list[str]) -> None:
    """vLLM reads the rewritten arguments as the user's, with only num_redundant_experts changed."""
    user = vllm_parse(args)
    rewritten = vllm_parse(commands.with_redundant_experts(args, 3))
    assert rewritten == {**user, "eplb_config": {**(user["eplb_config"] or {}), "num_redundant_experts": 3}}
