"""Chunked log-probs (:mod:`rltune.models.chunked`) against the full logits.

Tolerances. In float64 the two paths differ only in how the head's matmul and the
gradient sums are blocked (one ``[N, H] x [H, V]`` product against several ``[c, H]``
ones, per-chunk partial sums of ``dW``): ~1e-15 relative. The float32 log-softmax runs on
logits rounded from those float64 values, identical but for a rare rounding tie (one
float32 ulp of a logit, ~1e-7 at |z| ~ 5). So ``ATOL = 1e-6`` on log-probs, entropy and
every parameter's gradient holds with a wide margin, while a real mistake (a missing
temperature, a shifted position, a lost gradient to the head) moves values by 1e-2 and
more. The float32 tests (LoRA, MoE, bfloat16-free realistic init) allow the blocking
difference in float32 instead: 4 ulps at the log-probs' magnitude (|log p| < 8 with a
vocabulary of 300: ulp 4.8e-7), ``F32_ATOL = 2e-6``; gradients ``F32_GRAD_RTOL = 1e-6``
of each tensor's largest entry (a sum of N products in another order, measured 2e-7).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from rltune.models.chunked import ChunkedHead, logprob_chunk_tokens, set_logprob_chunk_tokens
from rltune.models.logprobs import completion_logprobs

ATOL = 1e-6
F32_ATOL = 2e-6
F32_GRAD_RTOL = 1e-6
VOCAB = 300
PROMPT = 6


def build(tied: bool, dtype: torch.dtype = torch.float64, init: float = 0.3) -> torch.nn.Module:
    """A tiny Qwen2; ``init`` 0.3 makes the next-token distributions far from uniform, so a
    wrong position or temperature shows."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=init, tie_word_embeddings=tied)
    return AutoModelForCausalLM.from_config(config).to(dtype)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 6 prompt + 8 completion columns: left padding on row 1, right padding
    on rows 0 and 2: 4 + 8 + 6 = 18 attended completion tokens (chunks of 3 fit; 5 and 7
    leave an uneven last chunk)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (3, PROMPT + 8), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[0, 10:] = 0
    mask[2, 12:] = 0
    return ids, mask


def run(model: torch.nn.Module, chunk: int, temperature: float = 0.7) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Log-probs, entropy and the gradients of a weighted sum of the log-probs."""
    ids, mask = batch()
    model.zero_grad(set_to_none=True)
    out = completion_logprobs(model, ids, mask, PROMPT, temperature=temperature, with_entropy=True,
                              chunk_tokens=chunk)
    weights = torch.linspace(-1.0, 2.0, out.logprobs.numel()).reshape(out.logprobs.shape)
    (out.logprobs * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logprobs.detach(), out.entropy, grads


def assert_same(got: tuple, want: tuple, atol: float, grad_rtol: float | None = None) -> None:
    torch.testing.assert_close(got[0], want[0], atol=atol, rtol=0, msg="log-probs")
    torch.testing.assert_close(got[1], want[1], atol=atol, rtol=0, msg="entropy")
    assert got[2].keys() == want[2].keys()
    for name, g in want[2].items():
        tol = atol if grad_rtol is None else grad_rtol * float(g.abs().max())
        torch.testing.assert_close(got[2][name], g, atol=tol, rtol=0, msg=f"gradient of {name}")


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk", [1, 3, 5, 7, 100])
def test_chunked_equals_full(tied: bool, chunk: int) -> None:
    """Log-probs, entropy and every parameter's gradient, temperature 0.7, padded rows,
    uneven last chunks (3, 5 and 7 do not divide the attended tokens) and a single chunk."""
    model = build(tied)
    full = run(model, 0)
    got = run(model, chunk)
    assert_same(got, full, ATOL)
    head = "lm_head.weight" if not tied else "model.embed_tokens.weight"
    assert got[2][head].abs().sum() > 0  # the head's (tied: the embedding's) gradient flows
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_float32_realistic_init() -> None:
    model = build(tied=True, dtype=torch.float32, init=0.02)
    assert_same(run(model, 4, temperature=1.0), run(model, 0, temperature=1.0), F32_ATOL, F32_GRAD_RTOL)


def test_head_sees_one_chunk_at_a_time_and_nothing_of_v_is_saved() -> None:
    """The real head is called on at most ``chunk`` attended tokens per call (padding is
    skipped), and with gradients nothing as large as a chunk's logits is kept for the
    backward outside the checkpointed chunks; the full path keeps ``[B, C, V]``."""
    model = build(tied=False)
    ids, mask = batch()
    attended = int(mask[:, PROMPT:].sum())
    calls: list[tuple[int, ...]] = []
    model.lm_head.register_forward_hook(lambda m, i, o: calls.append(tuple(o.shape)))
    saved: list[int] = []  # sizes of the saved tensors that span the vocabulary

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() and t.shape[-1] == VOCAB:
            saved.append(t.numel())
        return t

    for chunk in (4, 0):
        calls.clear()
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = completion_logprobs(model, ids, mask, PROMPT, with_entropy=True, chunk_tokens=chunk)
        out.logprobs.sum().backward()
        if chunk:
            # 18 attended tokens: the forward's chunks, then each recomputed by the backward (last first)
            forward = [(4, VOCAB)] * 4 + [(2, VOCAB)]
            assert attended == 18 and calls == forward + forward[::-1]
            assert saved == []
        else:
            assert calls == [(3, 8, VOCAB)]  # C positions: the dense forward leaves out the last column
            assert max(saved) >= 3 * 8 * VOCAB  # [B, C, V] logits kept for the backward


def test_chunk_size_is_read_from_the_model() -> None:
    model = build(tied=True)
    assert logprob_chunk_tokens(model) > 0
    set_logprob_chunk_tokens(model, 2)
    assert logprob_chunk_tokens(model) == 2
    seen = []
    model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.shape[0]))
    ids, mask = batch()
    with torch.no_grad():
        completion_logprobs(model, ids, mask, PROMPT)
    assert max(seen) == 2
    set_logprob_chunk_tokens(model, 0)
    with torch.no_grad():
        completion_logprobs(model, ids, mask, PROMPT)
    assert seen[-1] == 3  # the full path: the head saw [B, C + 1, V] once
    assert not any(isinstance(m, ChunkedHead) for m in model.modules())  # the stand-in is gone
    with pytest.raises(ValueError, match="must be >= 0"):
        set_logprob_chunk_tokens(model, -1)


def test_head_is_restored_after_an_error() -> None:
    model = build(tied=False)
    head = model.lm_head
    ids, mask = batch()
    with pytest.raises(Exception):
        completion_logprobs(model, ids[:, :-1], mask, PROMPT, chunk_tokens=3)  # shapes disagree
    assert model.lm_head is head


def test_model_without_logits_to_keep_is_refused() -> None:
    model = build(tied=False)
    forward = model.forward

    def ignores(*args, logits_to_keep=0, **kwargs):
        return forward(*args, **kwargs)

    model.forward = ignores
    ids, mask = batch()
    for chunk in (0, 3):
        with pytest.raises(ValueError, match="does not support that argument"):
            completion_logprobs(model, ids, mask, PROMPT, chunk_tokens=chunk)


def test_lora_with_lm_head_saved() -> None:
    """LoRA adapters with ``lm_head`` trained in full (peft's ``modules_to_save`` copy): the
    chunked path calls the wrapper, so the copy gets the gradient, as with the full logits."""
    pytest.importorskip("peft")
    from rltune.config.schema import LoraConfig
    from rltune.models.lora import apply_lora

    torch.manual_seed(0)
    model = apply_lora(build(tied=False, dtype=torch.float32, init=0.02),
                       LoraConfig(r=4, target_modules=("q_proj", "v_proj"), modules_to_save=("lm_head",)))
    with torch.no_grad():  # adapters away from zero so that their gradients differ
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    full, got = run(model, 0), run(model, 4)
    assert_same(got, full, F32_ATOL, F32_GRAD_RTOL)
    saved = [n for n in got[2] if "modules_to_save" in n and "lm_head" in n]
    assert saved and all(got[2][n].abs().sum() > 0 for n in saved)


def test_moe_outputs_are_kept(tiny_moe_dir: str) -> None:
    """builtin:tiny-moe: aux loss, expert load and log-probs as with the full logits."""
    from rltune.models.load import load_model

    model = load_model(tiny_moe_dir)
    ids, mask = batch()
    ids = ids % model.config.vocab_size
    outs = []
    for chunk in (0, 3):
        model.zero_grad(set_to_none=True)
        out = completion_logprobs(model, ids, mask, PROMPT, output_router_logits=True, with_entropy=True,
                                  chunk_tokens=chunk)
        (out.logprobs.sum() + out.aux_loss).backward()
        outs.append((out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (full, full_grads), (got, got_grads) = outs
    torch.testing.assert_close(got.logprobs, full.logprobs, atol=F32_ATOL, rtol=0)
    torch.testing.assert_close(got.entropy, full.entropy, atol=F32_ATOL, rtol=0)
    torch.testing.assert_close(got.aux_loss, full.aux_loss, atol=0, rtol=0)
    torch.testing.assert_close(got.expert_load, full.expert_load, atol=0, rtol=0)
    assert got_grads.keys() == full_grads.keys()
    for name, g in full_grads.items():
        torch.testing.assert_close(got_grads[name], g, atol=F32_GRAD_RTOL * float(g.abs().max()), rtol=0, msg=name)
