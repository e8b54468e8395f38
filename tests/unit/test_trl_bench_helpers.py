"""The shared helpers of the benchmarks against TRL: the held-out pair judge, the config
overrides and the per-child peak RSS (the figures the benchmarks print rest on them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import trl_common as common  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rltune.models.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("m"), hidden_size=32, layers=1, heads=2, kv_heads=1)


def test_response_logps_of_a_padded_batch_equal_each_sequence_alone(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    seqs = [([10, 11, 12], [20, 3]), ([10], [21, 22, 23, 3]), ([13, 14, 15, 16, 17], [3])]
    batched = common._response_logps(model, seqs, pad=0)
    for i, (p, r) in enumerate(seqs):
        ids = torch.tensor([p + r])
        with torch.no_grad():
            logps = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
        alone = sum(float(logps[len(p) - 1 + j, t]) for j, t in enumerate(r))
        # fp32 sums of at most 4 log-probs near -5.6 each; padding only changes the
        # reduction order inside attention (~1e-6 relative), so 1e-4 is ample yet far
        # below the ~1 gap a misplaced token or a padded position would cause.
        assert abs(float(batched[i]) - alone) < 1e-4, (i, float(batched[i]), alone)


def test_pair_accuracy_of_the_reference_itself_is_zero(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    pairs = [{"prompt": "1+2=", "chosen": "3", "rejected": "4"},
             {"prompt": "20+22=", "chosen": "42", "rejected": "24"}]
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    # the margin is exactly 0 for every pair (same weights, same inputs), never > 0
    assert common.pair_accuracy(policy, model_dir, pairs) == 0.0


def test_parse_sets_reads_json_values_and_names_a_bad_item() -> None:
    assert common.parse_sets(["bf16=true", "max_steps=3", "optim=adamw_torch"]) == {
        "bf16": True, "max_steps": 3, "optim": "adamw_torch"}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        common.parse_sets(["bf16"])


def test_run_child_reports_each_child_its_own_peak_rss() -> None:
    # from a small parent, as the benchmarks run it: this test process holds torch, and
    # Linux carries a parent's peak RSS over fork and exec into the child's figure
    child = ("import json, sys; b = bytearray(int(sys.argv[1]) * 2**20); "
             "b[::4096] = b'x' * len(b[::4096]); print(json.dumps({'rate': 1.0}))")
    parent = (
        f"import sys, json; sys.path.insert(0, {str(Path(common.__file__).parent)!r}); "
        "import trl_common as c; env = c.child_env(None); "
        f"run = lambda n: c.run_child([sys.executable, '-c', {child!r}, str(n)], env, str(n)); "
        "print(json.dumps([run(300)['peak_rss_mb'], run(1)['peak_rss_mb']]))"
    )
    done = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, check=True)
    big, small = json.loads(done.stdout.splitlines()[-1])
    # the 300 MiB buffer is touched page by page, so it is resident; an interpreter alone
    # stays far below 100 MB
    assert big > 300 and small < 100, (big, small)


def test_the_async_row_runs_right_after_rltune() -> None:
    import grpo_vs_trl

    assert grpo_vs_trl.sides_of(False) == ["trl", "rltune", "trl-plain"]
    assert grpo_vs_trl.sides_of(True) == ["trl", "rltune", "rltune-async", "trl-plain"]
    assert grpo_vs_trl.ASYNC_SETS == ("runtime.max_staleness=1", "algo.importance_correction=token-truncate")
    assert grpo_vs_trl.sides_of(True, True) == ["trl", "rltune", "rltune-compiled", "rltune-async", "trl-plain"]
    assert grpo_vs_trl.sides_of(False, True) == ["trl", "rltune", "rltune-compiled", "trl-plain"]
    assert grpo_vs_trl.EXTRA_SETS["rltune-compiled"] == ("rollout.compile=true",)


def test_the_report_prints_the_async_ratio_apart_from_the_synchronous_one(capsys) -> None:
    def runs(*rates: float, quality: float) -> list[dict]:
        return [{"rate": r, "quality": quality, "peak_rss_mb": 500.0} for r in rates]

    results = {"trl": runs(9.0, 10.0, 11.0, quality=0.5), "rltune": runs(15.0, 14.0, 16.0, quality=0.4),
               "rltune-async": runs(20.0, 19.0, 25.0, quality=0.45)}
    common.report(results, unit="completions/s", quality="reward", target=2.0)
    out = capsys.readouterr().out
    # medians: trl 10, rltune 15, rltune-async 20 -> 15 / 10 = 1.50x, 20 / 10 = 2.00x
    assert "rltune / TRL speed: 1.50x (target 2.0x: NOT met)" in out
    assert "rltune-async / TRL speed: 2.00x, reward 0.450 (generation one step ahead" in out
    assert "the synchronous, same-algorithm ratio is rltune's above" in out


def test_the_compiled_row_counts_towards_the_target(capsys) -> None:
    """rltune-compiled runs the same synchronous algorithm, so its ratio is judged against
    the target like rltune's, not set apart like the async row's."""
    results = {"trl": [{"rate": r, "quality": 0.5, "peak_rss_mb": 500.0} for r in (9.0, 10.0, 11.0)],
               "rltune-compiled": [{"rate": r, "quality": 0.5, "peak_rss_mb": 500.0} for r in (21.0, 20.0, 19.0)]}
    common.report(results, unit="completions/s", quality="reward", target=2.0)
    out = capsys.readouterr().out
    # medians: trl 10, rltune-compiled 20 -> 2.00x, which meets a 2.0x target
    assert ("rltune-compiled / TRL speed: 2.00x (target 2.0x: met) (rollout.compile=true: "
            "the decode step compiled; the same algorithm)") in out
    assert ("reward after the same samples: rltune-compiled 0.500, TRL 0.500 (medians); difference of the "
            "means +0.000, standard error 0.000 (rltune-compiled at least equal: yes)") in out
    assert "the same algorithm" in out and "ratio is rltune's above" not in out


def test_learning_is_judged_by_the_difference_of_the_means_against_its_standard_error() -> None:
    # means 0.40 and 0.50: difference -0.10; sample variances 0.01 (0.3, 0.4, 0.5) and
    # 0.0025 (0.45, 0.5, 0.55), so se = sqrt(0.01 / 3 + 0.0025 / 3) = sqrt(0.0125 / 3) = 0.0645
    # and -0.10 >= -2 se = -0.129: equal within the rounds' spread
    equal, text = common.learned_as_much([0.3, 0.4, 0.5], [0.45, 0.5, 0.55])
    assert equal and text == "difference of the means -0.100, standard error 0.065"
    # the same difference with a tenth of the spread (se 0.00645): below by 15 se
    equal, text = common.learned_as_much([0.39, 0.40, 0.41], [0.495, 0.5, 0.505])
    assert not equal and text == "difference of the means -0.100, standard error 0.006"
    # a side ahead is equal whatever the spread; one round each is compared as it is
    assert common.learned_as_much([0.6, 0.7, 0.8], [0.5, 0.5, 0.5])[0]
    assert common.learned_as_much([0.5], [0.5]) == (True, "difference +0.000 (one round: no spread)")
    assert not common.learned_as_much([0.49], [0.5])[0]


def test_an_extra_side_without_a_note_is_an_error() -> None:
    with pytest.raises(KeyError, match="rltune-other"):
        common.side_note("rltune-other")
