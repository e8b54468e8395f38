"""What an environment is built from and starts with: retrieval stores and corpora named in
a search spec (resolved from the config file's directory, never silently empty), env specs
that name the wrong thing (errors worded as env specs, with a suggestion), and a first
observation held to the limits of a dataset prompt."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from rltune.data.chat import encode_prompt
from rltune.data.records import Prompt, Rollout, SamplingParams
from rltune.envs.base import StepResult
from rltune.envs.episodes import EpisodeGenerator
from rltune.envs.loading import EnvLoadError, load_env_factory
from rltune.envs.retrieval import build_retriever
from rltune.envs.tool_format import ToolCall, format_tool_call, turn_glue
from rltune.models.tiny import build_tokenizer

HASHING = {"name": "hashing", "dim": 64}


def _corpus(path: Path, rows: int = 2) -> Path:
    path.write_text("".join(json.dumps({"id": f"d{i}", "text": f"kav number {i}"}) + "\n"
                            for i in range(rows)))
    return path


def _search(make) -> str | None:
    return make().step(format_tool_call(ToolCall("search", {"query": "kav number 1"}))).observation


def _tools(search: dict) -> dict:
    return {"tools": ["search"], "search": search}


@pytest.fixture
def elsewhere(tmp_path, monkeypatch) -> Path:
    """The config's directory, with the working directory somewhere else."""
    config_dir, cwd = tmp_path / "config", tmp_path / "cwd"
    config_dir.mkdir()
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return config_dir


# --------------------------------------------------------------------------- stores


def test_an_embedded_store_path_without_a_store_or_documents_is_refused(elsewhere):
    spec = {"kind": "embedded", "path": "store", "embedder": HASHING}
    with pytest.raises(EnvLoadError) as info:
        load_env_factory("builtin:tools", _tools(spec), base_dir=elsewhere)
    message = str(info.value)
    assert f"path 'store': there is no store at {elsewhere / 'store'} and no `documents:` are given" in message
    assert "give `documents:` (a JSONL corpus) to build it there, or the path of an existing store" in message
    assert not (elsewhere / "store").exists() and not (elsewhere.parent / "cwd" / "store").exists()
    (elsewhere / "store").mkdir()  # a directory that holds no store is no store either
    with pytest.raises(EnvLoadError, match="there is no store at"):
        load_env_factory("builtin:tools", _tools(spec), base_dir=elsewhere)


def test_an_empty_in_memory_store_is_kept_as_a_control(elsewhere):
    # no path and no documents: an empty store on purpose (a control run), not a missing one
    make = load_env_factory("builtin:tools", _tools({"kind": "embedded", "embedder": HASHING}), base_dir=elsewhere)
    assert _search(make) == "no results"


def test_a_new_store_with_documents_is_built_in_the_config_directory_and_reopened(elsewhere):
    _corpus(elsewhere / "docs.jsonl")
    spec = {"kind": "embedded", "path": "store", "embedder": HASHING, "documents": "docs.jsonl"}
    assert _search(load_env_factory("builtin:tools", _tools(spec), base_dir=elsewhere)) == "kav number 1"
    assert (elsewhere / "store" / "store.sqlite3").is_file()
    assert not (elsewhere.parent / "cwd" / "store").exists()
    # an existing store needs no documents
    reopened = {"kind": "embedded", "path": "store", "embedder": HASHING}
    assert _search(load_env_factory("builtin:tools", _tools(reopened), base_dir=elsewhere)) == "kav number 1"


def test_build_retriever_alone_still_makes_empty_stores(tmp_path):
    store = build_retriever({"kind": "embedded", "path": str(tmp_path / "new"), "embedder": HASHING})
    assert len(store) == 0


# --------------------------------------------------------------------------- corpora


def test_relative_documents_start_at_the_config_directory(elsewhere):
    _corpus(elsewhere / "docs.jsonl")
    make = load_env_factory("builtin:tools", _tools({"kind": "bm25", "documents": "docs.jsonl"}), base_dir=elsewhere)
    assert _search(make) == "kav number 1"


def test_relative_documents_in_the_working_directory_only_are_found_there(elsewhere, tmp_path, monkeypatch):
    """As reward files are found: the config's directory first, then the working directory."""
    work = tmp_path / "work"
    work.mkdir()
    _corpus(work / "docs.jsonl")
    monkeypatch.chdir(work)
    make = load_env_factory("builtin:tools", _tools({"kind": "bm25", "documents": "docs.jsonl"}), base_dir=elsewhere)
    assert _search(make) == "kav number 1"


def test_a_missing_corpus_names_the_path_looked_for(elsewhere):
    with pytest.raises(EnvLoadError) as info:
        load_env_factory("builtin:tools", _tools({"kind": "bm25", "documents": "docs.jsonl"}), base_dir=elsewhere)
    assert (f"documents 'docs.jsonl': no such corpus file {elsewhere / 'docs.jsonl'} "
            "(a relative path starts at the config file's directory, then the working directory)") in str(info.value)


def test_absolute_documents_and_builtin_corpora_are_kept(elsewhere, tmp_path):
    absolute = _corpus(tmp_path / "abs.jsonl")
    make = load_env_factory("builtin:tools", _tools({"kind": "bm25", "documents": str(absolute)}), base_dir=elsewhere)
    assert _search(make) == "kav number 1"
    make = load_env_factory("builtin:tools", _tools({"kind": "bm25", "documents": "builtin:lookup"}), base_dir=elsewhere)
    assert make().tools["search"]("zzzz") == "no results"


def test_a_factory_gets_the_config_directory_only_when_it_asks(tmp_path):
    (tmp_path / "envs.py").write_text(
        "from rltune.envs.base import StepResult\n"
        "class Env:\n"
        "    def __init__(self, base_dir=None):\n"
        "        self.base_dir = base_dir\n"
        "    def reset(self, prompt):\n"
        "        return None\n"
        "    def step(self, action):\n"
        "        return StepResult(done=True)\n"
        "class Plain(Env):\n"
        "    def __init__(self, **kwargs):\n"
        "        self.base_dir = kwargs.get('base_dir')\n"
    )
    assert load_env_factory("envs.py:Env", {}, base_dir=tmp_path)().base_dir == str(tmp_path)
    assert load_env_factory("envs.py:Env", {"base_dir": "mine"}, base_dir=tmp_path)().base_dir == "mine"
    assert load_env_factory("envs.py:Plain", {}, base_dir=tmp_path)().base_dir is None


# --------------------------------------------------------------------------- env specs


@pytest.mark.parametrize(("spec", "message"), [
    ("tools", r"^env spec 'tools': expected `module:factory` or `path/to/file.py:factory` "
              r"\(e.g. `builtin:tools` or `envs.py:MyEnv`\)$"),
    ("missing.py:Env", r"^env spec 'missing.py:Env': file not found \(looked for "),
    ("no_such_env_module:Env", r"^env spec 'no_such_env_module:Env': cannot import module 'no_such_env_module'"),
    ("broken.py:Env", r"^env spec 'broken.py:Env': running .*broken.py failed: RuntimeError: no$"),
    ("rltune.envs.tools:TooolEnv", r"^env spec 'rltune.envs.tools:TooolEnv': module 'rltune.envs.tools' has no "
                                   r"attribute 'TooolEnv'; did you mean 'ToolEnv'\? \(its functions and classes: "),
    ("envs.py:MyEnvv", r"^env spec 'envs.py:MyEnvv': file .*envs.py has no attribute 'MyEnvv'; "
                       r"did you mean 'MyEnv'\? \(its functions and classes: MyEnv, make\)$"),
])
def test_env_spec_errors_say_env_spec_and_suggest_classes(tmp_path, spec, message):
    (tmp_path / "broken.py").write_text("raise RuntimeError('no')\n")
    (tmp_path / "envs.py").write_text("from pathlib import Path\nclass MyEnv:\n    pass\ndef make():\n    pass\n")
    with pytest.raises(EnvLoadError, match=message):
        load_env_factory(spec, {}, base_dir=tmp_path)


def test_a_factory_that_makes_no_environment_is_named_with_its_article(tmp_path):
    (tmp_path / "envs.py").write_text("def plain(**kw):\n    return object()\n"
                                      "def listy(**kw):\n    return []\n")
    with pytest.raises(EnvLoadError, match=r"^env spec 'envs.py:plain' made an object, which has no reset\(prompt\)"):
        load_env_factory("envs.py:plain", {}, base_dir=tmp_path)
    with pytest.raises(EnvLoadError, match=r"^env spec 'envs.py:listy' made a list, which has no reset\(prompt\)"):
        load_env_factory("envs.py:listy", {}, base_dir=tmp_path)


# --------------------------------------------------------------------------- first observations

TOK = build_tokenizer()
EOS = TOK.eos_token_id


class Echo:
    """A generator that answers every context with "ok" and EOS, recording the contexts."""

    version = 0

    def __init__(self) -> None:
        self.contexts: list[list[int]] = []

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Rollout]:
        out = []
        for p in prompts:
            self.contexts.append(list(p.input_ids))
            ids = TOK("ok", add_special_tokens=False)["input_ids"] + [EOS]
            out.append(Rollout(
                prompt_id=p.id, group=0, prompt_ids=torch.tensor(p.input_ids), completion_ids=torch.tensor(ids),
                completion_logprobs=torch.zeros(len(ids)), loss_mask=torch.ones(len(ids)), text="ok",
                finish_reason="stop", policy_version=0,
            ))
        return out


class Wordy:
    """Shows ``prompt.meta["words"]`` words of its own as the first observation."""

    def reset(self, prompt):
        return " ".join(["word"] * prompt.meta["words"])

    def step(self, action):
        return StepResult(done=True)


def _prompt(pid: str, words: int) -> Prompt:
    p = Prompt(id=pid, text="start", meta={"words": words})
    p.input_ids = encode_prompt(TOK, p)
    return p


def _play(prompts, **limits) -> tuple[list[Rollout], Echo]:
    gen = Echo()
    runner = EpisodeGenerator(gen, TOK, Wordy, glue=turn_glue(TOK), encode=lambda p: encode_prompt(TOK, p),
                              max_turns=1, max_total_tokens=20, eos_ids=[EOS], **limits)
    return runner.generate(prompts, SamplingParams(n=1, max_new_tokens=10)), gen


def test_a_first_observation_longer_than_max_prompt_tokens_fails_its_episode_only():
    short, long = _prompt("short", 3), _prompt("long", 200)
    n_long = len(encode_prompt(TOK, Prompt(id="x", text=" ".join(["word"] * 200))))
    rollouts, gen = _play([short, long], max_prompt_tokens=100)
    ok, bad = rollouts
    assert ok.env_error is None and ok.text == "ok"
    assert bad.env_error == (f"env: reset text too long: {n_long} tokens, more than data.max_prompt_tokens=100; "
                             "shorten what reset returns or raise data.max_prompt_tokens")
    assert bad.env_reward is None and bad.completion_ids.numel() == 0
    assert bad.prompt_ids.tolist() == long.input_ids  # the dataset's prompt, as when reset raises
    assert len(gen.contexts) == 1  # never generated on


def test_a_first_observation_past_the_models_positions_fails_its_episode():
    n = len(encode_prompt(TOK, Prompt(id="x", text=" ".join(["word"] * 50))))
    rollouts, _ = _play([_prompt("a", 50)], max_prompt_tokens=512, max_positions=n + 9)
    assert rollouts[0].env_error == (
        f"env: reset text too long: {n} tokens and a first turn of up to 10 need {n + 10} positions, "
        f"more than the model's {n + 9}; shorten what reset returns or lower rollout.max_new_tokens")
    rollouts, _ = _play([_prompt("a", 50)], max_prompt_tokens=512, max_positions=n + 10)
    assert rollouts[0].env_error is None


def test_without_limits_nothing_is_checked():
    rollouts, _ = _play([_prompt("long", 200)])
    assert rollouts[0].env_error is None


def test_a_module_form_for_a_local_env_file_hints_at_the_file_form_with_a_factory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the console script runs: the working directory is not on sys.path, so
    `zz_local_envs_q:make` does not import the file next to the config."""
    (tmp_path / "zz_local_envs_q.py").write_text("def make():\n    return None\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    with pytest.raises(EnvLoadError, match=r"write it as `zz_local_envs_q\.py:FACTORY`"):
        load_env_factory("zz_local_envs_q:make", {}, base_dir=tmp_path)
