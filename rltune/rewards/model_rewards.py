"""Rewards scored by a trained reward model (a sequence classifier with one output).

Name it in a config as ``rltune.rewards.model_rewards:reward_model``::

    reward:
    - fn: rltune.rewards.model_rewards:reward_model
      kwargs: {path: runs/rm/final, batch_size: 32}

The reward of a sample is ``scale * s + shift``, with ``s`` the model's raw score of the
(prompt, completion) sequence (:func:`~rltune.models.reward_model.score_completions`). No
running mean is subtracted: a sample's reward then depends only on the sample and the
model, never on what else was scored before it; centring is the advantage estimator's job
(GRPO's group mean, PPO's critic).

The sequence is tokenised as the reward model was trained
(:func:`~rltune.data.loaders.load_prompts` with pairs): the prompt's ``input_ids`` (the
policy's rendered prompt), then the completion text's tokens and EOS
(:func:`~rltune.data.chat.encode_completion`). A prompt without ``input_ids``, or every
prompt when ``render_prompt`` is true, is rendered through the reward model's own tokenizer
(its chat template when it has one); use ``render_prompt: true`` for a reward model whose
tokenizer differs from the policy's.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
)

from rltune.data.chat import encode_completion, encode_prompt
from rltune.data.records import Prompt
from rltune.models.load import DTYPES, TOKENIZER_FILES, ModelLoadError, load_tokenizer
from rltune.models.reward_model import SCORE_HEAD, load_reward_model, score_completions
from rltune.models.safetensors_io import open_tensors
from rltune.rewards.contract import batched
from rltune.rewards.keyed_cache import KeyedCache, cache_key


@dataclass
class LoadedRewardModel:
    """A reward model ready to score, with what encoding needs to know about it.

    ``lock`` serialises forward passes: two scoring threads sharing one model would
    otherwise hold two batches of activations at once on the same device."""

    model: torch.nn.Module
    tokenizer: Any
    pad_id: int
    vocab_size: int
    max_positions: int | None
    lock: threading.Lock = field(default_factory=threading.Lock)


_MODELS: KeyedCache[LoadedRewardModel] = KeyedCache()


@batched
def reward_model(
    prompts: Sequence[Prompt],
    completions: Sequence[str],
    *,
    path: str,
    batch_size: int = 32,
    dtype: str = "float32",
    device: str | None = None,
    scale: float = 1.0,
    shift: float = 0.0,
    render_prompt: bool = False,
    trust_remote_code: bool = False,
) -> list[float | Exception]:
    """``scale * score + shift`` of each (prompt, completion) under the reward model in the
    local directory ``path`` (a model and tokenizer saved with ``save_pretrained``).

    ``batch_size``: rows per forward pass; samples are sorted by length first, so a batch
    holds sequences of similar length (little padding) and a sample's score does not depend
    on the order the samples came in. ``dtype``: ``float32`` or ``bfloat16``. ``device``:
    where the model runs; None means ``cuda`` when torch sees a GPU, else ``cpu``.

    The model is loaded once per distinct (path, dtype, device, trust_remote_code) and kept.
    A sample that cannot be scored (a prompt id outside the model's vocabulary, a sequence
    longer than its position limit) is an exception in its place in the result; a model
    that does not load raises (every sample of the call is an error). A config's kwargs are
    checked when it loads (a directory that holds no reward model, a bad setting), before
    anything is generated.
    """
    _check_settings(batch_size=batch_size, scale=scale, shift=shift)
    _check_lengths(prompts, completions)
    device = device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    rm = _MODELS.get(
        cache_key(path=str(Path(path).expanduser().resolve()), dtype=dtype, device=device,
                  trust_remote_code=trust_remote_code),
        lambda: _load(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code),
    )
    encoded = [_encode(rm, p, c, render_prompt=render_prompt) for p, c in zip(prompts, completions)]
    results: list[float | Exception] = [
        e if isinstance(e, Exception) else math.nan for e in encoded
    ]
    rows = [i for i, e in enumerate(encoded) if not isinstance(e, Exception)]
    # by length, ties by the ids: the batches (and so the float rounding of each score) are
    # a function of the set of samples, not of the order they arrived in
    rows.sort(key=lambda i: (len(encoded[i][0]) + len(encoded[i][1]), encoded[i]))
    with rm.lock:
        scores = score_completions(
            rm.model,
            [encoded[i][0] for i in rows],
            [encoded[i][1] for i in rows],
            rm.pad_id,
            batch_size=batch_size,
        )
    for i, score in zip(rows, scores.tolist()):
        results[i] = scale * score + shift
    return results


def clear_cache() -> None:
    """Drop every loaded reward model (they are freed once nothing else holds them)."""
    _MODELS.clear()


def _load(path: str, *, dtype: str, device: str, trust_remote_code: bool) -> LoadedRewardModel:
    """The reward model and its tokenizer from ``path``, in eval mode on ``device``."""
    model = load_reward_model(path, dtype=dtype, trust_remote_code=trust_remote_code, new_head=False)
    tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
    try:
        model = model.to(device).eval()
    except (RuntimeError, AssertionError) as err:  # an unknown or unavailable device
        raise ValueError(
            f"reward model {path}: cannot move it to device {device!r}: {err}"
        ) from err
    return LoadedRewardModel(
        model=model,
        tokenizer=tokenizer,
        pad_id=int(tokenizer.pad_token_id),
        vocab_size=int(model.get_input_embeddings().num_embeddings),
        max_positions=getattr(model.config, "max_position_embeddings", None),
    )


def _encode(
    rm: LoadedRewardModel, prompt: Prompt, completion: str, *, render_prompt: bool
) -> tuple[list[int], list[int]] | Exception:
    """``(prompt ids, completion ids + EOS)`` of one sample, or the reason it cannot be
    scored."""
    if prompt.input_ids is not None and not render_prompt:
        prompt_ids = [int(i) for i in prompt.input_ids]
    else:
        prompt_ids = encode_prompt(rm.tokenizer, prompt)
    completion_ids = encode_completion(rm.tokenizer, completion)
    bad = [i for i in prompt_ids if not 0 <= i < rm.vocab_size]
    if bad:
        return ValueError(
            f"prompt {prompt.id!r}: token ids {bad[:3]} are outside the reward model's "
            f"vocabulary of {rm.vocab_size}; its tokenizer differs from the policy's, so set "
            f"`render_prompt: true` to render prompts with the reward model's tokenizer"
        )
    total = len(prompt_ids) + len(completion_ids)
    if rm.max_positions is not None and total > rm.max_positions:
        return ValueError(
            f"prompt {prompt.id!r}: prompt and completion are {total} tokens, more than the "
            f"reward model's max_position_embeddings={rm.max_positions}"
        )
    return prompt_ids, completion_ids


def _check_settings(*, batch_size: int, scale: float, shift: float, prefix: str = "reward_model: ") -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{prefix}batch_size must be a positive integer, got {batch_size!r}")
    for name, value in (("scale", scale), ("shift", shift)):
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{prefix}{name} must be a finite number, got {value!r}")


def _check_lengths(prompts: Sequence[Prompt], completions: Sequence[str]) -> None:
    if len(prompts) != len(completions):
        raise ValueError(
            f"reward_model: {len(prompts)} prompts but {len(completions)} completions"
        )


def _check_reward_model(kwargs: dict) -> None:
    """The config's kwargs, checked when the config loads: the settings, and that ``path``
    holds a reward model (read from its config.json and the names in its safetensors
    headers, without loading a weight), so a wrong directory stops the run before the
    first generation instead of failing every sample. ``device`` is not checked: the
    process that scores may see devices that this one does not."""
    _check_settings(batch_size=kwargs.get("batch_size", 32), scale=kwargs.get("scale", 1.0),
                    shift=kwargs.get("shift", 0.0), prefix="kwargs.")
    dtype = kwargs.get("dtype", "float32")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"kwargs.dtype {dtype!r} is not one of {sorted(DTYPES)}")
    path = kwargs.get("path")
    if isinstance(path, str):
        _check_model_dir(path, trust_remote_code=bool(kwargs.get("trust_remote_code", False)))


_TRAIN_ONE = "train one with algo.name=reward_model and `rltune export` it"


def _check_model_dir(path: str, *, trust_remote_code: bool) -> None:
    """Raise ValueError unless ``path`` is a directory with a config.json of an architecture
    with a sequence-classification model, a tokenizer and, when its weights are
    safetensors, a trained score head among them."""
    if path.startswith("builtin:"):
        raise ValueError(
            f"kwargs.path {path!r} names a built-in causal LM, not a reward model: it has no "
            f"trained `{SCORE_HEAD}` head; set it to a reward model's directory ({_TRAIN_ONE})"
        )
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ValueError(f"kwargs.path {path!r} is not a directory (a reward model saved with save_pretrained)")
    config = _json_file(directory / "config.json", path=path)
    if not isinstance(config, dict):
        raise ValueError(f"kwargs.path {path!r}: config.json holds a JSON {type(config).__name__}, not an object")
    model_type = config.get("model_type")
    if model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES and not trust_remote_code:
        raise ValueError(
            f"kwargs.path {path!r}: transformers has no sequence-classification model for its "
            f"model_type {model_type!r}, which a reward model needs"
        )
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"kwargs.path {path!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
            f"save the reward model's tokenizer there with `tokenizer.save_pretrained`"
        )
    names = _weight_names(directory, path=path)
    if names is not None and f"{SCORE_HEAD}.weight" not in names:
        raise ValueError(
            f"kwargs.path {path!r} holds no trained `{SCORE_HEAD}` head (a causal LM, not a reward "
            f"model): its scores would be a random head's; {_TRAIN_ONE}"
        )


def _weight_names(directory: Path, *, path: str) -> set[str] | None:
    """The tensor names of the directory's safetensors weights (from the shard index or the
    file's header); None when its weights are in another format."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        data = _json_file(index, path=path)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        return set(weight_map) if isinstance(weight_map, dict) else None
    single = directory / "model.safetensors"
    if not single.is_file():
        return None
    with open_tensors(single, error=ModelLoadError) as f:
        return set(f.keys())


def _json_file(file: Path, *, path: str) -> Any:
    if not file.is_file():
        raise ValueError(
            f"kwargs.path {path!r} has no {file.name}, so it is not a Hugging Face model directory "
            f"(a reward model saved with save_pretrained)"
        )
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"kwargs.path {path!r}: {file.name} is not valid JSON ({err})") from None


reward_model.check_kwargs = _check_reward_model  # type: ignore[attr-defined]
