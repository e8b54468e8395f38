"""load_prompts with a vision-language model's processor: a row's images rendered once, to
the same ids and pixel inputs as the processor's own chat template gives; bad images named
with the row and the file."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from rltune.config.schema import DataConfig
from rltune.data.loaders import DataError, load_prompts

QUESTION = "How many red shapes?"


@pytest.fixture(scope="module")
def processor():
    """``builtin:tiny-vl``'s processor (a Qwen2-VL processor, 28x28 pixels per image token)."""
    from rltune.models.load import load_processor, resolve_model

    return load_processor(resolve_model("builtin:tiny-vl"))


def png(width: int = 112, height: int = 112, colour=(220, 20, 20)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


def pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


def plain(processor, messages: list[dict]) -> dict[str, torch.Tensor]:
    """The processor used plainly: its chat template on messages with the images in them."""
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=True, return_tensors="pt")


def image_message(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture()
def images(tmp_path: Path) -> dict[str, bytes]:
    """Two PNGs in ``tmp_path/imgs``: ``red.png`` 112x112 and ``blue.png`` 168x112."""
    (tmp_path / "imgs").mkdir()
    files = {"red.png": png(), "blue.png": png(168, 112, (10, 10, 230))}
    for name, data in files.items():
        (tmp_path / "imgs" / name).write_bytes(data)
    return files


def test_same_ids_and_pixels_as_the_processor_used_plainly(processor, tmp_path, images):
    row = {"prompt": image_message({"type": "image", "image": "imgs/red.png"},
                                   {"type": "text", "text": QUESTION}), "answer": "1"}
    (prompt,) = load_prompts(write_jsonl(tmp_path / "d.jsonl", [row]), DataConfig(), None,
                             processor=processor).prompts
    expected = plain(processor, image_message({"type": "image", "image": pil(images["red.png"])},
                                              {"type": "text", "text": QUESTION}))
    assert prompt.input_ids == expected["input_ids"][0].tolist()
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert prompt.input_ids.count(image_pad) == 16  # 112x112 pixels: 4x4 tokens of 28x28
    assert set(prompt.vision) == {"pixel_values", "image_grid_thw"}  # no token-aligned tensors
    torch.testing.assert_close(prompt.vision["pixel_values"], expected["pixel_values"], rtol=0, atol=0)
    assert prompt.vision["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert [i.source for i in prompt.images] == [str(tmp_path / "imgs" / "red.png")]
    assert prompt.images[0].data == images["red.png"]
    assert prompt.messages == image_message({"type": "image"}, {"type": "text", "text": QUESTION})
    assert prompt.meta == {"answer": "1"}


def test_the_images_field_goes_before_the_first_user_text_with_the_system_prompt(
    processor, tmp_path, images
):
    rows = [{"prompt": QUESTION, "images": ["imgs/red.png", "imgs/blue.png"]},
            {"prompt": [{"role": "user", "content": QUESTION}], "images": ["imgs/blue.png"]}]
    cfg = DataConfig(system_prompt="Answer with one word.")
    first, second = load_prompts(write_jsonl(tmp_path / "d.jsonl", rows), cfg, None,
                                 processor=processor).prompts
    system = {"role": "system", "content": [{"type": "text", "text": "Answer with one word."}]}
    red, blue = pil(images["red.png"]), pil(images["blue.png"])
    expected = plain(processor, [system, *image_message({"type": "image", "image": red},
                                                        {"type": "image", "image": blue},
                                                        {"type": "text", "text": QUESTION})])
    assert first.input_ids == expected["input_ids"][0].tolist()
    assert first.vision["image_grid_thw"].tolist() == [[1, 8, 8], [1, 8, 12]]  # images on dim 0
    assert first.vision["pixel_values"].shape[0] == 4 * (16 + 24)  # 2x2 patches of 14x14 per token
    assert first.messages == image_message({"type": "image"}, {"type": "image"},  # the system
                                           {"type": "text", "text": QUESTION})  # prompt: at render
    assert "images" not in first.meta and first.text is None
    assert [i.source.rsplit("/", 1)[1] for i in first.images] == ["red.png", "blue.png"]
    assert second.vision["image_grid_thw"].tolist() == [[1, 8, 12]]


def test_data_uri_bytes_and_the_datasets_dict_form_all_load(processor, tmp_path, images):
    red = images["red.png"]
    uri = "data:image/png;base64," + base64.b64encode(red).decode()
    rows = [{"prompt": QUESTION, "images": [red]},
            {"prompt": QUESTION, "images": [{"bytes": red, "path": "red.png"}]},
            {"prompt": QUESTION, "images": [{"bytes": None, "path": "imgs/red.png"}]},
            {"prompt": image_message({"type": "image_url", "image_url": {"url": uri}},
                                     {"type": "text", "text": QUESTION}), "images": None}]
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows[:1]), parquet)
    loaded = load_prompts(str(parquet), DataConfig(), None, processor=processor).prompts
    loaded += load_prompts(write_jsonl(tmp_path / "u.jsonl", rows[3:]), DataConfig(), None,
                           processor=processor).prompts
    dicts = tmp_path / "dicts.parquet"
    pq.write_table(pa.Table.from_pylist(rows[1:3]), dicts)
    loaded += load_prompts(str(dicts), DataConfig(), None, processor=processor).prompts
    assert [p.images[0].source for p in loaded] == [
        "row 1, image 1 (bytes)", "row 1, image 1 (data URI)", "row 1, image 1 (bytes)",
        str(tmp_path / "imgs" / "red.png")]
    assert {p.images[0].data for p in loaded} == {red}
    assert len({tuple(p.input_ids) for p in loaded}) == 1
    for p in loaded[1:]:
        torch.testing.assert_close(p.vision["pixel_values"], loaded[0].vision["pixel_values"])


def test_text_rows_with_a_processor_render_through_it_without_vision(processor, tmp_path):
    rows = [{"prompt": QUESTION}, {"prompt": [{"role": "user", "content": QUESTION}]}]
    loaded = load_prompts(write_jsonl(tmp_path / "d.jsonl", rows), DataConfig(), None,
                          processor=processor).prompts
    expected = plain(processor, image_message({"type": "text", "text": QUESTION}))
    for prompt in loaded:
        assert prompt.input_ids == expected["input_ids"][0].tolist()
        assert prompt.vision is None and prompt.images is None


def test_sft_and_preference_rows_carry_the_prompts_images(processor, tmp_path, images):
    sft = [{"prompt": QUESTION, "images": ["imgs/red.png"], "completion": "one"}]
    (row,) = load_prompts(write_jsonl(tmp_path / "s.jsonl", sft), DataConfig(), processor.tokenizer,
                          processor=processor, with_completion=True).prompts
    assert row.meta["completion_ids"] == [*processor.tokenizer("one")["input_ids"],
                                          processor.tokenizer.eos_token_id]
    assert row.vision["image_grid_thw"].tolist() == [[1, 8, 8]]
    pairs = [{"prompt": QUESTION, "images": ["imgs/red.png"], "chosen": "one", "rejected": "two"}]
    (pair,) = load_prompts(write_jsonl(tmp_path / "p.jsonl", pairs), DataConfig(), processor.tokenizer,
                           processor=processor, with_pairs=True).prompts
    assert pair.input_ids == row.input_ids and pair.images == row.images
    assert pair.meta["chosen"] == "one" and pair.meta["rejected"] == "two"


def test_max_prompt_tokens_counts_the_image_tokens(processor, tmp_path, images):
    rows = [{"prompt": "a", "images": ["imgs/blue.png"]}]
    source = write_jsonl(tmp_path / "d.jsonl", rows)
    (prompt,) = load_prompts(source, DataConfig(), None, processor=processor).prompts
    n = len(prompt.input_ids)
    assert n > 24  # the 24 image tokens are in it
    assert load_prompts(source, DataConfig(max_prompt_tokens=n), None, processor=processor).prompts
    with pytest.raises(DataError, match=f"row 1: the prompt is {n} tokens, more than "
                                        f"data.max_prompt_tokens={n - 1}"):
        load_prompts(source, DataConfig(max_prompt_tokens=n - 1), None, processor=processor)


BAD = {2: ["imgs/red.png", "imgs/missing.png"], 3: ["imgs/notes.png"], 4: ["imgs/huge.png"]}
"""Row number -> the images of a bad row (see :func:`_bad_rows`)."""


def _bad_rows(tmp_path: Path, rows: tuple[int, ...] = (2, 3, 4)) -> str:
    """Rows 1 and 5 good, the ``rows`` of :data:`BAD` bad, the others good."""
    (tmp_path / "imgs" / "notes.png").write_text("not a picture")
    (tmp_path / "imgs" / "huge.png").write_bytes(png(300, 200))
    return write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": QUESTION, "images": BAD[n] if n in rows else ["imgs/blue.png"]} for n in range(1, 6)
    ])


@pytest.mark.parametrize("row, message", [
    (2, r"d\.jsonl: row 2: image 2 \(.*imgs/missing\.png\) does not exist"),
    (3, r"d\.jsonl: row 3: image 1 \(.*imgs/notes\.png\) is not an image Pillow can read"),
    (4, r"d\.jsonl: row 4: image 1 \(.*imgs/huge\.png\) is 300x200 = 60000 pixels, more than "
        r"data.max_image_pixels=50000; downscale the image or raise data.max_image_pixels"),
])
def test_bad_images_are_named_with_row_and_file(processor, tmp_path, images, row, message):
    with pytest.raises(DataError, match=message):
        load_prompts(_bad_rows(tmp_path, (row,)), DataConfig(max_image_pixels=50_000), None,
                     processor=processor)


def test_skip_mode_counts_the_bad_image_rows(processor, tmp_path, images):
    cfg = DataConfig(max_image_pixels=50_000, on_bad_row="skip")
    loaded = load_prompts(_bad_rows(tmp_path), cfg, None, processor=processor)
    assert [p.id for p in loaded.prompts] == ["d.jsonl:1", "d.jsonl:5"]
    assert loaded.skipped == 3
    assert [e.split(": ", 2)[1] for e in loaded.skip_examples] == ["row 2", "row 3", "row 4"]


def test_images_need_a_vision_language_model_even_when_skipping(tmp_path, images):
    source = write_jsonl(tmp_path / "d.jsonl", [{"prompt": QUESTION},
                                                {"prompt": QUESTION, "images": ["imgs/red.png"]}])
    with pytest.raises(DataError, match=r"row 2 has images, but model.path=builtin:tiny is a "
                                        r"text-only model; rows with images need a vision-language"):
        load_prompts(source, DataConfig(on_bad_row="skip", chat_template=False), _Tok(),
                     model="builtin:tiny")


def test_images_need_the_chat_template(processor, tmp_path, images):
    source = write_jsonl(tmp_path / "d.jsonl", [{"prompt": QUESTION, "images": ["imgs/red.png"]}])
    with pytest.raises(DataError, match="row 1 has images, which only the processor's chat "
                                        "template places: set data.chat_template=true"):
        load_prompts(source, DataConfig(chat_template=False), None, processor=processor)


def test_an_images_field_and_image_parts_together_is_a_bad_row(processor, tmp_path, images):
    row = {"prompt": image_message({"type": "image", "image": "imgs/red.png"}),
           "images": ["imgs/blue.png"]}
    with pytest.raises(DataError, match="both image parts in its messages and an images field"):
        load_prompts(write_jsonl(tmp_path / "d.jsonl", [row]), DataConfig(), None, processor=processor)


class _Tok:
    """A text tokenizer without a chat template: one id per character."""

    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}


class _BatchingProcessor:
    """A processor that returns ``pixel_values`` with a batch dim (``[1, n, 3, 4, 4]``, as
    Idefics-style processors do), or without one (LLaVA's ``[n, 3, 4, 4]``)."""

    def __init__(self, batched: bool) -> None:
        self.batched, self.seen = batched, None

    def apply_chat_template(self, conversation, **kwargs):
        self.seen = conversation
        n = sum(p["type"] == "image" for m in conversation for p in m["content"])
        pixels = torch.arange(n * 48.0).reshape(n, 3, 4, 4)
        return {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3),
                "token_type_ids": torch.zeros(1, 3), "image_sizes": torch.tensor([[4, 4]] * n),
                "pixel_values": pixels[None] if self.batched else pixels}


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("n", [1, 3])
def test_vision_inputs_hold_the_images_along_dim_0(batched, n):
    from rltune.data.chat import encode_vl_prompt

    fake = _BatchingProcessor(batched)
    red = pil(png(4, 4))
    messages = [{"role": "system", "content": "S"},
                {"role": "user", "content": [*([{"type": "image"}] * n), {"type": "text", "text": "q"}]}]
    ids, vision = encode_vl_prompt(fake, messages, [red] * n)
    assert ids == [5, 6, 7]
    assert set(vision) == {"pixel_values", "image_sizes"}  # token-aligned tensors left out
    torch.testing.assert_close(vision["pixel_values"], torch.arange(n * 48.0).reshape(n, 3, 4, 4))
    assert fake.seen[0] == {"role": "system", "content": [{"type": "text", "text": "S"}]}
    assert fake.seen[1]["content"][0] == {"type": "image", "image": red}
    with pytest.raises(ValueError, match="more image parts in the messages than images"):
        encode_vl_prompt(fake, messages, [red] * (n - 1))


def test_conversational_pair_responses_of_an_image_prompt(processor, tmp_path, images):
    asked = image_message({"type": "image", "image": "imgs/red.png"}, {"type": "text", "text": QUESTION})
    answer = [{"role": "assistant", "content": [{"type": "text", "text": "one"}]}]
    rows = [{"prompt": asked, "chosen": [*asked, *answer],  # a copy of the prompt, then text parts
             "rejected": [{"role": "assistant", "content": "two"}]},
            {"prompt": asked, "chosen": answer,
             "rejected": [{"role": "assistant", "content": [{"type": "image", "image": "imgs/red.png"}]}]}]
    cfg = DataConfig(on_bad_row="skip")
    loaded = load_prompts(write_jsonl(tmp_path / "p.jsonl", rows), cfg, processor.tokenizer,
                          processor=processor, with_pairs=True)
    (pair,) = loaded.prompts
    assert (pair.meta["chosen"], pair.meta["rejected"]) == ("one", "two")
    assert "the assistant message of 'rejected' has an image part; a response is text" in loaded.skip_examples[0]


def test_a_datasets_directory_with_an_image_feature(processor, tmp_path, images):
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"prompt": datasets.Value("string"),
                                  "images": datasets.List(datasets.Image())})
    rows = {"prompt": [QUESTION], "images": [[{"bytes": images["red.png"], "path": None}]]}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "hf"))
    before = sorted(p.name for p in (tmp_path / "hf").iterdir())
    (prompt,) = load_prompts(str(tmp_path / "hf"), DataConfig(), None, processor=processor).prompts
    assert prompt.images[0].data == images["red.png"]  # the file's bytes, not a re-encoding
    assert prompt.vision["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == before  # nothing written there


def test_prompts_with_the_same_images_share_one_copy_of_their_pixels(processor, tmp_path, images):
    rows = [{"prompt": QUESTION, "images": ["imgs/red.png"]},
            {"prompt": "What colour is it?", "images": ["imgs/red.png"]},
            {"prompt": QUESTION, "images": ["imgs/blue.png"]}]
    a, b, c = load_prompts(write_jsonl(tmp_path / "d.jsonl", rows), DataConfig(), None,
                           processor=processor).prompts
    assert a.vision is b.vision and a.input_ids != b.input_ids
    assert c.vision is not a.vision


class _TextDependentPixels:
    """A processor whose pixel inputs depend on the prompt's text (its length)."""

    chat_template = "yes"

    def apply_chat_template(self, conversation, **kwargs):
        text = "".join(p.get("text", "") for m in conversation for p in m["content"])
        return {"input_ids": torch.tensor([[1, 2]]), "pixel_values": torch.full((1, 3), float(len(text)))}


def test_pixels_that_differ_are_not_shared(tmp_path, images):
    rows = [{"prompt": "a", "images": ["imgs/red.png"]}, {"prompt": "bb", "images": ["imgs/red.png"]},
            {"prompt": "c", "images": ["imgs/red.png"]}]
    a, b, c = load_prompts(write_jsonl(tmp_path / "d.jsonl", rows), DataConfig(), None,
                           processor=_TextDependentPixels()).prompts
    assert b.vision["pixel_values"].tolist() == [[2.0, 2.0, 2.0]]
    assert c.vision is a.vision
