"""LeanDecoder against the HF forward, the configs it must refuse, and HFGenerator with
the lean path on and off."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
)

from rltune.data.records import Prompt, SamplingParams
from rltune.models import replay
from rltune.models.dense_layout import has_hooks, supports_fastpath
from rltune.rollout.fastpath import LeanDecoder
from rltune.rollout.hf import HFGenerator, HFSteps

SMALL = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)
CONFIGS = {
    "qwen2": lambda **kw: Qwen2Config(**SMALL, **kw),  # q/k/v bias
    "llama": lambda **kw: LlamaConfig(**SMALL, **kw),
    "llama-bias": lambda **kw: LlamaConfig(**SMALL, attention_bias=True, **kw),
    "mistral": lambda **kw: MistralConfig(**SMALL, sliding_window=None, **kw),
}
STEPS = 6


def build(config: PretrainedConfig, *, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # biases start at 0: make them count
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
    return model


def padded_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 7 prompt tokens with 0, 3 and 6 positions of left padding."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 64, (3, 7), generator=gen)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :6] = 0
    return ids.masked_fill(mask == 0, 0), mask


def hf_last_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Last-position logits of a full forward (no cache) of the whole padded sequence."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]


# the products: plain F.linear, or one of the packed kernels (rltune.rollout.fastpath.KERNELS)
KERNELS = [None, pytest.param("onednn", marks=pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="oneDNN not built in")), "fewrows"]


def decoder_for(model: torch.nn.Module, kernel: str | None, require: Callable[[], None], **kw: Any) -> LeanDecoder:
    """A decoder on ``kernel``'s products (None: unpacked); ``require``: the
    ``require_fewrows`` fixture."""
    if kernel == "fewrows":
        require()
    return LeanDecoder(model, pack=kernel is not None, kernel=kernel, **kw)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k or "plain")
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_prefill_and_steps_equal_the_hf_forward(arch: str, kernel: str | None, require_fewrows) -> None:
    """The lean decoder's fused projections (q/k/v in one product, gate/up in one; packed
    for oneDNN or the fewrows kernel, or plain) against HF's separate ones. Tolerance 1e-5
    absolute: the same dot products of at most 48 float32 terms, summed in another order
    (by the kernel's blocking and layout): each differs by a few ulps of its terms'
    magnitude (~1e-7 here), and two layers and the head carry that to the O(1) logits
    as ~1e-6 (measured: 0 plain, <= 1e-6 packed); a misplaced column of a fused matrix
    moves them by ~0.1."""
    model = build(CONFIGS[arch]())
    assert supports_fastpath(model)
    ids, mask = padded_batch(seed=1)
    new = torch.randint(4, 64, (3, STEPS), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        decoder = decoder_for(model, kernel, require_fewrows, max_new_tokens=STEPS + 1)
        got = [decoder.prefill(ids, mask)] + [decoder.step(new[:, t]) for t in range(STEPS)]
        full_ids = torch.cat([ids, new], dim=1)
        full_mask = torch.cat([mask, torch.ones_like(new)], dim=1)
        want = [hf_last_logits(model, full_ids[:, :n], full_mask[:, :n]) for n in range(7, 8 + STEPS)]
    assert want[0].abs().max() > 0.1  # logits that carry signal, not all ~0
    for t, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0, msg=lambda m: f"position {t}: {m}")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_one_query_step_equals_the_general_step(arch: str) -> None:
    """On a CPU in float32 a step runs ``_one_query`` (batched products for the attention,
    the residuals as post-ops; on the default fewrows panels each layer as one native call,
    which the next tests compare with the batched-product step); elsewhere (a GPU, bf16, autocast) it runs the general
    ``_forward`` with SDPA. Both over the same padded rows and tokens, the general one
    forced by dropping the key mask the one-query step reads. Tolerance 1e-5 as in the HF
    comparison above: the same dot products in another order; a wrong key mask, rotary
    position or head grouping moves the logits by ~0.1."""
    model = build(CONFIGS[arch]())
    ids, mask = padded_batch(seed=5)
    new = torch.randint(4, 64, (3, STEPS), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        fast = LeanDecoder(model, max_new_tokens=STEPS + 1)
        general = LeanDecoder(model, max_new_tokens=STEPS + 1)
        fast.prefill(ids, mask, repeats=2)
        general.prefill(ids, mask, repeats=2)
        assert fast.key_bias is not None
        general.key_bias = None
        for t in range(STEPS):
            tokens = new[:, t].repeat_interleave(2)
            got, want = fast.step(tokens), general.step(tokens)
            assert want.abs().max() > 0.1
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m: f"step {t}: {m}")


def test_decoder_reads_the_live_parameters() -> None:
    """An in-place weight update (what the optimizer does) made after the decoder is built
    is seen: its prefill reads the parameters."""
    model = build(CONFIGS["qwen2"]())
    ids, mask = padded_batch(seed=3)
    with torch.inference_mode():
        decoder = LeanDecoder(model, max_new_tokens=1)
        model.model.layers[1].mlp.down_proj.weight.mul_(2.0)
        got = decoder.prefill(ids, mask)
        torch.testing.assert_close(got, hf_last_logits(model, ids, mask), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k or "plain")
def test_an_optimizer_step_between_generations_is_seen(kernel: str | None, require_fewrows) -> None:
    """The fused weights are rebuilt at every prefill: after a fused AdamW step (which does
    not bump the parameters' version counters) the next generation runs the new weights.
    Tolerance 1e-5 as in the HF comparison above."""
    model = build(CONFIGS["qwen2"]())
    ids, mask = padded_batch(seed=8)
    decoder = decoder_for(model, kernel, require_fewrows, max_new_tokens=1)
    with torch.inference_mode():
        before = decoder.prefill(ids, mask)
    model.train()
    logits = model(input_ids=ids, attention_mask=mask).logits
    logits[:, -1].logsumexp(-1).sum().backward()
    torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True).step()
    model.eval()
    with torch.inference_mode():
        after = decoder.prefill(ids, mask)
        torch.testing.assert_close(after, hf_last_logits(model, ids, mask), atol=1e-5, rtol=0)
    assert (after - before).abs().max() > 1e-2  # the step moved the logits


@pytest.mark.parametrize("bias", [True, False])
def test_fused_projections_equal_separate_ones(bias: bool) -> None:
    """q/k/v in one product, split by columns, as a GPU decodes (fused, unpacked), against
    one product each. Each output is the same dot product of 32 float32 terms; only the
    kernel's blocking may change their order: a few ulps of values ~1 (1e-6); a column
    taken from the wrong matrix is off by ~1."""
    from rltune.rollout.fastpath import _Projections

    gen = torch.Generator().manual_seed(9)
    pairs = [(torch.randn(n, 32, generator=gen) / 32**0.5, torch.randn(n, generator=gen) if bias else None)
             for n in (16, 8, 8)]
    x = torch.randn(8, 1, 32, generator=gen)
    fused = _Projections(pairs, fuse=True, kernel=None, rows=8)(x)
    separate = _Projections(pairs, fuse=False, kernel=None, rows=8)(x)
    assert [t.shape[-1] for t in fused] == [16, 8, 8]
    for f, s, (w, b) in zip(fused, separate, pairs):
        torch.testing.assert_close(f, s, atol=1e-6, rtol=0)
        torch.testing.assert_close(s, torch.nn.functional.linear(x, w, b), atol=1e-6, rtol=0)


def test_packing_is_refused_where_it_does_not_apply() -> None:
    model = build(CONFIGS["llama"]()).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"pack=True\) needs float32"):
        LeanDecoder(model, max_new_tokens=2, pack=True)


def test_step_past_the_size_is_an_error() -> None:
    model = build(CONFIGS["llama"]())
    ids, mask = padded_batch(seed=4)
    with torch.inference_mode():
        decoder = LeanDecoder(model, max_new_tokens=1)
        decoder.prefill(ids, mask)
        with pytest.raises(ValueError, match="sized for 1 new tokens"):
            decoder.step(ids[:, 0])


UNSUPPORTED: dict[str, Any] = {
    "rope-linear": lambda: LlamaConfig(**SMALL, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "rope-yarn": lambda: Qwen2Config(**SMALL, rope_scaling={"rope_type": "yarn", "factor": 2.0}),
    "qwen2-sliding": lambda: Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=16, max_window_layers=0),
    "mistral-sliding": lambda: MistralConfig(**SMALL, sliding_window=16),
    "gelu": lambda: LlamaConfig(**SMALL, hidden_act="gelu"),
    "mlp-bias": lambda: LlamaConfig(**SMALL, mlp_bias=True),
    "gpt2": lambda: GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_configs_are_refused(name: str) -> None:
    model = build(UNSUPPORTED[name]())
    assert not supports_fastpath(model)
    with pytest.raises(ValueError, match="not supported by LeanDecoder"):
        LeanDecoder(model, max_new_tokens=1)


def test_float16_and_replaced_projections_are_refused() -> None:
    assert not supports_fastpath(build(CONFIGS["llama"]()).to(torch.float16))
    model = build(CONFIGS["llama"]())
    # An adapter that wraps a projection (as LoRA does) must not be bypassed.
    model.model.layers[0].self_attn.q_proj = torch.nn.Sequential(model.model.layers[0].self_attn.q_proj)
    assert not supports_fastpath(model)


def test_hooks_are_detected() -> None:
    model = build(CONFIGS["qwen2"]())
    assert not has_hooks(model)
    handle = model.lm_head.register_forward_hook(lambda *_: None)
    assert has_hooks(model)
    handle.remove()
    assert not has_hooks(model)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[Prompt]:
    texts = ("What is 2+3?", "Hi", "A longer prompt, with several words in it.")
    return [Prompt(id=f"p{i}", text=t, input_ids=tokenizer.encode(t)) for i, t in enumerate(texts)]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_generator_fastpath_on_and_off_give_the_same_rollouts(
    tiny_model, tokenizer, prompts, temperature: float
) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=temperature, n=2)
    runs = {}
    for fastpath in (True, False):
        gen = HFGenerator(tiny_model, tokenizer, rng=torch.Generator().manual_seed(5), fastpath=fastpath)
        assert gen.fastpath is fastpath  # the builtin tiny model is supported
        runs[fastpath] = gen.generate(prompts, params)
    for lean, hf in zip(runs[True], runs[False]):
        assert lean.completion_ids.tolist() == hf.completion_ids.tolist()
        assert lean.finish_reason == hf.finish_reason
        torch.testing.assert_close(lean.completion_logprobs, hf.completion_logprobs, atol=1e-5, rtol=0)
    tokens = [r.completion_ids.tolist() for r in runs[True]]
    assert len({tuple(t) for t in tokens}) > 1  # rows differ: the comparison is not vacuous


@pytest.mark.parametrize("source", ["lean", "hf"])
def test_prefill_once_per_prompt_equals_a_prefill_per_row(source: str) -> None:
    """A group's prompt run once, its cache copied to the group's rows, gives the logits
    of running every row's prompt. Tolerance 1e-5: the same arithmetic on fewer rows; only
    the matmul's blocking over rows may change the float32 summation order (logits here
    are O(1), so a few ulps, ~1e-6), as for the lean-vs-HF comparison above."""
    model = build(CONFIGS["qwen2"]())
    ids, mask = padded_batch(seed=6)
    repeats = 3
    new = torch.randint(4, 64, (3 * repeats, STEPS), generator=torch.Generator().manual_seed(7))
    make = (lambda: LeanDecoder(model, max_new_tokens=STEPS + 1)) if source == "lean" else (
        lambda: HFSteps(model, max_new_tokens=STEPS + 1))
    with torch.inference_mode():
        shared, per_row = make(), make()
        got = [shared.prefill(ids, mask, repeats=repeats)] + [shared.step(new[:, t]) for t in range(STEPS)]
        want = [per_row.prefill(ids.repeat_interleave(repeats, 0), mask.repeat_interleave(repeats, 0))]
        want += [per_row.step(new[:, t]) for t in range(STEPS)]
    assert got[0].shape == (3 * repeats, 64)
    assert not torch.equal(got[-1][0], got[-1][1])  # rows of a group diverge after the prompt
    for t, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0, msg=lambda m: f"position {t}: {m}")


# shapes where the native layer's vector loops have tails: head_dim 40 (two 16-float
# steps of a dot product, then 8 floats), 5 q heads over 1 kv head, intermediate 52
# (silu's exp over 6 full 8-lane vectors, then 4 lanes)
ODD = dict(vocab_size=64, hidden_size=200, intermediate_size=52, num_hidden_layers=2, num_attention_heads=5,
           num_key_value_heads=1, head_dim=40, max_position_embeddings=64)


@pytest.mark.parametrize("gate_scale", [1.0, 400.0], ids=["plain", "huge-gates"])
@pytest.mark.parametrize("arch", ["qwen2", "llama-bias", "odd"])
def test_the_native_layer_step_equals_the_aten_one_query_step(arch: str, gate_scale: float,
                                                            require_fewrows) -> None:
    """On fewrows-packed weights the one-query step runs each layer as one native call
    (``fewrows_decode_layer``); the same step as ATen ops (``native`` off) over the same
    padded rows. Its norms, dot products, softmax and silu sum the same float32 terms in
    another order and take exp from a polynomial within 1 ulp of the exact exp, so logits
    differ by a few ulps carried through two layers (~1e-6 at these O(1) logits; measured <= 4.6e-7,
    the kept outputs <= 7.3e-7 of their largest entry), bounded at 1e-5 absolute as in
    the HF comparison; a wrong rotary sign, key slot, head
    grouping or bias moves them by ~0.1. ``huge-gates`` scales the gate weights so that
    |gate| passes 88, where exp is clamped (silu is then 0 or the gate itself, as in ATen).
    The kept outputs for the learner (q/k/v, after attention, gate/up, after the MLP) are
    compared too, at the same bound."""
    require_fewrows()
    model = build(LlamaConfig(**ODD, attention_bias=True) if arch == "odd" else CONFIGS[arch]())
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate_proj.weight.mul_(gate_scale)
    ids, mask = padded_batch(seed=7)
    new = torch.randint(4, 64, (3, STEPS), generator=torch.Generator().manual_seed(8))
    replay.keep_records(model, 1 << 30)  # the decoders keep their outputs in real records
    decoders, kept = [], []
    with torch.inference_mode():
        for native in (True, False):
            decoder = LeanDecoder(model, max_new_tokens=STEPS + 1, kernel="fewrows", keep_forward=True)
            decoder.prefill(ids, mask, repeats=2)
            assert decoder.native and decoder.record is not None
            decoder.native = native
            decoders.append([decoder.step(new[:, t].repeat_interleave(2)) for t in range(STEPS)])
            assert decoder.record.fed == STEPS
            kept.append([[out[:, :STEPS] for out in layer.steps] for layer in decoder.record.layers])
    assert decoders[1][0].abs().max() > 0.1
    gates = max(layer[2].abs().max().item() for layer in kept[1])
    assert gates > 88 if gate_scale > 1 else gates < 20  # past the clamp, or well inside it
    for t, (got, want) in enumerate(zip(*decoders)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m: f"step {t}: {m}")
    for index, (got_layer, want_layer) in enumerate(zip(*kept)):
        for g, w in zip(got_layer, want_layer):
            scale = max(w.abs().max().item(), 1.0)
            torch.testing.assert_close(g, w, atol=1e-5 * scale, rtol=0, msg=lambda m: f"layer {index}: {m}")


def test_the_native_layer_step_runs_only_on_fewrows_panels(require_fewrows) -> None:
    """The native call serves fewrows-packed weights; oneDNN's packing and plain weights
    keep the ATen step."""
    require_fewrows()
    model = build(CONFIGS["qwen2"]())
    ids, mask = padded_batch(seed=1)
    with torch.inference_mode():
        for kernel, pack, native in (("fewrows", None, True), (None, False, False)):
            decoder = LeanDecoder(model, max_new_tokens=3, kernel=kernel, pack=pack)
            decoder.prefill(ids, mask)
            assert decoder.native is native
        if torch.backends.mkldnn.is_available():
            decoder = LeanDecoder(model, max_new_tokens=3, kernel="onednn")
            decoder.prefill(ids, mask)
            assert decoder.native is False


def test_the_native_layer_step_names_bad_inputs(require_fewrows) -> None:
    """Caches, slot, tables or weights that do not fit (norm weights of another width,
    an empty head dimension, a gate/up weight that is not twice the down weight's inputs)
    are refused with the operator's name, before any loop reads them."""
    require_fewrows()
    from rltune.rollout import fewrows

    model = build(CONFIGS["qwen2"]())
    ids, mask = padded_batch(seed=1)
    with torch.inference_mode():
        decoder = LeanDecoder(model, max_new_tokens=3, kernel="fewrows")
        decoder.prefill(ids, mask)
        layer, fused = decoder.layers[0], decoder.fused[0]
        h = torch.zeros(3, 32)
        cos, sin = decoder.cos[:, 0, 7], decoder.sin[:, 0, 7]

        def call(**over: Any) -> None:
            args = dict(h=h, norm1=layer.norm1, eps1=layer.eps1, qkv=fused.qkv.linears[0].weight,
                        qkv_bias=fused.qkv.linears[0].bias, keys=decoder.keys[0], values=decoder.values[0],
                        key_bias=decoder.key_bias, cos=cos, sin=sin, t=7, scale=decoder.scale, o=fused.o.weight,
                        o_bias=fused.o.bias, norm2=layer.norm2, eps2=layer.eps2,
                        gate_up=fused.gate_up.linears[0].weight, down=fused.down.weight)
            fewrows.decode_layer(**{**args, **over})

        call()  # fits
        for over in (dict(t=9), dict(h=torch.zeros(4, 32)), dict(cos=cos[:2]), dict(keys=decoder.keys[0][:, :1]),
                     dict(qkv=fused.o.weight), dict(norm1=layer.norm1[:4]), dict(norm2=torch.ones(40)),
                     dict(keys=decoder.keys[0][..., :0], values=decoder.values[0][..., :0]),
                     dict(gate_up=fused.down.weight)):
            with pytest.raises(RuntimeError, match="fewrows"):
                call(**over)
