"""Images that would be ignored stop loading: a row whose images sit in a field other than
``data.images_field``, and an images field that no row has. Other values under an
image-like name stay reward metadata."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import datasets
import pytest
from PIL import Image

from rltune.config.schema import DataConfig
from rltune.data.images import looks_like_images
from rltune.data.loaders import DataError, load_prompts

QUESTION = "How many red shapes?"
HINT = "so they would be ignored; set data.images_field: {key}, or rename the field to 'images'"


def png(width: int = 56, height: int = 56) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (220, 20, 20)).save(out, format="PNG")
    return out.getvalue()


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def processor():
    """``builtin:tiny-vl``'s processor."""
    from rltune.models.load import load_processor, resolve_model

    return load_processor(resolve_model("builtin:tiny-vl"))


@pytest.mark.parametrize(("key", "value", "shown"), [
    ("image", "cat.png", "'cat.png'"),
    ("Image", "imgs/cat.JPG", "'imgs/cat.JPG'"),
    ("pictures", ["a.png", "b.jpeg"], "2, the first 'a.png'"),
    ("img", {"bytes": None, "path": "cat.webp"}, "'cat.webp'"),
    ("photo", "data:image/png;base64,iVBORw0KGgo=", "'data:image/png;base64,iVBORw0KGgo='"),
    ("images", ["x.gif"], "1, the first 'x.gif'"),
])
def test_images_under_another_field_are_refused_with_the_row_and_the_setting(tmp_path, chatml_tok, key,
                                                                             value, shown):
    cfg = DataConfig(images_field="images" if key != "images" else "pics")
    rows = [{"prompt": QUESTION, "answer": "1"}, {"prompt": QUESTION, key: value, "answer": "2"}]
    source = write_jsonl(tmp_path / "d.jsonl", rows)
    hint = HINT.format(key=key).replace("'images'", repr(cfg.images_field))
    with pytest.raises(DataError) as err:
        load_prompts(source, cfg, chatml_tok)
    message = str(err.value)
    assert message == (f"{source}: row 2: the field {key!r} holds images ({shown}), but "
                       f"data.images_field is {cfg.images_field!r}, {hint}")


def test_the_refusal_holds_when_skipping_bad_rows(tmp_path, chatml_tok):
    source = write_jsonl(tmp_path / "d.jsonl", [{"prompt": QUESTION, "image": "cat.png"}])
    with pytest.raises(DataError, match=r"row 1: the field 'image' holds images \('cat.png'\)"):
        load_prompts(source, DataConfig(on_bad_row="skip"), chatml_tok)


def test_an_image_feature_of_a_datasets_directory_under_another_name(tmp_path, chatml_tok):
    features = datasets.Features({"prompt": datasets.Value("string"), "image": datasets.Image()})
    rows = {"prompt": [QUESTION], "image": [{"bytes": png(), "path": None}]}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "hf"))
    shown = f"{len(png())} bytes"
    with pytest.raises(DataError, match=rf"/hf: row 1: the field 'image' holds images \({shown}\), "
                                        r"but data.images_field is 'images'"):
        load_prompts(str(tmp_path / "hf"), DataConfig(), chatml_tok)


@pytest.mark.parametrize("value", [
    "a red square next to a blue circle",
    ["a caption", "another"],
    "see cat.png\nand more",
    [],
    None,
    {"caption": "cat.png"},
    12,
])
def test_other_values_under_an_image_name_stay_metadata(tmp_path, chatml_tok, value):
    source = write_jsonl(tmp_path / "d.jsonl", [{"prompt": QUESTION, "image": value}])
    (prompt,) = load_prompts(source, DataConfig(), chatml_tok).prompts
    assert prompt.meta == {"image": value} and prompt.images is None


def test_an_images_field_no_row_has_is_refused(tmp_path, chatml_tok):
    source = write_jsonl(tmp_path / "d.jsonl", [{"prompt": QUESTION, "answer": "1"},
                                                {"prompt": QUESTION, "picture_file": "cat"}])
    with pytest.raises(DataError) as err:
        load_prompts(source, DataConfig(images_field="pics", on_bad_row="skip"), chatml_tok)
    assert str(err.value) == (
        f"{source}: no row has the images field 'pics' (data.images_field), so no prompt would "
        f"have images; the rows have fields ['answer', 'picture_file', 'prompt']: set "
        f"data.images_field to the one with the images, or remove it for text-only data"
    )


def test_the_default_images_field_may_be_absent(tmp_path, chatml_tok):
    source = write_jsonl(tmp_path / "d.jsonl", [{"prompt": QUESTION, "answer": "1"}])
    assert len(load_prompts(source, DataConfig(images_field="images"), chatml_tok)) == 1


def test_a_named_images_field_loads_its_images(processor, tmp_path):
    (tmp_path / "cat.png").write_bytes(png())
    rows = [{"prompt": QUESTION, "pics": ["cat.png"], "image": "a red square"},
            {"prompt": QUESTION, "answer": "text only"}]
    first, second = load_prompts(write_jsonl(tmp_path / "d.jsonl", rows),
                                 DataConfig(images_field="pics"), None, processor=processor).prompts
    assert [i.source for i in first.images] == [str(tmp_path / "cat.png")]
    assert first.vision is not None and first.meta == {"image": "a red square"}
    assert second.images is None and second.meta == {"answer": "text only"}


def test_a_row_with_images_may_keep_another_image_field(processor, tmp_path):
    (tmp_path / "cat.png").write_bytes(png())
    (tmp_path / "dog.png").write_bytes(png(84, 56))
    rows = [{"prompt": QUESTION, "images": ["cat.png"], "image": "dog.png"}]
    (prompt,) = load_prompts(write_jsonl(tmp_path / "d.jsonl", rows), DataConfig(), None,
                             processor=processor).prompts
    assert [i.source for i in prompt.images] == [str(tmp_path / "cat.png")]
    assert prompt.meta == {"image": "dog.png"}


def test_what_looks_like_images():
    data = png()
    webp = io.BytesIO()
    Image.new("RGB", (8, 8)).save(webp, format="WEBP")
    assert looks_like_images(data) and looks_like_images(webp.getvalue())
    assert looks_like_images([data, "b.bmp"]) and looks_like_images(("a.tiff",))
    assert looks_like_images(Image.open(io.BytesIO(data)))
    assert looks_like_images({"bytes": data}) and looks_like_images({"path": "x"})
    assert looks_like_images(f"data:image/png;base64,{base64.b64encode(data).decode()}")
    assert not looks_like_images(b"plain bytes") and not looks_like_images({"bytes": None, "path": None})
    assert not looks_like_images(["cat.png", "a caption"]) and not looks_like_images([])
    assert not looks_like_images("cat.png is a file name") and not looks_like_images([["a.png"]])
