# SPDX-License-Identifier: Apache-2.0
"""Local mode: a whole fleet as processes on 127.0.0.1, no Kubernetes (`corefleet up/status/down`).

The processes run the same command lines the operator's pods run (both are built by
`corefleet_client.commands`), with every address 127.0.0.1 and every port a free one, except the
frontend's HTTP port, which the user picks:

* the coordinator: `python -m corefleet_client.coordinator --engine-count N ...` (vLLM's
  DPCoordinator on three fixed ports, without wave coordination for dense models);
* the frontend: `python -m corefleet_client.frontend <admin/coordinator flags> -- MODEL <vLLM flags>`,
  the OpenAI API on the HTTP port and the admin API (`corefleet_client.admin`) on its own port;
* one engine per rank: `python -m corefleet_client.engine` (real vLLM, headless) or
  `python -m corefleet_harness.emulator` (the wire-level test double), `--health-port H -- MODEL
  --headless --data-parallel-start-rank i ...`.

Supervision, all recorded in a state directory so that another `corefleet` command finds it:

* each process leads its own process group (`process_group=0`), so a terminal's Ctrl-C (sent to
  the foreground group) reaches only `corefleet up`, which then stops exactly what it started; its
  output goes to `logs/<name>.log`. Not its own session: with `kernel.sched_autogroup_enabled`
  (the default on most distributions) the CPU scheduler shares the cores between *sessions* before
  threads, so a fleet of one session per process gave the frontend one share against every
  spinning engine worker's share and served at about half of stock `vllm serve` (issue 10);
* the state file `fleet.json` lists each process (role, rank, pid, start time, command line, log),
  the ports, the endpoint and the admin token file. It is rewritten after every start, so a
  `corefleet up` that fails half way still leaves a record `corefleet down` can act on;
* stopping sends SIGTERM to each process group, then SIGKILL to what is left after a grace period.
  A pid is acted on only while it is provably the process that was started: same boot, same start
  time (clock ticks since boot, from /proc/PID/stat) and the recorded command line in
  /proc/PID/cmdline (or the title vLLM's setproctitle gave it, which keeps the start time). So a
  pid recycled by an unrelated process is never signalled. If a group leader is gone but members
  of its group remain (vLLM's EngineCore children), the group is still signalled: Linux does not
  reuse a pid that still names a process group.

This package uses only the standard library (the `corefleet` command never imports vLLM, torch or
ZeroMQ); the tiny model is written by `corefleet_harness.tinymodel`, which imports `tokenizers` only
when it builds a tokenizer. Its modules, by concern:

* `config`: names, defaults, errors and `FleetOptions` (the options of `corefleet up`);
* `ports`: the fleet's ports (`Ports`), the user's checked free, the others free ones;
* `argv`: the processes' command lines and environments;
* `state`: the state file (`FleetRecord`, `ProcessRecord`);
* `procs`: /proc (whether a recorded pid is still ours, RSS, the boot id);
* `stopping`: `stop_fleet` and `corefleet down`;
* `members`: a lost frontend or coordinator replaced in place (the engines serve on), as the pods are;
* `supervise`: `spawn`, `start`, `LocalFleet`, `corefleet up` and `corefleet supervise` (what `up --detach`
  leaves running: it replaces a lost member);
* `scaling`: `corefleet scale`;
* `report`: `corefleet status`.

Everything callers use is re-exported here (`from corefleet_harness import local; local.up(...)`).
"""

from __future__ import annotations

from corefleet_harness.local.argv import (
    DEFAULT_RESERVED_CPUS,
    coordinator_argv,
    engine_argv,
    engine_cpu,
    engine_env,
    frontend_argv,
    is_moe_model,
    reserved_cpus,
)
from corefleet_harness.local.config import (
    DEFAULT_PORT,
    DEFAULT_READY_TIMEOUT,
    DEFAULT_REPLICAS,
    ENGINE_EMULATOR,
    ENGINE_KINDS,
    ENGINE_MODULES,
    ENGINE_VLLM,
    LAUNCHER_ARGS_END,
    LOCALHOST,
    LOG_DIR,
    MAX_FRONTENDS,
    MODEL_DIR,
    POLL_SECONDS,
    ROLE_COORDINATOR,
    ROLE_ENGINE,
    ROLE_FRONTEND,
    ROLE_SUPERVISOR,
    STATE_FILE,
    STATE_VERSION,
    STOP_GRACE_SECONDS,
    TINY_MODEL_NAME,
    TINY_MOE_MODEL_NAME,
    TOKEN_FILE,
    FleetOptions,
    Interrupted,
    LocalFleetError,
    default_state_dir,
)
from corefleet_harness.local.members import MEMBER_ROLES, member_argv
from corefleet_harness.local.ports import Ports, check_port_free, fleet_ports, with_new_ranks
from corefleet_harness.local.procs import (
    ProcStat,
    all_procs,
    boot_id,
    is_running,
    owns,
    proc_cmdline,
    proc_stat,
    tree_rss_bytes,
)
from corefleet_harness.local.report import status
from corefleet_harness.local.scaling import DEFAULT_DRAIN_TIMEOUT, scale
from corefleet_harness.local.state import FleetRecord, ProcessRecord, load_record, save_record, state_file
from corefleet_harness.local.stopping import down, stop_fleet
from corefleet_harness.local.supervise import LocalFleet, spawn, spawn_supervisor, start, supervise, up

__all__ = [
    "DEFAULT_DRAIN_TIMEOUT",
    "DEFAULT_PORT",
    "DEFAULT_READY_TIMEOUT",
    "DEFAULT_REPLICAS",
    "DEFAULT_RESERVED_CPUS",
    "ENGINE_EMULATOR",
    "ENGINE_KINDS",
    "ENGINE_MODULES",
    "ENGINE_VLLM",
    "LAUNCHER_ARGS_END",
    "LOCALHOST",
    "LOG_DIR",
    "MAX_FRONTENDS",
    "MEMBER_ROLES",
    "MODEL_DIR",
    "POLL_SECONDS",
    "ROLE_COORDINATOR",
    "ROLE_ENGINE",
    "ROLE_FRONTEND",
    "ROLE_SUPERVISOR",
    "STATE_FILE",
    "STATE_VERSION",
    "STOP_GRACE_SECONDS",
    "TINY_MODEL_NAME",
    "TINY_MOE_MODEL_NAME",
    "TOKEN_FILE",
    "FleetOptions",
    "FleetRecord",
    "Interrupted",
    "LocalFleet",
    "LocalFleetError",
    "Ports",
    "ProcStat",
    "ProcessRecord",
    "all_procs",
    "boot_id",
    "check_port_free",
    "coordinator_argv",
    "default_state_dir",
    "down",
    "engine_argv",
    "engine_cpu",
    "engine_env",
    "fleet_ports",
    "frontend_argv",
    "is_moe_model",
    "is_running",
    "load_record",
    "member_argv",
    "owns",
    "proc_cmdline",
    "proc_stat",
    "reserved_cpus",
    "save_record",
    "scale",
    "spawn",
    "spawn_supervisor",
    "start",
    "state_file",
    "status",
    "stop_fleet",
    "supervise",
    "tree_rss_bytes",
    "up",
    "with_new_ranks",
]
