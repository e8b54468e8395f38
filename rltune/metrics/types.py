"""Metrics as data: a value together with how it combines with others of its name.

Code that measures something returns it, never logs it::

    {"loss": Mean(loss, weight=tokens), "ratio_max": Max(ratio.amax()),
     "tokens": Sum(n), "lr": Last(lr), "length": Histogram(lengths)}

A plain number (or 0-d tensor) is a ``Mean`` of weight 1. One place combines them, an
:class:`Aggregator`: over the micro-batches of a step, over the updates of a step, and
across the processes of a group (:func:`all_reduce`); what comes out goes to the sinks as
scalars (:func:`scalars`) and histograms (:func:`histograms`).

Values may stay tensors while they are added up, so a step's micro-batches cost no
device synchronisation; they become floats once, in :meth:`Aggregator.result`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Union

Number = Any
"""A Python float/int or a 0-d torch tensor."""


@dataclass(frozen=True)
class Mean:
    """Weighted mean: ``sum(value * weight) / sum(weight)``."""

    value: Number
    weight: Number = 1.0


@dataclass(frozen=True)
class Sum:
    """Total over everything combined (tokens, samples, skipped steps)."""

    value: Number


@dataclass(frozen=True)
class Max:
    value: Number


@dataclass(frozen=True)
class Min:
    value: Number


@dataclass(frozen=True)
class Last:
    """The most recent value (a learning rate, a running counter)."""

    value: Number


@dataclass(frozen=True)
class Histogram:
    """A distribution: its values, combined by concatenation. ``values`` is a sequence of
    numbers or a 1-d tensor."""

    values: Any


Metric = Union[Mean, Sum, Max, Min, Last, Histogram]
MetricLike = Union[Metric, float, int, Any]
"""What measuring code may return per name: a :data:`Metric`, or a plain number (a mean)."""

_KINDS = (Mean, Sum, Max, Min, Last, Histogram)


def as_metric(value: MetricLike, *, weight: Number = 1.0) -> Metric:
    """``value`` as a typed metric; a plain number is a :class:`Mean` with ``weight``."""
    if isinstance(value, _KINDS):
        return value
    if isinstance(value, bool) or not _is_number(value):
        raise TypeError(f"a metric is a number, a 0-d tensor or one of {[k.__name__ for k in _KINDS]}; "
                        f"got {type(value).__name__}")
    return Mean(value, weight)


class Aggregator:
    """Combines metrics by name, each by its own reduction.

    ``add(metrics, weight=w)`` weighs the plain numbers of ``metrics`` by ``w`` (a
    micro-batch's token count, say); a :class:`Mean` keeps its own weight. A name must keep
    one kind: a name first added as a ``Max`` and later as a ``Sum`` is a ``TypeError``.
    """

    def __init__(self) -> None:
        self._acc: dict[str, list[Any]] = {}
        self._kind: dict[str, type] = {}

    def __len__(self) -> int:
        return len(self._acc)

    def add(self, metrics: Mapping[str, MetricLike], *, weight: Number = 1.0) -> "Aggregator":
        for name, raw in metrics.items():
            m = as_metric(raw, weight=weight)
            kind = self._kind.setdefault(name, type(m))
            if kind is not type(m):
                raise TypeError(f"metric {name!r} was a {kind.__name__} and is now a {type(m).__name__}")
            self._combine(name, m)
        return self

    def extend(self, many: Iterable[Mapping[str, MetricLike]]) -> "Aggregator":
        for metrics in many:
            self.add(metrics)
        return self

    def _combine(self, name: str, m: Metric) -> None:
        acc = self._acc.get(name)
        if isinstance(m, Mean):
            if acc is None:
                self._acc[name] = [m.value * m.weight, m.weight]
            else:
                acc[0] = acc[0] + m.value * m.weight
                acc[1] = acc[1] + m.weight
        elif isinstance(m, Histogram):
            if acc is None:
                self._acc[name] = [m.values]
            else:
                acc.append(m.values)
        elif acc is None:
            self._acc[name] = [m.value]
        elif isinstance(m, Sum):
            acc[0] = acc[0] + m.value
        elif isinstance(m, Max):
            acc[0] = _pick(acc[0], m.value, max)
        elif isinstance(m, Min):
            acc[0] = _pick(acc[0], m.value, min)
        else:  # Last
            acc[0] = m.value

    def result(self) -> dict[str, Metric]:
        """The combined metrics, values as Python floats (histograms as lists of floats).
        A mean whose weights sum to 0 is nan: nothing was measured."""
        out: dict[str, Metric] = {}
        for name, acc in self._acc.items():
            kind = self._kind[name]
            if kind is Mean:
                total, weight = _float(acc[0]), _float(acc[1])
                out[name] = Mean(total / weight if weight else math.nan, weight)
            elif kind is Histogram:
                out[name] = Histogram([float(v) for part in acc for v in _values(part)])
            else:
                out[name] = kind(_float(acc[0]))
        return out


def reduce(many: Iterable[Mapping[str, MetricLike]]) -> dict[str, Metric]:
    """The metrics of several records combined (each with weight 1)."""
    return Aggregator().extend(many).result()


def scalars(metrics: Mapping[str, MetricLike]) -> dict[str, float]:
    """Every metric that is a single number, as a float (histograms left out)."""
    out = {}
    for name, raw in metrics.items():
        m = as_metric(raw)
        if not isinstance(m, Histogram):
            out[name] = _float(m.value)
    return out


def histograms(metrics: Mapping[str, MetricLike]) -> dict[str, list[float]]:
    """The histogram metrics, as lists of floats."""
    return {name: [float(v) for v in _values(m.values)]
            for name, m in metrics.items() if isinstance(m, Histogram)}


def all_reduce(metrics: Mapping[str, Metric], group: Any = None) -> dict[str, Metric]:
    """Combine the already reduced ``metrics`` of every process of a torch.distributed
    group (all processes call it, with the same names): means weighted by their weights,
    sums added, maxima and minima taken, ``Last`` from the highest rank, histograms
    concatenated. Without an initialised group it returns ``metrics`` unchanged."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return dict(metrics)
    names = sorted(metrics)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    kinds = [(n, type(metrics[n]).__name__) for n in names]
    dist.all_gather_object(gathered, kinds, group=group)
    if any(g != kinds for g in gathered):
        raise ValueError(f"processes report different metrics: {[dict(g) for g in gathered]}")
    sums = torch.tensor([_sum_part(metrics[n]) for n in names] + [_weight_part(metrics[n]) for n in names],
                        dtype=torch.float64)
    maxes = torch.tensor([_max_part(metrics[n]) for n in names], dtype=torch.float64)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
    hists: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hists, {n: metrics[n].values for n in names if isinstance(metrics[n], Histogram)},
                           group=group)
    lasts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(lasts, {n: metrics[n].value for n in names if isinstance(metrics[n], Last)},
                           group=group)
    out: dict[str, Metric] = {}
    k = len(names)
    for i, n in enumerate(names):
        m = metrics[n]
        if isinstance(m, Mean):
            weight = float(sums[k + i])
            out[n] = Mean(float(sums[i]) / weight if weight else math.nan, weight)
        elif isinstance(m, Sum):
            out[n] = Sum(float(sums[i]))
        elif isinstance(m, Max):
            out[n] = Max(float(maxes[i]))
        elif isinstance(m, Min):
            out[n] = Min(-float(maxes[i]))
        elif isinstance(m, Last):
            out[n] = Last(float(lasts[-1][n]))
        else:
            out[n] = Histogram([float(v) for h in hists for v in h[n]])
    return out


# ----------------------------------------------------------------------------- helpers

def _is_number(value: Any) -> bool:
    """A Python number, or a tensor / numpy value holding exactly one number."""
    if isinstance(value, (int, float)):
        return True
    numel = getattr(value, "numel", None)  # torch
    if callable(numel):
        return numel() == 1
    return hasattr(value, "item") and getattr(value, "size", None) == 1  # numpy


def _float(value: Any) -> float:
    return float(value.item()) if hasattr(value, "item") else float(value)


def _values(values: Any) -> Iterable[Any]:
    if hasattr(values, "detach"):
        return values.detach().reshape(-1).tolist()
    if hasattr(values, "tolist"):
        return list(values.tolist())
    return values


def _pick(a: Any, b: Any, how: Any) -> Any:
    if hasattr(a, "detach") or hasattr(b, "detach"):
        import torch

        return torch.maximum(torch.as_tensor(a), torch.as_tensor(b)) if how is max else \
            torch.minimum(torch.as_tensor(a), torch.as_tensor(b))
    return how(a, b)


def _sum_part(m: Metric) -> float:
    if isinstance(m, Mean):
        return _float(m.value) * _float(m.weight) if _float(m.weight) else 0.0
    return _float(m.value) if isinstance(m, Sum) else 0.0


def _weight_part(m: Metric) -> float:
    return _float(m.weight) if isinstance(m, Mean) else 0.0


def _max_part(m: Metric) -> float:
    if isinstance(m, Max):
        return _float(m.value)
    if isinstance(m, Min):
        return -_float(m.value)
    return 0.0
