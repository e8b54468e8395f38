"""What a run's model and data must agree on, refused when the run is built: the
tokenizer's ids fit the model's embedding (and a PPO critic's, whose tokenizer must be
the policy's), and every sequence the run generates or trains on fits the model's
positions (training and eval prompts with their new tokens, SFT rows, preference pairs)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rltune.config import ConfigError, load_config
from rltune.models.load import ModelLoadError
from rltune.runtime.local import build_run

REWARD = "reward=[{fn: builtin:exact_numeric}]"


@pytest.fixture(autouse=True)
def keep_threads() -> Iterator[None]:
    """``build_run`` sets torch's thread count for the process; put it back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _build(tmp_path: Path, model: str, *overrides: str):
    cfg = load_config(None, [f"model.path={model}", f"log.dir={tmp_path / 'runs'}", "train.threads=1",
                             "data.train=builtin:arith_small/train", REWARD, *overrides])
    run = build_run(cfg)
    if run.scorer is not None:
        run.scorer.close()
    return run


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _resized(src: str, dst: Path, rows: int) -> Path:
    """A copy of the model in ``src`` with ``rows`` embedding rows and ``src``'s tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(src)
    model.resize_token_embeddings(rows)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def _with_extra_token(src: str, dst: Path) -> Path:
    """A copy of ``src`` whose tokenizer has one more id than the model has rows."""
    _copy(src, dst)
    tokenizer = AutoTokenizer.from_pretrained(dst)
    tokenizer.add_tokens(["<extra_token>"])
    tokenizer.save_pretrained(dst)
    return dst


def _rows(model_dir: str | Path) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


# -- the tokenizer and the model's embedding


def test_a_tokenizer_with_more_ids_than_the_embedding_has_rows_is_refused(tmp_path, tiny_path) -> None:
    model = _with_extra_token(tiny_path, tmp_path / "model")
    rows = _rows(model)
    with pytest.raises(ModelLoadError) as err:
        _build(tmp_path, str(model))
    message = str(err.value)
    assert message.startswith(f"model.path: the tokenizer in {model} has {rows + 1} token ids but the model's "
                              f"embedding has {rows} rows (vocab_size in {model / 'config.json'})")
    assert "\n" not in message


def test_an_embedding_padded_past_the_tokenizer_is_accepted(tmp_path, tiny_path) -> None:
    model = _resized(tiny_path, tmp_path / "model", _rows(tiny_path) + 40)  # as Qwen pads its vocabulary
    assert _build(tmp_path, str(model)).train_prompts


# -- PPO's critic


def test_a_critic_with_fewer_rows_than_the_policy_tokenizer_is_refused(tmp_path, tiny_path) -> None:
    critic = _resized(tiny_path, tmp_path / "critic", 100)
    with pytest.raises(ModelLoadError) as err:
        _build(tmp_path, tiny_path, "algo.name=ppo", f"model.critic_path={critic}")
    message = str(err.value)
    assert message.startswith(f"model.critic_path: the critic's embedding has 100 rows (vocab_size in "
                              f"{critic / 'config.json'}) but the policy's tokenizer (model.path: {tiny_path}) "
                              f"has {_rows(tiny_path)} ids")


def test_a_critic_with_another_tokenizer_of_the_same_size_is_refused(tmp_path, tiny_path) -> None:
    critic = _copy(tiny_path, tmp_path / "critic")
    spec = json.loads((critic / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # same tokens, two of them swapped
    (critic / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ModelLoadError) as err:
        _build(tmp_path, tiny_path, "algo.name=ppo", f"model.critic_path={critic}")
    message = str(err.value)
    assert message.startswith(f"model.critic_path: the tokenizer in {critic} differs from the policy's "
                              f"(model.path: {tiny_path}): token 'a' is id {vocab['a']} in the critic's and "
                              f"{vocab['b']} in the policy's")


def test_a_critic_whose_tokenizer_adds_a_token_is_accepted(tmp_path, tiny_path) -> None:
    """Every policy id means the same token to it (a reward model that added a [PAD])."""
    critic = _with_extra_token(tiny_path, tmp_path / "critic")
    critic = _resized(critic, tmp_path / "critic-rows", _rows(tiny_path) + 1)
    assert _build(tmp_path, tiny_path, "algo.name=ppo", f"model.critic_path={critic}").roles.critic is not None


def test_a_critic_without_a_tokenizer_of_its_own_is_accepted(tmp_path, tiny_path) -> None:
    critic = _copy(tiny_path, tmp_path / "critic")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (critic / name).unlink(missing_ok=True)
    assert _build(tmp_path, tiny_path, "algo.name=ppo", f"model.critic_path={critic}").roles.critic is not None


def test_a_builtin_critic_path_is_built_like_a_builtin_model_path(tmp_path, tiny_path) -> None:
    run = _build(tmp_path, tiny_path, "algo.name=ppo", "model.critic_path=builtin:tiny")
    assert run.roles.critic is not None


def test_an_unknown_builtin_critic_path_names_its_own_key(tmp_path, tiny_path) -> None:
    with pytest.raises(ModelLoadError, match=r"^model.critic_path: unknown builtin model 'builtin:nope'; set "
                                             r"`model.critic_path` to one of builtin:tiny"):
        _build(tmp_path, tiny_path, "algo.name=ppo", "model.critic_path=builtin:nope")


# -- the model's positions


def _positions(model_dir: str) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"]


def test_eval_prompts_and_the_eval_new_tokens_must_fit_the_positions(tmp_path, tiny_path) -> None:
    limit = _positions(tiny_path)
    with pytest.raises(ConfigError) as err:
        _build(tmp_path, tiny_path, "data.eval=builtin:arith/eval", f"eval.max_new_tokens={limit}")
    message = str(err.value)
    assert message.startswith(f"eval.max_new_tokens={limit} after eval prompts (data.eval=builtin:arith/eval) of up "
                              f"to ")
    assert message.endswith(f"but the model has {limit} (max_position_embeddings in "
                            f"{Path(tiny_path) / 'config.json'}); lower eval.max_new_tokens or data.max_prompt_tokens")


def test_sft_eval_without_its_own_new_tokens_uses_the_rollout_s(tmp_path, tiny_path) -> None:
    limit = _positions(tiny_path)
    with pytest.raises(ConfigError, match=rf"^eval.max_new_tokens \(unset: rollout.max_new_tokens={limit}\) after "
                                          rf"eval prompts \(data.eval=builtin:arith/eval\)"):
        _build(tmp_path, tiny_path, "algo.name=sft", "data.train=builtin:arith_small/train",
               "data.eval=builtin:arith/eval", f"rollout.max_new_tokens={limit}")


def _long_rows(path: Path, limit: int, **fields: str) -> Path:
    long = " ".join(["7"] * limit)
    rows = [{"prompt": "1+1=", **{k: (long if v == "long" else v) for k, v in fields.items()}},
            {"prompt": "2+2=", **{k: ("4" if v == "long" else v) for k, v in fields.items()}}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_sft_rows_longer_than_the_positions_are_refused(tmp_path, tiny_path) -> None:
    data = _long_rows(tmp_path / "sft.jsonl", _positions(tiny_path), completion="long")
    with pytest.raises(ConfigError) as err:
        _build(tmp_path, tiny_path, "algo.name=sft", f"data.train={data}", "reward=[]")
    message = str(err.value)
    assert message.startswith(f"data.train={data}: 1 row(s) are longer than the model's {_positions(tiny_path)} "
                              f"positions (max_position_embeddings in {Path(tiny_path) / 'config.json'}); the longest, "
                              f"sft.jsonl:1, has ")
    assert " completion tokens = " in message


def test_preference_pairs_longer_than_the_positions_are_refused(tmp_path, tiny_path) -> None:
    data = _long_rows(tmp_path / "pairs.jsonl", _positions(tiny_path), chosen="2", rejected="long")
    with pytest.raises(ConfigError) as err:
        _build(tmp_path, tiny_path, "algo.name=dpo", f"data.train={data}", "reward=[]")
    assert str(err.value).startswith(f"data.train={data}: 1 row(s) are longer than the model's "
                                     f"{_positions(tiny_path)} positions")
    assert " longer response tokens = " in str(err.value)
    # refused as the pairs load: no reference log-probs were computed and written
    assert not list((tmp_path / "runs").rglob("*.safetensors"))


def test_a_prompt_and_an_environments_first_turn_must_fit_the_positions(tmp_path, tiny_path) -> None:
    limit = _positions(tiny_path)
    env = ("env={name: 'builtin:tools', kwargs: {tools: [calculator]}}", "algo.group_size=2")
    # the first turn is the smaller of rollout.max_new_tokens and env.max_total_tokens
    with pytest.raises(ConfigError, match=rf"^env.max_total_tokens={limit - 1} \(the first turn's budget\) after "
                                          rf"prompts of up to \d+ tokens needs \d+ positions, but the model has {limit}"):
        _build(tmp_path, tiny_path, *env, f"rollout.max_new_tokens={limit}", f"env.max_total_tokens={limit - 1}")
    with pytest.raises(ConfigError, match=rf"^rollout.max_new_tokens={limit - 1} after prompts"):
        _build(tmp_path, tiny_path, *env, f"rollout.max_new_tokens={limit - 1}", f"env.max_total_tokens={limit}")
    # a budget past the positions is accepted: the turns after the first end at them as played
    run = _build(tmp_path, tiny_path, *env, "rollout.max_new_tokens=16", f"env.max_total_tokens={2 * limit}",
                 "name=ok")
    assert run.roles.generator.max_positions == limit
