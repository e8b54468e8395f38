"""The Generator contract, checked against every generator rltune has: the in-process HF
generator (with and without its decoding fast path), the Ray generator actors, and the
vLLM generator (skipped, with the reason, where vLLM is not installed; ``make test-vllm``
runs it on vLLM's CPU build).

For each: ``n`` samples per prompt, adjacent, in prompt order, numbered from
``group_offset``; completions within ``max_new_tokens`` with a finish reason that says why
they ended; the reported log-probs are the model's own (recomputed here by teacher forcing,
at the sampling temperature); greedy decoding repeats itself; stop strings cut the text;
``load_weights`` changes what is sampled and the version every rollout carries.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rltune.data.records import Prompt, SamplingParams
from rltune.models.load import load_model, load_tokenizer
from rltune.rollout.hf import HFGenerator, eos_ids

KINDS = ("hf", "hf-no-fastpath", "ray", "vllm")


@pytest.fixture(scope="module")
def reference(model_dir: str) -> torch.nn.Module:
    """The initial weights, in this process, for teacher forcing."""
    return load_model(model_dir).eval()


@pytest.fixture(scope="module", params=KINDS)
def generator(request: pytest.FixtureRequest, model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    kind = request.param
    if kind == "vllm":
        from rltune.rollout.vllm import VLLMGenerator, vllm_missing

        if (missing := vllm_missing()) is not None:
            pytest.skip(missing)
        yield VLLMGenerator(model_dir, load_tokenizer(model_dir), rng=torch.Generator().manual_seed(0),
                            engine_args={"max_model_len": 256, "kv_cache_memory_bytes": 2**28})
        return
    if kind != "ray":
        yield HFGenerator(load_model(model_dir).eval(), load_tokenizer(model_dir),
                          rng=torch.Generator().manual_seed(0), fastpath=kind == "hf")
        return
    request.getfixturevalue("ray_cluster")
    from rltune.config import load_config
    from rltune.config.schema import PlacementConfig
    from rltune.runtime.ray.cluster import place
    from rltune.runtime.ray.rollouts import RayGenerator

    root = tmp_path_factory.mktemp("contract")
    (root / "r.py").write_text("def r(prompt, completion, **meta):\n    return 0.0\n")
    cfg = load_config(None, [f"model.path={model_dir}", "data.train=builtin:arith_small/train",
                             f"reward.0.fn={root / 'r.py'}:r", "runtime.mode=ray"])
    placement = place(PlacementConfig(generators=2), name="test-contract")
    gen = RayGenerator(cfg, model_dir, None, placement, None)
    yield gen
    gen.close()
    placement.remove()


def prompts(model_dir: str, texts: list[str]) -> list[Prompt]:
    tok = load_tokenizer(model_dir)
    return [Prompt(id=f"q{i}", text=t, input_ids=tok(t)["input_ids"]) for i, t in enumerate(texts)]


TEXTS = ["12+34=", "7+8=", "40+2=", "1+1="]


def test_samples_come_per_prompt_in_order(generator, model_dir, reference) -> None:
    eos = set(eos_ids(reference, load_tokenizer(model_dir)))
    out = generator.generate(prompts(model_dir, TEXTS), SamplingParams(n=3, max_new_tokens=5, temperature=1.0),
                             group_offset=7)
    assert [r.prompt_id for r in out] == [f"q{i}" for i in range(4) for _ in range(3)]
    assert [r.group for r in out] == [7 + i for i in range(4) for _ in range(3)]
    for r in out:
        length = len(r.completion_ids)
        assert 1 <= length <= 5
        assert r.completion_logprobs.shape == r.loss_mask.shape == (length,)
        assert torch.equal(r.loss_mask, torch.ones(length))
        # no stop strings: a completion stops at an EOS token or at the length limit
        assert r.finish_reason in ("stop", "length")
        if r.finish_reason == "stop":
            assert int(r.completion_ids[-1]) in eos
        else:
            assert length == 5 and not eos & set(r.completion_ids.tolist())


def test_logprobs_are_the_models_at_the_sampling_temperature(generator, model_dir, reference) -> None:
    generator.load_weights(0, reference.state_dict())
    for temperature in (1.0, 0.7):
        out = generator.generate(prompts(model_dir, TEXTS[:2]),
                                 SamplingParams(n=2, max_new_tokens=6, temperature=temperature))
        for r in out:
            ids = torch.cat([r.prompt_ids, r.completion_ids]).unsqueeze(0)
            with torch.no_grad():
                logits = reference(ids).logits[0, len(r.prompt_ids) - 1 : -1].float() / temperature
            expected = torch.log_softmax(logits, -1).gather(-1, r.completion_ids.unsqueeze(-1)).squeeze(-1)
            torch.testing.assert_close(r.completion_logprobs, expected, rtol=0, atol=1e-4)


def test_greedy_decoding_repeats_itself(generator, model_dir) -> None:
    params = SamplingParams(n=2, max_new_tokens=6, temperature=0.0)
    first = generator.generate(prompts(model_dir, TEXTS), params)
    second = generator.generate(prompts(model_dir, TEXTS), params)
    assert [r.completion_ids.tolist() for r in first] == [r.completion_ids.tolist() for r in second]
    assert first[0].completion_ids.tolist() == first[1].completion_ids.tolist()


def test_a_stop_string_cuts_the_text(generator, model_dir) -> None:
    """A two-character stop string taken from inside a greedy completion, at a place where
    it first occurs (not at the start, so something is kept), cuts the completion there.
    The prompts' greedy completions are 8 tokens of the tiny model (``=====TTT`` ...); none
    with such a place is a failure, not a skip."""
    greedy = SamplingParams(n=1, max_new_tokens=8, temperature=0.0)
    frees = [r.text for r in generator.generate(prompts(model_dir, TEXTS), greedy)]
    cuts = [(i, k) for i, text in enumerate(frees) if "\ufffd" not in text
            for k in range(1, len(text) - 1) if text.find(text[k:k + 2]) == k]
    assert cuts, f"no greedy completion has a stop string to cut at: {frees!r}"
    i, k = cuts[0]
    cut = generator.generate(prompts(model_dir, [TEXTS[i]]),
                             dataclasses.replace(greedy, stop=(frees[i][k:k + 2],)))[0]
    assert cut.text == frees[i][:k], (frees[i], k, cut.text)


def test_loaded_weights_are_the_ones_sampled_from(generator, model_dir, reference) -> None:
    vocab = reference.config.vocab_size
    # a zero output layer (and input embedding: the tiny model ties them, and an engine may
    # load only one of a tied pair)
    zero = ("lm_head.weight", "embed_tokens.weight")
    flat = {k: torch.zeros_like(v) if k.endswith(zero) else v for k, v in reference.state_dict().items()}
    generator.load_weights(3, flat)
    try:
        out = generator.generate(prompts(model_dir, TEXTS[:2]), SamplingParams(n=2, max_new_tokens=4, temperature=1.0))
        assert {r.policy_version for r in out} == {3}
        for r in out:  # a zero output layer: every token has probability 1/V
            torch.testing.assert_close(r.completion_logprobs, torch.full_like(r.completion_logprobs, -torch.log(torch.tensor(float(vocab)))))
    finally:
        generator.load_weights(0, reference.state_dict())


def test_an_engine_with_its_own_layout_refuses_a_partial_update(generator, model_dir, reference) -> None:
    if not hasattr(generator, "required_names"):
        pytest.skip("this generator takes any subset of the weights (it copies them by name)")
    partial = {k: v for k, v in reference.state_dict().items() if ".layers.0." not in k}
    with pytest.raises(ValueError, match=r"takes the whole model; \d+ weight\(s\) missing, e.g. \['model.layers.0."):
        generator.load_weights(5, partial)
    assert generator.version != 5
    out = generator.generate(prompts(model_dir, TEXTS[:1]), SamplingParams(n=1, max_new_tokens=4, temperature=0.0))
    assert len(out) == 1  # the engine still samples
