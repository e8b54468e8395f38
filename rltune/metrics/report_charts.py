"""The charts of ``rltune report`` and the files it writes beside them: PNG files drawn
with matplotlib from a run's metrics (:class:`rltune.metrics.report.RunData`), on
``matplotlib.figure.Figure`` with the Agg canvas directly, never through ``pyplot``, so
no global matplotlib state changes. A chart draws finite numbers only;
:func:`odd_value_notes` says which values it leaves out, so that a diverging run does
not look fine. :func:`replaced_files` tells which files of an output folder a report
would replace."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltune.metrics import keys
from rltune.metrics.images import resolve_image

if TYPE_CHECKING:
    from rltune.metrics.report import RunData, Series


def odd_value(value: Any) -> str:
    """How a value that is not a finite number is shown in place of one: ``nan``,
    ``inf``, ``-inf``, ``null (not finite)`` (how a run writes a non-finite value),
    ``too large for a float``, ``'0.5' (text)``, ``true``, ``a list``, ``an object``."""
    if value is None:
        return "null (not finite)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, numbers.Real):
        try:
            number = float(value)
        except OverflowError:
            return "too large for a float"
        return "nan" if math.isnan(number) else "inf" if number > 0 else "-inf" if number < 0 else str(number)
    if isinstance(value, str):
        shown = value if len(value) <= 20 else value[:20] + "…"
        return f"{shown!r} (text)"
    return {"list": "a list", "dict": "an object"}.get(type(value).__name__, f"a {type(value).__name__}")


def odd_value_notes(odd: Mapping[str, Mapping[int, str]]) -> list[str]:
    """One note per metric with values that are not finite numbers: what they are and at
    which steps, left out of the charts."""
    notes = []
    for key in sorted(odd):
        if odd[key]:
            steps = sorted(odd[key])
            shown = ", ".join(dict.fromkeys(odd[key][step] for step in steps))
            notes.append(f"{key} is not a finite number at {_step_list(steps)} ({shown}); "
                         "the charts leave those points out.")
    return notes


def _step_list(steps: Sequence[int]) -> str:
    """``step 3``, ``steps 1–4, 7``."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][-1] + 1:
            runs[-1].append(step)
        else:
            runs.append([step])
    text = ", ".join(f"{r[0]}–{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs[:10])
    text += f" and {len(runs) - 10} more" if len(runs) > 10 else ""
    return f"step{'s' if len(steps) > 1 else ''} {text}"


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


GENERATOR = '<meta name="generator" content="rltune report">'
"""Written near the top of every report's ``index.html``: how a later report tells a folder
that holds an earlier one (which it may replace) from someone else's."""


def is_report_page(path: Path) -> bool:
    """Whether ``path`` is an ``index.html`` a report wrote: it has :data:`GENERATOR`, or
    (a report written before that tag) the report's title, in its first kilobytes."""
    try:
        with path.open("rb") as page:
            head = page.read(4096)
    except OSError:
        return False
    return GENERATOR.encode() in head or "– rltune report</title>".encode() in head


def replaced_files(out: Path, run_dir: Path, image_paths: Sequence[str]) -> list[str]:
    """The files of ``out`` that a report there would write or remove (``index.html``, a
    chart, a copied image), unless an earlier report wrote them (then none)."""
    if is_report_page(out / "index.html"):
        return []
    names = ["index.html", *(filename for filename, _, _ in CHARTS)]
    for relative in dict.fromkeys(image_paths):
        source = resolve_image(run_dir, relative)
        if source is not None and (out / relative).resolve() != source:
            names.append(relative)
    return [name for name in names if (out / name).exists() or (out / name).is_symlink()]
