# SPDX-License-Identifier: Apache-2.0
"""A tiny model directory that real vLLM serves on CPU: the local fleet's default and the e2e tests'.

There is no hub access on the machines corefleet is tested on, so the model is written here:

* `config.json` / `generation_config.json`: a 2-layer dense llama (or, with `moe=True`, a
  Mixtral with 4 experts, 2 per token) whose shapes the CPU attention accepts (head_dim 32);
* `tokenizer.json` / `tokenizer_config.json`: a byte-level BPE tokenizer trained right here with
  the `tokenizers` library on a fixed text, special tokens `<unk>`, `<s>`, `</s>` = ids 0, 1, 2,
  padded to exactly `VOCAB_SIZE` entries (the model's vocab), with a small chat template, so
  `/v1/completions` and `/v1/chat/completions` take text.

There are no weights: engines run with `--load-format dummy` (in `VLLM_CPU_FLAGS`), so the
output is noise, but every token id decodes.

Writing is deterministic (same bytes every time), idempotent (a directory that already holds
exactly these files is left alone) and atomic (files go to a temporary sibling directory that is
renamed into place), so concurrent `corefleet up`s and tests may share one directory.

    python -m corefleet_harness.tinymodel DIR [--moe]

This module imports neither torch nor vLLM: only `tokenizers` (a vLLM dependency), and only
when a tokenizer is built.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

VOCAB_SIZE = 512
UNK, BOS, EOS = "<unk>", "<s>", "</s>"  # ids 0, 1, 2
SPECIAL_TOKENS = (UNK, BOS, EOS)
MAX_MODEL_LEN = 256

# vLLM flags that make the tiny model run on a CPU-only machine (docs/vllm-on-cpu.md): no weights,
# a short context, few sequences, no graph capture, and an explicit 64 MiB KV cache (the default
# memory fraction of a large NUMA node fails at startup).
VLLM_CPU_FLAGS: tuple[str, ...] = (
    "--load-format", "dummy",
    "--dtype", "bfloat16",
    "--max-model-len", str(MAX_MODEL_LEN),
    "--max-num-seqs", "8",
    "--enforce-eager",
    "--kv-cache-memory-bytes", str(64 * 1024 * 1024),
)

_DENSE_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,  # the CPU attention rejects 16
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": MAX_MODEL_LEN,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}

_MOE_CONFIG: dict[str, Any] = {
    **_DENSE_CONFIG,
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}

# Rendered by transformers' Jinja environment; `bos_token` comes from tokenizer_config.json.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# The tokenizer's training text: fixed, so the merges (and the file) are the same on every machine.
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. "
    "corefleet runs vLLM data-parallel fleets: a frontend, a coordinator and one engine per rank. "
    "Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris. "
    "Once upon a time there was a small model that could only say a few things, and it said them "
    "again and again, because its weights were random numbers and nobody had ever trained it. "
    "user: hello assistant: hi there system: you are a helpful assistant "
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 2025 2026 "
    "def main(): return 0 import json print(\"ok\") {\"key\": \"value\", \"list\": [1, 2, 3]} "
    "Kubernetes pods, services and secrets; scale up, scale down, drain, retire, serve. "
)


def model_config(moe: bool = False, context: int | None = None, shape: Mapping[str, int] | None = None
                 ) -> dict[str, Any]:
    """The model's config.json as a dict (a fresh copy); `context` replaces its max_position_embeddings, `shape`
    (config.json keys: hidden_size, num_hidden_layers, ...) its size, for a model whose steps cost more."""
    config = copy.deepcopy(_MOE_CONFIG if moe else _DENSE_CONFIG)
    if context is not None:
        config["max_position_embeddings"] = context
    config.update(shape or {})
    return config


def _tokenizer_json() -> str:
    """Train the byte-level BPE tokenizer and return its tokenizer.json (exactly VOCAB_SIZE ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    # The corpus may not yield enough merges: pad with unused tokens so that every id the model
    # can sample (0..VOCAB_SIZE-1) decodes.
    missing = VOCAB_SIZE - tok.get_vocab_size(with_added_tokens=True)
    if missing < 0:
        raise AssertionError(f"trained vocab exceeds {VOCAB_SIZE}")
    if missing:
        tok.add_tokens([f"<extra_{i}>" for i in range(missing)])
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)],
        ),
    ])
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != [0, 1, 2] or tok.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise AssertionError(f"unexpected tokenizer layout: special ids {ids}, size {tok.get_vocab_size()}")
    return tok.to_str(pretty=True)


def _dump(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def model_files(moe: bool = False, context: int | None = None, shape: Mapping[str, int] | None = None
                ) -> dict[str, str]:
    """File name -> content of the tiny model directory (`context`: its max_position_embeddings, and its tokenizer's
    model_max_length, if not the default's; `shape`: as for `model_config`)."""
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": context or MAX_MODEL_LEN,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    return {
        "config.json": _dump(model_config(moe, context, shape)),
        "generation_config.json": _dump({"bos_token_id": 1, "eos_token_id": 2}),
        "tokenizer.json": _tokenizer_json(),
        "tokenizer_config.json": _dump(tokenizer_config),
    }


def _holds(path: Path, files: dict[str, str]) -> bool:
    try:
        return sorted(p.name for p in path.iterdir()) == sorted(files) and all(
            (path / name).read_text() == content for name, content in files.items()
        )
    except OSError:
        return False


def write_tiny_model(path: str | os.PathLike[str], moe: bool = False, context: int | None = None,
                     shape: Mapping[str, int] | None = None) -> Path:
    """Write the tiny model to `path` (created with its parents) unless it already holds it; `context`
    widens (or narrows) its max_position_embeddings (requests that stay in flight for seconds need more
    than the default's); `shape` makes it bigger (`model_config`), its weights still dummy and its tokenizer the
    same.

    1. Build every file in memory and return at once if `path` already holds exactly those.
    2. Write them into a temporary sibling directory.
    3. Move it into place with rename: a stale `path` is first renamed aside and removed after, so
       a reader sees the old directory or the new one, never a half-written one. If another writer
       won the race with the same content, its directory stays and ours is dropped.
    """
    path = Path(path).absolute()
    files = model_files(moe, context, shape)
    if _holds(path, files):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        for name, content in files.items():
            (tmp / name).write_text(content)
        tmp.chmod(0o755)
        stale: Path | None = None
        if path.exists():
            stale = path.with_name(f".{path.name}.stale-{os.getpid()}-{tmp.name[-8:]}")
            with contextlib.suppress(FileNotFoundError):
                path.rename(stale)
        try:
            tmp.rename(path)
        except OSError:
            if not _holds(path, files):  # someone else wrote something else meanwhile
                raise
        else:
            logger.info("Wrote the tiny %s model to %s", "MoE" if moe else "dense", path)
        if stale is not None:
            shutil.rmtree(stale, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m corefleet_harness.tinymodel",
                                     description="Write a tiny llama (or Mixtral) model directory for vLLM on CPU.")
    parser.add_argument("path", help="the model directory to write")
    parser.add_argument("--moe", action="store_true", help="MixtralForCausalLM (4 experts, 2 per token)")
    parser.add_argument("--context", type=int, default=None,
                        help=f"max_position_embeddings (default {MAX_MODEL_LEN})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s [%(name)s] %(message)s", stream=sys.stderr)
    print(write_tiny_model(args.path, moe=args.moe, context=args.context))  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(main())
