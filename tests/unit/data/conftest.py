"""A tiny character-level tokenizer built on the spot (no hub, no model code)."""

from __future__ import annotations

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
CHARS = [chr(i) for i in range(32, 127)] + ["\n"]
VOCAB = {t: i for i, t in enumerate(SPECIALS + CHARS)}
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_char_tokenizer(*, chat_template: str | None = CHATML, bos: bool = False,
                        eos: bool = True) -> PreTrainedTokenizerFast:
    """One token per character; ``bos`` adds a ``<s>`` post-processor (like Llama)."""
    tk = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<|endoftext|>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    if bos:
        tk.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", VOCAB["<s>"])]
        )
    kwargs = {"eos_token": "<|im_end|>"} if eos else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
        chat_template=chat_template,
        **kwargs,
    )


def as_text(tokenizer: PreTrainedTokenizerFast, ids: list[int]) -> str:
    """The tokens of ``ids`` concatenated (exact, no cleanup)."""
    return "".join(tokenizer.convert_ids_to_tokens(ids))


@pytest.fixture(scope="session")
def chatml_tok() -> PreTrainedTokenizerFast:
    return make_char_tokenizer()


@pytest.fixture(scope="session")
def plain_tok() -> PreTrainedTokenizerFast:
    return make_char_tokenizer(chat_template=None)


@pytest.fixture(scope="session")
def make_tok():
    """The tokenizer factory, for tests that need a variant (BOS, no EOS, no template)."""
    return make_char_tokenizer


@pytest.fixture(scope="session")
def tok_text():
    return as_text
