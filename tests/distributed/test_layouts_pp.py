"""Pipeline parallelism (``rltune/parallel/pipeline.py``): ``pp=2`` learner groups on
gloo equal one process after two optimizer steps (loss, whole-model gradient norm,
every weight), with GPipe and 1F1B; no-grad prediction through the stages; the pieces
(layer split, equal micro-batches, tied embeddings) on their own.

Tolerance. Every rank computes in float32 the same operations as one process on the same
rows; what differs is the shape of the tensors (micro-batches padded to one shape: more
masked keys in attention's softmax, more zero rows in reductions) and the order of a few
sums (the norm's squares summed per stage, then over stages). Each is a reordering of
float32 sums of O(10..10^3) terms, relative error ~ n * 2^-24 ~ 1e-5 at worst on values
of order 1, so losses and norms compare at rtol 1e-5 and weights (moved by Adam with
``eps=1e-3``, slope <= lr/eps = 1, see learner_group_workers.ADAM_EPS) at atol 1e-6.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from layout_workers import build_learner, global_batch, run_steps  # noqa: E402
from learner_group_workers import BUDGET, algo_config, make_batch  # noqa: E402

from rltune.learner.distributed import shard_batch  # noqa: E402
from rltune.learner.launch import spawn_learner_group  # noqa: E402
from rltune.learner.pair_scoring import learner_pair_outputs  # noqa: E402
from rltune.learner.parallel import NoParallelism  # noqa: E402
from rltune.models.chunked import set_logprob_chunk_tokens  # noqa: E402
from rltune.models.load import load_model, resolve_model  # noqa: E402
from rltune.parallel.layout import Layout  # noqa: E402
from rltune.parallel.strategy import MeshParallelism  # noqa: E402
from rltune.parallel.pipeline import equalise, split_model, stage_layer_ranges  # noqa: E402

RTOL = 1e-5
ATOL_WEIGHTS = 1e-6
PP2 = {"pp": 2}


class UntiedCopies(MeshParallelism):
    """Control (a real mistake): the tied embedding's two copies (first and last stage)
    each keep only their own stage's gradient, so they learn apart and the update is not
    one process's."""

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        stage = super().wrap(model)
        self.pipeline.tied_group = None
        return stage


def pp_runs(model_path: str, runs: list[tuple[dict, bool]], seed: int = 0) -> list[dict]:
    """One rank: for each ``(layout, control)``, a fresh learner of that layout (with
    the :class:`UntiedCopies` control when ``control``) takes two steps on its data
    shard; the harness's result, plus the log-probs of the shard predicted after them."""
    torch.set_num_threads(1)
    out = []
    for layout, control in runs:
        model_dir = resolve_model(model_path)
        batch = global_batch(model_dir, seed)
        parallelism = (UntiedCopies if control else MeshParallelism)(Layout(**layout))
        learner = build_learner(load_model(model_dir), parallelism)
        shard = shard_batch(batch, parallelism.rank, parallelism.world, unit=learner.objective.unit)
        result = run_steps(learner, shard, 2)
        result["logprobs"] = learner.logprobs(shard)
        result["data_rank"], result["data_world"] = parallelism.rank, parallelism.world
        out.append(result)
    return out


def reference_with_logprobs(model_path: str, seed: int = 0) -> dict:
    """:func:`layout_workers.reference` plus the log-probs of the batch after the steps."""
    torch.set_num_threads(1)
    model_dir = resolve_model(model_path)
    batch = global_batch(model_dir, seed)
    learner = build_learner(load_model(model_dir), NoParallelism())
    result = run_steps(learner, batch, 2)
    result["logprobs"] = learner.logprobs(batch)
    return result


def max_differences(got: dict, ref: dict) -> dict[str, float]:
    """The largest relative loss and norm differences and absolute weight difference."""
    rel = lambda a, b: max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))  # noqa: E731
    return {
        "loss": rel(got["loss"], ref["loss"]),
        "grad_norm": rel(got["grad_norm"], ref["grad_norm"]),
        "params": max(float((got["params"][k] - v).abs().max()) for k, v in ref["params"].items()),
    }


def assert_equal_to_reference(got: dict, ref: dict, *, logprob_rows: slice | None = None) -> None:
    assert got["params"].keys() == ref["params"].keys()
    diff = max_differences(got, ref)
    assert diff["loss"] <= RTOL and diff["grad_norm"] <= RTOL, diff
    assert diff["params"] <= ATOL_WEIGHTS, diff
    if logprob_rows is not None:  # predicted through the stages: the same float32 ops, padded
        torch.testing.assert_close(got["logprobs"], ref["logprobs"][logprob_rows], rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_dir() -> str:
    return resolve_model("builtin:tiny")


@pytest.mark.slow
def test_pp2_gpipe_and_1f1b_equal_one_process(tiny_dir: str) -> None:
    """Both schedules on gloo, two ranks (every rank returns the group's loss, norm,
    weights and predictions); the control without the tied-gradient sum must differ."""
    runs = [({**PP2, "pp_schedule": "gpipe"}, False), ({**PP2, "pp_schedule": "1f1b"}, False),
            ({**PP2, "pp_schedule": "1f1b"}, True)]
    ranks = spawn_learner_group(2, pp_runs, tiny_dir, runs, backend="gloo", timeout_s=400)
    ref = reference_with_logprobs(tiny_dir)
    for rank in ranks:
        gpipe, one_f_one_b, untied = rank
        assert_equal_to_reference(gpipe, ref, logprob_rows=slice(None))
        assert_equal_to_reference(one_f_one_b, ref, logprob_rows=slice(None))
        diff = max_differences(untied, ref)
        assert diff["params"] > 100 * ATOL_WEIGHTS, diff


@pytest.mark.slow
def test_pp2_by_dp_shard2_and_by_tp2_equal_one_process(tiny_dir: str) -> None:
    """Four ranks: two stages, each sharded (FSDP2, the stage as root) over two data
    ranks; then two stages, each tensor parallel over two ranks (the tied head's copy
    vocabulary-sharded like the embedding it copies)."""
    from rltune.data.shards import shard_bounds

    runs = [({**PP2, "dp_shard": 2, "pp_schedule": "1f1b"}, False), ({**PP2, "tp": 2, "pp_schedule": "gpipe"}, False)]
    ranks = spawn_learner_group(4, pp_runs, tiny_dir, runs, backend="gloo", timeout_s=700)
    ref = reference_with_logprobs(tiny_dir)
    for rank in ranks:
        for got in rank:
            start, stop = shard_bounds(len(ref["logprobs"]), got["data_rank"], got["data_world"])
            assert_equal_to_reference(got, ref, logprob_rows=slice(start, stop))


def test_stage_layer_ranges_balanced_and_refused() -> None:
    assert stage_layer_ranges(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layer_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layer_ranges(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    with pytest.raises(ValueError, match="pp=5 stages for a model of 4"):
        stage_layer_ranges(4, 5)


def test_split_keeps_names_and_unties_last_stage(tiny_dir: str) -> None:
    full = load_model(tiny_dir)
    names = set(full.state_dict())
    first = split_model(load_model(tiny_dir), 0, 2)
    last = split_model(load_model(tiny_dir), 1, 2)
    got_first, got_last = set(first.model.state_dict()), set(last.model.state_dict())
    assert got_first | got_last == names
    assert "model.embed_tokens.weight" in got_first and "lm_head.weight" not in got_first
    assert "lm_head.weight" in got_last and "model.norm.weight" in got_last
    assert {n for n in got_first if ".layers." in n} == {n for n in names if ".layers.0." in n or ".layers.1." in n}
    # the last stage's head is a copy of the embedding matrix, no longer the same tensor
    torch.testing.assert_close(last.model.lm_head.weight, full.model.embed_tokens.weight, rtol=0, atol=0)


def test_equalise_pads_to_one_shape(tiny_dir: str) -> None:
    from rltune.learner.microbatch import split_by_tokens

    batch = make_batch(load_model(tiny_dir))
    micro = split_by_tokens(batch, BUDGET)
    assert len({(len(m), m.input_ids.shape[1]) for m in micro}) > 1  # the test needs unequal ones
    equal = equalise(micro, len(micro) + 1)
    assert equal.input_ids.shape[0] == equal.rows * (len(micro) + 1)
    for k, m in enumerate(micro):
        left = equal.prompt_len - m.prompt_len
        rows = slice(k * equal.rows, k * equal.rows + len(m))
        cols = slice(left, left + m.input_ids.shape[1])
        assert torch.equal(equal.input_ids[rows, cols], m.input_ids)
        assert torch.equal(equal.attention_mask[rows, cols], m.attention_mask)
        assert int(equal.attention_mask[rows].sum()) == int(m.attention_mask.sum())


# ----------------------------------------------------------------------------- in one process


def chain(stages: list, mb, other, kind: str):
    """``mb`` padded to ``other``'s shape (as a step with both would pad it), run through
    ``stages`` one after the other in this process; the objective forward's output."""
    from rltune.parallel.pipeline import _stage_head, stage_output

    equal = equalise([mb, other], 2)
    ids, mask = equal.input_ids[: equal.rows], equal.attention_mask[: equal.rows]
    hidden = ids
    for stage in stages[:-1]:
        hidden = stage(hidden, attention_mask=mask)
    stages[-1].head = _stage_head(stages[-1].model, kind, equal.prompt_len, 0.7, True)
    return stage_output(kind, stages[-1](hidden, attention_mask=mask, input_ids=ids), mb, temperature=0.7,
                        with_entropy=True)


def stage_grads(stages: list) -> dict[str, torch.Tensor]:
    """Every parameter's gradient by its model name; a tied matrix's copies summed."""
    grads: dict[str, torch.Tensor] = {}
    for stage in stages:
        for name, p in stage.model.named_parameters():
            grads[name] = grads.get(name, 0) + p.grad
    if "lm_head.weight" in grads and "model.embed_tokens.weight" in grads:
        grads["model.embed_tokens.weight"] = grads["model.embed_tokens.weight"] + grads.pop("lm_head.weight")
    return grads


@pytest.mark.parametrize(("model", "pp", "chunk"), [("builtin:tiny", 2, 1024), ("builtin:tiny", 3, 0),
                                                   ("builtin:tiny", 2, 5), ("builtin:tiny-moe", 2, 1024)])
def test_stages_in_one_process_equal_the_model(model: str, pp: int, chunk: int) -> None:
    """The stages chained by hand (no schedule) give the model's log-probs, entropy,
    GRPO loss and every gradient (the tied matrix's: the two copies' sum), for a padded
    micro-batch, dense and MoE; the last stage's head in one chunk, or in chunks of 5
    tokens (``chunk``: its ``train.logprob_chunk_tokens``; 0 also one chunk). Same float32
    ops on a padded shape: log-probs at 1e-5, gradients at rtol 1e-4 (sums over more
    masked keys and rows reorder float32 additions)."""
    from rltune.algos import ALGORITHMS
    from rltune.learner.microbatch import split_by_tokens
    from rltune.learner.objectives import build_objective, logprob_forward

    tiny_dir = resolve_model(model)
    torch.manual_seed(0)
    full = load_model(tiny_dir)
    batch = make_batch(full)
    micro = sorted(split_by_tokens(batch, BUDGET), key=lambda m: m.input_ids.numel())
    small, big = micro[0], micro[-1]
    objective = build_objective(ALGORITHMS["grpo"], algo_config())
    denominator = objective.denominator(batch)
    want = logprob_forward(full, small, temperature=0.7, router_logits=False)
    objective.loss(want, small, denominator)[0].backward()
    stages = [split_model(load_model(tiny_dir), i, pp) for i in range(pp)]
    set_logprob_chunk_tokens(stages[-1].model, chunk)
    got = chain(stages, small, big, "logprobs")
    objective.loss(got, small, denominator)[0].backward()
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=0, atol=1e-5)
    grads = stage_grads(stages)
    assert grads.keys() == {n for n, _ in full.named_parameters()}
    for name, p in full.named_parameters():
        if p.grad is None:  # an expert no token of this micro-batch routed to
            assert grads[name] is None or not grads[name].any(), name
            continue
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_critic_stages_equal_the_critic(tiny_dir: str) -> None:
    """A critic (body + value head) split in two gives the critic's values."""
    from rltune.learner.microbatch import split_by_tokens
    from rltune.models.value import ValueModel, value_forward

    def critic() -> ValueModel:
        torch.manual_seed(1)
        model = ValueModel(load_model(tiny_dir).model, 128)
        torch.nn.init.normal_(model.head.weight)
        return model

    batch = make_batch(load_model(tiny_dir))
    micro = sorted(split_by_tokens(batch, BUDGET), key=lambda m: m.input_ids.numel())
    want = value_forward(critic(), micro[0], temperature=1.0, router_logits=False).values
    got = chain([split_model(critic(), i, 2) for i in range(2)], micro[0], micro[-1], "values").values
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)



# ----------------------------------------------------------------------------- every objective


def objective_learner(model_dir: str, name: str, parallelism):
    """A learner for objective ``name`` (``sft``, ``dpo``: pairs, unit 2, or ``critic``:
    a value model) with the harness's lr, clip, budget and Adam eps, and its batch."""
    from layout_workers import build_learner
    from learner_group_workers import ADAM_EPS, GRAD_CLIP, LR

    from rltune.config.schema import AlgoConfig, TrainConfig
    from rltune.learner.learner import LocalLearner
    from rltune.learner.objectives import value_objective
    from rltune.learner.preference import dpo_objective
    from rltune.models.value import ValueModel

    batch = global_batch(model_dir, 0)
    g = torch.Generator().manual_seed(1)
    if name == "sft":
        return build_learner(load_model(model_dir), parallelism, "sft"), batch
    if name == "whole":  # GRPO, the batch in one micro-batch: fewer than 1F1B's one per stage
        learner = build_learner(load_model(model_dir), parallelism)
        learner.cfg = learner.cfg.model_copy(update={"micro_batch_tokens": 100_000})
        return learner, batch
    if name == "rm":  # a reward model: the score head on the last stage
        from rltune.learner.preference import reward_model_objective
        from rltune.models.reward_model import load_reward_model

        objective, model = reward_model_objective(AlgoConfig(name="reward_model")), load_reward_model(model_dir, seed=0)
    elif name == "dpo":
        objective, model = dpo_objective(AlgoConfig(name="dpo")), load_model(model_dir)
        batch.ref_seq_logps = (batch.old_logprobs * batch.loss_mask).sum(-1) + torch.randn(len(batch), generator=g)
    else:
        objective, model = value_objective(AlgoConfig(name="ppo")), ValueModel(load_model(model_dir).model, 128)
        batch.returns = torch.randn(batch.loss_mask.shape, generator=g) * batch.loss_mask
        batch.values = 0.1 * torch.randn(batch.loss_mask.shape, generator=g) * batch.loss_mask
    cfg = TrainConfig(lr=LR, grad_clip=GRAD_CLIP, micro_batch_tokens=BUDGET)
    learner = LocalLearner(model, objective, cfg, parallelism=parallelism)
    for group in learner.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    return learner, batch


def objective_runs(model_path: str, names: list[str]) -> list[dict]:
    """One rank of a pp=2 (1F1B) group: two steps of each objective of ``names``."""
    torch.set_num_threads(1)
    out = []
    for name in names:
        learner, batch = objective_learner(resolve_model(model_path), name, MeshParallelism(Layout(pp=2)))
        out.append(run_steps(learner, batch, 2))
        if name == "whole":  # and a prediction in one chunk
            out[-1]["logprobs"] = learner.logprobs(batch)
        if name == "rm":  # and each row's score, as a preference run's evaluation asks
            out[-1]["scores"] = learner_pair_outputs(learner, batch, "scores", False)
    return out


@pytest.mark.slow
def test_pp2_every_objective_equals_one_process(tiny_dir: str) -> None:
    """SFT, DPO (pairs: unit 2, the pair-count denominator) and PPO's critic (the value
    head on the last stage) through the 1F1B schedule equal one process; so does GRPO
    with the whole batch in one micro-batch (1F1B runs a padding one for the second
    stage), and a reward model's training and its scores predicted through the stages
    (one number a row, 1e-5 as the log-probs)."""
    names = ["sft", "dpo", "critic", "whole", "rm"]
    ranks = spawn_learner_group(2, objective_runs, tiny_dir, names, backend="gloo", timeout_s=400)
    torch.set_num_threads(1)
    for k, name in enumerate(names):
        learner, batch = objective_learner(tiny_dir, name, NoParallelism())
        ref = run_steps(learner, batch, 2)
        if name == "whole":
            ref["logprobs"] = learner.logprobs(batch)
        if name == "rm":
            ref["scores"] = learner_pair_outputs(learner, batch, "scores", False)
        for rank in ranks:
            assert_equal_to_reference(rank[k], ref, logprob_rows=slice(None) if name == "whole" else None)
            if name == "rm":
                assert rank[k]["scores"].shape == (len(batch),)
                torch.testing.assert_close(rank[k]["scores"], ref["scores"], rtol=0, atol=1e-5)


def test_moe_balancing_that_needs_the_whole_load_is_refused() -> None:
    """pp > 1 does not gather the expert load or the router logits across stages: the
    aux-free bias and the load-balancing loss are refused by name, not skipped."""
    from types import SimpleNamespace

    from rltune.models.routing import install_routing
    from rltune.parallel.pipeline import Pipeline, build_pipeline

    model = load_model(resolve_model("builtin:tiny-moe"))
    install_routing(model, aux_free_bias=0.01)
    with pytest.raises(ValueError, match="aux_free_bias"):
        build_pipeline(model, mesh=None, schedule="1f1b", device=torch.device("cpu"))
    pipeline = SimpleNamespace()  # the refusal comes before anything of the pipeline is used
    with pytest.raises(ValueError, match="model.router_aux_loss_coef: 0"):
        Pipeline.train(pipeline, [], 1, None, None, temperature=1.0, autocast=None, aux_loss_coef=0.001)
