"""truncate_after_step, what a resumed run does to its metrics.jsonl and samples.jsonl:
the lines after the checkpoint's step go, a last line cut short by a crash goes with a
note, and any other line it cannot read stops the resume with an error naming the file
and line, the file left byte for byte as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from rltune.metrics.sinks import JsonlWriter, ResumeError, truncate_after_step

GOOD = b'{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.25}\n{"step": 3, "loss": 0.125}\n'


def test_lines_after_the_step_go_and_the_rest_are_kept_byte_for_byte(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1,   "loss": 0.5}\n\n{"step": 2, "c": "\\u00e9 \xc3\xa9"}\n{"step": 3}\n')
    assert truncate_after_step(path, 2) is None
    assert path.read_bytes() == b'{"step": 1,   "loss": 0.5}\n{"step": 2, "c": "\\u00e9 \xc3\xa9"}\n'
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_a_missing_file_is_left_missing(tmp_path: Path) -> None:
    assert truncate_after_step(tmp_path / "samples.jsonl", 3) is None
    assert not (tmp_path / "samples.jsonl").exists()


def test_a_last_line_cut_short_by_a_crash_is_dropped_with_a_note(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(GOOD + b'{"step": 4, "loss": 0.')
    note = truncate_after_step(path, 5)
    assert path.read_bytes() == GOOD
    assert note is not None
    assert note.startswith(f"{path}:4: the last line was cut short when the run stopped and is dropped "
                           "(not a JSON line")


def test_a_last_line_cut_inside_a_character_is_dropped_too(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    path.write_bytes(GOOD + b'{"step": 4, "completion": "\xc3')
    assert truncate_after_step(path, 5) == (
        f"{path}:4: the last line was cut short when the run stopped and is dropped (not a JSON line "
        "('utf-8' codec can't decode byte 0xc3 in position 27: unexpected end of data))")
    assert path.read_bytes() == GOOD


def test_a_whole_last_line_without_its_newline_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2}')
    assert truncate_after_step(path, 2) is None
    assert path.read_bytes() == b'{"step": 1}\n{"step": 2}\n'


@pytest.mark.parametrize(
    ("name", "content", "where"),
    [
        # a bad first line (and so not the last): the report of the probe that found it
        ("metrics.jsonl", b'{broken\n' + GOOD, ":1: not a JSON line (Expecting property name"),
        ("metrics.jsonl", GOOD + b'{broken\n{"step": 4}\n', ":4: not a JSON line (Expecting property name"),
        # a bad last line that ends in a newline was written whole: not a crash's doing
        ("metrics.jsonl", GOOD + b'{broken\n', ":4: not a JSON line (Expecting property name"),
        ("metrics.jsonl", b'{"step": 1}\n[1]\n{"step": 2}\n', ":2: expected a JSON object, got list"),
        ("metrics.jsonl", GOOD + b'[1]', ":4: expected a JSON object, got list"),
        ("metrics.jsonl", b'{"step": "x"}\n' + GOOD, ":1: 'step' must be an integer, got 'x'"),
        ("metrics.jsonl", b'{"step": 1}\n{"loss": 1.0}\n', ":2: 'step' must be an integer, got None"),
        ("metrics.jsonl", b'{"step": true}\n', ":1: 'step' must be an integer, got True"),
        ("samples.jsonl", b'{"step": 1}\n{"step": 1, "completion": "\xff"}\n{"step": 2}\n',
         ":2: not a JSON line ('utf-8' codec can't decode byte 0xff in position 27: invalid start byte)"),
    ],
)
def test_a_line_that_cannot_be_read_stops_the_resume_and_keeps_the_file(tmp_path, name, content, where) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ResumeError) as info:
        truncate_after_step(path, 1)
    message = str(info.value)
    assert message.startswith(f"{path}{where}")
    assert message.endswith("; cannot cut the file back to step 1 to resume, so it is left as it was: "
                            "fix or delete that line (or move the file aside) and start the run again")
    assert "\n" not in message
    assert path.read_bytes() == content  # nothing lost, nothing rewritten
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no temporary file left


def test_the_cli_shows_the_error_as_one_message() -> None:
    from rltune.cli import _user_errors

    assert issubclass(ResumeError, _user_errors())


def test_a_resumed_writer_refuses_before_it_writes(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    content = b'{broken\n' + GOOD
    path.write_bytes(content)
    with pytest.raises(ResumeError, match=r"metrics\.jsonl:1: not a JSON line"):
        JsonlWriter(path, resume_after_step=2)
    assert path.read_bytes() == content


def test_a_resumed_writer_warns_of_a_dropped_last_line(tmp_path: Path, capsys) -> None:
    path = tmp_path / "samples.jsonl"
    path.write_bytes(GOOD + b'{"step": 4, "compl')
    writer = JsonlWriter(path, resume_after_step=3)
    writer.write({"step": 4, "completion": "again"})
    writer.close()
    assert path.read_bytes() == GOOD + b'{"step": 4, "completion": "again"}\n'
    assert writer.resume_note is not None and writer.resume_note.startswith(f"{path}:4: the last line was cut short")
    assert capsys.readouterr().err == f"warning: {writer.resume_note}\n"
    assert JsonlWriter(path, resume_after_step=4).resume_note is None


def test_check_only_reads_the_file_the_same_way_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    assert truncate_after_step(path, 1, check_only=True) is None
    assert path.read_bytes() == b'{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    path.write_bytes(b'{"step": 1}\n[1]\n{"step": 3}\n')
    with pytest.raises(ResumeError, match=r"metrics\.jsonl:2: "):
        truncate_after_step(path, 1, check_only=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
