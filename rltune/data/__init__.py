"""Typed records, dataset loading, prompt rendering and prompt sampling."""

from rltune.data.chat import encode_completion, encode_prompt, render_plain
from rltune.data.loaders import DataError, PromptSet, load_prompts
from rltune.data.records import Prompt, Rollout, SamplingParams, TrainBatch
from rltune.data.sampler import PromptSampler

__all__ = [
    "DataError",
    "Prompt",
    "PromptSampler",
    "PromptSet",
    "Rollout",
    "SamplingParams",
    "TrainBatch",
    "encode_completion",
    "encode_prompt",
    "load_prompts",
    "render_plain",
]
