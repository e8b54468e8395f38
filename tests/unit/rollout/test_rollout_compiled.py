"""rollout.compile: the compiled static-cache step against the eager lean step, one graph
for batches of the same rows and bucket, and the cases it refuses."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, Qwen2MoeConfig

from rltune.config import load_config
from rltune.data.records import Prompt, SamplingParams
from rltune.rollout import compiled as compiled_module
from rltune.rollout.compiled import BUCKET, CompiledStep
from rltune.rollout.fastpath import LeanDecoder
from rltune.rollout.hf import HFGenerator

STEPS = 12
# Tolerance on logits and log-probs: the compiled step does the eager step's float32
# arithmetic; inductor may only reorder reductions (the RMSNorm mean over 128 features,
# the softmax over the cache slots, whose masked slots add exact zeros). Logits of the
# tiny model are O(1), so reordering moves them by a few ulps (~1e-6); 1e-5 leaves room
# for that and catches any wrong slot, mask or rotary phase (those move logits by ~0.1).
ATOL = 1e-5


def _prompts(tokenizer, texts: list[str]) -> list[Prompt]:
    return [Prompt(id=str(i), text=t, input_ids=tokenizer(t)["input_ids"]) for i, t in enumerate(texts)]


@pytest.fixture
def uncompiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The static-cache step run eagerly: its arithmetic tested without a compile."""
    monkeypatch.setattr(compiled_module, "compiled_step_fn", lambda mode: compiled_module.static_step)
    monkeypatch.setattr(compiled_module, "compiled_packed_fn", lambda: compiled_module.packed_step)


@pytest.mark.parametrize("kernel", ["fewrows", "onednn", None], ids=lambda k: k or "plain")
def test_static_cache_step_equals_the_eager_step(tiny_model, tokenizer, uncompiled: None, kernel: str | None,
                                                 require_fewrows) -> None:
    """Slots, key mask, rotary phases and the shared-prompt copy of the static cache give
    the eager lean step's logits, over two batches of different prompt widths that
    reuse the same buffers: the CPU float32 step on weights packed for either kernel
    (``packed_step``, against the eager one-query step) and the general one
    (``static_step``)."""
    if kernel == "fewrows":
        require_fewrows()
    pack = kernel is not None
    ids = torch.tensor([tokenizer("What is 3 + 4?")["input_ids"]] * 2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    new = torch.randint(4, 200, (4, STEPS), generator=torch.Generator().manual_seed(0))
    static = CompiledStep()
    for width in (ids.shape[1], ids.shape[1] - 3):
        cols = slice(ids.shape[1] - width, None)
        with torch.inference_mode():
            eager, fast = (LeanDecoder(tiny_model, max_new_tokens=STEPS + 1, compiled=c, pack=pack, kernel=kernel)
                           for c in (None, static))
            want = [eager.prefill(ids[:, cols], mask[:, cols], repeats=2)] + [eager.step(new[:, t]) for t in range(STEPS)]
            got = [fast.prefill(ids[:, cols], mask[:, cols], repeats=2)] + [fast.step(new[:, t]) for t in range(STEPS)]
        assert want[1].abs().max() > 0.1
        for t, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=0, msg=lambda m: f"width {width} step {t}: {m}")
    assert static.caches[0][0].shape[2] == BUCKET  # both widths in one bucket: one set of buffers
    assert static.tables[0].dtype == (torch.float32 if pack else torch.bool)  # the path taken


def _compare_generators(tiny_model, tokenizer) -> list:
    """Rollouts of an eager and a ``compile=True`` generator from the same seed, over two
    batches of the same rows and other prompt widths; returns the compiled rollouts."""
    params = SamplingParams(n=2, max_new_tokens=STEPS, temperature=1.0)
    batches = [_prompts(tokenizer, ["Compute 12 + 30 =", "7 * 6 ="]), _prompts(tokenizer, ["1 + 1 =", "What is 9 - 4?"])]
    runs = {}
    for compile in (False, True):
        gen = HFGenerator(tiny_model, tokenizer, rng=torch.Generator().manual_seed(3), compile=compile)
        runs[compile] = [r for batch in batches for r in gen.generate(batch, params)]
    for eager, compiled in zip(runs[False], runs[True]):
        assert compiled.completion_ids.tolist() == eager.completion_ids.tolist()
        torch.testing.assert_close(compiled.completion_logprobs, eager.completion_logprobs, atol=ATOL, rtol=0)
    assert len({tuple(r.completion_ids.tolist()) for r in runs[True]}) > 1
    return runs[True]


def test_static_cache_generator_gives_the_eager_rollouts(tiny_model, tokenizer, uncompiled: None) -> None:
    _compare_generators(tiny_model, tokenizer)


@pytest.mark.slow
def test_compiled_generator_gives_the_eager_rollouts_with_one_graph(tiny_model, tokenizer) -> None:
    """torch.compile itself: the same rollouts, and the second batch (same rows, other
    prompt widths in the same bucket) reuses the first batch's graph."""
    before = counters["stats"]["unique_graphs"]
    _compare_generators(tiny_model, tokenizer)
    assert counters["stats"]["unique_graphs"] - before <= 1  # 0 when an earlier test compiled this shape


def test_compile_is_refused_where_the_lean_step_cannot_run(tiny_model, tokenizer) -> None:
    moe = AutoModelForCausalLM.from_config(Qwen2MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, eos_token_id=tokenizer.eos_token_id,
    ))
    with pytest.raises(ValueError, match="rollout.compile compiles the lean decoder's step.*Qwen2Moe"):
        HFGenerator(moe, tokenizer, compile=True)
    with pytest.raises(ValueError, match="fastpath=False"):
        HFGenerator(tiny_model, tokenizer, fastpath=False, compile=True)
    gen = HFGenerator(tiny_model, tokenizer, compile=True)
    handle = tiny_model.model.layers[0].register_forward_hook(lambda *a: None)
    try:
        with pytest.raises(RuntimeError, match="forward hooks"):
            gen.generate(_prompts(tokenizer, ["1 + 1 ="]), SamplingParams(n=1, max_new_tokens=2))
    finally:
        handle.remove()


def test_compile_with_vllm_is_refused_at_config_time() -> None:
    with pytest.raises(ValueError, match="rollout.compile.*rollout.engine=vllm"):
        load_config(None, ["name=x", "model.path=builtin:tiny", "rollout.engine=vllm", "rollout.compile=true"])


def test_the_packed_add_shape_function_matches_the_kernel() -> None:
    """The shape function given to oneDNN's ``binary`` packed product (which torch lacks)
    says what the kernel returns: a new contiguous tensor of the input's dtype, shaped by
    the input's rows and the weight's outputs, whatever the added tensor's strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w = torch.randn(4, 16), torch.randn(24, 16)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 4)
    other = torch.randn(24, 4).t()  # [4, 24], not contiguous
    real = torch.ops.mkldnn._linear_pointwise.binary(x, other, packed, None, "add")
    torch.testing.assert_close(real, x @ w.t() + other, atol=1e-5, rtol=0)
    with FakeTensorMode() as mode:
        fake = compiled_module.linear_add_fake(mode.from_tensor(x), mode.from_tensor(other), mode.from_tensor(w),
                                               None, "add")
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)


def test_one_compiled_packed_step_per_thread_count() -> None:
    """Inductor writes the compiling thread's count into its loops, so each thread count
    gets its own compiled step, and a second call reuses it (nothing compiles until the
    step is first called)."""
    threads = torch.get_num_threads()
    try:
        first = compiled_module.compiled_packed_fn()
        assert compiled_module.compiled_packed_fn() is first
        torch.set_num_threads(threads + 1)
        assert compiled_module.compiled_packed_fn() is not first
    finally:
        torch.set_num_threads(threads)
