"""The charts of ``rltune report``: PNG files drawn with matplotlib from a run's metrics
(:class:`rltune.metrics.report.RunData`), on ``matplotlib.figure.Figure`` with the Agg
canvas directly, never through ``pyplot``, so no global matplotlib state changes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltune.metrics import keys

if TYPE_CHECKING:
    from rltune.metrics.report import RunData, Series


def _figure(panels: int = 1) -> tuple[Any, list[Any]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.2 if panels == 1 else 5.0 * panels, 3.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(1, panels, squeeze=False)[0])


def _line(ax: Any, series: Series, label: str, **style: Any) -> None:
    steps = sorted(series)
    ax.plot(steps, [series[s] for s in steps], label=label, marker="o", markersize=3, **style)


DRAWABLE = 1e300
"""The largest magnitude a chart draws. matplotlib cannot tick an axis that reaches
about 1e308 (an error), and draws an empty axis for the largest float; a value this large
is an overflow, not a measurement, so its chart is left out with a note."""


class _Undrawable(ValueError):
    """A chart's values are beyond :data:`DRAWABLE`; the message says how large."""


def _finish(fig: Any, axes: Sequence[Any], path: Path, title: str, ylabel: Sequence[str]) -> None:
    from matplotlib.ticker import MaxNLocator

    for ax in axes:
        if ax.has_data():
            largest = float(abs(ax.dataLim.get_points()).max())
            if not largest <= DRAWABLE:
                raise _Undrawable(f"its values reach {largest:.4g}, more than a chart can show "
                                  f"(at most {DRAWABLE:.0e} either way)")
    for ax, label in zip(axes, ylabel):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if len(ax.get_legend_handles_labels()[1]) > 1:
            ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.savefig(path, format="png")


def _chart_reward(data: RunData, path: Path) -> bool:
    mean, evals = data.train.get(keys.REWARD_MEAN), data.eval.get(keys.EVAL_REWARD_MEAN)
    if not mean and not evals:
        return False
    fig, [ax] = _figure()
    if mean:
        _line(ax, mean, "mean", linewidth=2.2, color="black")
    for name in keys.reward_names(data.train):
        _line(ax, data.train[keys.reward_key(name)], name, linewidth=1.0, alpha=0.8)
    if evals:
        steps = sorted(evals)
        ax.scatter(steps, [evals[s] for s in steps], label="eval mean", marker="D", s=36, color="tab:red", zorder=3)
    _finish(fig, [ax], path, "Reward", ["reward"])
    return True


def _chart_lines(lines: Sequence[tuple[str, str]], title: str, ylabel: str) -> Callable[[RunData, Path], bool]:
    """A chart of one panel with a line for each of ``lines`` ((metric, label)) present."""

    def chart(data: RunData, path: Path) -> bool:
        present = [(key, label) for key, label in lines if data.train.get(key)]
        if not present:
            return False
        fig, [ax] = _figure()
        for key, label in present:
            _line(ax, data.train[key], label)
        _finish(fig, [ax], path, title, [ylabel])
        return True

    return chart


def _chart_throughput(data: RunData, path: Path) -> bool:
    present = [(k, label) for k, label in ((keys.SAMPLES_PER_S, "samples/s"), (keys.TOKENS_PER_S, "tokens/s"))
               if data.train.get(k)]
    if not present:
        return False
    fig, axes = _figure(len(present))
    for ax, (key, label) in zip(axes, present):
        _line(ax, data.train[key], label)
    _finish(fig, axes, path, "Throughput", [label for _, label in present])
    return True


def _chart_time(data: RunData, path: Path) -> bool:
    present = [(keys.time_key(p), p) for p in keys.TIME_PHASES if data.train.get(keys.time_key(p))]
    if not present:
        return False
    steps = sorted({s for k, _ in present for s in data.train[k]})
    fig, [ax] = _figure()
    bottom = [0.0] * len(steps)
    for key, label in present:
        heights = [data.train[key].get(s, 0.0) for s in steps]
        ax.bar(steps, heights, bottom=bottom, label=label, width=0.8)
        bottom = [b + h for b, h in zip(bottom, heights)]
    if data.train.get(keys.TIME_STEP):
        _line(ax, data.train[keys.TIME_STEP], "whole step", color="black", linewidth=1.0)
    _finish(fig, [ax], path, "Time per step", ["seconds"])
    return True


CHARTS: tuple[tuple[str, str, Callable[[RunData, Path], bool]], ...] = (
    ("reward.png", "Reward", _chart_reward),
    ("grad_norm.png", "Gradient norm", _chart_lines([(keys.GRAD_NORM, "grad norm")], "Gradient norm", "norm")),
    ("kl.png", "KL", _chart_lines([(keys.KL, "kl"), (keys.APPROX_KL, "approx kl")], "KL divergence", "kl")),
    ("entropy.png", "Entropy", _chart_lines([(keys.ENTROPY, "entropy")], "Entropy", "nats per token")),
    ("length.png", "Response length",
     _chart_lines([(keys.LENGTH_MEAN, "mean"), (keys.LENGTH_MAX, "max")], "Response length", "tokens")),
    ("throughput.png", "Throughput", _chart_throughput),
    ("time.png", "Time split", _chart_time),
)
"""(file name, caption, drawing function); a function returns False, and draws nothing,
when none of its metrics was logged."""


def write_charts(data: RunData, out_dir: Path) -> list[tuple[str, str]]:
    """Draw every chart whose metrics exist into ``out_dir``; a chart file of an earlier
    report whose metrics are now absent is removed. A chart that cannot be drawn (a value
    beyond :data:`DRAWABLE`, a step too large for a float) is left out too, and a note of
    the page says why. Returns (file name, caption) pairs."""
    written = []
    for filename, caption, draw in CHARTS:
        path = out_dir / filename
        try:
            drawn = draw(data, path)
        except (ValueError, OverflowError, FloatingPointError) as exc:
            why = str(exc) if isinstance(exc, _Undrawable) else (
                f"matplotlib could not draw its values ({type(exc).__name__}: {exc})")
            data.notes.append(f"The {caption} chart is left out: {why}.")
            drawn = False
        if drawn:
            written.append((filename, caption))
        elif path.exists():
            path.unlink()
    return written
