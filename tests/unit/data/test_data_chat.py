"""Prompt rendering: exact token strings for every (prompt form, template) pair."""

from __future__ import annotations

import pytest

from rltune.data.chat import encode_completion, encode_prompt, render_plain
from rltune.data.records import Prompt

MSGS = [{"role": "user", "content": "hi"}]


def test_text_with_chat_template_is_one_user_message(chatml_tok, tok_text):
    ids = encode_prompt(chatml_tok, Prompt(id="a", text="37+45="))
    assert tok_text(chatml_tok, ids) == (
        "<|im_start|>user\n37+45=<|im_end|>\n<|im_start|>assistant\n"
    )
    # The chat-template markers are single tokens, every other character one token.
    assert len(ids) == 3 + len("user\n37+45=") + len("\n") + len("assistant\n")


def test_system_prompt_goes_first(chatml_tok, tok_text):
    ids = encode_prompt(chatml_tok, Prompt(id="a", text="1+1="), system_prompt="Be brief.")
    assert tok_text(chatml_tok, ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    )


def test_row_system_message_wins_over_system_prompt(chatml_tok, tok_text):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]
    ids = encode_prompt(chatml_tok, Prompt(id="a", messages=msgs), system_prompt="other")
    assert tok_text(chatml_tok, ids) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    )


def test_messages_without_template_use_plain_format(plain_tok, tok_text):
    msgs = [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "3+3="}]
    ids = encode_prompt(plain_tok, Prompt(id="a", messages=msgs), system_prompt="S")
    assert tok_text(plain_tok, ids) == (
        "system: S\nuser: 2+2=\nassistant: 4\nuser: 3+3=\nassistant: "
    )


def test_chat_template_switched_off(chatml_tok, tok_text):
    ids = encode_prompt(chatml_tok, Prompt(id="a", messages=MSGS), use_chat_template=False)
    assert tok_text(chatml_tok, ids) == "user: hi\nassistant: "
    ids = encode_prompt(chatml_tok, Prompt(id="a", text="raw"), use_chat_template=False)
    assert tok_text(chatml_tok, ids) == "raw"


def test_text_without_template_is_used_as_is(plain_tok, tok_text):
    assert tok_text(plain_tok, encode_prompt(plain_tok, Prompt(id="a", text="7*6="))) == "7*6="
    ids = encode_prompt(plain_tok, Prompt(id="a", text="7*6="), system_prompt="S")
    assert tok_text(plain_tok, ids) == "S\n7*6="


def test_plain_text_gets_bos_but_template_and_completion_do_not(make_tok, tok_text):
    bos_tok = make_tok(chat_template=None, bos=True)
    assert tok_text(bos_tok, encode_prompt(bos_tok, Prompt(id="a", text="x"))) == "<s>x"
    assert tok_text(bos_tok, encode_completion(bos_tok, "42")) == "42<|im_end|>"
    bos_chat = make_tok(bos=True)
    ids = encode_prompt(bos_chat, Prompt(id="a", text="x"))
    assert tok_text(bos_chat, ids) == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"


def test_encode_completion_ends_with_eos(chatml_tok):
    ids = encode_completion(chatml_tok, "82")
    vocab = chatml_tok.get_vocab()
    assert ids == [vocab["8"], vocab["2"], vocab["<|im_end|>"]]
    assert ids[-1] == chatml_tok.eos_token_id


def test_encode_completion_needs_eos(make_tok):
    with pytest.raises(ValueError, match="eos_token"):
        encode_completion(make_tok(eos=False), "82")


def test_render_plain():
    assert render_plain([]) == "assistant: "
    assert render_plain([{"role": "user", "content": "a\nb"}]) == "user: a\nb\nassistant: "


class _TemplateReturns:
    """Stands in for tokenizers whose apply_chat_template returns other container types."""

    chat_template = "x"

    def __init__(self, out):
        self.out = out
        self.calls = []

    def apply_chat_template(self, messages, **kwargs):
        self.calls.append((messages, kwargs))
        return self.out


@pytest.mark.parametrize(
    "out", [[5, 6, 7], {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]}, [[5, 6, 7]]]
)
def test_apply_chat_template_return_types(out):
    tok = _TemplateReturns(out)
    assert encode_prompt(tok, Prompt(id="a", text="q"), system_prompt="S") == [5, 6, 7]
    messages, kwargs = tok.calls[0]
    assert messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]
    assert kwargs["add_generation_prompt"] is True and kwargs["tokenize"] is True


def test_apply_chat_template_batch_of_two_is_an_error():
    with pytest.raises(ValueError, match="2 sequences"):
        encode_prompt(_TemplateReturns([[1], [2]]), Prompt(id="a", text="q"))
