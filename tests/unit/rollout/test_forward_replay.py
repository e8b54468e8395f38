"""The learner's forward on the generator's kept products (``rltune/models/replay.py``):
the same log-probs and gradients as the forward that runs them, used only where it
holds, and dropped when the weights change.

The expected values are the transformers model's own forward over every row's whole
sequence (log-softmax of its logits at the completion positions, and the gradients of
their sum), not rltune's lean forward.

Tolerances (float32, machine epsilon 1.2e-7):

- log-probs 1e-5 absolute. The kept products were computed by the decoder's kernels
  (row by row, packed weights, the residual added inside the product) and the expected
  ones by transformers' batched GEMMs: the same dot products of at most 4 x 128 terms in
  another summation order, a few ulps each (~1e-7 at these magnitudes). Four layers, the
  head and a logsumexp over 260 logits carry that to ~1e-6 (measured: at most 9.5e-7). A
  replayed row taken from the wrong recorded row, or a kept column shifted by one
  position, moves them by 0.1 or more.
- gradients 1e-5 of the largest entry: each is a sum over the batch's ~100 tokens of
  such products (~100 ulps relative at worst; measured at most 1.1e-6).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rltune.data.collate import join
from rltune.data.records import Prompt, SamplingParams
from rltune.models import replay
from rltune.models.lean_forward import lean_completion_logprobs
from rltune.models.load import load_model
from rltune.rollout.hf import HFGenerator

LOGP_TOL = 1e-5  # see the module docstring
GRAD_TOL = 1e-5  # of the largest gradient entry; see the module docstring
BUDGET = 1 << 30


STOPS = tuple("0123456789abcdefghijklmnop")
"""Stop strings that end most rows within a few tokens, at different lengths: the
decoder then feeds padding to the rows that are done, and the batch is right-padded."""


@pytest.fixture
def model(tiny_path: str) -> torch.nn.Module:
    """A fresh copy: the tests keep records on it and step its weights."""
    return load_model(tiny_path)


def prompts(tokenizer) -> list[Prompt]:
    """Two prompts of different lengths: the shorter is left-padded in the prefill."""
    return [Prompt(id=str(i), text=t, input_ids=tokenizer(t)["input_ids"])
            for i, t in enumerate(["12+30=", "7*8="])]


def generate(model, tokenizer, n: int = 4, new: int = 10):
    generator = HFGenerator(model, tokenizer, rng=torch.Generator().manual_seed(3))
    rollouts = generator.generate(prompts(tokenizer), SamplingParams(n=n, max_new_tokens=new, temperature=1.0,
                                                                         stop=STOPS))
    ids, mask, prompt_len = join([r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts],
                                 tokenizer.pad_token_id)
    return generator, rollouts, ids, mask, prompt_len


def lean_step(model, ids, mask, prompt_len):
    """Log-probs ``[B, C]`` and the gradients of their (masked) sum, lean forward."""
    model.train().zero_grad(set_to_none=True)
    logprobs, _ = lean_completion_logprobs(model, ids, mask, prompt_len)
    (logprobs * mask[:, prompt_len:]).sum().backward()
    return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def hf_step(model, ids, mask, prompt_len):
    """The same from transformers' forward over the whole rows (positions from the mask)."""
    model.train().zero_grad(set_to_none=True)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits.float()
    logprobs = F.log_softmax(logits[:, prompt_len - 1: -1], -1).gather(-1, ids[:, prompt_len:, None]).squeeze(-1)
    logprobs = logprobs * mask[:, prompt_len:]
    logprobs.sum().backward()
    return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close(got, expected, mask) -> None:
    (lp, grads), (lp_ref, grads_ref) = got, expected
    valid = mask.bool()
    assert (lp - lp_ref)[valid].abs().max().item() < LOGP_TOL
    assert grads.keys() == grads_ref.keys()
    for name, ref in grads_ref.items():
        assert (grads[name] - ref).abs().max().item() <= GRAD_TOL * ref.abs().max().item(), name


@pytest.mark.parametrize("rows", [slice(None), slice(2, 6), [5, 1, 0, 7]], ids=["all", "two-groups", "shuffled"])
def test_a_kept_forward_gives_the_forwards_logprobs_and_gradients(model, tokenizer, tiny_path, rows) -> None:
    replay.keep_records(model, BUDGET)
    _, rollouts, ids, mask, prompt_len = generate(model, tokenizer)
    lengths = {len(r.completion_ids) for r in rollouts}
    assert len(lengths) > 1, "some rows should end early, so the batch has right padding"
    assert len({len(r.prompt_ids) for r in rollouts}) == 2, "and the shorter prompt left padding"
    ids, mask = ids[rows], mask[rows]
    store = replay.store_of(model)
    got = lean_step(model, ids, mask, prompt_len)
    assert store.take_counts() == (len(ids), 0), "the forward took the kept products"
    assert_close(got, hf_step(model, ids, mask, prompt_len), mask[:, prompt_len:])
    # the learner's log-probs are the sampler's, to the head's rounding
    for row, r in zip(torch.arange(len(rollouts))[rows].tolist(), range(len(ids))):
        c = len(rollouts[row].completion_ids)
        assert (got[0][r, :c] - rollouts[row].completion_logprobs).abs().max().item() < LOGP_TOL


def decode_records(model, tokenizer, **decoder) -> list[torch.Tensor]:
    """Every kept output of a LeanDecoder(``decoder``) over two prompts, two rows each,
    four fed tokens."""
    from rltune.rollout.fastpath import LeanDecoder

    replay.keep_records(model, BUDGET)
    batch = prompts(tokenizer)
    ids, mask = join([torch.tensor(p.input_ids) for p in batch], [torch.zeros(0, dtype=torch.long)] * 2,
                     tokenizer.pad_token_id)[:2]
    general = decoder.pop("general", False)
    steps = LeanDecoder(model.eval(), max_new_tokens=5, keep_forward=True, **decoder)
    with torch.inference_mode():
        steps.prefill(ids, mask, repeats=2)
        if general:
            steps.key_bias = None  # as off the CPU: the step runs the general _forward
        for token in (5, 9, 11, 40):
            steps.step(torch.full((4,), token))
    record = replay.store_of(model).records[-1]
    assert record.fed == 4
    return [t.clone() for layer in record.layers for t in (*layer.prompt, *layer.steps)]


@pytest.fixture
def uncompiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """rollout.compile's static-cache steps run eagerly: their arithmetic without a compile."""
    from rltune.rollout import compiled

    monkeypatch.setattr(compiled, "compiled_step_fn", lambda mode: compiled.static_step)
    monkeypatch.setattr(compiled, "compiled_packed_fn", lambda: compiled.packed_step)


@pytest.mark.parametrize("path", ["general", "static-fewrows", "static-onednn", "static-plain"])
def test_every_decode_step_keeps_the_same_outputs(model, tokenizer, uncompiled, require_fewrows, path) -> None:
    """The general step (off the CPU, or in bf16) and rollout.compile's static-cache steps
    (on packed weights, or the plain one) keep what the CPU's eager one-query step keeps,
    to float32 rounding (1e-5 of each output's largest entry: the same products summed
    in another order)."""
    from rltune.rollout.compiled import CompiledStep

    if path == "static-fewrows":
        require_fewrows()
    options = {"general": {"general": True}, "static-fewrows": {"kernel": "fewrows"},
               "static-onednn": {"kernel": "onednn"}, "static-plain": {"pack": False}}[path]
    if path.startswith("static"):
        options["compiled"] = CompiledStep()
    want = decode_records(model, tokenizer)
    got = decode_records(model, tokenizer, **options)
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()


@pytest.mark.slow
def test_a_compiled_decode_keeps_its_outputs_for_the_learner(model, tokenizer) -> None:
    """torch.compile itself (rollout.compile: a first compile of ~20 s): the compiled
    step's kept outputs serve the learner's forward as the eager ones do."""
    replay.keep_records(model, BUDGET)
    generator = HFGenerator(model, tokenizer, rng=torch.Generator().manual_seed(3), compile=True)
    rollouts = generator.generate(prompts(tokenizer), SamplingParams(n=4, max_new_tokens=10, stop=STOPS))
    ids, mask, prompt_len = join([r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts],
                                 tokenizer.pad_token_id)
    got = lean_step(model, ids, mask, prompt_len)
    assert replay.store_of(model).take_counts() == (len(ids), 0)
    assert_close(got, hf_step(model, ids, mask, prompt_len), mask[:, prompt_len:])


def test_rows_not_generated_run_the_whole_forward(model, tokenizer) -> None:
    replay.keep_records(model, BUDGET)
    _, _, ids, mask, prompt_len = generate(model, tokenizer)
    other = ids.clone()
    other[0, prompt_len] = (other[0, prompt_len] + 1) % 200 + 3  # a completion token no row sampled
    got = lean_step(model, other, mask, prompt_len)
    assert replay.store_of(model).take_counts() == (0, len(ids))
    assert_close(got, hf_step(model, other, mask, prompt_len), mask[:, prompt_len:])


def test_an_optimizer_step_or_a_weight_load_drops_the_records(model, tokenizer) -> None:
    replay.keep_records(model, BUDGET)
    generator, _, ids, mask, prompt_len = generate(model, tokenizer)
    store = replay.store_of(model)
    assert len(store.records) == 1
    lean_step(model, ids, mask, prompt_len)
    critic = torch.nn.Linear(3, 1)
    critic(torch.ones(3)).sum().backward()
    torch.optim.AdamW(critic.parameters()).step()  # another model's optimizer: the records stay
    assert len(store.records) == 1
    torch.optim.SGD(model.parameters(), lr=1e-2).step()  # any optimizer over the model's
    assert store.records == []
    got = lean_step(model, ids, mask, prompt_len)
    assert store.take_counts() == (len(ids), len(ids))  # the first forward replayed, the second did not
    assert_close(got, hf_step(model, ids, mask, prompt_len), mask[:, prompt_len:])
    generate(model, tokenizer)
    generator.load_weights(1, {k: v.clone() for k, v in model.state_dict().items()})
    assert store.records == []


def test_the_budget_bounds_what_is_kept(model, tokenizer) -> None:
    replay.keep_records(model, BUDGET)
    generate(model, tokenizer)
    store = replay.store_of(model)
    one = store.used_bytes()
    assert one > 0
    replay.keep_records(model, int(one * 1.5))  # room for one generation: the older one goes
    store = replay.store_of(model)
    generate(model, tokenizer)
    first = store.records[0]
    generate(model, tokenizer)
    assert len(store.records) == 1 and store.records[0] is not first and store.used_bytes() == one
    kept = store.records[0]
    generate(model, tokenizer, new=40)  # a record larger than the budget: none, and the kept one stays
    assert store.records == [kept]
    replay.keep_records(model, 0)
    assert replay.store_of(model) is None


def run_config(tiny_path: str, tmp_path, *overrides: str):
    from rltune.config import load_config

    return load_config(None, [
        f"model.path={tiny_path}", "algo.name=grpo", "algo.group_size=4", "data.train=builtin:arith_small/train",
        "reward.0.fn=builtin:exact_numeric", "rollout.max_new_tokens=6", "train.steps=2", "train.prompts_per_step=2",
        f"log.dir={tmp_path}", "log.console=false", "checkpoint.final=false", *overrides])


@pytest.mark.parametrize("overrides, kept", [
    ((), True),
    (("train.reuse_rollout_mb=0",), False),
    (("train.precision=bf16",), False),
    (("rollout.precision=bf16",), False),
    (("train.activation_checkpointing=full",), False),
    (("runtime.max_staleness=1", "algo.importance_correction=token-truncate"), False),
], ids=["default", "off", "bf16-learner", "bf16-sampler", "checkpointing", "generator-ahead"])
def test_a_local_run_keeps_records_only_where_its_learner_can_read_them(tiny_path, tmp_path, overrides, kept) -> None:
    from rltune.runtime.local import build_run

    run = build_run(run_config(tiny_path, tmp_path, *overrides))
    assert (replay.store_of(run.roles.generator.model) is not None) == kept


def test_the_learner_drops_its_records_without_the_optimizer_hook(tiny_path, tmp_path) -> None:
    """An optimizer that steps copies of the parameters (train.offload: optimizer) is not
    seen by the global hook: the learner drops its model's records after every step."""
    from rltune.runtime.local import build_run
    from rltune.runtime.loop import train

    run = build_run(run_config(tiny_path, tmp_path))
    store = replay.store_of(run.roles.generator.model)
    hook = replay._HOOKED.pop()
    hook.remove()
    try:
        history = train(run)
    finally:
        replay._HOOKED.append(replay.register_optimizer_step_post_hook(replay._forget_stepped))
    assert [m["learn/replayed_frac"] for m in history] == [1.0, 1.0]
    assert store.records == []


def test_a_copy_and_an_unfinished_prefill_keep_nothing_usable(model, tokenizer) -> None:
    import copy
    import pickle

    replay.keep_records(model, BUDGET)
    store = replay.store_of(model)
    _, _, ids, mask, prompt_len = generate(model, tokenizer)
    twin = copy.deepcopy(model)
    assert replay.store_of(twin).records == [] and replay.store_of(twin).owner() is None
    assert len(store.records) == 1 and len(pickle.loads(pickle.dumps(store)).records) == 0
    store.records[0].ready = False  # as when the prefill raised part way
    assert replay.find(model, ids, mask, prompt_len) is None


def test_checkpointed_blocks_and_autocast_run_the_whole_forward(model, tokenizer) -> None:
    from rltune.learner.memory import apply_activation_checkpointing

    replay.keep_records(model, BUDGET)
    _, _, ids, mask, prompt_len = generate(model, tokenizer)
    store = replay.store_of(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            lean_completion_logprobs(model, ids, mask, prompt_len)
        lean_completion_logprobs(model, ids, mask, prompt_len)
    assert store.take_counts() == (0, len(ids))
    apply_activation_checkpointing(model, "full")
    got = lean_step(model, ids, mask, prompt_len)
    assert store.take_counts() == (0, len(ids))
    assert_close(got, hf_step(model, ids, mask, prompt_len), mask[:, prompt_len:])


def test_a_model_without_a_store_keeps_nothing(model, tokenizer) -> None:
    _, _, ids, mask, prompt_len = generate(model, tokenizer)
    assert replay.store_of(model) is None
    assert replay.find(model, ids, mask, prompt_len) is None
