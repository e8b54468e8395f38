"""Metrics combined across the processes of a torch.distributed group (gloo, CPU): two
real processes, each with its own micro-batch results, agree on the hand-worked totals."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER = r'''
import json, sys
import torch.distributed as dist
from rltune.metrics.types import Aggregator, Histogram, Last, Max, Min, Sum, all_reduce, scalars, histograms

rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
mine = [
    {"loss": 1.0, "ratio_max": Max(1.25), "tokens": Sum(4), "low": Min(0.5), "lr": Last(0.1),
     "length": Histogram([3, 5])},
    {"loss": 4.0, "ratio_max": Max(2.0), "tokens": Sum(6), "low": Min(-0.5), "lr": Last(0.2),
     "length": Histogram([7])},
][rank]
weight = [2.0, 6.0][rank]
got = all_reduce(Aggregator().add(mine, weight=weight).result())
json.dump({"scalars": scalars(got), "histograms": histograms(got)}, open(out, "w"))
dist.destroy_process_group()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_agree_on_the_combined_metrics(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = str(_free_port())
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, str(outs[r])], env=env)
             for r in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    results = [json.loads(o.read_text()) for o in outs]
    assert results[0] == results[1]
    # loss: (1*2 + 4*6) / 8 = 3.25; lr: the highest rank's
    assert results[0]["scalars"] == {"loss": 3.25, "ratio_max": 2.0, "tokens": 10.0,
                                     "low": -0.5, "lr": 0.2}
    assert results[0]["histograms"] == {"length": [3.0, 5.0, 7.0]}
