"""Strict in-place weight loading from safetensors: a file, or an HF directory (`model.safetensors` or shards)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files a path names. Raises FileNotFoundError with what was looked for."""
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix != ".safetensors":
            raise ValueError(f"{p} is not a .safetensors file")
        return [p]
    if not p.is_dir():
        raise FileNotFoundError(f"weights path {p} does not exist")
    index = p / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (p / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names missing shards: {missing}")
        return [p / s for s in shards]
    if (p / "model.safetensors").is_file():
        return [p / "model.safetensors"]
    found = sorted(p.glob("*.safetensors"))
    if found:
        return found
    raise FileNotFoundError(f"no model.safetensors, model.safetensors.index.json or *.safetensors in {p}")


@torch.no_grad()
def copy_into(model: torch.nn.Module, tensors: dict[str, torch.Tensor], source: str = "received weights") -> int:
    """Copy `tensors` into `model`'s parameters (cast to each parameter's dtype and device). Strict: every parameter
    must be present with its shape, and no unknown name is allowed (tied aliases such as lm_head.weight are accepted).
    Everything is checked before the first copy, so nothing is changed when the check fails: an engine keeps serving
    whole old weights rather than a mix. Returns the number of parameters written."""
    params = dict(model.named_parameters())  # tied parameters appear once
    aliases = {name for name in model.state_dict() if name not in params}
    missing = sorted(set(params) - set(tensors))
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
    for name, p in params.items():
        p.copy_(tensors[name].to(dtype=p.dtype, device=p.device))
    return len(params)


def load_into(model: torch.nn.Module, path: str | Path) -> int:
    """Copy every tensor of `path` into `model`'s parameters, strictly (see `copy_into`). Returns the number of
    tensors loaded."""
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return copy_into(model, tensors, source=f"weights at {path}")
