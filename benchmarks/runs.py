"""What the CPU benchmarks share: the digit-share reward and ``rltune train`` run in a
process of its own, as a user would run it, read back from its ``metrics.jsonl``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REWARD = '''
def digit_share(prompt, completion, **meta):
    return sum(ch.isdigit() for ch in completion) / max(1, len(completion))
'''


def train_rows(root: Path, overrides: list[str], *, what: str, python: str = sys.executable) -> list[dict]:
    """Train ``overrides`` (plus the digit-share reward and a quiet log) in ``root`` with
    ``python``; every step's metrics. Exits with the run's error output when it fails."""
    (root / "r.py").write_text(REWARD)
    (root / "c.yaml").write_text("name: bench\n")
    args = [*overrides, f"reward.0.fn={root / 'r.py'}:digit_share", f"log.dir={root / 'runs'}",
            "log.console=false", "checkpoint.final=false"]
    done = subprocess.run([python, "-m", "rltune.cli", "train", str(root / "c.yaml"), *args],
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"the run with {what} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (root / "runs" / "bench" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "time/step" in r]
