"""The prompt run once per group gives the whole-sequence forward's log-probs, entropy
and gradients, and completion_logprobs takes that path where rows share a prompt.

The expected values come from transformers' own forward over every row's whole sequence
(the logits, log-softmax and entropy written out here), not from rltune's code."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from rltune.data.collate import join
from rltune.models.logprobs import completion_logprobs
from rltune.models.shared_prompt import prompt_groups, shared_prompt_stats, shares_prompts


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=50, max_position_embeddings=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).float()


def _batch(prompt_lens: list[int], sizes: list[int], completion_lens: list[int]):
    """Prompts of the given lengths, ``sizes[i]`` completions of prompt ``i``."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 50, (n,), generator=g) for n in prompt_lens]
    rows = [p for p, k in zip(prompts, sizes) for _ in range(k)]
    completions = [torch.randint(1, 50, (n,), generator=g) for n in completion_lens]
    return join(rows, completions, 0)


def _whole(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, p: int, temperature: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy ``[B, C]`` of the completions from one forward over the whole
    rows, 0 on padding."""
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, p - 1:-1] / temperature
    logp = torch.log_softmax(logits.float(), dim=-1)
    valid = mask[:, p:].bool()
    token = logp.gather(-1, ids[:, p:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.where(valid, token, 0.0), torch.where(valid, entropy.detach(), 0.0)


def test_groups_are_the_runs_of_equal_prompts() -> None:
    ids, mask, p = _batch([3, 5, 3], [2, 1, 3], [2, 2, 2, 2, 2, 2])
    assert prompt_groups(ids, mask, p).tolist() == [0, 0, 1, 2, 2, 2]
    ids, mask, p = _batch([3, 4], [1, 1], [2, 2])
    assert prompt_groups(ids, mask, p) is None  # no row shares its prompt


@pytest.mark.parametrize("completion_lens", [[4, 1, 3, 2, 5, 4], [1, 1, 1, 1, 1, 1]])
def test_same_logprobs_entropy_and_gradients(model: torch.nn.Module, completion_lens: list[int]) -> None:
    # left padding (prompts of 3, 6 and 4 tokens), groups of 2, 1 and 3, right padding
    ids, mask, p = _batch([3, 6, 4], [2, 1, 3], completion_lens)
    groups = prompt_groups(ids, mask, p)
    whole_logprobs, whole_entropy = _whole(model, ids, mask, p, 0.7)
    model.zero_grad()
    whole_logprobs.sum().backward()
    expected = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad()
    logprobs, entropy = shared_prompt_stats(model, ids, mask, p, groups, temperature=0.7, with_entropy=True)
    logprobs.sum().backward()
    # float32 sums over a few hundred terms in another order: agreement to ~1e-6, not bitwise
    torch.testing.assert_close(logprobs, whole_logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, whole_entropy, rtol=0, atol=1e-5)
    for name, q in model.named_parameters():
        scale = expected[name].abs().max().item()
        assert (q.grad - expected[name]).abs().max().item() <= 1e-5 * max(scale, 1.0), name
    model.zero_grad()


def test_only_plain_models_share(model: torch.nn.Module) -> None:
    assert shares_prompts(model)
    block = model.model.layers[0]
    block.__dict__["_rltune_checkpointed"] = True  # recomputed in the backward, cache and all
    try:
        assert not shares_prompts(model)
    finally:
        del block.__dict__["_rltune_checkpointed"]


def test_completion_logprobs_runs_each_prompt_once(model: torch.nn.Module) -> None:
    ids, mask, p = _batch([3, 6, 4], [2, 1, 3], [4, 1, 3, 2, 5, 4])
    rows: list[int] = []
    hook = model.model.register_forward_pre_hook(
        lambda _m, _args, kwargs: rows.append(int(kwargs["input_ids"].shape[0])), with_kwargs=True)
    try:
        out = completion_logprobs(model, ids, mask, p, temperature=0.7, with_entropy=True)
    finally:
        hook.remove()
    assert rows == [3, 6]  # the three distinct prompts, then the six rows' completions
    expected, entropy = _whole(model, ids, mask, p, 0.7)
    # the fp32 sums of another order, as above
    torch.testing.assert_close(out.logprobs, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.entropy, entropy, rtol=0, atol=1e-5)
    rows.clear()
    distinct, dmask, dp = _batch([3, 6], [1, 1], [2, 3])
    hook = model.model.register_forward_pre_hook(
        lambda _m, _args, kwargs: rows.append(int(kwargs["input_ids"].shape[0])), with_kwargs=True)
    try:
        completion_logprobs(model, distinct, dmask, dp)
    finally:
        hook.remove()
    assert rows == [2]  # no prompt shared: one forward over the whole rows
