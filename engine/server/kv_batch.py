"""The running batch of a continuous-batching scheduler: one left-padded KV cache for every running sequence.

Each row's tokens are right-aligned; an attention mask hides the padding and explicit position ids keep every row's
positions its own, so a row decodes exactly as it would alone. Rows join (after their own unpadded prefill) and
leave between decode steps. Model-agnostic: every model class gets the shapes all of them accept (a 2-D padding mask,
or in cascade steps a prepared 4-D one, which transformers' mask builders hand through as is), and sliding-window
layers see exactly their window (the model's own mask in plain steps, `sliding_window` in cascade steps).

KV lives in preallocated per-layer buffers [rows, kv_heads, capacity, head_dim], grown geometrically: a decode step
writes its token's K/V in place (`_BufferLayer.update`) instead of concatenating the whole cache anew, and the model
attends over views up to the current length. Prefills run in batches of sequences with equal cached and uncached
lengths (`prefill`), e.g. the samples of a group on top of their shared cached prompt.

Shared-prefix ("cascade") decode, as FlashInfer/SGLang for radix-shared prefixes: with `KVBatch(cascade=True)` and
a model loaded with `attn_implementation=CASCADE`, rows added with a `SharedPrefix` keep only their suffix (the
tokens after the prefix) in the left-padded buffers; all rows of one prefix share a single copy of its K/V. A decode
step attends each row's query to the shared prefix (one batched attention op for all groups) and to its own suffix, and
merges the two by log-sum-exp, which is exact. Rows without a prefix take the suffix part only (their whole KV).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [rows, kv_heads, length, head_dim]


def _capacity(n: int) -> int:
    """Room for n tokens and then some: buffers grow by half (amortised O(1) copies per token)."""
    return n + max(16, n // 2)


CASCADE = "rollq_cascade"  # attn_implementation: SDPA, plus shared-prefix attention in KVBatch decode steps


class SharedPrefix:
    """The K/V of a token prefix shared by several rows of a KVBatch: `key` its tokens, `layers` per layer
    (keys, values), each [1, kv_heads, len(key), head_dim], read-only. `epoch`: the caller's tag of the weights it
    was computed with (the prefix cache's epoch), so that rows prefilled after a flush do not join it."""

    __slots__ = ("key", "layers", "length", "epoch")

    def __init__(self, key: tuple[int, ...], layers: KV, epoch: int = 0) -> None:
        self.key = key
        self.layers = layers
        self.length = len(key)
        self.epoch = epoch


class _CascadePlan:
    """What the cascade attention needs in one decode step: per layer the groups' prefix K/V, padded to one length
    ([G, kv_heads, Pmax, head_dim]), which rows use which group, and the suffix padding of every row."""

    __slots__ = (
        "prefix",
        "prefix_bias",
        "lengths",
        "rows",
        "slots",
        "order",
        "groups",
        "width",
        "suffix_bias",
        "padded",
        "positions",
        "windows",
        "mask",
    )

    def __init__(self, prefixes: list[SharedPrefix], shared: list[SharedPrefix | None], device: torch.device) -> None:
        index = {id(p): g for g, p in enumerate(prefixes)}
        rows, slots, fill = [], [], [0] * len(prefixes)
        for r, p in enumerate(shared):
            if p is not None:
                g = index[id(p)]
                rows.append(r)
                slots.append((g, fill[g]))
                fill[g] += 1
        self.groups, self.width = len(prefixes), max(fill)
        self.lengths = torch.tensor([p.length for p in prefixes], device=device)
        self.rows = torch.tensor(rows, device=device)
        flat = [g * self.width + j for g, j in slots]
        self.slots = torch.tensor(flat, device=device)  # flat (group, slot) of each shared row
        self.order: torch.Tensor | None = None  # the rows in slot order, when no slot is empty
        if len(flat) == self.groups * self.width:
            order = [0] * len(flat)
            for r, f in zip(rows, flat, strict=True):
                order[f] = r
            self.order = torch.tensor(order, device=device)
        longest = max(p.length for p in prefixes)
        self.prefix: KV = []
        for li in range(len(prefixes[0].layers)):
            pair = []
            for j in range(2):
                t0 = prefixes[0].layers[li][j]
                buf = t0.new_zeros(len(prefixes), t0.shape[1], longest, t0.shape[3])
                for g, p in enumerate(prefixes):
                    buf[g, :, : p.length] = p.layers[li][j][0]
                pair.append(buf)
            self.prefix.append((pair[0], pair[1]))
        pad = torch.arange(longest, device=device)[None, :] >= self.lengths[:, None]
        dtype = prefixes[0].layers[0][0].dtype
        bias = torch.zeros(pad.shape, dtype=dtype, device=device).masked_fill_(pad, float("-inf"))
        self.prefix_bias = bias[:, None, None, :] if bool(pad.any()) else None  # [G, 1, 1, Pmax] additive
        self.suffix_bias: torch.Tensor | None = None  # [B, 1, 1, W] additive (-inf on left padding), set per step
        self.padded = True  # whether rows have left padding (else suffix_bias stays None)
        self.positions = torch.zeros(0, dtype=torch.long, device=device)  # [B] each row's query token index, per step
        self.windows: dict[int, _WindowBias] = {}  # per sliding-window size, built at its first layer of a step
        # What the model is handed as attention_mask: a 4-D tensor, which every model class's mask builder returns
        # unchanged (transformers' _preprocess_mask_arguments), so none builds a mask of its own for this step
        self.mask = torch.zeros(1, 1, 1, 1, dtype=dtype, device=device)

    def step(self, positions: torch.Tensor, suffix_bias: torch.Tensor | None) -> None:
        """Set up one forward: `positions` [B] the token index of each row's query (its tokens before it, shared
        prefix included), `suffix_bias` as the attribute."""
        self.positions, self.suffix_bias = positions, suffix_bias
        self.windows.clear()

    def window(self, size: int, suffix_width: int) -> _WindowBias:
        """The additive biases of a sliding-window layer of `size` in this step (transformers' rule: a query at token
        index i sees the keys at indices j with i - size < j <= i)."""
        made = self.windows.get(size)
        if made is None:
            made = self.windows[size] = _WindowBias(self, size, suffix_width)
        return made


class _WindowBias:
    """A sliding-window layer's view in one cascade step. Suffix: column c of the left-padded buffers (the query's
    own token at the last column, W-1) holds the token W-1-c before the query in every row, so the window keeps the
    last `size` columns of all rows alike. Prefix: token j of a row's shared prefix is visible from j >
    position - size, a bound per row; a row that sees none of its prefix drops that part (`dead`)."""

    __slots__ = ("suffix", "prefix", "dead")

    def __init__(self, plan: _CascadePlan, size: int, suffix_width: int) -> None:
        self.suffix = plan.suffix_bias
        if suffix_width > size:
            cut = plan.mask.new_zeros(1, 1, 1, suffix_width)
            cut[..., : suffix_width - size] = float("-inf")
            self.suffix = cut if self.suffix is None else self.suffix + cut
        self.prefix = plan.prefix_bias
        self.dead: torch.Tensor | None = None
        low = plan.positions[plan.rows] - size + 1  # per shared row: its first visible prefix token
        if bool((low > 0).any()):
            longest = plan.prefix[0][0].shape[2]
            lows = low.new_zeros(plan.groups * plan.width)
            lows[plan.slots] = low  # by (group, slot); empty slots see everything (their output is never read)
            hidden = torch.arange(longest, device=low.device)[None, :] < lows[:, None]  # [G * n, Pmax]
            rows = plan.mask.new_zeros(hidden.shape).masked_fill_(hidden, float("-inf"))
            rows = rows.view(plan.groups, 1, plan.width, 1, longest)
            self.prefix = rows if self.prefix is None else rows + self.prefix[:, :, None]
            self.dead = (low >= plan.lengths[plan.slots // plan.width])[:, None, None, None]  # [shared rows, 1, 1, 1]


def cascade_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    rollq_cascade: _CascadePlan | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA, except in a KVBatch cascade decode step (`rollq_cascade` given): there every row attends to its
    suffix (`key`/`value`: the batch's left-padded buffers) and, for rows with a shared prefix, to that prefix;
    the two partial attentions are merged exactly by their log-sum-exp. A sliding-window layer (`sliding_window`,
    as the model passes it) sees its window in both parts. An attention the cascade does not compute (logit
    softcapping, attention sinks) raises CascadeUnsupported: the engine's start-up check (engine/server/
    self_check.py) then serves the model without shared-prefix decode."""
    if rollq_cascade is None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
    unsupported = [name for name in UNSUPPORTED_ATTENTION if kwargs.get(name) is not None]
    if unsupported:
        raise CascadeUnsupported(f"{type(module).__name__} passes {', '.join(unsupported)} to its attention")
    plan = rollq_cascade
    b, heads, _, d = query.shape  # one query token per row
    kv_heads = key.shape[1]
    rep = heads // kv_heads
    scale = scaling if scaling is not None else d**-0.5
    window = plan.window(sliding_window, key.shape[2]) if sliding_window else None
    suffix_bias = window.suffix if window is not None else plan.suffix_bias
    prefix_bias = window.prefix if window is not None else plan.prefix_bias
    q = query.reshape(b, kv_heads, rep, d)  # head h reads kv head h // rep, as repeat_kv: the rep heads as queries
    out, lse = _partial_attention(q, key, value, suffix_bias, scale)  # every row has its new token
    pk, pv = plan.prefix[module.layer_idx]  # type: ignore[index]
    g, n = plan.groups, plan.width
    if prefix_bias is not None and prefix_bias.dim() == 5:  # per-row window bounds: [G, 1, n, 1 -> rep, Pmax]
        prefix_bias = prefix_bias.expand(-1, -1, -1, rep, -1).reshape(g, 1, n * rep, -1)
    if plan.order is not None:  # every slot of every group taken: a gather
        qp = q.index_select(0, plan.order)
    else:
        qp = q.new_zeros(g * n, kv_heads, rep, d)
        qp[plan.slots] = q[plan.rows]
    qp = qp.view(g, n, kv_heads, rep, d).transpose(1, 2).reshape(g, kv_heads, n * rep, d)
    op, lse_p = _partial_attention(qp, pk, pv, prefix_bias, scale)  # all groups' queries at once

    def per_row(t: torch.Tensor) -> torch.Tensor:  # [G, kv_heads, n * rep, x] -> [shared rows, kv_heads, rep, x]
        x = t.shape[-1]
        return t.view(g, kv_heads, n, rep, x).transpose(1, 2).reshape(g * n, kv_heads, rep, x)[plan.slots]

    op, lse_p = per_row(op).float(), per_row(lse_p)
    if window is not None and window.dead is not None:  # rows past their whole prefix: no weight, whatever the op
        op.masked_fill_(window.dead, 0.0)
        lse_p = lse_p.masked_fill(window.dead, float("-inf"))
    every = plan.rows.shape[0] == b  # every row shares a prefix: no row indexing
    ls = lse if every else lse[plan.rows]
    # The suffix part's share of the whole softmax is exp(ls) / (exp(ls) + exp(lse_p)) = sigmoid(ls - lse_p): one
    # stable op where a max, two exps and a division would take five (a dead prefix, lse_p -inf, gives 1)
    share = (ls - lse_p).sigmoid_()
    out = out.float()
    merged = (out if every else out[plan.rows]).sub(op).mul_(share).add_(op)
    if not every:
        out[plan.rows] = merged
    return (merged if every else out).to(query.dtype).reshape(b, 1, heads, d), None


class CascadeUnsupported(RuntimeError):
    """The model's attention does something the cascade does not compute; the message names it."""


# Arguments a model's attention may pass that change its result and that the cascade does not compute: Gemma 2's
# attention logit softcapping, gpt-oss's attention sinks
UNSUPPORTED_ATTENTION = ("softcap", "s_aux")

_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [N, H, Q, d] to k/v [N, H, K, d] (additive `bias` broadcast to [N, H, Q, K]); returns the
    output [N, H, Q, d] and the log-sum-exp of the scores [N, H, Q, 1] (float32), to merge with other parts."""
    if _flash_cpu is not None and q.device.type == "cpu":
        out, lse = _flash_cpu(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
        return out, lse.unsqueeze(-1)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)
    if bias is not None:
        s += bias
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return torch.matmul(s.sub_(lse).exp_(), v.float()).to(q.dtype), lse


AttentionInterface.register(CASCADE, cascade_attention)
AttentionMaskInterface.register(CASCADE, sdpa_mask)


@functools.cache
def cache_argument(model_class: Any) -> str:
    """The name under which `model_class.forward` takes its KV cache: `cache` since transformers 5.x renamed it
    (`past_key_values` is deprecated for removal in 5.40: modeling_layers.py's deprecate_kwarg), `past_key_values`
    before. A fact of the class, looked up once."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def _cache_kwargs(model: Any, cache: Cache) -> dict[str, Cache]:
    """The model's forward argument for `cache`; peft's wrapper passes its keyword arguments to the base model."""
    base: Any = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {cache_argument(base.__class__): cache}


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
    """One sequence's own cache after prefill, and the logits of its last position. With `shared` (a cascade
    prefill), `layers` hold only the tokens after that prefix."""

    __slots__ = ("layers", "length", "logits", "shared", "rope_delta")

    def __init__(
        self,
        layers: KV,
        length: int,
        logits: torch.Tensor,
        shared: SharedPrefix | None = None,
        rope_delta: int = 0,
    ) -> None:
        self.layers = layers  # per layer (keys, values), each [1, kv_heads, length (- shared.length), head_dim]
        self.length = length
        self.logits = logits  # [vocab]
        self.shared = shared
        # Position of the next token minus `length`: negative after images under multimodal rope (Qwen2-VL's
        # rope_deltas: an image's tokens span fewer positions than they are many)
        self.rope_delta = rope_delta

    def full_layers(self) -> KV:
        """KV of all `length` tokens (a concatenation when the prefix is shared)."""
        if self.shared is None:
            return self.layers
        return [
            (torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2))
            for (pk, pv), (k, v) in zip(self.shared.layers, self.layers, strict=True)
        ]


# Sequences' ids here are cache keys: a LoRA adapter's rows carry token + adapter id * ADAPTER_KEY_SPACE
# (engine/server/reference.py `_keys`), so prefixes of different adapters never match; the model gets the tokens.
ADAPTER_KEY_SPACE = 1 << 40


def _tokens(ids: Sequence[int]) -> list[int]:
    return [t % ADAPTER_KEY_SPACE for t in ids]


def _adapter_kwargs(adapters: Sequence[str] | None) -> dict[str, Any]:
    """peft's mixed-batch argument (one adapter name per row, "__base__" for the base model), when the model
    serves adapters (engine/server/reference.py); nothing otherwise."""
    return {} if adapters is None else {"adapter_names": list(adapters)}


def prefill(
    model: PreTrainedModel,
    ids: Sequence[Sequence[int]],
    cached: Sequence[KV | None] | None = None,
    adapters: Sequence[str] | None = None,
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
        input_ids=torch.tensor([_tokens(x[start:]) for x in ids], device=model.device),
        **_cache_kwargs(model, _BufferCache(layers)),
        use_cache=True,
        logits_to_keep=1,
        **_adapter_kwargs(adapters),
    )
    logits = out.logits[:, -1]
    kvs_out = [lay.kv() for lay in layers]
    return [Prefilled([(k[r : r + 1], v[r : r + 1]) for k, v in kvs_out], length, logits[r]) for r in range(rows)]


def prefill_vision(
    model: PreTrainedModel,
    ids: Sequence[Sequence[int]],
    pixel_values: Sequence[torch.Tensor],
    image_grid_thw: Sequence[torch.Tensor],
    mm_token_type_ids: Sequence[Sequence[int]],
) -> list[Prefilled]:
    """Prefill sequences of equal length holding image tokens (a Qwen2-VL-family model) in one forward pass: their
    images through the vision tower, each row's 3-D rope positions from its image grids (the model's own
    get_rope_index), no cached prefix. Each result decodes in a KVBatch like any row, its positions moved by its rope
    delta."""
    length = len(ids[0])
    if any(len(x) != length for x in ids):
        raise ValueError("a batched prefill takes sequences of one length")
    device = model.device
    input_ids = torch.tensor([list(x) for x in ids], device=device)
    types = torch.tensor([list(t) for t in mm_token_type_ids], device=device)
    grid = torch.cat(list(image_grid_thw)).to(device)
    positions, deltas = model.model.get_rope_index(input_ids, types, grid, None, torch.ones_like(input_ids))
    n_layers = model.config.get_text_config().num_hidden_layers
    layers = [_BufferLayer(reserve=length) for _ in range(n_layers)]
    out = model(
        input_ids=input_ids,
        pixel_values=torch.cat(list(pixel_values)).to(device, model.dtype),
        image_grid_thw=grid,
        position_ids=positions,
        **_cache_kwargs(model, _BufferCache(layers)),
        use_cache=True,
        logits_to_keep=1,
    )
    kv = [lay.kv() for lay in layers]
    rows = [[(k[r : r + 1], v[r : r + 1]) for k, v in kv] for r in range(len(ids))]
    return [Prefilled(row, length, out.logits[r, -1], rope_delta=int(deltas[r, 0])) for r, row in enumerate(rows)]


def prefill_last(
    model: PreTrainedModel,
    ids: Sequence[Sequence[int]],
    shared: Sequence[SharedPrefix],
    adapters: Sequence[str] | None = None,
) -> list[Prefilled]:
    """Cascade prefill (model loaded with CASCADE) of sequences whose all but last token are their `shared`
    prefix's: one forward pass of the last tokens, attending to the prefixes' single copies (as a decode step of a
    cascade KVBatch), no prefix KV copied. Each result holds the KV of its last token and its `shared` prefix."""
    device = shared[0].layers[0][0].device
    if any(len(x) != p.length + 1 or tuple(x[: p.length]) != p.key for x, p in zip(ids, shared, strict=True)):
        raise ValueError("a cascade prefill computes the one token after each sequence's shared prefix")
    groups = list({id(p): p for p in shared}.values())
    plan = _CascadePlan(groups, list(shared), device)
    positions = torch.tensor([p.length for p in shared], device=device)
    plan.step(positions, None)
    n_layers = model.config.get_text_config().num_hidden_layers
    layers = [_BufferLayer(reserve=1) for _ in range(n_layers)]
    out = model(
        input_ids=torch.tensor([[x[-1] % ADAPTER_KEY_SPACE] for x in ids], device=device),
        attention_mask=plan.mask,
        position_ids=positions[:, None],
        **_cache_kwargs(model, _BufferCache(layers)),
        use_cache=True,
        logits_to_keep=1,
        rollq_cascade=plan,
        **_adapter_kwargs(adapters),
    )
    logits = out.logits[:, -1]
    kvs_out = [lay.kv() for lay in layers]
    return [
        Prefilled([(k[r : r + 1], v[r : r + 1]) for k, v in kvs_out], len(x), logits[r], p)
        for r, (x, p) in enumerate(zip(ids, shared, strict=True))
    ]


class KVBatch:
    """Left-padded batched cache. Row order is the caller's: `keep` and `add` say which rows stay and join.

    With `cascade`, rows added with a SharedPrefix hold only their suffix in the buffers (see the module doc)."""

    def __init__(self, cascade: bool = False) -> None:
        self.cascade = cascade
        self._reset()

    def _reset(self) -> None:
        self._cache: _BufferCache | None = None  # holds the per-layer buffers; width = its layers' length
        self._mask_buf = torch.zeros(0, 0, dtype=torch.long)  # [B, capacity]: 1 = real token, up to the width
        self._lengths = torch.zeros(0, dtype=torch.long)  # [B]: tokens per row = next position id
        self._offsets = torch.zeros(0, dtype=torch.long)  # [B]: tokens of its shared prefix (not in the buffers)
        self._deltas = torch.zeros(0, dtype=torch.long)  # [B]: rope position minus token index (Prefilled.rope_delta)
        self._shared: list[SharedPrefix | None] = []
        self._plan: _CascadePlan | None = None
        self._width = 0

    @property
    def _layers(self) -> list[_BufferLayer]:
        return [] if self._cache is None else self._cache.layers

    @property
    def size(self) -> int:
        return int(self._lengths.shape[0])

    def tokens(self) -> int:
        return int(self._lengths.sum())

    def prefixes(self, epoch: int | None = None) -> dict[tuple[int, ...], SharedPrefix]:
        """The shared prefixes rows of the batch use (of that epoch, if given), by their tokens."""
        return {p.key: p for p in self._shared if p is not None and (epoch is None or p.epoch == epoch)}

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
        lengths, offsets = self._lengths[idx], self._offsets[idx]
        width = int((lengths - offsets).max())
        start = self._width - width
        kept = [(k[idx, :, start:], v[idx, :, start:]) for k, v in (lay.kv() for lay in self._layers)]
        shared = [self._shared[r] for r in rows]
        self._install(kept, self._mask_buf[idx, start : self._width], lengths, offsets, shared, self._deltas[idx])

    def add(self, seqs: Sequence[Prefilled], shared: Sequence[SharedPrefix | None] | None = None) -> None:
        """Append rows, left-padding old and new rows to a common length. `shared` (per row, cascade batches only):
        the prefix of the row's tokens it shares with others; only the rest of its KV is copied in."""
        if not seqs:
            return
        shared = list(shared) if shared is not None else [None] * len(seqs)
        for r, s in enumerate(seqs):
            if s.shared is not None:
                if shared[r] not in (None, s.shared):
                    raise ValueError("a cascade-prefilled row keeps the prefix it was prefilled against")
                shared[r] = s.shared
        if any(p is not None for p in shared) and not self.cascade:
            raise ValueError("shared prefixes need a cascade batch")
        offs = [p.length if p is not None else 0 for p in shared]
        cut = [o - (s.shared.length if s.shared is not None else 0) for s, o in zip(seqs, offs, strict=True)]
        dev = seqs[0].logits.device
        width = max([self._width, *(s.length - o for s, o in zip(seqs, offs, strict=True))])
        old, b_old = self._layers, self.size
        rows = b_old + len(seqs)
        cap = _capacity(width)
        mask = torch.zeros(rows, cap, dtype=torch.long, device=dev)
        if b_old:
            mask[:b_old, width - self._width : width] = self._mask_buf[:, : self._width]
        for r, (s, o) in enumerate(zip(seqs, offs, strict=True), b_old):
            mask[r, width - s.length + o : width] = 1
        layers = []
        for li, kv0 in enumerate(seqs[0].layers):
            bufs = []
            for j, t0 in enumerate(kv0):
                buf = t0.new_zeros(rows, t0.shape[1], cap, t0.shape[3])  # zeros: padding must stay finite
                if b_old:
                    buf[:b_old, :, width - self._width : width] = old[li].kv()[j]
                for r, (s, o, c) in enumerate(zip(seqs, offs, cut, strict=True), b_old):
                    buf[r, :, width - s.length + o : width] = s.layers[li][j][0, :, c:]
                bufs.append(buf)
            layers.append(_BufferLayer(bufs[0], bufs[1], width))
        self._cache = _BufferCache(layers)
        self._mask_buf = mask
        self._width = width
        self._lengths = torch.cat([self._lengths.to(dev), torch.tensor([s.length for s in seqs], device=dev)])
        self._offsets = torch.cat([self._offsets.to(dev), torch.tensor(offs, device=dev)])
        self._deltas = torch.cat([self._deltas.to(dev), torch.tensor([s.rope_delta for s in seqs], device=dev)])
        self._shared = [*self._shared, *shared]
        self._plan = None

    def _install(
        self,
        layers: KV,
        mask: torch.Tensor,
        lengths: torch.Tensor,
        offsets: torch.Tensor,
        shared: list[SharedPrefix | None],
        deltas: torch.Tensor,
    ) -> None:
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
        self._offsets = offsets
        self._deltas = deltas
        self._shared = shared
        self._plan = None

    def own(self, i: int) -> tuple[int, int, KV]:
        """(tokens of row i, tokens of its shared prefix, KV of the tokens after that prefix): views, not copies."""
        n = int(self._lengths[i])
        prefix = self._shared[i]
        p = prefix.length if prefix is not None else 0
        start = self._width - n + p
        return n, p, [(k[i : i + 1, :, start:], v[i : i + 1, :, start:]) for k, v in (lay.kv() for lay in self._layers)]

    def row(self, i: int) -> tuple[int, KV]:
        """(tokens of row i, their KV per layer): the row without its left padding (views, not copies), its shared
        prefix (if any) included (a concatenation)."""
        n, _, own = self.own(i)
        prefix = self._shared[i]
        if prefix is None:
            return n, own
        return n, [
            (torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2))
            for (pk, pv), (k, v) in zip(prefix.layers, own, strict=True)
        ]

    def decode(
        self, model: torch.nn.Module, tokens: Sequence[int], adapters: Sequence[str] | None = None
    ) -> torch.Tensor:
        """Feed one token per row (with its row's adapter, when the model serves adapters); returns next-token
        logits [B, vocab] and grows every row by one."""
        assert self._cache is not None
        w = self._width
        if w + 1 > self._mask_buf.shape[1]:
            grown = self._mask_buf.new_zeros(self.size, _capacity(w + 1))
            grown[:, :w] = self._mask_buf[:, :w]
            self._mask_buf = grown
        self._mask_buf[:, w] = 1
        mask: Any = self._mask_buf[:, : w + 1]
        extra: dict[str, Any] = {}
        if any(p is not None for p in self._shared):
            if self._plan is None:
                groups = list({id(p): p for p in self._shared if p is not None}.values())
                self._plan = _CascadePlan(groups, self._shared, self._mask_buf.device)
                # rows all as long as the buffers (e.g. a group admitted at once) stay so: no padding to mask
                self._plan.padded = bool((self._lengths - self._offsets != w).any())
            bias = None
            if self._plan.padded:
                bias = torch.zeros(mask.shape, dtype=self._layers[0].dtype, device=mask.device)
                bias = bias.masked_fill_(mask == 0, float("-inf"))[:, None, None, :]
            self._plan.step(self._lengths, bias)
            extra["rollq_cascade"], mask = self._plan, self._plan.mask
        out = model(
            input_ids=torch.tensor(list(tokens), device=self._mask_buf.device)[:, None],
            attention_mask=mask,
            position_ids=(self._lengths + self._deltas)[:, None],
            **_cache_kwargs(model, self._cache),
            use_cache=True,
            logits_to_keep=1,
            **extra,
            **_adapter_kwargs(adapters),
        )
        self._width = w + 1
        self._lengths = self._lengths + 1
        return out.logits[:, -1]
