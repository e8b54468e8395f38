"""The wording of bad-row messages: json's own message read as a sentence, and no advice
to set ``data.on_bad_row=skip`` where it is already set."""

from __future__ import annotations

from pathlib import Path

import pytest

from rltune.config.schema import DataConfig
from rltune.data.loaders import DataError, load_prompts

GOOD = '{"prompt": "1+1="}'


@pytest.mark.parametrize(("line", "problem"), [
    ('{"prompt": "1+1=', "invalid JSON (Unterminated string starting at column 12)"),
    ('{"prompt": "a\tb"}', "invalid JSON (Invalid control character at column 14)"),
    ('{"prompt": "a" "b"}', "invalid JSON (Expecting ',' delimiter at column 16)"),
])
def test_json_error_reads_as_one_sentence(tmp_path: Path, chatml_tok, line, problem):
    src = tmp_path / "d.jsonl"
    src.write_text(f"{GOOD}\n{line}")  # a last newline would be read as a control character in the string
    with pytest.raises(DataError) as info:
        load_prompts(str(src), DataConfig(), chatml_tok)
    assert str(info.value).startswith(f"{src}: row 2: {problem}; ")
    assert "at at" not in str(info.value)


def test_skipped_rows_do_not_suggest_skipping(tmp_path: Path, chatml_tok):
    src = tmp_path / "d.jsonl"
    src.write_text(f'{GOOD}\n{{"question": "x"}}\n')
    loaded = load_prompts(str(src), DataConfig(on_bad_row="skip"), chatml_tok)
    assert loaded.skipped == 1
    [example] = loaded.skip_examples
    assert example.startswith(f"{src}: row 2: no field 'prompt'")
    assert "on_bad_row" not in example
    with pytest.raises(DataError, match="or set data.on_bad_row=skip to skip such rows$"):
        load_prompts(str(src), DataConfig(), chatml_tok)
