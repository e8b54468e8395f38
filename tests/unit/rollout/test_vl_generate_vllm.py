"""The parts of the vLLM generator for vision-language models that need no engine: the
request for a prompt (its token ids, and for a prompt with images the decoded images in
token order) and the weights the engine takes."""

from __future__ import annotations

import hashlib
import io

import pytest
from PIL import Image

from rltune.data.images import ImageError
from rltune.data.records import Prompt, PromptImage
from rltune.models.load import load_model, resolve_model
from rltune.rollout.vllm import VLLMGenerator, vllm_request


def _png(size: tuple[int, int], colour: tuple[int, int, int], mode: str = "RGB") -> PromptImage:
    buf = io.BytesIO()
    Image.new(mode, size, colour if mode == "RGB" else colour[0]).save(buf, format="PNG")
    data = buf.getvalue()
    return PromptImage(source=f"{size}.png", digest=hashlib.sha256(data).hexdigest()[:16], data=data)


def test_a_text_prompt_is_its_token_ids_alone() -> None:
    assert vllm_request(Prompt(id="t", text="1+1=", input_ids=[4, 5, 6])) == {"prompt_token_ids": [4, 5, 6]}


def test_a_prompt_with_images_carries_them_decoded_in_order() -> None:
    images = [_png((30, 20), (255, 0, 0)), _png((8, 12), (0, 0, 0), mode="L")]
    prompt = Prompt(id="v", text="<image><image>which?", input_ids=[1, 9, 9, 9, 2], images=images)
    request = vllm_request(prompt)
    assert request["prompt_token_ids"] == [1, 9, 9, 9, 2]  # placeholders as the processor expanded them
    got = request["multi_modal_data"]["image"]
    assert [(im.size, im.mode) for im in got] == [((30, 20), "RGB"), ((8, 12), "RGB")]
    assert got[0].getpixel((0, 0)) == (255, 0, 0) and got[1].getpixel((3, 3)) == (0, 0, 0)


def test_an_image_that_does_not_decode_names_itself() -> None:
    broken = PromptImage(source="data/cat.png", digest="0" * 16, data=b"\x89PNG not really")
    prompt = Prompt(id="v", text="<image>", input_ids=[9], images=[broken])
    with pytest.raises(ImageError, match=r"image 0 \(data/cat.png\)"):
        vllm_request(prompt)


def test_the_weights_a_vision_language_engine_takes_are_the_whole_models(tmp_path) -> None:
    """The names the learner must send: those of the loaded vision-language model (tower,
    projector, language model; the tied head once), not of a causal LM's."""
    path = resolve_model("builtin:tiny-vl", cache_dir=str(tmp_path))
    generator = VLLMGenerator.__new__(VLLMGenerator)  # the skeleton needs no engine
    generator._meta_model, generator.model_dir, generator.trust_remote_code, generator.dtype = None, path, False, "float32"
    model = load_model(path)
    untied = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers() if n in model.state_dict()}
    assert generator.required_names() == untied
    assert any(n.startswith("model.visual.") for n in untied)
