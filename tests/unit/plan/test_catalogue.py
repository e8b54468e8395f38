"""Model shapes: the catalogue against the model cards, counts against transformers' own
modules, FLOPs and KV bytes worked by hand, and ``load_model_spec``'s errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rltune.plan.catalogue import (
    CATALOGUE,
    TINY_BUILD_ARGS,
    active_param_count,
    embedding_params,
    expert_params,
    forward_flops,
    forward_flops_per_token,
    kv_bytes_per_token,
    layer_params,
    load_model_spec,
    matmul_params_per_token,
    param_count,
)
from rltune.plan.errors import PlanError
from rltune.plan.spec import ModelSpec

# (name, total parameters as the model card gives them)
PUBLISHED_TOTAL = [
    ("llama-3.1-8b", 8.03e9),     # meta-llama/Llama-3.1-8B card: 8.03B
    ("llama-3.1-70b", 70.6e9),    # meta-llama/Llama-3.1-70B card: 70.6B
    ("qwen2.5-1.5b", 1.54e9),     # Qwen/Qwen2.5-1.5B card: 1.54B
    ("qwen2.5-7b", 7.61e9),       # Qwen/Qwen2.5-7B card: 7.61B
    ("qwen2.5-72b", 72.7e9),      # Qwen/Qwen2.5-72B card: 72.7B
    ("qwen3-8b", 8.2e9),          # Qwen/Qwen3-8B card: 8.2B
    ("qwen3-30b-a3b", 30.5e9),    # Qwen/Qwen3-30B-A3B card: 30.5B in total
    ("qwen3-235b-a22b", 235e9),   # Qwen/Qwen3-235B-A22B card: 235B in total
    ("mixtral-8x7b", 46.7e9),     # Mixtral of Experts (Jiang et al. 2024): 47B; HF 46.7B
]

# (name, lowest, highest activated parameter count the published figure allows). Qwen's
# cards truncate to the digits shown (the totals too: 30.53B is "30.5B", 235.09B "235B"),
# so "3.3B" means [3.3, 3.4): our 3.353B is 1.6 % above the figure as written, inside the
# figure as truncated. Mixtral's 12.9B is rounded: within 1 %.
PUBLISHED_ACTIVE = [
    ("qwen3-30b-a3b", 3.3e9, 3.4e9),          # Qwen3-30B-A3B card: 3.3B activated
    ("qwen3-235b-a22b", 22e9, 23e9),          # Qwen3-235B-A22B card: 22B activated
    ("mixtral-8x7b", 12.9e9 * 0.99, 12.9e9 * 1.01),  # HF Mixtral-8x7B: 12.9B active
]


@pytest.mark.parametrize(("name", "total"), PUBLISHED_TOTAL)
def test_catalogue_total_within_one_percent_of_the_model_card(name, total):
    assert param_count(CATALOGUE[name]) == pytest.approx(total, rel=0.01)


@pytest.mark.parametrize(("name", "low", "high"), PUBLISHED_ACTIVE)
def test_moe_active_parameters_match_the_published_figure(name, low, high):
    assert low <= active_param_count(CATALOGUE[name]) < high


def test_dense_model_uses_every_parameter():
    spec = CATALOGUE["qwen3-8b"]
    assert active_param_count(spec) == param_count(spec)
    assert expert_params(spec) == 0


def test_llama_8b_count_worked_by_hand():
    spec = CATALOGUE["llama-3.1-8b"]
    # embeddings: 2 (untied) x 128,256 x 4,096 = 1,050,673,152
    assert embedding_params(spec) == 1_050_673_152
    # a block: q, o 2 x 4,096^2 = 33,554,432; k, v 2 x 4,096 x 1,024 = 8,388,608;
    # MLP 3 x 4,096 x 14,336 = 176,160,768; two RMSNorms 8,192 -> 218,112,000
    assert layer_params(spec, 0) == 218_112_000
    # 1,050,673,152 + 32 x 218,112,000 + 4,096 (final norm) = 8,030,261,248
    assert param_count(spec) == 8_030_261_248


def test_qwen3_30b_a3b_experts_worked_by_hand():
    spec = CATALOGUE["qwen3-30b-a3b"]
    # 48 layers x 128 experts x 3 x 2,048 x 768 = 28,991,029,248
    assert expert_params(spec) == 28_991_029_248
    # 120 of 128 experts unused per token: 28,991,029,248 x 120 / 128 = 27,179,089,920
    assert param_count(spec) - active_param_count(spec) == 27_179_089_920


# --- a small hand-made spec: every number below is worked beside it ---------------------

SMALL = ModelSpec(name="small", hidden=4, layers=2, heads=2, kv_heads=1, head_dim=2,
                  intermediate=8, vocab=10)
SMALL_MOE = ModelSpec(name="small-moe", hidden=4, layers=2, heads=2, kv_heads=1, head_dim=2,
                      intermediate=8, vocab=10, experts=4, experts_per_token=2,
                      expert_intermediate=3, dense_layers=1)


def test_small_dense_flops_by_hand():
    # per layer: q, o 2 x 4 x (2 x 2) = 32, k, v 2 x 4 x (1 x 2) = 16, MLP 3 x 4 x 8 = 96
    # -> 144; 2 layers 288; LM head 10 x 4 = 40 -> 328 weights a token multiplies
    assert matmul_params_per_token(SMALL) == 328
    # 2 x 328 = 656; attention 4 x 2 layers x 2 heads x 2 head_dim = 32 per key; 5 keys: 160
    assert forward_flops_per_token(SMALL, 5) == 816.0
    # 3 new tokens after 2 cached: keys 3 + 4 + 5 = 12 -> 3 x 656 + 32 x 12 = 2,352
    assert forward_flops(SMALL, 3, past=2) == 2352.0
    assert forward_flops(SMALL, 3, past=2) == sum(forward_flops_per_token(SMALL, k) for k in (3, 4, 5))


def test_small_moe_counts_and_flops_by_hand():
    # embeddings 2 x 10 x 4 = 80; layer 0 (dense): attention 48 + norms 8 + MLP 96 = 152;
    # layer 1: 48 + 8 + router 4 x 4 = 16 + 4 experts x (3 x 4 x 3 = 36) = 144 -> 216;
    # final norm 4 -> 80 + 152 + 216 + 4 = 452
    assert layer_params(SMALL_MOE, 0) == 152
    assert layer_params(SMALL_MOE, 1) == 216
    assert param_count(SMALL_MOE) == 452
    assert expert_params(SMALL_MOE) == 144
    # 2 of 4 experts unused: 452 - 2 x 36 = 380
    assert active_param_count(SMALL_MOE) == 380
    # matmul: 2 x 48 + 96 + (16 + 2 x 36) + 40 = 320; FLOPs at context 1: 640 + 32 = 672
    assert matmul_params_per_token(SMALL_MOE) == 320
    assert forward_flops_per_token(SMALL_MOE, 1) == 672.0


def test_kv_bytes_by_hand():
    # Llama-3.1-8B bf16: 2 x 32 layers x 8 kv heads x 128 x 2 bytes = 131,072
    assert kv_bytes_per_token(CATALOGUE["llama-3.1-8b"], 2) == 131_072
    # Qwen3-30B-A3B fp8: 2 x 48 x 4 x 128 x 1 = 49,152
    assert kv_bytes_per_token(CATALOGUE["qwen3-30b-a3b"], 1) == 49_152


def test_layer_out_of_range_is_refused():
    with pytest.raises(PlanError, match=r"layer 2 of small: it has layers 0 to 1"):
        layer_params(SMALL, 2)


# --- load_model_spec --------------------------------------------------------------------


def test_builtin_names_come_from_the_catalogue():
    assert load_model_spec("builtin:qwen3-8b") is CATALOGUE["qwen3-8b"]


def test_unknown_builtin_lists_the_known_names():
    with pytest.raises(PlanError) as info:
        load_model_spec("builtin:llama-9b")
    message = str(info.value)
    assert "'builtin:llama-9b'" in message and "builtin:llama-3.1-8b" in message
    assert "builtin:tiny-moe" in message and "\n" not in message


# One small config per family, with the keys that change the count switched on.
FAMILIES = {
    "llama": dict(attention_bias=True),
    "mistral": dict(head_dim=16),  # Mistral-NeMo style: head_dim != hidden / heads
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=8),
    "qwen3/no head_dim": dict(),  # Qwen3Config's default head_dim is 128, not hidden / heads
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                      shared_expert_intermediate_size=40, mlp_only_layers=[0]),
    "qwen3_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                      decoder_sparse_step=1, mlp_only_layers=[]),
}
BASE = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=48, vocab_size=50, tie_word_embeddings=False)


def write_config(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_count_equals_transformers_modules(tmp_path, family):
    """The spec read from a config.json counts exactly what transformers builds for it
    (on the meta device: no memory, no weights)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {"model_type": family.split("/")[0], **BASE, **FAMILIES[family]}
    spec = load_model_spec(str(write_config(tmp_path, config)))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    assert param_count(spec) == sum(p.numel() for p in model.parameters())
    assert spec.name == tmp_path.name


def test_config_json_path_and_moe_fields(tmp_path):
    config = {"model_type": "qwen2_moe", **BASE, **FAMILIES["qwen2_moe"]}
    spec = load_model_spec(str(write_config(tmp_path, config) / "config.json"))
    assert (spec.experts, spec.experts_per_token, spec.expert_intermediate) == (4, 2, 24)
    assert (spec.shared_expert_intermediate, spec.dense_layers, spec.qkv_bias) == (40, 1, True)


def test_builtin_tiny_models_match_the_factory(tmp_path):
    """The catalogue's tiny specs are the factory's: same build arguments, same config,
    and the count equals the built model's ``sum(p.numel())``."""
    pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from rltune.models.tiny import TINY_SPECS, build_tiny, count_parameters

    assert TINY_BUILD_ARGS == TINY_SPECS
    for name, args in TINY_SPECS.items():
        directory = build_tiny(tmp_path / name, **args)
        spec = load_model_spec(str(directory))
        assert spec == CATALOGUE[name].__class__(**{**vars(CATALOGUE[name]), "name": name})
        model = AutoModelForCausalLM.from_pretrained(directory)
        assert param_count(CATALOGUE[name]) == count_parameters(model)


@pytest.mark.parametrize(("config", "expected"), [
    ({"model_type": "llama", **{k: v for k, v in BASE.items() if k != "vocab_size"}},
     r"has no `vocab_size`, which the planner needs"),
    ({**BASE, "model_type": "bert"}, r"`model_type` 'bert' is not an architecture the planner models"),
    ({**BASE, "model_type": "t5", "is_encoder_decoder": True}, r"encoder-decoder"),
    ({**BASE}, r"`model_type` None is not"),
    ({**BASE, "model_type": "llama", "mlp_bias": True}, r"`mlp_bias: true`"),
    ({**BASE, "model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 3},
     r"not a multiple of 3 `num_key_value_heads`"),
    ({**BASE, "model_type": "llama", "hidden_size": "32"}, r"`hidden_size` is '32', expected an integer"),
    ({**BASE, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": 8, "decoder_sparse_step": 2}, r"dense layers \[0, 2\]"),
    ({**BASE, "model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 4},
     r"`num_experts_per_tok` 4 exceeds the 2 experts"),
])
def test_bad_configs_name_the_file_and_key(tmp_path, config, expected):
    write_config(tmp_path, config)
    with pytest.raises(PlanError, match=expected) as info:
        load_model_spec(str(tmp_path))
    assert str(tmp_path / "config.json") in str(info.value)


def test_unreadable_or_missing_files(tmp_path):
    with pytest.raises(PlanError, match=r"has no config.json"):
        load_model_spec(str(tmp_path))
    with pytest.raises(PlanError, match=r"neither a builtin: name, a directory nor a file; "
                                        r"give .* or one of builtin:llama-3.1-8b"):
        load_model_spec("Qwen/Qwen2.5-7B")  # a hub id: the planner reads local files only
    (tmp_path / "config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(PlanError, match=r"cannot read model config .*config.json"):
        load_model_spec(str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(PlanError, match=r"holds a list, not a JSON object"):
        load_model_spec(str(tmp_path))
