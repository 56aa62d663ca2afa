"""The running batch of a continuous-batching scheduler: one left-padded KV cache for every running sequence.

Each row's tokens are right-aligned; an attention mask hides the padding and explicit position ids keep every row's
positions its own, so a row decodes exactly as it would alone. Rows join (after their own unpadded prefill) and
leave between decode steps. Works with HF decoder-only models that take `position_ids` and a 2-D attention mask
(Llama/Qwen families); sliding-window layers are treated as full attention.

KV lives in preallocated per-layer buffers [rows, kv_heads, capacity, head_dim], grown geometrically: a decode step
writes its token's K/V in place (`_BufferLayer.update`) instead of concatenating the whole cache anew, and the model
attends over views up to the current length. Prefills run in batches of sequences with equal cached and uncached
lengths (`prefill`), e.g. the samples of a group on top of their shared cached prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [rows, kv_heads, length, head_dim]


def _capacity(n: int) -> int:
    """Room for n tokens and then some: buffers grow by half (amortised O(1) copies per token)."""
    return n + max(16, n // 2)


class _BufferLayer(DynamicLayer):
    """A cache layer over preallocated buffers: `update` writes the new K/V after the current length, in place, and
    returns views of the filled part. `reserve`: capacity to allocate at the first update when given no buffers."""

    def __init__(
        self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None, length: int = 0, reserve: int = 0
    ) -> None:
        super().__init__()
        self.length = length
        self.reserve = reserve
        self.kbuf: torch.Tensor | None = keys
        self.vbuf: torch.Tensor | None = values
        if keys is not None and values is not None:
            self.dtype, self.device = keys.dtype, keys.device
            self.keys, self.values = keys[:, :, :length], values[:, :, :length]
            self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, q, d = key_states.shape
        cap = max(q, self.reserve)
        self.kbuf = key_states.new_empty(b, h, cap, d)
        self.vbuf = value_states.new_empty(b, h, cap, value_states.shape[-1])
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.kbuf is not None and self.vbuf is not None
        start, end = self.length, self.length + key_states.shape[2]
        if end > self.kbuf.shape[2]:
            self.grow(_capacity(end))
        self.kbuf[:, :, start:end].copy_(key_states)
        self.vbuf[:, :, start:end].copy_(value_states)
        self.length = end
        self.keys, self.values = self.kbuf[:, :, :end], self.vbuf[:, :, :end]
        return self.keys, self.values

    def grow(self, capacity: int) -> None:
        assert self.kbuf is not None and self.vbuf is not None
        n = self.length
        for name in ("kbuf", "vbuf"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[0], old.shape[1], capacity, old.shape[3])
            new[:, :, :n].copy_(old[:, :, :n])
            setattr(self, name, new)

    def get_seq_length(self) -> int:
        return self.length

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of the filled part: views [rows, kv_heads, length, head_dim]."""
        assert self.kbuf is not None and self.vbuf is not None
        return self.kbuf[:, :, : self.length], self.vbuf[:, :, : self.length]


class _BufferCache(DynamicCache):
    """A DynamicCache (as far as the model can tell) over `_BufferLayer`s."""

    def __init__(self, layers: list[_BufferLayer]) -> None:  # skips DynamicCache.__init__
        Cache.__init__(self, layers=list(layers))


class Prefilled:
    """One sequence's own cache after prefill, and the logits of its last position."""

    __slots__ = ("layers", "length", "logits")

    def __init__(self, layers: KV, length: int, logits: torch.Tensor) -> None:
        self.layers = layers  # per layer (keys, values), each [1, kv_heads, length, head_dim]
        self.length = length
        self.logits = logits  # [vocab]


def prefill(
    model: PreTrainedModel, ids: Sequence[Sequence[int]], cached: Sequence[KV | None] | None = None
) -> list[Prefilled]:
    """Prefill a batch of sequences of equal length in one forward pass. With `cached` (per sequence, the KV of a
    prefix of its ids from the prefix cache, all prefixes of one length) only the rest is computed, on top of it;
    `cached` itself is never written. A sequence's result (KV views into the batch's buffers) is what a prefill of
    it alone would give."""
    rows, length = len(ids), len(ids[0])
    if any(len(x) != length for x in ids):
        raise ValueError("a batched prefill takes sequences of one length")
    kvs = list(cached) if cached is not None else [None] * rows
    start = int(kvs[0][0][0].shape[2]) if kvs[0] else 0
    if any((int(kv[0][0].shape[2]) if kv else 0) != start for kv in kvs):
        raise ValueError("a batched prefill takes cached prefixes of one length")
    if not 0 <= start < length:
        raise ValueError(f"a cached prefix of {start} tokens leaves nothing to compute of {length}")
    layers: list[_BufferLayer]
    if start:
        layers = []
        for li in range(len(kvs[0])):  # type: ignore[arg-type]
            k0, v0 = kvs[0][li]  # type: ignore[index]
            kbuf = k0.new_empty(rows, k0.shape[1], length, k0.shape[3])
            vbuf = v0.new_empty(rows, v0.shape[1], length, v0.shape[3])
            for r, kv in enumerate(kvs):
                kbuf[r, :, :start].copy_(kv[li][0][0])  # type: ignore[index]
                vbuf[r, :, :start].copy_(kv[li][1][0])  # type: ignore[index]
            layers.append(_BufferLayer(kbuf, vbuf, start))
    else:
        n_layers = model.config.get_text_config().num_hidden_layers
        layers = [_BufferLayer(reserve=length) for _ in range(n_layers)]
    out = model(
        input_ids=torch.tensor([list(x[start:]) for x in ids], device=model.device),
        past_key_values=_BufferCache(layers),
        use_cache=True,
        logits_to_keep=1,
    )
    logits = out.logits[:, -1]
    kvs_out = [lay.kv() for lay in layers]
    return [Prefilled([(k[r : r + 1], v[r : r + 1]) for k, v in kvs_out], length, logits[r]) for r in range(rows)]


class KVBatch:
    """Left-padded batched cache. Row order is the caller's: `keep` and `add` say which rows stay and join."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._cache: _BufferCache | None = None  # holds the per-layer buffers; width = its layers' length
        self._mask_buf = torch.zeros(0, 0, dtype=torch.long)  # [B, capacity]: 1 = real token, up to the width
        self._lengths = torch.zeros(0, dtype=torch.long)  # [B]: real tokens per row = next position id
        self._width = 0

    @property
    def _layers(self) -> list[_BufferLayer]:
        return [] if self._cache is None else self._cache.layers  # type: ignore[return-value]

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
        width = int(lengths.max())
        start = self._width - width
        kept = [(k[idx, :, start:], v[idx, :, start:]) for k, v in (lay.kv() for lay in self._layers)]
        self._install(kept, self._mask_buf[idx, start : self._width], lengths)

    def add(self, seqs: Sequence[Prefilled]) -> None:
        """Append rows, left-padding old and new rows to a common length."""
        if not seqs:
            return
        dev = seqs[0].logits.device
        width = max([self._width, *(s.length for s in seqs)])
        old, b_old = self._layers, self.size
        rows = b_old + len(seqs)
        cap = _capacity(width)
        mask = torch.zeros(rows, cap, dtype=torch.long, device=dev)
        if b_old:
            mask[:b_old, width - self._width : width] = self._mask_buf[:, : self._width]
        for r, s in enumerate(seqs, b_old):
            mask[r, width - s.length : width] = 1
        layers = []
        for li, kv0 in enumerate(seqs[0].layers):
            bufs = []
            for j, t0 in enumerate(kv0):
                buf = t0.new_zeros(rows, t0.shape[1], cap, t0.shape[3])  # zeros: padding must stay finite
                if b_old:
                    buf[:b_old, :, width - self._width : width] = old[li].kv()[j]
                for r, s in enumerate(seqs, b_old):
                    buf[r, :, width - s.length : width] = s.layers[li][j][0]
                bufs.append(buf)
            layers.append(_BufferLayer(bufs[0], bufs[1], width))
        self._cache = _BufferCache(layers)
        self._mask_buf = mask
        self._width = width
        self._lengths = torch.cat([self._lengths.to(dev), torch.tensor([s.length for s in seqs], device=dev)])

    def _install(self, layers: KV, mask: torch.Tensor, lengths: torch.Tensor) -> None:
        """Rows given as (keys, values) per layer of width = mask.shape[1], copied into fresh buffers with room."""
        width = mask.shape[1]
        cap = _capacity(width)
        new = []
        for k, v in layers:
            kbuf = k.new_empty(k.shape[0], k.shape[1], cap, k.shape[3])
            vbuf = v.new_empty(v.shape[0], v.shape[1], cap, v.shape[3])
            kbuf[:, :, :width] = k
            vbuf[:, :, :width] = v
            new.append(_BufferLayer(kbuf, vbuf, width))
        self._cache = _BufferCache(new)
        self._mask_buf = mask.new_zeros(mask.shape[0], cap)
        self._mask_buf[:, :width] = mask
        self._width = width
        self._lengths = lengths

    def row(self, i: int) -> tuple[int, KV]:
        """(real tokens of row i, their KV per layer): the row without its left padding (views, not copies)."""
        n = int(self._lengths[i])
        w = self._width
        return n, [(k[i : i + 1, :, w - n :], v[i : i + 1, :, w - n :]) for k, v in (lay.kv() for lay in self._layers)]

    def decode(self, model: torch.nn.Module, tokens: Sequence[int]) -> torch.Tensor:
        """Feed one token per row; returns next-token logits [B, vocab] and grows every row by one."""
        assert self._cache is not None
        w = self._width
        if w + 1 > self._mask_buf.shape[1]:
            grown = self._mask_buf.new_zeros(self.size, _capacity(w + 1))
            grown[:, :w] = self._mask_buf[:, :w]
            self._mask_buf = grown
        self._mask_buf[:, w] = 1
        out = model(
            input_ids=torch.tensor(list(tokens), device=self._mask_buf.device)[:, None],
            attention_mask=self._mask_buf[:, : w + 1],
            position_ids=self._lengths[:, None],
            past_key_values=self._cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self._width = w + 1
        self._lengths = self._lengths + 1
        return out.logits[:, -1]
