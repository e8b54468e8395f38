"""The default Generator: batched sampling with a KV cache on a transformers model.

The decode loop is written here rather than calling ``model.generate`` so that the
sampled tokens' log-probs come out of the same pass (no second forward) and the loop stays
free of per-token logits processors. Its logits come from one of two sources with the same
``prefill`` / ``step`` interface: the HF model's own forward and cache (:class:`HFSteps`),
or, for Llama-family models, :class:`~rltune.rollout.fastpath.LeanDecoder`, which runs the
same arithmetic on the same tensors without transformers' per-call overhead.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from rltune.data.collate import left_pad
from rltune.data.records import Prompt, Rollout, SamplingParams, VisionInputs
from rltune.metrics import keys
from rltune.metrics.types import Metric
from rltune.models.autocast import autocast_for
from rltune.models import replay
from rltune.models.dense_layout import has_hooks, supports_fastpath
from rltune.models.routing import NO_ROUTE, expert_count, expert_load_metrics, recording, route_counts
from rltune.models.vision import batch_vision_inputs
from rltune.models.vl_inputs import (
    model_vision_inputs,
    mrope_owner,
    mrope_positions,
    placeholder_ids,
    suppress_placeholders,
)
from rltune.rollout.compiled import CompiledStep
from rltune.rollout.fastpath import LeanDecoder
from rltune.rollout.sampling import sample_next


def eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids that end a completion: the generation config's EOS ids and the tokenizer's."""
    return generation_eos_ids(model.generation_config, tokenizer)


def generation_eos_ids(generation_config: Any, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """:func:`eos_ids` from a ``GenerationConfig`` (None: the tokenizer's alone)."""
    ids: set[int] = set()
    gen_eos = getattr(generation_config, "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(v) for v in value)
    if not ids:
        raise ValueError("the tokenizer and the model's generation config define no EOS token")
    return sorted(ids)


class HFGenerator:
    """Generator protocol over a transformers causal LM.

    In the local runtime the learner and the generator share one module, so
    ``load_weights`` only records the version; given tensors, it copies them in.

    On an MoE model whose routers are installed (:func:`rltune.models.routing.install_routing`)
    every rollout carries ``routes``: the experts each of its tokens went to, per MoE
    layer, for the learner to replay; and :meth:`step_metrics` reports the experts' load
    over the tokens it ran (``gen/moe/...``).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        rng: torch.Generator | None = None,
        fastpath: bool = True,
        precision: str = "fp32",
        compile: bool = False,
    ) -> None:
        """``fastpath``: decode with :class:`LeanDecoder` when the model supports it
        (:func:`supports_fastpath`) and has no forward hooks; off, always the HF forward.
        ``compile`` (``rollout.compile``): the lean decoder's step compiled over a static
        cache (:mod:`rltune.rollout.compiled`); refused for a model the lean decoder does
        not support, since the HF forward's growing cache would recompile every token.
        ``precision``: ``fp32``, or ``bf16``/``fp16`` to sample under that autocast (the
        learner's precision, so that the sampled log-probs match its arithmetic)."""
        self.precision = precision
        self.model = model
        self.fastpath = fastpath and supports_fastpath(model)
        if compile and not self.fastpath:
            raise ValueError(
                f"rollout.compile compiles the lean decoder's step, which does not run "
                f"{type(model).__name__} with this config (it runs Qwen2, Llama and Mistral "
                "causal LMs in float32 or bfloat16 with default rope, full attention and plain "
                "Linear projections: no MoE, no LoRA adapters); set rollout.compile=false"
                if fastpath else "rollout.compile needs the lean decoder, which fastpath=False turns off"
            )
        self._compiled = CompiledStep(next(model.parameters()).device) if compile else None
        self.tokenizer = tokenizer
        self.rng = rng if rng is not None else torch.Generator().manual_seed(0)
        self.version = 0
        self._eos = torch.tensor(eos_ids(model, tokenizer))
        self._pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(self._eos[0])
        self._load: torch.Tensor | None = None
        # a vision-language model never samples its image placeholders (rltune.models.vl_inputs)
        self._placeholders = placeholder_ids(model)

    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        if tensors is not None:
            self.model.load_state_dict(dict(tensors), strict=False)
            replay.forget(self.model)  # records of the old weights
        self.version = version

    def step_metrics(self) -> dict[str, Metric]:
        """The expert load of the tokens routed since the last call (MoE models with
        installed routers: ``gen/moe/load_max`` ...); nothing otherwise."""
        load = self.take_expert_load()
        return {} if load is None else expert_load_metrics(load, key=keys.generation_key)

    def take_expert_load(self) -> torch.Tensor | None:
        """``[L, E]`` routing counts of the tokens generated since the last call (None for
        a dense model), and start counting afresh: a pool of generators sums them."""
        load, self._load = self._load, None
        return load

    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams, *, group_offset: int = 0
    ) -> list[Rollout]:
        """``params.n`` samples of each prompt; samples of prompt ``i`` get group
        ``group_offset + i`` and are adjacent in the output."""
        prompt_seqs = [torch.tensor(prompt_ids(p), dtype=torch.long) for p in prompts]
        ids, mask = left_pad(prompt_seqs, self._pad)
        device_type = next(self.model.parameters()).device.type
        with recording(self.model, ids.shape[0] * params.n) as recorder, autocast_for(self.precision, device_type):
            # a group's prompt is run once and its cache copied to the group's rows; a
            # route recorder counts rows from the start, so there every row runs its prompt
            shared = params.n if recorder is None else 1
            copies = params.n // shared
            rows_ids, rows_mask = ids.repeat_interleave(copies, 0), mask.repeat_interleave(copies, 0)
            vision = prompt_vision(prompts, copies)
            tokens, logprobs, lengths, stopped = self._decode(rows_ids, rows_mask, params, repeats=shared, vision=vision)
        routes = recorder.routes() if recorder is not None else None
        texts = self.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        width = ids.shape[1]
        out = []
        for row in range(tokens.shape[0]):
            group = row // params.n
            length = int(lengths[row])
            sample_routes = None if routes is None else row_routes(
                routes, row, width - len(prompt_seqs[group]), width + length)
            text = texts[row]
            if params.stop:
                text = cut_at_stop(text, params.stop)
            out.append(
                Rollout(
                    prompt_id=prompts[group].id,
                    group=group_offset + group,
                    prompt_ids=ids[group, width - len(prompt_seqs[group]) :],
                    completion_ids=tokens[row, :length],
                    completion_logprobs=logprobs[row, :length],
                    loss_mask=torch.ones(length),
                    text=text,
                    finish_reason="stop" if bool(stopped[row]) else "length",
                    policy_version=self.version,
                    routes=sample_routes,
                    images=prompts[group].images,
                    vision=prompts[group].vision,
                )
            )
        if routes is not None:
            self._count_load([r.routes for r in out])
        return out

    def _count_load(self, routes: list[torch.Tensor]) -> None:
        """Add the experts chosen for these rollouts' tokens to the step's load."""
        counts = route_counts(torch.cat(routes), expert_count(self.model))
        self._load = counts if self._load is None else self._load + counts

    @torch.inference_mode()
    def _decode(
        self, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams, *, repeats: int = 1,
        vision: VisionInputs | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sampling loop over ``R = len(ids) * repeats`` rows (each prompt row
        ``repeats`` times, adjacent); ``vision``: the pixel inputs of ``ids``' rows.
        Returns ``tokens [R, C]`` (pad after the end),
        ``logprobs [R, C]``, ``lengths [R]`` (EOS included) and ``stopped [R]`` bool."""
        model = self.model
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        ids, mask = ids.to(device), mask.to(device)
        rows = ids.shape[0] * repeats
        lean = self.fastpath and vision is None and not has_hooks(model)
        if self._compiled is not None and not lean:
            raise RuntimeError("rollout.compile: the model has forward hooks registered, which the "
                               "compiled lean step would skip; remove them or set rollout.compile=false")
        if lean:
            source = LeanDecoder(model, max_new_tokens=params.max_new_tokens, compiled=self._compiled,
                                 keep_forward=replay.store_of(model) is not None)
        else:
            source = HFSteps(model, max_new_tokens=params.max_new_tokens, vision=vision)
        logits = source.prefill(ids, mask, repeats=repeats)
        eos = self._eos.to(device)
        tokens = torch.full((rows, params.max_new_tokens), self._pad, dtype=torch.long, device=device)
        logprobs = torch.zeros((rows, params.max_new_tokens), device=device)
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        lengths = torch.full((rows,), params.max_new_tokens, dtype=torch.long, device=device)
        for t in range(params.max_new_tokens):
            tok, lp = sample_next(
                suppress_placeholders(logits.float(), self._placeholders), temperature=params.temperature,
                top_k=params.top_k, top_p=params.top_p, generator=self.rng,
            )
            tok = tok.masked_fill(done, self._pad)
            tokens[:, t] = tok
            logprobs[:, t] = lp.masked_fill(done, 0.0)
            finished = ~done & torch.isin(tok, eos)
            if params.stop:
                finished |= self._hit_stop(tokens[:, : t + 1], done, params.stop)
            lengths = torch.where(finished, t + 1, lengths)
            done = done | finished
            if bool(done.all()) or t + 1 == params.max_new_tokens:
                break
            logits = source.step(tok)
        if was_training:
            model.train()
        width = int(lengths.max()) if rows else 0
        return tokens[:, :width].cpu(), logprobs[:, :width].cpu(), lengths.cpu(), done.cpu()

    def _hit_stop(self, tokens: torch.Tensor, done: torch.Tensor, stop: tuple[str, ...]) -> torch.Tensor:
        """Rows not yet done whose latest tokens (``tokens [R, t]``, sampled so far) decode
        to text holding a stop string. Runs only when stop strings are configured.

        The last few tokens are decoded together, not one by one: a character split over
        several byte tokens, or a SentencePiece word-initial space, decodes right only in
        context. A stop string of ``k`` UTF-8 bytes spans at most ``k`` tokens, and a match
        ending before the newest token was already reported, so that window suffices."""
        window = max(len(s.encode("utf-8")) for s in stop) + 4
        live = (~done).nonzero().flatten().tolist()
        texts = self.tokenizer.batch_decode(tokens[live, -window:].tolist(), skip_special_tokens=True)
        hit = torch.zeros_like(done)
        for row, text in zip(live, texts):
            hit[row] = any(s in text for s in stop)
        return hit


class HFSteps:
    """Next-token logits from the HF forward with its ``DynamicCache``; the interface of
    :class:`~rltune.rollout.fastpath.LeanDecoder`: ``prefill(ids [U, P], mask [U, P],
    repeats=n)`` (``R = U n`` rows) then ``step(tokens [R])``, each returning the next position's logits ``[R, V]``.
    Positions count real tokens only (``cumsum(mask) - 1``), so left padding shifts nothing."""

    deltas: torch.Tensor | None = None
    """M-RoPE models: ``[R, 1]`` each row's offset of its next position from its token count."""

    def __init__(self, model: PreTrainedModel, *, max_new_tokens: int, vision: VisionInputs | None = None) -> None:
        """``vision``: the prompts' pixel inputs (rows' concatenated) for a vision-language
        model; an M-RoPE model (Qwen2-VL) then gets 3-D positions from its own rope index
        (:mod:`rltune.models.vl_inputs`)."""
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.cache = DynamicCache()
        self.cache_arg = {_cache_kwarg(model): self.cache}
        device = next(model.parameters()).device
        self.vision = {} if vision is None else model_vision_inputs(vision, device)
        self.rope = mrope_owner(model) if vision is not None else None

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, *, repeats: int = 1) -> torch.Tensor:
        """Run the prompts once; with ``repeats > 1`` each row's cache is then copied to
        ``repeats`` adjacent rows, and so are its logits (and a vision-language prompt's
        position offsets: its images go through the vision tower once)."""
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        model_positions = positions
        if self.rope is not None:
            model_positions, deltas = mrope_positions(self.rope, ids, mask, self.vision)
            self.deltas = deltas.repeat_interleave(repeats, 0)
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=model_positions,
            use_cache=True, logits_to_keep=1, **self.cache_arg, **self.vision,
        )
        if repeats > 1:
            self.cache.batch_repeat_interleave(repeats)
            mask, positions = mask.repeat_interleave(repeats, 0), positions.repeat_interleave(repeats, 0)
        self.mask = mask
        self.next_pos = positions[:, -1:]
        self.step_mask = torch.ones((mask.shape[0], 1), dtype=mask.dtype, device=mask.device)
        return out.logits[:, -1].repeat_interleave(repeats, 0)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.step_mask], dim=1)
        self.next_pos = self.next_pos + 1
        # M-RoPE: the next token's position is its count plus the prompt's offset, in
        # all three components (text after the images)
        positions = self.next_pos if self.rope is None else (self.next_pos + self.deltas).expand(3, -1, -1)
        out = self.model(
            input_ids=tokens.unsqueeze(-1), attention_mask=self.mask, position_ids=positions,
            use_cache=True, **self.cache_arg,
        )
        return out.logits[:, -1]


def _cache_kwarg(model: PreTrainedModel) -> str:
    """The forward argument that takes the KV cache: ``cache`` in newer transformers,
    ``past_key_values`` before. The cache object is updated in place either way. A LoRA
    wrapper forwards its keyword arguments to the model it wraps, whose signature counts."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def row_routes(routes: torch.Tensor, row: int, start: int, stop: int) -> torch.Tensor:
    """Columns ``start:stop`` of row ``row`` of a generation's routes ``[R, P + steps, L, k]``
    (a sample's prompt and completion), padded with -1 past the recorded steps: the last
    sampled token is never fed back, so it has no route."""
    taken = routes[row, start:stop]
    missing = stop - start - taken.shape[0]
    if missing:
        taken = torch.cat([taken, taken.new_full((missing, *taken.shape[1:]), NO_ROUTE)])
    return taken.clone()


def prompt_vision(prompts: Sequence[Prompt], copies: int = 1) -> VisionInputs | None:
    """The pixel inputs of the prompts' rows, each prompt's ``copies`` times (rows that
    run their prompt separately); None when no prompt has images."""
    if all(p.vision is None for p in prompts):
        return None
    return batch_vision_inputs([p.vision for p in prompts for _ in range(copies)])


def prompt_ids(prompt: Prompt) -> list[int]:
    if prompt.input_ids is None:
        raise ValueError(f"prompt {prompt.id!r} has no input_ids: load it through rltune.data")
    return prompt.input_ids


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """Text up to the first stop string (the stop string itself is kept out)."""
    cut = min((i for s in stop if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]
