"""The lean training forward gives the log-probs, entropy and parameter gradients of the
transformers forward, on the layouts the learner passes it, and refuses the models whose
forward it does not reproduce.

The expected values come from transformers' own forward over every row's whole sequence
(logits, log-softmax and entropy written out here), not from rltune's code.

Tolerances in float32 (machine epsilon 1.2e-7; bfloat16's at :data:`BF16_TOL`):

- log-probs and entropy, 1e-5 absolute. Both sides compute the same dot products of at
  most 4 x 48 terms; the lean path may group tokens into other matrix shapes (prompts and
  completions in one product), which changes the kernel's summation order, so each
  product differs by a few ulps of its terms (~1e-7 at these O(1) magnitudes). Two or
  three layers, the head and a logsumexp over 64 logits carry that to ~1e-6 at most
  (measured: at most 9.5e-7, a few ulps of a log-prob near -4); a wrong rotary phase or
  an unmasked padded key moves them by 0.1-0.5 (checked by breaking each on purpose; the
  weights are drawn with std 0.1, not HF's 0.02, so that attention is not near uniform
  and such mistakes show).
- gradients, 1e-5 of the largest gradient entry of the model. A weight's gradient is a
  sum over every token of the batch (~100 terms here), in another order when the lean
  path runs one product where HF runs a prompt and a completion product and adds them:
  a relative error of ~100 ulps ~ 1e-5 at worst, 8.3e-7 measured; comparing against the
  largest entry keeps near-zero entries (bias gradients) from failing on absolute noise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config

from rltune.config.schema import LoraConfig
from rltune.learner.memory import apply_activation_checkpointing
from rltune.data.collate import join
from rltune.models.lean_forward import lean_completion_logprobs, supports_lean_forward
from rltune.models.lora import apply_lora

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64
SMALL = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             initializer_range=0.1)  # see the module docstring
CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "qwen2-tied": lambda: Qwen2Config(**SMALL, tie_word_embeddings=True),  # q/k/v bias
    "qwen2-untied": lambda: Qwen2Config(**SMALL, tie_word_embeddings=False),
    "llama-mha": lambda: LlamaConfig(**{**SMALL, "num_key_value_heads": 4}),  # no GQA
    "llama-bias": lambda: LlamaConfig(**SMALL, attention_bias=True),  # o bias too
    "mistral": lambda: MistralConfig(**SMALL, sliding_window=None, tie_word_embeddings=False),
}
LOGP_TOL = 1e-5  # see the module docstring
GRAD_TOL = 1e-5  # of the largest gradient entry; see the module docstring


def build(config: PretrainedConfig, *, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised model in training mode, its biases non-zero (they start at 0)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float().train()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0.0, 0.5)
    return model


def batch(prompt_lens: list[int], sizes: list[int], completion_lens: list[int]
          ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Prompts of the given lengths (left padded), ``sizes[i]`` adjacent rows of prompt
    ``i``, completions of the given lengths (right padded)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g) for n in prompt_lens]
    rows = [p for p, k in zip(prompts, sizes) for _ in range(k)]
    completions = [torch.randint(1, VOCAB, (n,), generator=g) for n in completion_lens]
    return join(rows, completions, 0)


LAYOUTS: dict[str, tuple[list[int], list[int], list[int]]] = {
    # shared prompts (groups of 2, 1, 3), left and right padding
    "shared-padded": ([3, 6, 4], [2, 1, 3], [4, 1, 3, 2, 5, 4]),
    # shared prompts of one length, completions of one token (the prompt pass alone)
    "shared-one-token": ([5, 5], [2, 2], [1, 1, 1, 1]),
    # no prompt shared, left and right padding (whole rows under a mask)
    "rows-padded": ([3, 6, 4], [1, 1, 1], [4, 1, 3]),
    # no prompt shared, right padding only (whole rows, causal, no mask)
    "rows-right-padded": ([5, 5, 5], [1, 1, 1], [2, 6, 3]),
}


def hf_stats(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, p: int, temperature: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy ``[B, C]`` from the HF forward over the whole rows, 0 on padding."""
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                   use_cache=False).logits[:, p - 1:-1] / temperature
    logp = torch.log_softmax(logits.float(), dim=-1)
    valid = mask[:, p:].bool()
    token = logp.gather(-1, ids[:, p:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.where(valid, token, 0.0), torch.where(valid, entropy.detach(), 0.0)


def grads_of(model: torch.nn.Module, logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of a fixed weighted sum of ``logprobs`` (then cleared)."""
    weights = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(2))
    (logprobs * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def assert_same(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, p: int, *,
                temperature: float = 1.0, chunk_tokens: int | None = None) -> None:
    assert supports_lean_forward(model)
    want_logp, want_entropy = hf_stats(model, ids, mask, p, temperature)
    want = grads_of(model, want_logp)
    logp, entropy = lean_completion_logprobs(model, ids, mask, p, temperature=temperature,
                                             with_entropy=True, chunk_tokens=chunk_tokens)
    got = grads_of(model, logp)
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=LOGP_TOL)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=LOGP_TOL)
    assert not entropy.requires_grad
    scale = max(g.abs().max() for g in want.values())
    assert scale > 0
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=GRAD_TOL * scale, msg=name)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_logprobs_entropy_and_gradients_equal_hf(arch: str, layout: str) -> None:
    ids, mask, p = batch(*LAYOUTS[layout])
    assert_same(build(CONFIGS[arch]()), ids, mask, p)


BF16_TOL = 2e-2
"""bfloat16 (and CPU autocast to it): 8 significant bits, so one rounding of an O(1) logit
or weight-gradient entry moves it by up to 2^-8 relative; the two paths round after
differently grouped products, so values may differ by about one bf16 ulp (7.8e-3 at
1-2): 2e-2 absolute on log-probs and of the largest gradient entry allows two (measured:
at most 9.0e-3 and 9.1e-3); a wrong mask or rotary phase moves log-probs by 0.1-0.5."""


@pytest.mark.parametrize("layout", ["shared-padded", "rows-padded"])
@pytest.mark.parametrize("precision", ["bf16", "autocast"])
@pytest.mark.parametrize("arch", ["qwen2-tied", "mistral"])
def test_bfloat16_and_autocast(arch: str, precision: str, layout: str) -> None:
    model = build(CONFIGS[arch]())
    model = model.to(torch.bfloat16) if precision == "bf16" else model
    ids, mask, p = batch(*LAYOUTS[layout])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
        want_logp, want_entropy = hf_stats(model, ids, mask, p, 1.0)
        logp, entropy = lean_completion_logprobs(model, ids, mask, p, with_entropy=True)
    want, got = grads_of(model, want_logp), grads_of(model, logp)
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=BF16_TOL)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=BF16_TOL)
    scale = max(g.abs().max().float() for g in want.values())
    for name in want:
        torch.testing.assert_close(got[name].float(), want[name].float(), rtol=0, atol=BF16_TOL * scale, msg=name)


def test_temperature_and_chunks(tiny_dir: str) -> None:
    """The project's tiny model (Qwen2, tied, 4 layers, GQA), temperature-scaled, the head
    in chunks of 3 tokens (recomputed in the backward)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).train()
    ids, mask, p = batch(*LAYOUTS["shared-padded"])
    assert_same(model, ids.clamp(max=model.config.vocab_size - 1), mask, p, temperature=0.7, chunk_tokens=3)


def test_the_parameters_are_the_models_own() -> None:
    """A weight changed in place (as an optimizer step does) changes the next result."""
    model = build(CONFIGS["qwen2-tied"]())
    ids, mask, p = batch(*LAYOUTS["shared-padded"])
    before, _ = lean_completion_logprobs(model, ids, mask, p)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1.5)
    after, _ = lean_completion_logprobs(model, ids, mask, p)
    assert (after - before).abs().max() > 1e-3
    assert_same(model, ids, mask, p)


def test_the_padding_row_gets_no_gradient() -> None:
    """With ``pad_token_id`` set, the embedding's ``padding_idx`` row gets no gradient from
    the lookup (``nn.Embedding``'s rule), also where the pad id is an attended token; with
    tied embeddings the head's gradient still reaches that row."""
    for tied in (True, False):
        model = build(Qwen2Config(**SMALL, tie_word_embeddings=tied, pad_token_id=0))
        assert model.model.embed_tokens.padding_idx == 0
        ids, mask, p = batch(*LAYOUTS["shared-padded"])
        ids[0, p - 1] = ids[1, p - 1] = ids[0, p + 1] = 0  # in a shared prompt and a completion
        assert_same(model, ids, mask, p)
        logp, _ = lean_completion_logprobs(model, ids, mask, p)
        logp.sum().backward()
        pad_row = model.model.embed_tokens.weight.grad[0]
        assert (pad_row.abs().max() > 0) if tied else bool((pad_row == 0).all())
        model.zero_grad(set_to_none=True)


REFUSED: dict[str, Callable[[], Any]] = {
    "rope-linear": lambda: build(LlamaConfig(**SMALL, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "rope-yarn": lambda: build(Qwen2Config(**SMALL, rope_scaling={"rope_type": "yarn", "factor": 2.0})),
    "qwen2-sliding": lambda: build(Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=16,
                                               max_window_layers=0)),
    "mistral-sliding": lambda: build(MistralConfig(**SMALL, sliding_window=16)),
    "attention-dropout": lambda: build(Qwen2Config(**SMALL, attention_dropout=0.1)),
    "lora": lambda: apply_lora(build(CONFIGS["qwen2-tied"]()), LoraConfig(r=4)),
    "lora-base": lambda: apply_lora(build(CONFIGS["qwen2-tied"]()), LoraConfig(r=4)).get_base_model(),
    "float16": lambda: build(CONFIGS["llama-mha"]()).half(),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_models_are_refused(name: str) -> None:
    model = REFUSED[name]()
    assert not supports_lean_forward(model)
    ids, mask, p = batch(*LAYOUTS["rows-padded"])
    with pytest.raises(ValueError, match="not supported by the lean forward"):
        lean_completion_logprobs(model, ids, mask, p)


def test_hooks_and_replaced_forwards_are_refused() -> None:
    model = build(CONFIGS["qwen2-tied"]())
    assert supports_lean_forward(model)
    handle = model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: None)
    assert not supports_lean_forward(model)  # the lean path calls no module: the hook would be skipped
    handle.remove()
    assert supports_lean_forward(model)
    mlp = model.model.layers[1].mlp
    mlp.forward = lambda x: 2 * type(mlp).forward(mlp, x)  # a patch the lean path would skip
    assert not supports_lean_forward(model)
    del mlp.forward
    model.model.layers[1].__dict__["_rltune_compiled"] = True
    assert not supports_lean_forward(model)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_blocks_are_recomputed_with_the_same_gradients(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks checkpointed by the learner (``train.activation_checkpointing``) run under
    ``torch.utils.checkpoint`` in the lean path too: the same log-probs and gradients to
    the bit (the same arithmetic), and the checkpointed blocks run again in the backward."""
    import rltune.models.lean_forward as lean

    plain = build(Qwen2Config(**{**SMALL, "num_hidden_layers": 4}))
    ids, mask, p = batch(*LAYOUTS["shared-padded"])
    want_logp, _ = lean_completion_logprobs(plain, ids, mask, p)
    want = grads_of(plain, want_logp)
    apply_activation_checkpointing(plain, mode)
    assert supports_lean_forward(plain)
    calls = []
    block = lean._block
    monkeypatch.setattr(lean, "_block", lambda *a, **kw: calls.append(1) or block(*a, **kw))
    logp, _ = lean_completion_logprobs(plain, ids, mask, p)
    got = grads_of(plain, logp)
    assert torch.equal(logp, want_logp)
    assert all(torch.equal(got[name], want[name]) for name in want)
    assert len(calls) == 4 + {"full": 4, "selective": 2}[mode]  # the forward, then the recomputes
    assert_same(plain, ids, mask, p)


def test_attention_dropout_is_refused_only_in_training() -> None:
    model = build(Qwen2Config(**SMALL, attention_dropout=0.1))
    assert not supports_lean_forward(model)
    assert supports_lean_forward(model.eval())  # no dropout in eval mode


def test_completion_logprobs_runs_the_lean_forward_where_supported(monkeypatch: pytest.MonkeyPatch) -> None:
    """``completion_logprobs`` takes the lean path for a supported model (the same
    tensors as calling it directly) and the transformers forward for one it refuses."""
    import rltune.models.lean_forward as lean
    from rltune.models.logprobs import completion_logprobs

    model = build(CONFIGS["qwen2-tied"]())
    ids, mask, p = batch(*LAYOUTS["shared-padded"])
    calls = []
    block = lean._block
    monkeypatch.setattr(lean, "_block", lambda *a, **kw: calls.append(1) or block(*a, **kw))
    out = completion_logprobs(model, ids, mask, p, temperature=0.7, with_entropy=True)
    assert len(calls) == 2  # one call per layer
    logp, entropy = lean_completion_logprobs(model, ids, mask, p, temperature=0.7, with_entropy=True)
    assert torch.equal(out.logprobs, logp) and torch.equal(out.entropy, entropy)
    calls.clear()
    handle = model.model.register_forward_hook(lambda *_: None)
    try:
        out = completion_logprobs(model, ids, mask, p, temperature=0.7, with_entropy=True)
    finally:
        handle.remove()
    assert not calls  # the hooked model ran transformers' forward
    torch.testing.assert_close(out.logprobs, logp, rtol=0, atol=LOGP_TOL)
