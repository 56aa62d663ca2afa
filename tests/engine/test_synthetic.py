"""SyntheticBackend on its own: determinism across resubmission, length distributions, weights, speed."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import pytest

from engine.backend import GenState
from engine.synthetic import LengthDist, SyntheticBackend, SyntheticConfig
from engine.types import SamplingParams


async def run(backend: SyntheticBackend, prompt: list[int], tokens: int, **params) -> GenState:
    state = GenState("r", prompt, SamplingParams(max_new_tokens=tokens, ignore_eos=True, **params), True)
    await backend.run(state)
    return state


@pytest.mark.parametrize("latency", [0.0, 0.001])
async def test_prompt_plus_partial_output_continues_identically(latency):
    backend = SyntheticBackend(SyntheticConfig(per_token_latency_s=latency, seed=7))
    full = await run(backend, [10, 11, 12], 30)
    rest = await run(backend, [10, 11, 12, *full.output_ids[:10]], 20)
    assert rest.output_ids == full.output_ids[10:]
    assert rest.output_logprobs == full.output_logprobs[10:]
    assert all(lp < 0 for lp in full.output_logprobs)
    other_seed = await run(SyntheticBackend(SyntheticConfig(seed=8)), [10, 11, 12], 30)
    assert other_seed.output_ids != full.output_ids
    await backend.close()


def test_length_distributions():
    rng = random.Random(0)
    pareto = [LengthDist.parse("pareto:16:1.2").sample(rng) for _ in range(4000)]
    assert min(pareto) >= 16 and max(pareto) > 20 * statistics.median(pareto)  # heavy tail
    uniform = [LengthDist.parse("uniform:5:9").sample(rng) for _ in range(500)]
    assert set(uniform) == {5, 6, 7, 8, 9}
    assert 80 < statistics.median(LengthDist.parse("lognormal:100:0.5").sample(rng) for _ in range(2000)) < 120
    assert LengthDist.parse("fixed").sample(rng) is None and LengthDist.parse("fixed:3").sample(rng) == 3
    with pytest.raises(ValueError):
        LengthDist.parse("zipf:1")


async def test_length_draw_ends_with_eos_capped_by_max_new_tokens():
    backend = SyntheticBackend(SyntheticConfig(length=LengthDist(kind="uniform", low=3, high=6)))
    for i in range(20):
        state = GenState(f"r{i}", [i + 3], SamplingParams(max_new_tokens=5))
        await backend.run(state)
        assert state.finish.type in ("stop", "length") and len(state.output_ids) <= 5
        if state.finish.type == "stop":
            assert state.output_ids[-1] == 2 and 2 not in state.output_ids[:-1]


async def test_load_weights_needs_an_existing_path(tmp_path):
    backend = SyntheticBackend()
    await backend.load_weights(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        await backend.load_weights(str(tmp_path / "nope"))


async def test_many_short_generations_are_cheap():
    backend = SyntheticBackend()
    states = [GenState(f"r{i}", [3, i % 500 + 3], SamplingParams(max_new_tokens=16, ignore_eos=True)) for i in range(5000)]
    t0 = time.perf_counter()
    await asyncio.gather(*(backend.run(s) for s in states))
    assert time.perf_counter() - t0 < 1.0  # well under the 1,000 requests/s the server must sustain
    assert all(len(s.output_ids) == 16 for s in states)
