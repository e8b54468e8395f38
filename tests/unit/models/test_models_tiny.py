"""The tiny model factory: tokenizer behaviour, chat template, config consistency, determinism."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rltune.models.load import load_model, load_tokenizer
from rltune.models.tiny import TINY_SPECS, build_tiny, build_tokenizer, count_parameters


def test_tokenizer_is_byte_level_and_round_trips(tiny_dir: str) -> None:
    tok = load_tokenizer(tiny_dir)
    assert len(tok) == 4 + 256
    printable = "".join(chr(c) for c in range(32, 127))
    text = "Hello,  world!\n\n  x = 3*4 {}\t 'll " + printable
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == [4 + ord(c) for c in text]  # one token per ASCII character, id 4 + byte
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids) == text


def test_non_ascii_text_is_bytes_and_round_trips(tiny_dir: str) -> None:
    tok = load_tokenizer(tiny_dir)
    text = "é 日本"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == [4 + b for b in text.encode("utf-8")]
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_every_loading_route_tokenises_the_same(tiny_dir: str, tiny_moe_dir: str) -> None:
    # transformers 5 rebuilds a Qwen2Tokenizer for model_type qwen2 and reads tokenizer.json
    # as is for qwen2_moe; both must agree with the tokenizer the factory built.
    text = "<|im_start|>user\nSay 'hi'  twice.\n\n<|im_end|>\n"
    expected = build_tokenizer()(text, add_special_tokens=False)["input_ids"]
    for directory in (tiny_dir, tiny_moe_dir):
        for loader in (AutoTokenizer, PreTrainedTokenizerFast):
            tok = loader.from_pretrained(directory, local_files_only=True)
            assert tok(text, add_special_tokens=False)["input_ids"] == expected, (directory, loader)


def test_special_tokens_are_single_ids_and_skipped_on_decode(tiny_dir: str) -> None:
    tok = load_tokenizer(tiny_dir)
    text = "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    newline = 4 + ord("\n")
    assert ids == [2, *[4 + ord(c) for c in "user\nhi"], 3, newline, 1]
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi\n"
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == [
        "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_chat_template_is_chatml(tiny_dir: str) -> None:
    tok = load_tokenizer(tiny_dir)
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}]
    expected = (
        "<|im_start|>system\nBe terse.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == expected
    assert tok.apply_chat_template(messages, tokenize=False) == expected[: -len("<|im_start|>assistant\n")]
    encoded = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    assert ids == tok(expected, add_special_tokens=False)["input_ids"]
    assert ids[0] == 2 and ids[-1] == 4 + ord("\n")
    assert tok.decode(ids) == expected


def test_eos_pad_and_configs_agree(tiny_dir: str) -> None:
    tok = load_tokenizer(tiny_dir)
    config = json.loads((Path(tiny_dir) / "config.json").read_text())
    generation = json.loads((Path(tiny_dir) / "generation_config.json").read_text())
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 3
    assert tok.pad_token == "<|pad|>" and tok.pad_token_id == 0
    assert tok.padding_side == "left"
    assert config["eos_token_id"] == generation["eos_token_id"] == 3
    assert config["pad_token_id"] == generation["pad_token_id"] == 0
    assert config["vocab_size"] == len(tok)
    assert config["tie_word_embeddings"] is True


def test_parameter_counts(tiny_dir: str, tiny_moe_dir: str) -> None:
    # Worked out by hand for TINY_SPECS (tied embeddings count once):
    # dense: emb 260*128 + 4 * (attn 128*128+128 + 2*(64*128+64) + 128*128
    #        + mlp 3*128*512 + 2 norms 2*128) + final norm 128
    attn = 128 * 128 + 128 + 2 * (64 * 128 + 64) + 128 * 128
    dense_layer = attn + 3 * 128 * 512 + 2 * 128
    assert count_parameters(load_model(tiny_dir)) == 260 * 128 + 4 * dense_layer + 128 == 1_018_496
    # moe layer: router 4*128, experts 4*3*128*256, shared expert 3*128*256, shared gate 128
    moe_layer = attn + 4 * 128 + 4 * 3 * 128 * 256 + 3 * 128 * 256 + 128 + 2 * 128
    assert count_parameters(load_model(tiny_moe_dir)) == 260 * 128 + 2 * moe_layer + 128 == 1_117_056


def test_build_is_deterministic_and_leaves_global_rng_alone(tmp_path: Path) -> None:
    spec = dict(TINY_SPECS["tiny"], layers=1)
    state = torch.get_rng_state()
    a = load_file(build_tiny(tmp_path / "a", seed=3, **spec) / "model.safetensors")
    b = load_file(build_tiny(tmp_path / "b", seed=3, **spec) / "model.safetensors")
    c = load_file(build_tiny(tmp_path / "c", seed=4, **spec) / "model.safetensors")
    assert torch.equal(torch.get_rng_state(), state)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    weights = [k for k in a if k.endswith("proj.weight") or "embed" in k]
    assert weights and all(not torch.equal(a[k], c[k]) for k in weights)


def test_overrides_reach_the_config(tmp_path: Path) -> None:
    directory = build_tiny(tmp_path, arch="qwen2_moe", hidden_size=32, layers=1, heads=2,
                           kv_heads=1, num_experts=3, num_experts_per_tok=1)
    config = json.loads((directory / "config.json").read_text())
    assert (config["model_type"], config["num_experts"], config["num_experts_per_tok"]) == (
        "qwen2_moe", 3, 1)
    assert config["hidden_size"] == 32 and config["num_key_value_heads"] == 1


def test_unknown_arch_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny architecture 'gpt9'.*qwen2"):
        build_tiny(tmp_path, arch="gpt9")
