"""Tensor parallelism (``rltune.parallel.tensor``) in real process groups (gloo, CPU).

1. Forward and backward: every supported architecture family (a tiny random Qwen2 with
   tied embeddings; slow: Qwen2-MoE with a shared expert, Llama, Mistral, Qwen3 with its
   per-head norms, Mixtral, Qwen3-MoE), split over tp=2 with and without sequence
   parallelism, gives the log-probs, entropy and parameter gradients of the unsplit model
   (its full logits): from the full vocabulary-sharded logits (Qwen2) and in chunks of 3
   tokens, each chunk's logits sharded over the vocabulary (``rltune.models.chunked``).
2. Training: tp=2 (and dp_shard=2 x tp=2, slow) trains like one process on the whole
   batch over two optimizer steps (loss, grad norm, parameters), through the shared
   layout harness ``layout_workers``.

Tolerances. Everything is fp32. A split layer sums its ``H`` or ``I`` products in two
halves and adds them (all-reduce) instead of in one sweep, the vocabulary's log-sum-exp
likewise: the same numbers added in another order, ~1e-7 relative per sum, growing
through 4 layers and a softmax to a few 1e-6 on log-probs of magnitude ~5 (measured
below 1e-6); LOGP_ATOL = 1e-5 leaves room and is far below what a missing reduction
does (a log-sum-exp over half the vocabulary is off by ~log 2 = 0.7). Gradients:
GRAD_RTOL = 1e-4 relative to each tensor's largest entry (measured below 1e-6).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from rltune.learner.launch import spawn_learner_group
from rltune.models.logprobs import completion_logprobs
from rltune.parallel.tensor import SUPPORTED, TensorParallelError, apply_tensor_parallel

LOGP_ATOL = 1e-5
GRAD_RTOL = 1e-4


def tiny_config(model_type: str):
    """A tiny random config of ``model_type`` (vocab 260 as builtin:tiny, 2 layers,
    4 heads, 2 KV heads): small enough to build in every process."""
    from transformers import AutoConfig

    common = dict(vocab_size=260, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=model_type == "qwen2", pad_token_id=0)
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=48)
    extra = {
        "qwen3": dict(head_dim=16),
        "qwen2_moe": dict(num_experts=4, shared_expert_intermediate_size=64, **moe),
        "qwen3_moe": dict(num_experts=4, head_dim=16, **moe),
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    }.get(model_type, {})
    return AutoConfig.for_model(model_type, **common, **extra)


def build(model_type: str, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(model_type)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms away from 1 so that their gradients matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def toy_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Four rows, prompts left-padded to 5 columns, completions right-padded to 6; ids 0
    (the pad id, the embedding's ``padding_idx``) and 130 (the first id of the second
    rank's vocabulary slice) appear among the attended tokens and targets."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 260, (4, 11), generator=g)
    ids[3, 2:9] = torch.tensor([130, 0, 129, 130, 0, 259, 130])
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    mask[1, 8:] = 0
    mask[2, :1] = 0
    mask[2, 10:] = 0
    return ids, mask, 5


def forward_backward(model: torch.nn.Module, chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Log-probs, entropy and the gradients of a weighted sum of the log-probs, the head
    in chunks of ``chunk`` completion tokens (0: the full logits)."""
    ids, mask, prompt_len = toy_batch()
    out = completion_logprobs(model, ids, mask, prompt_len, with_entropy=True, temperature=0.9, chunk_tokens=chunk)
    weights = torch.linspace(-1.0, 2.0, out.logprobs.numel()).reshape(out.logprobs.shape)
    (out.logprobs * weights).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        grads[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach()
    return out.logprobs.detach(), out.entropy, grads


def tp_forward_backward(cases: list[tuple[str, bool, int]]) -> dict:
    """In each rank: for each ``(model_type, sequence_parallel, chunk)``, the model split
    over all ranks and its forward-backward (one process group for all cases: starting one
    costs more than the cases)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    results = {}
    for model_type, sequence_parallel, chunk in cases:
        model = build(model_type)
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sequence_parallel)
        logprobs, entropy, grads = forward_backward(model, chunk)
        results[f"{model_type}-{sequence_parallel}-{chunk}"] = {"logprobs": logprobs, "entropy": entropy,
                                                                "grads": grads}
    return results


def check_same(got: dict, want: tuple, label: str) -> None:
    logprobs, entropy, grads = want
    torch.testing.assert_close(got["logprobs"], logprobs, atol=LOGP_ATOL, rtol=0, msg=f"{label}: log-probs")
    torch.testing.assert_close(got["entropy"], entropy, atol=LOGP_ATOL, rtol=0, msg=f"{label}: entropy")
    assert got["grads"].keys() == grads.keys(), label
    for name, g in grads.items():
        scale = float(g.abs().max()) or 1.0
        torch.testing.assert_close(got["grads"][name], g, atol=GRAD_RTOL * scale, rtol=0,
                                   msg=f"{label}: gradient of {name}")


def check_families(families: list[str], chunks: tuple[int, ...] = (3,)) -> None:
    cases = [(family, sp, chunk) for family in families for sp in (False, True) for chunk in chunks]
    results = spawn_learner_group(2, tp_forward_backward, cases, backend="gloo")
    for family in families:
        want = forward_backward(build(family))
        for _, sp, chunk in [c for c in cases if c[0] == family]:
            for rank, got in enumerate(results):
                check_same(got[f"{family}-{sp}-{chunk}"], want,
                           f"{family} sequence_parallel={sp} chunk={chunk} rank {rank}")


def test_tied_qwen2_matches_unsplit() -> None:
    """builtin:tiny's family, with tied embeddings; the full logits and chunks of 3."""
    check_families(["qwen2"], chunks=(0, 3))


@pytest.mark.slow
def test_other_families_match_unsplit() -> None:
    """Qwen2-MoE (builtin:tiny-moe's family) and the others."""
    check_families(["qwen2_moe", "llama", "mistral", "qwen3", "mixtral", "qwen3_moe"])


# ------------------------------------------------------------------ training through the mesh

PARAM_ATOL = 1e-6
"""As tests/distributed/test_layouts_data.py: fp32 sums in another order move gradient
components by ~1e-7 relative; with Adam eps=1e-3 (layout_workers) the update's slope is
<= lr/eps = 1, so parameters agree within 1e-6 after two steps, while a step moves them
by ~1e-3. Loss and gradient norm: rel 1e-5."""


def assert_trains_like_one_process(ranks: list[dict], single: dict, label: str) -> None:
    from test_layouts_data import max_abs_diff

    for rank, got in enumerate(ranks):
        where = f"{label}, rank {rank}"
        assert got["loss"] == pytest.approx(single["loss"], rel=1e-5), where
        assert got["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5), where
        assert max_abs_diff(got["params"], single["params"]) <= PARAM_ATOL, where
        assert got["metrics"] == ranks[0]["metrics"], where


def test_tp2_trains_like_one_process(model_dir: str, single: dict) -> None:
    """tp=2 (both ranks the same rows), with and without sequence parallelism."""
    from layout_workers import several

    runs = [({"tp": 2, "dp_shard": 1}, None), ({"tp": 2, "dp_shard": 1, "sequence_parallel": True}, None)]
    results = spawn_learner_group(2, several, model_dir, runs, backend="gloo", timeout_s=600)
    for i, (layout, _) in enumerate(runs):
        assert_trains_like_one_process([ranks[i] for ranks in results], single, str(layout))


@pytest.mark.slow
def test_dp_shard2_tp2_trains_like_one_process(model_dir: str, single: dict) -> None:
    """Four ranks: FSDP2 over two data ranks of two tp ranks each (2-D DTensor weights)."""
    from layout_workers import several

    runs = [({"tp": 2, "dp_shard": 2}, None), ({"tp": 2, "dp_shard": 2, "sequence_parallel": True}, None)]
    results = spawn_learner_group(4, several, model_dir, runs, backend="gloo", timeout_s=900)
    for i, (layout, _) in enumerate(runs):
        assert_trains_like_one_process([ranks[i] for ranks in results], single, str(layout))


# ------------------------------------------------------------------ refusals (no process group)


class _Mesh:
    """What apply_tensor_parallel reads of a 1-D mesh before it splits anything."""

    ndim = 1
    mesh_dim_names = ("tp",)

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_unknown_architecture_is_refused_with_the_supported_list() -> None:
    from transformers import AutoModelForCausalLM, GPT2Config

    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(TensorParallelError, match="gpt2") as err:
        apply_tensor_parallel(model, _Mesh(2), sequence_parallel=False)
    assert all(name in str(err.value) for name in SUPPORTED)


def test_sizes_tp_does_not_divide_are_named() -> None:
    with pytest.raises(TensorParallelError, match=r"tp=3 does not divide .*num_attention_heads"):
        apply_tensor_parallel(build("qwen2"), _Mesh(3), sequence_parallel=False)
