"""Scalar reward models: an HF sequence-classification model with one output, scored at
each sequence's last token.

A reward model is ``AutoModelForSequenceClassification`` with ``num_labels=1``: the
decoder of a causal LM (``model.base_model``) and a linear ``score`` head on its final
hidden states. The score of a sequence is the head's output at the last token the
attention mask attends to: for a (prompt, completion) row that is the completion's last
token, its EOS when it has one.

Loading the directory of a causal LM (``builtin:tiny`` included) gives its decoder and a
*new* head: :func:`load_reward_model` says so by name and initialises that head from its
own seeded generator, so the start of reward-model training does not depend on the global
RNG (and leaves it untouched). A directory saved from a trained reward model (``save_pretrained``) loads with its
head as it was.

HF's own forward pools at the last token that is not ``pad_token_id``; that is wrong when
padding shares its id with EOS (a common tokenizer setup) and breaks with left padding
plus a pad-id token inside the text. :func:`sequence_scores` finds the last token from
the attention mask instead, and gives positions from the mask as
:func:`~rltune.models.logprobs.completion_logprobs` does, so a row scores the same
however it is padded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from transformers import AutoModelForSequenceClassification, PreTrainedModel
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
)

from rltune.data.collate import join
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError

from rltune.models.load import (
    DTYPES,
    ModelLoadError,
    _existing_dir,
    _mismatch,
    _read_config,
    held_transformers_warnings,
    hf_load_error,
)
from rltune.models.logprobs import body_hidden_states

SCORE_HEAD = "score"
"""Attribute of the HF sequence-classification models (Llama, Qwen2, Mistral, GPT-2,
...) that holds the linear head."""


def load_reward_model(
    path: str, *, dtype: str = "float32", seed: int = 0, trust_remote_code: bool = False, new_head: bool = True
) -> PreTrainedModel:
    """The reward model in the local directory ``path``, one output per sequence.

    ``path`` holds a saved reward model (its head is loaded) or, with ``new_head`` (a
    reward model about to be trained), any causal LM of an architecture with a
    sequence-classification class (its decoder is loaded and the head is new:
    :func:`init_score_head` with ``seed``); without it, a directory with no trained head
    is an error, since its scores would be noise. Any other missing or mismatched weight
    is an error, as in :func:`~rltune.models.load.load_model`.
    """
    if dtype not in DTYPES:
        raise ModelLoadError(f"model dtype {dtype!r} is not one of {sorted(DTYPES)}; set `model.dtype`")
    directory = _existing_dir(path)
    model_type = _read_config(directory).get("model_type")
    if model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES and not trust_remote_code:
        raise ModelLoadError(
            f"transformers has no sequence-classification model for model_type {model_type!r} "
            f"of {directory}, which a reward model needs; use a decoder such as Llama, Qwen2 "
            f"or Mistral"
        )
    with held_transformers_warnings() as held:
        model, info = _from_pretrained(directory, dtype=dtype, trust_remote_code=trust_remote_code)
        _check_head(model, info, directory, seed=seed, new_head=new_head)
        held.release()
    return model


def _from_pretrained(directory, *, dtype: str, trust_remote_code: bool):
    try:
        # transformers fills a missing head from the global RNG before we overwrite it;
        # the fork keeps the caller's stream where it was. Mismatched shapes are
        # reported by key in _check_head.
        with torch.random.fork_rng(devices=[]):
            return AutoModelForSequenceClassification.from_pretrained(
                directory, num_labels=1, local_files_only=True, ignore_mismatched_sizes=True,
                trust_remote_code=trust_remote_code, dtype=DTYPES[dtype], output_loading_info=True,
            )
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError, StrictDataclassError) as err:
        raise hf_load_error(err, directory, "a reward model") from err


def _check_head(model: PreTrainedModel, info: dict, directory, *, seed: int, new_head: bool) -> None:
    head = getattr(model, SCORE_HEAD, None)
    if not isinstance(head, torch.nn.Linear) or head.out_features != 1:
        raise ModelLoadError(
            f"{type(model).__name__} from {directory} has no linear `{SCORE_HEAD}` head with one "
            f"output; rltune scores sequences with that head"
        )
    head_keys = {f"{SCORE_HEAD}.{name}" for name, _ in head.named_parameters()}
    missing = set(info["missing_keys"])
    bad = sorted(missing - head_keys) + sorted(_mismatch(k) for k in info["mismatched_keys"])
    if bad:
        raise ModelLoadError(
            f"the weights in {directory} do not fit a reward model of its config: missing or "
            f"mismatched {bad[:5]}{' ...' if len(bad) > 5 else ''}"
        )
    if missing and not new_head:
        raise ModelLoadError(
            f"{directory} holds no trained `{SCORE_HEAD}` head (a causal LM, not a reward model): its scores "
            f"would be a random head's; train one with algo.name=reward_model and `rltune export` it"
        )
    if missing:  # a causal LM's directory: the head is new
        init_score_head(model, seed=seed)


@torch.no_grad()
def init_score_head(model: PreTrainedModel, *, seed: int) -> None:
    """Draw the score head's weight from ``N(0, 1 / (H + 1))`` (H the hidden size) with a
    generator seeded with ``seed``, and zero its bias if it has one.

    The variance keeps the initial scores of unit-scale hidden states at unit scale; the
    draw is on the CPU so the head is the same on every device.
    """
    head = getattr(model, SCORE_HEAD)
    generator = torch.Generator().manual_seed(seed)
    std = 1.0 / math.sqrt(head.in_features + 1)
    weight = torch.randn(tuple(head.weight.shape), generator=generator) * std
    head.weight.copy_(weight.to(head.weight.dtype))
    if head.bias is not None:
        head.bias.zero_()


def last_attended_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` column of each row's last attended token; every row must attend to one."""
    mask = attention_mask.bool()
    if not bool(mask.any(dim=1).all()):
        empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
        raise ValueError(f"rows {empty} of the attention mask attend to no token; nothing to score")
    # the first attended column of the flipped mask is the last one of the row
    return mask.shape[1] - 1 - mask.flip(1).long().argmax(dim=1)


def sequence_scores(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """``[B]`` float32 score of each row: ``score(h[b, last_b])`` with ``h`` the decoder's
    final hidden states and ``last_b`` the row's last attended column.

    Positions count attended tokens only (``cumsum(mask) - 1``), so left or right
    padding does not change a row's score. Differentiable; only the ``[B, H]`` hidden
    states at the last tokens go through the head. A LoRA-wrapped model is read through
    the model it wraps (its layers carry the adapters in place).
    """
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must both be [B, T]"
        )
    last = last_attended_index(attention_mask)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = body_hidden_states(inner.base_model, input_ids, attention_mask)
    rows = torch.arange(len(input_ids), device=input_ids.device)
    return getattr(inner, SCORE_HEAD)(hidden[rows, last]).squeeze(-1).float()


@torch.no_grad()
def score_completions(
    model: PreTrainedModel,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    pad_id: int,
    *,
    batch_size: int = 32,
) -> torch.Tensor:
    """``[N]`` scores of (prompt, completion) token sequences, in eval mode, in batches of
    ``batch_size`` rows. The completions are scored as given: a completion the reward
    model was trained on ends with EOS (``encode_completion``), so pass EOS too."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(
            f"score_completions: {len(prompt_ids)} prompts but {len(completion_ids)} completions"
        )
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    scores = []
    try:
        for start in range(0, len(prompt_ids), batch_size):
            stop = start + batch_size
            input_ids, attention_mask, _ = join(
                [torch.tensor(p, dtype=torch.long) for p in prompt_ids[start:stop]],
                [torch.tensor(c, dtype=torch.long) for c in completion_ids[start:stop]],
                pad_id,
            )
            scores.append(sequence_scores(model, input_ids.to(device), attention_mask.to(device)))
    finally:
        model.train(was_training)
    return torch.cat(scores).cpu() if scores else torch.zeros(0)
