"""The critic of PPO: a separate value model built from an HF causal LM.

rltune's critic is a *separate* model (the LM's transformer body plus a scalar head), not
a value head on the policy. The two then learn at their own rates and the critic can warm
up alone (``algo.critic_warmup_steps``) without its gradient reaching the policy; a value
head on the policy's body would save memory but couple the two losses through shared
weights and make the policy's update depend on a value-loss coefficient. This is the
layout of the PPO-for-LLMs line of work (Ouyang et al. 2022; OpenRLHF, verl).

Layout as in :mod:`rltune.models.logprobs`: the value of completion token ``j`` is the
critic's estimate of the return *before* that token is emitted, read at column
``P + j - 1`` — the same position whose logits predict the token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rltune.data.records import VisionInputs
from rltune.models.load import load_model
from rltune.models.logprobs import body_hidden_states
from rltune.models.vision import batch_vision_inputs


@dataclass
class ValueOutput:
    """``values`` ``[B, C]`` float32, differentiable, 0 on padding; ``aux_loss`` is None
    (the critic's router loss, for an MoE body, is not trained)."""

    values: torch.Tensor
    aux_loss: torch.Tensor | None = None


class ValueModel(nn.Module):
    """A transformer body and ``head: Linear(hidden, 1)``, zero-initialised so that every
    value starts at 0 and the first returns, not noise, shape it."""

    def __init__(self, body: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                vision: VisionInputs | None = None) -> torch.Tensor:
        """``vision``: a vision-language batch's pixel inputs (the rows' concatenated)."""
        hidden = body_hidden_states(self.body, input_ids, attention_mask, vision)
        states = hidden[:, prompt_len - 1 : -1].float()  # [B, C, H]: the state before each token
        values = self.head(states).squeeze(-1)
        return torch.where(attention_mask[:, prompt_len:].bool(), values, values.new_zeros(()))


def load_critic(path: str, *, dtype: str = "float32", trust_remote_code: bool = False) -> ValueModel:
    """A critic whose body is the causal LM in ``path`` without its LM head (for a
    vision-language model, its vision tower, projector and language model)."""
    lm = load_model(path, dtype=dtype, trust_remote_code=trust_remote_code)
    return ValueModel(lm.base_model, lm.config.get_text_config().hidden_size)


def value_forward(model: ValueModel, mb, *, temperature: float, router_logits: bool) -> ValueOutput:
    """The learner's forward for a critic (``temperature`` and ``router_logits`` unused)."""
    vision = None if mb.vision is None else batch_vision_inputs(mb.vision)
    return ValueOutput(values=model(mb.input_ids, mb.attention_mask, mb.prompt_len, vision))
