# SPDX-License-Identifier: Apache-2.0
"""The emulator's command line: its own flags, then `--`, then a headless vLLM engine's flags.

    python -m corefleet_harness.emulator [EMULATOR FLAGS] -- MODEL --headless --data-parallel-size N
        --data-parallel-size-local 1 --data-parallel-start-rank R --data-parallel-address HOST
        --data-parallel-rpc-port P [other vLLM flags]

The vLLM part is read with a small `parse_known_args` parser that knows only the flags that change
what the engine says on the wire (DP layout, lengths, batch limits, expert-parallel switches); every
other vLLM flag is accepted and ignored, so an engine pod's argument list can be handed over as is.
No vLLM import happens here (nor anywhere in the emulator): the health server answers `/livez` while
the engine is still importing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corefleet_client import commands
from corefleet_client.argv import split_launcher_argv

logger = logging.getLogger(__name__)


DEFAULT_TOKEN_DELAY_MS = 10.0
DEFAULT_VOCAB_SIZE = 32000
DEFAULT_MAX_MODEL_LEN = 2048
# vLLM's defaults (SchedulerConfig / CacheConfig, 0.32.0) where the command line leaves them out.
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_BLOCK_SIZE = 16
DEFAULT_NUM_GPU_BLOCKS = 4096
DEFAULT_DP_RPC_PORT = 29550
DEFAULT_DP_SYNC_INTERVAL = 16

# Keys of a HF config.json that make vLLM's ModelConfig.is_moe true (num_experts > 0).
MOE_CONFIG_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")

ENV_SCALE_UP_LAUNCH = commands.ENV_SCALE_UP_LAUNCH


@dataclass
class EmulatorConfig:
    """Everything the emulated engine needs; built by `parse_args`, or directly by tests."""

    rank: int = 0
    data_parallel_size: int = 1
    handshake_address: str = f"tcp://127.0.0.1:{DEFAULT_DP_RPC_PORT}"
    data_parallel_master_ip: str = "127.0.0.1"
    model: str = "emulated-model"
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    block_size: int = DEFAULT_BLOCK_SIZE
    num_gpu_blocks: int = DEFAULT_NUM_GPU_BLOCKS
    vocab_size: int = DEFAULT_VOCAB_SIZE
    dtype: str = "bfloat16"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    is_moe: bool = False
    enable_expert_parallel: bool = False
    enable_eplb: bool = False
    eplb_config: dict[str, Any] = field(default_factory=dict)
    enable_elastic_ep: bool = False
    elastic_ep_max_dp_size: int | None = None
    dp_sync_interval: int = DEFAULT_DP_SYNC_INTERVAL
    async_scheduling: bool = True
    disable_nccl_for_dp_synchronization: bool | None = None
    log_stats: bool = True
    scale_up_launch: bool = False
    token_delay_s: float = DEFAULT_TOKEN_DELAY_MS / 1000
    parallel_config_hash: str | None = None  # None: computed from the flags (MoE only)
    health_host: str = "0.0.0.0"
    health_port: int | None = None
    coord_store_port: int | None = None  # serve the startup's coordination store (engine 0's launcher's job)
    instance_id: str = ""
    log_level: str = "INFO"

    @property
    def coordinated_dp(self) -> bool:
        """vLLM runs a `DPEngineCoreProc` (lock-step waves, elastic EP) only for MoE with DP > 1."""
        return self.is_moe and self.data_parallel_size > 1


def _vllm_parser() -> argparse.ArgumentParser:
    """The vLLM flags the emulator reads; names and short forms as in vLLM 0.32.0's EngineArgs."""
    p = argparse.ArgumentParser(prog="vllm (emulated engine)", add_help=False, allow_abbrev=False)
    p.add_argument("model_tag", nargs="?", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--headless", action="store_true")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    p.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None)
    p.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=0)
    p.add_argument("--data-parallel-rank", "-dpn", type=int, default=None)
    p.add_argument("--data-parallel-address", "-dpa", default="127.0.0.1")
    p.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=DEFAULT_DP_RPC_PORT)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1)
    p.add_argument("--enable-expert-parallel", "-ep", action="store_true")
    p.add_argument("--enable-eplb", action="store_true")
    p.add_argument("--eplb-config", default=None)
    p.add_argument("--enable-elastic-ep", action="store_true")
    p.add_argument("--elastic-ep-max-dp-size", type=int, default=None)
    p.add_argument("--dp-sync-interval", type=int, default=DEFAULT_DP_SYNC_INTERVAL)
    p.add_argument("--disable-log-stats", action="store_true")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--disable-nccl-for-dp-synchronization", action=argparse.BooleanOptionalAction, default=None)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m corefleet_harness.emulator",
        description="A wire-level vLLM 0.32.0 engine core for tests: vLLM's structs and framing, no model. "
                    "Give the headless vLLM engine's arguments after `--`.",
        allow_abbrev=False,
    )
    parser.add_argument("--token-delay-ms", type=float, default=DEFAULT_TOKEN_DELAY_MS,
                        help="time per engine step (one token for every running request)")
    parser.add_argument("--health-port", type=int, default=None,
                        help="serve /livez, /readyz and /stats on this port (off by default)")
    parser.add_argument("--health-host", default="0.0.0.0")
    parser.add_argument("--frontend-admin-port", type=int, default=None,
                        help="accepted for the launcher's sake and ignored: the emulator serves no /drain (a pre-stop "
                             "hook that calls it fails, and the pod stops at once)")
    parser.add_argument("--coord-store-port", type=int, default=None,
                        help="serve the startup's elastic-EP coordination store on --health-host at this port, "
                             "as engine rank 0's launcher does (corefleet_client.coordstore)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="overrides the vLLM flag and the model's max_position_embeddings")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="token ids are drawn below this (default: the model's config.json, else 32000)")
    parser.add_argument("--emulate-moe", action="store_true",
                        help="behave as vLLM's DPEngineCoreProc (waves, elastic EP) even if the model is dense")
    parser.add_argument("--parallel-config-hash", default=None,
                        help="READY's parallel_config_hash (MoE), if the computed one does not match the frontend's")
    parser.add_argument("--log-level", default=os.environ.get("VLLM_LOGGING_LEVEL", "INFO"))
    return parser


def split_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(emulator args, vLLM args), split at the first `--` (as every launcher does)."""
    return split_launcher_argv(argv)


def read_model_config(model: str | None) -> dict[str, Any]:
    """The model directory's config.json, or {} for a hub name or a directory without one."""
    if not model:
        return {}
    path = Path(model) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def model_is_moe(hf_config: dict[str, Any]) -> bool:
    for key in MOE_CONFIG_KEYS:
        value = hf_config.get(key)
        if isinstance(value, int) and value > 0:
            return True
    text_config = hf_config.get("text_config")
    return isinstance(text_config, dict) and model_is_moe(text_config)


def parse_args(argv: Sequence[str], environ: dict[str, str] | None = None) -> EmulatorConfig:
    """Parse the whole command line; errors exit through argparse like any CLI."""
    environ = dict(os.environ) if environ is None else environ
    parser = build_parser()
    own_argv, vllm_argv = split_args(argv)
    own = parser.parse_args(own_argv)
    vllm_args, ignored = _vllm_parser().parse_known_args(vllm_argv)
    if ignored:
        logger.debug("Ignoring vLLM arguments the emulator does not need: %s", ignored)

    if vllm_args.data_parallel_rank is not None:
        parser.error("external-LB engines (--data-parallel-rank) are not emulated; use --headless "
                     "with --data-parallel-start-rank")
    if vllm_argv and not vllm_args.headless:
        parser.error("the emulator replaces a headless engine: pass --headless after `--`")
    if vllm_args.data_parallel_size_local not in (None, 1):
        parser.error("the emulator runs exactly one engine: --data-parallel-size-local must be 1")
    if not 0 <= vllm_args.data_parallel_start_rank < vllm_args.data_parallel_size:
        parser.error(f"rank {vllm_args.data_parallel_start_rank} is outside --data-parallel-size "
                     f"{vllm_args.data_parallel_size}")
    if own.token_delay_ms < 0:
        parser.error("--token-delay-ms must be >= 0")

    model = vllm_args.model or vllm_args.model_tag or "emulated-model"
    hf_config = read_model_config(model)
    max_model_len = (own.max_model_len or vllm_args.max_model_len
                     or hf_config.get("max_position_embeddings") or DEFAULT_MAX_MODEL_LEN)
    block_size = vllm_args.block_size or DEFAULT_BLOCK_SIZE
    max_num_seqs = vllm_args.max_num_seqs or DEFAULT_MAX_NUM_SEQS
    eplb_config: dict[str, Any] = {}
    if vllm_args.eplb_config:
        try:
            eplb_config = json.loads(vllm_args.eplb_config)
        except ValueError:
            parser.error(f"--eplb-config is not JSON: {vllm_args.eplb_config!r}")
    if vllm_args.num_gpu_blocks_override:
        num_gpu_blocks = vllm_args.num_gpu_blocks_override
    else:
        # Enough blocks for every sequence at full length: the emulator never runs out of KV cache.
        num_gpu_blocks = max(DEFAULT_NUM_GPU_BLOCKS, max_num_seqs * -(-max_model_len // block_size))
    dtype = vllm_args.dtype if vllm_args.dtype not in (None, "auto") else hf_config.get("torch_dtype", "bfloat16")
    address = vllm_args.data_parallel_address
    host = f"[{address}]" if ":" in address and not address.startswith("[") else address

    return EmulatorConfig(
        rank=vllm_args.data_parallel_start_rank,
        data_parallel_size=vllm_args.data_parallel_size,
        handshake_address=f"tcp://{host}:{vllm_args.data_parallel_rpc_port}",
        data_parallel_master_ip=address,
        model=model,
        max_model_len=int(max_model_len),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=vllm_args.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len),
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        vocab_size=own.vocab_size or hf_config.get("vocab_size") or DEFAULT_VOCAB_SIZE,
        dtype=str(dtype).removeprefix("torch."),
        tensor_parallel_size=vllm_args.tensor_parallel_size,
        pipeline_parallel_size=vllm_args.pipeline_parallel_size,
        decode_context_parallel_size=vllm_args.decode_context_parallel_size,
        is_moe=own.emulate_moe or model_is_moe(hf_config),
        enable_expert_parallel=vllm_args.enable_expert_parallel,
        enable_eplb=vllm_args.enable_eplb,
        eplb_config=eplb_config,
        enable_elastic_ep=vllm_args.enable_elastic_ep,
        elastic_ep_max_dp_size=vllm_args.elastic_ep_max_dp_size,
        dp_sync_interval=vllm_args.dp_sync_interval,
        async_scheduling=vllm_args.async_scheduling is not False,
        disable_nccl_for_dp_synchronization=vllm_args.disable_nccl_for_dp_synchronization,
        log_stats=not vllm_args.disable_log_stats,
        scale_up_launch=environ.get(ENV_SCALE_UP_LAUNCH, "0") not in ("", "0"),
        token_delay_s=own.token_delay_ms / 1000,
        parallel_config_hash=own.parallel_config_hash,
        health_host=own.health_host,
        health_port=own.health_port,
        coord_store_port=own.coord_store_port,
        log_level=str(own.log_level).upper(),
    )

