"""What weight updates do to the requests in flight: under load from real clients, the default `retract` pause aborts
nothing any client sees, and the engines' counters (read by FleetController.run_cycle, engine/update_counts.py) say
how many requests each update retracted, and in `abort` mode aborted."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from rollq.engine.client import SGLangClient
from rollq.engine.fleet import FleetController
from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.server.app import ServerHandle
from rollq.engine.types import GenerateResult, PauseMode, SamplingParams
from rollq.engine.update_counts import counted, parse_counts
from tests.helpers import wait_until

ENGINES = 2
CLIENTS = 12  # concurrent requests, spread over the engines
TOKENS = 40
CYCLES = 3


def generating(handles: list[ServerHandle]) -> Callable[[], bool]:
    """Every engine has a request past the gate that generated under the current weights and is not finished."""

    def check() -> bool:
        return all(
            any(r.started and r.state.finish is None and r.state.output_ids for r in h.server.states.values())
            for h in handles
        )

    return check


async def client_load(client: SGLangClient, i: int, stop: asyncio.Event, results: list[GenerateResult]) -> None:
    """One client: a request after another until told to stop (a request the pause holds waits for the resume)."""
    n = 0
    while not stop.is_set():
        sampling = SamplingParams(max_new_tokens=TOKENS, ignore_eos=True)
        results.append(await client.generate([7, 8, 9, i, n], sampling, timeout=30))
        n += 1


@pytest.mark.parametrize("mode", ["retract", "abort"])
async def test_updates_under_load_abort_nothing_in_retract_mode_and_the_engines_count_both(
    start_engine, tmp_path: Path, mode: PauseMode
) -> None:
    handles = [await start_engine(server={"weight_version": "0"}, per_token_latency_s=0.004) for _ in range(ENGINES)]
    results: list[GenerateResult] = []
    phases: list[dict[str, float]] = []
    stop = asyncio.Event()
    async with EnginePool(PoolConfig(urls=[h.url for h in handles])) as pool:
        fleet = FleetController(pool)
        clients = [pool.members[h.url].client for h in handles]
        load = [asyncio.create_task(client_load(clients[i % ENGINES], i, stop, results)) for i in range(CLIENTS)]
        try:
            for version in range(1, CYCLES + 1):
                await wait_until(generating(handles), 10, what="requests generating on every engine")
                (tmp_path / f"v{version}").mkdir()
                update = functools.partial(fleet.update_weights, str(tmp_path / f"v{version}"), version)
                report = await asyncio.wait_for(fleet.run_cycle(update, mode=mode), 30)
                assert report.updated == [h.url for h in handles]
                phases.append(report.phases)
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*load), 30)  # each client's last request finishes

    aborted = [r for r in results if r.aborted]
    # (an answer aborted before its first token has no num_retractions, as SGLang's "Abort in waiting queue")
    retractions = sum(r.meta_info.get("num_retractions", 0) for r in results)
    if mode == "retract":
        # no client saw an abort: every request generated all its tokens across the updates
        assert aborted == [], [r.finish_reason for r in aborted]
        assert all(len(r.output_ids) == TOKENS for r in results)
        assert [p["aborted"] for p in phases] == [0.0] * CYCLES
        assert all(p["retracted"] > 0 for p in phases), phases  # each update caught requests running: counted
        assert sum(p["retracted"] for p in phases) == retractions  # as many as the clients' answers report
    else:
        assert all(p["aborted"] > 0 for p in phases), phases
        assert sum(p["aborted"] for p in phases) == len(aborted)  # each one a client saw, none else
        assert [p["retracted"] for p in phases] == [0.0] * CYCLES and retractions == 0


def sglang_text(aborted: dict[str, float], retracted: float) -> str:
    """/metrics as SGLang 0.5.23 writes it (prometheus_client, its names and labels, one series per label set)."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine_type"]
    aborts = Counter("sglang:num_aborted_requests_total", "Number of requests aborted.", labels, registry=registry)
    for model, n in aborted.items():
        aborts.labels(model, "unified").inc(n)
    retracts = Counter(
        "sglang:num_retracted_requests_total", "Total number of retracted requests.", labels, registry=registry
    )
    retracts.labels("m", "unified").inc(retracted)
    Counter("sglang:num_requests_total", "Number of requests.", labels, registry=registry).labels("m", "x").inc(99)
    return generate_latest(registry).decode()


def test_sglangs_counters_are_summed_over_series_and_a_restart_counts_nothing() -> None:
    assert parse_counts(sglang_text({"m": 2, "lora": 1}, 5)) == {"aborted": 3.0, "retracted": 5.0}
    assert parse_counts("# no counters here\nsglang:num_running_reqs 4.0\n") == {}
    before = {"a": {"aborted": 3.0, "retracted": 5.0}, "b": {"aborted": 7.0, "retracted": 2.0}, "gone": {"aborted": 1}}
    after = {"a": {"aborted": 4.0, "retracted": 9.0}, "b": {"aborted": 1.0, "retracted": 3.0}, "new": {"aborted": 50}}
    # a: +1 aborted, +4 retracted; b restarted (its aborts went down): its count is lost, its retractions grew by 1;
    # an engine read only once adds nothing
    assert counted(before, after) == {"aborted": 1.0, "retracted": 5.0}
    assert counted({}, {}) == {"aborted": 0.0, "retracted": 0.0}
