"""The generator on a vision-language model (builtin:tiny-vl, a tiny Qwen2-VL): the vision
tower runs once per prompt, and the sampled tokens' log-probs are those the learner
computes and those of transformers' own forward (its own M-RoPE positions) on each
unpadded sample."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from rltune.data.collate import collate_rollouts
from rltune.data.records import Prompt, SamplingParams
from rltune.learner.objectives import batch_vision, logprob_forward
from rltune.models.dense_layout import supports_fastpath
from rltune.models.load import load_model, load_processor, resolve_model
from rltune.models.logprobs import completion_logprobs
from rltune.models.vision import image_token_ids
from rltune.models.vl_inputs import SUPPRESSED, token_types
from rltune.envs.base import StepResult
from rltune.envs.episodes import EpisodeGenerator
from rltune.envs.tool_format import turn_glue
from rltune.rollout.hf import HFGenerator, eos_ids


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory: pytest.TempPathFactory):
    path = resolve_model("builtin:tiny-vl", cache_dir=str(tmp_path_factory.mktemp("builtin_vl")))
    return load_model(path).eval(), load_processor(path)


def vl_prompt(processor, name: str, size: tuple[int, int], colour: tuple[int, int, int], text: str) -> Prompt:
    """A prompt of one image as the data loader renders it: the processor's ids (image
    placeholders expanded) and its pixel inputs."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = processor(text=[rendered], images=[Image.new("RGB", size, colour)], return_tensors="pt")
    vision = {k: v for k, v in out.items() if k in ("pixel_values", "image_grid_thw")}
    return Prompt(id=name, messages=messages, input_ids=out["input_ids"][0].tolist(), vision=vision)


@pytest.fixture(scope="module")
def two_prompts(tiny_vl) -> list[Prompt]:
    _, processor = tiny_vl
    # different image sizes (16 and 24 image tokens) and prompt lengths: row 0 is left-padded
    return [vl_prompt(processor, "a", (112, 112), (200, 30, 90), "how many red?"),
            vl_prompt(processor, "b", (168, 112), (20, 130, 190), "which colour is the largest one?")]


@torch.no_grad()
def own_forward_logprobs(model, prompt: Prompt, completion: torch.Tensor) -> torch.Tensor:
    """Log-probs of ``completion`` after ``prompt`` from transformers' own forward on the
    unpadded sequence (positions from its own rope index and the processor-style token
    types), placeholders suppressed as the policy does."""
    ids = torch.tensor([prompt.input_ids + completion.tolist()])
    logits = model(input_ids=ids, mm_token_type_ids=token_types(model.model, ids), **prompt.vision).logits
    logits = logits[0, len(prompt.input_ids) - 1 : -1].float()
    logits[:, image_token_ids(model)] = SUPPRESSED
    return torch.log_softmax(logits, -1).gather(-1, completion[:, None]).squeeze(-1)


def test_vision_tower_once_per_prompt_and_logprobs_match(tiny_vl, two_prompts) -> None:
    model, processor = tiny_vl
    assert not supports_fastpath(model)
    generator = HFGenerator(model, processor.tokenizer, rng=torch.Generator().manual_seed(3))
    calls: list[torch.Size] = []
    hook = model.model.visual.register_forward_hook(lambda m, args, out: calls.append(args[0].shape))
    try:
        rollouts = generator.generate(two_prompts, SamplingParams(n=3, max_new_tokens=8), group_offset=4)
    finally:
        hook.remove()
    patches = sum(p.vision["pixel_values"].shape[0] for p in two_prompts)
    assert calls == [torch.Size([patches, 1176])]  # one prefill, each prompt's image once
    assert [r.group for r in rollouts] == [4, 4, 4, 5, 5, 5]
    for r in rollouts:
        prompt = two_prompts[r.group - 4]
        assert r.vision is prompt.vision and r.images is prompt.images
        expected = own_forward_logprobs(model, prompt, r.completion_ids)
        torch.testing.assert_close(r.completion_logprobs, expected, atol=1e-5, rtol=0)

    batch = collate_rollouts(rollouts, processor.tokenizer.pad_token_id)
    assert int(batch.attention_mask[:, : batch.prompt_len].eq(0).sum()) > 0  # left padding present
    engine = batch.behaviour_logprobs
    with torch.no_grad():  # the learner's forward (chunked head), the model's logits, small chunks
        learner = [logprob_forward(model, batch, temperature=1.0, router_logits=False).logprobs] + [
            completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_len,
                                vision=batch_vision(batch), chunk_tokens=chunk).logprobs
            for chunk in (0, 5)
        ]
    for logprobs in learner:
        torch.testing.assert_close(logprobs, engine, atol=1e-5, rtol=0)
    # micro-batches keep their rows' pixel inputs
    half = batch.select(torch.tensor([5, 0]))
    with torch.no_grad():
        part = logprob_forward(model, half, temperature=1.0, router_logits=False).logprobs
    torch.testing.assert_close(part, engine[[5, 0]], atol=1e-5, rtol=0)


def test_image_tokens_are_prompt_tokens_never_trained(tiny_vl, two_prompts) -> None:
    model, processor = tiny_vl
    generator = HFGenerator(model, processor.tokenizer, rng=torch.Generator().manual_seed(0))
    rollouts = generator.generate(two_prompts, SamplingParams(n=2, max_new_tokens=6))
    batch = collate_rollouts(rollouts, processor.tokenizer.pad_token_id)
    image = batch.input_ids == model.config.image_token_id
    assert int(image[:, : batch.prompt_len].sum()) == 2 * (16 + 24)
    assert not bool(image[:, batch.prompt_len :].any())
    # the loss mask is over the completion columns only, where no placeholder is
    assert batch.loss_mask.shape[1] == batch.input_ids.shape[1] - batch.prompt_len


def test_placeholders_are_never_sampled(tiny_vl, two_prompts) -> None:
    """Even where the model puts nearly all its mass on the image placeholder."""
    model, processor = tiny_vl
    bias = torch.zeros(model.config.text_config.vocab_size)
    bias[model.config.image_token_id] = 50.0
    hook = model.lm_head.register_forward_hook(lambda m, args, out: out + bias)
    try:
        generator = HFGenerator(model, processor.tokenizer, rng=torch.Generator().manual_seed(0))
        rollouts = generator.generate(two_prompts[:1], SamplingParams(n=4, max_new_tokens=6))
    finally:
        hook.remove()
    ids = torch.cat([r.completion_ids for r in rollouts])
    assert not bool((ids == model.config.image_token_id).any())
    assert all(bool(torch.isfinite(r.completion_logprobs).all()) for r in rollouts)


def test_a_batch_of_text_and_image_prompts(tiny_vl, two_prompts) -> None:
    """A text prompt beside an image prompt: the text row gets ordinary positions, the
    image row its M-RoPE ones; both sides agree with the own forward."""
    model, processor = tiny_vl
    messages = [{"role": "user", "content": "How many red shapes are there?"}]
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    text = Prompt(id="t", messages=messages, input_ids=processor.tokenizer.encode(rendered, add_special_tokens=False))
    prompts = [text, two_prompts[1]]
    generator = HFGenerator(model, processor.tokenizer, rng=torch.Generator().manual_seed(5))
    rollouts = generator.generate(prompts, SamplingParams(n=2, max_new_tokens=6))
    assert [r.vision is None for r in rollouts] == [True, True, False, False]
    batch = collate_rollouts(rollouts, processor.tokenizer.pad_token_id)
    with torch.no_grad():
        learner = logprob_forward(model, batch, temperature=1.0, router_logits=False).logprobs
    torch.testing.assert_close(learner, batch.behaviour_logprobs, atol=1e-5, rtol=0)
    for r in rollouts[2:]:
        torch.testing.assert_close(r.completion_logprobs, own_forward_logprobs(model, prompts[1], r.completion_ids),
                                   atol=1e-5, rtol=0)


class _Echo:
    """An environment that answers every turn with one observation, for two turns."""

    def reset(self, prompt: Prompt) -> None:
        return None

    def step(self, action: str) -> StepResult:
        return StepResult(observation="look again")


def test_multi_turn_episodes_keep_the_prompts_images(tiny_vl, two_prompts) -> None:
    """Every turn of an episode sees the prompt's images; the learner scores the model's
    turns of the finished episode (pixel inputs of its prompt) as they were sampled."""
    model, processor = tiny_vl
    tok = processor.tokenizer
    generator = HFGenerator(model, tok, rng=torch.Generator().manual_seed(7))
    runner = EpisodeGenerator(generator, tok, _Echo, glue=turn_glue(tok), encode=None, max_turns=2,
                              max_total_tokens=200, eos_ids=eos_ids(model, tok))
    rollouts = runner.generate(two_prompts, SamplingParams(n=2, max_new_tokens=4))
    assert all(r.vision is two_prompts[r.group].vision for r in rollouts)
    assert all(0 < float(r.loss_mask.sum()) < len(r.loss_mask) for r in rollouts)  # a tool turn between two
    batch = collate_rollouts(rollouts, tok.pad_token_id)
    with torch.no_grad():
        learner = logprob_forward(model, batch, temperature=1.0, router_logits=False).logprobs
    torch.testing.assert_close(learner * batch.loss_mask, batch.behaviour_logprobs * batch.loss_mask, atol=1e-5, rtol=0)
