"""User text on the console (a reward's error, a config value, a path) is printed as
written: ``:ok:`` or ``:smile:`` are not turned into emoji."""

from __future__ import annotations

import argparse

from rltune import cli
from rltune.config import ConfigError
from rltune.metrics.sinks import ConsoleProgress


def test_an_error_message_keeps_its_colons(monkeypatch, capsys) -> None:
    def train(args: argparse.Namespace, console) -> int:
        raise ConfigError("reward spec 'rw.py:ok:extra': expected :smile: here")

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    monkeypatch.setattr(parser, "parse_args", lambda argv: argparse.Namespace(fn=train))
    monkeypatch.setenv("COLUMNS", "500")
    assert cli.main(["train", "x.yaml"]) == 2
    assert capsys.readouterr().err.strip() == "error: reward spec 'rw.py:ok:extra': expected :smile: here"


def test_the_training_console_keeps_its_colons(capsys) -> None:
    progress = ConsoleProgress(1, enabled=False)
    progress.console.width = 500
    progress.print("reward error: expected :ok: or :smile:")
    assert "expected :ok: or :smile:" in capsys.readouterr().err


def test_an_empty_token_or_out_is_refused_by_name(tmp_path, monkeypatch, capsys) -> None:
    import rltune.metrics.dashboard

    def no_serving(*args, **kwargs):
        raise AssertionError("the dashboard started with an empty token")

    monkeypatch.setattr(rltune.metrics.dashboard, "serve", no_serving)
    monkeypatch.setenv("COLUMNS", "500")
    assert cli.main(["dashboard", str(tmp_path), "--token", ""]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --token is empty; give a token of at least 16")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["report", str(tmp_path), "--out", ""]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --out is empty;")
    assert list(tmp_path.iterdir()) == []  # nothing written into the working directory


def test_a_finished_runs_damaged_metrics_end_the_summary_not_the_command(tmp_path, capsys) -> None:
    from types import SimpleNamespace

    from rich.console import Console

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{not json}\n')
    console = Console(stderr=True, width=500)
    cli._print_eval_summary(SimpleNamespace(run_dir=tmp_path), console)
    assert capsys.readouterr().err.startswith(f"no held-out summary: {tmp_path / 'metrics.jsonl'}:2: ")
