# SPDX-License-Identifier: Apache-2.0
"""A wire-level vLLM 0.32.0 engine core for tests: `python -m corefleet_harness.emulator`.

It takes a headless engine's place where real vLLM cannot run on CPU (MoE elastic EP) and in
frontend benchmarks. It speaks vLLM's protocol byte for byte, and starts in a fraction of a second:
it imports neither vLLM nor torch (an import-linter contract in pyproject.toml holds it to that).

What it copies from vLLM, and how drift is caught (`tests/unit/test_emulator_mirror.py`, which
imports vLLM and compares):

* `structs`: the wire types (`vllm/v1/engine/__init__.py`, `v1/engine/utils.py`, `v1/metrics/stats.py`,
  `sampling_params.py`): msgspec structs and dataclasses with vLLM's struct config, field order, types
  and defaults; the test compares each with vLLM's class field by field;
* `serial`: `MsgpackEncoder` / `MsgpackDecoder` (`v1/serial_utils.py`) for messages without tensors
  (tensors and pickles are refused loudly); the test encodes every kind of message with both and
  compares the bytes, and decodes each side's bytes with the other's decoder;
* `sockets`: `make_zmq_socket` (`utils/network_utils.py`); the test compares socket options;
* `parallel_hash`: READY's `parallel_config_hash` (`ParallelConfig.compute_hash`) from the flags; the
  test compares it, factor by factor, with vLLM's own `ParallelConfig` over a grid of flags, and
  `tests/e2e/test_emulator.py` with a whole `VllmConfig`'s;
* `store`: the one torch import, `torch.distributed.TCPStore` as the elastic-EP coordination store's
  client, made on first use: only an elastic-EP engine (startup, scale-up, resize) reaches it. Rank 0
  started with `--coord-store-port` also serves the store (`corefleet_client.coordstore`, torch's
  TCPStore master). Dense engines and MoE engines without elastic EP never import torch.

`tests/unit/test_emulator_wire.py` and `test_emulator_eep_order.py` then check the emulator's messages
and elastic-EP order against vLLM's own encoders and decoders, and the e2e tests run the real vLLM
frontend against emulated engines.

What each part mirrors in vLLM 0.32.0 (`vllm/v1/engine/core.py` unless named):

* `config.parse_args`: the headless engine's flags (`EngineArgs`). Dense DP ranks run as DP=1
  (`run_engine_core` -> `reconfigure_for_independent_dp_rank`), MoE ranks as `DPEngineCoreProc`.
* `EmulatedEngineCore._run`: `EngineCoreProc.__init__`, `_perform_handshakes`, `_perform_handshake`,
  `startup_handshake`: HELLO, INIT (`EngineHandshakeMetadata`, parallel_config keys applied), READY
  (with `parallel_config_hash` for MoE) once the coordinator said READY.
* `_input_thread`: `process_input_sockets`: a DEALER per frontend input (identity = rank, 2 bytes
  little-endian), an XSUB to the coordinator (sends `\\x01`, waits for `READY`), the
  `EngineCoreReadyResponse` first on every input, ADD decoded as `EngineCoreRequest`; an ADD with
  multimodal features or prompt embeddings answered with `FinishReason.ERROR`
  (`_handle_request_preproc_error`), a message carrying tensors logged as undecodable.
* `_output_thread`: `process_output_sockets`: a PUSH per frontend output chosen by `client_index`,
  the coordinator PUSH for index -1, `engine_index` stamped, `ENGINE_CORE_DEAD` on a fatal error.
* `run_busy_loop`, `_process_input_queue`, `_handle_client_request`: the same names in
  `EngineCoreProc`: ADD / ABORT / UTILITY / START_DP_WAVE, `_handle_shutdown` (abort in-flight).
* `scheduler.EmulatedScheduler`: `Scheduler.add_request`, `schedule`, `update_from_output`,
  `finish_requests`, `check_stop` (v1/core/sched), pause states, `finished_req_ids_dict`.
* `_maybe_publish_request_counts`: the same name in `EngineCoreProc` and `DPEngineCoreProc`.
* `_dp_after_step`, `_has_global_unfinished_reqs`, `add_request`: `DPEngineCoreProc.run_busy_loop`
  waves (`wave_complete` from rank 0, `start_wave`, START_DP_WAVE); the DP all-reduce is replaced by
  this rank's own state.
* Utility methods (`get_supported_tasks`, `reset_mm_cache`, `pause_scheduler`, `is_sleeping`, ...):
  the `EngineCore` / `EngineCoreProc` methods of the same names and signatures; other names fail
  with `Call to {name} method failed: ...` as `_invoke_utility_method` reports them.
* `reinitialize_distributed`, `commit_prepared_elastic_ep`: the `DPEngineCoreProc` methods plus
  `ElasticEPScalingState.progress` (vllm/distributed/elastic_ep/elastic_state.py): `eep_ready/{rank}`
  set in the coord store (`_mark_ready_for_switch`), `RECONFIGURE_FINISHED` from new-group rank 0
  after the commit (`_send_reconfigure_finished`), `SHUTDOWN_COMPLETE` and exit 0 for a removed rank.
* `_eep_scale_up_before_kv_init`: the same name: with `VLLM_ELASTIC_EP_SCALE_UP_LAUNCH=1` a new
  engine ignores START_DP_WAVE until resumed and sets `eep_ready/{rank}` in the store INIT names.
* `_eep_send_engine_core_notification`: the same name: `UtilityOutput(call_id=-1,
  result=UtilityResult((type, dp_rank)))` to client 0.

Left out, because the emulator has no DP process group, workers or weights: every collective
(gloo DP group and its `dp_master_port` key, weight transfer, KV-size and wave-state all-reduces,
EPLB reshuffles, `eep_async/*` worker keys); each state that only waits for one passes at once.
"""

# `python -m EMULATOR_MODULE` runs it (what a pod's command names in place of `corefleet_client.engine`).
EMULATOR_MODULE = "corefleet_harness.emulator"
