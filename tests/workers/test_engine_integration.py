"""A worker running a RolloutWorkflow that generates through two reference engines (tiny model), one SIGKILLed
mid-run."""

import os
import signal
import subprocess
import sys

import pytest

from rollq.engine.registry import EngineRegistry
from rollq.local import free_port
from rollq.producer import JobRequest, Producer
from tests.helpers import REPO_ROOT, engine_healthy, wait_registered, wait_until


@pytest.mark.slow
@pytest.mark.scenario  # SIGKILL failover of the pool itself stays in CI: tests/engine/test_pool.py
async def test_every_job_completes_when_an_engine_dies_mid_run(redis, redis_url, run_name, spawn_worker):
    ports = [free_port(), free_port()]
    engines = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rollq",
                "engine",
                "--backend",
                "reference",
                "--model",
                "tiny",
                "--port",
                str(p),
                "--register",
                "--redis",
                redis_url,
                "--run",
                run_name,
            ],
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for p in ports
    ]
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for url in urls:
            await wait_until(lambda url=url: engine_healthy(url), 90, what=f"{url} up")
        registry = EngineRegistry(redis, run_name)
        await wait_until(lambda: _registered(registry, urls), 10, what="engines registered")
        # The worker finds the engines through the registry (no --engine flags).
        worker = spawn_worker(redis_url, run_name, "--concurrency", "16")
        await wait_registered(redis, run_name, worker.name)
        producer = Producer(redis, run_name)
        consumer = producer.consumer()
        await consumer.setup()
        reqs = [
            JobRequest(
                workflow="tests.workflows:Generate",
                job_id=f"g{i}",
                n=2,
                data={"prompt_ids": [30, 31, 32, 40 + i], "max_new_tokens": 60, "group": f"g{i}"},
            )
            for i in range(12)
        ]
        await producer.submit_many(reqs)
        # Killed while it holds requests (not merely after some trajectories arrived: under load it may be idle)
        await wait_until(lambda: _busy(urls[0]), 60, what=f"requests running on {urls[0]}")
        os.kill(engines[0].pid, signal.SIGKILL)
        expected = {f"g{i}": 2 for i in range(12)}
        trajs = [t async for t in producer.wait_for(expected, timeout_s=90, consumer=consumer)]
        assert sorted((t.job_id, t.sample_index) for t in trajs) == sorted((j, s) for j in expected for s in range(2))
        assert all(t.status == "ok" for t in trajs), [t.error for t in trajs if t.error]
        assert "failed over from" in worker.output()  # the kill really hit requests in flight
        for t in trajs:
            seq = t.sequences[0]
            assert len(seq.input_ids) == 4 + 60 and sum(seq.loss_mask) == 60
            assert seq.versions.tolist()[4:] == [-1] * 60  # the engines run weight version "default"
    finally:
        for e in engines:
            if e.poll() is None:
                e.kill()
            e.wait(10)


async def _registered(registry, urls):
    return sorted(await registry.live()) == sorted(urls)


async def _busy(url: str) -> bool:
    """The engine reports requests running or queued (SGLang's /server_info internal_states)."""
    import aiohttp  # polled: an aiohttp session is ~0.1 ms of CPU, an httpx client ~85 ms (it loads the CA bundle)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        async with session.get(url + "/server_info") as response:
            state = (await response.json())["internal_states"][0]
    return state["num_running_reqs"] + state["num_queue_reqs"] > 0
