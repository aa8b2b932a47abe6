# SPDX-License-Identifier: Apache-2.0
"""`python -m corefleet_harness.emulator` processes against a stock vLLM frontend and a test-side frontend.

(a) Two emulated engines (ranks 0 and 1) behind a stock `vllm serve --data-parallel-size 2
    --data-parallel-size-local 0` (the frontend starts its own coordinator): /health, completions
    streaming and not, the emulator's tokens, both ranks used, a cancelled stream aborted on the
    rank that had it, SIGTERM -> exit 0.
(b) The elastic EP engine side, driven at the wire level as vLLM 0.32.0's `DPLBAsyncMPClient`
    drives it (`_prepare_scale_up_elastic_ep` ... `_commit_scale_down_elastic_ep`): the test binds
    the handshake ROUTER, the input ROUTER, the output PULL, plays the coordinator's engine side,
    and owns the coord stores (`torch.distributed.TCPStore` masters).

Every vLLM start imports vLLM (20-30 s each on the 2-core CI machines; an emulator starts in under a
second), so each test starts its processes together and checks as much as it can with them. Run under the heavy lock:
`flock /tmp/corefleet-heavy.lock .venv/bin/python -m pytest tests/e2e/test_emulator.py -x -q`.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from corefleet_harness.emulator.scheduler import expected_tokens
from corefleet_harness.support import free_port, http_get, tail, wait_until

pytestmark = pytest.mark.e2e

STARTUP_TIMEOUT = 420.0  # a stock frontend and two emulators importing vLLM on 2 busy cores
STEP_TIMEOUT = 30.0
EXIT_TIMEOUT = 15.0
VOCAB = 512
MAX_MODEL_LEN = 256

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 32,
    "vocab_size": VOCAB, "max_position_embeddings": MAX_MODEL_LEN, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def write_tiny_model(directory: Path, **overrides: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**TINY_LLAMA, **overrides}))
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return directory


class Proc:
    """A process in its own session, output to a log file; the group is killed by `kill()`."""

    def __init__(self, name: str, cmd: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        self._log_file = self.log.open("wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )

    def tail(self, lines: int = 40) -> str:
        return f"--- {self.name} (rc={self.proc.poll()}) ---\n" + tail(self.log, lines)

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise ProcessExited(self.tail())

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} still running {timeout}s later\n{self.tail()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._log_file.close()


class ProcessExited(AssertionError):
    pass


@contextlib.contextmanager
def processes() -> Iterator[list[Proc]]:
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()


def emulator_cmd(model: Path, rank: int, dp_size: int, rpc_port: int, health_port: int, *extra: str,
                 vllm_extra: tuple[str, ...] = ()) -> list[str]:
    return [
        sys.executable, "-m", "corefleet_harness.emulator",
        "--token-delay-ms", "20", "--health-host", "127.0.0.1", "--health-port", str(health_port), *extra,
        "--", str(model), "--headless",
        "--data-parallel-size", str(dp_size), "--data-parallel-size-local", "1",
        "--data-parallel-start-rank", str(rank), "--data-parallel-address", "127.0.0.1",
        "--data-parallel-rpc-port", str(rpc_port),
        "--max-model-len", str(MAX_MODEL_LEN), "--load-format", "dummy", "--enforce-eager", *vllm_extra,
    ]


def stats(port: int) -> dict[str, Any]:
    code, body = http_get(f"http://127.0.0.1:{port}/stats")
    assert code == 200, body
    result: dict[str, Any] = json.loads(body)
    return result


def post_json(port: int, path: str, body: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        result: dict[str, Any] = json.loads(r.read())
        return result


def stream_completion(port: int, body: dict[str, Any], stop_after: int | None = None) -> list[dict[str, Any]]:
    """The SSE chunks of a streaming completion; with `stop_after`, hang up after that many chunks."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        chunks: list[dict[str, Any]] = []
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunks.append(json.loads(line.removeprefix("data: ")))
            if stop_after is not None and len(chunks) >= stop_after:
                break
        return chunks
    finally:
        conn.close()  # with stop_after: the client goes away mid-stream


def test_stock_frontend_serves_two_emulated_engines(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny-llama")
    http_port, rpc_port = free_port(), free_port()
    health = [free_port(), free_port()]
    with processes() as procs:
        procs.append(Proc("frontend", [
            sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
            "--data-parallel-size", "2", "--data-parallel-size-local", "0",
            "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port),
            "--skip-tokenizer-init", "--load-format", "dummy", "--dtype", "bfloat16",
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8", "--enforce-eager",
            "--host", "127.0.0.1", "--port", str(http_port),
        ], tmp_path))
        for rank in (0, 1):
            procs.append(Proc(f"emulator-{rank}", emulator_cmd(model, rank, 2, rpc_port, health[rank]), tmp_path))

        def all_alive() -> None:
            for p in procs:
                p.check_alive()

        def healthy() -> bool:
            all_alive()
            return http_get(f"http://127.0.0.1:{http_port}/health")[0] == 200

        try:
            wait_until(healthy, STARTUP_TIMEOUT, "stock frontend /health with two emulated engines",
                       interval=1.0, retry_on=(Exception,), fatal=(ProcessExited,))
        except TimeoutError as e:
            pytest.fail(f"{e}\n" + "\n".join(p.tail() for p in procs))
        for rank in (0, 1):
            assert http_get(f"http://127.0.0.1:{health[rank]}/livez")[0] == 200
            assert http_get(f"http://127.0.0.1:{health[rank]}/readyz")[0] == 200
            assert stats(health[rank])["ready_after_s"] is not None
            # The frontend's startup utility calls reached every engine (DPLB fans them out).
            assert {"get_supported_tasks", "reset_mm_cache"} <= set(stats(health[rank])["utility_calls"])

        # Non-streaming: the emulator's deterministic tokens, finished by length.
        prompt = [5, 6, 7]
        result = post_json(http_port, "/v1/completions",
                           {"model": str(model), "prompt": prompt, "max_tokens": 5, "return_token_ids": True})
        choice = result["choices"][0]
        assert choice["token_ids"] == expected_tokens(prompt, 5, VOCAB), result
        assert choice["finish_reason"] == "length"
        assert result["usage"]["completion_tokens"] == 5

        # Concurrent requests spread over both ranks (DPLB least-loaded routing).
        results: list[dict[str, Any]] = []
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                results.append(post_json(http_port, "/v1/completions", {
                    "model": str(model), "prompt": [10 + i, 11], "max_tokens": 8, "return_token_ids": True}))
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=STEP_TIMEOUT)
        assert not errors, errors
        assert len(results) == 6
        for r in results:
            assert len(r["choices"][0]["token_ids"]) == 8
        per_rank = [stats(health[rank]) for rank in (0, 1)]
        assert all(s["requests_added"] >= 1 for s in per_rank), per_rank
        assert sum(s["requests_added"] for s in per_rank) == 7
        assert sum(s["requests_finished"] for s in per_rank) == 7

        # Streaming: one token per chunk, the same tokens.
        chunks = stream_completion(http_port, {"model": str(model), "prompt": prompt, "max_tokens": 6,
                                               "return_token_ids": True})
        streamed = [t for c in chunks for choice in c["choices"] for t in (choice.get("token_ids") or [])]
        assert streamed == expected_tokens(prompt, 6, VOCAB), chunks
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"

        # A stream the client abandons is aborted on the rank that ran it (ABORT -> finished set).
        before = [stats(health[rank]) for rank in (0, 1)]
        chunks = stream_completion(http_port, {"model": str(model), "prompt": [42], "max_tokens": 200},
                                   stop_after=2)
        assert len(chunks) == 2

        def aborted() -> bool:
            now = [stats(health[rank]) for rank in (0, 1)]
            aborted_now: int = sum(s["requests_aborted"] for s in now)
            aborted_before: int = sum(s["requests_aborted"] for s in before)
            return aborted_now > aborted_before

        wait_until(aborted, STEP_TIMEOUT, "an ABORT at the emulated engine that ran the cancelled stream",
                   interval=0.1, retry_on=(Exception,))
        after = [stats(health[rank]) for rank in (0, 1)]
        rank = next(r for r in (0, 1) if after[r]["requests_aborted"] > before[r]["requests_aborted"])
        (aborted_id,) = set(after[rank]["aborted_ids"]) - set(before[rank]["aborted_ids"])
        assert aborted_id in after[rank]["added_ids"]
        assert aborted_id not in after[1 - rank]["added_ids"]
        assert after[rank]["running"] == 0
        assert after[rank]["tokens_generated"] - before[rank]["tokens_generated"] < 200

        # The frontend stays usable; then SIGTERM stops an emulator promptly with exit 0.
        again = post_json(http_port, "/v1/completions",
                          {"model": str(model), "prompt": prompt, "max_tokens": 2, "return_token_ids": True})
        assert again["choices"][0]["token_ids"] == expected_tokens(prompt, 2, VOCAB)
        emulator = procs[1]
        started = time.monotonic()
        emulator.proc.send_signal(signal.SIGTERM)
        assert emulator.wait_exit(EXIT_TIMEOUT) == 0, emulator.tail()
        assert time.monotonic() - started < 5.0
        assert "Traceback" not in emulator.log.read_text(), emulator.tail()


# ---- (b) elastic EP, engine side ------------------------------------------------------------------


class FakeFrontend:
    """The sockets vLLM's rank-0 frontend and the DP coordinator offer engines, bound by the test."""

    def __init__(self, ctx: zmq.SyncContext, rpc_port: int) -> None:
        from vllm.v1.engine import EngineCoreOutputs
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        self.ctx = ctx
        self.rpc_port = rpc_port
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(EngineCoreOutputs)
        self.input = self._bind(zmq.ROUTER)
        self.output = self._bind(zmq.PULL)
        self.coord_publish = self._bind(zmq.XPUB)
        self.coord_publish.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.coord_output = self._bind(zmq.PULL)
        self.registrations: dict[int, dict[str, Any]] = {}
        self.outputs: list[Any] = []  # every EngineCoreOutputs received, in order
        self.coordinator_messages: list[Any] = []

    def _bind(self, kind: int) -> zmq.SyncSocket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind("tcp://127.0.0.1:0")
        return sock

    def endpoint(self, sock: zmq.SyncSocket) -> str:
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def addresses(self) -> Any:
        from vllm.v1.engine.utils import EngineZmqAddresses

        return EngineZmqAddresses(
            inputs=[self.endpoint(self.input)], outputs=[self.endpoint(self.output)],
            coordinator_input=self.endpoint(self.coord_publish), coordinator_output=self.endpoint(self.coord_output))

    def handshake(self, ranks: set[int], parallel_config: dict[str, Any], procs: list[Proc]) -> dict[int, Any]:
        """`wait_for_engine_startup` + the coordinator's engine gate; returns each rank's READY message."""
        from vllm.v1.engine.utils import EngineHandshakeMetadata

        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(f"tcp://127.0.0.1:{self.rpc_port}")
        ready: dict[int, Any] = {}
        subscribed = 0
        deadline = time.monotonic() + STARTUP_TIMEOUT
        try:
            poller = zmq.Poller()
            poller.register(router, zmq.POLLIN)
            poller.register(self.coord_publish, zmq.POLLIN)
            while set(ready) != ranks:
                for p in procs:
                    p.check_alive()
                assert time.monotonic() < deadline, f"handshake incomplete: READY from {sorted(ready)}"
                for sock, _ in poller.poll(timeout=500):
                    if sock is self.coord_publish:
                        if self.coord_publish.recv() == b"\x01":
                            subscribed += 1
                            if subscribed >= len(ranks):
                                self.coord_publish.send(b"READY")
                        continue
                    identity, payload = router.recv_multipart()
                    rank = int.from_bytes(identity, "little")
                    assert rank in ranks, rank
                    msg = msgspec.msgpack.decode(payload)
                    assert (msg["local"], msg["headless"]) == (False, True), msg
                    if msg["status"] == "HELLO":
                        init = EngineHandshakeMetadata(addresses=self.addresses(), parallel_config=parallel_config)
                        router.send_multipart((identity, msgspec.msgpack.encode(init)))
                    else:
                        assert msg["status"] == "READY", msg
                        ready[rank] = msg
        finally:
            router.close(linger=0)
        return ready

    def read_registrations(self, ranks: set[int]) -> None:
        """`MPClient`'s wait for each engine's `EngineCoreReadyResponse` on the input ROUTER."""
        from vllm.v1.engine import EngineCoreReadyResponse

        while not ranks <= set(self.registrations):
            assert self.input.poll(timeout=int(STEP_TIMEOUT * 1000)), f"registrations: {sorted(self.registrations)}"
            identity, payload = self.input.recv_multipart()
            response = msgspec.msgpack.decode(payload, type=EngineCoreReadyResponse)
            self.registrations[int.from_bytes(identity, "little")] = msgspec.to_builtins(response)

    def call_utility(self, rank: int, method: str, *args: Any) -> int:
        """`_call_utility_async`: (client_index, call_id, method, args) on the UTILITY frame type."""
        from vllm.v1.engine import EngineCoreRequestType

        call_id = uuid.uuid1().int >> 64
        frames = self.encoder.encode((0, call_id, method, args))
        self.input.send_multipart((rank.to_bytes(2, "little"), EngineCoreRequestType.UTILITY.value, *frames))
        return call_id

    def wait_output(self, match: Callable[[Any], bool], what: str) -> Any:
        for out in self.outputs:
            if match(out):
                return out
        deadline = time.monotonic() + STEP_TIMEOUT
        while (left := deadline - time.monotonic()) > 0:
            if self.output.poll(timeout=int(left * 1000)):
                out = self.decoder.decode(self.output.recv_multipart())
                self.outputs.append(out)
                if match(out):
                    return out
        pytest.fail(f"no {what} within {STEP_TIMEOUT}s; outputs: {self.outputs}")

    def utility_result(self, call_id: int) -> Any:
        out = self.wait_output(lambda o: o.utility_output is not None and o.utility_output.call_id == call_id,
                               f"utility answer {call_id}")
        assert out.utility_output.failure_message is None, out.utility_output.failure_message
        return out.utility_output.result.result

    def notification(self, kind: str, rank: int) -> Any:
        from vllm.v1.engine import EEP_NOTIFICATION_CALL_ID

        def match(o: Any) -> bool:
            u = o.utility_output
            return u is not None and u.call_id == EEP_NOTIFICATION_CALL_ID and list(u.result.result) == [kind, rank]

        return self.wait_output(match, f"EEP notification {kind} from rank {rank}")

    def drain_coordinator(self) -> None:
        while self.coord_output.poll(timeout=0):
            self.coordinator_messages.append(self.decoder.decode(self.coord_output.recv_multipart()))


def new_coord_store() -> Any:
    """`_setup_elastic_ep_reconfig_bootstrap`'s store: a TCPStore master on an open port."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # an implicit re-export (from torch._C)

    return TCPStore("127.0.0.1", 0, is_master=True, world_size=-1, wait_for_workers=False)


def reconfig_request(size: int, rank_type: int, store_port: int) -> Any:
    """`DPLBAsyncMPClient._make_reconfig_request`."""
    from vllm.v1.engine import ReconfigureDistributedRequest, ReconfigureRankType

    ports = [free_port() for _ in range(5)]
    return ReconfigureDistributedRequest(
        new_data_parallel_size=size, new_data_parallel_rank=rank_type,
        new_data_parallel_rank_local=ReconfigureRankType.KEEP_CURRENT_RANK,
        new_data_parallel_master_ip="127.0.0.1", new_data_parallel_master_port=ports.pop(),
        new_data_parallel_master_port_list=ports, coord_store_port=store_port)


def test_elastic_ep_engine_side_scale_up_then_down(tmp_path: Path) -> None:
    from datetime import timedelta

    from vllm.v1.engine import ReconfigureRankType

    keep, shutdown = ReconfigureRankType.KEEP_CURRENT_RANK, ReconfigureRankType.SHUTDOWN_CURRENT_RANK
    model = write_tiny_model(tmp_path / "tiny-mixtral", architectures=["MixtralForCausalLM"], model_type="mixtral",
                             num_local_experts=4, num_experts_per_tok=2)
    rpc_port = free_port()
    health = [free_port() for _ in range(3)]
    moe_flags = ("--enable-expert-parallel", "--enable-eplb", "--enable-elastic-ep", "--elastic-ep-max-dp-size", "4",
                 "--eplb-config", '{"use_async": false}')
    ctx: zmq.SyncContext = zmq.Context()
    startup_store_port = free_port()
    try:
        with processes() as procs:
            front = FakeFrontend(ctx, rpc_port)
            for rank in (0, 1):
                # Rank 0 serves the startup's coordination store, as engine 0's launcher does in a pod.
                store_flag = ("--coord-store-port", str(startup_store_port)) if rank == 0 else ()
                procs.append(Proc(f"emulator-{rank}", emulator_cmd(model, rank, 2, rpc_port, health[rank], *store_flag,
                                                                   vllm_extra=moe_flags), tmp_path))
            # 1. Startup, as corefleet's frontend advertises it for elastic EP: engine 0 is the DP master and
            #    the store is beside it; both engines open the store and form their DP group through it.
            ready = front.handshake({0, 1}, {
                "data_parallel_master_ip": "127.0.0.1", "data_parallel_master_port": free_port(),
                "_data_parallel_master_port_list": [], "_coord_store_port": startup_store_port,
                "data_parallel_size": 2}, procs)
            hashes = {msg["parallel_config_hash"] for msg in ready.values()}
            assert len(hashes) == 1, ready
            assert all(isinstance(h, str) and h for h in hashes), ready
            front.read_registrations({0, 1})
            for rank in (0, 1):
                reg = front.registrations[rank]
                assert (reg["data_parallel_rank"], reg["data_parallel_size"]) == (rank, 2), reg
                assert http_get(f"http://127.0.0.1:{health[rank]}/readyz")[0] == 200

            # 2. Scale up 2 -> 3 (_prepare_scale_up_elastic_ep): a new store, KEEP to the existing ranks ...
            store = new_coord_store()
            calls = {rank: front.call_utility(rank, "reinitialize_distributed",
                                              reconfig_request(3, keep, store.port)) for rank in (0, 1)}
            assert {rank: front.utility_result(c) for rank, c in calls.items()} == {0: "eep_ready/0", 1: "eep_ready/1"}
            # ... and the new rank, started by the operator with the scale-up env and the new size.
            procs.append(Proc("emulator-2", emulator_cmd(model, 2, 3, rpc_port, health[2], vllm_extra=moe_flags),
                              tmp_path, env={"VLLM_ELASTIC_EP_SCALE_UP_LAUNCH": "1"}))
            new_ready = front.handshake({2}, {
                "data_parallel_master_ip": "127.0.0.1", "data_parallel_master_port": free_port(),
                "_data_parallel_master_port_list": [], "_coord_store_port": store.port,
                "data_parallel_size": 3}, procs)
            assert new_ready[2]["parallel_config_hash"] != ready[0]["parallel_config_hash"]  # the DP size is hashed
            store.wait(["eep_ready/0", "eep_ready/1", "eep_ready/2"], timedelta(seconds=STEP_TIMEOUT))
            assert store.get("eep_ready/2") == b"1"

            # Commit (_commit_scale_up_elastic_ep): pause, commit, RECONFIGURE_FINISHED from rank 0 only.
            for rank in (0, 1):
                assert front.utility_result(front.call_utility(rank, "pause_scheduler", "keep", False)) is None
            for rank in (0, 1):
                assert front.utility_result(front.call_utility(rank, "commit_prepared_elastic_ep")) is None
            front.notification("RECONFIGURE_FINISHED", 0)
            front.read_registrations({2})  # _wait_for_new_engine_ready
            assert front.registrations[2]["data_parallel_rank"] == 2
            for rank in (0, 1, 2):
                assert front.utility_result(front.call_utility(rank, "resume_scheduler")) is None
            # A survivor switches in its busy loop's next elastic-EP step after the commit (as vLLM's does): a
            # resume that reached it in the same input drain is answered first, so its new size shows moments later.
            wait_until(lambda: [stats(health[r])["data_parallel_size"] for r in (0, 1, 2)] == [3, 3, 3], STEP_TIMEOUT,
                       "every rank at the new size", interval=0.01)
            # A commit without a prepared reconfiguration fails as in vLLM.
            bad = front.call_utility(0, "commit_prepared_elastic_ep")
            failed = front.wait_output(lambda o: o.utility_output is not None and o.utility_output.call_id == bad,
                                       "the failed commit")
            assert failed.utility_output.failure_message == (
                "Call to commit_prepared_elastic_ep method failed: No prepared Elastic EP reconfiguration is ready")

            # 3. Scale down 3 -> 1 (_prepare/_commit_scale_down_elastic_ep).
            store = new_coord_store()
            prepare = front.call_utility(0, "reinitialize_distributed", reconfig_request(1, keep, store.port))
            assert front.utility_result(prepare) == "eep_ready/0"
            store.wait(["eep_ready/0"], timedelta(seconds=STEP_TIMEOUT))
            assert front.utility_result(front.call_utility(0, "pause_scheduler", "keep", False)) is None
            for rank in (1, 2):
                assert front.utility_result(front.call_utility(rank, "pause_scheduler", "abort", False)) is None
            assert front.utility_result(front.call_utility(0, "commit_prepared_elastic_ep")) is None
            for rank in (1, 2):
                result = front.utility_result(front.call_utility(
                    rank, "reinitialize_distributed", reconfig_request(1, shutdown, store.port)))
                assert result == f"eep_ready/{rank}"
            for rank in (1, 2):
                front.notification("SHUTDOWN_COMPLETE", rank)
                assert procs[rank].wait_exit(EXIT_TIMEOUT) == 0, procs[rank].tail()
                assert "Traceback" not in procs[rank].log.read_text(), procs[rank].tail()
            front.notification("RECONFIGURE_FINISHED", 0)
            assert not store.check(["eep_ready/1"]), "a removed rank must not report ready"
            assert front.utility_result(front.call_utility(0, "resume_scheduler")) is None
            assert stats(health[0])["data_parallel_size"] == 1
            # Rank 0 sent exactly two RECONFIGURE_FINISHED (one per operation), and no other rank sent one.
            finished = [o for o in front.outputs if o.utility_output is not None and o.utility_output.call_id == -1
                        and o.utility_output.result.result[0] == "RECONFIGURE_FINISHED"]
            assert [o.engine_index for o in finished] == [0, 0]

            # 4. The survivor still serves the wire protocol after the resize, and exits 0 on SIGTERM.
            assert front.utility_result(front.call_utility(0, "get_supported_tasks")) == ["generate"]
            procs[0].proc.send_signal(signal.SIGTERM)
            assert procs[0].wait_exit(EXIT_TIMEOUT) == 0, procs[0].tail()
    finally:
        ctx.destroy(linger=0)
    for rank in (0, 1):
        assert "DP group formed through the coordination store" in procs[rank].log.read_text(), procs[rank].tail()


def test_an_elastic_engine_without_a_coordination_store_fails_at_startup(tmp_path: Path) -> None:
    """vLLM's elastic-EP engine opens the store at startup; INIT without one (what vLLM's multiprocess
    launch sends, and corefleet sent before issue 11) fails the engine with a message, before READY."""
    model = write_tiny_model(tmp_path / "tiny-mixtral", architectures=["MixtralForCausalLM"], model_type="mixtral",
                             num_local_experts=4, num_experts_per_tok=2)
    rpc_port = free_port()
    moe_flags = ("--enable-expert-parallel", "--enable-eplb", "--enable-elastic-ep", "--elastic-ep-max-dp-size", "2")
    ctx: zmq.SyncContext = zmq.Context()
    try:
        with processes() as procs:
            front = FakeFrontend(ctx, rpc_port)
            procs.append(Proc("emulator-1", emulator_cmd(model, 1, 2, rpc_port, free_port(), vllm_extra=moe_flags),
                              tmp_path))
            with pytest.raises(ProcessExited):
                front.handshake({1}, {
                    "data_parallel_master_ip": "127.0.0.1", "data_parallel_master_port": free_port(),
                    "_data_parallel_master_port_list": [], "_coord_store_port": 0, "data_parallel_size": 2}, procs)
            assert procs[0].wait_exit(EXIT_TIMEOUT) == 1, procs[0].tail()
            assert "elastic EP needs the fleet's coordination store at startup" in procs[0].log.read_text(), \
                procs[0].tail()
    finally:
        ctx.destroy(linger=0)


def test_parallel_config_hash_matches_a_real_engines(tmp_path: Path) -> None:
    """READY's hash equals `parallel_config.compute_hash()` of the VllmConfig vLLM builds from the same
    flags (the frontend compares the two for MoE fleets). In-process: no engine is started."""
    from vllm.engine.arg_utils import EngineArgs

    from corefleet_harness.emulator.config import parse_args
    from corefleet_harness.emulator.wire import compute_parallel_config_hash

    model = write_tiny_model(tmp_path / "tiny-mixtral", architectures=["MixtralForCausalLM"], model_type="mixtral",
                             num_local_experts=4, num_experts_per_tok=2)
    cases: list[tuple[tuple[str, ...], dict[str, Any]]] = [
        ((), {}),
        (("--enable-expert-parallel", "--dp-sync-interval", "8"), {"enable_expert_parallel": True,
                                                                    "dp_sync_interval": 8}),
        (("--no-async-scheduling",), {"async_scheduling": False}),
    ]
    for flags, kwargs in cases:
        engine_args = EngineArgs(model=str(model), data_parallel_size=2, data_parallel_size_local=0,
                                 data_parallel_address="127.0.0.1", load_format="dummy", max_model_len=MAX_MODEL_LEN,
                                 enforce_eager=True, skip_tokenizer_init=True, **kwargs)
        want = engine_args.create_engine_config().parallel_config.compute_hash()
        cfg = parse_args(["--", str(model), "--headless", "-dp", "2", "-dpl", "1", "-dpr", "1", *flags], environ={})
        assert compute_parallel_config_hash(cfg) == want, flags
