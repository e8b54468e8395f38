"""MoE routing: the generator records routes aligned with the tokens, the learner replays
them (the recorded experts, with the router's own probabilities as weights), the router
agreement counts what it says, and the aux-free bias moves selection toward balance."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from rltune.config import load_config
from rltune.data.collate import collate_rollouts
from rltune.data.records import Prompt, SamplingParams
from rltune.models.load import load_model, load_tokenizer
from rltune.models.logprobs import completion_logprobs
from rltune.models.routing import (
    BIAS_BUFFER,
    NO_ROUTE,
    RoutingError,
    agreement_metrics,
    find_routers,
    install_routing,
    update_routing_bias,
)
from rltune.rollout.hf import HFGenerator

pytestmark = pytest.mark.usefixtures("one_thread")  # small forwards: one thread is fastest


@pytest.fixture(scope="module")
def moe(tiny_moe_dir: str):
    """(model, tokenizer) of builtin:tiny-moe, fp32 (module-wide: tests copy the model)."""
    return load_model(tiny_moe_dir), load_tokenizer(tiny_moe_dir)


def _prompts(tokenizer) -> list[Prompt]:
    texts = ["1 + 2 =", "the cat sat on the", "7 * 8 - 3 ="]
    return [Prompt(id=str(i), text=t, input_ids=tokenizer(t)["input_ids"]) for i, t in enumerate(texts)]


def _generate(model, tokenizer, *, seed: int = 0, max_new_tokens: int = 10):
    gen = HFGenerator(model, tokenizer, rng=torch.Generator().manual_seed(seed))
    rollouts = gen.generate(_prompts(tokenizer), SamplingParams(n=2, max_new_tokens=max_new_tokens))
    return gen, rollouts, collate_rollouts(rollouts, tokenizer.pad_token_id)


def _perturb_routers(model, scale: float = 0.5, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for gate in find_routers(model):
            gate.weight.add_(scale * gate.weight.std() * torch.randn(gate.weight.shape, generator=g))


# ------------------------------------------------------------------------- install


def test_installed_routers_compute_what_transformers_computes(moe) -> None:
    """Installed (no routes, no bias), the forward is the same arithmetic in the same
    order as transformers' router: log-probs and expert counts equal to the bit."""
    model, _ = moe
    plain, patched = copy.deepcopy(model), copy.deepcopy(model)
    assert install_routing(patched, replay=True) == 2
    ids = torch.randint(0, 250, (3, 14), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    a = completion_logprobs(plain, ids, mask, 6, output_router_logits=True)
    b = completion_logprobs(patched, ids, mask, 6, output_router_logits=True)
    assert torch.equal(a.logprobs, b.logprobs)
    assert torch.equal(a.expert_load, b.expert_load)
    assert b.route_agreement is None


def test_a_dense_model_with_replay_or_bias_is_refused(tiny_dir: str) -> None:
    dense = load_model(tiny_dir)
    assert install_routing(dense) == 0  # nothing asked: left alone
    with pytest.raises(RoutingError, match=r"routing_replay: rollout .*dense model"):
        install_routing(dense, replay=True)
    with pytest.raises(RoutingError, match=r"aux_free_bias: 0.1 .*dense model"):
        install_routing(dense, aux_free_bias=0.1)


@pytest.mark.parametrize("overrides, fragment", [
    (["model.moe.routing_replay=rollout", "rollout.engine=vllm"], "vLLM's generate API"),
    (["model.moe.aux_free_bias=0.01", "rollout.engine=vllm"], "vLLM's MoE layers"),
    (["model.moe.routing_replay=rollout", "env.name=builtin:tools"], "multi-turn episode"),
    (["model.moe.aux_free_bias=0.01", "model.lora.r=4"], "LoRA checkpoint saves the adapters only"),
])
def test_config_refuses_what_the_rollout_side_cannot_record(overrides, fragment) -> None:
    with pytest.raises(ValueError, match=fragment):
        load_config(None, ["model.path=builtin:tiny-moe", *overrides])


# ------------------------------------------------------------------------- recording


def test_generation_records_every_token_route_aligned_with_input_ids(moe) -> None:
    """Routes are int16 ``[P_i + L, layers, k]``; in the batch they sit on their tokens
    (-1 on padding and on a completion's last token, never fed back); with unchanged
    weights the learner's router picks the recorded set for every compared token-layer."""
    model, tok = copy.deepcopy(moe[0]), moe[1]
    install_routing(model)
    _, rollouts, batch = _generate(model, tok)
    for r in rollouts:
        assert r.routes.dtype == torch.int16
        assert r.routes.shape == (len(r.prompt_ids) + len(r.completion_ids), 2, 2)
        assert bool((r.routes[: len(r.prompt_ids)] >= 0).all())
    longest = max(len(r.completion_ids) for r in rollouts)
    assert all(bool((r.routes[-1] == NO_ROUTE).all()) for r in rollouts if len(r.completion_ids) == longest)
    assert batch.routes.shape == (*batch.input_ids.shape, 2, 2)
    have = batch.routes[..., 0, 0] >= 0
    assert not bool((have & ~batch.attention_mask.bool()).any())  # padding has no route
    out = completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_len, routes=batch.routes)
    matches, compared = out.route_agreement.tolist()
    completion_routes = int((have[:, batch.prompt_len:]).sum()) * 2  # tokens x layers
    assert compared == completion_routes > 0
    assert matches == compared  # agreement 1.0 right after generation


def test_batch_trim_and_select_keep_routes_on_their_tokens(moe) -> None:
    model, tok = copy.deepcopy(moe[0]), moe[1]
    install_routing(model)
    _, rollouts, batch = _generate(model, tok)
    part = batch.select(torch.tensor([2, 3])).trim()  # a shorter prompt: columns dropped
    assert part.routes.shape[:2] == part.input_ids.shape
    r = rollouts[2]
    row = part.routes[0][part.attention_mask[0].bool()]
    assert torch.equal(row, r.routes)


# ------------------------------------------------------------------------- replay


def _moe_block_io(model):
    """Forward hooks on each sparse-MoE block: lists of (input [N, H], output [N, H])."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    handles = [
        gate_owner.register_forward_hook(
            lambda _m, args, out: seen.append((args[0].reshape(-1, args[0].shape[-1]), out.reshape(-1, out.shape[-1])))
        )
        for gate_owner in (layer.mlp for layer in model.model.layers)
    ]
    return seen, handles


def _manual_block(block, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE's sparse block by hand with given experts ``[N, k]``: the router's softmax
    at those experts (renormalised when ``norm_topk_prob``), each chosen expert's SwiGLU
    from the 3-D weights, plus the sigmoid-gated shared expert."""
    probs = torch.softmax(F.linear(x, block.gate.weight).float(), dim=-1)
    w = probs.gather(-1, experts)
    if block.gate.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for slot in range(experts.shape[1]):
        e = experts[:, slot]
        gate_up = torch.einsum("nih,nh->ni", block.experts.gate_up_proj[e], x)
        g, u = gate_up.chunk(2, dim=-1)
        y = torch.einsum("nhi,ni->nh", block.experts.down_proj[e], F.silu(g) * u)
        out = out + w[:, slot:slot + 1] * y
    shared = torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return out + shared


def test_replay_routes_through_the_recorded_experts_after_the_router_changed(moe) -> None:
    """Generate, then perturb the routers so the learner would choose otherwise (agreement
    < 1). With replay, every MoE block's output is the hand computation with the
    *recorded* experts and the perturbed router's probabilities; the same forward without
    replay is not (it follows the perturbed router's own choice).

    Tolerance: fp32, the hand version sums the same products in another order (einsum
    over H = 128 and I = 256 terms of size ~1, then k + 1 terms), a few ulp of the
    outputs' magnitude (~1): 1e-5 absolute."""
    model, tok = copy.deepcopy(moe[0]), moe[1]
    install_routing(model, replay=True)
    _, _, batch = _generate(model, tok)
    _perturb_routers(model)
    seen, handles = _moe_block_io(model)
    try:
        out = completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_len,
                                  routes=batch.routes)
    finally:
        for h in handles:
            h.remove()
    matches, compared = out.route_agreement.tolist()
    assert matches < compared  # the perturbed router disagrees somewhere
    have = (batch.routes[..., 0, 0] >= 0).reshape(-1)
    own_differs = 0
    for layer, (x, y) in enumerate(seen):
        block = model.model.layers[layer].mlp
        recorded = batch.routes[:, :, layer].reshape(-1, 2).long()
        own = torch.topk(F.linear(x, block.gate.weight), 2, dim=-1).indices
        experts = torch.where(have[:, None], recorded, own)
        with torch.no_grad():
            torch.testing.assert_close(y, _manual_block(block, x, experts), atol=1e-5, rtol=0)
        differ = have & (own.sort(-1).values != recorded.sort(-1).values).any(-1)
        own_differs += int(differ.sum())
    assert own_differs > 0  # the replayed experts are not the ones the router would pick

    plain = copy.deepcopy(model)
    install_routing(plain, replay=False)
    free = completion_logprobs(plain, batch.input_ids, batch.attention_mask, batch.prompt_len, routes=batch.routes)
    assert not torch.allclose(free.logprobs, out.logprobs, atol=1e-4)
    # counted over the same (token, layer) pairs; the matches may differ, since without
    # replay the layers after the first see other hidden states, so their routers choose
    # otherwise
    assert free.route_agreement[1] == out.route_agreement[1]


def test_replay_gradient_reaches_the_router_and_the_replayed_experts(moe) -> None:
    """The routing weights are the router's probabilities at the replayed experts: the
    router's weight gets a gradient, and so does every expert the routes name."""
    model, tok = copy.deepcopy(moe[0]), moe[1]
    install_routing(model, replay=True)
    _, _, batch = _generate(model, tok)
    _perturb_routers(model)
    out = completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_len, routes=batch.routes)
    out.logprobs.sum().backward()
    for layer, block in enumerate(model.model.layers):
        assert block.mlp.gate.weight.grad.abs().sum() > 0
        used = batch.routes[:, :, layer][batch.routes[:, :, layer] >= 0].long().unique()
        grads = block.mlp.experts.down_proj.grad.abs().sum(dim=(1, 2))
        assert bool((grads[used] > 0).all())


# ------------------------------------------------------------------------- agreement


def test_router_agreement_is_the_share_of_matching_topk_sets_by_hand(moe) -> None:
    """After a perturbation: agreement = (completion token-layer routes whose recorded
    set equals the router's own top-k) / (those compared), recomputed here from the
    router logits the model returns, and weighted by the count as a metric."""
    model, tok = copy.deepcopy(moe[0]), moe[1]
    install_routing(model, replay=True)
    _, _, batch = _generate(model, tok)
    _perturb_routers(model, scale=0.3)
    out = completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_len,
                              routes=batch.routes, output_router_logits=True)
    seen, handles = _moe_block_io(model)
    try:
        completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_len, routes=batch.routes)
    finally:
        for h in handles:
            h.remove()
    counted = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
    counted[:, batch.prompt_len:] = True
    counted &= batch.attention_mask.bool() & (batch.routes[..., 0, 0] >= 0)
    matches = compared = 0
    for layer, (x, _) in enumerate(seen):
        own = torch.topk(F.linear(x, model.model.layers[layer].mlp.gate.weight), 2, dim=-1).indices
        recorded = batch.routes[:, :, layer].reshape(-1, 2).long()
        same = (own.sort(-1).values == recorded.sort(-1).values).all(-1)
        matches += int((same & counted.reshape(-1)).sum())
        compared += int(counted.sum())
    assert out.route_agreement.tolist() == [matches, compared]
    assert 0 < matches < compared
    metric = agreement_metrics(out.route_agreement)["moe/router_agreement"]
    assert float(metric.value) == pytest.approx(matches / compared) and float(metric.weight) == compared


# ------------------------------------------------------------------------- aux-free bias


def _skew(model, ids: torch.Tensor) -> None:
    """Make expert 0 every token's first choice on ``ids``, layer after layer: its router
    row gets the least-squares ``w`` with ``x @ w = 3`` for every token ``x`` reaching
    that router (fewer tokens than hidden dims: solved exactly), so its logit leads."""
    for index, layer in enumerate(model.model.layers):
        seen, handles = _moe_block_io(model)
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        for h in handles:
            h.remove()
        x = seen[index][0]
        with torch.no_grad():
            layer.mlp.gate.weight[0] += torch.linalg.pinv(x) @ torch.full((x.shape[0],), 3.0)


def test_aux_free_bias_moves_a_skewed_router_toward_balance_without_touching_weights(moe) -> None:
    """Expert 0 starts on every token of both layers (its share of the choices x E = 2,
    the most top-2 allows). Steps of ``0.01 * sign(mean - load)`` on the same inputs bring
    the load near even: with fixed inputs the tokens cross a bias threshold together, so
    the load alternates from step to step (period 2) and the measure is its average over
    the last 30 steps. Measured here: every expert within 0.83 .. 1.17 of even (2.0 at the
    start); the bounds 0.75 .. 1.25 leave room for other kernels, and an update with the
    wrong sign (or none) stays at 2.0. The weights stay the unbiased probabilities."""
    model = copy.deepcopy(moe[0])
    install_routing(model, aux_free_bias=0.01)
    ids = torch.randint(0, 250, (4, 24), generator=torch.Generator().manual_seed(4))
    _skew(model, ids)
    mask = torch.ones_like(ids)
    shares = []
    for _ in range(120):
        with torch.no_grad():
            counts = completion_logprobs(model, ids, mask, 4, output_router_logits=True).expert_load
        shares.append(counts / counts.sum(-1, keepdim=True) * counts.shape[1])
        assert update_routing_bias(model, counts)
    assert float(shares[0].max()) == 2.0
    late = torch.stack(shares[-30:]).mean(0)  # [L, E]
    assert 0.75 < float(late.min()) and float(late.max()) < 1.25, late
    gate = model.model.layers[0].mlp.gate
    assert gate.routing_bias[0] < 0 and f"model.layers.0.mlp.gate.{BIAS_BUFFER}" in model.state_dict()
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(5))
    logits, weights, chosen = gate(x)
    probs = torch.softmax(logits, dim=-1)
    expected = probs.gather(-1, chosen)
    if gate.norm_topk_prob:
        expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, expected, atol=0, rtol=0)  # the same ops: exact
    assert torch.equal(chosen, torch.topk(probs + gate.routing_bias, 2, dim=-1).indices)


def test_the_learner_step_updates_the_bias_from_its_routing_counts(moe) -> None:
    from rltune.algos import ALGORITHMS
    from rltune.config.schema import AlgoConfig, TrainConfig
    from rltune.learner.learner import LocalLearner
    from rltune.learner.objectives import build_objective

    model, tok = copy.deepcopy(moe[0]), moe[1]
    install_routing(model, replay=True, aux_free_bias=0.01)
    _, _, batch = _generate(model, tok)
    batch.advantages = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(0))
    learner = LocalLearner(model, build_objective(ALGORITHMS["grpo"], AlgoConfig()), TrainConfig(lr=1e-3))
    metrics = learner.step(batch)
    assert float(metrics["moe/router_agreement"].value) == 1.0  # replayed, unchanged weights
    bias = torch.stack([g.routing_bias for g in find_routers(model)])
    assert bool((bias.abs() == 0.01).all() | (bias == 0).all())  # one step of +-rate (0: exactly even)
    assert bias.abs().sum() > 0
