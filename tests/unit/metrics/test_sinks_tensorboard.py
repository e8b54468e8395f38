"""TensorBoardSink: event files written through the real writer and read back with
TensorBoard's own EventAccumulator."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rltune.metrics.sinks import Sink, TensorBoardSink, config_yaml, finite_scalars

NAN, INF = float("nan"), float("inf")


def read_events(log_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    events.Reload()
    return events


def scalar_points(events: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_scalars_histograms_and_config_are_read_back(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    assert isinstance(sink, Sink)
    sink.log(1, {"reward/mean": 0.5, "loss": NAN, "kl": INF, "entropy": None, "lr": 1},
             {"length": [1.0, 2.0, 2.0, 3.0, NAN, -INF], "empty": [NAN]})
    sink.log(2, {"reward/mean": 0.75, "loss": -0.25})
    sink.log_config({"name": "t", "algo": {"name": "grpo", "clip": 0.2}, "train": {"betas": [0.9, 0.999]}})
    sink.close()
    sink.close()  # harmless

    events = read_events(tmp_path / "tb")
    tags = events.Tags()
    assert sorted(tags["scalars"]) == ["loss", "lr", "reward/mean"]
    assert tags["histograms"] == ["length"]
    assert scalar_points(events, "reward/mean") == [(1, 0.5), (2, 0.75)]
    assert scalar_points(events, "loss") == [(2, -0.25)]
    assert scalar_points(events, "lr") == [(1, 1.0)]

    [hist] = events.Histograms("length")
    assert hist.step == 1
    h = hist.histogram_value
    assert (h.num, h.min, h.max, h.sum, h.sum_squares) == (4.0, 1.0, 3.0, 8.0, 18.0)

    [text] = events.Tensors("config/text_summary")
    assert text.step == 0
    assert text.tensor_proto.string_val == [
        b"```yaml\nname: t\nalgo:\n  name: grpo\n  clip: 0.2\ntrain:\n  betas:\n  - 0.9\n  - 0.999\n```"
    ]


def test_resume_purges_the_steps_after_the_checkpoint(tmp_path):
    first = TensorBoardSink(tmp_path)
    for step in (1, 2, 3, 4):
        first.log(step, {"loss": float(step)})
    first.close()

    resumed = TensorBoardSink(tmp_path, resume_after_step=2)
    resumed.log(3, {"loss": 30.0})
    resumed.log_config({"name": "again"})
    resumed.close()

    events = read_events(tmp_path)
    assert scalar_points(events, "loss") == [(1, 1.0), (2, 2.0), (3, 30.0)]
    [text] = events.Tensors("config/text_summary")
    assert (text.step, text.tensor_proto.string_val) == (2, [b"```yaml\nname: again\n```"])


def test_bad_input_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"TensorBoardSink: resume_after_step must be a step >= 0 or None, got -1"):
        TensorBoardSink(tmp_path, resume_after_step=-1)
    sink = TensorBoardSink(tmp_path)
    with pytest.raises(TypeError, match=r"metric 'length': a scalar must be a real number or None, got list"):
        sink.log(1, {"length": [1.0, 2.0]})
    sink.close()


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install 'rltune\[tensorboard\]'"):
        TensorBoardSink(tmp_path)


def test_finite_scalars_and_config_yaml():
    assert finite_scalars({"a": 1, "b": 0.5, "c": NAN, "d": -INF, "e": None}) == {"a": 1.0, "b": 0.5}
    with pytest.raises(TypeError, match=r"metric 'f': a scalar must be a real number or None, got bool"):
        finite_scalars({"f": True})
    assert config_yaml({"p": Path("/x/y"), "t": (1, 2), "n": None}) == "p: /x/y\nt:\n- 1\n- 2\nn: null\n"
