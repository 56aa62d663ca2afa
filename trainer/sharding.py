"""A model sharded over the trainer's ranks with FSDP2 (`fully_shard`), loaded without one full copy anywhere.

The model is built on the meta device (shapes only), each decoder layer and then the root is `fully_shard`-ed, the
shards are allocated on this rank's device and filled from the model's safetensors directory by the distributed
checkpoint's Hugging Face reader: each rank reads only the slices of its shards. Tied weights (SmolLM2's lm_head is
its embedding) are one Parameter in the root's group, so they stay one under sharding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks FSDP shards one by one (one all-gather per block in each pass): transformers' causal LMs
    keep them in a ModuleList, `model.layers` for Llama/Qwen-likes."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    return list(max(lists, key=lambda m: len(list(m))))


def shard_model(model: torch.nn.Module, *, mixed_precision: bool) -> torch.nn.Module:
    """`fully_shard` each decoder layer, then the root (embeddings, final norm, lm_head). FSDP averages the
    gradients over the ranks; trainer.policy scales each rank's loss by their number, so the average is the sum of
    the ranks' parts of one per-token mean over the global batch: the gradient one process would take (a divide
    factor of 1 would say the same, but gloo cannot reduce with it). With `mixed_precision` (a GPU), passes run in
    bfloat16 and gradients are reduced in float32; the sharded parameters and AdamW's state stay float32."""
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _refresh_unsaved_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Buffers a checkpoint does not hold (rotary inverse frequencies: `persistent=False`) are computed by their
    module's constructor; after building on the meta device they hold nothing, so each such module is built again
    (small: no parameters) and its buffers copied in."""
    for name, module in model.named_modules():
        unsaved = [b for b in module._buffers if b in module._non_persistent_buffers_set]
        if not unsaved:
            continue
        config = getattr(module, "config", None)
        if config is None:
            raise ValueError(
                f"cannot rebuild the unsaved buffers {unsaved} of {name or 'the model'} after a meta-device build"
            )
        with torch.device(device):
            fresh = type(module)(config)
        for b in unsaved:
            module._buffers[b] = fresh._buffers[b]


def load_sharded(path: Path, device: str, *, dtype: torch.dtype = torch.float32, mixed_precision: bool = False) -> Any:
    """The model of the HF directory `path`, sharded over the process group, each rank's shard read from its
    safetensors (nothing is materialised whole)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    shard_model(model, mixed_precision=mixed_precision)
    target = torch.device(device)
    model.to_empty(device=target)
    _refresh_unsaved_buffers(model, target)
    state = get_model_state_dict(model)
    tied = _tied_names(model)
    wanted = {k: v for k, v in state.items() if k not in tied}  # a tied weight is saved once, under its first name
    # allow_partial_load: the file may lack what the model does not keep either (none left after the line above);
    # every wanted key is checked below instead, so a missing weight is an error naming it.
    reader = HuggingFaceStorageReader(str(path))
    metadata = reader.read_metadata()
    missing = sorted(k for k in wanted if k not in metadata.state_dict_metadata)
    if missing:
        raise ValueError(f"{path} lacks weights of the model: {missing[:8]}")
    dcp.load(wanted, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True))
    set_model_state_dict(model, wanted, options=StateDictOptions(strict=False))
    return model


def _tied_names(model: torch.nn.Module) -> set[str]:
    """Names under which a parameter appears a second time (remove_duplicate=False lists every alias)."""
    seen: set[int] = set()
    tied: set[str] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.add(id(p))
    return tied


__all__ = ["decoder_layers", "load_sharded", "shard_model"]
