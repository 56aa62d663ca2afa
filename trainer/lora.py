"""LoRA for the trainer (peft): a frozen base model with a trained adapter.

The adapter is put on the model after it is loaded, sharded or not: on N ranks the base stays FSDP2-sharded (and
frozen: FSDP all-gathers it for each pass and reduces nothing of it), while the adapter, a few MiB, is a plain
replicated copy on every rank whose gradients are summed by one all-reduce before each optimizer step. So every
rank holds the same adapter, and a rank's checkpoint shard of it is the whole of it (DCP writes it once).

`all-linear` (the default target) names the model's linear layers, never a transformers-5 MoE's router or fused
experts, which no engine serves in mixed-adapter batches (`linear_targets` says why, with the sources); a run that
names them anyway must publish merged weights (`apply_lora`).

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


def linear_targets(model: torch.nn.Module) -> list[str]:
    """`all-linear` as rollq resolves it: the full names of the model's linear layers (`nn.Linear`, GPT-2's
    `Conv1D`) but the output head, the modules every serving side runs an adapter on in mixed batches.

    peft's own rule for the shorthand is the same (peft 0.21.2, tuners/tuners_utils.py:2430-2490,
    `_maybe_include_all_linear_layers`), except on transformers 5 MoE models: there peft first rewrites `all-linear`
    to the v4 names of the router and the experts as well (utils/transformers_weight_conversion.py:355-373 and
    402-481, for every model type transformers maps to the `mixtral` or `qwen2_moe` conversion, Qwen3-MoE included),
    because in transformers 5 these are no linear layers any more: the router is a module of its own holding a
    `weight` Parameter (MixtralTopKRouter, models/mixtral/modeling_mixtral.py:96-102 in 5.24.0; Qwen3MoeTopKRouter,
    models/qwen3_moe/modeling_qwen3_moe.py:250-257) and the experts are two 3-D Parameters (`gate_up_proj`,
    `down_proj`: modeling_mixtral.py:57-66). peft adapts those through `target_parameters`, as `lora.ParamWrapper`,
    which refuses mixed-adapter batches (peft/tuners/lora/layer.py:2680-2684), the batches the reference engine
    runs; SGLang serves no router adapter in 0.5.5 or 0.5.23 (`gate` is in neither's SUPPORTED_LORA_TARGET_MODULES:
    srt/utils/common.py:3238-3248 and 4700-4722) and no expert adapter in 0.5.5 (srt/lora/layers.py:337-352 wrap
    linear layers only), and reads an adapter's `target_modules` alone, never `target_parameters`
    (srt/lora/lora_config.py:28 in 0.5.5, :42 in 0.5.23). Naming the linear layers explicitly keeps peft's
    rewrite from adding them."""
    from transformers.pytorch_utils import Conv1D

    output_embeddings = getattr(model, "get_output_embeddings", None)
    head = output_embeddings() if callable(output_embeddings) else None
    return sorted(
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear | Conv1D) and module is not head
    )


def lora_config(config: TrainConfig, model: torch.nn.Module, base_path: Path | str | None = None) -> Any:
    """peft's LoraConfig of the run's settings for `model` (`all-linear` resolved by `linear_targets`)."""
    from peft import LoraConfig

    targets = list(config.lora_target_modules)
    return LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=linear_targets(model) if targets == ["all-linear"] else targets,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=str(base_path) if base_path is not None else None,
    )


def parameter_targets(model: torch.nn.Module) -> list[str]:
    """The Parameters an adapter adapts directly (peft's `lora.ParamWrapper`, from `target_parameters`: a MoE's
    router weight and fused experts), by their names in the model; [] when it adapts linear layers only."""
    from peft.tuners.lora import ParamWrapper

    found = []
    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper):  # nested wrappers (two Parameters of one module) sit under base_layer
            owner = ".".join(part for part in name.split(".") if part != "base_layer")
            found.append(f"{owner}.{module.parameter_name}")
    return sorted(found)


def apply_lora(model: torch.nn.Module, config: TrainConfig, base_path: Path | str) -> Any:
    """`model` (loaded, sharded or not) with an adapter: a peft model whose only trainable parameters are the
    adapter's. Its initial weights depend on the torch seed only (B is zero: the adapter starts as no change).

    An adapter that would adapt Parameters directly (named targets peft maps onto a MoE's router or fused experts)
    is refused when the run publishes adapters: no engine could serve it (`linear_targets`), and the run would
    fail at its first publish instead of now."""
    from peft import get_peft_model

    try:
        peft_model = get_peft_model(model, lora_config(config, model, base_path))
    except ValueError as exc:  # peft names the target modules it could not find
        raise ValueError(f"lora_target_modules {config.lora_target_modules}: {exc}") from None
    direct = parameter_targets(base_model(peft_model))
    if direct and config.lora_publish == "adapter":
        raise ValueError(
            f"lora_target_modules {config.lora_target_modules}: peft adapts {_listed(direct)} as Parameters "
            "(lora.ParamWrapper: a MoE router or fused experts), which engines cannot serve as an adapter in "
            "mixed batches; target linear layers only (all-linear does), or publish merged weights "
            "(lora_publish merged)"
        )
    return peft_model


def _listed(names: list[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


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
    from peft.tuners.lora import LoraLayer, ParamWrapper

    base = base_model(model)
    # Each adapted Parameter's LoRA layer, by the Parameter itself: a linear layer's weight (lora.Linear), or the
    # Parameter a ParamWrapper adapts (nested ones all under one module), so both merge.
    owners: dict[int, Any] = {}
    for module in base.modules():
        if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A:
            target = module.get_param() if isinstance(module, ParamWrapper) else module.get_base_layer().weight
            owners[id(target)] = module
    for name, p in base.named_parameters():
        if "lora_" in name:
            continue
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        owner = owners.get(id(p))
        if owner is not None:
            with torch.no_grad():
                full = full + _full(owner.get_delta_weight(ADAPTER_NAME)).to(full.dtype)
        plain = ".".join(part for part in name.split(".") if part != "base_layer")  # the base model's own name
        yield plain, (full.detach().to("cpu").contiguous() if leader else None)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_NAME",
    "ADAPTER_WEIGHTS",
    "adapter_state",
    "all_reduce_grads",
    "apply_lora",
    "base_model",
    "broadcast_adapter",
    "linear_targets",
    "lora_config",
    "merged_parameters",
    "parameter_targets",
    "trainable",
    "write_adapter",
]
