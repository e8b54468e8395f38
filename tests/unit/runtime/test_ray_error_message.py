"""A user error raised inside a Ray actor (a learner or generator refusing its input)
reaches ``rltune``'s driver as Ray's ``RayTaskError(ErrorType)``, whose text is the
actor's whole traceback. The CLI shows the error's own one line, as for the same error
raised in this process."""

from __future__ import annotations

import argparse

import pytest

from rltune import cli
from rltune.config import ConfigError

ray_exceptions = pytest.importorskip("ray.exceptions")


def test_an_error_from_an_actor_is_shown_as_its_own_line(monkeypatch, capsys) -> None:
    remote = ray_exceptions.RayTaskError(
        "LearnerActor.__init__", 'Traceback (most recent call last):\n  File "learner.py", line 1\n'
        "rltune.config.load.ConfigError: model.x: bad value", ConfigError("model.x: bad value"),
    ).as_instanceof_cause()

    def train(args: argparse.Namespace, console) -> int:
        raise remote

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    monkeypatch.setattr(parser, "parse_args", lambda argv: argparse.Namespace(fn=train))
    monkeypatch.setenv("COLUMNS", "500")
    assert cli.main(["train", "x.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: model.x: bad value"
