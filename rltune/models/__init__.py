"""Loading HF causal LMs, vision-language models, tokenizers and processors, the tiny
local model factories, log-probs."""

from rltune.models.load import (
    ModelLoadError,
    is_moe,
    load_model,
    load_processor,
    load_tokenizer,
    resolve_model,
    router_aux_loss_coef,
)
from rltune.models.logprobs import LogProbOutput, completion_logprobs
from rltune.models.tiny import TINY_SPECS, build_tiny
from rltune.models.tiny_vl import TINY_VL_SPECS, build_tiny_vl

__all__ = [
    "TINY_SPECS",
    "TINY_VL_SPECS",
    "LogProbOutput",
    "ModelLoadError",
    "build_tiny",
    "build_tiny_vl",
    "completion_logprobs",
    "is_moe",
    "load_model",
    "load_processor",
    "load_tokenizer",
    "resolve_model",
    "router_aux_loss_coef",
]
