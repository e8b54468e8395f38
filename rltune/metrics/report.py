"""``rltune report RUN_DIR``: a run directory as a static, self-contained HTML page.

From ``metrics.jsonl``, ``samples.jsonl`` and ``config.yaml`` of a run (finished or still
writing) it makes PNG charts with matplotlib and an ``index.html`` beside them that
needs nothing else: inline CSS, no scripts, no external addresses, the charts linked by
file name, the images of the rollouts shown copied from the run's ``images/`` into the
report's. So the folder can be copied, mailed or served as it is.

Charts are drawn on ``matplotlib.figure.Figure`` with the Agg canvas directly, never
through ``pyplot``, so making a report changes no global matplotlib state of the process
that calls it."""

from __future__ import annotations

import html
import math
import numbers
import re
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rltune.metrics import keys
from rltune.metrics.images import copy_images, images_html, resolve_image, sample_image_paths
from rltune.metrics.jsonl import JsonlError, JsonlReader
from rltune.metrics.report_charts import CHARTS, write_charts

Series = dict[int, float]
"""One metric: step -> value (finite values only; a later line at a step wins)."""

SAMPLES_SHOWN = 3
"""How many of the best and how many of the worst rollouts the page shows."""

MAX_TEXT = 4000
"""Characters of a prompt or completion shown; the rest is cut with a note."""

GENERATOR = '<meta name="generator" content="rltune report">'
"""Written near the top of every report's ``index.html``: how a later report tells a folder
that holds an earlier one (which it may replace) from someone else's."""


class ReportError(ValueError):
    """The run directory cannot be reported on; the message names the file (and line)."""


# --------------------------------------------------------------------------- reading


@dataclass
class RunData:
    run_dir: Path
    name: str
    train: dict[str, Series] = field(default_factory=dict)
    eval: dict[str, Series] = field(default_factory=dict)
    train_steps: list[int] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    """The rollouts of the last step in ``samples.jsonl``."""
    config: dict[str, Any] | None = None
    config_text: str | None = None
    notes: list[str] = field(default_factory=list)


def load_run(run_dir: Path) -> RunData:
    """The metrics, samples and config of ``run_dir`` (``samples.jsonl`` and
    ``config.yaml`` may be missing; ``metrics.jsonl`` may not)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"run directory {run_dir} does not exist (or is not a directory)")
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ReportError(f"{metrics_path} does not exist: not a run directory, or the run has not started")
    data = RunData(run_dir=run_dir, name=run_dir.name)
    _read_config(run_dir / "config.yaml", data)
    try:
        _read_metrics(metrics_path, data)
        if (run_dir / "samples.jsonl").is_file():
            _read_samples(run_dir / "samples.jsonl", data)
    except JsonlError as exc:
        raise ReportError(str(exc)) from exc
    return data


_CUT_SHORT = "The last line of {} was incomplete (the run is still writing) and is left out."


def _read_config(path: Path, data: RunData) -> None:
    if not path.is_file():
        data.notes.append("There is no config.yaml in the run directory.")
        return
    text = path.read_text(encoding="utf-8")
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ReportError(f"{where}: not valid YAML ({getattr(exc, 'problem', None) or exc})") from exc
    if not isinstance(config, dict):
        raise ReportError(f"{path}: expected a mapping of config sections, got {type(config).__name__}")
    data.config, data.config_text = config, text
    if isinstance(config.get("name"), str) and config["name"]:
        data.name = config["name"]


def _read_samples(path: Path, data: RunData) -> None:
    """Every line is checked; only the rollouts of the last step are kept (the page
    shows no others)."""
    reader, last_step = JsonlReader(path), None
    for number, row in reader:
        step = _step_of(row, path, number)
        if last_step is None or step > last_step:
            last_step, data.samples = step, []
        if step == last_step:
            data.samples.append(row)
    if reader.cut_short:
        data.notes.append(_CUT_SHORT.format("samples.jsonl"))


def _read_metrics(path: Path, data: RunData) -> None:
    metrics = JsonlReader(path)
    steps: set[int] = set()
    for number, row in metrics:
        step = _step_of(row, path, number)
        for key, value in row.items():
            if key == "step":
                continue
            if not keys.is_eval_key(key):
                steps.add(step)
            number_value = _finite_number(value)
            if number_value is not None:
                target = data.eval if keys.is_eval_key(key) else data.train
                target.setdefault(key, {})[step] = number_value
    data.train_steps = sorted(steps)
    if metrics.cut_short:
        data.notes.append(_CUT_SHORT.format("metrics.jsonl"))


def _step_of(row: Mapping[str, Any], path: Path, number: int) -> int:
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise ReportError(f"{path}:{number}: 'step' must be an integer, got {step!r}")
    return step


def _finite_number(value: Any) -> float | None:
    """``value`` as a float when it is a finite number; None for null, nan, inf, and for
    values that are not numbers (charts and tables show numbers only)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


# --------------------------------------------------------------------------- the page


def fmt(value: float) -> str:
    """A number for a table: integers as such (``8``), large values with thousands
    separators and one decimal (``12,345.6``), others to 4 significant digits (``0.05385``)."""
    if value == int(value) and abs(value) < 1e6:
        return str(int(value))
    if abs(value) >= 1000:
        return f"{value:,.1f}"
    return f"{value:.4g}"


KEY_METRICS: tuple[tuple[str, str | None], ...] = (
    (keys.REWARD_MEAN, "max"),
    (keys.REWARD_STD, None),
    (keys.LOSS, None),
    (keys.KL, None),
    (keys.APPROX_KL, None),
    (keys.ENTROPY, None),
    (keys.GRAD_NORM, None),
    (keys.CLIP_FRAC, None),
    (keys.LENGTH_MEAN, None),
    (keys.LENGTH_CLIPPED_FRAC, None),
    (keys.SAMPLES_PER_S, "max"),
    (keys.TOKENS_PER_S, "max"),
    (keys.TIME_STEP, "min"),
)
"""The summary table's metrics (those logged) and which direction is best, if any. The
reward functions (``reward/<fn>``) and the accuracies (``accuracy``, ``accuracy/<fn>``),
best: max, follow ``reward/mean``."""


def _summary_rows(data: RunData) -> list[tuple[str, Series, str | None]]:
    rows: list[tuple[str, str | None]] = list(KEY_METRICS[:1])
    rows += [(keys.reward_key(name), "max") for name in keys.reward_names(data.train)]
    rows += [(key, "max") for key in sorted(data.train) if keys.is_accuracy_key(key)]
    rows += list(KEY_METRICS[1:])
    return [(key, data.train[key], best) for key, best in rows if data.train.get(key)]


def _best(series: Series, direction: str | None) -> str:
    if direction is None:
        return "–"
    pick = max if direction == "max" else min
    step = pick(sorted(series), key=lambda s: series[s])
    return f"{fmt(series[step])} <span class=\"step\">(step {step})</span>"


def _summary_table(data: RunData) -> str:
    rows = _summary_rows(data)
    if not rows:
        return "<p>No training metrics have been logged yet.</p>"
    body = []
    for key, series, direction in rows:
        first, last = min(series), max(series)
        body.append(
            f"<tr><th>{_e(key)}</th><td>{fmt(series[first])} <span class=\"step\">(step {first})</span></td>"
            f"<td>{fmt(series[last])} <span class=\"step\">(step {last})</span></td>"
            f"<td>{_best(series, direction)}</td></tr>"
        )
    head = "<tr><th>metric</th><th>first</th><th>last</th><th>best</th></tr>"
    return f"<table class=\"summary\">{head}{''.join(body)}</table>"


def _eval_table(data: RunData) -> str:
    if not data.eval:
        return ""
    body = []
    for key in sorted(data.eval):
        series = data.eval[key]
        last = max(series)
        body.append(f"<tr><th>{_e(key)}</th><td>{fmt(series[last])}</td><td>{last}</td></tr>")
    head = "<tr><th>metric</th><th>value</th><th>step</th></tr>"
    return f"<h2>Final evaluation</h2><table class=\"eval\">{head}{''.join(body)}</table>"


def _steps_line(data: RunData) -> str:
    train = (data.config or {}).get("train")
    planned = train.get("steps") if isinstance(train, dict) else None
    if not data.train_steps:
        text = "No training step logged yet"
    else:
        text = (f"Training steps {data.train_steps[0]}–{data.train_steps[-1]} "
                f"({len(data.train_steps)} logged)")
    if isinstance(planned, int) and not isinstance(planned, bool):
        text += f" of {planned} planned"
    eval_steps = sorted({s for series in data.eval.values() for s in series})
    if eval_steps:
        text += "; evaluated at step" + ("s " if len(eval_steps) > 1 else " ") + ", ".join(map(str, eval_steps))
    return f"<p class=\"steps\">{_e(text)}.</p>"


Sample = Mapping[str, Any]


def pick_samples(samples: Sequence[Sample]) -> tuple[int | None, list[Sample], list[Sample], int]:
    """At the last step that has samples: the best and the worst rollouts by reward
    (up to :data:`SAMPLES_SHOWN` each, no rollout in both, worst first in its list), and
    how many rollouts of that step had no reward (a failed reward function)."""
    if not samples:
        return None, [], [], 0
    step = max(int(s["step"]) for s in samples)
    at_step = [s for s in samples if s["step"] == step]
    scored = [s for s in at_step if _finite_number(s.get("reward")) is not None]
    ranked = sorted(scored, key=lambda s: -float(s["reward"]))
    best = ranked[:SAMPLES_SHOWN]
    worst = ranked[SAMPLES_SHOWN:][-SAMPLES_SHOWN:][::-1]
    return step, best, worst, len(at_step) - len(scored)


def _text(value: Any) -> str:
    """A prompt or completion as text: chat messages as ``role: content`` lines, a content
    of parts (vision-language prompts) as its text with ``[image]`` for each image."""
    if isinstance(value, list):
        return "\n".join(
            f"{m.get('role', '?')}: {_content(m.get('content', ''))}" if isinstance(m, dict) else str(m) for m in value
        )
    return "" if value is None else str(value)


def _content(content: Any) -> str:
    if not isinstance(content, list):
        return str(content)
    parts = [part if isinstance(part, dict) else {"type": "text", "text": part} for part in content]
    return "".join(str(part.get("text", "")) if part.get("type") == "text" else "[image]" for part in parts)


def _cut(text: str) -> str:
    """``text`` cut to :data:`MAX_TEXT` characters, and control characters other than
    tab, newline and carriage return (which HTML does not allow, and a model may well generate) written
    as ``\\xNN`` so they stay visible."""
    shown = text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + f"\n… ({len(text) - MAX_TEXT} more characters)"
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", shown)


_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _sample_html(sample: Mapping[str, Any], copied: Set[str]) -> str:
    facts = [f"reward {fmt(float(sample['reward']))}"]
    rewards = sample.get("rewards")
    if isinstance(rewards, dict):
        for name, value in rewards.items():
            number = _finite_number(value)
            facts.append(f"{name} {fmt(number) if number is not None else '–'}")
    for key in ("length", "finish_reason", "turns", "prompt_id"):
        if sample.get(key) is not None:
            facts.append(f"{key.replace('_', ' ')} {sample[key]}")
    error = sample.get("reward_error")
    error_html = f"<p class=\"error\">reward error: {_e(str(error))}</p>" if error else ""
    return (
        "<div class=\"sample\">"
        f"<p class=\"facts\">{_e(' · '.join(facts))}</p>{error_html}"
        f"{images_html(sample_image_paths(sample), copied)}"
        f"<div class=\"label\">prompt</div><pre>{_e(_cut(_text(sample.get('prompt'))))}</pre>"
        f"<div class=\"label\">completion</div><pre>{_e(_cut(_text(sample.get('completion'))))}</pre>"
        "</div>"
    )


def _samples_section(data: RunData, copied: Set[str]) -> str:
    step, best, worst, unscored = pick_samples(data.samples)
    if step is None:
        return ""
    parts = [f"<h2>Sample rollouts at step {step}</h2>"]
    if unscored:
        many = unscored != 1
        parts.append(f"<p>{unscored} rollout{'s' if many else ''} of this step had no reward (a reward "
                     f"function failed) and {'are' if many else 'is'} not ranked.</p>")
    if best:
        parts.append("<h3>Best</h3>" + "".join(_sample_html(s, copied) for s in best))
    if worst:
        parts.append("<h3>Worst</h3>" + "".join(_sample_html(s, copied) for s in worst))
    return "".join(parts)


CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1100px; padding: 0 1em; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 1.8em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; } th, td { padding: 0.25em 0.8em; text-align: left; }
tr:nth-child(even) { background: #f6f6f6; } td { font-variant-numeric: tabular-nums; }
.step { color: #888; font-size: 0.9em; } .notes { color: #a15c00; }
.charts img { max-width: 100%; margin: 0.5em 0; border: 1px solid #eee; }
.sample { border: 1px solid #ddd; border-radius: 4px; padding: 0.5em 0.8em; margin: 0.8em 0; }
.images img { max-width: 160px; max-height: 160px; margin: 0.2em 0.5em 0.5em 0; border: 1px solid #ddd; }
.facts { color: #555; margin: 0; } .error { color: #b00020; } .label { color: #888; font-size: 0.85em; }
pre { background: #f6f6f6; padding: 0.5em; white-space: pre-wrap; word-break: break-word; margin: 0.2em 0 0.5em; }
"""


def render_html(data: RunData, charts: Sequence[tuple[str, str]], copied: Set[str] = frozenset()) -> str:
    """The page: title and steps, notes, summary, final evaluation, charts, sample
    rollouts (``copied``: the paths of their images copied beside the page),
    config. Every text from the run is HTML-escaped."""
    notes = "".join(f"<li>{_e(n)}</li>" for n in data.notes)
    images = "".join(f"<figure><img src=\"{_e(f)}\" alt=\"{_e(c)}\"></figure>" for f, c in charts)
    config = f"<h2>Config</h2><pre class=\"config\">{_e(data.config_text)}</pre>" if data.config_text else ""
    return (
        f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">{GENERATOR}"
        f"<title>{_e(data.name)} – rltune report</title><style>{CSS}</style></head><body>"
        f"<h1>{_e(data.name)}</h1>{_steps_line(data)}"
        + (f"<ul class=\"notes\">{notes}</ul>" if notes else "")
        + f"<h2>Summary</h2>{_summary_table(data)}{_eval_table(data)}"
        + (f"<h2>Charts</h2><div class=\"charts\">{images}</div>" if images else "")
        + f"{_samples_section(data, copied)}{config}</body></html>\n"
    )


def _e(text: str) -> str:
    return html.escape(text, quote=True)


def write_report(run_dir: Path, out_dir: Path | None = None) -> Path:
    """Write the report of ``run_dir`` into ``out_dir`` (default ``run_dir/report``):
    the charts as PNG files, the images of the rollouts shown (``images/``) and
    ``index.html``. Returns the path of ``index.html``.
    A missing run directory or ``metrics.jsonl``, or a bad line before the last one, is
    a :class:`ReportError` naming the file (and line).

    The default folder is the report's own: a report there replaces the last one. Any
    other ``out_dir`` that exists may hold other files, but not one the report would
    write or remove (``index.html``, a chart, a copied image) unless an earlier report
    is there (:func:`is_report_page`); else it is a :class:`ReportError` naming the
    folder, and nothing is written. A folder that cannot be made or written (no such
    parent, no permission, a read-only file system) is a :class:`ReportError` naming the
    path and the system's reason."""
    data = load_run(Path(run_dir))
    default = Path(run_dir) / "report"
    out = Path(out_dir) if out_dir is not None else default
    try:
        return _write(data, out, default)
    except OSError as err:
        where = f" ({err.filename})" if err.filename is not None and str(err.filename) != str(out) else ""
        raise ReportError(f"cannot write the report to {out}: {err.strerror or err}{where}; give --out a "
                          "directory this user can create and write") from None


def _write(data: RunData, out: Path, default: Path) -> Path:
    """:func:`write_report`'s writing, once the run is read."""
    if out.exists() and not out.is_dir():
        raise ReportError(f"report directory {out} exists and is not a directory")
    _, best, worst, _ = pick_samples(data.samples)  # the shown rollouts' images go beside the page
    image_paths = [p for s in [*best, *worst] for p in sample_image_paths(s)]
    if out.is_dir() and out.resolve() != default.resolve():
        _check_replaceable(out, data.run_dir, image_paths)
    out.mkdir(parents=True, exist_ok=True)
    charts = write_charts(data, out)
    index = out / "index.html"
    copied = copy_images(data.run_dir, image_paths, out)
    # a lone surrogate in a sample's text (no UTF-8 for it) shows as its escape, \ud800
    index.write_text(render_html(data, charts, copied), encoding="utf-8", errors="backslashreplace")
    return index


def is_report_page(path: Path) -> bool:
    """Whether ``path`` is an ``index.html`` a report wrote: it has :data:`GENERATOR`, or
    (a report written before that tag) the report's title, in its first kilobytes."""
    try:
        with path.open("rb") as page:
            head = page.read(4096)
    except OSError:
        return False
    return GENERATOR.encode() in head or "– rltune report</title>".encode() in head


def _check_replaceable(out: Path, run_dir: Path, image_paths: Sequence[str]) -> None:
    """A :class:`ReportError` naming ``out`` if it holds, and no earlier report wrote, a
    file a report there would write or remove."""
    if is_report_page(out / "index.html"):
        return
    names = ["index.html", *(filename for filename, _, _ in CHARTS)]
    for relative in dict.fromkeys(image_paths):
        source = resolve_image(run_dir, relative)
        if source is not None and (out / relative).resolve() != source:
            names.append(relative)
    taken = [name for name in names if (out / name).exists() or (out / name).is_symlink()]
    if taken:
        raise ReportError(
            f"report directory {out} already holds {', '.join(taken)}, which the report would overwrite or remove "
            "and no earlier rltune report wrote; choose a new or empty directory, or move those files aside"
        )
