# SPDX-License-Identifier: Apache-2.0
"""corefleet's vLLM general plugin (entry point group `vllm.general_plugins`, see pyproject.toml).

vLLM calls every general plugin in each of its processes (the API server, each engine core and
each worker) before it builds a model. This one has a single job, and only on vLLM's CPU platform:

* **AMX tile permission.** On an x86 CPU with AMX, vLLM 0.32.0's CPU attention picks its AMX kernel
  (`v1/attention/backends/cpu_attn.py` `_get_attn_isa`: bf16 and a block size divisible by 32),
  but nothing in the worker asks Linux for permission to use the AMX tile registers
  (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`), which Linux requires before a process's
  first AMX instruction. The worker then dies with SIGILL on its first forward pass (seen on a
  Sapphire Rapids VM: `Illegal instruction` in `cpu_attention_with_kv_cache`). PyTorch's
  `torch.cpu._init_amx()` makes that request; it is idempotent and harmless where AMX is absent.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    """The plugin's entry point: called by vLLM in each of its processes, possibly more than once."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import torch

    if torch.cpu._is_amx_tile_supported() and not torch.cpu._init_amx():
        logger.warning("This CPU has AMX but Linux refused the AMX tile permission: vLLM's AMX kernels "
                       "will fail with SIGILL")
