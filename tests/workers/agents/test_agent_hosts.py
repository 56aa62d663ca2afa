"""Agent host processes (`agent_hosts`, rollq.workers.agents.hosts) in a real worker: Redis streams, the worker's
recording proxy, a real EnginePool and a scripted engine server. Inline async agents run in host processes, token-
exactly as in the worker's loop; timeouts, CPU-stuck agents, killed hosts and worker shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.producer.producer import JobRequest, Producer
from rollq.protocol.messages import AgentOptions
from rollq.workers.agents.hosts import HOST_GRACE_S, AgentHosts
from rollq.workers.resolver import Allowlist
from tests.agents import CALL_ADD, SCRIPT
from tests.helpers import pid_alive, running_worker, wait_until
from tests.scripted import tiny_tokenizer


@pytest.fixture
async def pool():
    from tests.scripted import scripted_engine

    async with scripted_engine(SCRIPT) as engine, EnginePool(PoolConfig(urls=[engine.url])) as pool:
        yield pool


class Jobs:
    """Submits jobs to a running worker and waits (bounded) for their trajectories."""

    def __init__(self, redis: Any, run: str) -> None:
        self.producer = Producer(redis, run)
        self.consumer = self.producer.consumer()
        self.count = 0
        self.prefix = uuid.uuid4().hex[:6]  # job ids are never reused (a producer admits a job id once)

    async def run(
        self, workflow: str, jobs: int = 1, n: int = 1, kwargs: dict | None = None, timeout_s: float = 60, **options
    ) -> list[Any]:
        agent = AgentOptions(**options) if options else None
        first, self.count = self.count, self.count + jobs
        reqs = [
            JobRequest(
                workflow=workflow,
                job_id=f"{self.prefix}-{i:04d}",
                n=n,
                data={"question": "What is 2 + 3?"},
                workflow_kwargs=kwargs,
                agent=agent,
            )
            for i in range(first, first + jobs)
        ]
        await self.producer.submit_many(reqs)
        got = [
            t
            async for t in self.producer.wait_for(
                {r.job_id: n for r in reqs}, timeout_s=timeout_s, consumer=self.consumer
            )
        ]
        return sorted(got, key=lambda t: (t.job_id, t.sample_index))


async def warm_up(jobs: Jobs, tmp_path: Path) -> None:
    """One episode first, so the host is started and has imported the SDK: a 1 s episode timeout then covers the
    episode alone (an SDK import and a first request can take longer than that on a loaded machine)."""
    [t] = await jobs.run("tests.agents:PidAgent", kwargs={"record": str(tmp_path / "warm-up")})
    assert t.status == "ok", t.error


def _lines(path: Path) -> list[list[int]]:
    return [list(map(int, line.split())) for line in path.read_text().splitlines()] if path.exists() else []


def _signature(trajs: list[Any]) -> list[tuple]:
    return [
        (t.status, [(list(s.input_ids), list(s.loss_mask), list(s.logprobs), s.reward) for s in t.sequences])
        for t in trajs
    ]


async def test_hosted_agent_runs_in_another_process_token_exactly_as_inline(redis, redis_url, run_name, pool, tmp_path):
    record = tmp_path / "pids"
    kwargs = {"record": str(record)}
    async with running_worker(redis_url, run_name, engine=pool, max_attempts=1, concurrency=8):
        jobs = Jobs(redis, run_name)
        await jobs.consumer.setup()
        inline = await jobs.run("tests.agents:PidAgent", n=2, kwargs=kwargs, export="concat")
    inline_pids = _lines(record)
    record.unlink()
    async with running_worker(redis_url, run_name, engine=pool, max_attempts=1, concurrency=8, agent_hosts=2) as worker:
        jobs = Jobs(redis, run_name)
        hosted = await jobs.run("tests.agents:PidAgent", n=2, kwargs=kwargs, export="concat")
        hosted_pids = _lines(record)
        assert worker.context.config.agent_hosts == 2
    assert [t.status for t in inline + hosted] == ["ok"] * 4, [t.error for t in inline + hosted]
    assert {p[0] for p in inline_pids} == {os.getpid()}
    hosts = {p[0] for p in hosted_pids}
    assert os.getpid() not in hosts and 1 <= len(hosts) <= 2
    # token-exact: the very same sequences, masks, logprobs and rewards as in the worker's own loop
    assert _signature(hosted) == _signature(inline)
    tok = tiny_tokenizer()
    for t in hosted:
        [seq] = t.sequences
        trained = tok.decode(
            [i for i, m in zip(seq.input_ids, seq.loss_mask, strict=True) if m], skip_special_tokens=True
        )
        assert trained == CALL_ADD + "The answer is 5." and seq.reward == 1.0
    # AsyncRewardWrappers built per run inside a host share one pool there, closed with the host (worker stop)
    for pids in hosted_pids:
        assert len(pids) == 2 and pids[1] not in hosts
    by_host: dict[int, set[int]] = {}
    for host, reward_pid in hosted_pids:
        by_host.setdefault(host, set()).add(reward_pid)
    assert all(len(p) == 1 for p in by_host.values()), by_host
    gone = [p for pids in hosted_pids for p in pids]
    await wait_until(lambda: not any(map(pid_alive, gone)), timeout_s=10, what="hosts and their pools to exit")


async def test_many_concurrent_episodes_spread_over_two_hosts(redis, redis_url, run_name, pool, tmp_path):
    record = tmp_path / "pids"
    async with running_worker(
        redis_url, run_name, engine=pool, max_attempts=1, concurrency=32, agent_hosts=2
    ) as worker:
        jobs = Jobs(redis, run_name)
        await jobs.consumer.setup()
        trajs = await jobs.run("tests.agents:PidAgent", jobs=24, n=2, kwargs={"record": str(record)})
        hosts = worker.context.pool(("agent-hosts",), lambda: None)
        assert sorted(hosts.pids) == sorted({p[0] for p in _lines(record)})
        host_pids = hosts.pids
    assert [t.status for t in trajs] == ["ok"] * 48, [t.error for t in trajs if t.status != "ok"][:3]
    assert all([s.reward for s in t.sequences] == [1.0, 1.0] for t in trajs)
    assert len(host_pids) == 2 and os.getpid() not in host_pids
    await wait_until(lambda: not any(map(pid_alive, host_pids)), timeout_s=10, what="the hosts to exit at worker stop")


async def test_timeout_cancels_the_episode_in_its_host_which_stays_usable(redis, redis_url, run_name, pool, tmp_path):
    stuck, record = tmp_path / "stuck", tmp_path / "pids"
    async with running_worker(redis_url, run_name, engine=pool, max_attempts=1, concurrency=8, agent_hosts=2):
        jobs = Jobs(redis, run_name)
        await jobs.consumer.setup()
        await warm_up(jobs, tmp_path)
        [t] = await jobs.run("tests.agents:StuckAgent", kwargs={"record": str(stuck)}, timeout_seconds=1.0)
        assert t.status == "error" and t.error.type == "AgentTimeout", t.error
        assert "longer than 1s" in t.error.message and "killed" not in t.error.message, t.error.message
        [ok] = await jobs.run("tests.agents:PidAgent", kwargs={"record": str(record)})
        assert ok.status == "ok", ok.error
    # the same host (the least loaded, the first) ran both: the timed-out episode did not cost it
    assert _lines(stuck)[0][0] == _lines(record)[0][0] != os.getpid()


async def test_cpu_stuck_agent_gets_its_host_killed_and_the_next_episode_works(
    redis, redis_url, run_name, pool, tmp_path
):
    stuck, record = tmp_path / "stuck", tmp_path / "pids"
    async with running_worker(redis_url, run_name, engine=pool, max_attempts=1, concurrency=8, agent_hosts=1):
        jobs = Jobs(redis, run_name)
        await jobs.consumer.setup()
        await warm_up(jobs, tmp_path)
        [t] = await jobs.run(
            "tests.agents:StuckAgent",
            kwargs={"record": str(stuck), "how": "spin"},
            timeout_seconds=1.0,
            timeout_s=1.0 + HOST_GRACE_S + 30,
        )
        assert t.status == "error" and t.error.type == "AgentTimeout", t.error
        assert "longer than 1s" in t.error.message and "host was killed" in t.error.message, t.error.message
        [spun] = _lines(stuck)
        await wait_until(lambda: not pid_alive(spun[0]), timeout_s=10, what="the stuck host to be gone")
        [ok] = await jobs.run("tests.agents:PidAgent", kwargs={"record": str(record)})
        assert ok.status == "ok", ok.error
    assert _lines(record)[0][0] not in (spun[0], os.getpid())  # a replacement host


async def test_killed_host_fails_its_episode_clearly_and_is_replaced(redis, redis_url, run_name, pool, tmp_path):
    stuck, record = tmp_path / "stuck", tmp_path / "pids"
    async with running_worker(redis_url, run_name, engine=pool, max_attempts=1, concurrency=8, agent_hosts=1):
        jobs = Jobs(redis, run_name)
        await jobs.consumer.setup()
        episode = jobs.run("tests.agents:StuckAgent", kwargs={"record": str(stuck)}, timeout_seconds=300)
        task = asyncio.create_task(episode)
        [[host]] = await wait_until(lambda: _lines(stuck), timeout_s=30, what="the agent to reach its host")
        os.kill(host, signal.SIGKILL)
        [t] = await asyncio.wait_for(task, 30)
        assert t.status == "error" and t.error.type == "AgentHostError", t.error
        assert f"agent host {host} died (exit code -9, SIGKILL)" in t.error.message, t.error.message
        [ok] = await jobs.run("tests.agents:PidAgent", kwargs={"record": str(record)})
        assert ok.status == "ok", ok.error
    assert _lines(record)[0][0] not in (host, os.getpid())


async def test_sync_agents_and_command_agents_keep_running_as_before(redis, redis_url, run_name, pool):
    async with running_worker(redis_url, run_name, engine=pool, max_attempts=1, concurrency=8, agent_hosts=2) as w:
        jobs = Jobs(redis, run_name)
        await jobs.consumer.setup()
        [t] = await jobs.run("tests.agents:SyncEnvAgent", mode="subproc")
        assert t.status == "ok", t.error
        [t] = await jobs.run("tests.agents:RaisingAgent")
        assert t.status == "error" and t.error.type == "AgentError", t.error
        assert "raised RuntimeError: the agent's environment crashed" in t.error.message
        assert "Traceback" in t.error.message
        [t] = await jobs.run("tests.agents:NotANumberAgent")
        assert (
            t.status == "error" and t.error.type == "AgentOutputError" and "must be a finite number" in t.error.message
        )
        assert len(w.context.pool(("agent-hosts",), lambda: None).pids) == 1


async def test_cancelling_an_episode_cancels_its_task_in_the_host(tmp_path):
    """What a worker's drain or a cancelled job does to a hosted episode: the host cancels the agent's task (and
    stays up for the next episode)."""
    record = tmp_path / "stuck"
    cancelled = tmp_path / "stuck.cancelled"
    hosts = AgentHosts(1)
    try:
        kwargs = json.dumps({"record": str(record), "model": False})
        urls = {"base_url": "http://127.0.0.1:9/v1", "anthropic_base_url": "http://127.0.0.1:9"}
        allow = Allowlist(patterns=("tests",))
        task = asyncio.create_task(hosts.run("tests.agents:StuckAgent", kwargs, {}, urls, "k", allow, None, 300))
        [[host]] = await wait_until(lambda: _lines(record), timeout_s=30, what="the agent to start in its host")
        assert hosts.pids == [host] != [os.getpid()] and hosts.load() == [1]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        assert hosts.load() == [0]
        assert await wait_until(lambda: _lines(cancelled), timeout_s=10, what="the host to cancel it") == [[host]]
        reply = await asyncio.wait_for(hosts.run("tests.agents:RaisingAgent", "{}", {}, urls, "k", allow, None, 30), 30)
        assert reply[0] == "raised" and reply[2] == "RuntimeError" and hosts.pids == [host]
        refused = await hosts.run("tests.agents:RaisingAgent", "{}", {}, urls, "k", Allowlist(), None, 30)
        assert refused[0] == "raised" and refused[2] == "ImportNotAllowed"  # the allowlist is checked in the host
    finally:
        await hosts.close()
    await wait_until(lambda: not pid_alive(host), timeout_s=10, what="the host to exit")
