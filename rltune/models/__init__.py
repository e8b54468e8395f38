"""Loading HF causal LMs and tokenizers, the tiny local model factory, log-probs."""

from rltune.models.load import (
    ModelLoadError,
    is_moe,
    load_model,
    load_tokenizer,
    resolve_model,
    router_aux_loss_coef,
)
from rltune.models.logprobs import LogProbOutput, completion_logprobs
from rltune.models.tiny import TINY_SPECS, build_tiny

__all__ = [
    "TINY_SPECS",
    "LogProbOutput",
    "ModelLoadError",
    "build_tiny",
    "completion_logprobs",
    "is_moe",
    "load_model",
    "load_tokenizer",
    "resolve_model",
    "router_aux_loss_coef",
]
