"""The offline tiny Qwen2-VL (engine/tiny_vlm.py): a plain HF directory that transformers loads with no network and no
torchvision, whose processor expands an image into its patch tokens and whose vision tower changes the logits."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("PIL")

import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer, Qwen2VLForConditionalGeneration

from rollq.engine import tiny_vlm
from rollq.engine.models import model_dir
from rollq.engine.tiny_model import CHAT_TEMPLATE, SPEC_FILE
from rollq.engine.tiny_vlm import IMAGE_PAD, VISION_TOKENS, TinyVLSpec, build_tiny_vl, load_processor

QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]}]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vl(tmp_path_factory.mktemp("cache") / "tiny-vl")


@pytest.fixture(scope="module")
def processor(vl_dir: Path):
    return load_processor(vl_dir)


@pytest.fixture(scope="module")
def model(vl_dir: Path) -> Qwen2VLForConditionalGeneration:
    return Qwen2VLForConditionalGeneration.from_pretrained(vl_dir, local_files_only=True).eval()


def image(rgb: tuple[int, int, int], size: int = 56) -> Image.Image:
    return Image.new("RGB", (size, size), rgb)


def test_directory_loads_offline(vl_dir: Path) -> None:
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "preprocessor_config.json",
        "processor_config.json",
        SPEC_FILE,
    } <= {p.name for p in vl_dir.iterdir()}
    model = AutoModelForImageTextToText.from_pretrained(vl_dir, local_files_only=True)
    assert isinstance(model, Qwen2VLForConditionalGeneration)
    tok = AutoTokenizer.from_pretrained(vl_dir, local_files_only=True)
    ids = tok.convert_tokens_to_ids(list(VISION_TOKENS.values()))
    assert ids == list(range(len(tok) - 4, len(tok)))  # appended after the text model's vocabulary
    config = model.config
    assert [
        config.vision_start_token_id,
        config.vision_end_token_id,
        config.image_token_id,
        config.video_token_id,
    ] == ids
    assert (tok.image_token, tok.image_token_id, tok.video_token_id) == (IMAGE_PAD, config.image_token_id, ids[3])
    assert config.text_config.vocab_size == len(tok) and not config.tie_word_embeddings
    assert config.vision_config.hidden_size == config.text_config.hidden_size
    assert json.loads((vl_dir / "processor_config.json").read_text())["processor_class"] == "Qwen2VLProcessor"
    # The PIL backend: asked for, or picked by itself where torchvision is missing.
    pil = AutoImageProcessor.from_pretrained(vl_dir, local_files_only=True, backend="pil")
    assert type(pil).__name__ == "Qwen2VLImageProcessorPil"
    if importlib.util.find_spec("torchvision") is None:
        assert type(AutoImageProcessor.from_pretrained(vl_dir, local_files_only=True)) is type(pil)


def test_processor_expands_an_image_into_merged_patches(processor) -> None:
    text = processor.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What colour is this?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    out = processor(images=[image((255, 0, 0))], text=text, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    image_id = processor.tokenizer.image_token_id
    assert ids.count(image_id) == 4  # 56x56 -> a 4x4 grid of 14-pixel patches -> 2x2 merged tokens
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert out["pixel_values"].shape == (16, 3 * 2 * 14 * 14)  # a patch per row: channels x temporal x 14 x 14
    assert out["mm_token_type_ids"][0].tolist() == [int(i == image_id) for i in ids]
    big = processor(images=[image((0, 0, 255), size=500)], text=text, return_tensors="pt")
    assert big["image_grid_thw"].tolist() == [[1, 8, 8]]  # resized to the 112x112 bound: 16 image tokens
    assert big["input_ids"][0].tolist().count(image_id) == 16
    with pytest.raises(ValueError):
        processor(images=[image((255, 0, 0))], text="no image token here")


def test_forward_is_finite_and_sees_the_image(processor, model) -> None:
    text = processor.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    last = []
    for rgb in [(255, 0, 0), (0, 0, 255)]:
        inputs = processor(images=[image(rgb)], text=text, return_tensors="pt")
        with torch.no_grad():
            logits = model(**inputs).logits
        assert logits.shape == (1, inputs["input_ids"].shape[1], model.config.text_config.vocab_size)
        assert torch.isfinite(logits).all()
        last.append(logits[0, -1])
    assert not torch.allclose(last[0], last[1], atol=1e-3)  # the vision tower reaches the last position


def test_chat_template_keeps_the_text_model_rendering(processor) -> None:
    """String content and tool calls render as the text model's template does, so text-only prompts match."""
    tok = processor.tokenizer
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temperature": 21}'},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    for kwargs in [{}, {"tools": tools}]:
        ours = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        text_model = tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, chat_template=CHAT_TEMPLATE, **kwargs
        )
        assert ours == text_model
    parts = [{"type": "text", "text": "a "}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "video"}]
    assert tok.apply_chat_template([{"role": "user", "content": parts}], tokenize=False) == (
        "<|im_start|>user\na <|vision_start|><|image_pad|><|vision_end|><|vision_start|><|video_pad|><|vision_end|>"
        "<|im_end|>\n"
    )
    assert processor.chat_template == tok.chat_template


def test_build_is_deterministic_and_skipped_when_built(
    vl_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    again = build_tiny_vl(tmp_path / "again")
    for name in ["model.safetensors", "config.json", "tokenizer.json", "preprocessor_config.json", SPEC_FILE]:
        assert (again / name).read_bytes() == (vl_dir / name).read_bytes(), name

    def no_rebuild(*_: object) -> None:
        raise AssertionError("built again")

    monkeypatch.setattr(tiny_vlm, "build_model_vl", no_rebuild)
    monkeypatch.setenv("ROLLQ_CACHE", str(vl_dir.parent))
    assert model_dir("tiny-vl") == vl_dir  # the cache's build, found
    assert build_tiny_vl(vl_dir) == vl_dir
    with pytest.raises(ValueError):
        TinyVLSpec(mrope_section=(2, 2, 2))  # 6 != head_dim // 2
