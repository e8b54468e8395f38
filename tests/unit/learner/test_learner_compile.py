"""``train.compile``: the learner's transformer blocks run their training forward through
``torch.compile``. The fast tests compile with a counting backend that runs the traced
graph as it is (what is compiled, when, how often); the slow one generates code with
inductor and compares the update with the eager one's."""

from __future__ import annotations

import copy

import pytest
import torch

import fp32_bounds as fp32
from test_learner_step import ADAM_EPS, LR, Whole, budget_for, grpo_batch

from rltune.algos import ALGORITHMS
from rltune.config.schema import AlgoConfig, LoraConfig, TrainConfig
from rltune.learner.compiled import compile_blocks, compiled_graphs, is_compiled
from rltune.learner.learner import LocalLearner
from rltune.learner.memory import apply_activation_checkpointing, is_checkpointed
from rltune.learner.objectives import build_objective
from rltune.learner.parallel import transformer_blocks
from rltune.metrics.types import scalars
from rltune.models.lora import apply_lora


class Counting:
    """A torch.compile backend that counts the graphs it is given and the calls of each,
    and runs them as traced (no code generation: fast)."""

    def __init__(self) -> None:
        self.graphs = 0
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1

        def run(*args):
            self.calls += 1
            return gm.forward(*args)

        return run


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    """Each test starts from dynamo's empty cache (a compiled code object is cached per
    process, and the counts below are per test)."""
    torch._dynamo.reset()


def grpo_learner(model: torch.nn.Module, **train) -> LocalLearner:
    objective = build_objective(ALGORITHMS["grpo"], AlgoConfig(name="grpo"))
    return LocalLearner(model, objective, TrainConfig(**{"lr": LR, "grad_clip": None, **train}))


def test_one_graph_serves_every_block_and_a_second_every_later_shape(tiny_model: torch.nn.Module) -> None:
    model = copy.deepcopy(tiny_model)
    backend = Counting()
    assert compile_blocks(model, backend=backend) == 4
    assert compile_blocks(model, backend=backend) == 4  # idempotent: nothing wrapped twice
    learner = grpo_learner(model)
    shapes = set()
    for seed in range(6):
        batch = grpo_batch(tiny_model, seed=seed)
        shapes.add(tuple(batch.input_ids.shape))
        learner.step(batch)
    assert len(shapes) >= 3  # the steps really saw different shapes
    # the first shape's graph, then one with symbolic sizes that every later shape reuses;
    # the four blocks share both (their parameters are the graphs' inputs)
    assert backend.graphs == 2
    assert backend.calls >= 6 * 4


def test_only_training_forwards_run_compiled(tiny_model: torch.nn.Module) -> None:
    """Generation, old and reference log-probs (eval mode, no grad) keep the plain forward:
    a growing KV cache would otherwise compile a graph per length."""
    model = copy.deepcopy(tiny_model)
    backend = Counting()
    compile_blocks(model, backend=backend)
    learner = grpo_learner(model)
    batch = grpo_batch(tiny_model)
    learner.logprobs(batch)
    with torch.no_grad():
        model.train()(batch.input_ids)
    assert (backend.graphs, backend.calls) == (0, 0)
    learner.step(batch)
    assert backend.calls == 4


def test_names_and_the_update_stay_those_of_the_plain_model(tiny_model: torch.nn.Module) -> None:
    """The traced graph runs the same operations: with the counting backend the step is
    the eager step to the bit, and the parameter names (checkpoints, weight export) are
    unchanged."""
    plain, compiled = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    compile_blocks(compiled, backend=Counting())
    assert all(is_compiled(b) for b in transformer_blocks(compiled))
    assert compiled.state_dict().keys() == plain.state_dict().keys()
    batch = grpo_batch(tiny_model)
    grpo_learner(plain).step(batch)
    grpo_learner(compiled).step(batch)
    for (name, p), q in zip(plain.named_parameters(), compiled.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_blocks_are_compiled_inside_their_checkpoint(tiny_model: torch.nn.Module, mode: str) -> None:
    """A checkpointed block's checkpoint runs the compiled graph, in the forward and again
    in the backward's recompute (compiling the checkpoint wrapper instead traced nothing:
    dynamo ran such blocks eagerly), and the update is the eager one to the bit."""
    plain, compiled = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    for model in (plain, compiled):
        apply_activation_checkpointing(model, mode, None)
    backend = Counting()
    compile_blocks(compiled, backend=backend)
    checkpointed = sum(is_checkpointed(b) for b in transformer_blocks(compiled))
    assert checkpointed == (4 if mode == "full" else 2)
    batch = grpo_batch(tiny_model)
    grpo_learner(plain).step(batch)
    grpo_learner(compiled).step(batch)
    assert backend.graphs >= 1
    # one micro-batch: every block's forward once, and the checkpointed ones once more
    assert backend.calls == 4 + checkpointed
    for (name, p), q in zip(plain.named_parameters(), compiled.parameters()):
        assert torch.equal(p, q), name


def test_lora_adapters_are_compiled_with_their_blocks(tiny_model: torch.nn.Module) -> None:
    model = apply_lora(copy.deepcopy(tiny_model), LoraConfig(r=4))
    backend = Counting()
    compile_blocks(model, backend=backend)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    learner = grpo_learner(model)
    learner.step(grpo_batch(tiny_model))
    assert backend.calls == 4
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert moved and all("lora_" in n for n in moved)


def test_what_cannot_be_compiled_is_refused() -> None:
    with pytest.raises(ValueError, match="names none"):
        compile_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    for layout in ({"tp": 2}, {"pp": 2}, {"ep": 2}):
        with pytest.raises(ValueError, match="train.compile compiles whole transformer blocks"):
            TrainConfig(compile=True, parallel=layout)
    assert TrainConfig(compile=True, parallel={"dp_shard": 2}).compile


# Inductor fuses the blocks' element-wise work and reduces in its own order and vector
# width (norms, softmax, the residual adds), while the matrix products stay ATen's: the
# compiled step computes the same sums in another order, with terms rounded differently
# by at most a few u each. That is what fp32_bounds.py bounds for any two fp32
# computations of the step (gradients within 4 N u A per entry, the parameters after
# AdamW's first step at eps 1e-3 within that plus the update's roundings), so the test
# uses the same tolerances as the micro-batch invariance tests.
@pytest.mark.slow
@pytest.mark.parametrize("chunks", [1, 2])
def test_an_inductor_compiled_step_is_the_eager_step(tiny_model: torch.nn.Module, chunks: int) -> None:
    batch = grpo_batch(tiny_model)
    whole = Whole(tiny_model, batch, "grpo", "token-mean", None)
    model = copy.deepcopy(tiny_model)
    learner = grpo_learner(model, compile=True, micro_batch_tokens=budget_for(batch, chunks))
    assert all(is_compiled(b) for b in transformer_blocks(model))
    for group in learner.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    grads = fp32.capture_grads(model)
    graphs = compiled_graphs()
    metrics = scalars(learner.step(batch))
    assert compiled_graphs() > graphs  # inductor really compiled
    whole.assert_same_update(model, metrics, grads)
