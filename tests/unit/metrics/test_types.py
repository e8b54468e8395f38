"""Typed metrics and their one aggregator, against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rltune.metrics.types import (
    Aggregator,
    Histogram,
    Last,
    Max,
    Mean,
    Min,
    Sum,
    as_metric,
    histograms,
    reduce,
    scalars,
)


def test_each_kind_reduces_its_own_way() -> None:
    agg = Aggregator()
    agg.add({"loss": 2.0, "ratio_max": Max(1.5), "tokens": Sum(10), "low": Min(0.3),
             "lr": Last(1e-3), "length": Histogram([4, 6])}, weight=3)
    agg.add({"loss": 6.0, "ratio_max": Max(1.2), "tokens": Sum(5), "low": Min(0.1),
             "lr": Last(5e-4), "length": Histogram([8])}, weight=1)
    got = agg.result()
    # (2*3 + 6*1) / 4 = 3.0
    assert got == {"loss": Mean(3.0, 4.0), "ratio_max": Max(1.5), "tokens": Sum(15.0),
                   "low": Min(0.1), "lr": Last(5e-4), "length": Histogram([4.0, 6.0, 8.0])}
    assert scalars(got) == {"loss": 3.0, "ratio_max": 1.5, "tokens": 15.0, "low": 0.1, "lr": 5e-4}
    assert histograms(got) == {"length": [4.0, 6.0, 8.0]}


def test_an_explicit_mean_keeps_its_weight_and_tensors_stay_tensors_until_the_end() -> None:
    agg = Aggregator()
    agg.add({"kl": Mean(torch.tensor(1.0), weight=torch.tensor(1.0)), "ent": torch.tensor(4.0)},
            weight=torch.tensor(9.0))
    agg.add({"kl": Mean(torch.tensor(4.0), weight=torch.tensor(3.0)), "ent": torch.tensor(0.0)},
            weight=torch.tensor(1.0))
    assert isinstance(agg._acc["kl"][0], torch.Tensor)  # no .item() per micro-batch
    got = scalars(agg.result())
    assert got["kl"] == (1 * 1 + 4 * 3) / 4  # 3.25: the batch weight does not apply to a Mean
    assert got["ent"] == (4 * 9 + 0 * 1) / 10  # 3.6
    assert all(type(v) is float for v in got.values())


def test_tensor_max_min_and_histograms() -> None:
    got = reduce([{"m": Max(torch.tensor(2.0)), "n": Min(torch.tensor(-1.0)), "h": Histogram(torch.tensor([[1.0, 2.0]]))},
                  {"m": Max(torch.tensor(3.0)), "n": Min(torch.tensor(0.5)), "h": Histogram(torch.tensor([3.0]))}])
    assert got == {"m": Max(3.0), "n": Min(-1.0), "h": Histogram([1.0, 2.0, 3.0])}


def test_a_mean_with_no_weight_is_nan_not_zero() -> None:
    (value,) = scalars(Aggregator().add({"entropy": 5.0}, weight=0).result()).values()
    assert math.isnan(value)


def test_a_name_keeps_one_kind() -> None:
    agg = Aggregator().add({"x": Max(1.0)})
    with pytest.raises(TypeError, match="metric 'x' was a Max and is now a Sum"):
        agg.add({"x": Sum(1.0)})


@pytest.mark.parametrize("bad", ["0.5", [1.0, 2.0], torch.tensor([1.0, 2.0]), None, True])
def test_only_numbers_are_metrics(bad) -> None:
    with pytest.raises(TypeError, match="a metric is a number"):
        as_metric(bad)
