"""The reward-model reward: the scores of score_completions on the sequences the reward model
was trained on (prompt ids, completion bytes, EOS), whatever the batch size or sample order,
one load per configuration, and per-sample errors for samples it cannot score."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rltune.data.records import Prompt
from rltune.models.load import ModelLoadError, load_tokenizer
from rltune.models.reward_model import load_reward_model, score_completions
from rltune.models.tiny import TINY_SPECS, build_tiny
from rltune.rewards import model_rewards
from rltune.rewards.contract import is_batched
from rltune.rewards.model_rewards import reward_model

PAD, IM_START, EOS = 0, 2, 3  # ids of the tiny tokenizer; byte b is id 4 + b


def byte_ids(text: str) -> list[int]:
    """The tiny tokenizer's ids of ``text``, worked out from its definition."""
    return [4 + b for b in text.encode()]


@pytest.fixture(autouse=True)
def _fresh(one_thread: None) -> Iterator[None]:
    model_rewards.clear_cache()
    yield
    model_rewards.clear_cache()


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A saved reward model: the tiny LM's decoder with a seeded head, and its tokenizer."""
    lm_dir = build_tiny(tmp_path_factory.mktemp("lm"), seed=0, **TINY_SPECS["tiny"])
    out = tmp_path_factory.mktemp("rm")
    load_reward_model(str(lm_dir), seed=3).save_pretrained(out)
    load_tokenizer(str(lm_dir)).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def rm(rm_dir: str) -> torch.nn.Module:
    return load_reward_model(rm_dir).eval()


def _samples(n: int, seed: int = 0) -> tuple[list[Prompt], list[str]]:
    """``n`` samples with pre-tokenised prompts, every one longer than the one before, so
    sorting by length leaves them in this order."""
    rng = random.Random(seed)
    prompts, completions = [], []
    for i in range(n):
        ids = [rng.randrange(4, 260) for _ in range(3 + i)]
        prompts.append(Prompt(id=f"p{i}", text="unused", input_ids=ids))
        completions.append("".join(rng.choice("abcxyz ") for _ in range(2 + i)))
    return prompts, completions


def _expected(rm: torch.nn.Module, prompts, completions, batch_size: int) -> list[float]:
    ids = [p.input_ids for p in prompts]
    return score_completions(
        rm, ids, [byte_ids(c) + [EOS] for c in completions], PAD, batch_size=batch_size
    ).tolist()


def test_is_a_batched_reward() -> None:
    assert is_batched(reward_model)


def test_scores_equal_score_completions_on_prompt_ids_completion_and_eos(rm_dir, rm) -> None:
    prompts, completions = _samples(7)
    got = reward_model(prompts, completions, path=rm_dir, batch_size=3)
    assert got == _expected(rm, prompts, completions, batch_size=3)
    # the EOS matters: without it the scores are different numbers
    no_eos = score_completions(rm, [p.input_ids for p in prompts],
                               [byte_ids(c) for c in completions], PAD, batch_size=3).tolist()
    assert all(abs(a - b) > 1e-4 for a, b in zip(got, no_eos))


def test_scale_and_shift_are_affine_on_the_raw_score(rm_dir, rm) -> None:
    prompts, completions = _samples(4)
    got = reward_model(prompts, completions, path=rm_dir, scale=2.0, shift=-0.5)
    assert got == [2.0 * s - 0.5 for s in _expected(rm, prompts, completions, batch_size=32)]


def test_sample_order_does_not_change_any_score(rm_dir) -> None:
    prompts, completions = _samples(9)
    base = reward_model(prompts, completions, path=rm_dir, batch_size=4)
    order = list(range(9))
    random.Random(1).shuffle(order)
    shuffled = reward_model([prompts[i] for i in order], [completions[i] for i in order],
                            path=rm_dir, batch_size=4)
    assert shuffled == [base[i] for i in order]  # bitwise: batches are formed by length


@pytest.mark.parametrize("batch_size", [1, 2, 5, 64])
def test_batch_size_does_not_change_the_scores(rm_dir, batch_size: int) -> None:
    prompts, completions = _samples(9)
    one_row = reward_model(prompts, completions, path=rm_dir, batch_size=1)
    got = reward_model(prompts, completions, path=rm_dir, batch_size=batch_size)
    # only the padding differs between batchings: float32 rounding, nothing more
    torch.testing.assert_close(torch.tensor(got), torch.tensor(one_row), rtol=0, atol=2e-6)


def test_prompt_without_ids_is_rendered_with_the_chat_template(rm_dir, rm) -> None:
    rendered = ([IM_START] + byte_ids("user\nWhat is 2+2?") + [EOS] + byte_ids("\n")
                + [IM_START] + byte_ids("assistant\n"))
    as_ids = Prompt(id="ids", text="ignored", input_ids=rendered)
    as_text = Prompt(id="text", text="What is 2+2?")
    got = reward_model([as_text], ["4"], path=rm_dir)
    assert got == reward_model([as_ids], ["4"], path=rm_dir)
    assert got == score_completions(rm, [rendered], [byte_ids("4") + [EOS]], PAD).tolist()


def test_unscorable_samples_are_errors_in_place(rm_dir) -> None:
    prompts, completions = _samples(3)
    foreign = Prompt(id="foreign", text="hi", input_ids=[5, 999, 6])  # not a tiny-vocab id
    too_long = Prompt(id="long", text="hi", input_ids=[5] * 600)  # tiny: 512 positions
    got = reward_model([prompts[0], foreign, prompts[1], too_long, prompts[2]],
                       [completions[0], "a", completions[1], "a", completions[2]],
                       path=rm_dir, batch_size=1)
    assert isinstance(got[1], ValueError) and isinstance(got[3], ValueError)
    assert "'foreign'" in str(got[1]) and "[999]" in str(got[1])
    assert "render_prompt: true" in str(got[1])
    assert "'long'" in str(got[3]) and "max_position_embeddings=512" in str(got[3])
    assert [got[0], got[2], got[4]] == reward_model(prompts, completions, path=rm_dir,
                                                    batch_size=1)


def test_render_prompt_ignores_the_policy_ids(rm_dir) -> None:
    foreign = Prompt(id="foreign", text="hi", input_ids=[5, 999, 6])
    plain = Prompt(id="plain", text="hi")
    assert reward_model([foreign], ["ok"], path=rm_dir, render_prompt=True) == reward_model(
        [plain], ["ok"], path=rm_dir
    )


def test_the_model_is_loaded_once_per_configuration(rm_dir, monkeypatch) -> None:
    calls: list[str] = []
    real = model_rewards.load_reward_model

    def counting(path: str, **kwargs):
        calls.append(path)
        return real(path, **kwargs)

    monkeypatch.setattr(model_rewards, "load_reward_model", counting)
    prompts, completions = _samples(2)
    results: list[list] = []
    threads = [
        threading.Thread(target=lambda: results.append(
            reward_model(prompts, completions, path=rm_dir)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 4 and all(r == results[0] for r in results)
    reward_model(prompts, completions, path=rm_dir, batch_size=1, scale=3.0)  # same model
    assert len(calls) == 1
    reward_model(prompts, completions, path=rm_dir, dtype="bfloat16")  # another one
    assert len(calls) == 2


def test_a_missing_model_directory_is_a_clear_error(tmp_path: Path) -> None:
    prompts, completions = _samples(1)
    with pytest.raises(ModelLoadError, match=r"model path .*nowhere does not exist"):
        reward_model(prompts, completions, path=str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match="has no config.json"):
        reward_model(prompts, completions, path=str(tmp_path))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"scale": float("nan")}, "scale must be a finite number"),
    ],
)
def test_bad_settings_are_errors(rm_dir, kwargs, message: str) -> None:
    prompts, completions = _samples(1)
    with pytest.raises(ValueError, match=message):
        reward_model(prompts, completions, path=rm_dir, **kwargs)
