"""Text holding a lone surrogate (legal in JSON as ``\\ud800``, or text decoded with
``surrogateescape``) has no UTF-8 form, so no tokenizer encodes it: in any text the
tokenizer would see (the prompt, its messages' roles, contents and text parts, an SFT
completion, a preference pair's responses) it is a bad row naming the file, row and
field, which ``data.on_bad_row: skip`` skips; in ``data.system_prompt`` it stops loading
naming the key. Text the tokenizer never sees (other fields) is left alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from rltune.config.schema import DataConfig
from rltune.data.loaders import DataError, load_prompts

GOOD = '{"prompt": "1+1=", "completion": "2", "chosen": "2", "rejected": "3"}'
HINT = ", or set data.on_bad_row=skip to skip such rows"

# (row as JSON text, mode, what the message names)
BAD = {
    "text_prompt": ('{"prompt": "\\ud800 1+1=", "completion": "2"}', "rl",
                    "the prompt field 'prompt' holds a lone surrogate \\ud800 at character 1"),
    "message_content": ('{"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "ab\\udc80"}]}',
                        "rl", "message 2 of 'prompt' holds a lone surrogate \\udc80 at character 3"),
    "message_role": ('{"prompt": [{"role": "us\\udfffer", "content": "a"}]}', "rl",
                     "the role of message 1 of 'prompt' holds a lone surrogate \\udfff at character 3"),
    "text_part": ('{"prompt": [{"role": "user", "content": [{"type": "text", "text": "ok"}, '
                  '{"type": "text", "text": "x\\ud800"}]}]}', "rl",
                  "part 2 of message 1 of 'prompt' holds a lone surrogate \\ud800 at character 2"),
    "completion": ('{"prompt": "1+1=", "completion": "2\\ud800"}', "sft",
                   "the completion field 'completion' holds a lone surrogate \\ud800 at character 2"),
    "chosen": ('{"prompt": "1+1=", "chosen": "\\udcff2", "rejected": "3"}', "pairs",
               "the response field 'chosen' holds a lone surrogate \\udcff at character 1"),
    "rejected_messages": ('{"prompt": "1+1=", "chosen": "2", "rejected": [{"role": "user", "content": "1+1="}, '
                          '{"role": "assistant", "content": "3\\ud800"}]}', "pairs",
                          "message 2 of 'rejected' holds a lone surrogate \\ud800 at character 2"),
}
MODES = {"rl": {}, "sft": {"with_completion": True}, "pairs": {"with_pairs": True}}


@pytest.mark.parametrize("template", [True, False], ids=["chat_template", "plain"])
@pytest.mark.parametrize("name", sorted(BAD))
def test_a_lone_surrogate_is_a_bad_row_naming_file_row_and_field(tmp_path: Path, chatml_tok, name: str,
                                                                  template: bool) -> None:
    row, mode, named = BAD[name]
    src = tmp_path / f"{name}.jsonl"
    src.write_text("\n".join([GOOD, row, GOOD]) + "\n", encoding="ascii")
    with pytest.raises(DataError) as info:
        load_prompts(str(src), DataConfig(chat_template=template), chatml_tok, **MODES[mode])
    assert str(info.value) == (
        f"{src}: row 2: {named}, which no tokenizer encodes; fix the text's encoding{HINT}")
    skip = load_prompts(str(src), DataConfig(chat_template=template, on_bad_row="skip"), chatml_tok,
                        **MODES[mode])
    assert [p.id for p in skip.prompts] == [f"{name}.jsonl:1", f"{name}.jsonl:3"]
    assert skip.skipped == 1 and skip.skip_examples == [str(info.value).removesuffix(HINT)]


def test_text_the_tokenizer_never_sees_and_surrogate_pairs_are_kept(tmp_path: Path, chatml_tok) -> None:
    src = tmp_path / "d.jsonl"
    src.write_text("\n".join([
        '{"prompt": "1+1=", "answer": "2 \\ud800", "note": ["\\udc80"]}',
        '{"prompt": "\\ud800 1+1="}',
        '{"prompt": "2+2= \\ud83d\\ude00", "answer": "4"}',  # an escaped pair is one character
    ]) + "\n", encoding="ascii")
    ps = load_prompts(str(src), DataConfig(on_bad_row="skip"), chatml_tok)
    assert [p.id for p in ps.prompts] == ["d.jsonl:1", "d.jsonl:3"] and ps.skipped == 1
    assert ps.prompts[0].meta == {"answer": "2 \ud800", "note": ["\udc80"]}
    assert ps.prompts[1].text == "2+2= \U0001f600"


@pytest.mark.parametrize("template", [True, False], ids=["chat_template", "plain"])
def test_a_lone_surrogate_in_the_system_prompt_names_the_key(tmp_path: Path, chatml_tok, template: bool) -> None:
    src = tmp_path / "d.jsonl"
    src.write_text(GOOD + "\n", encoding="ascii")
    cfg = DataConfig(system_prompt="be \udcff brief", chat_template=template, on_bad_row="skip")
    with pytest.raises(DataError) as info:
        load_prompts(str(src), cfg, chatml_tok)
    assert str(info.value) == ("data.system_prompt holds a lone surrogate \\udcff at character 4, which no "
                               "tokenizer encodes; fix the text's encoding")


def test_unencodable_names_the_first_lone_surrogate() -> None:
    from rltune.data.chat import unencodable

    assert unencodable("caf\u00e9 \U0001f600", "x") is None
    assert unencodable([{"type": "image"}, {"type": "text", "text": "ok"}], "x") is None
    assert unencodable("ab\udc80\ud800", "the text") == (
        "the text holds a lone surrogate \\udc80 at character 3, which no tokenizer encodes")
    assert unencodable([{"type": "image"}, {"type": "text", "text": "\ud800"}], "message 1") == (
        "part 2 of message 1 holds a lone surrogate \\ud800 at character 1, which no tokenizer encodes")
