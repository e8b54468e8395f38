"""completion_logprobs against a naive reference: one unpadded forward per row, full
log_softmax over the vocabulary, gather. Five architectures, mixed left/right padding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
)

from rltune.models.load import is_moe, load_model
from rltune.models.logprobs import completion_logprobs, position_ids_from_mask

VOCAB = 80
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    # Large weights make the next-token distribution far from uniform, so a wrong position
    # or an off-by-one shift changes log-probs by much more than the tolerance.
    initializer_range=0.3,
)
_MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.02)

CONFIGS: dict[str, PretrainedConfig] = {
    "qwen2": Qwen2Config(**_COMMON),
    "llama": LlamaConfig(**_COMMON),
    "mistral": MistralConfig(**_COMMON),
    "qwen2_moe": Qwen2MoeConfig(**_COMMON, **_MOE, num_experts=4, moe_intermediate_size=32,
                                shared_expert_intermediate_size=32),
    "mixtral": MixtralConfig(**_COMMON, **_MOE, num_local_experts=4),
    # Absolute position embeddings: unlike rotary ones (which see only relative offsets),
    # they give wrong log-probs when left padding shifts the positions.
    "gpt2": GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                       initializer_range=0.3),
}
MOE = ("qwen2_moe", "mixtral")

# Prompt width P = 6, completion width C = 5. Rows: no padding; 3 left + 3 right pads;
# 5 left + 1 right pads.
P, C = 6, 5
PROMPT_LENS = (6, 3, 1)
COMPLETION_LENS = (5, 2, 4)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each config, randomly initialised, saved with save_pretrained."""
    from transformers import AutoModelForCausalLM

    dirs = {}
    for name, config in CONFIGS.items():
        torch.manual_seed(0)
        directory = tmp_path_factory.mktemp(name)
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
        dirs[name] = directory
    return dirs


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(PROMPT_LENS), P + C, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (p, c) in enumerate(zip(PROMPT_LENS, COMPLETION_LENS)):
        ids[b] = torch.randint(1, VOCAB, (P + C,), generator=g)
        ids[b, : P - p] = 0
        ids[b, P + c :] = 0
        mask[b, P - p : P + c] = 1
    return ids, mask


def _naive(model, ids, mask, temperature):
    """Per row: the real tokens only, full forward, log_softmax over all logits, gather."""
    logps, ents = torch.zeros(ids.shape[0], C), torch.zeros(ids.shape[0], C)
    for b, (p, c) in enumerate(zip(PROMPT_LENS, COMPLETION_LENS)):
        row = ids[b][mask[b].bool()].unsqueeze(0)  # [1, p + c]
        logits = model(input_ids=row).logits[0].double() / temperature  # [p + c, V]
        logp_all = torch.log_softmax(logits, dim=-1)
        for j in range(c):
            logps[b, j] = logp_all[p - 1 + j, row[0, p + j]]
            ents[b, j] = -(logp_all[p - 1 + j].exp() * logp_all[p - 1 + j]).sum()
    return logps, ents


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_matches_naive_reference(model_dirs, arch: str, temperature: float) -> None:
    model = load_model(str(model_dirs[arch]))
    ids, mask = _batch()
    with torch.no_grad():
        out = completion_logprobs(model, ids, mask, P, temperature=temperature, with_entropy=True)
        ref_logp, ref_ent = _naive(model, ids, mask, temperature)
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == (3, C)
    torch.testing.assert_close(out.logprobs, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy, ref_ent, atol=1e-5, rtol=0)
    # The distribution is far from uniform, so the test can tell positions apart.
    assert ref_logp.std() > 0.3
    assert out.aux_loss is None  # router logits were not asked for


def test_position_ids_ignore_left_padding() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    expected = torch.tensor([[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5]])
    assert torch.equal(position_ids_from_mask(mask), expected)


def test_lm_head_sees_only_completion_positions(model_dirs) -> None:
    """Full logits: the C positions ``logits_to_keep`` asks for (a dense model's forward
    leaves out the last column, whose prediction is past the end); chunked (the default):
    only the attended completion tokens (11 of them), a chunk at a time."""
    model = load_model(str(model_dirs["qwen2"]))
    shapes = []
    model.get_output_embeddings().register_forward_hook(lambda m, i, o: shapes.append(i[0].shape))
    ids, mask = _batch()
    completion_logprobs(model, ids, mask, P, chunk_tokens=0)
    assert shapes == [torch.Size([3, C, 32])]
    shapes.clear()
    completion_logprobs(model, ids, mask, P)
    assert shapes == [torch.Size([sum(COMPLETION_LENS), 32])]


def test_gradient_matches_naive_reference(model_dirs) -> None:
    model = load_model(str(model_dirs["llama"]))
    ids, mask = _batch(seed=1)
    weights = torch.linspace(-1.0, 1.0, C).expand(3, C)  # a non-trivial loss
    (completion_logprobs(model, ids, mask, P).logprobs * weights).sum().backward()
    batched = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref_logp, _ = _naive(model, ids, mask, 1.0)
    (ref_logp * weights).sum().backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(batched[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)
    assert batched["model.embed_tokens.weight"].abs().sum() > 0


def test_padding_columns_are_zero(model_dirs) -> None:
    model = load_model(str(model_dirs["mistral"]))
    ids, mask = _batch()
    out = completion_logprobs(model, ids, mask, P, with_entropy=True)
    pad = mask[:, P:] == 0
    assert pad.sum() == 4
    assert torch.all(out.logprobs[pad] == 0) and torch.all(out.entropy[pad] == 0)
    assert torch.all(out.logprobs[~pad] < 0) and torch.all(out.entropy[~pad] > 0)
    assert not out.entropy.requires_grad and out.logprobs.requires_grad


def test_bfloat16_model_gives_float32_logprobs(model_dirs) -> None:
    model = load_model(str(model_dirs["qwen2"]), dtype="bfloat16")
    ids, mask = _batch()
    with torch.no_grad():
        out = completion_logprobs(model, ids, mask, P)
        full = model(input_ids=ids, attention_mask=mask,
                     position_ids=position_ids_from_mask(mask)).logits  # [B, T, V] bf16
    assert full.dtype == torch.bfloat16 and out.logprobs.dtype == torch.float32
    # Reference: the same bf16 logits, upcast before the softmax.
    ref = torch.log_softmax(full[:, P - 1 : -1].float(), dim=-1)
    ref = ref.gather(-1, ids[:, P:, None]).squeeze(-1) * mask[:, P:]
    torch.testing.assert_close(out.logprobs, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", MOE)
def test_moe_aux_loss_is_positive_with_gradient_to_router(model_dirs, arch: str) -> None:
    model = load_model(str(model_dirs[arch]))
    assert is_moe(model)
    ids, mask = _batch()
    out = completion_logprobs(model, ids, mask, P, output_router_logits=True)
    aux = out.aux_loss
    assert isinstance(aux, torch.Tensor) and aux.dim() == 0
    assert torch.isfinite(aux) and aux > 0
    aux.backward()
    routers = [p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert len(routers) == 2
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in routers)
    # Log-probs are the same with or without router outputs. Without them the forward
    # leaves out the last column: the same fp32 products over fewer rows, so sums may round
    # differently, by a few ulps (|log p| < 8, an ulp there 9.5e-7): 1e-5 is 10 ulps.
    with torch.no_grad():
        plain = completion_logprobs(model, ids, mask, P).logprobs
    torch.testing.assert_close(out.logprobs.detach(), plain, atol=1e-5, rtol=0)


def test_dense_model_has_no_aux_loss(model_dirs) -> None:
    model = load_model(str(model_dirs["qwen2"]))
    ids, mask = _batch()
    assert completion_logprobs(model, ids, mask, P, output_router_logits=True).aux_loss is None


@pytest.mark.parametrize(
    ("prompt_len", "temperature", "message"),
    [(0, 1.0, "prompt_len 0 must be at least 1"), (P + C, 1.0, "less than the sequence length"),
     (P, 0.0, "temperature 0.0 must be positive")],
)
def test_bad_arguments(model_dirs, prompt_len, temperature, message) -> None:
    model = load_model(str(model_dirs["qwen2"]))
    ids, mask = _batch()
    with pytest.raises(ValueError, match=message):
        completion_logprobs(model, ids, mask, prompt_len, temperature=temperature)
