"""Strict in-place weight loading from safetensors: a file, or an HF directory (`model.safetensors` or shards)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from rollq.engine.server.weights_root import file_in


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files a path names: the file itself, or those of a directory (its index's shards,
    `model.safetensors` or `*.safetensors`), each of which must stay inside the directory (`file_in`: an index may
    not name absolute or `..` shards, nor a symlink lead out). Raises FileNotFoundError with what was looked for.

    The server resolves `path` under its weights_root first (weights_root.resolve_under): the messages here only
    describe paths under the root. `~` is not expanded."""
    p = Path(path)
    if p.is_file():
        if p.suffix != ".safetensors":
            raise ValueError(f"{p} is not a .safetensors file")
        return [p]
    if not p.is_dir():
        raise FileNotFoundError(f"weights path {p} does not exist")
    index = p / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
            raise ValueError(f"{index} has no weight_map of tensor names to shard file names")
        shards = [file_in(p, s, "a shard of model.safetensors.index.json") for s in sorted(set(weight_map.values()))]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names missing shards: {missing}")
        return shards
    if (p / "model.safetensors").is_file():
        return [file_in(p, "model.safetensors")]
    found = sorted(p.glob("*.safetensors"))
    if found:
        return [file_in(p, f.name) for f in found]
    raise FileNotFoundError(f"no model.safetensors, model.safetensors.index.json or *.safetensors in {p}")


@torch.no_grad()
def copy_into(
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    source: str = "received weights",
    *,
    partial: bool = False,
    adopt: bool = False,
) -> int:
    """Copy `tensors` into `model`'s parameters (cast to each parameter's dtype and device). Strict: every parameter
    must be present with its shape, and no unknown name is allowed (tied aliases such as lm_head.weight are accepted).
    Everything is checked before the first copy, so nothing is changed when the check fails: an engine keeps serving
    whole old weights rather than a mix. `partial`: a subset of the parameters is fine (a bucket of a weight update
    sent in several calls); unknown names and wrong shapes are still refused. `adopt`: the tensors are given away
    (a staged weight delta's): one with its parameter's dtype and device becomes the parameter's storage, no copy
    (a tied alias shares the parameter, so it follows). Returns the number of parameters written."""
    params = served_parameters(model)  # tied parameters appear once
    aliases = {n for name in model.state_dict() if (n := _served_name(name)) not in params and ".lora_" not in name}
    missing = [] if partial else sorted(set(params) - set(tensors))
    unknown = sorted(set(tensors) - set(params) - aliases)
    bad_shape = sorted(
        f"{n}: {tuple(tensors[n].shape)} != {tuple(p.shape)}"
        for n, p in params.items()
        if n in tensors and tensors[n].shape != p.shape
    )
    if missing or unknown or bad_shape:
        raise ValueError(
            f"{source} do not fit the model: missing {missing[:8]}, unknown {unknown[:8]}, "
            f"shape mismatch {bad_shape[:8]}"
        )
    written = 0
    for name, p in params.items():
        if name in tensors:
            t = tensors[name]
            if adopt and t.dtype == p.dtype and t.device == p.device and t.is_contiguous():
                p.data = t
            else:
                p.copy_(t.to(dtype=p.dtype, device=p.device))
            written += 1
    return written


PEFT_PREFIX = "base_model.model."


def _served_name(name: str) -> str:
    """A parameter's name in the model's own files: a model serving LoRA adapters (peft) holds each targeted
    weight as `<module>.base_layer.weight` under `base_model.model.`."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def served_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The model's own parameters by the names its checkpoints use (a peft-wrapped model's adapters left out)."""
    return {_served_name(n): p for n, p in model.named_parameters() if ".lora_" not in n}


def load_into(model: torch.nn.Module, path: str | Path) -> int:
    """Copy every tensor of `path` into `model`'s parameters, strictly (see `copy_into`). Returns the number of
    tensors loaded."""
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return copy_into(model, tensors, source=f"weights at {path}")
