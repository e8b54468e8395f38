"""A run's episode generator holds an environment's first observation to the limits of a
dataset prompt: ``data.max_prompt_tokens`` and the model's positions."""

from __future__ import annotations

import json

import torch

from rltune.config import load_config
from rltune.envs.episodes import EpisodeGenerator
from rltune.models.load import load_model, load_tokenizer, resolve_model
from rltune.runtime.roles import make_generator, model_positions


class _Env:
    def reset(self, prompt):
        return None

    def step(self, action):
        return "", 0.0, True


def test_the_generator_of_a_run_with_an_environment_gets_the_prompt_limits() -> None:
    model_dir = resolve_model("builtin:tiny")
    cfg = load_config(None, ["reward.0.fn=m:f", "env.name=m:make", "data.max_prompt_tokens=40"])
    runner = make_generator(cfg, model_dir, load_model(model_dir), load_tokenizer(model_dir),
                            torch.Generator().manual_seed(0), _Env)
    assert isinstance(runner, EpisodeGenerator)
    assert runner.max_prompt_tokens == 40
    with open(f"{model_dir}/config.json", encoding="utf-8") as f:
        limit = json.load(f)["max_position_embeddings"]
    assert runner.max_positions == limit == model_positions(model_dir)


def test_model_positions_is_none_where_the_config_does_not_bound_them(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 64, "rope_scaling": {"type": "yarn"}}))
    assert model_positions(str(tmp_path)) is None
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 96}}))
    assert model_positions(str(tmp_path)) == 96
    assert model_positions(str(tmp_path / "absent")) is None
