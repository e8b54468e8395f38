"""Typed records that cross every boundary of the pipeline.

Shapes use B = rows in the batch, P = prompt columns (left-padded), C = completion
columns (right-padded), T = P + C.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class PromptImage:
    """One image of a prompt, as the dataset gave it.

    ``data`` is the encoded file (PNG, JPEG, ...) exactly as read, ``digest`` the first 16
    hex digits of its SHA-256 (the name a run directory stores it under, once per image),
    ``source`` where it came from, for messages and ``samples.jsonl``: the file's path, or
    ``"row N, image K (bytes)"`` / ``"row N, image K (data URI)"`` for inline images.
    """

    source: str
    digest: str
    data: bytes = field(repr=False)


VisionInputs = dict[str, torch.Tensor]
"""What a vision-language model's processor returns for one prompt besides ``input_ids`` and
``attention_mask`` (``pixel_values``, ``image_grid_thw``, ...). Every tensor holds the
prompt's images (or their patches) along dim 0, so the inputs of several prompts are
their concatenation along dim 0 (:func:`rltune.models.vision.batch_vision_inputs`)."""


@dataclass
class Prompt:
    """One task instance.

    Exactly one of ``messages`` (chat form, ``[{"role", "content"}, ...]``) or ``text``
    (raw text, used as-is) is set. ``meta`` carries what reward functions need (``answer``,
    ``tests``, ...) and is passed to them as keyword arguments. ``input_ids`` is the rendered,
    tokenised prompt, filled once when the dataset is loaded.

    Prompts with images (vision-language models) also carry ``images``, the images in the
    order their tokens appear in ``input_ids``, and ``vision``, the processor's pixel
    inputs rendered once with ``input_ids``; both None for text prompts.
    """

    id: str
    messages: list[dict[str, str]] | None = None
    text: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    input_ids: list[int] | None = None
    images: list[PromptImage] | None = None
    vision: VisionInputs | None = None

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.text is None):
            raise ValueError(f"prompt {self.id!r}: set exactly one of `messages` or `text`")


@dataclass
class SamplingParams:
    """How a generator samples. ``temperature == 0`` means greedy."""

    n: int = 1
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()


@dataclass
class Rollout:
    """One sampled completion of one prompt.

    ``completion_ids``, ``completion_logprobs`` and ``loss_mask`` are 1-D tensors of the
    same length L (the completion, EOS included when it was produced).
    ``completion_logprobs`` are the generating engine's log-probs of the sampled tokens
    (under the sampling distribution actually used: temperature-scaled), or None when the
    engine does not report them. ``loss_mask`` is 1 on tokens the policy produced; tokens an
    environment or tool inserted are 0. ``group`` indexes the prompt within its step, so the
    ``n`` samples of one prompt share it.
    """

    prompt_id: str
    group: int
    prompt_ids: torch.Tensor  # [P_i] long
    completion_ids: torch.Tensor  # [L] long
    completion_logprobs: torch.Tensor | None  # [L] float32
    loss_mask: torch.Tensor  # [L] float32
    text: str
    finish_reason: str  # "stop" (EOS or stop string) | "length"
    policy_version: int
    reward: float | None = None
    rewards: dict[str, float | None] = field(default_factory=dict)
    reward_error: str | None = None
    dropped: bool = False
    """A reward dropped the sample on purpose (a safety filter): ``reward`` is None and
    ``reward_error`` says why, but it is not counted as an error."""
    turns: list[dict[str, Any]] | None = None
    """Multi-turn episodes: the exchange after the prompt, ``{"role", "content"}`` per turn
    (``assistant`` turns are the model's, ``tool`` turns the environment's); ``text`` is the
    last assistant turn."""
    env_reward: float | None = None
    """Multi-turn episodes: the sum of the environment's step rewards (None: no
    environment, or it failed)."""
    env_error: str | None = None
    """Multi-turn episodes: why the environment failed; the sample then gets no reward."""
    routes: torch.Tensor | None = None
    """MoE models: ``[P_i + L, layers, k]`` int16, the experts each token of
    ``prompt_ids`` then ``completion_ids`` was routed to in every MoE layer when it was
    generated, -1 where none was (:mod:`rltune.models.routing`); None when not recorded."""
    images: list[PromptImage] | None = None
    """The prompt's images (vision-language prompts), shared with the :class:`Prompt`."""
    vision: VisionInputs | None = None
    """The prompt's pixel inputs, the same object as the :class:`Prompt`'s (never copied per
    sample); the learner's forward takes them with ``prompt_ids``."""


@dataclass
class TrainBatch:
    """Padded tensors for one learner step.

    ``input_ids``/``attention_mask`` are ``[B, T]``: the prompt left-padded to ``prompt_len``
    columns, then the completion right-padded. Every per-token field is ``[B, C]`` and is
    aligned with ``input_ids[:, prompt_len:]`` (the tokens whose log-probs are trained).
    ``advantages`` is ``[B, C]`` (a per-sequence advantage is expanded, not copied).
    ``old_logprobs`` None means the batch is learned once, on-policy: the learner uses its
    own detached log-probs as the old ones, so the PPO ratio is exactly 1 at the first step.
    """

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    prompt_len: int
    loss_mask: torch.Tensor  # [B, C] float32
    advantages: torch.Tensor | None = None  # [B, C]
    old_logprobs: torch.Tensor | None = None  # [B, C]
    ref_logprobs: torch.Tensor | None = None  # [B, C]
    behaviour_logprobs: torch.Tensor | None = None  # [B, C]
    returns: torch.Tensor | None = None  # [B, C]
    values: torch.Tensor | None = None  # [B, C]
    versions: torch.Tensor | None = None  # [B] long
    ref_seq_logps: torch.Tensor | None = None  # [B] float32
    """Preference pairs: each row's completion log-prob summed over its tokens under the
    frozen reference model (rows ``2k``, ``2k + 1`` are pair ``k``'s chosen and rejected)."""
    routes: torch.Tensor | None = None  # [B, T, L, k] int16
    """MoE routing replay: per token of ``input_ids`` (aligned with it, not with the
    completion) and MoE layer, the experts the generator chose; -1 where none."""
    vision: list[VisionInputs | None] | None = None
    """Vision-language batches: per row, its prompt's pixel inputs (None for a row without
    images; rows of one group share the object); None when no row has images."""

    @property
    def completion_len(self) -> int:
        return self.input_ids.shape[1] - self.prompt_len

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor | slice) -> "TrainBatch":
        """Rows ``rows`` of every tensor field (views where indexing allows)."""
        return TrainBatch(
            input_ids=self.input_ids[rows],
            attention_mask=self.attention_mask[rows],
            prompt_len=self.prompt_len,
            loss_mask=self.loss_mask[rows],
            vision=_select_rows(self.vision, rows),
            **{
                name: (None if getattr(self, name) is None else getattr(self, name)[rows])
                for name in _OPTIONAL_ROW_FIELDS
            },
        )

    def trim(self) -> "TrainBatch":
        """Drop prompt columns that are padding in every row, and completion columns
        that are masked out in every row."""
        prompt_mask = self.attention_mask[:, : self.prompt_len]
        has_token = prompt_mask.any(dim=0)
        first = int(has_token.nonzero()[0]) if bool(has_token.any()) else self.prompt_len
        comp_mask = self.attention_mask[:, self.prompt_len :]
        used = comp_mask.any(dim=0)
        last = int(used.nonzero()[-1]) + 1 if bool(used.any()) else 0
        if first == 0 and last == self.completion_len:
            return self
        cols = slice(first, self.prompt_len + last)
        per_tok = slice(0, last)
        return TrainBatch(
            input_ids=self.input_ids[:, cols],
            attention_mask=self.attention_mask[:, cols],
            prompt_len=self.prompt_len - first,
            loss_mask=self.loss_mask[:, per_tok],
            **{
                name: _trim_field(getattr(self, name), per_tok)
                for name in _OPTIONAL_ROW_FIELDS if name != "routes"
            },
            routes=None if self.routes is None else self.routes[:, cols],
            vision=self.vision,
        )


_OPTIONAL_ROW_FIELDS = (
    "advantages",
    "old_logprobs",
    "ref_logprobs",
    "behaviour_logprobs",
    "returns",
    "values",
    "versions",
    "ref_seq_logps",
    "routes",
)


def _trim_field(t: torch.Tensor | None, per_tok: slice) -> torch.Tensor | None:
    if t is None or t.dim() == 1:
        return t
    return t[:, per_tok]


def _select_rows(values: list[Any] | None, rows: torch.Tensor | slice) -> list[Any] | None:
    """``values[rows]`` for a per-row list, with ``rows`` a slice, an index tensor or a
    boolean mask as tensor indexing takes them."""
    if values is None:
        return None
    if isinstance(rows, slice):
        return values[rows]
    rows = torch.as_tensor(rows)
    if rows.dtype == torch.bool:
        rows = rows.nonzero().flatten()
    return [values[int(i)] for i in rows.reshape(-1)]
