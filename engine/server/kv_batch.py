"""The running batch of a continuous-batching scheduler: one left-padded KV cache for every running sequence.

Each row's tokens are right-aligned; an attention mask hides the padding and explicit position ids keep every row's
positions its own, so a row decodes exactly as it would alone. Rows join (after their own unpadded prefill) and
leave between decode steps. Works with HF decoder-only models that take `position_ids` and a 2-D attention mask
(Llama/Qwen families); sliding-window layers are treated as full attention.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel


class Prefilled:
    """One sequence's own cache after prefill, and the logits of its last position."""

    __slots__ = ("layers", "length", "logits")

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]], length: int, logits: torch.Tensor) -> None:
        self.layers = layers  # per layer (keys, values), each [1, kv_heads, length, head_dim]
        self.length = length
        self.logits = logits  # [vocab]


def prefill(model: PreTrainedModel, ids: Sequence[int]) -> Prefilled:
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=torch.tensor([list(ids)], device=model.device),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    layers = [(k, v) for k, v, *_ in out.past_key_values]
    return Prefilled(layers, len(ids), out.logits[0, -1])


class KVBatch:
    """Left-padded batched cache. Row order is the caller's: `keep` and `add` say which rows stay and join."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._mask = torch.zeros(0, 0, dtype=torch.long)  # [B, L]: 1 = real token
        self._lengths = torch.zeros(0, dtype=torch.long)  # [B]: real tokens per row = next position id
        self._cache: DynamicCache | None = None  # built from _layers on the first decode after a membership change

    @property
    def size(self) -> int:
        return int(self._lengths.shape[0])

    def tokens(self) -> int:
        return int(self._lengths.sum())

    def clear(self) -> None:
        self._reset()

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only `rows` (in that order); columns that became padding in every row are cut."""
        if len(rows) == self.size and list(rows) == list(range(self.size)):
            return
        if not rows:
            self.clear()
            return
        idx = torch.tensor(list(rows), device=self._lengths.device)
        lengths = self._lengths[idx]
        start = self._mask.shape[1] - int(lengths.max())
        self._layers = [(k[idx, :, start:], v[idx, :, start:]) for k, v in self._layers]
        self._cache = None
        self._mask = self._mask[idx, start:]
        self._lengths = lengths

    def add(self, seqs: Sequence[Prefilled]) -> None:
        """Append rows, left-padding old and new rows to a common length."""
        if not seqs:
            return
        dev = seqs[0].logits.device
        width = max([self._mask.shape[1], *(s.length for s in seqs)])
        parts_mask = [self._pad_mask(self._mask, width)] if self.size else []
        parts_mask += [self._pad_mask(torch.ones(1, s.length, dtype=torch.long, device=dev), width) for s in seqs]
        layers = []
        for li in range(len(seqs[0].layers)):
            ks, vs = ([self._pad_kv(self._layers[li][j], width)] if self.size else [] for j in (0, 1))
            ks += [self._pad_kv(s.layers[li][0], width) for s in seqs]
            vs += [self._pad_kv(s.layers[li][1], width) for s in seqs]
            layers.append((torch.cat(ks), torch.cat(vs)))
        self._layers = layers
        self._cache = None
        self._mask = torch.cat(parts_mask)
        self._lengths = torch.cat([self._lengths.to(dev), torch.tensor([s.length for s in seqs], device=dev)])

    def decode(self, model: torch.nn.Module, tokens: Sequence[int]) -> torch.Tensor:
        """Feed one token per row; returns next-token logits [B, vocab] and grows every row by one."""
        mask = torch.cat([self._mask, torch.ones(self.size, 1, dtype=torch.long, device=self._mask.device)], dim=1)
        if self._cache is None:
            self._cache = DynamicCache(ddp_cache_data=self._layers)
        out = model(
            input_ids=torch.tensor(list(tokens), device=mask.device)[:, None],
            attention_mask=mask,
            position_ids=self._lengths[:, None],
            past_key_values=self._cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self._layers = [(k, v) for k, v, *_ in self._cache]
        self._mask = mask
        self._lengths = self._lengths + 1
        return out.logits[:, -1]

    @staticmethod
    def _pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
        return torch.nn.functional.pad(mask, (width - mask.shape[1], 0))

    @staticmethod
    def _pad_kv(t: torch.Tensor, width: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, 0, width - t.shape[2], 0))
