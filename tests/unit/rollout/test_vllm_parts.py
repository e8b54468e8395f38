"""The parts of the vLLM generator that need no engine: what sampling it refuses and why,
how the sampled tokens' log-probs are read out of vLLM's per-position dicts, the engine
arguments a config gives, and the errors a config gets where vLLM is missing. The engine
itself is tested by ``make test-vllm`` (tests/distributed/test_generator_contract.py,
tests/e2e/test_e2e_vllm.py, tests/distributed/test_ray_vllm.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from rltune.config import ConfigError, load_config
from rltune.config.schema import VLLMConfig
from rltune.data.records import SamplingParams
from rltune.rollout.vllm import VLLMGenerator, VLLMUnavailable, check_sampling, engine_args, sampled_logprobs, vllm_missing


@dataclass
class Logprob:  # the one field rltune reads of vllm.logprobs.Logprob
    logprob: float


def test_the_sampled_tokens_logprobs_are_read_position_by_position() -> None:
    # logprobs=0 gives the sampled token's entry; vLLM may add others (e.g. the top-1)
    positions = [{5: Logprob(-0.25)}, {7: Logprob(-1.5), 2: Logprob(-0.1)}, {2: Logprob(-3.0)}]
    got = sampled_logprobs([5, 7, 2], positions)
    assert got.dtype == torch.float32
    assert got.tolist() == [-0.25, -1.5, -3.0]


def test_missing_or_short_logprobs_are_an_error() -> None:
    with pytest.raises(RuntimeError, match="returned none log-probs for 2 tokens"):
        sampled_logprobs([1, 2], None)
    with pytest.raises(RuntimeError, match="returned 1 log-probs for 2 tokens"):
        sampled_logprobs([1, 2], [{1: Logprob(0.0)}])


@pytest.mark.parametrize("params", [SamplingParams(top_k=20), SamplingParams(top_p=0.9)])
def test_filtered_sampling_is_refused(params: SamplingParams) -> None:
    with pytest.raises(ValueError, match="top_k=0 and top_p=1 only"):
        check_sampling(params)


def test_greedy_and_unfiltered_sampling_are_accepted() -> None:
    check_sampling(SamplingParams(temperature=0.0, top_p=0.5))  # greedy: nothing is filtered
    check_sampling(SamplingParams(temperature=0.7))


def test_engine_arguments_come_from_the_config() -> None:
    assert engine_args(VLLMConfig()) == {"gpu_memory_utilization": 0.5, "enforce_eager": False}
    cfg = VLLMConfig(max_model_len=2048, enforce_eager=True, engine_args={"swap_space": 0, "enforce_eager": False})
    assert engine_args(cfg) == {"gpu_memory_utilization": 0.5, "enforce_eager": False, "max_model_len": 2048, "swap_space": 0}


def config(*overrides: str):
    return load_config(None, ["reward.0.fn=m:f", "rollout.engine=vllm", *overrides])


def test_the_config_refuses_filtered_sampling_and_lora_with_vllm() -> None:
    with pytest.raises(ConfigError, match="rollout.engine=vllm samples with top_k: 0 and top_p: 1.0 only"):
        config("rollout.top_p=0.95")
    with pytest.raises(ConfigError, match="use rollout.engine=hf with LoRA"):
        config("model.lora.r=4")
    assert config("rollout.top_p=0.95", "rollout.engine=hf").rollout.engine == "hf"


def test_a_tensor_parallel_engine_needs_vllm_and_its_gpus_reserved() -> None:
    assert config("rollout.vllm.tensor_parallel_size=2").rollout.vllm.tensor_parallel_size == 2  # local: the process's GPUs
    ray = ["runtime.mode=ray", "rollout.vllm.tensor_parallel_size=4"]
    with pytest.raises(ConfigError, match="generator.gpus >= 4 .*generator.gpus=2"):
        config(*ray, "runtime.placement.generator.gpus=2")
    assert config(*ray, "runtime.placement.generator.gpus=4").runtime.placement.generator.gpus == 4
    with pytest.raises(ConfigError, match="needs rollout.engine=vllm"):
        config("rollout.vllm.tensor_parallel_size=2", "rollout.engine=hf")
    with pytest.raises(ConfigError, match="set by rltune"):  # not through engine_args either
        config("rollout.vllm.engine_args.tensor_parallel_size=2")


@pytest.mark.skipif(vllm_missing() is None, reason="vLLM is installed here")
def test_without_vllm_the_generator_says_how_to_get_it() -> None:
    with pytest.raises(VLLMUnavailable, match=r"rollout.engine=vllm: vLLM is not installed .*pip install 'rltune\[vllm\]'"):
        VLLMGenerator("unused", None)
    assert issubclass(VLLMUnavailable, ConfigError)  # shown as one line by the CLI


def test_the_config_refuses_engine_arguments_rltune_sets() -> None:
    with pytest.raises(ConfigError, match=r"engine_args: \['seed', 'tensor_parallel_size'\] are set by rltune"):
        config("rollout.vllm.engine_args.seed=3", "rollout.vllm.engine_args.tensor_parallel_size=2")
