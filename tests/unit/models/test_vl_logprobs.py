"""Log-probs of vision-language batches outside GRPO's generator: LLaVA (ordinary
positions) through the generator and the learner, DPO's frozen-reference log-probs of
pairs with images, and the critic body's hidden states, each against transformers' own
forward on the unpadded sequence."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from PIL import Image

from rltune.data.collate import collate_rollouts, left_pad
from rltune.data.records import Prompt, PromptImage, SamplingParams
from rltune.learner.objectives import logprob_forward
from rltune.learner.pair_scoring import pairs_fingerprint, reference_seq_logps
from rltune.models.load import load_model, load_processor, resolve_model
from rltune.models.logprobs import body_hidden_states
from rltune.models.vision import batch_vision_inputs, image_token_ids
from rltune.models.vl_inputs import SUPPRESSED, token_types
from rltune.rollout.hf import HFGenerator


def _load(name: str, tmp_path_factory: pytest.TempPathFactory):
    path = resolve_model(f"builtin:{name}", cache_dir=str(tmp_path_factory.mktemp(name)))
    return load_model(path).eval(), load_processor(path)


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory: pytest.TempPathFactory):
    return _load("tiny-llava", tmp_path_factory)


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory: pytest.TempPathFactory):
    return _load("tiny-vl", tmp_path_factory)


def _prompt(processor, name: str, size: tuple[int, int], colour: tuple[int, int, int], text: str, **meta) -> Prompt:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = processor(text=[rendered], images=[Image.new("RGB", size, colour)], return_tensors="pt")
    vision = {k: v for k, v in out.items() if k in ("pixel_values", "image_grid_thw")}
    return Prompt(id=name, messages=messages, input_ids=out["input_ids"][0].tolist(), vision=vision, meta=meta)


@torch.no_grad()
def _own_logprobs(model, prompt: Prompt, completion: list[int]) -> torch.Tensor:
    """transformers' own forward on the unpadded prompt + completion (its own positions),
    placeholders suppressed as the policy does."""
    ids = torch.tensor([prompt.input_ids + completion])
    extra = {"mm_token_type_ids": token_types(model.model, ids)} if "image_grid_thw" in prompt.vision else {}
    logits = model(input_ids=ids, **extra, **prompt.vision).logits[0, len(prompt.input_ids) - 1 : -1].float()
    logits[:, image_token_ids(model)] = SUPPRESSED
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def test_llava_generator_learner_and_own_forward_agree(tiny_llava) -> None:
    model, processor = tiny_llava
    prompts = [_prompt(processor, "a", (80, 56), (200, 30, 90), "how many?"),
               _prompt(processor, "b", (56, 90), (20, 130, 190), "which colour is largest?")]
    assert prompts[0].vision["pixel_values"].shape == (1, 3, 56, 56)
    calls = []
    hook = model.model.vision_tower.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    try:
        generator = HFGenerator(model, processor.tokenizer, rng=torch.Generator().manual_seed(2))
        rollouts = generator.generate(prompts, SamplingParams(n=3, max_new_tokens=6))
    finally:
        hook.remove()
    assert calls == [2]  # one image per prompt, not per sample
    for r in rollouts:
        expected = _own_logprobs(model, prompts[r.group], r.completion_ids.tolist())
        torch.testing.assert_close(r.completion_logprobs, expected, atol=1e-5, rtol=0)
    batch = collate_rollouts(rollouts, processor.tokenizer.pad_token_id)
    with torch.no_grad():
        learner = logprob_forward(model, batch, temperature=1.0, router_logits=False).logprobs
    torch.testing.assert_close(learner, batch.behaviour_logprobs, atol=1e-5, rtol=0)


def test_dpo_reference_logprobs_of_pairs_with_images(tiny_vl) -> None:
    model, processor = tiny_vl
    tok = processor.tokenizer
    pairs = [
        _prompt(processor, "a", (112, 112), (200, 30, 90), "how many red?",
                chosen_ids=tok.encode("2") + [tok.eos_token_id], rejected_ids=tok.encode("three") + [tok.eos_token_id]),
        _prompt(processor, "b", (168, 112), (20, 130, 190), "largest?",
                chosen_ids=tok.encode("blue") + [tok.eos_token_id], rejected_ids=tok.encode("red") + [tok.eos_token_id]),
    ]
    got = reference_seq_logps(model, pairs, tok.pad_token_id, budget=4096)
    expected = torch.tensor([[float(_own_logprobs(model, p, p.meta[k]).sum()) for k in ("chosen_ids", "rejected_ids")]
                             for p in pairs])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_pairs_fingerprint_covers_the_images() -> None:
    def pair(digest: str | None) -> Prompt:
        images = None if digest is None else [PromptImage(source="x.png", digest=digest, data=b"")]
        return Prompt(id="p", text="q", input_ids=[1], images=images, meta={"chosen_ids": [2], "rejected_ids": [3]})

    assert pairs_fingerprint([pair("aa")]) != pairs_fingerprint([pair("bb")])
    assert pairs_fingerprint([pair("aa")]) != pairs_fingerprint([pair(None)])
    # a text pair's fingerprint is what it was before images existed (caches stay valid)
    before = hashlib.sha256(json.dumps(["p", [1], [2], [3]]).encode() + b"\n").hexdigest()
    assert pairs_fingerprint([pair(None)]) == before


@torch.no_grad()
def test_critic_body_hidden_states_take_the_pixel_inputs(tiny_vl) -> None:
    """PPO's critic on a vision-language model: its body's hidden states of a left-padded
    batch are those of the body's own forward on each unpadded row."""
    model, processor = tiny_vl
    prompts = [_prompt(processor, "a", (112, 112), (200, 30, 90), "how many red?"),
               _prompt(processor, "b", (168, 112), (20, 130, 190), "which colour is the largest one?")]
    ids, mask = left_pad([torch.tensor(p.input_ids) for p in prompts], processor.tokenizer.pad_token_id)
    vision = batch_vision_inputs([p.vision for p in prompts])
    hidden = body_hidden_states(model.model, ids, mask, vision)
    for row, p in enumerate(prompts):
        own = torch.tensor([p.input_ids])
        expected = model.model(input_ids=own, mm_token_type_ids=token_types(model.model, own), **p.vision).last_hidden_state
        torch.testing.assert_close(hidden[row, -len(p.input_ids):], expected[0], atol=1e-5, rtol=0)
