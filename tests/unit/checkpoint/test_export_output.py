"""Where an export is written: the output path is checked before anything is loaded, the
model is written in a temporary directory of the export's own (``mkdtemp``) and renamed
into place, so no file of the user's beside the output is ever moved or removed, and a
failure leaves the output as it was.

The model and tokenizer here are stand-ins whose ``save_pretrained`` writes one file
(and can fail, or meddle, in the middle): what is checked is the file handling, not the
model (``test_export_lora.py`` and ``tests/e2e/test_e2e_export*.py`` do that)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from rltune.checkpoint import export
from rltune.checkpoint.export import STAGING_PREFIX, ExportError, check_output, export_hf, export_run
from rltune.config import load_config, save_resolved_config


class _Saves:
    """A stand-in model or tokenizer: ``save_pretrained`` writes ``NAME`` holding ``text``,
    then runs ``then`` (if given)."""

    def __init__(self, name: str, text: str = "new", then=None) -> None:
        self.name, self.text, self.then = name, text, then

    def save_pretrained(self, directory, **_) -> None:
        (Path(directory) / self.name).write_text(self.text)
        if self.then is not None:
            self.then()


def _disk_full() -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def _tree(root: Path) -> dict[str, str | None]:
    """Every path under ``root`` (hidden ones included) -> its text, None for a directory."""
    return {
        str(p.relative_to(root)): (None if p.is_dir() else p.read_text())
        for p in sorted(root.rglob("*"))
    }


def _user_siblings(parent: Path) -> None:
    """Directories a user may keep beside an output named ``out``, among them the names the
    export used to use for its own temporary and backup directories."""
    for name in (".out.old", ".out.tmp", ".out.abc123", f"{STAGING_PREFIX}notes"):
        (parent / name).mkdir()
        (parent / name / "mine.txt").write_text(f"mine: {name}")


def test_an_empty_output_directory_is_filled_and_its_siblings_are_untouched(tmp_path):
    """The bug: exporting into an existing empty directory removed ``.NAME.old`` beside it."""
    (tmp_path / "out").mkdir()
    _user_siblings(tmp_path)
    before = _tree(tmp_path)
    export_hf(_Saves("model.safetensors"), _Saves("tokenizer.json"), tmp_path / "out", replace=False)
    assert _tree(tmp_path) == {**before, "out/model.safetensors": "new", "out/tokenizer.json": "new"}


def test_replacing_an_earlier_export_touches_only_it(tmp_path):
    """``replace`` (a resumed run's ``final``): the earlier export's files are gone, the
    user's directories beside it are as they were, and nothing temporary is left."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_text("old")
    (tmp_path / "out" / "stale.json").write_text("old")
    _user_siblings(tmp_path)
    before = {k: v for k, v in _tree(tmp_path).items() if not k.startswith("out/")}
    export_hf(_Saves("model.safetensors"), _Saves("tokenizer.json"), tmp_path / "out")
    assert _tree(tmp_path) == {**before, "out/model.safetensors": "new", "out/tokenizer.json": "new"}


@pytest.mark.parametrize("state", ["absent", "empty", "earlier export"])
def test_a_failed_write_leaves_the_output_as_it_was(tmp_path, state):
    if state != "absent":
        (tmp_path / "out").mkdir()
    if state == "earlier export":
        (tmp_path / "out" / "model.safetensors").write_text("old")
    _user_siblings(tmp_path)
    before = _tree(tmp_path)
    with pytest.raises(ExportError, match=f"cannot write the export to {tmp_path / 'out'}: .*No space left"):
        export_hf(_Saves("model.safetensors", then=_disk_full), _Saves("tokenizer.json"), tmp_path / "out")
    assert _tree(tmp_path) == before  # no half-written output, no temporary directory


def test_files_that_appear_in_the_output_meanwhile_are_kept(tmp_path):
    """Without ``replace`` (``rltune export``) an output directory that was empty when
    checked but holds files when the model is ready is left alone: not replaced."""
    (tmp_path / "out").mkdir()
    meddle = lambda: (tmp_path / "out" / "notes.txt").write_text("mine")  # noqa: E731
    with pytest.raises(ExportError, match=f"output directory {tmp_path / 'out'} received files"):
        export_hf(_Saves("model.safetensors", then=meddle), _Saves("tokenizer.json"), tmp_path / "out", replace=False)
    assert _tree(tmp_path) == {"out": None, "out/notes.txt": "mine"}


def test_a_failed_rename_puts_the_earlier_export_back(tmp_path, monkeypatch):
    """The earlier export is moved aside (into the export's own temporary directory) before
    the new one is renamed in; when that rename fails it is moved back."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_text("old")
    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append((Path(src).name, Path(dst).name))
        if len(calls) == 3:  # new -> out (refused), out -> aside, new -> out: fails here
            raise OSError(errno.EIO, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(ExportError, match="Input/output error"):
        export_hf(_Saves("model.safetensors"), _Saves("tokenizer.json"), tmp_path / "out")
    assert calls == [("model", "out"), ("out", "old"), ("model", "out"), ("old", "out")]
    assert _tree(tmp_path) == {"out": None, "out/model.safetensors": "old"}


def test_an_earlier_export_that_cannot_go_back_is_kept_and_named(tmp_path, monkeypatch):
    """Both renames fail (the new one in, the earlier one back): the earlier export stays
    in the export's temporary directory, which is not removed, and the message says where."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_text("old")
    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append(1)
        if len(calls) >= 3:
            raise OSError(errno.EIO, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(ExportError, match="nor put the earlier export back") as err:
        export_hf(_Saves("model.safetensors"), _Saves("tokenizer.json"), tmp_path / "out")
    aside = Path(str(err.value).rpartition("the earlier export is in ")[2])
    assert aside.parent.parent == tmp_path and aside.parent.name.startswith(f"{STAGING_PREFIX}out.")
    assert (aside / "model.safetensors").read_text() == "old"


def test_the_export_has_the_permissions_of_a_new_directory(tmp_path):
    """Not ``mkdtemp``'s owner-only 0700: a served model is read by other users."""
    umask = os.umask(0)
    os.umask(umask)
    out = export_hf(_Saves("model.safetensors"), _Saves("tokenizer.json"), tmp_path / "out")
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask


@pytest.fixture
def paths(tmp_path):
    """A file, a directory with a file, a link to an empty directory, under ``tmp_path``."""
    (tmp_path / "afile").write_text("mine")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    return tmp_path


BAD_OUTPUTS = {  # output -> the message, {root} the test's directory
    "afile/sub": "output directory {root}/afile/sub: {root}/afile is a file, not a directory",
    "afile/sub/deeper": "output directory {root}/afile/sub/deeper: {root}/afile is a file, not a directory",
    "afile": "output directory {root}/afile is a file, not a directory; choose a new path",
    "full": "output directory {root}/full already exists and is not empty; choose a new one",
    "link": "output directory {root}/link is a symbolic link; give the directory it points to ({root}/empty)",
}


@pytest.mark.parametrize("out", sorted(BAD_OUTPUTS))
def test_bad_outputs_are_refused(paths, out):
    before = _tree(paths)
    expected = BAD_OUTPUTS[out].format(root=paths)
    with pytest.raises(ExportError) as err:
        check_output(paths / out)
    assert expected in str(err.value)
    with pytest.raises(ExportError) as err:
        export_hf(_Saves("model.safetensors"), _Saves("tokenizer.json"), paths / out, replace=out != "full")
    assert expected in str(err.value)
    assert _tree(paths) == before


@pytest.mark.parametrize("out", ["new", "new/deeper", "empty"])
def test_good_outputs_pass(paths, out):
    check_output(paths / out)


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A run directory with its config and a checkpoint directory, and an export that
    fails the test if it loads anything: the output is checked first."""
    cfg = load_config(None, ["name=r", "model.path=builtin:tiny", "algo.name=sft",
                             "data.train=builtin:arith_small/train", f"log.dir={tmp_path}"])
    save_resolved_config(cfg, tmp_path / "r")
    (tmp_path / "r" / "checkpoints" / "step-1").mkdir(parents=True)

    def loads(*args, **kwargs):
        raise AssertionError("the export loaded something before checking its output")

    for name in ("load_checkpoint", "latest_checkpoint", "resolve_model", "load_model", "load_reward_model"):
        monkeypatch.setattr(export, name, loads)
    return tmp_path / "r"


INSIDE = "the run's checkpoint directory {run}/checkpoints, which the checkpoint store manages"


@pytest.mark.parametrize("out, message", [  # {root} the run's parent, {run} the run
    ("afile/sub", "output directory {root}/afile/sub: {root}/afile is a file, not a directory"),
    ("r", "output directory {run} is the run directory {run}; choose a new one"),
    (".", "output directory {root} holds the run directory {run}; choose a new one"),
    ("r/checkpoints", "output directory {run}/checkpoints is inside " + INSIDE),
    ("r/checkpoints/step-1/hf", "output directory {run}/checkpoints/step-1/hf is inside " + INSIDE),
    ("r/checkpoints/hf", "output directory {run}/checkpoints/hf is inside " + INSIDE),
])
def test_export_run_checks_the_output_before_loading(run_dir, out, message):
    root = run_dir.parent
    (root / "afile").write_text("mine")
    with pytest.raises(ExportError) as err:
        export_run(run_dir, root / out if out != "." else root)
    assert message.format(root=root, run=run_dir) in str(err.value)
    assert (root / "afile").read_text() == "mine"
    assert not (run_dir / "checkpoints" / "hf").exists()


def test_an_output_inside_the_checkpoint_given(run_dir, tmp_path):
    elsewhere = tmp_path / "saved" / "step-3"
    elsewhere.mkdir(parents=True)
    with pytest.raises(ExportError, match=f"output directory {elsewhere / 'hf'} is inside the checkpoint {elsewhere}"):
        export_run(run_dir, elsewhere / "hf", checkpoint=elsewhere)
