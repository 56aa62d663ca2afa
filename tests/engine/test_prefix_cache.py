"""Prefix (radix) cache and request priority of the reference engine: the cache alone, the backend driven directly,
and the weight-update / flush path through a real server on loopback. Synthetic backend: priority order too."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


from rollq.engine.server.app import EngineServerConfig, serve  # noqa: E402
from rollq.engine.server.backend import GenState  # noqa: E402
from rollq.engine.server.prefix_cache import PrefixCache  # noqa: E402
from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig  # noqa: E402
from rollq.engine.server.synthetic import SyntheticBackend, SyntheticConfig  # noqa: E402
from rollq.engine.types import SamplingParams  # noqa: E402
from tests.engine.sharing import watch_sharing  # noqa: E402

TEXTS = [
    "Solve for x: 3x + 5 = 20. Subtract 5 from both sides, then divide by three.",
    "def add(a: int, b: int) -> int:\n    return a + b\n\nfor i in range(10):\n    print(add(i, i))",
    "The quick brown fox jumps over the lazy dog. " * 4,
]


@pytest.fixture(scope="module")
def prompts(tiny_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer  # here, not at collection: each test process would pay for it

    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture
async def start_backend(tiny_dir: Path):
    started: list[ReferenceBackend] = []

    async def start(**config) -> ReferenceBackend:
        b = ReferenceBackend(ReferenceConfig(model=str(tiny_dir), **config))
        await b.start()
        started.append(b)
        return b

    yield start
    for b in started:
        await b.close()


def greedy(max_new: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True, **kw)


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.002)


def kv(ids: list[int], layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fake KV whose entries encode (layer, token id), so a match can be checked value by value."""
    t = torch.tensor(ids, dtype=torch.float32)[None, None, :, None].expand(1, 2, len(ids), 3)
    return [(t + 1000 * li, -t - 1000 * li) for li in range(layers)]


# ---- the radix tree alone ------------------------------------------------------------------------------------------


def test_radix_tree_matches_longest_prefix_across_splits() -> None:
    c = PrefixCache(max_tokens=100)
    assert c.match([1, 2, 3]) == (0, None)
    c.insert([1, 2, 3, 4, 5], kv([1, 2, 3, 4, 5]))
    c.insert([1, 2, 7, 8], kv([1, 2, 7, 8]))  # splits the first run after [1, 2]
    c.insert([1, 2, 3], kv([1, 2, 3]))  # already there: nothing new
    assert c.tokens == 7
    for ids, want in [([1, 2, 3, 4, 9], [1, 2, 3, 4]), ([1, 2, 7, 8, 9], [1, 2, 7, 8]), ([1, 2, 9], [1, 2]), ([5], [])]:
        n, layers = c.match(ids)
        assert n == len(want), ids
        if want:
            assert layers is not None and len(layers) == 2
            for (k, v), (wk, wv) in zip(layers, kv(want), strict=True):
                assert torch.equal(k, wk) and torch.equal(v, wv)
    c.clear()
    assert c.tokens == 0 and c.match([1, 2]) == (0, None)


def test_radix_tree_evicts_least_recently_used_leaves_within_budget() -> None:
    c = PrefixCache(max_tokens=10)
    c.insert([1, 2, 3, 4], kv([1, 2, 3, 4]))
    c.insert([5, 6, 7, 8], kv([5, 6, 7, 8]))
    assert c.match([1, 2, 3, 4])[0] == 4  # [1..4] is now more recent than [5..8]
    c.insert([9, 10, 11, 12], kv([9, 10, 11, 12]))  # 12 > 10: the least recently used leaf goes
    assert c.tokens == 8 and c.evicted_tokens == 4
    assert c.match([5, 6])[0] == 0 and c.match([1, 2, 3, 4])[0] == 4 and c.match([9, 10, 11, 12])[0] == 4
    # a shared prefix outlives its leaves: evicting both branches of [1, 2] leaves [1, 2] itself a leaf to evict
    c.insert([1, 2, 20, 21, 22, 23, 24, 25, 26], kv([1, 2, 20, 21, 22, 23, 24, 25, 26]))
    assert c.tokens <= 10 and c.match([1, 2, 20])[0] == 3
    c.insert(list(range(100, 130)), kv(list(range(100, 130))))  # longer than the budget: its head is kept
    assert c.tokens == 10 and c.match(list(range(100, 130)))[0] == 10


# ---- the backend ---------------------------------------------------------------------------------------------------


async def test_same_tokens_and_logprobs_with_and_without_the_cache(start_backend, prompts: list[list[int]]) -> None:
    cached = await start_backend(max_running=4)
    plain = await start_backend(max_running=4, prefix_cache_tokens=0)

    async def both(rid: str, ids: list[int], params: SamplingParams) -> GenState:
        a, b = (GenState(rid, ids, params, return_logprob=True) for _ in range(2))
        await asyncio.gather(cached.run(a), plain.run(b))
        assert a.output_ids == b.output_ids, rid
        assert torch.allclose(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-4), rid
        assert b.cached_tokens == 0
        return a

    first = await both("t-0", prompts[0], greedy(16))
    assert first.cached_tokens == 0
    again = await both("t-1", prompts[0], greedy(16))  # the whole prompt but its last token is reused
    assert again.cached_tokens == len(prompts[0]) - 1
    # a prompt extending a cached prompt + output (its last output token's KV was never computed)
    longer = [*prompts[0], *first.output_ids, *prompts[1]]
    ext = await both("t-2", longer, greedy(16))
    assert ext.cached_tokens == len(prompts[0]) + len(first.output_ids) - 1
    sampled = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, ignore_eos=True)
    s = await both("t-3", prompts[0], sampled)  # same rid, same draws: the same sample
    assert s.cached_tokens == len(prompts[0]) - 1
    assert plain.stats()["prefix_cache_tokens"] == 0 and cached.stats()["prefix_cache_tokens"] > 0


async def test_group_admitted_together_shares_one_prefill(start_backend, prompts: list[list[int]]) -> None:
    b = await start_backend(max_running=8)
    prompt = prompts[2]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True)
    states = [GenState(f"g-{i}", prompt, params, return_logprob=True) for i in range(8)]
    await b.pause("in_place")  # queue the whole group, so one iteration admits all of it
    tasks = [asyncio.create_task(b.run(s)) for s in states]
    await until(lambda: b.stats()["num_queue_reqs"] == 8)
    await b.resume()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert [s.cached_tokens for s in states] == [0] + [len(prompt) - 1] * 7
    stats = b.stats()
    assert stats["prefill_tokens_total"] == len(prompt) + 7
    assert stats["prompt_tokens_total"] == 8 * len(prompt)
    assert stats["cached_tokens_total"] == 7 * (len(prompt) - 1)
    assert stats["cache_hit_rate"] == pytest.approx(7 * (len(prompt) - 1) / (8 * len(prompt)))
    assert len({tuple(s.output_ids) for s in states}) > 1  # the samples still differ
    # every finished sample's prompt + output (but its last token) goes into the tree when its row leaves the
    # batch (the next iteration), shared prefixes once
    fed = {tuple(s.output_ids[:k]) for s in states for k in range(1, len(s.output_ids))}
    await until(lambda: b.stats()["prefix_cache_tokens"] == len(prompt) + len(fed))


async def test_second_turn_reuses_the_first_turns_kv(start_backend, prompts: list[list[int]]) -> None:
    b = await start_backend(max_running=2)
    plain = await start_backend(max_running=2, prefix_cache_tokens=0)
    turn1 = GenState("turn-1", prompts[1], greedy(12))
    await b.run(turn1)
    history = [*prompts[1], *turn1.output_ids, *prompts[0]]
    turn2, ref = GenState("turn-2", history, greedy(12)), GenState("turn-2", history, greedy(12))
    await asyncio.gather(b.run(turn2), plain.run(ref))
    assert turn2.cached_tokens == len(prompts[1]) + len(turn1.output_ids) - 1
    assert turn2.output_ids == ref.output_ids
    before = b.stats()["prefill_tokens_total"]
    turn3 = GenState("turn-3", [*history, *turn2.output_ids, 42], greedy(4))
    await b.run(turn3)
    assert b.stats()["prefill_tokens_total"] - before == 2  # the new token, and turn 2's last (never fed)


async def test_weight_load_keeps_the_cache_and_flush_drops_it(start_backend, tiny_dir: Path, prompts) -> None:
    b = await start_backend(max_running=2)

    async def once(rid: str) -> GenState:
        s = GenState(rid, prompts[0], greedy(4))
        await b.run(s)
        return s

    await once("w-0")
    held = len(prompts[0]) + 3  # prompt + output but its last token, cached when the row leaves the batch
    await until(lambda: b.stats()["prefix_cache_tokens"] == held)
    await b.load_weights(str(tiny_dir))
    named = [(n, p.detach().clone()) for n, p in b.model.named_parameters()]
    await b.load_tensors(named)
    assert b.stats()["prefix_cache_tokens"] == held
    assert (await once("w-1")).cached_tokens == len(prompts[0]) - 1
    b.flush_cache()
    assert b.stats()["prefix_cache_tokens"] == 0
    assert (await once("w-2")).cached_tokens == 0
    await b.load_tensors(named[1:])  # a bucket of an update (SGLang loads whatever names a call carries)
    with pytest.raises(ValueError, match="unknown"):
        await b.load_tensors([("model.no_such_weight", torch.zeros(2)), *named[:1]])
    with pytest.raises(ValueError, match="shape mismatch"):
        await b.load_tensors([(named[0][0], torch.zeros(3))])


async def test_cache_stays_within_a_small_budget(start_backend, prompts: list[list[int]]) -> None:
    budget = 48
    b = await start_backend(max_running=3, prefix_cache_tokens=budget)
    plain = await start_backend(max_running=3, prefix_cache_tokens=0)
    for round_ in range(2):
        states = [GenState(f"e-{round_}-{i}", p, greedy(10)) for i, p in enumerate(prompts)]
        refs = [GenState(f"e-{round_}-{i}", p, greedy(10)) for i, p in enumerate(prompts)]
        await asyncio.gather(*(b.run(s) for s in states), *(plain.run(s) for s in refs))
        assert [s.output_ids for s in states] == [s.output_ids for s in refs]
        assert 0 < b.stats()["prefix_cache_tokens"] <= budget
    assert b._cache.evicted_tokens > 0


async def test_priority_orders_admission(start_backend, prompts: list[list[int]]) -> None:
    b = await start_backend(max_running=1)
    await b.pause("in_place")
    prios = [None, 5, 1, 5, -1, 0]
    states = [GenState(f"p-{i}", prompts[0], greedy(2), priority=p) for i, p in enumerate(prios)]
    tasks = []
    for n, s in enumerate(states, 1):  # queued one by one, so FCFS among equals is well defined
        tasks.append(asyncio.create_task(b.run(s)))
        await until(lambda n=n: b.stats()["num_queue_reqs"] == n)
    await b.resume()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    order = [s.rid for s in sorted(states, key=lambda s: s.first_token_at or 0.0)]
    assert order == ["p-1", "p-3", "p-2", "p-0", "p-5", "p-4"]


async def test_synthetic_stepped_queue_follows_priority() -> None:
    b = SyntheticBackend(SyntheticConfig(per_token_latency_s=0.001, max_running_requests=1, load_delay_s=0.01))
    try:
        await b.pause("in_place")
        prios = [None, 3, 7, 3]
        states = [GenState(f"s-{i}", [10, 11, 12], greedy(3), priority=p) for i, p in enumerate(prios)]
        tasks = [asyncio.create_task(b.run(s)) for s in states]
        await until(lambda: b.stats()["num_queue_reqs"] == len(states))
        await b.load_tensors([("w", torch.zeros(2))])
        await b.resume()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        order = [s.rid for s in sorted(states, key=lambda s: s.first_token_at or 0.0)]
        assert order == ["s-2", "s-1", "s-3", "s-0"]
    finally:
        await b.close()


# ---- through the server --------------------------------------------------------------------------------------------


async def test_server_update_flushes_only_when_asked(tiny_dir: Path, prompts: list[list[int]]) -> None:
    backend = ReferenceBackend(ReferenceConfig(model=str(tiny_dir), max_running=2))
    handle = await serve(backend, EngineServerConfig(host="127.0.0.1", port=0, weights_root=str(tiny_dir)))
    try:
        async with httpx.AsyncClient(base_url=handle.url, timeout=httpx.Timeout(20.0)) as http:

            async def generate() -> dict:
                body = {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
                r = await http.post("/generate", json=body)
                assert r.status_code == 200, r.text
                return r.json()["meta_info"]

            assert (await generate())["cached_tokens"] == 0
            assert (await generate())["cached_tokens"] == len(prompts[0]) - 1
            update = {"model_path": str(tiny_dir), "flush_cache": False}
            r = await http.post("/update_weights_from_disk", json=update)
            assert r.status_code == 200 and r.json()["success"], r.text
            assert (await generate())["cached_tokens"] == len(prompts[0]) - 1
            r = await http.post("/update_weights_from_disk", json={"model_path": str(tiny_dir)})  # flushes
            assert r.status_code == 200 and r.json()["success"], r.text
            assert backend.stats()["prefix_cache_tokens"] == 0
            assert (await generate())["cached_tokens"] == 0
            r = await http.post("/flush_cache")
            assert r.status_code == 200, r.text
            assert backend.stats()["prefix_cache_tokens"] == 0
    finally:
        await handle.close()


async def test_batched_prefills_match_one_at_a_time(start_backend, prompts: list[list[int]]) -> None:
    """Groups admitted together (batched prefills: the leaders, then their samples on the shared cached prompt, and
    equal-length prompts without the cache) give the tokens and logprobs of one sequence run alone."""
    cached = await start_backend(max_running=16)
    plain = await start_backend(max_running=16, prefix_cache_tokens=0)
    alone = await start_backend(max_running=1, prefix_cache_tokens=0)
    work = [(f"b-{g}-{i}", p) for g, p in enumerate([*prompts, prompts[0][:-3]]) for i in range(4)]

    async def run_all(b: ReferenceBackend) -> list[GenState]:
        states = [GenState(rid, p, greedy(8), return_logprob=True) for rid, p in work]
        await b.pause("in_place")  # queue everything, so one iteration admits it all
        tasks = [asyncio.create_task(b.run(s)) for s in states]
        await until(lambda: b.stats()["num_queue_reqs"] == len(states))
        await b.resume()
        await asyncio.wait_for(asyncio.gather(*tasks), 20)
        return states

    ref = await run_all(alone)
    for b in (cached, plain):
        got = await run_all(b)
        for r, s in zip(ref, got, strict=True):
            assert s.output_ids == r.output_ids, s.rid
            assert torch.allclose(torch.tensor(s.output_logprobs), torch.tensor(r.output_logprobs), atol=1e-4), s.rid
    # each group's first sample computes what the cache lacks (prompts[0] only its last 3 tokens: its prefix
    # prompts[0][:-3], lexicographically first, goes in an earlier wave), each other sample 1 token
    assert cached.stats()["prefill_tokens_total"] == sum(len(p) for p in prompts) + 4 * 3


# ---- shared-prefix (cascade) decode --------------------------------------------------------------------------------


async def _queue_all(b: ReferenceBackend, states: list[GenState]) -> list[asyncio.Task[None]]:
    await b.pause("in_place")  # queue everything, so one iteration admits it all
    tasks = [asyncio.create_task(b.run(s)) for s in states]
    await until(lambda: b.stats()["num_queue_reqs"] == len(states))
    await b.resume()
    return tasks


async def test_cascade_rows_mixed_with_unshared_ones_and_leaving_mid_group(
    start_backend, prompts: list[list[int]]
) -> None:
    """Groups decoding against one copy of their cached prompt, next to rows that share nothing, rows of a group
    leaving at different steps (lengths, an abort) and a late sample joining its running group: the tokens and
    logprobs of each sequence run alone, without the cache."""
    cached = await start_backend(max_running=16)
    alone = await start_backend(max_running=1, prefix_cache_tokens=0)
    long_a = [*prompts[2], *prompts[0]]  # over SHARED_PREFIX_MIN tokens
    long_b = [*prompts[1], *prompts[2]]
    work = [(f"c-a{i}", long_a, 4 + 3 * i) for i in range(4)]
    work += [(f"c-b{i}", long_b, 10) for i in range(3)]
    work += [("c-solo0", prompts[0], 9), ("c-solo1", [*prompts[0], 7, 8], 7)]  # share under the minimum, or nothing

    def states() -> list[GenState]:
        return [GenState(rid, p, greedy(n), return_logprob=True) for rid, p, n in work]

    ref = states()
    for s in ref:
        await alone.run(s)
    seen = watch_sharing(cached)
    got = states()
    tasks = await _queue_all(cached, got)
    await until(lambda: len(got[0].output_ids) >= 2)
    late = GenState("c-a-late", long_a, greedy(6), return_logprob=True)  # joins the running group's prefix
    late_ref = GenState("c-a-late", long_a, greedy(6), return_logprob=True)
    await asyncio.gather(cached.run(late), alone.run(late_ref), *tasks)
    for r, s in zip([*ref, late_ref], [*got, late], strict=True):
        assert s.output_ids == r.output_ids, s.rid
        assert torch.allclose(torch.tensor(s.output_logprobs), torch.tensor(r.output_logprobs), atol=1e-4), s.rid
    shared = max(n for _, n in seen)
    assert shared == 7 or shared == 8  # the two groups (and the late sample, when its group is still running)
    assert any(rows > n > 0 for rows, n in seen)  # shared and unshared rows in one step
    assert len({n for _, n in seen}) > 2  # rows left mid-group


async def test_cascade_rows_aborted_and_retracted_resume_to_the_same_tokens(
    start_backend, prompts: list[list[int]]
) -> None:
    cached = await start_backend(max_running=8)
    alone = await start_backend(max_running=1, prefix_cache_tokens=0)
    prompt = [*prompts[2], *prompts[1]]
    ref = GenState("r-ref", prompt, greedy(24), return_logprob=True)
    await alone.run(ref)
    seen = watch_sharing(cached)
    group = [GenState(f"r-{i}", prompt, greedy(24), return_logprob=True) for i in range(5)]
    tasks = await _queue_all(cached, group)
    await until(lambda: len(group[0].output_ids) >= 4)
    group[4].abort_message = "enough"
    await cached.pause("retract")  # frees the batch; the rows re-prefill from the cache on resume
    assert cached.stats()["token_usage"] == 0
    await cached.resume()
    await asyncio.wait_for(asyncio.gather(*tasks), 20)
    assert group[4].finish.type == "abort" and len(group[4].output_ids) < 24
    for s in group:
        n = len(s.output_ids)
        assert s.output_ids == ref.output_ids[:n], s.rid
        assert torch.allclose(torch.tensor(s.output_logprobs), torch.tensor(ref.output_logprobs[:n]), atol=1e-4)
    assert max(n for _, n in seen) >= 4


async def test_no_cache_shares_nothing_even_for_equal_prompts(start_backend, prompts: list[list[int]]) -> None:
    plain = await start_backend(max_running=8, prefix_cache_tokens=0)
    seen = watch_sharing(plain)
    prompt = [*prompts[2], *prompts[0]]
    tasks = await _queue_all(plain, [GenState(f"n-{i}", prompt, greedy(6)) for i in range(4)])
    await asyncio.wait_for(asyncio.gather(*tasks), 20)
    assert seen and all(n == 0 for _, n in seen)
    assert plain.model.config._attn_implementation == "sdpa"


async def test_rows_admitted_after_a_flush_do_not_join_older_prefixes(start_backend, prompts: list[list[int]]) -> None:
    b = await start_backend(max_running=8)
    prompt = [*prompts[2], *prompts[1]]
    old = [GenState(f"f-{i}", prompt, greedy(400)) for i in range(3)]
    tasks = await _queue_all(b, old)
    await until(lambda: len(old[0].output_ids) >= 2)
    before = {id(p) for p in b._batch._shared if p is not None}
    assert before  # the group decodes against one prefix
    b.flush_cache()  # as after a weight update: KV of the old weights must not serve new rows
    new = GenState("f-new", prompt, greedy(400))
    task = asyncio.create_task(b.run(new))
    await until(lambda: len(new.output_ids) >= 2)
    row = next(i for i, r in enumerate(b._running) if r.state is new)
    assert b._batch._shared[row] is None or id(b._batch._shared[row]) not in before
    for s in [*old, new]:
        s.abort_message = "done"
    await asyncio.wait_for(asyncio.gather(*tasks, task), 10)
