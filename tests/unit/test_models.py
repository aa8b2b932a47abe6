# SPDX-License-Identifier: Apache-2.0
"""The typed API (models.py): size bounds, engine flags corefleet sets itself, and reading a stored status.

The API server's side of the same rules (the generated schema and its CEL) is checked against a real
one in tests/integration/test_admission.py.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from corefleet_operator import constants, crd
from corefleet_operator.models import (
    MEMBER_ROLES,
    Condition,
    EngineCoreSetSpec,
    EngineCoreSetStatus,
    OperationStatus,
    RankStatus,
    RecoveryStatus,
    SpecError,
    engine_args_problem,
    to_json,
)

BASE: dict[str, Any] = {"model": "m", "image": "i"}
NOW = "2026-01-01T00:00:00Z"


def spec(**fields: Any) -> dict[str, Any]:
    return {**BASE, **fields}


def engine(*args: str, tp: int = 1, moe: bool = False, load_format: str | None = None) -> dict[str, Any]:
    eng: dict[str, Any] = {"args": list(args), "tensorParallelSize": tp}
    if load_format is not None:
        eng["loadFormat"] = load_format
    return spec(engine=eng, expertParallel=moe, replicas=2)


def refused(raw: dict[str, Any]) -> SpecError:
    with pytest.raises(SpecError) as e:
        EngineCoreSetSpec.parse(raw)
    return e.value


# ---- defect 9: sizes are bounded, in the model as in the schema ----------------------------------
@pytest.mark.parametrize(("raw", "path", "text"), [
    (spec(replicas=70000, maxReplicas=70000), "spec.replicas", "70000 exceeds the maximum 512"),
    (spec(replicas=513), "spec.replicas", "exceeds the maximum 512"),
    (spec(replicas=2, maxReplicas=513), "spec.maxReplicas", "exceeds the maximum 512"),
    (spec(engine={"args": ["--enforce-eager"] * 129}), "spec.engine.args", "129 items exceed the maximum 128"),
    (spec(engine={"args": ["--x=" + "a" * 1533]}), "spec.engine.args[0]", "1537 characters exceed"),
    (spec(engine={"env": [{"name": f"V{i}", "value": "1"} for i in range(257)]}), "spec.engine.env",
     "257 items exceed the maximum 256"),
    (spec(engine={"env": [{"name": "V", "value": "x" * 1025}]}), "spec.engine.env[0].value",
     "1025 characters exceed"),
    (spec(engine={"env": [{"name": "V", "valueFrom": {"secretKeyRef": {"name": "s" * 254, "key": "k"}}}]}),
     "spec.engine.env[0].valueFrom.secretKeyRef.name", "254 characters exceed"),
    (spec(model="m" * 1025), "spec.model", "1025 characters exceed"),
    (spec(scheduling={"tolerations": [{"key": "k", "operator": "Exists"}] * 65}), "spec.scheduling.tolerations",
     "65 items exceed"),
    (spec(scheduling={"nodeSelector": {"k": "v" * 254}}), "spec.scheduling.nodeSelector.k", "254 characters"),
    (spec(engine={"resources": {"limits": {f"r{i}": "1" for i in range(65)}}}), "spec.engine.resources.limits",
     "65 entries exceed"),
    (spec(engine={"shmSize": "lots"}), "spec.engine.shmSize", "does not match"),
    (spec(frontend={"replicas": 9}), "spec.frontend.replicas", "9 exceeds the maximum 8"),
    (spec(frontend={"replicas": 2}, expertParallel=True), "spec.frontend.replicas",
     "must be 1 with expertParallel: true"),
    (spec(idle={}, expertParallel=True), "spec.idle", "is for dense fleets"),
    (spec(idle={"afterSeconds": 60}, frontend={"replicas": 2}), "spec.idle", "needs frontend.replicas 1"),
    (spec(idle={"afterSeconds": 5}), "spec.idle.afterSeconds", "minimum"),
])
def test_a_spec_beyond_a_bound_is_refused_naming_the_field(raw: dict[str, Any], path: str, text: str) -> None:
    err = refused(raw)
    assert err.path == path
    assert text in err.message


def test_the_largest_spec_within_every_bound_parses() -> None:
    name_pad, value = "N" * (constants.MAX_ENV_NAME_LENGTH - 4), "x" * constants.MAX_ENV_VALUE_LENGTH
    env = [{"name": f"V{i:03}{name_pad}", "value": value} for i in range(constants.MAX_ENV_VARS)]
    args = [f"--x{i:03}=" + "a" * (constants.MAX_ENGINE_ARG_LENGTH - 7) for i in range(constants.MAX_ENGINE_ARGS)]
    parsed = EngineCoreSetSpec.parse(spec(replicas=512, maxReplicas=512, engine={"args": args, "env": env}))
    assert parsed.replicas == constants.MAX_REPLICAS
    assert len(parsed.engine.args) == constants.MAX_ENGINE_ARGS
    # The largest spec, its metadata and the largest status (below) stay under etcd's 1.5 MiB.
    assert len(json.dumps(to_json(parsed))) < 600 * 1024


def test_the_schema_carries_the_models_bounds() -> None:
    schema = crd.spec_schema()["properties"]
    assert schema["replicas"]["maximum"] == schema["maxReplicas"]["maximum"] == constants.MAX_REPLICAS == 512
    args = schema["engine"]["properties"]["args"]
    assert (args["maxItems"], args["items"]) == (128, {"type": "string", "maxLength": 1536})
    env = schema["engine"]["properties"]["env"]
    assert env["maxItems"] == 256
    assert env["items"]["properties"]["value"]["maxLength"] == constants.MAX_ENV_VALUE_LENGTH
    status = crd.status_schema()["properties"]
    assert status["ranks"]["maxItems"] == constants.MAX_REPLICAS
    assert status["ranks"]["items"]["properties"]["message"]["maxLength"] == constants.MAX_RANK_MESSAGE
    assert status["conditions"]["items"]["properties"]["message"]["maxLength"] == constants.MAX_STATUS_MESSAGE


def test_status_messages_are_truncated_to_their_bound() -> None:
    long = "x" * 100_000
    cond = Condition(type="Degraded", status="True", reason="RankFailed", lastTransitionTime=NOW, message=long)
    rank = RankStatus(rank=0, pod="p", phase="Failed", message=long)
    op = OperationStatus(id="r", fromReplicas=1, toReplicas=2, phase="Failed", message=long)
    rec = RecoveryStatus(attempt=1, reason=long)
    assert len(cond.message) == constants.MAX_STATUS_MESSAGE
    assert cond.message.endswith("\u2026")
    assert len(rank.message) == constants.MAX_RANK_MESSAGE
    assert len(op.message) == constants.MAX_STATUS_MESSAGE
    assert len(rec.reason) == constants.MAX_STATUS_MESSAGE
    assert Condition(type="A", status="True", reason="R", lastTransitionTime=NOW, message="short").message == "short"


def test_the_largest_status_fits_a_status_write() -> None:
    """512 failed ranks with long messages, 4 long conditions, an operation and a recovery."""
    long = "why " * 10_000
    ranks = tuple(RankStatus(rank=r, pod=constants.engine_name("f" * 48, r), phase="Failed", message=long)
                  for r in range(constants.MAX_REPLICAS + 10))
    conds = tuple(Condition(type=t, status="True", reason="R", lastTransitionTime=NOW, message=long)
                  for t in ("Available", "Progressing", "Scaling", "Degraded"))
    status = EngineCoreSetStatus(replicas=512, ranks=ranks, conditions=conds,
                                 operation=OperationStatus(id="x", fromReplicas=1, toReplicas=512, phase="Failed",
                                                           message=long),
                                 recovery=RecoveryStatus(attempt=3, reason=long))
    assert len(status.ranks) == constants.MAX_REPLICAS
    size = len(json.dumps(status.to_json()))
    assert size < 256 * 1024, size


# ---- defect 10: engine flags corefleet sets itself -------------------------------------------------
ACCEPTED = [
    engine("--enable-eplb", moe=True, tp=2),
    engine("--enable-expert-parallel", "-ep", "--enable-elastic-ep", moe=True),
    engine("--enable_eplb", moe=True),
    engine("--no-enable-eplb", "--no-enable-expert-parallel"),  # dense: what corefleet means anyway
    engine("--tensor-parallel-size", "2", tp=2),
    engine("--tensor-parallel-size=2", tp=2),
    engine("-tp", "4", tp=4),
    engine("-tp=4", tp=4),
    engine("--tensor_parallel_size=1"),
    engine("--load-format", "dummy", load_format="dummy"),
    engine("--load-format=auto"),
    engine("--max-model-len=256", "--enforce-eager", "--no-data-parallel-hybrid-lb"),
    engine("--compilation-config.data_parallel_x=1"),  # a dotted config key, not a flag corefleet sets
    engine("--served-model-name", "tiny", "--seed", "-1"),
]


@pytest.mark.parametrize("raw", ACCEPTED, ids=lambda r: " ".join(r["engine"]["args"]))
def test_a_flag_that_agrees_with_the_spec_is_accepted(raw: dict[str, Any]) -> None:
    EngineCoreSetSpec.parse(raw)


REFUSED = [
    (engine("--enable-eplb"), 0, "--enable-eplb is set by corefleet on expertParallel fleets only"),
    (engine("--max-model-len=8", "-ep"), 1, "-ep is set by corefleet on expertParallel fleets only"),
    (engine("--enable-elastic-ep"), 0, "expertParallel fleets only"),
    (engine("--enable-eplb=true", moe=True), 0, "--enable-eplb takes no value"),
    (engine("--no-enable-eplb", moe=True), 0,
     "--no-enable-eplb conflicts with expertParallel: true (corefleet sets --enable-eplb)"),
    (engine("--tensor-parallel-size", "4", tp=2), 0,
     "--tensor-parallel-size '4' disagrees with engine.tensorParallelSize '2'"),
    (engine("--tensor-parallel-size=02", tp=2), 0, "disagrees with engine.tensorParallelSize"),
    (engine("-tp=3"), 0, "-tp '3' disagrees"),
    (engine("--tensor_parallel_size", "8"), 0, "--tensor-parallel-size '8' disagrees"),
    (engine("--tensor-parallel-size"), 0, "--tensor-parallel-size '' disagrees"),
    (engine("--load-format", "dummy"), 0, "--load-format 'dummy' disagrees with engine.loadFormat 'auto'"),
    (engine("--data-parallel-size=8"), 0, "--data-parallel-size is set by corefleet and cannot be overridden"),
    (engine("--data_parallel_rank", "1"), 0, "--data-parallel-rank is set by corefleet"),
    (engine("-dpa=1.2.3.4"), 0, "-dpa is set by corefleet"),
    (engine("--data-parallel-anything"), 0, "--data-parallel-anything is set by corefleet"),
    (engine("--headless"), 0, "--headless is set by corefleet"),
    (engine("--api-server-count", "2"), 0, "--api-server-count is set by corefleet"),
    (engine("-asc=2"), 0, "-asc is set by corefleet"),
    (engine("--elastic-ep-max-dp-size=8", moe=True), 0, "--elastic-ep-max-dp-size is set by corefleet"),
    (engine("-n2"), 0, "-n is set by corefleet"),
    (engine("-r", "1"), 0, "-r is set by corefleet"),
    (engine("--model", "m"), 0, "--model is set by corefleet"),
    (engine("--port=9000"), 0, "--port is set by corefleet"),
    (engine("--"), 0, "-- is set by corefleet"),
    (engine("--headl"), 0, "--headl abbreviates --headless (vLLM accepts abbreviations)"),
    (engine("--tensor-parallel", "1"), 0, "abbreviates --tensor-parallel-size"),
    (engine("--data-parallel-s=1"), 0, "abbreviates --data-parallel-size or --data-parallel-size-local"),
]


@pytest.mark.parametrize(("raw", "index", "text"), REFUSED, ids=lambda x: x if isinstance(x, str) else None)
def test_a_flag_that_conflicts_is_refused_naming_it(raw: dict[str, Any], index: int, text: str) -> None:
    err = refused(raw)
    assert err.path == f"spec.engine.args[{index}]"
    assert text in err.message


def test_engine_args_problem_is_the_one_check() -> None:
    assert engine_args_problem(["--enable-eplb"], expert_parallel=True, tensor_parallel_size=1,
                               load_format="auto") is None
    assert engine_args_problem(["--enable-eplb"], expert_parallel=False, tensor_parallel_size=1,
                               load_format="auto") == (0, "--enable-eplb is set by corefleet on expertParallel "
                                                          "fleets only: this fleet is dense (expertParallel: false)")


def test_every_flag_builders_set_is_covered_by_the_lists() -> None:
    """Every vLLM flag corefleet's pods carry before the user's is in one of constants' lists."""
    from corefleet_operator import builders
    from factories import make_ecs

    fleet = make_ecs("f").replicas(2).max_replicas(4).expert_parallel().tp(2).obj()
    owned = {*constants.ENGINE_WIRING_FLAGS, *constants.ENGINE_MOE_FLAGS, *constants.ENGINE_TENSOR_PARALLEL_FLAGS,
             *constants.ENGINE_LOAD_FORMAT_FLAGS}
    pods = [builders.engine_pod(fleet, 0, dp_size=2, frontend_address="fe"),
            builders.frontend_pod(fleet, dp_size=2, coordinator_address="co")]
    for pod in pods:
        args = pod["spec"]["containers"][0]["args"]
        vllm = args[args.index("--") + 1:]
        flags = {a.split("=", 1)[0] for a in vllm if a.startswith("--")}
        assert flags <= owned, sorted(flags - owned)


# ---- defect 4: a stored status is read field by field ------------------------------------------------
GOOD: dict[str, Any] = {
    "observedGeneration": 3,
    "replicas": 2,
    "readyReplicas": 2,
    "phase": "Running",
    "fleetGeneration": 4,
    "recoveries": 1,
    "conditions": [{"type": "Available", "status": "True", "reason": "RanksServing",
                    "lastTransitionTime": NOW, "message": "2/2 ranks serving", "observedGeneration": 3}],
    "ranks": [{"rank": 0, "pod": "f-engine-0", "phase": "Serving"},
              {"rank": 1, "pod": "f-engine-1", "phase": "Serving"}],
    "operation": {"id": "r1", "fromReplicas": 1, "toReplicas": 2, "phase": "Completed", "fleetGeneration": 4},
    "endpoint": "http://f.ns.svc:8000/v1",
}


def with_(**changes: Any) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.dumps(GOOD))
    for key, value in changes.items():
        if value is ...:
            del out[key]
        else:
            out[key] = value
    return out


def test_a_good_status_round_trips_without_problems() -> None:
    status, problems, unreadable = EngineCoreSetStatus.parse_report(GOOD)
    assert (problems, unreadable) == ((), False)
    assert (status.fleetGeneration, status.replicas, status.phase, len(status.ranks)) == (4, 2, "Running", 2)
    assert status.operation is not None
    assert status.operation.phase == "Completed"
    assert EngineCoreSetStatus.parse_report(status.to_json()) == (status, (), False)


@pytest.mark.parametrize("raw", [None, {}])
def test_no_status_is_a_new_fleets_not_a_problem(raw: Any) -> None:
    assert EngineCoreSetStatus.parse_report(raw) == (EngineCoreSetStatus(), (), False)


def test_unknown_fields_from_a_newer_release_are_ignored_at_every_level() -> None:
    raw = with_(newField={"a": 1}, ranks=[{**GOOD["ranks"][0], "since": NOW}, GOOD["ranks"][1]],
                operation={**GOOD["operation"], "cancelled": False})
    status, problems, unreadable = EngineCoreSetStatus.parse_report(raw)
    assert (problems, unreadable) == ((), False)
    assert status == EngineCoreSetStatus.parse(GOOD)


def test_an_unknown_field_no_longer_empties_the_whole_status() -> None:
    status = EngineCoreSetStatus.parse(with_(newField=1))
    assert (status.fleetGeneration, status.replicas, len(status.ranks)) == (4, 2, 2)


@pytest.mark.parametrize(("change", "problem", "check"), [
    ({"phase": "Hibernating"}, "status.phase: must be one of", lambda s: s.phase == "Pending"),
    ({"readyReplicas": "two"}, "status.readyReplicas: must be an integer", lambda s: s.readyReplicas == 0),
    ({"conditions": "none"}, "status.conditions: must be a list", lambda s: s.conditions == ()),
    ({"ranks": [{"rank": 0, "pod": "f-engine-0", "phase": "Serving"}, {"rank": "one", "pod": "x", "phase": "?"}]},
     "status.ranks[1].rank: must be an integer (item left out)", lambda s: [r.rank for r in s.ranks] == [0]),
    ({"recovery": {"attempt": "x", "reason": "lost"}}, "status.recovery.attempt: must be an integer",
     lambda s: s.recovery == RecoveryStatus(reason="lost")),
    ({"operation": {**GOOD["operation"], "startedAt": 5}}, "status.operation.startedAt: must be a string",
     lambda s: s.operation is not None and s.operation.id == "r1"),
])
def test_a_broken_field_reads_as_its_default_and_is_reported(change: dict[str, Any], problem: str,
                                                               check: Any) -> None:
    status, problems, unreadable = EngineCoreSetStatus.parse_report(with_(**change))
    assert unreadable is False
    assert len(problems) == 1, problems
    assert problems[0].startswith(problem), problems
    assert check(status)
    assert (status.fleetGeneration, status.replicas) == (4, 2)  # the identity survives


@pytest.mark.parametrize(("raw", "problem"), [
    (with_(fleetGeneration="4"), "status.fleetGeneration: must be an integer"),
    (with_(replicas=[2]), "status.replicas: must be an integer"),
    (with_(fleetGeneration=...), "status.fleetGeneration: missing"),
    (with_(replicas=...), "status.replicas: missing"),
    (with_(operation={"id": "r1", "phase": "Draining"}), "status.operation.fromReplicas: is required"),
    (with_(operation=[1]), "status.operation: must be an object"),
    ("garbage", "status: must be an object, not str"),
])
def test_an_unreadable_identity_is_flagged(raw: Any, problem: str) -> None:
    _, problems, unreadable = EngineCoreSetStatus.parse_report(raw)
    assert unreadable is True
    assert any(p.startswith(problem) for p in problems), problems


def test_parse_keeps_working_for_existing_callers() -> None:
    assert EngineCoreSetStatus.parse(GOOD).fleetGeneration == 4
    assert EngineCoreSetStatus.parse(None) == EngineCoreSetStatus()
    assert EngineCoreSetStatus.parse(with_(phase="Nope")).replicas == 2


def test_an_operation_names_the_members_it_replaces_and_reads_them_back() -> None:
    assert set(MEMBER_ROLES) == {constants.ROLE_FRONTEND, constants.ROLE_COORDINATOR}
    op = OperationStatus(id="replace-frontend-g1-x", fromReplicas=2, toReplicas=2, phase="Pending",
                         members=("coordinator", "frontend", "frontend-1"))
    status = EngineCoreSetStatus(replicas=2, operation=op)
    assert status.to_json()["operation"]["members"] == ["coordinator", "frontend", "frontend-1"]
    assert EngineCoreSetStatus.parse_report(status.to_json()) == (status, (), False)
    schema = crd.status_schema()["properties"]["operation"]["properties"]["members"]
    assert schema["maxItems"] == 1 + constants.MAX_FRONTENDS
    pattern = re.compile(schema["items"]["pattern"])
    assert [m for m in ("coordinator", "frontend", "frontend-1", "frontend-7") if pattern.match(m)] == [
        "coordinator", "frontend", "frontend-1", "frontend-7"]
    assert not [m for m in ("frontend-0", "frontend-8", "router", "frontend-") if pattern.match(m)]
