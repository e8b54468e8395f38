"""LoRA adapters through peft: wrap a causal LM, switch its adapters off, merge them out.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") keeps each
targeted weight ``W [out, in]`` frozen and learns a low-rank update of it::

    h = W x + (alpha / r) * B A dropout(x),    A [r, in] random, B [out, r] zero at the start

so the wrapped model starts exactly at the base model and only ``A`` and ``B`` (plus the
modules named in ``modules_to_save``, trained in full) receive gradients. peft does the
wrapping; it is an optional dependency (``pip install 'rltune[lora]'``), imported inside
the functions that need it.

``target_modules: all-linear`` is peft's shorthand: every ``nn.Linear`` (and GPT-2's
``Conv1D``) except the model's output embedding (``get_output_embeddings()``, the
``lm_head``), which peft leaves out so that the vocabulary projection stays the base's. In
transformers 5 the routed experts of a mixture of experts are fused 3-d parameters and its
router is not an ``nn.Linear``, so there ``all-linear`` adapts attention and the shared
experts, not the routed experts or the router. On a vision-language model (with
``model.freeze_vision``, the default) the targets are only the language model's linear
layers (:func:`language_model_targets`): the vision tower and projector stay frozen.

The frozen reference model (KL penalty, DPO) of a LoRA run is the base model itself:
:func:`adapters_disabled` runs the same module with the adapters off, so no second copy of
the weights is held. Export writes the adapters merged into a plain Hugging Face model
(:func:`merged_copy`), built beside the training model without changing it.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import warnings
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from rltune.models.load import ModelLoadError
from rltune.models.vision import is_vision_language, language_model_prefix, vision_modules

if TYPE_CHECKING:
    from rltune.config.schema import LoraConfig

_INSTALL_FIX = "install it with `pip install 'rltune[lora]'`, or unset `model.lora`"


def apply_lora(model: PreTrainedModel, cfg: "LoraConfig", *, language_model_only: bool = True) -> torch.nn.Module:
    """``model`` wrapped with fresh LoRA adapters as ``cfg`` describes (a peft model).

    On a vision-language model with ``language_model_only`` (``model.freeze_vision``),
    the adapters go only into its language model: ``all-linear`` is every linear layer of
    the language model, and a named target matches only layers inside it; the vision
    tower and projector stay as loaded. Without it, ``all-linear`` covers the vision
    tower and projector too (every linear layer but the output head).

    ``model`` is changed in place (its targeted layers are replaced by LoRA layers) and
    becomes the wrapper's base; every parameter outside the adapters and
    ``cfg.modules_to_save`` is frozen (``requires_grad`` off). ``A`` is drawn from torch's
    global RNG (peft's Kaiming-uniform init), ``B`` is zero.

    Raises:
        ModelLoadError: peft is not installed, ``model`` already has adapters, a name
            in ``target_modules``/``modules_to_save`` matches no module of ``model`` (or
            a module LoRA cannot adapt) or, with ``language_model_only``, a vision part
            (:func:`_check_vision_not_saved`), or ``cfg.r`` is above the rank of every
            adapted layer's update (:func:`_check_rank`).
    """
    peft = _peft()
    if is_lora(model):
        raise ModelLoadError(f"{type(model).__name__} already has LoRA adapters; apply them once")
    names = [name for name, _ in model.named_modules() if name]
    targets = None if cfg.target_modules == "all-linear" else list(cfg.target_modules)
    to_save = None if cfg.modules_to_save is None else list(cfg.modules_to_save)
    for field, wanted in (("target_modules", targets), ("modules_to_save", to_save)):
        for target in wanted or ():
            if not any(_matches(name, target) for name in names):
                raise ModelLoadError(
                    f"model.lora.{field}: {type(model).__name__} has no module named {target!r}; "
                    f"the names of its layers are {', '.join(_leaf_names(model))}"
                )
    if language_model_only and is_vision_language(model):
        _check_vision_not_saved(model, to_save)
        targets = language_model_targets(model, targets)
    config = peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules="all-linear" if targets is None else targets,
        modules_to_save=to_save,
        bias="none",
        # a sequence classifier (a reward model) keeps its generation-free forward, and
        # peft trains its new score head in full next to the adapters
        task_type="SEQ_CLS" if type(model).__name__.endswith("ForSequenceClassification") else "CAUSAL_LM",
    )
    with warnings.catch_warnings():
        # peft asks the model `is_gradient_checkpointing`, which transformers 5 deprecates.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        # peft warns that an adapted or saved tied layer (lm_head, embed_tokens) makes
        # merging tricky; merged_copy unties such weights, so the export stays exact.
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*ensure_weight_tying", category=UserWarning)
        try:
            wrapped = peft.get_peft_model(model, config)
        except ValueError as err:  # e.g. a name matching a whole block, not a layer LoRA supports
            raise ModelLoadError(f"model.lora: peft cannot adapt {type(model).__name__}: {err}") from err
    _check_rank(wrapped, cfg.r)
    return wrapped


def _check_rank(model: torch.nn.Module, r: int) -> None:
    """A ModelLoadError when rank ``r`` is above what the update of every adapted layer can
    have: ``B A`` of a ``[out, in]`` weight has rank at most ``min(out, in)``, so past the
    largest such bound every adapter holds more numbers than the weight it adapts and
    learns nothing a full update would not (``r`` past the hidden size, for an LM). A rank
    above the bound of some layers only is accepted: ``all-linear`` also adapts layers as
    narrow as an MoE's shared-expert gate (one output), which any useful rank exceeds."""
    from peft.tuners.lora import LoraLayer

    bounds = {
        name.removeprefix("base_model.model."): (module.out_features, module.in_features)
        for name, module in model.named_modules() if isinstance(module, LoraLayer)
    }
    if not bounds:
        return
    name, (out, inp) = max(bounds.items(), key=lambda item: min(item[1]))
    if r > min(out, inp):
        raise ModelLoadError(
            f"model.lora.r={r} is above {min(out, inp)}, the highest rank an update of any adapted layer can have "
            f"({name} is {out} x {inp}): every adapter would be over-full and cost more than training its layer in "
            f"full; set model.lora.r <= {min(out, inp)}, or train without LoRA"
        )


def _check_vision_not_saved(model: torch.nn.Module, to_save: list[str] | None) -> None:
    """A ModelLoadError when a ``modules_to_save`` name of a vision-language ``model``
    matches a module of its vision tower or projector, or one holding them: peft would
    train a full copy of it, which ``model.freeze_vision`` promises to keep as loaded.
    Matched by peft's rule for ``modules_to_save``: a module whose name ends with it."""
    if not to_save:
        return
    frozen = {id(module) for module in vision_modules(model).values()}
    parts = [name for name, module in model.named_modules() if id(module) in frozen]
    for target in to_save:
        for name, _ in model.named_modules():
            part = next((part for part in parts if name and name.endswith(target) and _overlap(name, part)), None)
            if part is not None:
                where = "part of" if name == part or name.startswith(f"{part}.") else "holding"
                raise ModelLoadError(
                    f"model.lora.modules_to_save: {target!r} names {name} of {type(model).__name__}, {where} its vision "
                    f"tower or projector {part}, which model.freeze_vision: true keeps fixed; name only modules of the "
                    f"language model, or set `model.freeze_vision: false` to train the vision parts too"
                )


def _overlap(name: str, part: str) -> bool:
    """Whether the modules named ``name`` and ``part`` are one inside the other (or the same)."""
    return name == part or name.startswith(f"{part}.") or part.startswith(f"{name}.")


def language_model_targets(model: torch.nn.Module, targets: list[str] | None) -> list[str]:
    """The full names of the linear layers of a vision-language ``model``'s language model
    that match ``targets`` (peft's rule; ``None``: every one, ``all-linear``)."""
    prefix = language_model_prefix(model) + "."
    found = [
        name for name, module in model.named_modules()
        if name.startswith(prefix) and isinstance(module, torch.nn.Linear)
        and (targets is None or any(_matches(name, t) for t in targets))
    ]
    if not found:
        raise ModelLoadError(
            f"model.lora.target_modules: none of {targets} is a linear layer of the language "
            f"model of {type(model).__name__} ({prefix[:-1]}); name its layers, or set "
            f"`model.freeze_vision: false` to adapt the vision tower's"
        )
    return found


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft model (as :func:`apply_lora` returns).

    Never imports peft: a model can only be a peft model once peft has been imported.
    """
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def adapters_disabled(model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
    """A context in which ``model`` computes what its base model computes.

    For a LoRA model, peft's ``disable_adapter()``: every LoRA layer returns its base
    layer's output and every ``modules_to_save`` module its original; the adapters are
    switched back on when the context exits, also on an error. For any other model a
    ``nullcontext``: the model is its own base. The reference log-probs of a LoRA run are
    computed inside this context on the policy's own module.
    """
    return model.disable_adapter() if is_lora(model) else contextlib.nullcontext()


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The ``state_dict()`` of a plain model of the base's class with the adapters merged.

    Each LoRA layer becomes its base layer with ``W + (alpha / r) B A`` of every active
    adapter (peft's own ``merge`` of that layer, run on a copy of the layer, so GPT-2's
    transposed ``Conv1D`` and embeddings come out as peft merges them); each
    ``modules_to_save`` module becomes its trained copy; every other entry is the base's
    own. Tensors are on the CPU; those the merge leaves as they are *are* the model's own
    when it is on the CPU, so treat the result as read-only. ``model`` is not changed
    (merging in place and unmerging after would not give back ``W`` bitwise). Extra
    device memory: one layer at a time.
    """
    _peft()
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    base = model.get_base_model()
    wrappers = {
        name: module for name, module in base.named_modules()
        if isinstance(module, (BaseTunerLayer, ModulesToSaveWrapper))
    }
    out = {
        key: tensor.to("cpu") for key, tensor in base.state_dict().items()
        if not _under(key, wrappers)
    }
    for name, module in wrappers.items():
        if isinstance(module, ModulesToSaveWrapper):
            active = module.active_adapter  # a name in older peft, a list of names in newer
            active = [active] if isinstance(active, str) else list(active)
            plain = module.modules_to_save[active[0]] if active else module.original_module
        else:
            layer = copy.deepcopy(module)
            layer.merge()  # the active adapters not merged yet, on the copy's own weight
            plain = layer.get_base_layer()
        out.update({f"{name}.{key}": t.to("cpu") for key, t in plain.state_dict().items()})
    return out


@torch.no_grad()
def merged_copy(model: torch.nn.Module) -> PreTrainedModel:
    """A plain Hugging Face model on the CPU equal to ``model`` with its adapters merged.

    Same class and config as the base model, weights from :func:`merged_state_dict`; it
    loads and saves without peft. Weights the base ties (the embeddings and ``lm_head``
    of most small models) stay tied unless training made them differ (an adapted
    ``embed_tokens``, a trained ``lm_head`` copy): then the copy's config unties them,
    so the merged model computes what the adapted one does. ``model`` is not changed.
    """
    base = model.get_base_model()
    state = merged_state_dict(model)
    config = copy.deepcopy(base.config)
    plain = _skeleton(type(base), config)
    if any(not torch.equal(state[a], state[b]) for a, b in _tied_pairs(plain)):
        config.tie_word_embeddings = False
        plain = _skeleton(type(base), config)
        if _tied_pairs(plain):
            raise ModelLoadError(
                f"cannot merge the adapters of {type(base).__name__}: weights tied by the "
                f"architecture itself ({_tied_pairs(plain)[:3]}) were trained apart"
            )
    plain.load_state_dict(state, strict=True, assign=True)
    plain.tie_weights()
    for name, buffer in list(plain.named_buffers()):
        if buffer.is_meta:  # non-persistent buffers (rotary frequencies) are not in a state_dict
            owner, _, leaf = name.rpartition(".")
            plain.get_submodule(owner).register_buffer(leaf, base.get_buffer(name).to("cpu"), persistent=False)
    if getattr(base, "generation_config", None) is not None:  # a reward model has none
        plain.generation_config = copy.deepcopy(base.generation_config)
    return plain.eval()


def _peft() -> Any:
    try:
        import peft
    except ImportError as err:
        raise ModelLoadError(f"LoRA needs the peft package, which is not installed; {_INSTALL_FIX}") from err
    return peft


def _matches(name: str, target: str) -> bool:
    """peft's rule for a list of target names: the module's dotted name is ``target`` or
    ends with ``.target``."""
    return name == target or name.endswith(f".{target}")


def _leaf_names(model: torch.nn.Module) -> list[str]:
    """The distinct last components of the names of ``model``'s parameter-holding leaves."""
    return sorted({
        name.rpartition(".")[2] for name, module in model.named_modules()
        if name and not list(module.children()) and any(True for _ in module.parameters(recurse=False))
    })


def _under(key: str, prefixes: dict[str, Any]) -> bool:
    parts = key.split(".")
    return any(".".join(parts[:i]) in prefixes for i in range(1, len(parts)))


def _skeleton(cls: type[PreTrainedModel], config: Any) -> PreTrainedModel:
    """An instance of ``cls`` whose tensors are on the meta device (no memory, no init cost)."""
    with torch.device("meta"):
        return cls(config)


def _tied_pairs(model: torch.nn.Module) -> list[tuple[str, str]]:
    """``(first, other)`` names of parameters that are one tensor in ``model``."""
    first: dict[int, str] = {}
    pairs = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            pairs.append((first[id(param)], name))
        else:
            first[id(param)] = name
    return pairs
