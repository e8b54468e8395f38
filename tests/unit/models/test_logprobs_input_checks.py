"""completion_logprobs and the chunked head on out-of-domain arguments: a clear error
naming the argument, or the log-probs of the equivalent in-domain call."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, Qwen2Config

from rltune.models.chunked import ChunkedHead, chunked_stats
from rltune.models.lean_forward import supports_lean_forward
from rltune.models.load import load_model
from rltune.models.logprobs import completion_logprobs, position_ids_from_mask
from rltune.models.tiny import TINY_SPECS, build_tiny

VOCAB = 50
PROMPT = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.nn.Module]:
    """The three forward paths: the lean one (builtin tiny), the transformers one with the
    chunked head (a Qwen2 in float64, which the lean forward does not take), and GPT-2's
    absolute positions."""
    torch.manual_seed(0)
    qwen = AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3)).double().eval()
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=64, initializer_range=0.3)).double().eval()
    tiny = load_model(str(build_tiny(tmp_path_factory.mktemp("tiny"), seed=0, **TINY_SPECS["tiny"])))
    assert supports_lean_forward(tiny) and not supports_lean_forward(qwen)
    return {"lean": tiny, "qwen2": qwen, "gpt2": gpt2}


def _vocab(model: torch.nn.Module) -> int:
    return model.get_input_embeddings().num_embeddings


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 4 prompt + 4 completion columns: left padding on row 1, right on row 2."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, vocab, (3, PROMPT + 4), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, 6:] = 0
    return ids, mask


@pytest.mark.parametrize("path", ["lean", "qwen2", "gpt2"])
def test_mask_values_other_than_one_count_as_attended(models, path):
    model = models[path]
    ids, mask = _batch(_vocab(model))
    want = completion_logprobs(model, ids, mask, PROMPT).logprobs
    twos = mask * 2
    twos[0, 1] = 3
    for other in (twos, mask.bool(), mask.float()):
        torch.testing.assert_close(completion_logprobs(model, ids, other, PROMPT).logprobs, want, rtol=0, atol=0)


def test_position_ids_count_nonzero_entries():
    mask = torch.tensor([[0, 0, 2, 1, 5, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2, 2]]


@pytest.mark.parametrize("path", ["lean", "qwen2", "gpt2"])
@pytest.mark.parametrize(("row", "col", "value"), [(0, 6, None), (1, 0, None), (0, 0, -1)])
def test_token_ids_outside_the_vocabulary_are_named(models, path, row, col, value):
    # (1, 0) is a padding position: the model embeds it all the same
    model = models[path]
    vocab = _vocab(model)
    ids, mask = _batch(vocab)
    ids[row, col] = vocab if value is None else value
    with pytest.raises(ValueError, match=rf"input_ids hold token ids from .* vocabulary of {vocab} "):
        completion_logprobs(model, ids, mask, PROMPT)


@pytest.mark.parametrize("path", ["lean", "qwen2"])
def test_chunk_tokens(models, path):
    model = models[path]
    ids, mask = _batch(_vocab(model))
    full = completion_logprobs(model, ids, mask, PROMPT, chunk_tokens=0).logprobs
    torch.testing.assert_close(completion_logprobs(model, ids, mask, PROMPT, chunk_tokens=2).logprobs, full,
                               rtol=0, atol=2e-6)
    with pytest.raises(ValueError, match="chunk_tokens=-1 must be >= 0"):
        completion_logprobs(model, ids, mask, PROMPT, chunk_tokens=-1)
    with pytest.raises(TypeError, match="chunk_tokens=2.0"):
        completion_logprobs(model, ids, mask, PROMPT, chunk_tokens=2.0)


def test_chunked_head_and_stats_refuse_bad_sizes(models):
    model = models["qwen2"]
    targets, valid = torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="ChunkedHead: chunk_tokens=0 must be >= 1"):
        ChunkedHead(model.lm_head, targets, valid, temperature=1.0, with_entropy=False, chunk_tokens=0,
                    transform=lambda z: z)
    hidden = torch.zeros(1, 2, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="chunked_stats: chunk_tokens=-3"):
        chunked_stats(model, hidden, targets, valid, temperature=1.0, with_entropy=False, chunk_tokens=-3)


@pytest.mark.parametrize("path", ["lean", "qwen2"])
def test_argument_types_and_an_empty_batch(models, path):
    model = models[path]
    ids, mask = _batch(_vocab(model))
    with pytest.raises(ValueError, match=r"input_ids has shape \(0, 8\): no rows"):
        completion_logprobs(model, ids[:0], mask[:0], PROMPT)
    with pytest.raises(TypeError, match="prompt_len=True"):
        completion_logprobs(model, ids, mask, True)
    with pytest.raises(TypeError, match="prompt_len=4.0"):
        completion_logprobs(model, ids, mask, 4.0)
    with pytest.raises(TypeError, match="input_ids has dtype torch.float32"):
        completion_logprobs(model, ids.float(), mask, PROMPT)
