"""Batched token sampling for the reference engine, SGLang's semantics: penalties, then temperature (greedy below
1e-6), then top_k / top_p / min_p; logprobs are log_softmax of the raw logits at the sampled token."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from rollq.engine.types import SamplingParams

GREEDY_BELOW = 1e-6


def request_generator(seed: int, rid: str) -> torch.Generator:
    """A CPU generator seeded from (engine seed, rid): a request samples the same tokens whatever its batch."""
    digest = hashlib.blake2b(f"{seed}\x00{rid}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


class RowSpec:
    """What the sampler needs about one row: its params, the tokens it produced, its RNG and which ids stop it."""

    __slots__ = ("params", "output_ids", "generator", "stop_ids")

    def __init__(
        self, params: SamplingParams, output_ids: Sequence[int], generator: torch.Generator, stop_ids: Sequence[int]
    ) -> None:
        self.params = params
        self.output_ids = output_ids
        self.generator = generator
        self.stop_ids = stop_ids  # masked while fewer than min_new_tokens were produced


def sample(logits: torch.Tensor, rows: Sequence[RowSpec]) -> tuple[list[int], list[float]]:
    """logits: [B, V] (any float dtype). Returns (token ids, logprobs of those tokens under the raw logits)."""
    logits = logits.float().cpu()  # per-request CPU generators; the reference engine favours simplicity here
    logprobs = torch.log_softmax(logits, dim=-1)
    work = _apply_penalties(logits, rows)
    greedy = [i for i, r in enumerate(rows) if r.params.temperature < GREEDY_BELOW]
    sampled = [i for i, r in enumerate(rows) if r.params.temperature >= GREEDY_BELOW]
    tokens = torch.empty(len(rows), dtype=torch.long)
    if greedy:
        idx = torch.tensor(greedy)
        tokens[idx] = work[idx].argmax(dim=-1)
    if sampled:
        idx = torch.tensor(sampled)
        tokens[idx] = _sample_rows(work[idx], [rows[i] for i in sampled])
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    return tokens.tolist(), chosen.tolist()


def _apply_penalties(logits: torch.Tensor, rows: Sequence[RowSpec]) -> torch.Tensor:
    """Frequency/presence/repetition penalties over the output tokens, and stop ids masked under min_new_tokens."""
    out = logits
    for i, r in enumerate(rows):
        p = r.params
        needs_min = p.min_new_tokens > len(r.output_ids) and r.stop_ids
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


def _sample_rows(logits: torch.Tensor, rows: Sequence[RowSpec]) -> torch.Tensor:
    """Filtered sampling by inverse CDF over the sorted distribution; one uniform per row from its own generator."""
    n, vocab = logits.shape
    temp = torch.tensor([r.params.temperature for r in rows])[:, None]
    u = torch.cat([torch.rand(1, generator=r.generator) for r in rows])
    if all(_unfiltered(r.params, vocab) for r in rows):  # plain softmax sampling: no sort needed
        cdf = torch.softmax(logits / temp, dim=-1).cumsum(dim=-1)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
        last = (cdf < cdf[:, -1:]).sum(dim=-1, keepdim=True)  # last token with probability > 0 (rounding slack)
        return torch.minimum(pick, last).squeeze(1)
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
