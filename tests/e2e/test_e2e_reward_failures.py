"""A run whose reward function raises, hangs or returns None on some samples: the run goes
on, those samples are errors (masked, counted, shown with their message in samples.jsonl),
never zeros, and a hung call costs its timeout, not the run."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rltune.metrics.jsonl import JsonlReader
from rltune.runtime.local import build_run
from rltune.runtime.loop import train

pytestmark = pytest.mark.usefixtures("keep_torch_threads")

HANG_S = 600
"""How long a hung call sleeps: a run that waited for one, at any step, would take this
long at least. The run itself takes ~8 s here with threads, ~25 s on a machine 3x slower;
with worker processes, which restart after every killed call (a fresh interpreter each),
2-3 min on two busy cores. A hung thread sleeps on as a daemon, a hung worker is killed."""

TIMEOUT_S = 0.5
WORKERS = 4

MISBEHAVING = '''
import time

def moody(prompt, completion, **meta):
    """1 + digit share, except on a quarter of the completions each (by a checksum of
    the text): raise, hang, or return None. A hung call first notes when it started."""
    kind = sum(completion.encode()) % 4
    if kind == 0:
        raise ValueError("cannot parse " + repr(completion[:5]))
    if kind == 1:
        with open(STARTS, "a") as log:  # one short append per call: whole lines, any process
            log.write(f"{time.monotonic()}\\n")
        time.sleep(HANG_S)
    if kind == 2:
        return None
    return 1.0 + sum(ch.isdigit() for ch in completion) / max(len(completion), 1)
'''


# worker processes restart after every killed call (a fresh interpreter each): slow
@pytest.mark.parametrize("pool", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_raising_hanging_and_none_rewards_are_errors_not_zeros(tmp_path: Path, tiny_grpo_config, pool: str) -> None:
    reward_file, starts_file = tmp_path / "moody.py", tmp_path / "hung_starts.txt"
    reward_file.write_text(f"STARTS = {str(starts_file)!r}\nHANG_S = {HANG_S}\n" + MISBEHAVING)
    cfg = tiny_grpo_config(
        f"reward.0.fn={reward_file}:moody", f"reward.0.timeout_s={TIMEOUT_S}", "train.steps=3",
        "train.threads=1", f"runtime.reward_pool={pool}", f"runtime.reward_workers={WORKERS}",
    )
    run = build_run(cfg)
    start = time.perf_counter()
    try:
        history = train(run)
    finally:
        run.scorer.close()
    elapsed = time.perf_counter() - start
    rows = [row for _, row in JsonlReader(run.run_dir / "samples.jsonl")]
    assert len(rows) == 3 * 8 * 8
    errors = [r for r in rows if r["reward_error"] is not None]
    kinds = {
        "raise": [r for r in errors if "ValueError: cannot parse" in r["reward_error"]],
        "none": [r for r in errors if r["reward_error"] == "moody: returned None"],
        "hang": [r for r in errors if r["reward_error"] == "moody: timed out (call took over 0.5 s)"],
    }
    assert all(kinds.values()), {k: len(v) for k, v in kinds.items()}
    assert sum(len(v) for v in kinds.values()) == len(errors)
    for row in errors:
        assert row["reward"] is None and row["rewards"]["moody"] is None
    scored = [r for r in rows if r["reward_error"] is None]
    assert scored and all(r["reward"] >= 1.0 for r in scored)
    assert sum(m["reward/errors"] for m in history) == len(errors)
    assert sum(m["reward/timeouts"] for m in history) == len(kinds["hang"])
    # each hung call was cut at its timeout, and nothing waited for one to wake up
    assert elapsed < HANG_S, elapsed
    # The hung calls ran side by side, as many at once as there are workers. A worker
    # takes its next call only after the scorer has given up on its hung one, more than
    # TIMEOUT_S after that one began; so the hung calls of one worker start more than
    # TIMEOUT_S apart (less the moment between the scorer starting a call and the call
    # writing its line), and any TIMEOUT_S / 2 holds at most one start per worker. Calls
    # made one after another would show 1 here, not WORKERS.
    starts = sorted(float(line) for line in starts_file.read_text().split())
    assert 0 < len(starts) <= len(kinds["hang"])  # duplicate completions share one call
    at_once = max(sum(1 for t in starts[i:] if t - s < TIMEOUT_S / 2) for i, s in enumerate(starts))
    assert at_once == WORKERS, (at_once, starts)
    # the time of the hung calls is counted: at least the timeout for each
    assert sum(m["time/reward/moody"] for m in history) >= 0.5 * len(kinds["hang"])
