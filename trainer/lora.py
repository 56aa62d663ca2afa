"""LoRA for the trainer (peft): a frozen base model with a trained adapter.

The adapter is put on the model after it is loaded, sharded or not: on N ranks the base stays FSDP2-sharded (and
frozen: FSDP all-gathers it for each pass and reduces nothing of it), while the adapter, a few MiB, is a plain
replicated copy on every rank whose gradients are summed by one all-reduce before each optimizer step. So every
rank holds the same adapter, and a rank's checkpoint shard of it is the whole of it (DCP writes it once).

What leaves the trainer is either the adapter in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`,
what SGLang's `/load_lora_adapter` and peft's `PeftModel.from_pretrained` read) or the merged weights (base +
scaling * B A) under the base model's own names, for engines that take full weights.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rollq.trainer.config import TrainConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_NAME = "default"  # peft's name for a model's single adapter


def lora_config(config: TrainConfig, base_path: Path | str | None = None) -> Any:
    """peft's LoraConfig of the run's settings."""
    from peft import LoraConfig

    targets: str | list[str] = list(config.lora_target_modules)
    if targets == ["all-linear"]:
        targets = "all-linear"  # peft takes the shorthand only as a string
    return LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=str(base_path) if base_path is not None else None,
    )


def apply_lora(model: torch.nn.Module, config: TrainConfig, base_path: Path | str) -> Any:
    """`model` (loaded, sharded or not) with an adapter: a peft model whose only trainable parameters are the
    adapter's. Its initial weights depend on the torch seed only (B is zero: the adapter starts as no change)."""
    from peft import get_peft_model

    try:
        return get_peft_model(model, lora_config(config, base_path))
    except ValueError as exc:  # peft names the target modules it could not find
        raise ValueError(f"lora_target_modules {config.lora_target_modules}: {exc}") from None


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def base_model(model: Any) -> torch.nn.Module:
    """The transformers model under a peft model (its modules now wrapped by LoRA layers)."""
    return model.get_base_model()


def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Average the replicated adapter's gradients over the ranks (one flat all-reduce), as FSDP does for sharded
    parameters: each rank's loss is scaled by the number of ranks (trainer.policy), so the average is the gradient
    of the global per-token mean."""
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)  # the compute group (NCCL on GPUs): the tensors are where the model is
    flat /= dist.get_world_size()
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(g).clone()
        offset += n


def broadcast_adapter(params: list[torch.nn.Parameter]) -> None:
    """Rank 0's initial adapter on every rank (the seed makes them equal; this makes sure)."""
    import torch.distributed as dist

    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, src=0)


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapter's weights as PEFT saves them (keys without the adapter's name), on the CPU."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, state_dict=_adapter_params(model))
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def _adapter_params(model: Any) -> dict[str, torch.Tensor]:
    # the adapter's own parameters only: model.state_dict() would also list the (sharded) base
    return {name: p for name, p in model.named_parameters() if "lora_" in name}


def write_adapter(directory: Path, model: Any) -> Path:
    """The adapter in PEFT's format in `directory`, written beside it and renamed into place (an engine never sees
    half of it)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(adapter_state(model), str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    model.peft_config[ADAPTER_NAME].save_pretrained(str(tmp))  # adapter_config.json, as peft writes it
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return directory


def merged_parameters(model: Any, leader: bool) -> Iterator[tuple[str, torch.Tensor | None]]:
    """The base model's parameters under their own names with the adapter merged in (W + scaling * B A), whole,
    on the CPU on rank 0 (None elsewhere): a collective every rank runs to the end, in the same order (a sharded
    base weight is gathered)."""
    from peft.tuners.lora import LoraLayer

    base = base_model(model)
    owners: dict[str, Any] = {  # peft's Linear (what all-linear and named linears become) has get_delta_weight
        f"{name}.base_layer.weight": module
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A
    }
    for name, p in base.named_parameters():
        if "lora_" in name:
            continue
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        owner = owners.get(name)
        if owner is not None:
            with torch.no_grad():
                full = full + owner.get_delta_weight(ADAPTER_NAME).to(full.dtype)
        yield name.replace(".base_layer.", "."), (full.detach().to("cpu").contiguous() if leader else None)


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_NAME",
    "ADAPTER_WEIGHTS",
    "adapter_state",
    "all_reduce_grads",
    "apply_lora",
    "base_model",
    "broadcast_adapter",
    "lora_config",
    "merged_parameters",
    "trainable",
    "write_adapter",
]
