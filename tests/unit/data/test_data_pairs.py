"""Preference pairs: load_prompts(with_pairs=True) for text and chat rows, the bad rows,
and collate_pairs on hand-written ids."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from datasets import Dataset

from rltune.config.schema import DataConfig
from rltune.data.collate import collate_pairs
from rltune.data.loaders import DataError, load_prompts
from rltune.data.records import Prompt

CHAT_OPEN = "<|im_start|>user\n"
CHAT_CLOSE = "<|im_end|>\n<|im_start|>assistant\n"
EOS = "<|im_end|>"

TEXT_PAIR = {"id": "p1", "prompt": "2+3=", "chosen": "5", "rejected": "6", "level": 1}
USER = {"role": "user", "content": "2+3="}


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _load(tmp_path: Path, rows: list, tok, **cfg):
    src = _write_jsonl(tmp_path / "pairs.jsonl", rows)
    return load_prompts(str(src), DataConfig(**cfg), tok, with_pairs=True)


# ---------------------------------------------------------------- loading


def test_text_pair(tmp_path, chatml_tok, tok_text):
    p = _load(tmp_path, [TEXT_PAIR], chatml_tok).prompts[0]
    assert (p.text, p.messages) == ("2+3=", None)
    assert tok_text(chatml_tok, p.input_ids) == CHAT_OPEN + "2+3=" + CHAT_CLOSE
    assert tok_text(chatml_tok, p.meta["chosen_ids"]) == "5" + EOS
    assert tok_text(chatml_tok, p.meta["rejected_ids"]) == "6" + EOS
    # the raw response fields are replaced by their texts; other fields are kept
    assert p.meta == {
        "id": "p1", "level": 1, "chosen": "5", "rejected": "6",
        "chosen_ids": p.meta["chosen_ids"], "rejected_ids": p.meta["rejected_ids"],
    }


@pytest.mark.parametrize("chosen,rejected", [
    ([{"role": "assistant", "content": "5"}], [{"role": "assistant", "content": "6"}]),
    # the conversational form that repeats the prompt before the response
    ([USER, {"role": "assistant", "content": "5"}], [USER, {"role": "assistant", "content": "6"}]),
    # one of each
    ("5", [USER, {"role": "assistant", "content": "6"}]),
], ids=["assistant-only", "with-prompt", "mixed"])
@pytest.mark.parametrize("prompt", ["2+3=", [USER]], ids=["text-prompt", "chat-prompt"])
def test_chat_responses_render_like_text(tmp_path, chatml_tok, prompt, chosen, rejected):
    """Every form of the same pair gives the same tokens as the plain-text pair."""
    text = _load(tmp_path, [TEXT_PAIR], chatml_tok).prompts[0]
    row = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    p = _load(tmp_path, [row], chatml_tok).prompts[0]
    assert p.input_ids == text.input_ids
    assert p.meta["chosen_ids"] == text.meta["chosen_ids"]
    assert p.meta["rejected_ids"] == text.meta["rejected_ids"]
    assert (p.meta["chosen"], p.meta["rejected"]) == ("5", "6")


def test_system_prompt_and_plain_format_are_shared_by_both_responses(tmp_path, chatml_tok, tok_text):
    sys_msg = {"role": "system", "content": "S"}
    row = {"prompt": [sys_msg, USER], "chosen": [sys_msg, USER, {"role": "assistant", "content": "5"}],
           "rejected": "66"}
    p = _load(tmp_path, [row], chatml_tok, chat_template=False).prompts[0]
    assert tok_text(chatml_tok, p.input_ids) == "system: S\nuser: 2+3=\nassistant: "
    assert tok_text(chatml_tok, p.meta["chosen_ids"]) == "5" + EOS
    assert tok_text(chatml_tok, p.meta["rejected_ids"]) == "66" + EOS


def test_config_names_the_fields(tmp_path, chatml_tok, tok_text):
    row = {"q": "x?", "good": "yes", "bad": "no", "chosen": "kept as meta"}
    cfg = dict(prompt_field="q", chosen_field="good", rejected_field="bad", chat_template=False)
    p = _load(tmp_path, [row], chatml_tok, **cfg).prompts[0]
    assert tok_text(chatml_tok, p.input_ids) == "x?"
    assert (p.meta["chosen"], p.meta["rejected"]) == ("yes", "no")
    assert "good" not in p.meta and "bad" not in p.meta


def test_parquet_and_datasets_dir_agree_with_jsonl(tmp_path, chatml_tok):
    rows = [
        {"prompt": [USER], "chosen": [{"role": "assistant", "content": "5"}],
         "rejected": [{"role": "assistant", "content": "6"}]},
        {"prompt": [{"role": "user", "content": "1+1="}],
         "chosen": [{"role": "assistant", "content": "2"}],
         "rejected": [{"role": "assistant", "content": "11"}]},
    ]
    jsonl = _write_jsonl(tmp_path / "d.jsonl", rows)
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    hf_dir = tmp_path / "d_hf"
    Dataset.from_list(rows).save_to_disk(str(hf_dir))
    loaded = [load_prompts(str(s), DataConfig(), chatml_tok, with_pairs=True).prompts
              for s in (jsonl, parquet, hf_dir)]
    strip = lambda ps: [(p.input_ids, p.meta["chosen_ids"], p.meta["rejected_ids"]) for p in ps]
    assert strip(loaded[0]) == strip(loaded[1]) == strip(loaded[2])


def test_builtin_preference_task(chatml_tok, tok_text):
    ps = load_prompts("builtin:arith_prefs/eval", DataConfig(chat_template=False), chatml_tok,
                      with_pairs=True)
    assert len(ps) == 300 and ps.skipped == 0
    for p in ps.prompts:
        a, b = (int(x) for x in p.text.rstrip("=").split("+"))
        assert tok_text(chatml_tok, p.meta["chosen_ids"]) == f"{a + b}{EOS}"
        assert p.meta["rejected"] != str(a + b)


def test_with_completion_and_with_pairs_exclude_each_other(tmp_path, chatml_tok):
    src = _write_jsonl(tmp_path / "d.jsonl", [TEXT_PAIR])
    with pytest.raises(ValueError, match="exclude each other"):
        load_prompts(str(src), DataConfig(), chatml_tok, with_completion=True, with_pairs=True)


GOOD = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}
ASSISTANT = {"role": "assistant", "content": "2"}
BAD_PAIRS = {
    "missing_chosen": ({"prompt": "a", "rejected": "x"},
                       ["no response field 'chosen'", "data.chosen_field"]),
    "null_rejected": ({"prompt": "a", "chosen": "x", "rejected": None},
                      ["no response field 'rejected'", "data.rejected_field"]),
    "empty_chosen": ({"prompt": "a", "chosen": "", "rejected": "x"},
                     ["'chosen' is an empty string", "data.chosen_field"]),
    "wrong_type": ({"prompt": "a", "chosen": 5, "rejected": "x"}, ["got int"]),
    "empty_list": ({"prompt": "a", "chosen": [], "rejected": "x"},
                   ["'chosen' is an empty list of messages"]),
    "ends_with_user": ({"prompt": "a", "chosen": "x",
                        "rejected": [{"role": "user", "content": "y"}]},
                       ["'rejected' must end with the one assistant message", "['user']",
                        "data.rejected_field"]),
    "other_prompt": ({"prompt": "a", "chosen": "x",
                      "rejected": [{"role": "user", "content": "b"}, ASSISTANT]},
                     ["roles are ['user', 'assistant']", "data.prompt_field"]),
    "empty_messages": ({"prompt": "a", "chosen": [{"role": "assistant", "content": ""}],
                        "rejected": "x"},
                       ["every message of the field 'chosen' is empty"]),
    "empty_assistant": ({"prompt": "a", "rejected": "x", "chosen": [
                            {"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]},
                        ["the assistant message of 'chosen' is empty"]),
    "message_extra_key": ({"prompt": "a", "rejected": "x",
                           "chosen": [{"role": "assistant", "content": "2", "w": 1}]},
                          ["unexpected keys ['w']"]),
    "tie": ({"prompt": "a", "chosen": "same", "rejected": [ASSISTANT | {"content": "same"}]},
            ["chosen and rejected responses are the same (5 tokens)", "a tie"]),
}


@pytest.mark.parametrize("name", sorted(BAD_PAIRS))
def test_bad_pair_names_file_row_and_setting(tmp_path, chatml_tok, name):
    bad, expected = BAD_PAIRS[name]
    src = _write_jsonl(tmp_path / f"{name}.jsonl", [GOOD, bad, GOOD])
    with pytest.raises(DataError) as info:
        load_prompts(str(src), DataConfig(), chatml_tok, with_pairs=True)
    message = str(info.value)
    for part in [f"{name}.jsonl", "row 2:", "data.on_bad_row=skip", *expected]:
        assert part in message, (part, message)
    skip = load_prompts(str(src), DataConfig(on_bad_row="skip"), chatml_tok, with_pairs=True)
    assert [p.id for p in skip.prompts] == [f"{name}.jsonl:1", f"{name}.jsonl:3"]
    # the skipped row is reported as the error was, less the hint to skip such rows
    assert skip.skipped == 1 and skip.skip_examples == [message[: message.index(", or set")]]
    assert "on_bad_row" not in skip.skip_examples[0]


def test_sft_rows_are_not_pairs(tmp_path, chatml_tok):
    src = _write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(DataError, match=r"sft.jsonl: row 1: no response field 'chosen'"):
        load_prompts(str(src), DataConfig(), chatml_tok, with_pairs=True)


# ---------------------------------------------------------------- collate_pairs


def _pair(pid: str, prompt: list[int], chosen: list[int], rejected: list[int]) -> Prompt:
    return Prompt(id=pid, text="unused", input_ids=prompt,
                  meta={"chosen_ids": chosen, "rejected_ids": rejected})


PAIRS = [
    _pair("a", [11, 12, 13], [21, 22, 9], [31, 9]),
    _pair("b", [14], [23, 9], [32, 33, 34, 35, 9]),
]


def test_collate_pairs_by_hand():
    batch = collate_pairs(PAIRS, pad_id=0)
    assert batch.prompt_len == 3 and batch.completion_len == 5
    assert batch.input_ids.tolist() == [
        [11, 12, 13, 21, 22, 9, 0, 0],   # chosen 0
        [11, 12, 13, 31, 9, 0, 0, 0],    # rejected 0
        [0, 0, 14, 23, 9, 0, 0, 0],      # chosen 1
        [0, 0, 14, 32, 33, 34, 35, 9],   # rejected 1
    ]
    assert batch.attention_mask.tolist() == [
        [1, 1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 1, 1, 1, 1],
    ]
    assert batch.loss_mask.tolist() == [
        [1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1],
    ]
    assert batch.loss_mask.dtype == torch.float32
    assert batch.ref_seq_logps is None and batch.advantages is None


def test_collate_pairs_carries_reference_logps_interleaved():
    ref = torch.tensor([[-1.5, -2.5], [-3.5, -4.5]], dtype=torch.float64)
    batch = collate_pairs(PAIRS, pad_id=0, ref_logps=ref)
    assert batch.ref_seq_logps.dtype == torch.float32
    assert batch.ref_seq_logps.tolist() == [-1.5, -2.5, -3.5, -4.5]
    # 1-D, so it follows rows through select and survives trim
    pair1 = batch.select(slice(2, 4)).trim()
    assert pair1.ref_seq_logps.tolist() == [-3.5, -4.5]
    assert pair1.prompt_len == 1 and pair1.input_ids.tolist()[0] == [14, 23, 9, 0, 0, 0]


def test_collate_pairs_errors():
    with pytest.raises(ValueError, match=r"shape \(2,\), expected \(2, 2\)"):
        collate_pairs(PAIRS, 0, ref_logps=torch.zeros(2))
    with pytest.raises(ValueError, match="'x' has no chosen_ids.*with_pairs=True"):
        collate_pairs([Prompt(id="x", text="t", input_ids=[1], meta={"completion_ids": [2]})], 0)
    with pytest.raises(ValueError, match="no prompts"):
        collate_pairs([], 0)
