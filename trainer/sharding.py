"""A model sharded over the trainer's ranks with FSDP2 (`fully_shard`), loaded without one full copy anywhere.

The model is built on the meta device (shapes only), each decoder layer and then the root is `fully_shard`-ed, the
shards are allocated on this rank's device and filled from the model's safetensors directory by the distributed
checkpoint's Hugging Face reader: each rank reads only the slices of its shards. Tied weights (SmolLM2's lm_head is
its embedding) are one Parameter in the root's group, so they stay one under sharding. A checkpoint that stores its
weights under other names than the model's (a transformers-5 MoE's experts) is the exception: rank 0 loads it whole
through transformers and the ranks take their shards by broadcast (`_load_converted`).
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
    """Buffers a checkpoint does not hold (`persistent=False`: rotary inverse frequencies, Gemma's embedding scale)
    hold nothing after a meta-device build. A module that keeps its config (the rotary embeddings) is built again
    (small: no parameters) and its buffers copied in; any other is set by transformers' own initialisation of that
    module (`_init_weights`, how from_pretrained restores them: Gemma2's embed_scale at
    models/gemma2/modeling_gemma2.py:368-369 in 5.24.0), which also draws its parameters: the checkpoint's weights
    replace them next."""
    for name, module in model.named_modules():
        unsaved = [b for b in module._buffers if b in module._non_persistent_buffers_set]
        if not unsaved:
            continue
        config = getattr(module, "config", None)
        if config is not None:
            with torch.device(device):
                fresh = type(module)(config)
            for b in unsaved:
                module._buffers[b] = fresh._buffers[b]
            continue
        init = getattr(model, "_init_weights", None)
        if init is None:
            raise ValueError(
                f"cannot rebuild the unsaved buffers {unsaved} of {name or 'the model'} after a meta-device build"
            )
        # on a stream of its own: the seed's draws that follow (a LoRA adapter's A) must be one process's
        with torch.no_grad(), torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
            init(module)


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
    if any(k not in metadata.state_dict_metadata for k in wanted):  # the same metadata on every rank: one branch
        _load_converted(model, path, dtype)
        return model
    dcp.load(wanted, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True))
    set_model_state_dict(model, wanted, options=StateDictOptions(strict=False))
    return model


def _load_converted(model: torch.nn.Module, path: Path, dtype: torch.dtype) -> None:
    """A checkpoint whose weights are not stored under the model's own names: transformers 5 keeps a MoE's experts
    fused in memory (3-D `gate_up_proj` / `down_proj` Parameters) but writes and reads them per expert, under
    transformers 4's names (conversion_mapping.py: `mixtral`, `qwen2_moe` and the model types mapped to them), so
    the shards cannot be read by name. transformers' own loader converts them on rank 0 (one whole copy, in CPU
    memory, as one process would load it), and every rank takes its shards of rank 0's weights by broadcast."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoModelForCausalLM

    full: dict[str, Any] = {}  # rank 0's; the others take part with nothing
    if dist.get_rank() == 0:
        whole, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
        if info["missing_keys"]:  # it would have drawn them at random
            raise ValueError(f"{path} lacks weights of the model: {sorted(info['missing_keys'])[:8]}")
        full = whole.state_dict()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, full, options=options)


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
