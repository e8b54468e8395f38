"""The learner's numeric precision (``train.precision``) and the generator's
(``rollout.precision``).

* ``fp32``: no autocast.
* ``bf16``: forward and backward under bf16 autocast; master weights, optimizer state and
  the loss stay fp32. bf16 has fp32's exponent range, so gradients need no scaling.
* ``fp16``: fp16 autocast with **dynamic loss scaling**. fp16's smallest normal number is
  6e-5, so small gradients would flush to zero: the loss is multiplied by a large scale
  before the backward and the gradients divided by it before clipping and the optimizer
  step. When a scaled gradient overflowed (inf or NaN anywhere in the group), the step is
  skipped and the scale halved; after ``growth_interval`` clean steps it doubles. Such a
  skipped step is an overflow (``train/skipped_overflow``), not a non-finite step: it does
  not count towards ``train.max_nonfinite_steps``. A non-finite gradient norm that the
  scaler did not flag still does.
* ``fp8``: torchao's float8 training of the linear layers (on top of bf16 autocast for the
  rest), on CUDA GPUs of compute capability 8.9 or newer with the ``fp8`` extra installed.

The scaler is ``torch.amp.GradScaler`` for one process and DDP (every rank holds the same
summed gradient, so every rank finds the same overflow), and
``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` for a sharded group
(FSDP2 or a mesh layout): each rank checks only its own shards, and the overflow flag is
all-reduced over the group so that every rank skips (or takes) the same step.

Why the update under fp16 is the fp32 one, up to fp16 rounding: scaling is exact (a power
of two), ``unscale_`` divides by the same power of two before the clip, so the clip, the
norm and the optimizer see the unscaled gradient.
"""

from __future__ import annotations

import contextlib
import importlib.util
import types
from typing import Any

import torch

from rltune.metrics import keys
from rltune.metrics.types import Last, Metric, Sum
from rltune.models.autocast import AUTOCAST_DTYPES, autocast_for

DTYPE_NAMES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""A precision's dtype name, as vLLM and ``model.dtype`` spell it."""
INIT_SCALE = 2.0**16
"""fp16's first loss scale (``torch.amp.GradScaler``'s default)."""
GROWTH_INTERVAL = 2000
"""Clean fp16 steps after which the loss scale doubles (``GradScaler``'s default)."""
FP8_MIN_CAPABILITY = (8, 9)
"""float8 matmuls (``torch._scaled_mm``) need Ada / Hopper or newer."""


class PrecisionError(ValueError):
    """``train.precision`` (or ``rollout.precision``) cannot run here or with this layout;
    the message names what is missing and the fix."""


def fp8_problems(*, cuda: bool | None = None, capability: tuple[int, int] | None = None,
                 torchao: bool | None = None) -> list[str]:
    """Why ``train.precision: fp8`` cannot run on this machine, one line each (empty when
    it can). The arguments override what is detected (tests)."""
    torchao = importlib.util.find_spec("torchao") is not None if torchao is None else torchao
    cuda = torch.cuda.is_available() if cuda is None else cuda
    problems = []
    if not torchao:
        problems.append("torchao is not installed (pip install 'rltune[fp8]')")
    if not cuda:
        problems.append("no CUDA GPU is visible (float8 training runs on GPUs of compute capability "
                        f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}+: Ada, Hopper or newer)")
    else:
        capability = torch.cuda.get_device_capability() if capability is None else capability
        if tuple(capability) < FP8_MIN_CAPABILITY:
            problems.append(f"the GPU has compute capability {capability[0]}.{capability[1]}; float8 matmuls need "
                            f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or newer (Ada, Hopper)")
    return problems


def precision_problems(precision: str, layout: Any = None, *, learner_gpus: float | None = None) -> list[str]:
    """Every reason ``train.precision = precision`` cannot train with ``layout`` (a
    :class:`rltune.parallel.layout.Layout`, or None: one process) on this machine.
    ``learner_gpus``: on Ray, the GPUs each learner actor reserves; the learners train on
    other machines than this one (a head node or a laptop often has no GPU), so fp8 is
    checked only for a GPU reserved here, and each learner checks its own GPU as it starts."""
    problems = []
    if precision == "fp8" and learner_gpus is not None:
        if learner_gpus <= 0:
            problems.append("train.precision=fp8 trains the linear layers in float8 on the learners' GPUs, and the "
                            "learners reserve none (runtime.placement.learner.gpus: 0); set "
                            "runtime.placement.learner.gpus: 1, or use train.precision=bf16 (or fp16) instead")
    elif precision == "fp8":
        found = fp8_problems()
        if found:
            problems.append("train.precision=fp8 cannot run here: " + "; ".join(found)
                            + "; use train.precision=bf16 (or fp16) instead")
    if precision == "fp16" and layout is not None and layout.pp > 1:
        problems.append(f"train.precision=fp16 with train.parallel.pp={layout.pp}: the pipeline schedule runs the "
                        "backward itself and does not scale the loss; use train.precision=bf16, or pp=1")
    return problems


def check_precision(cfg: Any, layout: Any = None) -> None:
    """Raise :class:`PrecisionError` when the run config ``cfg`` asks for a precision that
    cannot run (checked before any model is loaded; on Ray, fp8 on the learners' own
    machines as they start, see :func:`precision_problems`)."""
    on_ray = cfg.runtime.mode == "ray"
    problems = precision_problems(cfg.train.precision, layout,
                                  learner_gpus=cfg.runtime.placement.learner.gpus if on_ray else None)
    if cfg.train.precision == "fp16" and cfg.model.dtype == "bfloat16":
        problems.append("train.precision=fp16 with model.dtype=bfloat16: fp16 autocast and its loss scaling need "
                        "float32 master weights; set model.dtype=float32, or train.precision=bf16")
    if problems:
        raise PrecisionError("; ".join(problems))


def generator_precision(cfg: Any) -> str:
    """The precision the generator samples in: ``rollout.precision``, whose ``auto`` is
    the learner's (fp8 training samples in bf16: the float8 casts are a training-only
    kernel choice)."""
    chosen = cfg.rollout.precision
    if chosen != "auto":
        return chosen
    return "bf16" if cfg.train.precision == "fp8" else cfg.train.precision


def vllm_dtype(cfg: Any) -> str:
    """The ``dtype`` a vLLM engine loads the policy in: :func:`generator_precision`'s
    (fp16 training samples in float16), or ``model.dtype`` when that is fp32 (a vLLM
    engine has no autocast; it computes in the dtype of its weights)."""
    chosen = generator_precision(cfg)
    return cfg.model.dtype if chosen == "fp32" else DTYPE_NAMES[chosen]


class Precision:
    """What ``train.precision`` does to one learner's step: the autocast around its
    forwards, and with fp16 the loss scaler. ``sharded``: the group's ranks hold
    different gradients (FSDP2, a mesh layout), so the overflow flag is all-reduced."""

    def __init__(self, precision: str, device_type: str, *, sharded: bool = False,
                 init_scale: float | None = None, growth_interval: int | None = None) -> None:
        if precision not in ("fp32", "bf16", "fp16", "fp8"):
            raise PrecisionError(f"train.precision={precision!r}; expected one of fp32, bf16, fp16, fp8")
        if precision == "fp8":
            found = fp8_problems()
            if found:
                raise PrecisionError("train.precision=fp8 cannot run here: " + "; ".join(found))
        self.mode = precision
        self.device_type = device_type
        self.scaler: Any = None
        if precision == "fp16":
            self.scaler = _make_scaler(device_type, sharded, INIT_SCALE if init_scale is None else init_scale,
                                       GROWTH_INTERVAL if growth_interval is None else growth_interval)
        self.overflows = 0

    def autocast(self) -> contextlib.AbstractContextManager:
        """Entered around every forward of the learner."""
        return autocast_for(self.mode, self.device_type)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale (itself without fp16)."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide the gradients by the loss scale; True when any rank's scaled gradient
        overflowed (the step must then be skipped). False without fp16."""
        if self.scaler is None:
            return False
        self.scaler.unscale_(optimizer)
        found = self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        return bool(sum(float(v.item()) for v in found.values()))

    def update(self, overflow: bool) -> None:
        """After the step (taken or skipped): back off or grow the scale."""
        if self.scaler is None:
            return
        self.overflows += int(overflow)
        self.scaler.update()

    def metrics(self, overflow: bool) -> dict[str, Metric]:
        """The step's scaler metrics (none without fp16): whether it was skipped for an
        overflow, and the scale after the update."""
        if self.scaler is None:
            return {}
        return {keys.SKIPPED_OVERFLOW: Sum(float(overflow)), keys.LOSS_SCALE: Last(self.loss_scale())}

    def loss_scale(self) -> float | None:
        """The scale the next backward multiplies by (None without fp16)."""
        return None if self.scaler is None else float(self.scaler.get_scale())

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state for checkpoints: the scale, its growth tracker and the overflow
        count (empty without fp16)."""
        if self.scaler is None:
            return {}
        state = self.scaler.state_dict()
        return {"scale": float(state["scale"]), "growth_tracker": int(state["_growth_tracker"]),
                "overflows": self.overflows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back :meth:`state_dict`'s output. A checkpoint written without fp16 leaves
        a fresh scaler; an fp16 checkpoint loaded by a run of another precision has nothing
        to restore (the scale only means something to an fp16 backward)."""
        if self.scaler is None or not state:
            return
        live = self.scaler.state_dict()
        live.update(scale=float(state["scale"]), _growth_tracker=int(state["growth_tracker"]))
        self.scaler.load_state_dict(live)
        self.overflows = int(state.get("overflows", 0))


def learner_precision(precision: str, model: torch.nn.Module, parallelism: Any) -> Precision:
    """The :class:`Precision` of a learner whose ``parallelism`` has wrapped ``model``
    (fp8: already converted by :func:`convert_fp8`); refuses fp16 through a pipeline,
    whose schedule runs the backward without the loss scale."""
    if precision == "fp16" and getattr(parallelism, "pipeline", None) is not None:
        raise PrecisionError("train.precision=fp16 with train.parallel.pp > 1: the pipeline schedule runs the "
                             "backward itself and does not scale the loss; use train.precision=bf16, or pp=1")
    from rltune.learner.parallel import DDP, NoParallelism

    device = next(model.parameters()).device.type
    return Precision(precision, device, sharded=not isinstance(parallelism, (NoParallelism, DDP)))


def _make_scaler(device_type: str, sharded: bool, init_scale: float, growth_interval: int) -> Any:
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device_type, init_scale=init_scale, growth_interval=growth_interval)
    return torch.amp.GradScaler(device_type, init_scale=init_scale, growth_interval=growth_interval)


def convert_fp8(model: torch.nn.Module) -> torch.nn.Module:
    """torchao's float8 training on ``model``'s linear layers, in place. The output head
    (vocabulary projection) stays in bf16: its logits feed the log-probs, whose precision
    the objective depends on, and its dimensions are rarely multiples of 16."""
    found = fp8_problems()
    if found:
        raise PrecisionError("train.precision=fp8 cannot run here: " + "; ".join(found))
    from torchao.float8 import convert_to_float8_training

    def keep(module: torch.nn.Module, name: str) -> bool:
        if not isinstance(module, torch.nn.Linear) or name.endswith("lm_head"):
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(model, module_filter_fn=keep)
    return plain_when_sampling(model)


def plain_when_sampling(model: torch.nn.Module) -> torch.nn.Module:
    """Give each of ``model``'s torchao ``Float8Linear`` layers :func:`_float8_or_plain` as
    its forward, bound to the layer (a deep copy, such as an asynchronous producer's,
    binds to the copy's own weights); in place."""
    for module in model.modules():
        if type(module).__name__ == "Float8Linear":
            module.forward = types.MethodType(_float8_or_plain, module)
    return model


def _float8_or_plain(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A float8 linear's forward for the learner, and a plain product for the sampler.

    Under ``torch.inference_mode`` (the HF generator's decode, and nothing the learner
    runs: its no-grad log-probs use ``no_grad``) the layer is an ``F.linear`` in the
    generator's own precision (autocast's dtype, else the weights'), so an fp8 run samples
    in bf16 as :func:`generator_precision` says. Otherwise the class's float8 forward runs
    with autocast off, its input cast to the autocast dtype first: autocast would otherwise
    try to cast torchao's float8 tensors inside the matmul, which they do not support; the
    float8 cast and scaling are the module's own. Grad mode is asked first: it is on in
    every compiled (``train.compile``) forward, and dynamo cannot trace the inference-mode
    query, which would break the block's graph at each linear."""
    if not torch.is_grad_enabled() and torch.is_inference_mode_enabled():
        return torch.nn.functional.linear(x, self.weight, self.bias)
    forward = type(self).forward
    kind = x.device.type
    if not torch.is_autocast_enabled(kind):
        return forward(self, x)
    x = x.to(torch.get_autocast_dtype(kind))
    with torch.autocast(device_type=kind, enabled=False):
        return forward(self, x)


__all__ = [
    "AUTOCAST_DTYPES", "DTYPE_NAMES", "Precision", "PrecisionError", "autocast_for", "check_precision",
    "convert_fp8", "fp8_problems", "generator_precision", "learner_precision", "plain_when_sampling",
    "precision_problems", "vllm_dtype",
]
