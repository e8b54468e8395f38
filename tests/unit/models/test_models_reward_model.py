"""Reward models: a seeded new head on a causal LM's decoder, scores at the last attended
token whatever the padding, and a saved model that scores the same after loading."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import pytest
import torch

from rltune.data.collate import join
from rltune.models.load import ModelLoadError, load_model
from rltune.models.reward_model import (
    last_attended_index,
    load_reward_model,
    score_completions,
    sequence_scores,
)

EOS = 3  # <|im_end|> of the tiny tokenizer


@pytest.fixture(autouse=True)
def _single_thread(one_thread: None) -> Iterator[None]:
    yield


@pytest.fixture(scope="module")
def rm(tiny_dir: str) -> torch.nn.Module:
    return load_reward_model(tiny_dir, seed=3).eval()


def test_new_head_is_seeded_and_the_decoder_is_the_lm(tiny_dir: str, rm) -> None:
    head = rm.score.weight
    assert tuple(head.shape) == (1, 128) and rm.score.bias is None
    expected = torch.randn(1, 128, generator=torch.Generator().manual_seed(3)) / math.sqrt(129)
    torch.testing.assert_close(head, expected, rtol=1e-6, atol=0)
    # independent of the global RNG, which it leaves alone
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    again = load_reward_model(tiny_dir, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(again.score.weight, head)
    assert not torch.equal(load_reward_model(tiny_dir, seed=4).score.weight, head)
    lm = load_model(tiny_dir)
    for name, p in lm.model.named_parameters():
        assert torch.equal(p, rm.model.get_parameter(name)), name


def test_last_attended_index_by_hand() -> None:
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1], [1, 1, 1, 1],
                         [0, 1, 0, 0]])
    assert last_attended_index(mask).tolist() == [3, 1, 0, 3, 3, 1]
    with pytest.raises(ValueError, match=r"rows \[1\] of the attention mask attend to no token"):
        last_attended_index(torch.tensor([[1, 0], [0, 0]]))


def _unpadded_score(rm, ids: list[int]) -> float:
    """The head applied to the final hidden state of the last token of the row run alone."""
    with torch.no_grad():
        hidden = rm.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        return float(hidden @ rm.score.weight[0])


ROWS = [[40, 41, 42, 43, 44, 45, EOS], [50, 51, EOS], [60, 61, 62, 63, 64], [70]]


@pytest.mark.parametrize("side", ["left", "right"])
def test_scores_do_not_depend_on_padding(rm, side: str) -> None:
    width = max(len(r) for r in ROWS) + 2  # padding on every row
    # pad with EOS, as a tokenizer whose pad token is its EOS would: only the mask says
    # which tokens count
    ids = torch.full((len(ROWS), width), EOS)
    mask = torch.zeros(len(ROWS), width, dtype=torch.long)
    for i, row in enumerate(ROWS):
        cols = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, cols] = torch.tensor(row)
        mask[i, cols] = 1
    with torch.no_grad():
        got = sequence_scores(rm, ids, mask)
    assert got.dtype == torch.float32 and got.shape == (len(ROWS),)
    expected = torch.tensor([_unpadded_score(rm, r) for r in ROWS])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert float(expected.std()) > 0.05  # the rows really score differently


def test_prompt_and_completion_layout_scores_the_last_completion_token(rm) -> None:
    prompts = [torch.tensor([40, 41, 42]), torch.tensor([50])]
    completions = [torch.tensor([60, EOS]), torch.tensor([61, 62, 63, EOS])]
    input_ids, mask, _ = join(prompts, completions, pad_id=EOS)
    with torch.no_grad():
        got = sequence_scores(rm, input_ids, mask)
    expected = [_unpadded_score(rm, [40, 41, 42, 60, EOS]), _unpadded_score(rm, [50, 61, 62, 63, EOS])]
    torch.testing.assert_close(got, torch.tensor(expected), rtol=0, atol=1e-5)


def test_scores_are_differentiable_through_head_and_decoder(tiny_dir: str) -> None:
    model = load_reward_model(tiny_dir, seed=0)
    ids, mask, _ = join([torch.tensor([40, 41])], [torch.tensor([42, EOS])], pad_id=0)
    sequence_scores(model, ids, mask).sum().backward()
    assert float(model.score.weight.grad.abs().sum()) > 0
    assert float(model.model.embed_tokens.weight.grad.abs().sum()) > 0


def test_saved_reward_model_loads_back_and_scores_the_same(tmp_path, tiny_dir: str) -> None:
    model = load_reward_model(tiny_dir, seed=5)
    with torch.no_grad():  # a trained head and decoder, not the fresh ones
        model.score.weight.mul_(-2.0)
        model.model.norm.weight.add_(0.5)
    model.save_pretrained(tmp_path / "rm")
    assert json.loads((tmp_path / "rm" / "config.json").read_text())["architectures"] == [
        "Qwen2ForSequenceClassification"
    ]
    loaded = load_reward_model(str(tmp_path / "rm"), seed=99)  # the saved head, not a new one
    for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), name
    prompts, completions = [[40, 41, 42], [50]], [[60, EOS], [61, 62, EOS]]
    model.train()
    before = score_completions(model, prompts, completions, pad_id=0, batch_size=1)
    after = score_completions(loaded, prompts, completions, pad_id=0, batch_size=2)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
    assert model.training  # score_completions restores the mode


def test_a_scorer_needs_a_trained_head(tmp_path, tiny_dir: str) -> None:
    # a causal LM's directory would score with a random head: refused where a reward is read
    with pytest.raises(ModelLoadError, match=r"holds no trained `score` head \(a causal LM, not a reward model\)"):
        load_reward_model(tiny_dir, new_head=False)
    load_reward_model(tiny_dir).save_pretrained(tmp_path / "rm")
    assert load_reward_model(str(tmp_path / "rm"), new_head=False).score.out_features == 1


def test_load_errors(tmp_path, tiny_dir: str) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_reward_model(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="dtype 'float16'"):
        load_reward_model(tiny_dir, dtype="float16")
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(ModelLoadError, match="no sequence-classification model for model_type"):
        load_reward_model(str(odd))
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        score_completions(load_reward_model(tiny_dir), [[1], [2]], [[3]], pad_id=0)


def test_lora_reward_model_trains_its_head_and_exports_the_scores_it_gives(tiny_dir: str) -> None:
    from rltune.config.schema import LoraConfig
    from rltune.models.lora import apply_lora, merged_copy

    model = apply_lora(load_reward_model(tiny_dir, seed=0), LoraConfig(r=4))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("score" in n for n in trainable) and any("lora_B" in n for n in trainable)
    assert not any("embed_tokens" in n for n in trainable)
    with torch.no_grad():  # adapters that change the output (B starts at 0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    adapted = sequence_scores(model, ids, mask).detach()
    plain = load_reward_model(tiny_dir, seed=0)
    assert not torch.allclose(sequence_scores(plain, ids, mask).detach(), adapted, atol=1e-4)
    merged = merged_copy(model)
    torch.testing.assert_close(sequence_scores(merged, ids, mask).detach(), adapted, atol=1e-5, rtol=0)
