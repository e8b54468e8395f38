"""load_prompts: every source gives the same Prompts; every bad row names file and row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, DatasetDict

from rltune.config.schema import DataConfig
from rltune.data.loaders import DataError, load_prompts

CHAT_OPEN = "<|im_start|>user\n"
CHAT_CLOSE = "<|im_end|>\n<|im_start|>assistant\n"

TEXT_ROWS = [
    {"id": "q1", "prompt": "2+3=", "answer": "5", "completion": "5", "level": 1},
    {"id": "q2", "prompt": "10+7=", "answer": "17", "completion": "17", "level": 2},
]
MESSAGE_ROWS = [
    {"id": "m1", "prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}],
     "answer": "x", "completion": "y"},
    {"id": "m2", "prompt": [{"role": "user", "content": "bc"}], "answer": "z", "completion": "w"},
]


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _write_all(tmp_path: Path, rows: list[dict]) -> list[str]:
    jsonl = _write_jsonl(tmp_path / "d.jsonl", rows)
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    hf_dir = tmp_path / "d_hf"
    Dataset.from_list(rows).save_to_disk(str(hf_dir))
    return [str(jsonl), str(parquet), str(hf_dir)]


@pytest.mark.parametrize("rows", [TEXT_ROWS, MESSAGE_ROWS], ids=["text", "messages"])
def test_jsonl_parquet_and_datasets_dir_agree(tmp_path, chatml_tok, rows):
    cfg = DataConfig(id_field="id")
    loaded = [
        load_prompts(src, cfg, chatml_tok, with_completion=True)
        for src in _write_all(tmp_path, rows)
    ]
    assert loaded[0].prompts == loaded[1].prompts == loaded[2].prompts
    assert [p.id for p in loaded[0].prompts] == [r["id"] for r in rows]
    assert all(s.skipped == 0 for s in loaded)


def test_text_rows_content(tmp_path, chatml_tok, tok_text):
    src = _write_jsonl(tmp_path / "d.jsonl", TEXT_ROWS)
    ps = load_prompts(str(src), DataConfig(), chatml_tok)
    first = ps.prompts[0]
    assert (first.id, first.text, first.messages) == ("d.jsonl:1", "2+3=", None)
    assert tok_text(chatml_tok, first.input_ids) == CHAT_OPEN + "2+3=" + CHAT_CLOSE
    # Other fields unchanged in meta; the completion field is the SFT target, not meta.
    assert first.meta == {"id": "q1", "answer": "5", "level": 1}
    assert (ps.skipped, ps.source, len(ps)) == (0, str(src), 2)


def test_messages_rows_content(tmp_path, chatml_tok, tok_text):
    src = _write_jsonl(tmp_path / "d.jsonl", MESSAGE_ROWS)
    p = load_prompts(str(src), DataConfig(system_prompt="ignored"), chatml_tok).prompts[0]
    assert p.messages == MESSAGE_ROWS[0]["prompt"] and p.text is None
    assert tok_text(chatml_tok, p.input_ids) == (
        "<|im_start|>system\nS<|im_end|>\n" + CHAT_OPEN + "a" + CHAT_CLOSE
    )


def test_sft_completion_in_meta(tmp_path, chatml_tok, tok_text):
    src = _write_jsonl(tmp_path / "d.jsonl", TEXT_ROWS)
    p = load_prompts(str(src), DataConfig(), chatml_tok, with_completion=True).prompts[1]
    assert p.meta["completion"] == "17"
    assert tok_text(chatml_tok, p.meta["completion_ids"]) == "17<|im_end|>"
    assert set(p.meta) == {"id", "answer", "level", "completion", "completion_ids"}


def test_config_keys_change_rendering_and_fields(tmp_path, chatml_tok, tok_text):
    rows = [{"question": "q?", "target": "t", "key": 7}]
    src = str(_write_jsonl(tmp_path / "d.jsonl", rows))
    cfg = DataConfig(prompt_field="question", completion_field="target", id_field="key",
                     chat_template=False, system_prompt="S")
    p = load_prompts(src, cfg, chatml_tok, with_completion=True).prompts[0]
    assert p.id == "7" and tok_text(chatml_tok, p.input_ids) == "S\nq?"
    assert p.meta["completion"] == "t" and p.meta["key"] == 7 and "target" not in p.meta


def test_row_numbers_are_line_numbers(tmp_path, chatml_tok):
    src = _write_jsonl(tmp_path / "d.jsonl", [TEXT_ROWS[0], "", "   ", TEXT_ROWS[1]])
    ps = load_prompts(str(src), DataConfig(), chatml_tok)
    assert [p.id for p in ps.prompts] == ["d.jsonl:1", "d.jsonl:4"]


GOOD = {"prompt": "1+1=", "completion": "2"}
BAD_ROWS = {
    "missing_prompt": ({"question": "x", "answer": "1"}, False,
                       ["no field 'prompt'", "['answer', 'question']", "data.prompt_field"]),
    "null_prompt": ({"prompt": None}, False, ["no field 'prompt'", "data.prompt_field"]),
    "empty_prompt": ({"prompt": "  "}, False, ["'prompt' is empty"]),
    "empty_messages": ({"prompt": []}, False, ["empty list of messages"]),
    "message_not_object": ({"prompt": ["hi"]}, False, ["message 1", "not an object"]),
    "message_no_role": ({"prompt": [{"content": "hi"}]}, False, ["message 1", "'role'"]),
    "message_extra_key": ({"prompt": [{"role": "user", "content": "a", "x": 1}]}, False,
                          ["unexpected keys ['x']"]),
    "all_messages_empty": ({"prompt": [{"role": "user", "content": ""}]}, False, ["empty"]),
    "prompt_wrong_type": ({"prompt": 5}, False, ["got int"]),
    "too_long": ({"prompt": "x" * 40}, False,
                 ["is 59 tokens", "data.max_prompt_tokens=30"]),
    "invalid_json": ('{"prompt": "a",', False, ["invalid JSON"]),
    # the row ends at column 16: it is reported there, not at the newline after it
    "cut_short": ('{"prompt": "a",', False, ["invalid JSON (Expecting property name enclosed in double quotes "
                                             "at column 16)"]),
    "duplicate_key": ('{"prompt": "a", "prompt": "b"}', False, ["the key 'prompt' appears twice in one object"]),
    "duplicate_nested_key": ('{"prompt": [{"role": "user", "content": "a", "role": "x"}]}', False,
                             ["the key 'role' appears twice"]),
    "not_an_object": ("[1, 2]", False, ["expected a JSON object, got list"]),
    "missing_completion": ({"prompt": "a"}, True, ["no completion field 'completion'",
                                                   "data.completion_field"]),
    "empty_completion": ({"prompt": "a", "completion": ""}, True, ["non-empty string"]),
}


@pytest.mark.parametrize("name", sorted(BAD_ROWS))
def test_bad_row_names_file_row_and_setting(tmp_path, chatml_tok, name):
    bad, sft, expected = BAD_ROWS[name]
    src = _write_jsonl(tmp_path / f"{name}.jsonl", [GOOD, bad, GOOD])
    cfg = DataConfig(max_prompt_tokens=30)
    with pytest.raises(DataError) as info:
        load_prompts(str(src), cfg, chatml_tok, with_completion=sft)
    message = str(info.value)
    for part in [f"{name}.jsonl", "row 2:", "data.on_bad_row=skip", *expected]:
        assert part in message, (part, message)
    # The same file loads in skip mode, minus the bad row.
    skip = load_prompts(str(src), DataConfig(max_prompt_tokens=30, on_bad_row="skip"),
                        chatml_tok, with_completion=sft)
    assert [p.id for p in skip.prompts] == [f"{name}.jsonl:1", f"{name}.jsonl:3"]
    assert skip.skipped == 1
    # the same message, without advice to set what is already set
    hint = ", or set data.on_bad_row=skip to skip such rows"
    assert message.endswith(hint) and skip.skip_examples == [message.removesuffix(hint)]


@pytest.mark.parametrize("field", ["prompt", "completion"])
def test_a_field_named_like_a_reward_argument_is_refused_where_rewards_read_it(tmp_path, chatml_tok, field):
    # fn(prompt, completion, **fields) would get the argument twice on every call
    src = _write_jsonl(tmp_path / "d.jsonl", [{"question": "1+1=", field: "x", "answer": "2"}])
    cfg = DataConfig(prompt_field="question", completion_field="target")
    with pytest.raises(DataError, match=rf"d.jsonl: row 1: the field '{field}' would reach the reward "
                                        rf"functions as a keyword.*data.prompt_field: {field}"):
        load_prompts(str(src), cfg, chatml_tok, fields_are_keywords=True)
    # without per-sample rewards (batched ones read prompts[i].meta, environments, SFT) it is only meta
    assert load_prompts(str(src), cfg, chatml_tok).prompts[0].meta[field] == "x"


def test_prompt_of_exactly_max_tokens_is_kept(tmp_path, chatml_tok):
    # 19 tokens of chat markup around the prompt text (see CHAT_OPEN / CHAT_CLOSE).
    assert len(chatml_tok(CHAT_OPEN + CHAT_CLOSE, add_special_tokens=False)["input_ids"]) == 19
    src = str(_write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x" * 11}]))
    assert len(load_prompts(src, DataConfig(max_prompt_tokens=30), chatml_tok)) == 1
    with pytest.raises(DataError, match="is 30 tokens"):
        load_prompts(src, DataConfig(max_prompt_tokens=29), chatml_tok)


def test_duplicate_and_missing_ids(tmp_path, chatml_tok):
    rows = [{"prompt": "a", "id": 1}, {"prompt": "b", "id": 2}, {"prompt": "c", "id": 1},
            {"prompt": "d"}]
    src = str(_write_jsonl(tmp_path / "ids.jsonl", rows))
    with pytest.raises(DataError, match=r"ids.jsonl: row 3: prompt id '1' already used by row 1"):
        load_prompts(src, DataConfig(id_field="id"), chatml_tok)
    ps = load_prompts(src, DataConfig(id_field="id", on_bad_row="skip"), chatml_tok)
    assert [p.id for p in ps.prompts] == ["1", "2"] and ps.skipped == 2
    assert "row 4: no id in field 'id'" in ps.skip_examples[1]


def test_skip_counts_and_all_bad(tmp_path, chatml_tok):
    rows = [{"prompt": ""}, GOOD, "not json", {"x": 1}, GOOD]
    src = str(_write_jsonl(tmp_path / "mixed.jsonl", rows))
    ps = load_prompts(src, DataConfig(on_bad_row="skip"), chatml_tok)
    assert ([p.id for p in ps.prompts], ps.skipped) == (["mixed.jsonl:2", "mixed.jsonl:5"], 3)
    assert [m.split(": ")[1] for m in ps.skip_examples] == ["row 1", "row 3", "row 4"]
    all_bad = str(_write_jsonl(tmp_path / "bad.jsonl", [{"prompt": ""}, {"x": 1}]))
    with pytest.raises(DataError, match=r"bad.jsonl: no usable prompts \(all 2 rows were bad"):
        load_prompts(all_bad, DataConfig(on_bad_row="skip"), chatml_tok)


def test_bad_row_in_parquet_names_file_and_row(tmp_path, chatml_tok):
    rows = [{"prompt": "a"}, {"prompt": "b"}, {"prompt": ""}]
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError, match=r"p.parquet: row 3: the prompt field 'prompt' is empty"):
        load_prompts(str(path), DataConfig(), chatml_tok)


def test_source_errors(tmp_path, chatml_tok):
    cfg = DataConfig()
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match="nope.jsonl' does not exist"):
        load_prompts(str(missing), cfg, chatml_tok)
    empty = _write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(DataError, match="empty.jsonl: no usable prompts \\(it has no rows\\)"):
        load_prompts(str(empty), cfg, chatml_tok)
    csv = tmp_path / "d.csv"
    csv.write_text("prompt\na\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        load_prompts(str(csv), cfg, chatml_tok)
    not_hf = tmp_path / "plain_dir"
    not_hf.mkdir()
    with pytest.raises(DataError, match="not one written by"):
        load_prompts(str(not_hf), cfg, chatml_tok)
    split_dir = tmp_path / "splits"
    DatasetDict({"train": Dataset.from_list([GOOD])}).save_to_disk(str(split_dir))
    with pytest.raises(DataError, match=r"several splits \['train'\]"):
        load_prompts(str(split_dir), cfg, chatml_tok)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet")
    with pytest.raises(DataError, match="cannot read parquet file"):
        load_prompts(str(broken), cfg, chatml_tok)


@pytest.mark.parametrize("damage", ["arrow", "state"])
def test_a_damaged_datasets_directory_is_named(tmp_path, chatml_tok, damage):
    saved = tmp_path / "d_hf"
    Dataset.from_list([GOOD] * 4).save_to_disk(str(saved))
    if damage == "arrow":
        arrow = next(saved.glob("*.arrow"))
        arrow.write_bytes(arrow.read_bytes()[:40])
    else:
        (saved / "state.json").write_text("{broken")
    with pytest.raises(DataError, match=r"d_hf': datasets cannot read this save_to_disk directory, a file in it is "
                                        r"damaged \(\w+: .*\); write it again"):
        load_prompts(str(saved), DataConfig(), chatml_tok)


def test_missing_extra_says_what_to_install(tmp_path, chatml_tok, monkeypatch):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD]), path)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"pip install 'rltune\[data\]'"):
        load_prompts(str(path), DataConfig(), chatml_tok)


def test_builtin_task(chatml_tok, tok_text):
    ps = load_prompts("builtin:arith_small/train", DataConfig(), chatml_tok, with_completion=True)
    assert len(ps) == 80 and ps.skipped == 0
    first = ps.prompts[0]
    assert first.id == "arith_small/train:1"
    a, b = first.text.rstrip("=").split("+")
    assert first.meta["answer"] == first.meta["completion"] == str(int(a) + int(b))
    assert tok_text(chatml_tok, first.input_ids) == CHAT_OPEN + first.text + CHAT_CLOSE
    assert tok_text(chatml_tok, first.meta["completion_ids"]) == first.meta["answer"] + "<|im_end|>"
    rl = load_prompts("builtin:arith/eval", DataConfig(id_field="id"), chatml_tok)
    assert len(rl) == 300 and rl.prompts[0].id == "arith-eval-0"
    assert "completion" not in rl.prompts[0].meta


@pytest.mark.parametrize("source,match", [
    ("builtin:nope/train", r"TASK one of \['arith', 'arith_prefs', 'arith_small', 'lookup', 'shapes', 'shapes_small'\]"),
    ("builtin:arith", "expected builtin:TASK/SPLIT"),
    ("builtin:arith/test", "'train', 'eval' and 'train-sloppy'"),
    ("builtin:arith_small/test", "'train' and 'eval'"),
])
def test_builtin_errors(chatml_tok, source, match):
    with pytest.raises(DataError, match=match):
        load_prompts(source, DataConfig(), chatml_tok)


@pytest.mark.parametrize(("template", "named"), [
    ("{{ raise_exception('System role not supported') }}", "TemplateError: System role not supported"),
    ("{% for m in messages %}{{ m.content }", "TemplateSyntaxError: "),
])
def test_a_chat_template_that_fails_is_named_with_the_row(tmp_path, make_tok, template, named):
    tok = make_tok(chat_template=template)
    src = _write_jsonl(tmp_path / "d.jsonl", [GOOD])
    with pytest.raises(DataError, match=r"d.jsonl: row 1: the model's chat template fails on this prompt \(" + named):
        load_prompts(str(src), DataConfig(), tok)


def test_sft_and_pairs_need_an_eos_token(tmp_path, make_tok):
    tok = make_tok()
    tok.eos_token = None
    src = _write_jsonl(tmp_path / "d.jsonl", [GOOD])
    with pytest.raises(DataError, match=r"d.jsonl: the model's tokenizer has no eos_token, and SFT targets end with EOS"):
        load_prompts(str(src), DataConfig(), tok, with_completion=True)
    assert load_prompts(str(src), DataConfig(), tok).prompts  # prompts alone need no EOS
