"""HFGenerator on the built-in tiny model: grouping, engine log-probs against the
learner's recompute, determinism, EOS, length limit and stop strings."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from rltune.data.collate import collate_rollouts
from rltune.data.records import Prompt, SamplingParams
from rltune.models.logprobs import completion_logprobs
from rltune.rollout.hf import HFGenerator

TEXTS = ("What is 2+3?", "Hi", "A longer prompt, with several words in it.")


def byte_id(char: str) -> int:
    """Id of a one-byte character in the tiny tokenizer (bytes start at id 4)."""
    (b,) = char.encode("utf-8")
    return 4 + b


@pytest.fixture(scope="module")
def prompts(tokenizer: PreTrainedTokenizerBase) -> list[Prompt]:
    return [Prompt(id=f"p{i}", text=t, input_ids=tokenizer.encode(t)) for i, t in enumerate(TEXTS)]


def generator(model, tokenizer, seed: int = 0) -> HFGenerator:
    return HFGenerator(model, tokenizer, rng=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def steer(model: torch.nn.Module, *, force: dict[tuple[int, int], int], ban: Sequence[int] = ()) -> Iterator[None]:
    """Make the model emit token ``force[(row, step)]`` at decode ``step`` of ``row`` and
    never emit a ``ban`` token otherwise, by editing the lm_head output (one call per
    decode step: the prefill produces step 0)."""
    steps = itertools.count()

    def hook(_module, _args, logits: torch.Tensor) -> torch.Tensor:
        step = next(steps)
        logits = logits.clone()
        logits[..., list(ban)] = -1e4
        for (row, at), token in force.items():
            if at == step:
                logits[row, -1, token] = 1e4
        return logits

    handle = model.lm_head.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def test_n_samples_per_prompt_are_adjacent_and_grouped(tiny_model, tokenizer, prompts) -> None:
    gen = generator(tiny_model, tokenizer)
    gen.load_weights(7)
    out = gen.generate(prompts, SamplingParams(n=4, max_new_tokens=5), group_offset=10)
    assert len(out) == len(prompts) * 4
    for i, r in enumerate(out):
        prompt = prompts[i // 4]
        assert r.group == 10 + i // 4
        assert r.prompt_id == prompt.id
        assert r.prompt_ids.tolist() == prompt.input_ids
        assert r.policy_version == 7
        length = len(r.completion_ids)
        assert 1 <= length <= 5
        assert r.completion_logprobs.shape == r.loss_mask.shape == (length,)
        assert torch.equal(r.loss_mask, torch.ones(length))
        assert r.text == tokenizer.decode(r.completion_ids, skip_special_tokens=True)
    # the samples of one prompt are drawn independently, not copied
    assert len({tuple(r.completion_ids.tolist()) for r in out[:4]}) == 4


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_equal_the_learner_recompute(tiny_model, tokenizer, prompts, temperature) -> None:
    # single-letter stop strings end rows at different lengths, so the collated batch has
    # left-padded prompts and right-padded completions
    params = SamplingParams(
        n=3, max_new_tokens=16, temperature=temperature, stop=tuple("etaoinshrdlu")
    )
    rollouts = generator(tiny_model, tokenizer).generate(prompts, params)
    assert len({len(r.completion_ids) for r in rollouts}) > 2
    batch = collate_rollouts(rollouts, tokenizer.pad_token_id)
    with torch.no_grad():
        out = completion_logprobs(
            tiny_model, batch.input_ids, batch.attention_mask, batch.prompt_len, temperature=temperature
        )
    mask = batch.loss_mask.bool()
    assert int(mask.sum()) == sum(len(r.completion_ids) for r in rollouts)
    torch.testing.assert_close(
        batch.behaviour_logprobs[mask], out.logprobs[mask], rtol=0, atol=1e-4
    )
    # a random tiny model is near uniform over 260 tokens: log-probs near log(1/260),
    # scaled by 1/T; far from 0, so the comparison above is not trivially met
    assert float(out.logprobs[mask].mean()) < -4.0


def test_greedy_is_deterministic_and_equals_top_k_1(tiny_model, tokenizer, prompts) -> None:
    greedy = SamplingParams(n=2, max_new_tokens=8, temperature=0.0)
    a = generator(tiny_model, tokenizer, seed=0).generate(prompts, greedy)
    b = generator(tiny_model, tokenizer, seed=1).generate(prompts, greedy)
    k1 = generator(tiny_model, tokenizer, seed=2).generate(
        prompts, SamplingParams(n=2, max_new_tokens=8, temperature=1.0, top_k=1)
    )
    for x, y, z in zip(a, b, k1):
        assert torch.equal(x.completion_ids, y.completion_ids)
        assert torch.equal(x.completion_ids, z.completion_ids)
        # both report log-probs under T = 1
        torch.testing.assert_close(x.completion_logprobs, z.completion_logprobs, rtol=0, atol=1e-6)
    # greedy: each token is the argmax of the model's next-token distribution
    batch = collate_rollouts(a, tokenizer.pad_token_id)
    with torch.no_grad():
        logits = tiny_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    predicted = logits[:, batch.prompt_len - 1 : -1].argmax(-1)
    mask = batch.loss_mask.bool()
    assert torch.equal(predicted[mask], batch.input_ids[:, batch.prompt_len :][mask])


def test_same_seed_same_samples_other_seed_other_samples(tiny_model, tokenizer, prompts) -> None:
    params = SamplingParams(n=2, max_new_tokens=8)

    def ids(seed: int) -> list[list[int]]:
        return [r.completion_ids.tolist() for r in generator(tiny_model, tokenizer, seed).generate(prompts, params)]

    assert ids(3) == ids(3)
    assert ids(3) != ids(4)


def test_eos_ends_one_row_and_max_new_tokens_the_other(tiny_model, tokenizer, prompts) -> None:
    eos = tokenizer.eos_token_id
    with steer(tiny_model, force={(0, 2): eos}, ban=[eos]):
        first, second = generator(tiny_model, tokenizer).generate(
            prompts[:2], SamplingParams(max_new_tokens=6)
        )
    assert first.finish_reason == "stop"
    assert len(first.completion_ids) == 3
    assert first.completion_ids.tolist()[-1] == eos
    assert eos not in first.completion_ids.tolist()[:-1]
    assert first.completion_logprobs[-1] == pytest.approx(0.0, abs=1e-6)  # forced: p = 1
    assert first.text == tokenizer.decode(first.completion_ids[:2])  # EOS not in the text
    assert second.finish_reason == "length"
    assert len(second.completion_ids) == 6
    assert eos not in second.completion_ids.tolist()


@pytest.mark.parametrize("stop", ["XY", "é"], ids=["ascii-two-tokens", "two-byte-char"])
def test_stop_string_cuts_the_text_and_ends_only_its_row(tiny_model, tokenizer, prompts, stop: str) -> None:
    stop_ids = tokenizer.encode(stop)
    assert len(stop_ids) == 2  # the stop string spans two tokens
    eos = tokenizer.eos_token_id
    force = {(0, 2): stop_ids[0], (0, 3): stop_ids[1]}
    with steer(tiny_model, force=force, ban=[eos, *stop_ids, byte_id("X")]):
        first, second = generator(tiny_model, tokenizer).generate(
            prompts[:2], SamplingParams(max_new_tokens=8, stop=(stop, "never-produced"))
        )
    assert first.finish_reason == "stop"
    assert first.completion_ids.tolist()[2:] == stop_ids  # generation ended right after it
    assert first.text == tokenizer.decode(first.completion_ids[:2])  # stop string cut off
    assert stop not in first.text
    assert second.finish_reason == "length"
    assert len(second.completion_ids) == 8
    assert second.text == tokenizer.decode(second.completion_ids)


def test_stop_string_is_found_inside_a_token_run(tiny_model, tokenizer, prompts) -> None:
    """A stop string that begins after earlier text on the same row is still found."""
    ban = [tokenizer.eos_token_id, byte_id("Q"), byte_id(":")]
    force = {(0, 4): byte_id("Q"), (0, 5): byte_id(":")}
    with steer(tiny_model, force=force, ban=ban):
        (row,) = generator(tiny_model, tokenizer).generate(
            prompts[:1], SamplingParams(max_new_tokens=10, stop=("Q:",))
        )
    assert len(row.completion_ids) == 6
    assert row.text == tokenizer.decode(row.completion_ids[:4])


def test_generator_restores_training_mode(tiny_model, tokenizer, prompts) -> None:
    tiny_model.train()
    try:
        generator(tiny_model, tokenizer).generate(prompts[:1], SamplingParams(max_new_tokens=2))
        assert tiny_model.training
    finally:
        tiny_model.eval()


def test_prompt_without_input_ids_is_an_error(tiny_model, tokenizer) -> None:
    with pytest.raises(ValueError, match="has no input_ids"):
        generator(tiny_model, tokenizer).generate([Prompt(id="raw", text="x")], SamplingParams())
