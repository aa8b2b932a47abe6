# SPDX-License-Identifier: Apache-2.0
"""The engine emulator enforces vLLM's elastic-EP ordering, so that a client that breaks it fails.

Each rule is shown rejecting (or holding back) a wrong order and letting the right one through:

1. A new rank of a scale-up joins the new group before its READY, and the group forms only once
   every old rank was sent `reinitialize_distributed` (vLLM: the new process groups are a collective
   of all ranks, old and new).
2. An old rank's `eep_ready` key is set only once every new rank has started (the same collective).
3. `commit_prepared_elastic_ep` is refused until every rank of the new group set its `eep_ready` key.
4. RECONFIGURE_FINISHED comes only after the commit, and only from rank 0.
5. A second `reinitialize_distributed` while one is active is refused, as vLLM does.
6. A rank told SHUTDOWN_CURRENT_RANK sends one SHUTDOWN_COMPLETE, then its engine exits 0.

A real TCPStore (torch's, in this process) stands for the resize's coordination store; the engine
runs without sockets (its utility calls and busy-loop steps are driven by the test).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
from vllm.v1.engine import EEPNotificationType, EngineCoreOutputs, ReconfigureDistributedRequest, ReconfigureRankType

from corefleet_harness.emulator.config import EmulatorConfig
from corefleet_harness.emulator.engine import (
    READY_FOR_SWITCH,
    EmulatedEngineCore,
    EngineExit,
    group_join_keys,
    join_new_group,
)
from emulated import drain, roundtrip_outputs, utility

KEEP = ReconfigureRankType.KEEP_CURRENT_RANK
DEADLINE_S = 20.0


@pytest.fixture
def store() -> Iterator[Any]:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    master = TCPStore("127.0.0.1", 0, is_master=True, world_size=-1, wait_for_workers=False)
    yield master
    del master


def engine(rank: int, size: int) -> EmulatedEngineCore:
    e = EmulatedEngineCore(EmulatorConfig(rank=rank, data_parallel_size=size, is_moe=True))
    e.has_coordinator = True
    return e


def request(size: int, store_port: int) -> dict[str, Any]:
    req = ReconfigureDistributedRequest(size, KEEP, KEEP, "127.0.0.1", 0, [], store_port)
    return msgspec.to_builtins(req)  # type: ignore[no-any-return]


def outputs(e: EmulatedEngineCore) -> list[EngineCoreOutputs]:
    """The engine's outputs now, as the frontend decodes them."""
    return [roundtrip_outputs(out) for _, out in drain(e)]


def step_until(e: EmulatedEngineCore, done: Callable[[], bool], what: str) -> None:
    """Run the busy loop's elastic-EP block until `done` (vLLM spins on it while a resize is active)."""
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        e._progress_elastic_ep()
        time.sleep(0.01)


def step_for(e: EmulatedEngineCore, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        e._progress_elastic_ep()
        time.sleep(0.01)


def test_a_new_rank_cannot_join_before_every_old_rank_was_sent_reinitialize(store: Any) -> None:
    # Scale-up 2 -> 3: the new rank 2 starts; old rank 1 never got reinitialize_distributed.
    store.set(group_join_keys(3)[0], b"1")  # old rank 0 did
    with pytest.raises(RuntimeError, match=r"new group of 3 rank\(s\).*missing: corefleet-emulator/joined/1"):
        join_new_group(store, 2, 3, threading.Event(), timeout_s=0.5)
    # In the right order it joins at once.
    store.set(group_join_keys(3)[1], b"1")
    join_new_group(store, 2, 3, threading.Event(), timeout_s=5)


def test_a_stopped_engine_leaves_the_join_wait() -> None:
    class NeverFormed:
        def set(self, key: str, value: bytes) -> None: ...

        def check(self, keys: list[str]) -> bool:
            return False

    stop = threading.Event()
    stop.set()
    with pytest.raises(EngineExit):
        join_new_group(NeverFormed(), 0, 2, stop, timeout_s=60)


def test_an_old_ranks_ready_key_waits_for_the_new_ranks_and_commit_waits_for_every_key(store: Any) -> None:
    old = engine(rank=0, size=2)
    assert utility(old, "reinitialize_distributed", request(3, store.port)).result.result == "eep_ready/0"
    # Rule 5: one reconfiguration at a time.
    assert "already active" in utility(old, "reinitialize_distributed", request(3, store.port)).failure_message
    # Rule 2: the new group needs ranks 1 and 2 too; rank 0 is not ready for the switch without them.
    step_for(old, 0.5)
    assert not store.check(["eep_ready/0"])
    assert old.eep_scaling_state is not None
    assert old.eep_scaling_state.state != READY_FOR_SWITCH
    # Rule 3: a commit now is refused (this rank is not even prepared).
    assert "No prepared Elastic EP reconfiguration" in utility(old, "commit_prepared_elastic_ep").failure_message
    store.set(group_join_keys(3)[1], b"1")  # old rank 1 got its reinitialize_distributed
    store.set(group_join_keys(3)[2], b"1")  # the new rank 2 started
    step_until(old, lambda: store.check(["eep_ready/0"]), "eep_ready/0")
    step_until(old, lambda: old.eep_scaling_state is not None and old.eep_scaling_state.state == READY_FOR_SWITCH,
               "READY_FOR_SWITCH")
    # Rule 3: prepared, but ranks 1 and 2 are not ready for the switch: refused, naming them.
    refused = utility(old, "commit_prepared_elastic_ep").failure_message
    assert "eep_ready/1, eep_ready/2 not set" in refused, refused
    step_for(old, 0.2)
    assert [o for o in outputs(old) if o.utility_output is not None] == []  # Rule 4: nothing before the commit
    store.set("eep_ready/1", b"1")
    store.set("eep_ready/2", b"1")
    result = utility(old, "commit_prepared_elastic_ep")
    assert result.failure_message is None, result.failure_message
    step_until(old, lambda: old.eep_scaling_state is None, "the switch")
    # Rule 4: rank 0 sends RECONFIGURE_FINISHED once, after the commit.
    (finished,) = outputs(old)
    assert finished.utility_output is not None
    assert finished.utility_output.result.result == [EEPNotificationType.RECONFIGURE_FINISHED.value, 0]
    assert old.data_parallel_size == 3


def test_only_rank_0_sends_reconfigure_finished(store: Any) -> None:
    other = engine(rank=1, size=2)
    utility(other, "reinitialize_distributed", request(3, store.port))
    for key in group_join_keys(3):
        store.set(key, b"1")
    step_until(other, lambda: other.eep_scaling_state is not None and other.eep_scaling_state.state == READY_FOR_SWITCH,
               "READY_FOR_SWITCH")
    for rank in range(3):
        store.set(f"eep_ready/{rank}", b"1")
    assert utility(other, "commit_prepared_elastic_ep").failure_message is None
    step_until(other, lambda: other.eep_scaling_state is None, "the switch")
    assert outputs(other) == []
    assert other.notifications_sent == []


def test_a_leaving_rank_sends_one_shutdown_complete_then_exits_0(store: Any) -> None:
    # Rule 6: a rank told SHUTDOWN_CURRENT_RANK sends SHUTDOWN_COMPLETE (its rank, call id -1) and its engine exits 0.
    leaving = engine(rank=2, size=3)
    shutdown = ReconfigureDistributedRequest(2, ReconfigureRankType.SHUTDOWN_CURRENT_RANK, KEEP, "127.0.0.1", 0, [],
                                             store.port)
    assert utility(leaving, "reinitialize_distributed", msgspec.to_builtins(shutdown)).result.result == "eep_ready/2"
    with pytest.raises(EngineExit) as exited:
        step_for(leaving, 1.0)
    assert exited.value.code == 0
    (complete,) = outputs(leaving)
    assert complete.utility_output is not None
    assert complete.utility_output.call_id == -1
    assert complete.utility_output.result.result == [EEPNotificationType.SHUTDOWN_COMPLETE.value, 2]
    assert leaving.notifications_sent == [EEPNotificationType.SHUTDOWN_COMPLETE.value]
