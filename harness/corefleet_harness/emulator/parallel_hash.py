# SPDX-License-Identifier: Apache-2.0
"""READY's `parallel_config_hash` for a MoE engine, computed as vLLM 0.32.0 computes it, without vLLM.

A real engine hashes its `ParallelConfig` (`vllm/config/parallel.py::ParallelConfig.compute_hash`): the
SHA-256 of the JSON of every dataclass field except the launch/topology ones it ignores, normalized by
`vllm/config/utils.py::normalize_value` (nested configs as `[fully qualified class name, [[field,
value], ...]]` sorted by field name), keys sorted. The frontend compares it with its own for MoE fleets.

The emulator builds those factors from the flags it parses: vLLM 0.32.0's defaults for the fields no
flag sets (`DEFAULT_FACTORS`), then the DP/TP/PP/DCP sizes, expert parallel, EPLB and its config,
elastic EP, `dp_sync_interval`, `is_moe_model`, with what `ParallelConfig.__post_init__` and
`VllmConfig.__post_init__` derive from them on a GPU (world size, elastic-EP maximum size, the EPLB
communicator, the DCP defaults, batch-sharded sampling off, NCCL-free DP sync with async scheduling).
It matches the frontend's hash as long as no other hashed field was set on the command line or changed
by a model's `verify_and_update_config`; otherwise pass `--parallel-config-hash`.

`tests/unit/test_emulator_mirror.py` compares this hash with the one vLLM's own `ParallelConfig` gives
for a grid of flags, and its factor names with vLLM's, so a new or changed field in the pinned vLLM
fails a unit test; `tests/e2e/test_emulator.py` compares it with a whole `VllmConfig`'s.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from typing import Any

from corefleet_harness.emulator.config import EmulatorConfig

logger = logging.getLogger(__name__)

EPLB_CONFIG_FQN = "vllm.config.parallel.EPLBConfig"
FAULT_TOLERANCE_CONFIG_FQN = "vllm.config.fault_tolerance.FaultToleranceConfig"

# EPLBConfig's fields and defaults, and the values its validators accept.
EPLB_DEFAULTS: dict[str, Any] = {
    "window_size": 1000,
    "step_interval": 3000,
    "num_redundant_experts": 0,
    "log_balancedness": False,
    "log_balancedness_interval": 1,
    "use_async": True,
    "policy": "default",
    "communicator": None,
    "enable_migration_batching": False,
}
EPLB_POSITIVE = ("window_size", "step_interval", "log_balancedness_interval")  # Field(gt=0)
EPLB_POLICIES = ("default",)
EPLB_COMMUNICATORS = ("torch_nccl", "torch_gloo", "torch_xccl", "nixl", "pynccl")

# Every hashed ParallelConfig factor no emulator flag sets, at vLLM 0.32.0's default (after VllmConfig's
# post-init for the DCP defaults and batch-sharded sampling).
DEFAULT_FACTORS: dict[str, Any] = {
    "_allow_auto_resolve_cp_interleave_size": True,
    "all2all_backend": "allgather_reducescatter",
    "cp_kv_cache_interleave_size": 1,
    "cpu_distributed_timeout_seconds": None,
    "dbo_decode_token_threshold": 32,
    "dbo_prefill_token_threshold": 512,
    "dcp_comm_backend": "ag_rs",
    "dcp_kv_cache_interleave_size": 1,
    "dcp_q_replicate": False,
    "distributed_timeout_seconds": None,
    "enable_batch_sharded_sampling": False,
    "enable_dbo": False,
    "enable_ep_weight_filter": False,
    "enable_fault_tolerance": False,
    "enable_hc_sp": False,
    "expert_placement_strategy": "linear",
    "fault_tolerance_config": [FAULT_TOLERANCE_CONFIG_FQN, [["engine_recovery_timeout_sec", 120]]],
    "prefill_context_parallel_size": 1,
    "ubatch_size": 0,
}


def nixl_available() -> bool:
    """`vllm.distributed.nixl_utils.is_nixl_available` on CUDA: is the `nixl` package installed?"""
    return importlib.util.find_spec("nixl") is not None


def eplb_config(given: dict[str, Any]) -> dict[str, Any]:
    """`EPLBConfig(**given)`'s fields: unknown keys and values its validators refuse raise ValueError."""
    unknown = sorted(set(given) - set(EPLB_DEFAULTS))
    if unknown:
        raise ValueError(f"EPLBConfig has no field(s) {', '.join(unknown)}")
    config = {**EPLB_DEFAULTS, **given}
    for name, default in EPLB_DEFAULTS.items():
        value = config[name]
        if isinstance(default, bool) and not isinstance(value, bool):
            raise ValueError(f"EPLBConfig.{name} must be a boolean, got {value!r}")
        if isinstance(default, int) and not isinstance(default, bool) and (
                isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"EPLBConfig.{name} must be an integer, got {value!r}")
    for name in EPLB_POSITIVE:
        if config[name] <= 0:
            raise ValueError(f"EPLBConfig.{name} must be greater than 0, got {config[name]}")
    if config["num_redundant_experts"] < 0:
        raise ValueError("EPLBConfig.num_redundant_experts must be >= 0")
    if config["policy"] not in EPLB_POLICIES:
        raise ValueError(f"EPLBConfig.policy must be one of {EPLB_POLICIES}, got {config['policy']!r}")
    if config["communicator"] not in (None, *EPLB_COMMUNICATORS):
        raise ValueError(f"EPLBConfig.communicator must be one of {EPLB_COMMUNICATORS}, "
                         f"got {config['communicator']!r}")
    if config["use_async"] and config["communicator"] in ("torch_nccl", "pynccl"):
        raise ValueError(f"{config['communicator']} communicator is incompatible with async EPLB")
    return config


def refusal(cfg: EmulatorConfig) -> str | None:
    """Why vLLM refuses to build this ParallelConfig even with EPLB off (its field and model validators), or None."""
    for name in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size",
                 "decode_context_parallel_size", "dp_sync_interval"):
        if getattr(cfg, name) < 1:
            return f"{name} must be >= 1"
    if cfg.elastic_ep_max_dp_size is not None and cfg.elastic_ep_max_dp_size < 1:
        return "elastic_ep_max_dp_size must be >= 1"
    if cfg.tensor_parallel_size % cfg.decode_context_parallel_size:
        return f"tp_size={cfg.tensor_parallel_size} must be divisible by dcp_size={cfg.decode_context_parallel_size}."
    return None


def parallel_config_factors(cfg: EmulatorConfig, *, nixl: bool) -> dict[str, Any]:
    """The hashed factors of the ParallelConfig a GPU engine builds from these flags (`nixl`: is NIXL installed)."""
    eplb = eplb_config(cfg.eplb_config)
    if cfg.enable_eplb and eplb["communicator"] is None:  # ParallelConfig.__post_init__
        eplb["communicator"] = "nixl" if nixl else ("pynccl" if cfg.enable_elastic_ep else "torch_gloo")
    max_dp_size = cfg.elastic_ep_max_dp_size
    disable_nccl = cfg.disable_nccl_for_dp_synchronization
    return {
        **DEFAULT_FACTORS,
        "data_parallel_size": cfg.data_parallel_size,
        "decode_context_parallel_size": cfg.decode_context_parallel_size,
        # VllmConfig.__post_init__: True with async scheduling, vLLM's default.
        "disable_nccl_for_dp_synchronization": cfg.async_scheduling if disable_nccl is None else disable_nccl,
        "dp_sync_interval": cfg.dp_sync_interval,
        "elastic_ep_max_dp_size": max_dp_size if cfg.enable_elastic_ep and max_dp_size is not None
        else cfg.data_parallel_size,
        "enable_elastic_ep": cfg.enable_elastic_ep,
        "enable_eplb": cfg.enable_eplb,
        "enable_expert_parallel": cfg.enable_expert_parallel,
        "eplb_config": [EPLB_CONFIG_FQN, [[name, eplb[name]] for name in sorted(eplb)]],
        "is_moe_model": cfg.is_moe,
        "pipeline_parallel_size": cfg.pipeline_parallel_size,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "world_size": cfg.pipeline_parallel_size * cfg.tensor_parallel_size * DEFAULT_FACTORS[
            "prefill_context_parallel_size"],
    }


def hash_factors(factors: dict[str, Any]) -> str:
    """`vllm.config.utils.hash_factors`."""
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()


def compute_parallel_config_hash(cfg: EmulatorConfig) -> str | None:
    """READY's `parallel_config_hash`: `--parallel-config-hash` if given; None for dense engines (their READY
    carries none) and, with a warning, when vLLM would refuse the config; ValueError for an EPLB config that
    vLLM's `EPLBConfig` refuses (as the engine fails to start there)."""
    if cfg.parallel_config_hash is not None:
        return cfg.parallel_config_hash
    if not cfg.coordinated_dp:
        return None
    eplb_config(cfg.eplb_config)  # vLLM builds the EPLBConfig first: its refusal fails the engine
    refused = refusal(cfg)
    if refused is not None:
        logger.warning("vLLM would refuse this ParallelConfig (%s); READY carries no parallel_config_hash. "
                       "Pass --parallel-config-hash if the frontend checks it.", refused)
        return None
    return hash_factors(parallel_config_factors(cfg, nixl=nixl_available()))
