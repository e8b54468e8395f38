"""The dense forward of ``completion_logprobs`` leaves out the last column and, without left
padding, the attention mask: the log-probs, the entropy and the gradient must be those of
the forward over every column with the padding mask (the reference below, written out
with the model's own call)."""

from __future__ import annotations

import copy

import pytest
import torch

from transformers import Qwen2Config, Qwen2ForCausalLM

from rltune.models.logprobs import causal_suffices, completion_logprobs, position_ids_from_mask

P = 4  # prompt columns


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    """A dense Qwen2, fp32; each test trains deep copies. Large weights (init std 0.3) make
    attention far from uniform, so a padded key attended by mistake, or an off-by-one
    column, moves the log-probs by much more than the tolerance."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.3)
    return Qwen2ForCausalLM(config).float().eval()


def _batch(left_pad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``[3, P + 6]`` ids and mask: completions of 6, 3 and 1 tokens (right padding), and,
    with ``left_pad``, prompts of 4, 2 and 4 tokens."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (3, P + 6), generator=gen)
    mask = torch.ones_like(ids)
    for row, length in enumerate((6, 3, 1)):
        mask[row, P + length:] = 0
    if left_pad:
        mask[1, :2] = 0
    return ids * mask, mask


def _reference(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every column, the padding mask, the full ``[B, T, V]`` logits: ``logp[b, j] =
    log_softmax(z[b, P + j - 1])[ids[b, P + j]]``, 0 on padding; and its entropy."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                   use_cache=False).logits[:, P - 1 : -1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, P:].unsqueeze(-1)).squeeze(-1)
    entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    valid = mask[:, P:].bool()
    return torch.where(valid, logp, 0.0), torch.where(valid, entropy.detach(), 0.0)


def test_causal_suffices_only_without_left_padding() -> None:
    assert causal_suffices(torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]]))
    assert not causal_suffices(torch.tensor([[1, 1, 1], [0, 1, 1]]))  # left padding
    assert not causal_suffices(torch.tensor([[1, 0, 1]]))  # a hole


@pytest.mark.parametrize("left_pad", [False, True], ids=["right-padding", "left-and-right"])
@pytest.mark.parametrize("chunk", [0, 4], ids=["full-logits", "chunked"])
def test_trimmed_forward_gives_the_reference_update(tiny_model: torch.nn.Module, left_pad: bool, chunk: int) -> None:
    # Tolerances: the two forwards run the same fp32 products on 3 x 9 rows instead of
    # 3 x 10 (and the SDPA causal kernel instead of the masked one), so only the order of
    # the sums may differ: |log p| < 10 and each of the ~10 rounded ops per layer adds at
    # most a few ulps of fp32 (eps 1.2e-7), far below 1e-5 absolute. A wrong column (an
    # off-by-one shift, a padded key attended) moves log-probs by ~0.1 or more.
    ids, mask = _batch(left_pad)
    ours, ref = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    out = completion_logprobs(ours, ids, mask, P, with_entropy=True, chunk_tokens=chunk)
    ref_logp, ref_entropy = _reference(ref, ids, mask)
    torch.testing.assert_close(out.logprobs, ref_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.entropy, ref_entropy, rtol=0, atol=1e-5)
    # the same loss through both: equal gradients (relative to the largest, 1e-4: the
    # backward sums over 27 vs 30 rows, padded rows contributing exact zeros)
    weights = torch.randn(ids.shape[0], ids.shape[1] - P, generator=torch.Generator().manual_seed(1))
    (out.logprobs * weights).sum().backward()
    (ref_logp * weights).sum().backward()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        scale = b.grad.abs().max().clamp(min=1e-12)
        torch.testing.assert_close(a.grad / scale, b.grad / scale, rtol=0, atol=1e-4, msg=name)


def test_the_dense_forward_skips_the_last_column(tiny_model: torch.nn.Module) -> None:
    """What the body sees: ``T - 1`` columns, and no mask without left padding."""
    seen = {}
    model = copy.deepcopy(tiny_model)

    def record(module, args, kwargs):
        seen["width"] = kwargs["input_ids"].shape[1]
        seen["mask"] = kwargs["attention_mask"]

    model.model.register_forward_pre_hook(record, with_kwargs=True)
    ids, mask = _batch(left_pad=False)
    completion_logprobs(model, ids, mask, P)
    assert seen["width"] == ids.shape[1] - 1 and seen["mask"] is None
    completion_logprobs(model, *_batch(left_pad=True), P)
    assert seen["mask"] is not None and seen["mask"].shape == (3, ids.shape[1] - 1)
