"""Running the CLI in a test and checking how it ends."""

from __future__ import annotations

from rltune.cli import main


def fails(capsys, argv: list[str]) -> str:
    """Run the CLI expecting a user error: exit code 2, one message, no traceback.
    Returns the message (what follows ``error:``; libraries may print progress before)."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "Traceback" not in out + err
    assert err.count("error: ") == 1, err
    return err[err.index("error: "):]
