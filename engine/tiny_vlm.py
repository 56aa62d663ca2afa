"""A tiny random-init Qwen2-VL vision-language model, built offline like engine/tiny_model.py's text model, for tests
and benchmarks of image inputs.

`build_tiny_vl(directory)` writes an HF directory (config.json, model.safetensors, generation_config.json, tokenizer
files and chat template, preprocessor_config.json, processor_config.json) that `Qwen2VLForConditionalGeneration` /
`AutoModelForImageTextToText`, `AutoTokenizer` and `AutoImageProcessor` load with no network. The tokenizer is the
tiny model's BPE plus Qwen2-VL's vision tokens. The build is deterministic for a spec and skipped when the directory
already holds the same spec's build.

transformers' own `Qwen2VLProcessor` always builds a video processor, which needs torchvision, so neither it nor
`AutoProcessor` loads without torchvision (transformers 5.24): `load_processor(directory)` gives the same processor
without the video half, on the PIL image processor.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import msgspec

from rollq.engine.tiny_model import CHAT_TEMPLATE, ENDOFTEXT, IM_END, TinySpec, build_once, build_tokenizer

BUILD_VERSION = 2  # bump when the build below changes in a way the spec does not capture

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
# The processor expands each pad into one token per merged patch; the names are the tokenizer attributes
# Qwen2VLProcessor reads (`image_token`, `video_token` and their `_id`s).
VISION_TOKENS = {
    "vision_start_token": VISION_START,
    "vision_end_token": VISION_END,
    "image_token": IMAGE_PAD,
    "video_token": VIDEO_PAD,
}


class TinyVLSpec(msgspec.Struct, frozen=True, kw_only=True):
    seed: int = 0
    # Language model: the sizes of tiny_model's TinySpec.
    hidden_size: int = 64
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    rope_theta: float = 1_000_000.0
    # M-RoPE: the (temporal, height, width) shares of each head's rotary frequencies; they sum to head_dim // 2.
    mrope_section: tuple[int, int, int] = (2, 3, 3)
    # Vision tower: a ViT over patch_size² x temporal_patch_size patches, whose spatial_merge_size² neighbours are
    # merged into one language-model token.
    vision_depth: int = 2
    vision_embed_dim: int = 32
    vision_num_heads: int = 2
    vision_mlp_ratio: int = 2
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    # Images are resized to multiples of patch_size * spatial_merge_size (28) with min_pixels..max_pixels pixels:
    # a 56x56 image is a 4x4 patch grid, 4 image tokens; nothing is larger than 112x112 (16 image tokens).
    min_pixels: int = 56 * 56
    max_pixels: int = 112 * 112
    initializer_range: float = 0.2  # as the text model: peaked logits, so greedy ties are practically impossible
    # An answer format the model starts with, as a pretrained VLM knows one (answer_prior): these tokens' logits
    # raised by answer_logit where an answer begins, all alike, so each is as likely as the others whatever the
    # picture. It knows the format, not the answers (rollq.tasks.colours: chance 0.25). "" = none.
    answer_tokens: str = "ABCD"
    answer_logit: float = 11.0

    def __post_init__(self) -> None:
        head_dim = self.hidden_size // self.num_attention_heads
        if sum(self.mrope_section) * 2 != head_dim:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to head_dim // 2 = {head_dim // 2}")
        if self.vision_embed_dim % self.vision_num_heads:
            raise ValueError("vision_embed_dim must be a multiple of vision_num_heads")

    def digest(self) -> str:
        h = hashlib.sha256()
        h.update(msgspec.json.encode(self))
        # The tokenizer is the text model's: its digest covers the corpus, its template and its build version.
        h.update(f"{BUILD_VERSION}|{TinySpec().digest()}|{CHAT_TEMPLATE_VL}".encode())
        return h.hexdigest()[:16]


# The text model's ChatML template (tools included), with message content rendered by a macro that also takes
# Qwen2-VL's list-of-parts content: an image part becomes the vision tokens the processor expands, as in Qwen2-VL's
# own template. Derived rather than copied so the two templates cannot drift apart.
_RENDER_CONTENT = """\
{%- macro render_content(content) %}
    {%- if content is string %}
        {{- content }}
    {%- else %}
        {%- for part in content %}
            {%- if part.type == 'image' or part.type == 'image_url' or 'image' in part or 'image_url' in part %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif part.type == 'video' or 'video' in part %}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
            {%- elif 'text' in part %}
                {{- part.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}
"""
CHAT_TEMPLATE_VL = _RENDER_CONTENT + CHAT_TEMPLATE.replace(
    "messages[0].content", "render_content(messages[0].content)"
).replace("message.content", "render_content(message.content)")


def build_tokenizer_vl():
    """The tiny model's tokenizer plus Qwen2-VL's vision tokens (special, so never split or normalized), with the
    vision-aware chat template."""
    from tokenizers import AddedToken

    tok = build_tokenizer(TinySpec())
    tok.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS.values()]},
        replace_extra_special_tokens=False,  # keep <|im_start|> and <|im_end|>
    )
    # Named tokens (`tok.image_token`, `tok.image_token_id`), saved in tokenizer_config.json and read back by
    # from_pretrained. transformers has no public setter for model-specific tokens on a built tokenizer; this is the
    # one from_pretrained and __init__ use.
    tok._set_model_specific_special_tokens(special_tokens=dict(VISION_TOKENS))
    tok.chat_template = CHAT_TEMPLATE_VL
    return tok


def build_image_processor(spec: TinyVLSpec):
    """Qwen2-VL's PIL image processor (no torchvision) with the spec's patch sizes and pixel bounds."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
        patch_size=spec.patch_size,
        temporal_patch_size=spec.temporal_patch_size,
        merge_size=spec.spatial_merge_size,
    )


def build_model_vl(spec: TinyVLSpec, tok):
    """Seeded random-init Qwen2-VL model; the global torch RNG is left as it was."""
    import torch
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    eos_ids = [tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(ENDOFTEXT)]
    text_config = {
        "vocab_size": len(tok),
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "max_window_layers": spec.num_hidden_layers,
        "initializer_range": spec.initializer_range,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": spec.rope_theta,
            "mrope_section": list(spec.mrope_section),
        },
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": eos_ids[0],
        "pad_token_id": tok.pad_token_id,
    }
    vision_config = {
        "depth": spec.vision_depth,
        "embed_dim": spec.vision_embed_dim,
        "hidden_size": spec.hidden_size,  # the patch merger projects into the language model's embedding space
        "num_heads": spec.vision_num_heads,
        "mlp_ratio": spec.vision_mlp_ratio,
        "patch_size": spec.patch_size,
        "temporal_patch_size": spec.temporal_patch_size,
        "spatial_merge_size": spec.spatial_merge_size,
        "initializer_range": spec.initializer_range,
    }
    config = Qwen2VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=tok.image_token_id,
        video_token_id=tok.video_token_id,
        vision_start_token_id=tok.vision_start_token_id,
        vision_end_token_id=tok.vision_end_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen2VLForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=tok.pad_token_id, do_sample=False)
    return model


def answer_prior(model, tok, spec: TinyVLSpec) -> None:
    """Sets the output rows of `spec.answer_tokens` (one token each) to one vector, along the mean final hidden
    state where the answer of a rollq.tasks.colours prompt begins, scaled so their logits there are about
    `answer_logit`, and equal: a random-init model otherwise writes any of its 524 tokens first and almost never an
    answer. Equal rows give each answer the same logit for any picture: the prior tells no picture from another,
    and the mean is over pictures of every colour alike."""
    import torch

    from rollq.tasks import colours

    if not spec.answer_tokens:
        return
    ids = [tok.convert_tokens_to_ids(t) for t in spec.answer_tokens]
    if len(set(ids)) != len(ids) or tok.unk_token_id in ids:
        raise ValueError(f"answer_tokens {spec.answer_tokens!r} must each be one distinct token")
    processor = _image_only_processor_class()(
        image_processor=build_image_processor(spec), tokenizer=tok, chat_template=tok.chat_template
    )
    hidden = []
    with torch.no_grad():
        for prompt in colours.prompts(8):  # two pictures of each colour
            text = processor.apply_chat_template(prompt["messages"], add_generation_prompt=True, tokenize=False)
            inputs = processor(text=[text], images=prompt["images"], return_tensors="pt")
            out = model(**inputs, output_hidden_states=True)
            hidden.append(out.hidden_states[-1][0, -1])  # after the final norm: what the output rows multiply
        mean = torch.stack(hidden).mean(0)
        model.lm_head.weight[ids] = mean * (spec.answer_logit / float(mean @ mean))


def build_tiny_vl(directory: str | os.PathLike[str], spec: TinyVLSpec | None = None) -> Path:
    """Write the tiny VLM to `directory` (skipped when it already holds this spec's build) and return its path."""
    spec = spec or TinyVLSpec()

    def write(tmp: Path) -> None:
        tok = build_tokenizer_vl()
        model = build_model_vl(spec, tok)
        answer_prior(model, tok, spec)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)  # also chat_template.jinja, where the processor reads its template too
        image_processor = build_image_processor(spec)
        # preprocessor_config.json, saved backend-neutral ("Qwen2VLImageProcessor"): AutoImageProcessor picks the PIL
        # class where torchvision is missing (and `backend="pil"` picks it anywhere).
        image_processor.save_pretrained(tmp)
        # What Qwen2VLProcessor.save_pretrained writes, which cannot run without torchvision. The video processor has no
        # config of its own: like the published Qwen2-VL checkpoints, it falls back to preprocessor_config.json.
        processor_config = {"image_processor": image_processor.to_dict(), "processor_class": "Qwen2VLProcessor"}
        (tmp / "processor_config.json").write_text(json.dumps(processor_config, indent=2, sort_keys=True) + "\n")

    return build_once(directory, spec.digest(), msgspec.to_builtins(spec), write)


def load_processor(directory: str | os.PathLike[str]):
    """A model directory's processor, never from the network: AutoProcessor's where torchvision is installed;
    without it (this project's CPU machines: PyPI's torchvision is built for CUDA torch), a Qwen2-VL-family
    processor for images and text, no videos: the tokenizer and chat template from AutoTokenizer, the PIL image
    processor from AutoImageProcessor."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        import torchvision  # noqa: F401
    except ImportError:
        pass
    else:
        return AutoProcessor.from_pretrained(directory, local_files_only=True)

    tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    image_processor = AutoImageProcessor.from_pretrained(directory, local_files_only=True, backend="pil")
    processor_class = _image_only_processor_class()
    return processor_class(image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template)


@functools.cache
def _image_only_processor_class():
    """Qwen2VLProcessor without the video processor. ProcessorMixin takes its sub-processors from __init__'s
    signature, so leaving `video_processor` out of it is what keeps AutoVideoProcessor (torchvision) from loading."""
    from transformers import ProcessorMixin, Qwen2VLProcessor

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            # Qwen2VLProcessor.__init__'s token set-up; the video token stays known so prompts holding it are refused.
            self.image_token = tokenizer.image_token
            self.video_token = tokenizer.video_token
            self.image_token_id = tokenizer.image_token_id
            self.video_token_id = tokenizer.video_token_id
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

        def __call__(self, images=None, text=None, videos=None, **kwargs):
            if videos is not None:
                raise ValueError("this processor takes images only: the Qwen2-VL video processor needs torchvision")
            return super().__call__(images=images, text=text, **kwargs)

    return ImageOnlyQwen2VLProcessor
