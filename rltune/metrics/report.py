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
import os
import re
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rltune.metrics import keys
from rltune.metrics.images import copy_images, images_html, sample_image_paths
from rltune.metrics.jsonl import BadLine, JsonlError, JsonlReader, RunFileError, open_file, row_step
from rltune.metrics.report_charts import GENERATOR, is_report_page  # noqa: F401 (part of this module's API)
from rltune.metrics.report_charts import odd_value, odd_value_notes, replaced_files, write_charts

Series = dict[int, float]
"""One metric: step -> value (finite values only; a later line at a step wins)."""

Odd = dict[int, str]
"""One metric's values that are not finite numbers: step -> how it is shown (``nan``, ...)."""

SAMPLES_SHOWN = 3
"""How many of the best and how many of the worst rollouts the page shows."""

MAX_TEXT, MAX_ERROR, MAX_FACT, MAX_TURNS = 4000, 1000, 200, 20
"""Characters shown of a prompt, completion or turn; of a reward error; of one fact of a
rollout (finish reason, prompt id, a reward's name); turns shown of a multi-turn rollout.
What is cut is counted in a note where it is cut."""


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
    odd: dict[str, Odd] = field(default_factory=dict)
    """Training and evaluation metrics' values that are not finite numbers, by key."""
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
    if not os.path.lexists(metrics_path):
        raise ReportError(f"{metrics_path} does not exist: not a run directory, or the run has not started")
    data = RunData(run_dir=run_dir, name=run_dir.name)
    try:
        _read_config(run_dir / "config.yaml", data)
        _read_metrics(metrics_path, data)
        if os.path.lexists(run_dir / "samples.jsonl"):
            _read_samples(run_dir / "samples.jsonl", data)
    except (JsonlError, RunFileError) as exc:  # RunFileError: a directory, a FIFO, no permission
        raise ReportError(str(exc)) from exc
    except OSError as exc:
        raise ReportError(f"{exc.filename or run_dir}: cannot be read ({exc.strerror or exc})") from None
    data.notes += odd_value_notes(data.odd)
    return data


_CUT_SHORT = "The last line of {} was incomplete (no newline yet: the run is still writing it) and is left out."


def _read_config(path: Path, data: RunData) -> None:
    if not os.path.lexists(path):
        data.notes.append("There is no config.yaml in the run directory.")
        return
    with open_file(path) as handle:
        raw = handle.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ReportError(f"{path}:{line}: not UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None
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
    reader, last_step = JsonlReader(path, nonfinite=True), None
    for number, row in reader:
        step = _step_of(row, path, number)
        if last_step is None or step > last_step:
            last_step, data.samples = step, []
        if step == last_step:
            data.samples.append(row)
    if reader.cut_short:
        data.notes.append(_CUT_SHORT.format("samples.jsonl"))


def _read_metrics(path: Path, data: RunData) -> None:
    """Finite numbers into ``data.train``/``data.eval``; any other value into
    ``data.odd`` (shown in the tables, noted); a later line at a step wins."""
    metrics = JsonlReader(path, nonfinite=True)
    steps: set[int] = set()
    for number, row in metrics:
        step = _step_of(row, path, number)
        for key, value in row.items():
            if key == "step":
                continue
            if not keys.is_eval_key(key):
                steps.add(step)
            target = data.eval if keys.is_eval_key(key) else data.train
            number_value = _finite_number(value)
            if number_value is not None:
                target.setdefault(key, {})[step] = number_value
                data.odd.get(key, {}).pop(step, None)
            else:
                data.odd.setdefault(key, {})[step] = odd_value(value)
                target.get(key, {}).pop(step, None)
    data.train_steps = sorted(steps)
    data.train, data.eval = ({key: series for key, series in d.items() if series} for d in (data.train, data.eval))
    if metrics.cut_short:
        data.notes.append(_CUT_SHORT.format("metrics.jsonl"))


def _step_of(row: Mapping[str, Any], path: Path, number: int) -> int:
    try:
        return row_step(row)
    except BadLine as exc:
        raise ReportError(f"{path}:{number}: {exc}") from None


def _finite_number(value: Any) -> float | None:
    """``value`` as a float when it is a finite number; None for null, nan, inf, an
    integer too large for a float, and values that are not numbers (charts and tables
    show numbers only)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def fmt(value: float) -> str:
    """A number for a table: integers as such (``8``), large values with thousands
    separators and one decimal (``12,345.6``), huge ones (from 1e15) and others to 4
    significant digits (``1e+308``, ``0.05385``); ``nan``, ``inf``, ``-inf`` as such."""
    if not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
    if value == int(value) and abs(value) < 1e6:
        return str(int(value))
    return f"{value:,.1f}" if 1000 <= abs(value) < 1e15 else f"{value:.4g}"


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


def _summary_rows(data: RunData) -> list[tuple[str, str | None]]:
    """(metric, best direction) of each summary row: those logged, finite or not."""
    logged = {key for key in [*data.train, *data.odd] if data.train.get(key) or data.odd.get(key)}
    rows: list[tuple[str, str | None]] = list(KEY_METRICS[:1])
    rows += [(keys.reward_key(name), "max") for name in keys.reward_names({k: 0 for k in logged})]
    rows += [(key, "max") for key in sorted(logged) if keys.is_accuracy_key(key) and not keys.is_eval_key(key)]
    rows += list(KEY_METRICS[1:])
    return [(key, best) for key, best in rows if key in logged]


def _value_at(data: RunData, key: str, step: int) -> str:
    """The value of ``key`` at ``step`` as the tables show it (a non-finite one too)."""
    series = data.train.get(key) or data.eval.get(key) or {}
    return fmt(series[step]) if step in series else _e(data.odd[key][step])


def _steps_of(data: RunData, key: str) -> list[int]:
    return sorted({*(data.train.get(key) or data.eval.get(key) or {}), *data.odd.get(key, {})})


def _best(series: Series, direction: str | None) -> str:
    if direction is None or not series:
        return "–"
    pick = max if direction == "max" else min
    step = pick(sorted(series), key=lambda s: series[s])
    return f"{fmt(series[step])} <span class=\"step\">(step {step})</span>"


def _summary_table(data: RunData) -> str:
    rows = _summary_rows(data)
    if not rows:
        return "<p>No training metrics have been logged yet.</p>"
    body = []
    for key, direction in rows:
        steps = _steps_of(data, key)
        first, last = steps[0], steps[-1]
        body.append(
            f"<tr><th>{_e(key)}</th><td>{_value_at(data, key, first)} <span class=\"step\">(step {first})</span></td>"
            f"<td>{_value_at(data, key, last)} <span class=\"step\">(step {last})</span></td>"
            f"<td>{_best(data.train.get(key, {}), direction)}</td></tr>"
        )
    head = "<tr><th>metric</th><th>first</th><th>last</th><th>best</th></tr>"
    return f"<table class=\"summary\">{head}{''.join(body)}</table>"


def _eval_table(data: RunData) -> str:
    logged = sorted(key for key in {*data.eval, *data.odd} if keys.is_eval_key(key) and _steps_of(data, key))
    if not logged:
        return ""
    body = []
    for key in logged:
        last = _steps_of(data, key)[-1]
        body.append(f"<tr><th>{_e(key)}</th><td>{_value_at(data, key, last)}</td><td>{last}</td></tr>")
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
    how many rollouts of that step have no finite reward to rank them by
    (:func:`_unranked` says why)."""
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


def _cut(text: str, limit: int = MAX_TEXT, gap: str = "\n") -> str:
    """``text`` cut to ``limit`` characters, with a note of how many more there were."""
    return text if len(text) <= limit else text[:limit] + f"{gap}… ({len(text) - limit} more characters)"


def _fact(text: Any) -> str:
    """One fact of a rollout, on one line and cut to :data:`MAX_FACT` characters."""
    return _cut(str(text).replace("\n", " "), MAX_FACT, "")


_HIDDEN = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""Control characters but tab, newline and carriage return (HTML does not allow them), and
marks that reorder text (U+202E shows text reversed): written as ``\\xNN``/``\\uNNNN``."""


def _neutral(text: str) -> str:
    return _HIDDEN.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}",
                       text)


def _reward_fact(value: Any) -> str:
    number = _finite_number(value)
    return fmt(number) if number is not None else "–" if value is None else odd_value(value)


def _sample_html(sample: Mapping[str, Any], copied: Set[str]) -> str:
    facts = [f"reward {fmt(float(sample['reward']))}"]
    rewards = sample.get("rewards")
    if isinstance(rewards, dict):
        facts += [f"{_fact(name)} {_reward_fact(value)}" for name, value in rewards.items()]
    for key in ("length", "finish_reason", "prompt_id"):
        if sample.get(key) is not None:
            facts.append(f"{key.replace('_', ' ')} {_fact(sample[key])}")
    turns = sample.get("turns")
    if turns is not None:
        facts.append(f"turns {len(turns)}" if isinstance(turns, list) else f"turns {_fact(turns)}")
    error = sample.get("reward_error")
    error_html = f"<p class=\"error\">reward error: {_e(_cut(str(error), MAX_ERROR))}</p>" if error else ""
    return (
        "<div class=\"sample\">"
        f"<p class=\"facts\">{_e(' · '.join(facts))}</p>{error_html}"
        f"{images_html(sample_image_paths(sample), copied)}"
        f"<div class=\"label\">prompt</div><pre>{_e(_cut(_text(sample.get('prompt'))))}</pre>"
        f"<div class=\"label\">completion</div><pre>{_e(_cut(_text(sample.get('completion'))))}</pre>"
        f"{_turns_html(turns) if isinstance(turns, list) else ''}</div>"
    )


def _turns_html(turns: list[Any]) -> str:
    """A multi-turn episode, one block per turn: its role, whether it was trained on, its
    tokens, its text (cut like a completion)."""
    parts = []
    for number, turn in enumerate(turns[:MAX_TURNS], start=1):
        if not isinstance(turn, dict):
            parts.append(f"<div class=\"label\">turn {number}: not a turn ({_e(_fact(turn))})</div>")
            continue
        label = [f"turn {number}", _fact(turn.get("role", "?"))]
        label += ["masked (not trained on)"] if turn.get("trained") is False else []
        label += [f"{turn['tokens']} tokens"] if isinstance(turn.get("tokens"), int) else []
        parts.append(f"<div class=\"label\">{_e(' · '.join(label))}</div>"
                     f"<pre>{_e(_cut(_content(turn.get('content', ''))))}</pre>")
    if len(turns) > MAX_TURNS:
        parts.append(f"<div class=\"label\">… {len(turns) - MAX_TURNS} more turns</div>")
    return "".join(parts)


def _unranked(at_step: Sequence[Sample]) -> list[str]:
    """Why rollouts of the shown step are not ranked, one sentence per reason."""
    why: dict[str, int] = {}
    for sample in at_step:
        reward = sample.get("reward")
        if _finite_number(reward) is not None:
            continue
        if reward is None:
            reason = "had no reward (a reward function failed)" if sample.get("reward_error") else "had no reward"
        elif isinstance(reward, numbers.Real) and not isinstance(reward, bool):
            reason = f"had a reward that is not finite ({odd_value(reward)})"
        else:
            reason = f"had a reward that is not a number ({odd_value(reward)})"
        why[reason] = why.get(reason, 0) + 1
    return [f"{count} rollout{'s' if count != 1 else ''} of this step {reason} and "
            f"{'are' if count != 1 else 'is'} not ranked." for reason, count in why.items()]


def _samples_section(data: RunData, copied: Set[str]) -> str:
    step, best, worst, unscored = pick_samples(data.samples)
    if step is None:
        return ""
    parts = [f"<h2>Sample rollouts at step {step}</h2>"]
    if unscored:
        parts += [f"<p>{_e(line)}</p>" for line in _unranked([s for s in data.samples if s["step"] == step])]
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
    """``text`` for HTML: escaped, its control and reordering characters made visible."""
    return html.escape(_neutral(text), quote=True)


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
    replacing = out.is_dir() and out.resolve() != default.resolve()
    taken = replaced_files(out, data.run_dir, image_paths) if replacing else []
    if taken:
        raise ReportError(
            f"report directory {out} already holds {', '.join(taken)}, which the report would overwrite or remove "
            "and no earlier rltune report wrote; choose a new or empty directory, or move those files aside")
    out.mkdir(parents=True, exist_ok=True)
    charts = write_charts(data, out)
    index = out / "index.html"
    copied = copy_images(data.run_dir, image_paths, out)
    # a lone surrogate in a sample's text (no UTF-8 for it) shows as its escape, \ud800
    index.write_text(render_html(data, charts, copied), encoding="utf-8", errors="backslashreplace")
    return index
