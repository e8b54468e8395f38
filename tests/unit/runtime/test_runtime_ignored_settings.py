"""Settings a run would not read are refused: an environment in a run that never
generates (before any model loads), and a router load-balancing weight on a dense model
(once the model is loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2MoeConfig

from rltune.algos import ALGORITHMS
from rltune.config import ConfigError, load_config
from rltune.config.schema import LoraConfig
from rltune.models.load import ModelLoadError
from rltune.models.lora import apply_lora
from rltune.runtime.build import setting_problems
from rltune.runtime.local import build_run
from rltune.runtime.roles import aux_loss_coef, learner_options

RECIPES = sorted((Path(__file__).resolve().parents[3] / "recipes").glob("*.yaml"))
ENV = "env.name=builtin:tools"
_SIZES = dict(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32)


@pytest.mark.parametrize(("overrides", "message"), [
    (["algo.name=dpo"], r"^env.name does not apply to algo.name=dpo \(it learns from preference pairs and never "
                        r"generates, not even to evaluate\); set env.name: null$"),
    (["algo.name=reward_model"], r"^env.name does not apply to algo.name=reward_model "),
    (["algo.name=sft"], r"^env.name does not apply to algo.name=sft without data.eval \(it learns from a fixed "
                        r"dataset and generates only to evaluate on data.eval\); set data.eval, or env.name: null$"),
])
def test_an_environment_in_a_run_that_never_generates_is_refused_before_loading(monkeypatch, overrides,
                                                                                message) -> None:
    monkeypatch.setattr("rltune.runtime.build.resolve_model", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(ConfigError, match=message):
        build_run(load_config(None, [ENV, *overrides]))


def test_an_environment_is_accepted_where_episodes_are_played() -> None:
    assert setting_problems(ALGORITHMS["grpo"], load_config(None, [ENV])) == []
    # SFT plays episodes in its held-out evaluation (recipes/lookup-sft.yaml)
    sft = load_config(None, [ENV, "algo.name=sft", "data.eval=builtin:arith/eval"])
    assert setting_problems(ALGORITHMS["sft"], sft) == []


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_no_recipe_sets_an_environment_it_would_not_use(path: Path) -> None:
    cfg = load_config(path)
    assert setting_problems(ALGORITHMS[cfg.algo.name], cfg) == []


def _dense() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen2Config(**_SIZES))


def _moe() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2MoeConfig(**_SIZES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                            shared_expert_intermediate_size=8, router_aux_loss_coef=0.02)
    return AutoModelForCausalLM.from_config(config)


def test_a_router_loss_weight_on_a_dense_model_is_refused() -> None:
    cfg = load_config(None, ["reward.0.fn=m:f", "model.router_aux_loss_coef=0.05"])
    message = (r"^model.router_aux_loss_coef: 0.05 needs a mixture-of-experts model \(it weighs the routers' "
               r"load-balancing loss\); Qwen2ForCausalLM: it has no experts \(a dense model\). Turn the option off "
               r"for this model \(router_aux_loss_coef: null\)$")
    with pytest.raises(ModelLoadError, match=message):
        learner_options(cfg, ALGORITHMS["grpo"], _dense())
    with pytest.raises(ModelLoadError, match=message):  # named by the base model under LoRA too
        aux_loss_coef(cfg, apply_lora(_dense(), LoraConfig(r=4)))


def test_a_router_loss_weight_on_a_dense_model_is_refused_before_any_role_is_built(monkeypatch, tmp_path) -> None:
    """From the model's config alone, on the driver: on Ray a learner actor refusing it as
    it loads would die and be restarted."""
    import rltune.runtime.build as build
    from rltune.runtime.local import build_run as build_local_run

    monkeypatch.setattr(build, "_build_roles", lambda *a, **k: pytest.fail("roles built"))
    cfg = load_config(None, ["reward.0.fn=builtin:exact_numeric", "model.path=builtin:tiny", "train.threads=1",
                             "data.train=builtin:arith_small/train", f"log.dir={tmp_path}", "model.router_aux_loss_coef=0.05"])
    with pytest.raises(ModelLoadError, match=r"^model.router_aux_loss_coef: 0.05 needs a mixture-of-experts model .* "
                                             r"Qwen2ForCausalLM: it has no experts"):
        build_local_run(cfg)


def test_a_router_loss_weight_off_or_on_an_moe_model_is_accepted() -> None:
    def coef(model: torch.nn.Module, *overrides: str) -> float:
        return aux_loss_coef(load_config(None, ["reward.0.fn=m:f", *overrides]), model)

    assert coef(_dense()) == 0.0
    assert coef(_dense(), "model.router_aux_loss_coef=0") == 0.0
    assert coef(_moe()) == pytest.approx(0.02)  # the model config's
    assert coef(_moe(), "model.router_aux_loss_coef=0.05") == 0.05
