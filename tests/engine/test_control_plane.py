"""The control plane against strict engines (SGLang 0.5.23's behaviour): /health_generate blocks while paused or
updating and then answers 503, weight loads take seconds, streamed errors come as HTTP 200 + an error event, and
0.5.5 compat mode. In-process servers with short timeouts; one SIGKILLed subprocess (slow)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from rollq.engine.client import EngineError
from rollq.engine.fleet import FleetController
from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.server.app import EngineServerConfig, ServerHandle, serve
from rollq.engine.server.synthetic import SyntheticBackend, SyntheticConfig
from rollq.engine.types import ModelRequest, ModelResponse, PauseMode, SamplingParams
from tests.helpers import wait_until

LOAD_S = 2.0  # a "long" weight load, scaled down: every pause-mode cycle below pays it once
SERVER_HEALTH_S = 0.6  # the engines' /health_generate gives up after this long while paused (SGLang: 20 s)
TOKENS = 120
CONCURRENT = 24

Start = Callable[..., Awaitable[ServerHandle]]


@pytest.fixture
async def strict(tmp_path: Path) -> AsyncIterator[Start]:
    """`await strict(load_delay_s=..., compat=..., ...)` -> a strict in-process engine loading weights from under
    tmp_path, closed at teardown."""
    handles: list[ServerHandle] = []

    async def start(*, compat: str = "0.5.23", skip_tokenizer_init: bool = False, **synthetic: Any) -> ServerHandle:
        synthetic.setdefault("per_token_latency_s", 0.004)
        config = EngineServerConfig(
            port=0,
            weight_version="0",
            health_timeout_s=SERVER_HEALTH_S,
            shutdown_timeout_s=0.5,
            compat=compat,  # type: ignore[arg-type]
            skip_tokenizer_init=skip_tokenizer_init,
            weights_root=str(tmp_path),
        )
        handles.append(await serve(SyntheticBackend(SyntheticConfig(**synthetic)), config))
        return handles[-1]

    yield start
    for h in handles:
        await h.close()


def quick_pool(urls: list[str], **overrides: Any) -> EnginePool:
    """Health checks every 0.1 s that give up after 0.3 s: a paused engine fails several of them per cycle."""
    config = dict(urls=urls, health_interval_s=0.1, health_timeout_s=0.3, fail_threshold=2, no_engine_timeout_s=10.0)
    return EnginePool(PoolConfig(**{**config, **overrides}))


def request(i: int, tokens: int = TOKENS, affinity: str = "") -> ModelRequest:
    return ModelRequest(
        input_ids=[7, 8, 9, i], sampling=SamplingParams(max_new_tokens=tokens, ignore_eos=True), affinity=affinity
    )


def weights(tmp_path: Path, version: int) -> str:
    path = tmp_path / f"v{version}"
    path.mkdir(exist_ok=True)
    return str(path)


def in_flight(handles: list[ServerHandle], count: int, min_tokens: int = 2) -> Callable[[], bool]:
    """Every one of `count` requests is running on an engine and has produced tokens under the old weights."""

    def check() -> bool:
        states = [r.state for h in handles for r in h.server.states.values()]
        return len(states) >= count and all(len(s.output_ids) >= min_tokens for s in states)

    return check


def evictions(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "leaves routing" in r.getMessage()]


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
async def test_a_long_load_under_load_evicts_nobody_and_loses_nothing(
    strict: Start, tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: PauseMode
) -> None:
    caplog.set_level(logging.WARNING, "rollq.engine")
    handles = [await strict(load_delay_s=LOAD_S) for _ in range(3)]
    async with quick_pool([h.url for h in handles]) as pool:
        baseline = await asyncio.gather(*(pool.agenerate(request(i)) for i in range(CONCURRENT)))
        fleet = FleetController(pool)
        running = [asyncio.create_task(pool.agenerate(request(i, affinity=f"g{i % 6}"))) for i in range(CONCURRENT)]
        await wait_until(in_flight(handles, CONCURRENT), 10, what="requests generating")
        affinity = dict(pool._affinity)
        cycle = asyncio.create_task(fleet.cycle(weights(tmp_path, 1), 1, mode=mode))
        await wait_until(lambda: pool.updating, 10, what="the weight load")
        # What the pool's health checks see meanwhile: a strict engine blocks /health_generate, then answers 503.
        assert await pool.members[handles[0].url].client.health_status(timeout=SERVER_HEALTH_S * 2) == "busy"
        phases = await asyncio.wait_for(cycle, 30)
        responses: list[ModelResponse] = await asyncio.wait_for(asyncio.gather(*running), 30)

    assert phases["load_s"] >= LOAD_S and phases["update_s"] >= LOAD_S  # health checks ran and failed during it
    assert evictions(caplog) == [], mode
    assert all(m.healthy and not m.stale and m.weight_version == "1" for m in pool.members.values())
    assert all(h.server.weight_version == "1" for h in handles)  # the in_place update was not refused (flush_cache)
    assert affinity.items() <= pool._affinity.items()  # nobody's affinity was dropped
    for base, resp in zip(baseline, responses, strict=True):
        assert resp.output_tokens == base.output_tokens  # synthetic tokens depend on prompt + position only
        assert len(resp.output_versions) == TOKENS and resp.output_versions[-1] == 1
        assert resp.output_versions == sorted(resp.output_versions)
    assert any(r.output_versions[0] == 0 for r in responses)  # they really spanned the update
    if mode == "in_place":
        assert all(r.resubmissions == 0 for r in responses)  # held in place, not aborted and resubmitted


async def test_an_engine_paused_behind_the_fleets_back_is_still_evicted(strict: Start) -> None:
    """The pool excuses only the fleet's own pauses: a 503 from an engine nobody paused is a failure."""
    handles = [await strict() for _ in range(2)]
    pool = quick_pool([h.url for h in handles])  # not started: the test runs each health check itself
    try:
        ours, theirs = (pool.members[h.url] for h in handles)
        pool.set_paused([ours], True)
        for member in (ours, theirs):
            await member.client.pause_generation("retract")
        for _ in range(3):
            await pool.check_health()
        assert ours.healthy and not theirs.healthy
        for member in (ours, theirs):
            await member.client.continue_generation()
        pool.set_paused([ours], False)
        await pool.check_health()
        assert ours.healthy and theirs.healthy  # healthy again once it answers
    finally:
        await pool.close()


async def test_a_bad_streamed_request_fails_once_with_the_engines_message(
    strict: Start, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "rollq.engine")
    handles = [await strict(context_length=64) for _ in range(3)]
    async with quick_pool([h.url for h in handles]) as pool:
        too_long = ModelRequest(input_ids=list(range(3, 103)), sampling=SamplingParams(max_new_tokens=4))
        seen: list[int] = []
        started = time.monotonic()
        with pytest.raises(EngineError, match="longer than the model's context length") as streamed:
            await pool.agenerate(too_long, on_tokens=lambda ids, lps: seen.extend(ids))
        with pytest.raises(EngineError, match="longer than the model's context length"):
            await pool.agenerate(too_long)  # the same, not streamed (a plain 400)
        assert time.monotonic() - started < 2
        assert streamed.value.status == 400 and seen == []
        assert all(m.healthy for m in pool.members.values()) and evictions(caplog) == []
        assert not [r for r in caplog.records if "failed over" in r.getMessage()]
        ok = await pool.agenerate(request(1, 10), on_tokens=lambda ids, lps: seen.extend(ids))
        assert ok.output_tokens == seen and len(seen) == 10


async def test_an_engine_closed_mid_update_is_detected_and_its_requests_fail_over(
    strict: Start, tmp_path: Path
) -> None:
    victim = await strict(load_delay_s=30.0)  # would load for 30 s: it goes away during the load
    survivor = await strict(load_delay_s=0.5)
    async with quick_pool([victim.url, survivor.url]) as pool:
        fleet = FleetController(pool, retries=1, retry_delay_s=0.05)
        running = [asyncio.create_task(pool.agenerate(request(i, affinity=f"g{i}"))) for i in range(8)]
        await wait_until(lambda: len(victim.server.states) > 0 and len(survivor.server.states) > 0, 10, what="work")
        cycle = asyncio.create_task(fleet.cycle(weights(tmp_path, 1), 1, mode="in_place"))
        await wait_until(lambda: victim.server._updating, 10, what="the victim's load")
        await victim.close()
        phases = await asyncio.wait_for(cycle, 20)
        responses = await asyncio.wait_for(asyncio.gather(*running), 20)
        member = pool.members[victim.url]
        assert not member.routable and member.stale
        assert phases["total_s"] < 10
        assert all(len(r.output_tokens) == TOKENS and r.engine == survivor.url for r in responses)
        assert all(r.output_versions[-1] == 1 for r in responses)


@pytest.mark.slow
async def test_an_engine_sigkilled_during_its_weight_load_is_failed_over(
    strict: Start, engine_process, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "rollq.engine")
    proc, victim_url = await engine_process(
        "--load-delay", "30", "--token-latency", "0.004", "--weight-version", "0", "--health-timeout", "0.6"
    )
    try:
        survivor = await strict(load_delay_s=0.5)
        async with quick_pool([victim_url, survivor.url]) as pool:
            fleet = FleetController(pool, retries=1, retry_delay_s=0.05)
            running = [asyncio.create_task(pool.agenerate(request(i, affinity=f"g{i}"))) for i in range(8)]
            await wait_until(lambda: pool.members[victim_url].outstanding > 0, 10, what="work on the victim")
            cycle = asyncio.create_task(fleet.cycle(weights(tmp_path, 1), 1, mode="retract"))
            await wait_until(lambda: pool.updating, 10, what="the weight load")
            await wait_until(lambda: survivor.server._updating, 10, what="the load under way")
            os.kill(proc.pid, signal.SIGKILL)
            phases = await asyncio.wait_for(cycle, 20)
            responses = await asyncio.wait_for(asyncio.gather(*running), 20)
            assert not pool.members[victim_url].routable and pool.members[victim_url].stale
            assert phases["total_s"] < 10
            assert all(len(r.output_tokens) == TOKENS and r.engine == survivor.url for r in responses)
            assert evictions(caplog) and all(victim_url in e for e in evictions(caplog))
    finally:
        proc.kill()
        proc.wait(10)


async def test_compat_055_cycle_loses_no_request_and_streams_at_segment_ends(strict: Start, tmp_path: Path) -> None:
    handles = [await strict(compat="0.5.5", load_delay_s=0.5) for _ in range(2)]
    async with quick_pool([h.url for h in handles]) as pool:
        baseline = await asyncio.gather(*(pool.agenerate(request(i)) for i in range(12)))
        chunks: list[list[int]] = []
        watched = asyncio.create_task(pool.agenerate(request(0), on_tokens=lambda ids, lps: chunks.append(ids)))
        running = [asyncio.create_task(pool.agenerate(request(i))) for i in range(1, 12)]
        await wait_until(in_flight(handles, 12), 10, what="requests generating")
        result = await FleetController(pool).cycle(weights(tmp_path, 1), 1, mode="in_place")  # 0.5.5: aborts
        responses = await asyncio.wait_for(asyncio.gather(watched, *running), 30)
        facts = [m.facts for m in pool.members.values() if m.facts is not None]
        assert facts and all(f.version == "0.5.5" and not f.streams for f in facts)
    assert result["total_s"] < 5
    assert [r.output_tokens for r in responses] == [r.output_tokens for r in baseline]
    assert all(r.output_versions[-1] == 1 and r.output_versions[0] == 0 for r in responses)
    assert any(r.resubmissions > 0 for r in responses)  # 0.5.5 ignored in_place: everything was aborted
    assert [t for c in chunks for t in c] == responses[0].output_tokens
    assert len(chunks) == responses[0].resubmissions + 1  # one report per segment, none mid-segment
