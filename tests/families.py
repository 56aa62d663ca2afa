"""Tiny models of the architecture families users bring, built from transformers' own config classes (no downloads).

`build_family(name, root)` writes an HF directory like the `tiny` model's (its ChatML tokenizer, random weights,
`initializer_range` 0.2 so greedy ties practically never happen): 2 layers, hidden 64, 4 query heads over 2 KV heads.
The sliding-window families get a window of `WINDOW` tokens, shorter than the prompts the tests send, so a window
that is not applied shows up as wrong logprobs. The MoE families have 4 experts, 2 per token. Built once per spec
into the cache (engine/tiny_model.py's build-once-and-rename), so test processes share one build.
"""

from __future__ import annotations

import fcntl
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollq.engine.tiny_model import ENDOFTEXT, IM_END, TinySpec, build_once, build_tokenizer, cache_root

BUILD_VERSION = 1  # bump when a family's config below changes
WINDOW = 16  # sliding window of the windowed families: shorter than every test prompt
COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    initializer_range=0.2,
    tie_word_embeddings=False,
)


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM, LlamaConfig(**COMMON)


def _qwen2() -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM, Qwen2Config(**COMMON)


def _qwen3() -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM, Qwen3Config(**COMMON, head_dim=16)


def _mistral() -> Any:
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM, MistralConfig(**COMMON, sliding_window=WINDOW)


def _gemma2() -> Any:  # logit softcapping in attention and on the head; every other layer windowed
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        **COMMON,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    )
    return Gemma2ForCausalLM, config


def _gemma3() -> Any:  # text-only Gemma 3: windowed layers with a local rope, a global layer
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **COMMON,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    )
    return Gemma3ForCausalLM, config


def _phi3() -> Any:  # fused qkv_proj and gate_up_proj
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM, Phi3Config(**COMMON)


def _mixtral() -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM, MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)


def _qwen3_moe() -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    return Qwen3MoeForCausalLM, config


FAMILIES: dict[str, Callable[[], Any]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mistral": _mistral,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
}
WINDOWED = ("mistral", "gemma2", "gemma3")  # the families built with a sliding window
MOE = ("mixtral", "qwen3_moe")


def family_root() -> Path:
    return cache_root() / "families"


def build_family(name: str, root: Path | None = None, seed: int = 0) -> Path:
    """The tiny `name` model's directory under `root` (default: the cache's families/), built on first use."""
    import torch
    from transformers import GenerationConfig

    spec = TinySpec()
    target = (root or family_root()) / name
    digest = f"{name}-{BUILD_VERSION}-{seed}-{spec.digest()}"

    def write(tmp: Path) -> None:
        tok = build_tokenizer(spec)
        eos = [tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(ENDOFTEXT)]
        model_class, config = FAMILIES[name]()
        config.vocab_size = len(tok)
        config.eos_token_id, config.pad_token_id, config.bos_token_id = eos[0], tok.pad_token_id, None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_class(config).eval()
        model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id, do_sample=False)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}.lock", "w") as lock:  # xdist processes take turns: one builds
        fcntl.flock(lock, fcntl.LOCK_EX)
        return build_once(target, digest, {"family": name, "seed": seed}, write)
