"""Loading Hugging Face causal LMs and tokenizers from local directories.

Nothing here downloads: every load is ``local_files_only=True``. A model is named by a
local directory or by ``builtin:NAME`` (a tiny model built on the spot, see
:mod:`rltune.models.tiny`); :func:`resolve_model` turns the latter into a directory.
Problems a user can fix (a wrong path, a missing file, remote code not allowed, a model
that is not a causal LM) raise :class:`ModelLoadError` naming the path and the fix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from transformers import (
    AutoImageProcessor, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer,
    PreTrainedModel,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
from transformers.processing_utils import ProcessorMixin
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.utils import is_torchvision_available

from rltune.models.experts import ExpertsLayoutError, use_grouped_experts
from rltune.models.routing import RoutingError, restore_routing_bias
from rltune.models.safetensors_io import bad_files
from rltune.models.tiny import TINY_FORMAT_VERSION, TINY_SPECS, build_tiny
from rltune.models.tiny_vl import TINY_VL_FORMAT_VERSION, TINY_VL_SPECS, build_tiny_vl

BUILTIN_PREFIX = "builtin:"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "rltune" / "builtin"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
# Vocabulary files of the tokenizer formats transformers reads: fast, SentencePiece, BPE,
# WordPiece, Mistral's tekken.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "tekken.json"
)
# Config keys under which HF MoE architectures store their number of routed experts.
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_PATH_FIX = "set `model.path` to a local Hugging Face model directory or to builtin:tiny"
_REMOTE_FIX = "set `model.trust_remote_code: true` if you trust the code in that directory"
# JSON files the tokenizer reads besides its vocabulary; checked before transformers, whose
# parse error names no file or blames the tokenizer.
_TOKENIZER_JSON = ("config.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.json")


class ModelLoadError(ValueError):
    """A model or tokenizer could not be loaded; the message names the path and the fix."""


def load_tokenizer(path: str, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer saved in the local directory ``path``, padding on the left.

    Left padding keeps every prompt's last token in the last prompt column, which is where
    generation continues and where :func:`~rltune.models.logprobs.completion_logprobs`
    reads the first completion logit. A tokenizer without a pad token gets its EOS token as
    pad: padded positions are always identified by the attention mask, never by token id,
    so sharing the id is harmless. A tokenizer with neither is an error.
    """
    directory = _existing_dir(path)
    _check_tokenizer_files(directory)
    try:
        with held_transformers_warnings() as held:
            tokenizer = AutoTokenizer.from_pretrained(
                directory, local_files_only=True, trust_remote_code=trust_remote_code
            )
            held.release()
    except StrictDataclassError as err:
        raise ModelLoadError(f"{directory / 'config.json'} is not a valid config: {_one_line(err)}") from err
    except (OSError, ValueError, KeyError, TypeError) as err:
        # Suggest remote code only when transformers asked for it: never to "fix" a bad file.
        fix = (
            f"if it ships its own tokenizer code, {_REMOTE_FIX}" if "trust_remote_code" in str(err)
            else "re-save it with `tokenizer.save_pretrained`"
        )
        raise ModelLoadError(
            f"could not load a tokenizer from {directory}: {_one_line(err)}. The directory needs "
            f"tokenizer files written by `save_pretrained` (e.g. tokenizer.json and "
            f"tokenizer_config.json); {fix}"
        ) from err
    return _padded_left(tokenizer, directory)


def _check_tokenizer_files(directory: Path) -> None:
    for name in _TOKENIZER_JSON:
        if (directory / name).is_file():
            _read_json(directory / name)
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        # transformers 5 would build an empty tokenizer here instead of failing.
        raise ModelLoadError(
            f"{directory} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save "
            f"one there with `tokenizer.save_pretrained`, or {_PATH_FIX}"
        )


def _padded_left(tokenizer: PreTrainedTokenizerBase, directory: Path) -> PreTrainedTokenizerBase:
    """``tokenizer`` padding on the left, with its EOS as pad token if it has none."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError(
                f"the tokenizer in {directory} has neither a pad token nor an EOS token; "
                f"add `pad_token` to {directory / 'tokenizer_config.json'}"
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_model(
    path: str, *, dtype: str = "float32", trust_remote_code: bool = False
) -> PreTrainedModel:
    """The causal LM or vision-language model in the local directory ``path``, in ``dtype``.

    Checks, before handing over to transformers, that the directory exists, holds a
    ``config.json`` naming an architecture this transformers knows (or remote code that
    is allowed) with a causal-LM head or an image-text-to-text one (a vision-language
    model, loaded through ``AutoModelForImageTextToText``), and holds weights; and, after loading, that no
    weight was missing (transformers would otherwise initialise it at random, silently).
    A mixture-of-experts model's experts are switched to rltune's grouped compute
    (:func:`~rltune.models.experts.use_grouped_experts`, logged).
    """
    if dtype not in DTYPES:
        raise ModelLoadError(
            f"model dtype {dtype!r} is not one of {sorted(DTYPES)}; set `model.dtype`"
        )
    directory = _existing_dir(path)
    config = _read_config(directory)
    _check_architecture(config, directory, trust_remote_code=trust_remote_code)
    auto_class = AutoModelForImageTextToText if is_vision_language_config(config) else AutoModelForCausalLM
    if not any(next(directory.glob(p), None) for p in WEIGHT_PATTERNS):
        raise ModelLoadError(
            f"{directory} has a config.json but no weights (*.safetensors or *.bin); "
            f"save the model there with `save_pretrained`, or {_PATH_FIX}"
        )
    with held_transformers_warnings() as held:
        try:
            # Mismatched shapes are reported below, by key, in one line.
            model, info = auto_class.from_pretrained(
                directory,
                local_files_only=True,
                trust_remote_code=trust_remote_code,
                dtype=DTYPES[dtype],
                output_loading_info=True,
                ignore_mismatched_sizes=True,
            )
        except (OSError, ValueError, KeyError, RuntimeError, SafetensorError, StrictDataclassError) as err:
            raise hf_load_error(err, directory, "the model") from err
        if _check_loading_info(info, directory, model):
            held.release()
    if is_moe(model):
        # transformers' experts run a Python loop over experts under `eager`: switch every
        # MoE model rltune loads (policy, reference, critic, generator) to the grouped compute.
        try:
            use_grouped_experts(model)
        except ExpertsLayoutError as err:
            raise ModelLoadError(f"the model in {directory}: {err}") from err
    return model


def load_processor(path: str, *, trust_remote_code: bool = False) -> ProcessorMixin | None:
    """The processor (image processor + tokenizer) of the vision-language model at ``path``;
    ``None`` for a text-only model.

    Its tokenizer pads on the left with a pad token, as :func:`load_tokenizer` ensures, and
    is the run's tokenizer. transformers builds Qwen2-VL's processor (and others with a video
    processor) only with torchvision installed; without it the processor is put together
    from its image processor (PIL backend) and tokenizer, with no video processor: images
    work, videos do not.
    """
    directory = _existing_dir(path)
    config = _read_config(directory)
    if not is_vision_language_config(config):
        return None
    if not any((directory / name).is_file() for name in _PROCESSOR_FILES):
        raise ModelLoadError(
            f"{directory} holds a vision-language model but no image processor (none of "
            f"{', '.join(_PROCESSOR_FILES)}); save the model's processor there with "
            f"`processor.save_pretrained`"
        )
    _check_tokenizer_files(directory)
    for name in _PROCESSOR_FILES:
        if (directory / name).is_file():
            _read_json(directory / name)
    try:
        with held_transformers_warnings() as held:
            processor = _processor(directory, config, trust_remote_code)
            held.release()
    except (OSError, ValueError, KeyError, TypeError, ImportError, StrictDataclassError) as err:
        raise ModelLoadError(
            f"could not load the processor of {directory}: {_one_line(err)}. The directory needs "
            f"the files `processor.save_pretrained` writes (preprocessor_config.json or "
            f"processor_config.json, and the tokenizer's)"
        ) from err
    if not isinstance(processor, ProcessorMixin):
        # AutoProcessor hands back the tokenizer alone when it finds no processor class.
        raise ModelLoadError(
            f"{directory} names no processor class transformers {transformers.__version__} "
            f"knows (got a {type(processor).__name__}); set `processor_class` in "
            f"{directory / 'processor_config.json'}, or save the processor with `processor.save_pretrained`"
        )
    _padded_left(processor.tokenizer, directory)
    return processor


# The image processor's settings: alone, or inside the processor's own config (transformers 5).
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def _processor(directory: Path, config: dict[str, Any], trust_remote_code: bool) -> ProcessorMixin:
    settings = _read_json(directory / "processor_config.json") if (directory / "processor_config.json").is_file() else {}
    name = settings.get("processor_class") or PROCESSOR_MAPPING_NAMES.get(config["model_type"])
    cls = getattr(transformers, name, None) if name else None
    if cls is None or is_torchvision_available() or "video_processor" not in cls.get_attributes():
        return AutoProcessor.from_pretrained(
            directory, local_files_only=True, trust_remote_code=trust_remote_code
        )
    return _processor_without_video(cls, directory, trust_remote_code)


def _processor_without_video(cls: type[ProcessorMixin], directory: Path, trust_remote_code: bool) -> ProcessorMixin:
    """``cls`` (a processor class with a video processor) built from the directory's image
    processor, tokenizer and settings, without the video processor (torchvision)."""
    settings, _ = cls.get_processor_dict(str(directory), local_files_only=True)
    remote = dict(local_files_only=True, trust_remote_code=trust_remote_code)
    image_processor = AutoImageProcessor.from_pretrained(
        directory, processor_config=settings.pop("image_processor", None), **remote
    )
    tokenizer = AutoTokenizer.from_pretrained(directory, **remote)
    for key in ("processor_class", "video_processor", "auto_map"):
        settings.pop(key, None)
    processor = cls.__new__(cls)
    # ProcessorMixin.__init__ checks each part against its base class; the video one,
    # VideoProcessorMixin, exists only with torchvision, so the absent part skips the check.
    checked = processor.check_argument_for_proper_class
    processor.check_argument_for_proper_class = (
        lambda part, value: None if part == "video_processor" and value is None else checked(part, value)
    )
    cls.__init__(processor, image_processor=image_processor, tokenizer=tokenizer,
                 video_processor=None, **settings)
    del processor.check_argument_for_proper_class
    return processor


def hf_load_error(err: Exception, directory: Path, what: str) -> ModelLoadError:
    """The :class:`ModelLoadError` for ``err`` raised by ``from_pretrained(directory)``:
    a corrupt weights file or an invalid config named as such, anything else as is."""
    if isinstance(err, SafetensorError):
        found = bad_files(directory)
        return ModelLoadError("; ".join(found) if found else f"{directory}: {err}")
    if isinstance(err, StrictDataclassError):
        return ModelLoadError(f"{directory / 'config.json'} is not a valid config: {_one_line(err)}")
    return ModelLoadError(
        f"could not load {what} in {directory}: {_one_line(err)}. Check that its weights were "
        f"written by `save_pretrained` for this config, or {_PATH_FIX}"
    )


def _check_loading_info(info: dict[str, Any], directory: Path, model: PreTrainedModel) -> bool:
    """Raise unless every weight of the model came from ``directory``; read back a saved routing
    bias (:func:`~rltune.models.routing.restore_routing_bias`). False: the load report is only about it."""
    bad = sorted(info["missing_keys"]) + sorted(
        _mismatch(k) for k in info["mismatched_keys"]
    )
    if bad:
        raise ModelLoadError(
            f"the weights in {directory} do not fit its config.json: missing or mismatched "
            f"{bad[:5]}{' ...' if len(bad) > 5 else ''}; the checkpoint is incomplete or "
            f"belongs to another architecture"
        )
    unexpected = sorted(info["unexpected_keys"])
    try:
        restored = restore_routing_bias(model, directory, unexpected)
    except RoutingError as err:
        raise ModelLoadError(str(err)) from err
    return not unexpected or len(restored) < len(unexpected)


class _HeldRecords(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.released = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not any(record is held for held in self.records):  # each handler asks once
            self.records.append(record)
        return False

    def release(self) -> None:
        """Log the held records after all, when the block ends: the load succeeded."""
        self.released = True


@contextmanager
def held_transformers_warnings() -> Iterator[_HeldRecords]:
    """Hold what transformers logs inside the block: a load that fails is reported by
    rltune's own one-line error, and transformers' report of the same problem (a table
    of keys, printed first) would bury it. Call ``release()`` on success to log them."""
    handlers = logging.getLogger("transformers").handlers
    held = _HeldRecords()
    for handler in handlers:
        handler.addFilter(held)
    try:
        yield held
    finally:
        for handler in handlers:
            handler.removeFilter(held)
    if held.released:
        for record in held.records:
            logging.getLogger(record.name).handle(record)


def resolve_model(path: str, *, cache_dir: str | None = None, seed: int = 0) -> str:
    """A local directory for ``path``: ``builtin:NAME`` is built, anything else returned as is.

    The builtin model is built once into ``CACHE/NAME-HASH`` (``CACHE`` defaults to
    ``~/.cache/rltune/builtin``), where ``HASH`` covers the build spec, ``seed``, the
    factory's format version and the transformers version, so a changed spec never
    reuses stale weights. The build writes a temporary directory and renames it, so a
    directory under its final name is always complete, even with concurrent builders.
    """
    if not path.startswith(BUILTIN_PREFIX):
        return path
    name = path[len(BUILTIN_PREFIX):]
    builders = {**{n: build_tiny for n in TINY_SPECS}, **{n: build_tiny_vl for n in TINY_VL_SPECS}}
    if name not in builders:
        known = ", ".join(BUILTIN_PREFIX + n for n in builders)
        raise ModelLoadError(f"unknown builtin model {path!r}; set `model.path` to one of {known}")
    spec = {**TINY_SPECS, **TINY_VL_SPECS}[name]
    root = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    version = TINY_VL_FORMAT_VERSION if name in TINY_VL_SPECS else TINY_FORMAT_VERSION
    final = root / f"{name}-{_spec_hash(spec, seed, version)}"
    if final.is_dir():
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        builders[name](tmp, seed=seed, **spec)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache is readable like any model dir
        os.rename(tmp, final)
    except OSError:
        # Another process renamed its complete build into place first: use that one.
        if not final.is_dir():
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return str(final)


def is_moe(model: torch.nn.Module) -> bool:
    """Whether ``model`` routes tokens to experts (its config counts more than one)."""
    config = model.config
    return any(int(getattr(config, key, None) or 0) > 1 for key in _EXPERT_COUNT_KEYS)


def router_aux_loss_coef(model: torch.nn.Module) -> float:
    """The router load-balancing loss weight in the model's config; 0.0 for a dense model."""
    if not is_moe(model):
        return 0.0
    coef = getattr(model.config, "router_aux_loss_coef", None)
    if coef is None:
        raise ModelLoadError(
            f"{type(model).__name__} is a mixture of experts but its config has no "
            f"router_aux_loss_coef; set `model.router_aux_loss_coef`"
        )
    return float(coef)


def _existing_dir(path: str) -> Path:
    if path.startswith(BUILTIN_PREFIX):
        raise ModelLoadError(
            f"{path!r} names a builtin model, not a directory; pass it through "
            f"`rltune.models.resolve_model` first, which builds it and returns its directory"
        )
    directory = Path(path).expanduser()
    if not directory.exists():
        raise ModelLoadError(f"model path {directory} does not exist; {_PATH_FIX}")
    if not directory.is_dir():
        raise ModelLoadError(f"model path {directory} is a file, not a directory; {_PATH_FIX}")
    return directory


def _read_config(directory: Path) -> dict[str, Any]:
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(
            f"{directory} has no config.json, so it is not a Hugging Face model directory; "
            f"{_PATH_FIX}"
        )
    config = _read_json(config_file)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_file} holds a JSON {type(config).__name__}, not an object")
    for part in (config, config.get("text_config")):  # a size of 0 ends in transformers' ZeroDivisionError
        bad = [f"{k}={v!r}" for k in _SIZES if (v := part.get(k)) is not None and (type(v) is not int or v < 1)] \
            if isinstance(part, dict) else []  # None: the model's default (num_key_value_heads)
        if bad:
            raise ModelLoadError(f"{config_file}: {', '.join(bad)}: each must be an integer >= 1 (a damaged config?)")
    return config


_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelLoadError(
            f"{path} is not valid JSON ({err}); the file is damaged: restore it or save the "
            f"model again with `save_pretrained`"
        ) from err


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def _mismatch(entry: Any) -> str:
    """A mismatched key of transformers' loading info: a name or (name, saved, model) shapes."""
    if isinstance(entry, tuple) and len(entry) == 3:
        name, saved, model = entry
        return f"{name} (saved {tuple(saved)}, config {tuple(model)})"
    return str(entry)


def _check_architecture(
    config: dict[str, Any], directory: Path, *, trust_remote_code: bool
) -> None:
    """Raise unless transformers can build a causal LM or a vision-language model from
    ``config`` under these rules."""
    model_type = config.get("model_type")
    if model_type is None:
        raise ModelLoadError(f"{directory / 'config.json'} has no `model_type`; {_PATH_FIX}")
    auto_map = config.get("auto_map", {})
    remote_class = next((c for c in _AUTO_CLASSES if c in auto_map), None)
    if _known_head(model_type) or (remote_class and trust_remote_code):
        return
    if remote_class:
        raise ModelLoadError(
            f"the model in {directory} (model_type {model_type!r}) needs code shipped inside "
            f"that directory, which is off by default; {_REMOTE_FIX}"
        )
    if model_type in CONFIG_MAPPING_NAMES or auto_map:
        raise ModelLoadError(
            f"the model in {directory} (model_type {model_type!r}) is not a causal language "
            f"model or a vision-language (image-text-to-text) model: neither transformers nor "
            f"its config's `auto_map` has an {' or '.join(_AUTO_CLASSES)} for it; {_PATH_FIX} "
            f"of a decoder-only LM or a vision-language model"
        )
    raise ModelLoadError(
        f"transformers {transformers.__version__} does not know model_type {model_type!r} "
        f"of {directory}; upgrade transformers, or {_PATH_FIX}"
    )


_AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForImageTextToText")


def _known_head(model_type: str) -> bool:
    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def is_vision_language_config(config: dict[str, Any]) -> bool:
    """Whether the ``config.json`` contents ``config`` describe a vision-language model.

    An image-text-to-text architecture with a ``vision_config`` (Gemma 3 and Mllama are
    also causal LMs in transformers' tables; their text-only checkpoints have no vision
    config), or remote code that registers only an ``AutoModelForImageTextToText``.
    """
    model_type = config.get("model_type")
    if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and "vision_config" in config:
        return True
    auto_map = config.get("auto_map", {})
    return "AutoModelForImageTextToText" in auto_map and "AutoModelForCausalLM" not in auto_map


def _spec_hash(spec: dict[str, Any], seed: int, version: int) -> str:
    key = {
        "spec": spec,
        "seed": seed,
        "format": version,
        "transformers": transformers.__version__,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
