# SPDX-License-Identifier: Apache-2.0
"""Local mode's names, defaults and errors, and the options of `corefleet up`."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from corefleet_client import commands
from corefleet_harness.emulator import EMULATOR_MODULE

LOCALHOST = "127.0.0.1"
MAX_FRONTENDS = 8


def frontend_host(index: int) -> str:
    """Where local frontend `index` binds its engine sockets and admin API: a loopback address of its own (Linux
    routes all of 127.0.0.0/8 to lo), so that every frontend uses the fleet's same fixed ports, as each frontend pod
    does on its own IP. Their OpenAI API shares one port on 127.0.0.1 (`SO_REUSEPORT`)."""
    return f"127.0.0.{1 + index}"
STATE_FILE = "fleet.json"
TOKEN_FILE = "admin-token"
LOG_DIR = "logs"
MODEL_DIR = "models"
FLEET_LOCK = "scale.lock"
STATE_VERSION = 1

ROLE_COORDINATOR = "coordinator"
ROLE_FRONTEND = "frontend"
ROLE_ENGINE = "engine"
# A detached fleet's supervisor (`corefleet up --detach`): it replaces a lost frontend or coordinator in place.
ROLE_SUPERVISOR = "supervisor"

ENGINE_VLLM = "vllm"
ENGINE_EMULATOR = "emulator"
ENGINE_KINDS = (ENGINE_VLLM, ENGINE_EMULATOR)
ENGINE_MODULES = {ENGINE_VLLM: commands.ENGINE_MODULE, ENGINE_EMULATOR: EMULATOR_MODULE}
LAUNCHER_ARGS_END = commands.LAUNCHER_ARGS_END  # where `corefleet up`'s own flags end and vLLM's begin

DEFAULT_PORT = 8000
DEFAULT_REPLICAS = 2
TINY_MODEL_NAME = "tiny-llama"
TINY_MOE_MODEL_NAME = "tiny-mixtral"
# Startup budgets: on a 2-core machine one real vLLM engine takes 20-45 s, and they start together.
DEFAULT_READY_TIMEOUT = {ENGINE_VLLM: 420.0, ENGINE_EMULATOR: 180.0}
STOP_GRACE_SECONDS = 20.0  # SIGTERM stops a vLLM engine's process tree in ~6-8 s
POLL_SECONDS = 0.5


class LocalFleetError(Exception):
    """A local fleet could not be started, found or stopped; the message says why and what to do."""


class Interrupted(LocalFleetError):
    """A stop signal arrived while the fleet was starting."""


def default_state_dir() -> Path:
    """`$XDG_RUNTIME_DIR/corefleet`, else `~/.cache/corefleet/local`."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "corefleet"
    return Path.home() / ".cache" / "corefleet" / "local"


@dataclass(frozen=True)
class FleetOptions:
    replicas: int = DEFAULT_REPLICAS
    engine: str = ENGINE_VLLM
    model: str | None = None  # None: the tiny model, written into the state directory
    port: int = DEFAULT_PORT
    state_dir: Path = field(default_factory=default_state_dir)
    vllm_flags: tuple[str, ...] | None = None  # None: VLLM_CPU_FLAGS (plus a served name for the tiny model)
    moe: bool = False  # the tiny model's Mixtral variant (ignored with `model`)
    token_delay_ms: int | None = None  # the emulator's per-token delay
    ready_timeout: float | None = None
    python: str = sys.executable
    # Elastic EP for a MoE model (the largest size it may grow to): engine 0 serves the coordination stores
    # and `corefleet scale` resizes through vLLM's elastic-EP protocol. vLLM runs EPLB only on GPUs.
    elastic_ep_max: int | None = None
    gpus_per_rank: int = 0  # > 0: each engine rank sees its own GPUs (CUDA_VISIBLE_DEVICES)
    frontends: int = 1  # frontend processes, each one of vLLM's clients of every engine, sharing the HTTP port

    def validate(self) -> None:
        if self.replicas < 1:
            raise LocalFleetError(f"--replicas must be at least 1, not {self.replicas}")
        if self.engine not in ENGINE_KINDS:
            raise LocalFleetError(f"--engine must be one of {', '.join(ENGINE_KINDS)}, not {self.engine!r}")
        if not 0 < self.port < 65536:
            raise LocalFleetError(f"--port must be in 1..65535, not {self.port}")
        if self.token_delay_ms is not None and self.engine != ENGINE_EMULATOR:
            raise LocalFleetError("--token-delay-ms applies to --engine emulator only")
        if self.elastic_ep_max is not None and self.elastic_ep_max < self.replicas:
            raise LocalFleetError(f"--elastic-ep-max ({self.elastic_ep_max}) must be at least --replicas "
                                  f"({self.replicas})")
        if self.gpus_per_rank < 0:
            raise LocalFleetError(f"--gpus-per-rank must be >= 0, not {self.gpus_per_rank}")
        if not 1 <= self.frontends <= MAX_FRONTENDS:
            raise LocalFleetError(f"--frontends must be in 1..{MAX_FRONTENDS}, not {self.frontends}")
        if self.frontends > 1 and (self.moe or self.elastic_ep_max is not None):
            raise LocalFleetError("--frontends above 1 is for dense models: vLLM's elastic EP tells only its first "
                                  "client of a resize, and a MoE fleet's frontend holds its elastic-EP state")
