"""The algorithm registry and the import rule of rltune.algos."""

import ast
import dataclasses
import pathlib

import pytest

import rltune.algos as algos
from rltune.algos import ALGORITHMS, Algorithm, group_advantages, ppo_policy_loss, sft_loss
from rltune.config.schema import AlgoConfig


def test_every_algorithm_is_registered_under_its_name_and_config_sets_agree():
    from rltune.config.schema import ALGO_PRESETS, GROUP_BASELINE_ALGOS, ONLINE_ALGOS, TOKEN_REWARD_ALGOS

    for key, algo in ALGORITHMS.items():
        assert algo.name == key
    # the config's load-time checks name built-in algorithms; they must say what the registry says
    assert ONLINE_ALGOS == {k for k, a in ALGORITHMS.items() if a.online}
    assert GROUP_BASELINE_ALGOS | TOKEN_REWARD_ALGOS | set(ALGO_PRESETS) <= set(ALGORITHMS)
    assert AlgoConfig.model_fields["name"].default in ALGORITHMS


def test_grpo_and_sft_entries():
    grpo, sft = ALGORITHMS["grpo"], ALGORITHMS["sft"]
    assert (grpo.online, grpo.needs_critic) == (True, False)
    assert (grpo.advantage, grpo.loss) == (group_advantages, ppo_policy_loss)
    assert (sft.online, sft.needs_critic, sft.advantage, sft.loss) == (False, False, None, sft_loss)
    # GRPO loads a reference model only for a KL penalty
    assert not grpo.requires_reference(0.0) and grpo.requires_reference(0.05)
    assert not sft.requires_reference(0.0) and not sft.requires_reference(0.05)


def test_algorithm_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ALGORITHMS["grpo"].online = False  # type: ignore[misc]
    assert isinstance(ALGORITHMS["sft"], Algorithm)


ALLOWED_ROOTS = {"torch", "__future__", "dataclasses", "typing", "collections", "math"}


def test_algos_imports_torch_and_itself_only():
    package = pathlib.Path(algos.__file__).parent
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                ok = (module.split(".")[0] in ALLOWED_ROOTS or module.startswith("rltune.algos")
                      or module == "rltune.metrics.types")  # metrics as data: Max, Sum
                assert ok, f"{path.name}:{node.lineno} imports {module}"
