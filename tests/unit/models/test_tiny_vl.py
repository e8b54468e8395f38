"""The tiny vision-language models: tokens, chat template, processor sizes, Auto loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from rltune.models.load import load_model, load_processor, load_tokenizer, resolve_model
from rltune.models.tiny import CHAT_TEMPLATE, build_tokenizer
from rltune.models.tiny_vl import TINY_VL_SPECS

IMAGE_QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Red?"}]}]
TEXT_ONLY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def _image(width: int, height: int) -> Image.Image:
    return Image.new("RGB", (width, height), (200, 30, 30))


def test_qwen2_vl_tokens_are_appended_after_the_byte_vocabulary(tiny_vl_dir: str) -> None:
    processor = load_processor(tiny_vl_dir)
    tok = processor.tokenizer
    assert len(tok) == 264
    ids = [tok.convert_tokens_to_ids(t) for t in
           ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")]
    assert ids == [260, 261, 262, 263]
    text = "Hi, 3 shapes!"
    base = build_tokenizer()
    assert tok(text, add_special_tokens=False)["input_ids"] == base(text, add_special_tokens=False)["input_ids"]
    assert tok(text, add_special_tokens=False)["input_ids"] == [4 + ord(c) for c in text]
    assert (tok.padding_side, tok.pad_token_id, tok.eos_token_id) == ("left", 0, 3)
    config = json.loads((Path(tiny_vl_dir) / "config.json").read_text())
    assert (config["image_token_id"], config["vision_start_token_id"], config["vision_end_token_id"]) == (262, 260, 261)


def test_chat_template_renders_image_parts_like_qwen2_vl_and_text_like_tiny(tiny_vl_dir: str) -> None:
    processor = load_processor(tiny_vl_dir)
    rendered = processor.apply_chat_template(IMAGE_QUESTION, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Red?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    from jinja2 import Template

    expected = Template(CHAT_TEMPLATE).render(messages=TEXT_ONLY, add_generation_prompt=True)
    assert processor.tokenizer.apply_chat_template(TEXT_ONLY, add_generation_prompt=True, tokenize=False) == expected


@pytest.mark.parametrize(("size", "tokens"), [((112, 112), 16), ((56, 56), 16), ((1000, 800), 56)])
def test_image_token_count(tiny_vl_dir: str, size: tuple[int, int], tokens: int) -> None:
    # 28x28 pixels per merged token: 112x112 is 4x4 = 16 tokens, a small image is scaled
    # up to 16, a large one down to at most 64: 1000x800 is scaled by sqrt(800000 / (64*784))
    # = 3.99 and floored to multiples of 28, 224x196, 8x7 = 56 tokens.
    processor = load_processor(tiny_vl_dir)
    text = processor.apply_chat_template(IMAGE_QUESTION, add_generation_prompt=True, tokenize=False)
    out = processor(images=[_image(*size)], text=[text], return_tensors="pt")
    assert int((out["input_ids"] == 262).sum()) == tokens
    assert int(out["image_grid_thw"].prod()) == 4 * tokens  # patches before the 2x2 merge
    assert tuple(out["pixel_values"].shape) == (4 * tokens, 3 * 2 * 14 * 14)


def test_tiny_vl_loads_through_the_auto_classes_and_generates(tiny_vl_dir: str) -> None:
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_dir, local_files_only=True)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert 1_000_000 < sum(p.numel() for p in model.parameters()) < 3_000_000
    ours = load_model(tiny_vl_dir)
    for (name, a), (_, b) in zip(model.state_dict().items(), ours.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    processor = load_processor(tiny_vl_dir)
    text = processor.apply_chat_template(IMAGE_QUESTION, add_generation_prompt=True, tokenize=False)
    inputs = processor(images=[_image(112, 112)], text=[text], return_tensors="pt")
    out = ours.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 3)


def test_llava_loads_with_its_image_token_and_a_56_pixel_crop(tiny_llava_dir: str) -> None:
    model = AutoModelForImageTextToText.from_pretrained(tiny_llava_dir, local_files_only=True)
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert 1_000_000 < sum(p.numel() for p in model.parameters()) < 3_000_000
    processor = load_processor(tiny_llava_dir)
    assert type(processor).__name__ == "LlavaProcessor"
    assert processor.tokenizer.convert_tokens_to_ids("<image>") == 260 == model.config.image_token_id
    rendered = processor.apply_chat_template(IMAGE_QUESTION, add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\n<image>Red?<|im_end|>\n<|im_start|>assistant\n"
    inputs = processor(images=[_image(90, 60)], text=[rendered], return_tensors="pt")
    assert tuple(inputs["pixel_values"].shape) == (1, 3, 56, 56)
    assert int((inputs["input_ids"] == 260).sum()) == 16  # 4x4 patches of 14, CLS dropped
    out = load_model(tiny_llava_dir).generate(**inputs, max_new_tokens=2, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 2


def test_auto_processor_loads_llava_and_a_text_model_has_no_processor(
    tiny_llava_dir: str, tiny_dir: str
) -> None:
    assert type(AutoProcessor.from_pretrained(tiny_llava_dir, local_files_only=True)).__name__ == "LlavaProcessor"
    assert load_processor(tiny_dir) is None
    assert load_tokenizer(tiny_llava_dir).convert_tokens_to_ids("<image>") == 260


def test_builtin_names_build_into_separate_cache_entries(tmp_path: Path) -> None:
    dirs = {name: resolve_model(f"builtin:{name}", cache_dir=str(tmp_path)) for name in ("tiny", *TINY_VL_SPECS)}
    assert len(set(dirs.values())) == 3
    assert resolve_model("builtin:tiny-vl", cache_dir=str(tmp_path)) == dirs["tiny-vl"]
    assert type(load_processor(dirs["tiny-vl"])).__name__ == "Qwen2VLProcessor"
