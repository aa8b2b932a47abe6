# SPDX-License-Identifier: Apache-2.0
"""A wire-level vLLM 0.32.0 engine core for tests: `python -m corefleet_harness.emulator`.

It takes a headless engine's place where real vLLM cannot run on CPU (MoE elastic EP) and in
frontend benchmarks. It speaks vLLM's protocol with vLLM's own msgspec structs and serializers
(`vllm.v1.engine`, `vllm.v1.serial_utils`, `vllm.v1.engine.utils`, `vllm.v1.metrics.stats`), so a
change of those in vLLM breaks the emulator and its conformance test rather than drifting silently.
It loads no model and no torch module of its own (torch comes in with vLLM's structs; the elastic
path uses `torch.distributed.TCPStore` as a client).

What each part mirrors in vLLM 0.32.0 (`vllm/v1/engine/core.py` unless named):

* `config.parse_args`: the headless engine's flags (`EngineArgs`). Dense DP ranks run as DP=1
  (`run_engine_core` -> `reconfigure_for_independent_dp_rank`), MoE ranks as `DPEngineCoreProc`.
* `EmulatedEngineCore._run`: `EngineCoreProc.__init__`, `_perform_handshakes`, `_perform_handshake`,
  `startup_handshake`: HELLO, INIT (`EngineHandshakeMetadata`, parallel_config keys applied), READY
  (with `parallel_config_hash` for MoE) once the coordinator said READY.
* `_input_thread`: `process_input_sockets`: a DEALER per frontend input (identity = rank, 2 bytes
  little-endian), an XSUB to the coordinator (sends `\\x01`, waits for `READY`), the
  `EngineCoreReadyResponse` first on every input, ADD decoded as `EngineCoreRequest`.
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
