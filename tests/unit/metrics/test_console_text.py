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
