"""The reference engine's start-up check: a model served through KVBatch's paths gives what the model itself gives.

Before the engine takes a request it runs a short probe sequence through the paths requests take (unpadded prefill,
prefill on top of a cached prefix, left-padded batched decode, and with shared-prefix decode the cascade prefill and
decode) and compares each position's log-probs with one plain forward pass of the model over the whole sequence. A
model class those paths do not serve right (masks, caches or attention it handles its own way) is then refused when
the engine starts, by name, instead of aborting requests or serving wrong logprobs mid-run. The probe is longer
than a short sliding window, so a window the paths do not apply shows here (a long window is covered by the tests'
short-window models: the code that applies it does not depend on its size).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from rollq.engine.server.kv_batch import CascadeUnsupported, KVBatch, SharedPrefix, prefill, prefill_last

PROBE_TOKENS = 24  # the probe's length without a window to cross
PROBE_WINDOW_MAX = 256  # a sliding window up to this long is crossed by the probe (a few more forward tokens)
DECODE_STEPS = 5
# Largest difference of a log-prob between a path and the plain forward: float32 paths agree to ~1e-5 (the same
# sums in another order); half precision rounds each path on its own. A bug (a missing mask or window) is off by
# whole nats.
TOLERANCE = {torch.float32: 2e-3, torch.float64: 1e-6}
HALF_TOLERANCE = 0.5


def probe_ids(vocab_size: int, context_length: int, window: int | None, avoid: Collection[int] = ()) -> list[int]:
    """A deterministic probe sequence: long enough to cross a window up to PROBE_WINDOW_MAX, within the context,
    without the `avoid` ids (a vision model's image placeholders, which a text forward cannot take)."""
    n = PROBE_TOKENS + (window + DECODE_STEPS if window and window <= PROBE_WINDOW_MAX else 0)
    n = min(n, context_length - 1)
    skip = set(avoid)
    usable = [t for t in range(vocab_size) if t not in skip]
    return [usable[(7919 * i + 11) % len(usable)] for i in range(n)]


def sliding_window(model: Any) -> int | None:
    """The model's sliding window, when it has windowed layers (config.sliding_window; transformers' own configs
    leave it None where no layer is windowed, as Qwen2 without use_sliding_window)."""
    window = getattr(model.config.get_text_config(), "sliding_window", None)
    return int(window) if window else None


def reference_logprobs(model: Any, ids: list[int]) -> tuple[torch.Tensor, str | None]:
    """Log-probs of every position from one plain forward pass ([len(ids), vocab]: what each check compares with),
    or what is wrong when the forward itself fails."""
    try:
        logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[0]
    except Exception as exc:  # a model class a causal LM's plain call does not run
        return torch.empty(0), _failed("the check", exc)
    return torch.log_softmax(logits.float(), dim=-1), None


class _Comparison:
    def __init__(self, reference: torch.Tensor, tolerance: float) -> None:
        self.reference = reference
        self.tolerance = tolerance
        self.worst = (0.0, "")

    def check(self, logits: torch.Tensor, position: int, path: str) -> None:
        """`logits` [vocab] the path's for the token after `position`."""
        got = torch.log_softmax(logits.float(), dim=-1)
        diff = float((got - self.reference[position]).abs().max())
        if not diff <= self.worst[0]:  # NaN counts as worst
            self.worst = (diff, path)

    def failure(self) -> str | None:
        diff, path = self.worst
        if diff <= self.tolerance:
            return None
        return f"{path} gives log-probs {diff:.3g} away from the model's own forward pass (tolerance {self.tolerance})"


def _decode(batch: KVBatch, model: Any, ids: list[int], ends: list[int], cmp: _Comparison, path: str) -> None:
    """DECODE_STEPS steps of `batch`, whose rows hold ids[:end] for each end: row r feeds ids[end] next."""
    for step in range(DECODE_STEPS):
        tokens = [ids[end + step] for end in ends]
        logits = batch.decode(model, tokens)
        for r, end in enumerate(ends):
            cmp.check(logits[r], end + step, path)


def _failed(what: str, exc: Exception) -> str:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{what} fails ({type(exc).__name__}: {first})"


def check_plain(model: Any, ids: list[int], reference: torch.Tensor, tolerance: float) -> str | None:
    """What is wrong with the plain paths (prefill, prefill on a cached prefix, batched left-padded decode), or
    None. `reference`: reference_logprobs(model, ids)."""
    try:
        return _check_plain(model, ids, _Comparison(reference, tolerance))
    except Exception as exc:  # e.g. a recurrent model's cache: nothing here can serve it
        return _failed("the check", exc)


def _check_plain(model: Any, ids: list[int], cmp: _Comparison) -> str | None:
    long_end, short_end = len(ids) - DECODE_STEPS, len(ids) - DECODE_STEPS - 3
    cached = short_end // 2
    (long,) = prefill(model, [ids[:long_end]])
    cmp.check(long.logits, long_end - 1, "prefill")
    prefix = [(k[:, :, :cached], v[:, :, :cached]) for k, v in long.layers]
    (short,) = prefill(model, [ids[:short_end]], [prefix])
    cmp.check(short.logits, short_end - 1, "prefill on a cached prefix")
    batch = KVBatch()
    batch.add([long, short])
    _decode(batch, model, ids, [long_end, short_end], cmp, "batched decode of left-padded rows")
    return cmp.failure()


def check_cascade(model: Any, ids: list[int], reference: torch.Tensor, tolerance: float) -> str | None:
    """What is wrong with shared-prefix decode (model loaded with CASCADE), or None: two rows on one prefix, one
    prefilled against it (`prefill_last`), one with a suffix of its own, decoding side by side with a third row
    that shares nothing. `reference`: reference_logprobs(model, ids), of the model's own attention."""
    cmp = _Comparison(reference, tolerance)
    shared_end = len(ids) - DECODE_STEPS - 4
    (whole,) = prefill(model, [ids[: len(ids) - DECODE_STEPS]])
    layers = [(k[:, :, :shared_end].clone(), v[:, :, :shared_end].clone()) for k, v in whole.layers]
    prefix = SharedPrefix(tuple(ids[:shared_end]), layers)
    try:
        (last,) = prefill_last(model, [ids[: shared_end + 1]], [prefix])
        cmp.check(last.logits, shared_end, "shared-prefix prefill")
        (own,) = prefill(model, [ids[: shared_end + 3]], [layers])
        alone = prefill(model, [ids[:4]])[0]
        batch = KVBatch(cascade=True)
        batch.add([last, own, alone], [prefix, prefix, None])
        _decode(batch, model, ids, [shared_end + 1, shared_end + 3, 4], cmp, "shared-prefix decode")
    except CascadeUnsupported as exc:
        return str(exc)
    except Exception as exc:  # the model's attention or cache works another way: served without the cascade
        return _failed("shared-prefix decode", exc)
    return cmp.failure()


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, HALF_TOLERANCE)
