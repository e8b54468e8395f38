"""`rltune train FILE [key.sub=value ...]`, `rltune export RUN_DIR OUT_DIR [--checkpoint PATH]`,
`rltune dashboard [RUN_DIR ...]`, `rltune report RUN_DIR [--out DIR]`,
`rltune plan CONFIG.yaml --gpus N [...]` (``rltune.plan.command``)."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors that mean the input (config, data, model, reward, checkpoint) is wrong: shown
    as one message, without a traceback."""
    from rltune.checkpoint.export import ExportError
    from rltune.checkpoint.store import CheckpointError
    from rltune.config import ConfigError
    from rltune.data.loaders import DataError
    from rltune.envs.loading import EnvLoadError
    from rltune.learner.learner import NonFiniteError
    from rltune.learner.memory import MemorySettingError
    from rltune.learner.precision import PrecisionError
    from rltune.metrics.dashboard import DashboardError
    from rltune.metrics.report import ReportError
    from rltune.metrics.sinks import ResumeError
    from rltune.models.load import ModelLoadError
    from rltune.models.routing import RoutingError
    from rltune.models.safetensors_io import TensorFileError
    from rltune.parallel.layout import LayoutError
    from rltune.plan.errors import PlanError
    from rltune.rewards.loading import RewardLoadError
    from rltune.runtime.reward_errors import RewardErrorLimit
    from rltune.runtime.sinks import SinkError

    return (
        ConfigError, DataError, ModelLoadError, RewardLoadError, CheckpointError, NonFiniteError,
        ExportError, EnvLoadError, SinkError, DashboardError, ReportError, TensorFileError,
        RewardErrorLimit, LayoutError, PrecisionError, PlanError, MemorySettingError, ResumeError,
        RoutingError,
    )


def cmd_train(args: argparse.Namespace, console: Console) -> int:
    from rltune.config import config_base_dir, load_config
    from rltune.learner.precision import check_precision
    from rltune.parallel.layout import run_layout
    from rltune.runtime.local import run_local

    cfg = load_config(args.config, args.overrides)
    layout = run_layout(cfg)  # an impossible learner layout is refused before any model is loaded
    check_precision(cfg, layout)  # and a precision this machine or layout cannot run (fp8 off a new GPU)
    _quiet_transformers()
    if cfg.runtime.mode == "ray":
        run = _train_on_ray(cfg, config_base_dir(args.config), console)
        if run is None:
            return 2
    else:
        run = run_local(cfg, config_dir=config_base_dir(args.config))
    console.print(f"run directory: {run.run_dir}")
    _print_eval_summary(run, console)
    return 0


def _train_on_ray(cfg, config_dir: Path, console: Console):
    """``runtime.mode: ray``; None after telling the user what the cluster lacks."""
    from rltune.config import ConfigError

    try:
        from rltune.runtime.ray.cluster import RayRuntimeError
        from rltune.runtime.ray.run import run_ray
    except ImportError as err:
        raise ConfigError(
            f"runtime.mode=ray needs Ray: pip install 'rltune[ray]' ({err})"
        ) from None
    try:
        return run_ray(cfg, config_dir=config_dir)
    except RayRuntimeError as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        return None


def cmd_export(args: argparse.Namespace, console: Console) -> int:
    from rltune.checkpoint.export import export_run

    _quiet_transformers()
    checkpoint = export_run(args.run_dir, args.out_dir, checkpoint=args.checkpoint)
    console.print(f"exported {checkpoint} to {args.out_dir}")
    return 0


def cmd_dashboard(args: argparse.Namespace, console: Console) -> int:
    from rltune.metrics.dashboard import DashboardError, serve

    if args.token == "":  # else taken for "no token", and the message would ask for one
        raise DashboardError("--token is empty; give a token of at least 16 characters "
                             "(python -c 'import secrets; print(secrets.token_urlsafe())')")
    token = args.token or os.environ.get("RLTUNE_DASHBOARD_TOKEN") or None
    serve(args.run_dirs or [Path("runs")], host=args.host, port=args.port, token=token,
          log=lambda line: console.print(line, highlight=False))
    return 0


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    from rltune.plan.command import cmd_plan as run_plan

    return run_plan(args, console)


def cmd_report(args: argparse.Namespace, console: Console) -> int:
    from rltune.metrics.report import ReportError, write_report

    if args.out == "":  # Path("") would be the working directory
        raise ReportError("--out is empty; give the directory to write the report to (default RUN_DIR/report)")
    index = write_report(args.run_dir, None if args.out is None else Path(args.out))
    console.print(f"report written to {index}")
    return 0


def _print_eval_summary(run, console: Console) -> None:
    """Held-out scores at the first and last evaluation of this run's metrics file."""
    from rltune.metrics import keys
    from rltune.metrics.jsonl import JsonlReader

    try:
        evals = [row for _, row in JsonlReader(run.run_dir / "metrics.jsonl") if keys.held_out_scores(row)]
    except (OSError, ValueError) as err:  # the run is done and saved: say why there is no summary
        console.print(f"no held-out summary: {escape(str(err))}", highlight=False)
        return
    if len(evals) < 1:
        return
    first, last = evals[0], evals[-1]
    for key in sorted(keys.held_out_scores(last, with_mean=False)):
        before, after = first.get(key), last.get(key)
        if before is None or after is None or not (math.isfinite(before) and math.isfinite(after)):
            continue
        console.print(
            f"held-out {keys.held_out_label(key)}: step {first['step']} {before:.3f} -> "
            f"step {last['step']} {after:.3f} ({after - before:+.3f})"
        )


def _quiet_transformers() -> None:
    """The run has its own progress bar; transformers' per-load bars would interleave with it."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rltune", description="RL post-training for language models")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train from a YAML config")
    p.add_argument("config", help="experiment YAML file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-4")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser(
        "export",
        help="write a run's checkpoint as a Hugging Face model directory (LoRA adapters merged)",
    )
    p.add_argument("run_dir", type=Path, help="the run's directory (log.dir/NAME), with its config.yaml")
    p.add_argument("out_dir", type=Path, help="new (or empty) directory to write the model to")
    p.add_argument(
        "--checkpoint", type=Path, default=None,
        help="checkpoint directory to export (default: the run's newest complete one)",
    )
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser(
        "dashboard",
        help="serve a live dashboard of runs (charts, rollouts, config) on http://127.0.0.1:8765",
    )
    p.add_argument("run_dirs", type=Path, nargs="*",
                   help="run directories, or folders of runs (default: runs)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; any other needs a token)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 picks a free one)")
    p.add_argument("--token", default=None,
                   help="require this token (default: $RLTUNE_DASHBOARD_TOKEN); needed off loopback")
    p.set_defaults(fn=cmd_dashboard)
    p = sub.add_parser("report", help="write a static HTML summary with PNG charts of a run")
    p.add_argument("run_dir", type=Path, help="the run's directory (log.dir/NAME)")
    p.add_argument("--out", default=None, help="output directory (default RUN_DIR/report)")
    p.set_defaults(fn=cmd_report)
    p = sub.add_parser(
        "plan",
        help="choose a run's layout on a cluster (memory, step time, samples/s) and write its config sections",
    )
    from rltune.plan.command import add_arguments

    add_arguments(p)
    p.set_defaults(fn=cmd_plan)
    return parser


def _message(err: Exception) -> str:
    """What a user error says. One raised inside a Ray actor reaches the driver as Ray's
    ``RayTaskError(ErrorType)`` (an instance of the error's own type too), whose text is
    the actor's whole traceback; its ``cause`` is the error that was raised."""
    if "ray" in sys.modules:  # only a Ray run can raise one; Ray is an extra
        from rltune.runtime.ray.cluster import raised_in_actor

        return str(raised_in_actor(err))
    return str(err)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(stderr=True, emoji=False)  # ":ok:" in a message stays as written
    try:
        return args.fn(args, console)
    except _user_errors() as err:
        console.print(f"[bold red]error:[/] {escape(_message(err))}", highlight=False)
        return 2
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
