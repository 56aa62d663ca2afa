"""The reference engine's LoRA adapters, inside one peft model (peft runs the mixed-adapter batches).

Each loaded adapter holds a slot: a peft adapter name (`s<N>`). peft's own load of a new adapter name walks and
wraps every targeted module (seconds for a 30-layer model), so an unloaded adapter's slot is kept, and the next
adapter of the same shape (rank, alpha, target modules) takes it: its weights are read and copied into the slot's
tensors, nothing else changes. SGLang keeps adapters in a memory pool of slots for the same reason
(srt/lora/mem_pool.py). Only a new shape, or no spare slot, goes through peft's load. Callers serialize calls (the
backend's lock) and run them off the event loop.

An adapter peft cannot run in a mixed-adapter batch is refused before it touches the model (`mixed_batch_blockers`):
every batch here passes `adapter_names`, so once loaded it would fail every step, every row, until unloaded.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Sequence
from typing import Any

import torch

BASE = "__base__"  # peft's name for a row of a mixed batch that runs the base model
SPARE_SLOTS = 4  # unloaded adapters' slots kept for reuse; beyond that peft deletes them


class UnservableAdapter(ValueError):
    """An adapter this engine cannot serve in mixed batches; the load is refused (a 400 naming why)."""


def mixed_batch_blockers(config: Any, base: torch.nn.Module) -> list[str]:
    """What of the adapter `config` (peft's LoraConfig as read from its adapter_config.json) peft cannot run in a
    mixed-adapter batch on `base`, each said in words; [] when it can run all of it.

    - Parameters adapted directly (`target_parameters`, peft's lora.ParamWrapper: a MoE's router weight and fused
      experts), whose forward refuses `adapter_names` (peft 0.21.2, tuners/lora/layer.py:2680-2684). On
      transformers 5 peft itself adds them at load time to an adapter whose `target_modules` name the router or
      the experts by their transformers-4 names, or are `all-linear` (utils/transformers_weight_conversion.py:
      355-373 and 402-481, called from tuners/tuners_utils.py:833-849), so the conversion is run here on a copy of
      the config, as the load would run it.
    - DoRA, which peft's mixed batches refuse for every layer (tuners/lora/layer.py:845-851)."""
    from peft import import_utils

    probe = copy.deepcopy(config)
    # peft's own condition (tuners_utils.py:833; the module imports only on transformers 5); a peft without the
    # conversion converts nothing
    if getattr(import_utils, "is_transformers_ge_v5", False):
        try:
            from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
        except ImportError:
            pass
        else:
            convert_peft_config_for_transformers(probe, model=base, conversions=None)
    blockers = []
    direct = sorted(getattr(probe, "target_parameters", None) or [])
    if direct:
        blockers.append(
            f"Parameters adapted directly (target_parameters {direct}: peft's lora.ParamWrapper, a MoE router or "
            "fused experts)"
        )
    if getattr(probe, "use_dora", False):
        blockers.append("DoRA (use_dora)")
    return blockers


def signature(config: Any) -> tuple[Any, ...]:
    """What must match for an adapter to take another's slot (the modules and the shapes of A and B, the scaling)."""
    targets = config.target_modules
    targets = tuple(sorted(targets)) if isinstance(targets, set | list | tuple) else targets
    return (config.r, config.lora_alpha, targets, bool(getattr(config, "use_rslora", False)), config.bias)


class AdapterSlots:
    def __init__(self, base: torch.nn.Module, device: str, dtype: torch.dtype) -> None:
        self.base = base
        self.model: Any = base  # the base model, or peft's wrapper once an adapter was loaded
        self.device, self.dtype = device, dtype
        self._slot_of: dict[int, str] = {}  # adapter id -> its slot
        self._spare: list[tuple[tuple[Any, ...], str]] = []  # (signature, slot) free for reuse, oldest first
        self._sig: dict[str, tuple[Any, ...]] = {}
        self._names = itertools.count(1)
        self.reused = 0  # loads that took a spare slot (tests and the bench read it)

    def load(self, adapter_id: int, path: str, config: Any) -> None:
        blockers = mixed_batch_blockers(config, self.base)
        if blockers:
            raise UnservableAdapter(
                f"{path} holds {' and '.join(blockers)}, which peft cannot run in mixed-adapter batches, the only "
                "batches this engine runs (plain LoRA on linear layers can: a rollq trainer's all-linear)"
            )
        sig = signature(config)
        spare = next((i for i, (s, _) in enumerate(self._spare) if s == sig), None)
        if spare is not None and self._copy_into(self._spare[spare][1], path):
            slot = self._spare.pop(spare)[1]
            self.reused += 1
        else:
            slot = f"s{next(self._names)}"
            self._attach(slot, path)
            self._sig[slot] = sig
        self._slot_of[adapter_id] = slot

    def _attach(self, slot: str, path: str) -> None:
        from peft import PeftModel

        if self.model is self.base:
            self.model = PeftModel.from_pretrained(self.base, path, adapter_name=slot, is_trainable=False)
        else:
            self.model.load_adapter(path, adapter_name=slot, is_trainable=False)
        self.model.to(device=self.device, dtype=self.dtype).eval()
        self.model.requires_grad_(False)

    @torch.no_grad()
    def _copy_into(self, slot: str, path: str) -> bool:
        """The adapter at `path` copied into `slot`'s tensors; False (nothing changed) unless every tensor of the
        file has its place there with its shape and every one of the slot's is in the file."""
        from peft.utils import load_peft_weights

        weights = load_peft_weights(path, device="cpu")
        params = {n: p for n, p in self.model.named_parameters() if f".{slot}." in n}
        placed = {}
        for key, tensor in weights.items():
            name = key.replace(".lora_A.", f".lora_A.{slot}.").replace(".lora_B.", f".lora_B.{slot}.")
            target = params.get(name)
            if target is None or target.shape != tensor.shape:
                return False
            placed[name] = tensor
        if placed.keys() != params.keys():
            return False
        for name, tensor in placed.items():
            params[name].copy_(tensor.to(dtype=params[name].dtype, device=params[name].device))
        return True

    def unload(self, adapter_id: int) -> None:
        slot = self._slot_of.pop(adapter_id)
        self._spare.append((self._sig[slot], slot))
        while len(self._spare) > SPARE_SLOTS:
            _, oldest = self._spare.pop(0)
            self._delete(oldest)

    def _delete(self, slot: str) -> None:
        if not self._slot_of and not self._spare:  # the last one: the plain model again (peft merges nothing)
            self.model = self.base = self.model.unload()
            return
        with warnings.catch_warnings():  # "Adapter sN was active which is now deleted": rows name theirs anyway
            warnings.filterwarnings("ignore", message="Adapter .* was active", category=UserWarning)
            self.model.delete_adapter(slot)
        self._sig.pop(slot, None)

    def names(self, adapter_ids: Sequence[int | None]) -> list[str] | None:
        """peft's per-row adapter names (None while no adapter was ever loaded: a plain forward)."""
        if self.model is self.base:
            return None
        return [self._slot_of[i] if i is not None else BASE for i in adapter_ids]


__all__ = ["BASE", "SPARE_SLOTS", "AdapterSlots", "UnservableAdapter", "mixed_batch_blockers", "signature"]
