"""Batched token sampling for the reference engine, SGLang's semantics: penalties, then temperature (greedy below
1e-6), then top_k / top_p / min_p; logprobs are log_softmax of the raw logits at the sampled token.

Randomness is counter-based: the uniform a row draws is a hash of (its request's key, the index of the token being
sampled), computed for the whole batch in a few tensor ops, so a request samples the same tokens whatever its batch
(and again after a retract re-prefills it)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from rollq.engine.types import SamplingParams

GREEDY_BELOW = 1e-6


def request_key(seed: int, rid: str) -> int:
    """The random key of a request, from (engine seed, rid): a signed 64-bit integer."""
    digest = hashlib.blake2b(f"{seed}\x00{rid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _M1, _M2 = (_signed(x) for x in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def uniforms(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) (float32, 24 random bits) per (key, position): splitmix64 over int64 tensors."""
    x = keys + (positions + 1) * _GOLDEN  # int64 arithmetic wraps
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    x = x ^ _shr(x, 31)
    return _shr(x, 40).to(torch.float32) * 2.0**-24


class RowSpec:
    """What the sampler needs about one row: its params, the tokens it produced, its random key and which ids stop
    it. `position`: the index of the token to sample (default: len(output_ids)); it and `key` pick its uniform."""

    __slots__ = ("params", "output_ids", "key", "stop_ids", "position")

    def __init__(
        self,
        params: SamplingParams,
        output_ids: Sequence[int],
        key: int,
        stop_ids: Sequence[int],
        position: int | None = None,
    ) -> None:
        self.params = params
        self.output_ids = output_ids
        self.key = key
        self.stop_ids = stop_ids  # masked while fewer than min_new_tokens were produced
        self.position = len(output_ids) if position is None else position


def sample(logits: torch.Tensor, rows: Sequence[RowSpec]) -> tuple[list[int], list[float]]:
    """logits: [B, V] (any float dtype). Returns (token ids, logprobs of those tokens under the raw logits).

    Each row takes its own path whatever its neighbours: greedy (argmax), plain softmax sampling (inverse CDF in
    vocabulary order) or filtered sampling (inverse CDF over the sorted, filtered distribution)."""
    logits = logits.float().cpu()
    work = _apply_penalties(logits, rows)
    vocab = logits.shape[1]
    kinds = [_kind(r.params, vocab) for r in rows]
    lse: torch.Tensor | None = None
    if all(k == _GREEDY for k in kinds):
        tokens = work.argmax(dim=-1)
    elif all(k == _PLAIN for k in kinds):  # the RL rollout case: no indexing, and the logprobs' normaliser for free
        temps = [r.params.temperature for r in rows]
        plain = work is logits and all(t == 1.0 for t in temps)
        tokens, cdf, peak = _sample_plain(work, temps, _uniforms_of(rows))
        if plain:
            lse = (peak + cdf[:, -1:].log()).squeeze(1)
    else:
        tokens = torch.empty(len(rows), dtype=torch.long)
        for kind in (_GREEDY, _PLAIN, _FILTERED):
            picked = [i for i, k in enumerate(kinds) if k == kind]
            if not picked:
                continue
            idx = torch.tensor(picked)
            sub = [rows[i] for i in picked]
            if kind == _GREEDY:
                tokens[idx] = work[idx].argmax(dim=-1)
            elif kind == _PLAIN:
                tokens[idx] = _sample_plain(work[idx], [r.params.temperature for r in sub], _uniforms_of(sub))[0]
            else:
                tokens[idx] = _sample_filtered(work[idx], sub)
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(1, tokens[:, None]).squeeze(1) - lse
    return tokens.tolist(), chosen.tolist()


_GREEDY, _PLAIN, _FILTERED = range(3)


def _kind(p: SamplingParams, vocab: int) -> int:
    if p.temperature < GREEDY_BELOW:
        return _GREEDY
    return _PLAIN if _unfiltered(p, vocab) else _FILTERED


def _uniforms_of(rows: Sequence[RowSpec]) -> torch.Tensor:
    return uniforms(torch.tensor([r.key for r in rows]), torch.tensor([r.position for r in rows]))


def _sample_plain(
    logits: torch.Tensor, temps: Sequence[float], u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax sampling by inverse CDF in vocabulary order (no sort). Returns the tokens, the unnormalised CDF of
    the scaled logits and their per-row maximum (at temperature 1 these give the logprobs' normaliser)."""
    scaled = logits if all(t == 1.0 for t in temps) else logits / torch.tensor(temps)[:, None]
    peak = scaled.amax(dim=-1, keepdim=True)
    cdf = (scaled - peak).exp_().cumsum_(dim=-1)
    return _inverse_cdf(cdf, u), cdf, peak


def _inverse_cdf(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index of the first cdf entry above u * total, per row (cdf unnormalised, non-decreasing). The target stays
    below the total, so the pick is never a zero-probability token at the end, whatever the rounding."""
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _apply_penalties(logits: torch.Tensor, rows: Sequence[RowSpec]) -> torch.Tensor:
    """Frequency/presence/repetition penalties over the output tokens, and stop ids masked under min_new_tokens."""
    out = logits
    for i, r in enumerate(rows):
        p = r.params
        needs_min = p.min_new_tokens > r.position and r.stop_ids
        penal = r.output_ids and (p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0)
        if not (needs_min or penal):
            continue
        if out is logits:
            out = logits.clone()
        row = out[i]
        if penal:
            counts = torch.bincount(torch.tensor(list(r.output_ids)), minlength=row.shape[0])[: row.shape[0]]
            seen = counts > 0
            row -= p.frequency_penalty * counts + p.presence_penalty * seen
            if p.repetition_penalty != 1.0:
                hit = row[seen]
                row[seen] = torch.where(hit > 0, hit / p.repetition_penalty, hit * p.repetition_penalty)
        if needs_min:
            row[torch.tensor(list(r.stop_ids))] = float("-inf")
    return out


def _sample_filtered(logits: torch.Tensor, rows: Sequence[RowSpec]) -> torch.Tensor:
    """Filtered sampling by inverse CDF over the sorted distribution; one uniform per row from (key, position)."""
    n, vocab = logits.shape
    temp = torch.tensor([r.params.temperature for r in rows])[:, None]
    u = _uniforms_of(rows)
    top_k = torch.tensor([r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows])[:, None]
    top_p = torch.tensor([r.params.top_p for r in rows])[:, None]
    min_p = torch.tensor([r.params.min_p for r in rows])[:, None]
    sorted_logits, order = torch.sort(logits / temp, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    rank = torch.arange(vocab)[None, :]
    drop = rank >= top_k
    drop |= (probs.cumsum(dim=-1) - probs) > top_p  # keep the smallest prefix reaching top_p
    drop |= probs < min_p * probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    probs = probs.masked_fill(drop, 0.0)
    cdf = probs.cumsum(dim=-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=vocab - 1)
    # Floating slack can land on a dropped (zero-probability) slot at the end: step back to the last kept one.
    kept = (~drop).sum(dim=-1, keepdim=True) - 1
    pick = torch.minimum(pick, kept)
    return order.gather(1, pick).squeeze(1)


def _unfiltered(p: SamplingParams, vocab: int) -> bool:
    return not 0 < p.top_k < vocab and p.top_p >= 1.0 and p.min_p <= 0.0
