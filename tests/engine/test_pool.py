"""EnginePool and FleetController against real synthetic engines (in-process servers and SIGKILLed subprocesses)."""

import asyncio
import os
import signal

import pytest

from rollq.engine.fleet import FleetController
from rollq.engine.pool import EnginePool, PoolConfig, version_number
from rollq.engine.server.app import EngineServerConfig, serve
from rollq.engine.server.synthetic import SyntheticBackend, SyntheticConfig
from rollq.engine.types import ModelRequest, SamplingParams
from tests.helpers import wait_until
from tests.redis_server import free_port


async def start_engines(count: int, **synthetic):
    handles = []
    for _ in range(count):
        backend = SyntheticBackend(SyntheticConfig(**synthetic))
        handles.append(await serve(backend, EngineServerConfig(host="127.0.0.1", port=free_port(), weight_version="0")))
    return handles


def request(i: int, tokens: int = 40, affinity: str = "") -> ModelRequest:
    return ModelRequest(
        input_ids=[7, 8, 9, i], sampling=SamplingParams(max_new_tokens=tokens, ignore_eos=True), affinity=affinity
    )


@pytest.fixture
async def engines():
    handles = await start_engines(3, per_token_latency_s=0.002)
    yield handles
    for h in handles:
        await h.close()


def test_version_numbers():
    assert [version_number(v) for v in ("3", "step-12", "default", "")] == [3, 12, -1, -1]


async def test_affinity_keeps_a_group_on_one_engine_and_spreads_groups(engines):
    async with EnginePool(PoolConfig(urls=[h.url for h in engines])) as pool:
        reqs = [request(i, 10, affinity=f"group-{i % 6}") for i in range(36)]
        responses = await asyncio.gather(*(pool.agenerate(r) for r in reqs))
    by_group: dict[str, set[str]] = {}
    for r, resp in zip(reqs, responses, strict=True):
        by_group.setdefault(r.affinity, set()).add(resp.engine)
        assert len(resp.output_tokens) == 10 and len(resp.output_versions) == 10
    assert all(len(urls) == 1 for urls in by_group.values())
    assert len({next(iter(u)) for u in by_group.values()}) == 3  # least-outstanding spread the 6 groups over 3 engines


async def test_pause_update_resume_under_load_loses_no_token_and_versions_each_one(engines, tmp_path):
    urls = [h.url for h in engines]
    weights = tmp_path / "step-1"
    weights.mkdir()
    async with EnginePool(PoolConfig(urls=urls)) as pool:
        baseline = await asyncio.gather(*(pool.agenerate(request(i, 60)) for i in range(12)))
        fleet = FleetController(pool)
        for mode, version in (("abort", 1), ("retract", 2), ("in_place", 3)):
            running = [asyncio.create_task(pool.agenerate(request(i, 60))) for i in range(12)]
            await wait_until(lambda: sum(m.outstanding for m in pool.members.values()) == 12, what="requests in flight")
            await asyncio.sleep(0.03)  # let them produce some tokens under the old version
            phases = await fleet.cycle(str(weights), version, mode=mode)
            assert phases["total_s"] < 5
            responses = await asyncio.wait_for(asyncio.gather(*running), 30)
            for base, resp in zip(baseline, responses, strict=True):
                # Synthetic tokens depend only on prompt + position: same tokens as an uninterrupted run.
                assert resp.output_tokens == base.output_tokens, mode
                assert len(resp.output_versions) == 60
                assert resp.output_versions == sorted(resp.output_versions)  # versions only move forward
                assert resp.output_versions[-1] == version
            assert any(r.output_versions[0] < version for r in responses), mode  # some tokens predate the update
            if mode == "abort":
                assert any(r.resubmissions > 0 for r in responses)


async def test_failed_update_takes_engines_out_of_routing_until_reloaded(engines, tmp_path):
    async with EnginePool(PoolConfig(urls=[h.url for h in engines], no_engine_timeout_s=0.5)) as pool:
        fleet = FleetController(pool, retries=0)
        missing = tmp_path / "not-yet"
        result = await fleet.update_weights(str(missing), 5)
        assert sorted(result.failed) == sorted(h.url for h in engines)
        assert pool.route("x") is None
        missing.mkdir()
        fixed = await fleet.reconcile()
        assert len(fixed.ok) == 3
        resp = await pool.agenerate(request(1, 5))
        assert resp.output_versions == [5] * 5


@pytest.mark.slow
async def test_requests_fail_over_when_an_engine_is_sigkilled_mid_request(engine_process):
    started = [await engine_process("--token-latency", "0.01") for _ in range(2)]
    procs = [proc for proc, _ in started]
    urls = [url for _, url in started]
    async with EnginePool(PoolConfig(urls=urls, health_interval_s=0.2)) as pool:
        reqs = [request(i, 80) for i in range(10)]
        tasks = [asyncio.create_task(pool.agenerate(r)) for r in reqs]
        victim = pool.members[urls[0]]
        await wait_until(lambda: victim.outstanding > 0, 10, what="work on the victim")
        await asyncio.sleep(0.2)  # mid-request: partial output exists on the victim
        os.kill(procs[0].pid, signal.SIGKILL)
        responses = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert all(len(r.output_tokens) == 80 for r in responses)
        assert all(r.engine == urls[1] for r in responses)
        assert any(r.resubmissions > 0 for r in responses)
        # Same tokens as a run on the survivor alone (deterministic synthetic engine).
        again = await asyncio.gather(*(pool.agenerate(r) for r in reqs))
        assert [r.output_tokens for r in responses] == [r.output_tokens for r in again]


class Collector:
    """on_tokens target: everything a streamed request showed its caller, in order."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.calls = 0

    def __call__(self, ids: list[int], logprobs: list[float]) -> None:
        self.ids += ids
        self.logprobs += logprobs
        self.calls += 1


async def test_streamed_tokens_are_the_response_across_a_pause(engines, tmp_path):
    async with EnginePool(PoolConfig(urls=[h.url for h in engines])) as pool:
        baseline = await pool.agenerate(request(1, 80))
        seen = Collector()
        task = asyncio.create_task(pool.agenerate(request(1, 80), on_tokens=seen))
        await wait_until(lambda: len(seen.ids) >= 5, 10, what="first streamed tokens")
        await FleetController(pool).cycle(str(tmp_path), 1, mode="abort")  # aborts and resubmits mid-stream
        resp = await asyncio.wait_for(task, 30)
        assert resp.resubmissions >= 1 and seen.calls > 2  # several chunks, not one at the end
        assert seen.ids == resp.output_tokens == baseline.output_tokens
        assert seen.logprobs == resp.output_logprobs


@pytest.mark.slow
async def test_streamed_tokens_survive_an_engine_sigkilled_mid_stream(engine_process):
    started = [await engine_process("--token-latency", "0.01") for _ in range(2)]
    urls = [url for _, url in started]
    async with EnginePool(PoolConfig(urls=urls, health_interval_s=0.2)) as pool:
        seen = Collector()
        task = asyncio.create_task(pool.agenerate(request(3, 80, affinity="a"), on_tokens=seen))
        await wait_until(lambda: len(seen.ids) >= 10, 10, what="tokens streamed")
        victim = next(i for i, u in enumerate(urls) if pool.members[u].outstanding)
        os.kill(started[victim][0].pid, signal.SIGKILL)
        resp = await asyncio.wait_for(task, 60)
        # Nothing shown is taken back or repeated: the survivor continued after the streamed tokens.
        assert seen.ids == resp.output_tokens and len(resp.output_tokens) == 80
        again = await pool.agenerate(request(3, 80))
        assert resp.output_tokens == again.output_tokens
