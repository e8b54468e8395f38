"""A Generator over vLLM (``rollout.engine: vllm``; the ``vllm`` extra), for GPU machines.

vLLM holds its own copy of the weights. ``load_weights`` copies new ones into that copy in
place, through the model's own ``load_weights`` (which fuses q/k/v and gate/up the way the
engine lays them out), run inside vLLM's worker by :class:`WeightLoader`, vLLM's
``worker_extension_cls``; the prefix cache is then dropped, since its keys and values were
computed by the old weights. Nothing is written to disk and the engine is not rebuilt.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one GPU, no tensor
parallelism), so tensors handed to ``load_weights`` reach the worker without being
serialised.

Log-probs are vLLM's ``processed_logprobs``: of the sampled token under the
temperature-scaled distribution, what :class:`~rltune.rollout.hf.HFGenerator` reports and
the learner recomputes. vLLM computes them *after* top-k/top-p filtering, which
renormalises over the kept tokens; the learner's are unfiltered, so the two would differ
by the kept mass on every token. The generator therefore refuses ``top_k``/``top_p``
filtering rather than feed the importance correction a biased ratio.

Sampling is seeded per request from the generator's ``rng`` (one draw per prompt; vLLM
gives the ``n`` samples of a prompt seeds ``s, s+1, ...``), so a run restored with the
same ``rng`` state samples the same completions.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from rltune.config import ConfigError
from rltune.config.schema import VLLM_RESERVED_ARGS
from rltune.data.images import decode_image
from rltune.data.records import Prompt, Rollout, SamplingParams
from rltune.models.load import is_vision_language_config
from rltune.rollout.hf import cut_at_stop, generation_eos_ids, prompt_ids


class VLLMUnavailable(ConfigError):
    """vLLM is not installed, or cannot start with this model and ``rollout.vllm``."""


def vllm_missing() -> str | None:
    """Why a :class:`VLLMGenerator` cannot be built here, or None when it can be tried."""
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        return f"vLLM is not installed ({err}): pip install 'rltune[vllm]' on a GPU machine; `make test-vllm` tries vLLM's CPU build"
    return None


class WeightLoader:
    """Methods vLLM mixes into its worker class (``worker_extension_cls``); called by
    name through ``LLM.collective_rpc``. Names carry a prefix so none clashes with the
    worker's own.

    An update is ``start``, one or more ``load`` (the whole model between them), then
    ``finish``: vLLM may have repacked a layer's weights for its kernels after loading
    (its CPU backend does), so a layer is loaded in checkpoint form and processed again,
    layer by layer, by vLLM's reload helpers where this vLLM has them."""

    def rltune_start_update(self) -> None:
        reload = _reload_helpers()
        if reload is not None:
            with self._rltune_config():
                reload.initialize_layerwise_reload(self.get_model())  # type: ignore[attr-defined]

    def rltune_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named ``weights`` into the engine's model."""
        with self._rltune_config():
            self.get_model().load_weights(weights=iter(weights))  # type: ignore[attr-defined]

    def rltune_finish_update(self) -> None:
        reload = _reload_helpers()
        if reload is not None:
            with self._rltune_config():
                reload.finalize_layerwise_reload(self.get_model(), self.model_config)  # type: ignore[attr-defined]

    def _rltune_config(self) -> Any:
        from vllm.config import set_current_vllm_config

        return set_current_vllm_config(self.vllm_config)  # type: ignore[attr-defined]


def _reload_helpers() -> Any:
    try:
        from vllm.model_executor.model_loader import reload
    except ImportError:  # a vLLM from before layerwise reloading: weights load as they are
        return None
    return reload


class VLLMGenerator:
    """The Generator protocol over a ``vllm.LLM`` built from the model directory.

    ``seed``: the engine's own seed; ``rng``: draws each request's sampling seed.
    ``engine_args``: further ``vllm.LLM`` keyword arguments (``gpu_memory_utilization``,
    ``max_model_len``, ``enforce_eager``, ...)."""

    def __init__(
        self,
        model_dir: str,
        tokenizer: Any,
        *,
        dtype: str = "float32",
        rng: torch.Generator | None = None,
        seed: int = 0,
        trust_remote_code: bool = False,
        engine_args: Mapping[str, Any] | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        missing = vllm_missing()
        if missing is not None:
            raise VLLMUnavailable(f"rollout.engine=vllm: {missing}")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        args = dict(engine_args or {})
        if clash := sorted(VLLM_RESERVED_ARGS & set(args)):
            raise ConfigError(f"rollout.vllm.engine_args: {clash} are set by rltune, not by engine_args")
        try:
            self.llm = LLM(
                model=model_dir, tokenizer=model_dir, dtype=dtype, seed=seed,
                logprobs_mode="processed_logprobs",
                worker_extension_cls=f"{WeightLoader.__module__}.{WeightLoader.__qualname__}",
                # one process for one GPU; worker processes (each loading its shard of every
                # update through collective_rpc) when the engine spans several
                tensor_parallel_size=tensor_parallel_size,
                distributed_executor_backend="uni" if tensor_parallel_size == 1 else "mp",
                trust_remote_code=trust_remote_code, **args,
            )
        except Exception as err:
            raise VLLMUnavailable(f"vLLM could not start on {model_dir}: {type(err).__name__}: {err}") from err
        self.model_dir = model_dir
        self.dtype = dtype
        self.tokenizer = tokenizer
        self.trust_remote_code = trust_remote_code
        self.rng = rng if rng is not None else torch.Generator().manual_seed(seed)
        self.version = 0
        self._meta_model: torch.nn.Module | None = None
        self.eos_ids = generation_eos_ids(_generation_config(model_dir), tokenizer)
        """Tokens that end a completion, as :func:`~rltune.rollout.hf.eos_ids` gives them."""

    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        """Copy ``tensors`` (every weight, HF names, any device) into the engine's
        weights, then sample as policy ``version``."""
        if tensors is not None:
            # vLLM reloads layer by layer and processes a layer once all its weights came:
            # a partial update would leave layers unloaded, so it is refused up front
            if missing := sorted(self.required_names() - set(tensors)):
                raise ValueError(
                    f"VLLMGenerator.load_weights takes the whole model; {len(missing)} weight(s) "
                    f"missing, e.g. {missing[:3]}"
                )
            self.load_buckets([tensors.items()])
        self.version = version

    def step_metrics(self) -> dict[str, float]:
        """Nothing to report per step (the Generator protocol's hook)."""
        return {}

    def load_buckets(self, buckets: Iterable[Iterable[tuple[str, torch.Tensor]]]) -> None:
        """One weight update whose tensors come a bucket at a time (a broadcast): each
        bucket is loaded as it arrives; together they must be the whole model. The
        version is unchanged."""
        self._rpc("rltune_start_update")
        for bucket in buckets:
            self._rpc("rltune_load_weights", list(bucket))
        self._rpc("rltune_finish_update")
        self.llm.reset_prefix_cache()

    def _rpc(self, method: str, *args: Any) -> Any:
        try:
            return self.llm.collective_rpc(method, args=args)
        except Exception as err:
            what = ""
            if args:
                names = [n for n, _ in args[0]]
                what = f" ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
            raise ValueError(f"vLLM's model did not take the weights{what}: {type(err).__name__}: {err}") from err

    def meta_weights(self) -> dict[str, torch.Tensor]:
        """Every weight in the HF layout the learner sends (the engine's own are fused
        differently), as meta tensors of the right names, shapes and dtypes: what a
        broadcast channel must carry."""
        return self._skeleton().state_dict()

    def required_names(self) -> set[str]:
        """The HF names a whole update must hold: one of each set of tied names (vLLM
        loads a tied weight once), every other weight."""
        seen: set[int] = set()
        names = set()
        for name, tensor in self._skeleton().state_dict(keep_vars=True).items():
            if id(tensor) not in seen:
                seen.add(id(tensor))
                names.add(name)
        return names

    def _skeleton(self) -> torch.nn.Module:
        """The HF model of ``model_dir`` on the meta device (built once); a vision-language
        model's whole (tower, projector, language model), as the learner sends it."""
        if self._meta_model is None:
            from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

            config = AutoConfig.from_pretrained(self.model_dir, trust_remote_code=self.trust_remote_code)
            vision = is_vision_language_config(config.to_dict())
            with torch.device("meta"):
                self._meta_model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_config(
                    config, torch_dtype=getattr(torch, self.dtype), trust_remote_code=self.trust_remote_code
                )
        return self._meta_model

    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams, *, group_offset: int = 0
    ) -> list[Rollout]:
        """``params.n`` samples of each prompt; samples of prompt ``i`` get group
        ``group_offset + i`` and are adjacent in the output."""
        from vllm import SamplingParams as VLLMParams
        from vllm.inputs import TokensPrompt

        check_sampling(params)
        # vLLM takes n > 1 only when sampling: a greedy prompt is sent n times instead
        copies = params.n if params.temperature == 0 else 1
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=self.rng).tolist()
        requests = [TokensPrompt(**vllm_request(p)) for p in prompts for _ in range(copies)]
        per_request = [
            VLLMParams(
                n=params.n // copies, temperature=params.temperature, max_tokens=params.max_new_tokens,
                stop=list(params.stop) or None, logprobs=0, seed=seed,
                detokenize=bool(params.stop),  # vLLM finds stop strings in its text; rltune decodes the rest
            )
            for seed in seeds for _ in range(copies)
        ]
        outputs = self.llm.generate(requests, per_request, use_tqdm=False)
        samples = []
        for i, prompt in enumerate(prompts):
            mine = outputs[i * copies : (i + 1) * copies]
            completions = [c for out in mine for c in sorted(out.outputs, key=lambda c: c.index)]
            prompt_tensor = torch.tensor(list(mine[0].prompt_token_ids), dtype=torch.long)
            if len(completions) != params.n:
                raise RuntimeError(f"vLLM returned {len(completions)} samples of prompt {prompt.id!r}, not {params.n}")
            for c in completions:
                if c.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM ended a sample of prompt {prompt.id!r} with {c.finish_reason!r}")
                samples.append((group_offset + i, prompt, prompt_tensor, c))
        return self._rollouts(samples, params)

    def _rollouts(self, samples: list[tuple[int, Prompt, torch.Tensor, Any]], params: SamplingParams) -> list[Rollout]:
        """Rollouts from ``(group, prompt, prompt token ids, vLLM CompletionOutput)``; the
        samples of one prompt share its ids tensor (as rltune's sampler's share a row)."""
        texts = self.tokenizer.batch_decode([list(c.token_ids) for *_, c in samples], skip_special_tokens=True)
        rollouts = []
        for (group, prompt, prompt_tensor, c), text in zip(samples, texts):
            ids = torch.tensor(list(c.token_ids), dtype=torch.long)
            rollouts.append(
                Rollout(
                    prompt_id=prompt.id,
                    group=group,
                    prompt_ids=prompt_tensor,
                    completion_ids=ids,
                    completion_logprobs=sampled_logprobs(c.token_ids, c.logprobs),
                    loss_mask=torch.ones(len(ids)),
                    text=cut_at_stop(text, params.stop) if params.stop else text,
                    finish_reason=c.finish_reason,
                    policy_version=self.version,
                    images=prompt.images,
                    vision=prompt.vision,
                )
            )
        return rollouts


def vllm_request(prompt: Prompt) -> dict[str, Any]:
    """The fields of a ``vllm.inputs.TokensPrompt`` for ``prompt``: its token ids and, for a
    prompt with images, ``multi_modal_data={"image": [PIL images]}`` in the order of its
    image tokens.

    The ids are rltune's, rendered by the model's processor, so the image placeholders are
    already expanded to each image's token count; vLLM's multi-modal processor finds the
    expanded placeholders in a token prompt and does not expand them again, so the engine
    sees the same ids the learner trains on (and returns them as ``prompt_token_ids``).
    The images were checked against ``data.max_image_pixels`` when the data was loaded."""
    request: dict[str, Any] = {"prompt_token_ids": prompt_ids(prompt)}
    if prompt.images:
        request["multi_modal_data"] = {"image": [
            decode_image(image, index=k, max_pixels=sys.maxsize) for k, image in enumerate(prompt.images)
        ]}
    return request


def engine_args(cfg: Any) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments from a :class:`~rltune.config.schema.VLLMConfig`."""
    args: dict[str, Any] = {"gpu_memory_utilization": cfg.gpu_memory_utilization, "enforce_eager": cfg.enforce_eager}
    if cfg.max_model_len is not None:
        args["max_model_len"] = cfg.max_model_len
    return {**args, **cfg.engine_args}


def _generation_config(model_dir: str) -> Any:
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json: the tokenizer's EOS alone
        return None


def check_sampling(params: SamplingParams) -> None:
    """What vLLM cannot sample while reporting rltune's log-probs (see the module doc)."""
    if params.temperature > 0 and (params.top_k or params.top_p < 1.0):
        raise ValueError(
            f"rollout.engine=vllm samples with top_k=0 and top_p=1 only (got top_k={params.top_k}, "
            f"top_p={params.top_p}): vLLM reports log-probs of the filtered distribution, "
            "which the learner's unfiltered ones would not match"
        )


def sampled_logprobs(token_ids: Sequence[int], logprobs: Sequence[Mapping[int, Any]] | None) -> torch.Tensor:
    """The sampled tokens' log-probs out of vLLM's per-position ``{token_id: Logprob}``
    dicts (``logprobs=0`` asks for the sampled token's alone)."""
    if logprobs is None or len(logprobs) != len(token_ids):
        got = "none" if logprobs is None else f"{len(logprobs)}"
        raise RuntimeError(f"vLLM returned {got} log-probs for {len(token_ids)} tokens")
    return torch.tensor([position[token].logprob for token, position in zip(token_ids, logprobs)],
                        dtype=torch.float32)
