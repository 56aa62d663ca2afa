"""EnginePool and FleetController against real synthetic engines (in-process servers and SIGKILLed subprocesses)."""

import asyncio
import os
import signal
from pathlib import Path

import msgspec
import pytest

from rollq.engine.client import EngineError
from rollq.engine.fleet import FleetController
from rollq.engine.pool import (
    EngineFacts,
    EnginePool,
    PoolConfig,
    UnsupportedRequest,
    stop_cut,
    token_versions,
    version_number,
)
from rollq.engine.server.app import EngineServerConfig, serve
from rollq.engine.server.synthetic import SyntheticBackend, SyntheticConfig
from rollq.engine.types import GenerateResult, ModelRequest, SamplingParams
from rollq.local import free_port
from tests.helpers import wait_until


async def start_engines(count: int, weights_root: Path, **synthetic):
    """`count` synthetic engines loading weights from under `weights_root`."""
    handles = []
    for _ in range(count):
        backend = SyntheticBackend(SyntheticConfig(**synthetic))
        config = EngineServerConfig(
            host="127.0.0.1", port=free_port(), weight_version="0", weights_root=str(weights_root)
        )
        handles.append(await serve(backend, config))
    return handles


def request(i: int, tokens: int = 40, affinity: str = "") -> ModelRequest:
    return ModelRequest(
        input_ids=[7, 8, 9, i], sampling=SamplingParams(max_new_tokens=tokens, ignore_eos=True), affinity=affinity
    )


@pytest.fixture
async def engines(tmp_path: Path):
    handles = await start_engines(3, tmp_path, per_token_latency_s=0.002)
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


def test_sampling_values_the_trainer_relies_on_are_always_sent():
    body = SamplingParams(max_new_tokens=8).to_request()
    assert body == {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
    body = SamplingParams(max_new_tokens=8, stop_token_ids=[2, 0], ignore_eos=True).to_request()
    assert body["stop_token_ids"] == [2, 0] and body["ignore_eos"] is True and "n" not in body
    assert msgspec.convert(body, SamplingParams) == SamplingParams(
        max_new_tokens=8, stop_token_ids=[2, 0], ignore_eos=True
    )


def test_stop_token_ids_hold_eos_generation_config_and_end_of_turn():
    from rollq.workers.chat_template import load_tokenizer, stop_token_ids

    tok = load_tokenizer("tiny")
    ids = stop_token_ids(tok)
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids and tok.convert_tokens_to_ids("<|endoftext|>") in ids
    assert len(ids) == len(set(ids))


def test_token_versions_follow_sglang_weight_version_spans():
    # add_weight_versions_to_meta_info (0.5.23): spans over this answer's output tokens, `end` capped at its length,
    # `weight_version` the last span's version.
    meta = {
        "weight_version": "step-2",
        "weight_versions": [
            {"version": "step-1", "start": 0, "end": 3},
            {"version": "step-2", "start": 3, "end": 5},
        ],
    }
    result = GenerateResult(
        rid="r", output_ids=[5] * 5, output_logprobs=[], finish_reason=None, weight_version="step-2", meta_info=meta
    )
    assert token_versions(result) == [1, 1, 1, 2, 2]
    plain = GenerateResult(rid="r", output_ids=[5] * 3, output_logprobs=[], finish_reason=None, weight_version="4")
    assert token_versions(plain) == [4, 4, 4]


async def test_priority_reaches_the_engine(engines):
    async with EnginePool(PoolConfig(urls=[engines[0].url])) as pool:
        client = pool.members[engines[0].url].client
        await client.pause_generation("retract")  # the request waits at the gate, where its state can be read
        task = asyncio.create_task(pool.agenerate(msgspec.structs.replace(request(1, 5), priority=7)))
        await wait_until(lambda: engines[0].server.states, 10, what="the request at the engine")
        assert [r.state.priority for r in engines[0].server.states.values()] == [7]
        await client.continue_generation()
        assert len((await asyncio.wait_for(task, 10)).output_tokens) == 5


def test_stop_cut_finds_the_token_that_completes_a_stop_string():
    decode = "".join  # token "ids" are characters here
    ids = list("abcSTOPdef")
    assert stop_cut(decode, ids, 0, ["STOP"]) == (7, "STOP")  # the completing token is kept, as SGLang does
    assert stop_cut(decode, ids, 0, ["nope"]) is None
    assert stop_cut(decode, ids, 5, ["STOP", "Pd"]) == (7, "STOP")  # ids[:5] was checked already; first to complete


async def test_without_a_tokenizer_on_the_engine_rollq_applies_stop_strings_and_refuses_min_new_tokens():
    handle = await serve(
        SyntheticBackend(SyntheticConfig(per_token_latency_s=0.001)),
        EngineServerConfig(port=0, skip_tokenizer_init=True),
    )
    decode = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731
    try:
        async with EnginePool(PoolConfig(urls=[handle.url])) as pool:
            base = (await pool.agenerate(request(1, 30))).output_tokens
            stop = decode(base[10:12])
            expected = next(k for k in range(1, 31) if stop in decode(base[:k]))
            stopping = msgspec.structs.replace(
                request(1, 30), sampling=SamplingParams(max_new_tokens=30, ignore_eos=True, stop=[stop])
            )
            with pytest.raises(UnsupportedRequest, match="skip-tokenizer-init"):
                await pool.agenerate(stopping)  # the pool cannot decode: a clear error, not the engine's 400
            assert pool.members[handle.url].facts == EngineFacts(skip_tokenizer_init=True, version="0.5.23")
            pool.decode = decode
            seen: list[int] = []
            resp = await pool.agenerate(stopping, on_tokens=lambda ids, lps: seen.extend(ids))
            assert resp.output_tokens == base[:expected] == seen and resp.stop_reason == "stop"
            assert len(resp.output_versions) == len(resp.output_logprobs) == expected
            # Streamed and aborted once the stop shows up: the engine does not run on to max_new_tokens.
            before = handle.server.counters["generation_tokens"]
            long = msgspec.structs.replace(
                stopping, sampling=msgspec.structs.replace(stopping.sampling, max_new_tokens=5000)
            )
            resp = await pool.agenerate(long)
            assert resp.output_tokens == base[:expected] and resp.stop_reason == "stop"
            assert handle.server.counters["generation_tokens"] - before < 1000
            with pytest.raises(UnsupportedRequest, match="min_new_tokens"):  # rollq's refusal, not the engine's 400
                await pool.agenerate(ModelRequest(input_ids=[3, 4], sampling=SamplingParams(min_new_tokens=2)))
    finally:
        await handle.close()


async def test_a_pool_with_the_engines_api_and_admin_keys_generates_and_controls(start_engine, caplog):
    handle = await start_engine(server={"api_key": "usr", "admin_api_key": "adm"})
    keys = dict(urls=[handle.url], no_engine_timeout_s=5.0)
    async with EnginePool(PoolConfig(api_key="usr", admin_api_key="adm", **keys)) as pool:
        # Told from a gateway by its /workers, which it refuses without its key (401) and answers 404 with it.
        assert pool.members[handle.url].kind == "engine"
        assert "engine or a gateway" not in caplog.text
        fleet = FleetController(pool, retries=0)
        assert len((await pool.agenerate(request(0, 5))).output_tokens) == 5
        paused = await fleet.pause("retract")
        assert paused.ok == [handle.url] and not paused.failed and handle.server.paused
        resumed = await fleet.resume()
        assert resumed.ok == [handle.url] and not resumed.failed and not handle.server.paused
        assert len((await pool.agenerate(request(1, 5))).output_tokens) == 5

    async with EnginePool(PoolConfig(api_key="usr", admin_api_key="wrong", **keys)) as pool:
        result = await FleetController(pool, retries=0).pause("retract")
        assert (
            result.ok == []
            and "Unauthorized" in result.failed[handle.url]
            and "admin_api_key" in result.failed[handle.url]
        )
        assert not handle.server.paused
        assert len((await pool.agenerate(request(2, 5))).output_tokens) == 5  # generation takes the api key

    async with EnginePool(PoolConfig(api_key="wrong", admin_api_key="adm", **keys)) as pool:
        with pytest.raises(EngineError, match=r"HTTP 401: Unauthorized \(the engine refused the key sent"):
            await pool.agenerate(request(3, 5))
        with pytest.raises(EngineError, match="HTTP 401"):
            await pool.agenerate(request(4, 5), on_tokens=lambda *_: None)  # streamed
