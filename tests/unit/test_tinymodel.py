# SPDX-License-Identifier: Apache-2.0
"""The tiny model directory: its files, a tokenizer that round-trips text, deterministic and idempotent writes.

That real vLLM serves it (text completions and chat) is checked in tests/e2e/test_local.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tokenizers import Tokenizer

from corefleet_harness.tinymodel import MAX_MODEL_LEN, VLLM_CPU_FLAGS, VOCAB_SIZE, write_tiny_model


def test_dense_model_directory(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "m")

    assert sorted(p.name for p in path.iterdir()) == [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == VOCAB_SIZE == 512
    assert config["head_dim"] == 32  # the CPU attention rejects 16
    assert json.loads((path / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tok_config["unk_token"], tok_config["bos_token"], tok_config["eos_token"]) == ("<unk>", "<s>", "</s>")
    assert "messages" in tok_config["chat_template"]


def test_moe_variant(tmp_path: Path) -> None:
    config = json.loads((write_tiny_model(tmp_path / "m", moe=True) / "config.json").read_text())

    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)


def test_a_longer_context_and_a_bigger_shape_change_the_config_and_the_tokenizers_limit_only(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "m", context=8192, shape={"hidden_size": 768, "num_hidden_layers": 6})
    config = json.loads((path / "config.json").read_text())
    assert (config["max_position_embeddings"], config["hidden_size"], config["num_hidden_layers"]) == (8192, 768, 6)
    assert config["vocab_size"] == VOCAB_SIZE
    assert json.loads((path / "tokenizer_config.json").read_text())["model_max_length"] == 8192
    plain = write_tiny_model(tmp_path / "plain")
    assert (path / "tokenizer.json").read_text() == (plain / "tokenizer.json").read_text()
    assert json.loads((plain / "tokenizer_config.json").read_text())["model_max_length"] == MAX_MODEL_LEN


def test_tokenizer_has_exactly_the_model_vocab_and_round_trips_text(tmp_path: Path) -> None:
    tok = Tokenizer.from_file(str(write_tiny_model(tmp_path / "m") / "tokenizer.json"))

    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    assert [tok.token_to_id(t) for t in ("<unk>", "<s>", "</s>")] == [0, 1, 2]
    text = "Hello, world! Ünïcode and 2026 numbers"
    enc = tok.encode(text)
    assert enc.ids[0] == 1  # BOS
    assert all(0 <= i < VOCAB_SIZE for i in enc.ids)
    assert tok.decode(enc.ids) == text
    # Every id the dummy-weight model can sample decodes to something.
    assert all(isinstance(tok.decode([i], skip_special_tokens=False), str) for i in range(VOCAB_SIZE))


def test_writes_are_deterministic_and_idempotent(tmp_path: Path) -> None:
    a = write_tiny_model(tmp_path / "a")
    b = write_tiny_model(tmp_path / "b")
    files = {p.name: p.read_bytes() for p in a.iterdir()}
    assert files == {p.name: p.read_bytes() for p in b.iterdir()}
    before = {p.name: p.stat().st_mtime_ns for p in a.iterdir()}

    assert write_tiny_model(a) == a

    assert {p.name: p.stat().st_mtime_ns for p in a.iterdir()} == before  # left alone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no temporary directories left


def test_a_different_directory_is_replaced_whole(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "m", moe=True)
    (path / "stray.bin").write_text("x")

    write_tiny_model(path)

    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    assert not (path / "stray.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_command_line_and_no_heavy_imports(tmp_path: Path) -> None:
    probe = ("import sys; from corefleet_harness.tinymodel import main; rc = main(sys.argv[1:]); "
             "assert not {'torch', 'vllm'} & set(sys.modules), 'imported torch/vllm'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "m"), "--moe"],
                          capture_output=True, text=True, timeout=60)

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "mixtral"


def test_cpu_flags_are_the_documented_ones() -> None:
    assert " ".join(VLLM_CPU_FLAGS) == ("--load-format dummy --dtype bfloat16 --max-model-len 256 --max-num-seqs 8 "
                                        "--enforce-eager --kv-cache-memory-bytes 67108864")
