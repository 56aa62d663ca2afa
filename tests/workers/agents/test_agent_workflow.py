"""Agent workflows end to end in a real worker: Redis streams, the worker's recording proxy, a real EnginePool and a
scripted engine server; inline and subproc modes, both exports, rewards, and every kind of bad agent."""

from __future__ import annotations

import pytest

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.producer.producer import JobRequest, Producer
from rollq.protocol.messages import AgentOptions
from tests.agents import CALL_ADD, SCRIPT
from tests.helpers import running_worker
from tests.scripted import tiny_tokenizer


@pytest.fixture
async def pool():
    from tests.scripted import scripted_engine

    async with scripted_engine(SCRIPT) as engine, EnginePool(PoolConfig(urls=[engine.url])) as pool:
        yield pool


async def run_jobs(redis, redis_url, run, pool, workflow: str, n: int = 1, jobs: int = 1, **options):
    agent = AgentOptions(**options) if options else None
    async with running_worker(redis_url, run, engine=pool, max_attempts=1, concurrency=8):
        producer = Producer(redis, run)
        consumer = producer.consumer()
        await consumer.setup()
        reqs = [
            JobRequest(workflow=workflow, job_id=f"j{i}", n=n, data={"question": "What is 2 + 3?"}, agent=agent)
            for i in range(jobs)
        ]
        await producer.submit_many(reqs)
        expected = {r.job_id: n for r in reqs}
        return sorted(
            [t async for t in producer.wait_for(expected, timeout_s=60, consumer=consumer)],
            key=lambda t: (t.job_id, t.sample_index),
        )


async def test_inline_agent_concat_export_is_the_exact_conversation(redis, redis_url, run_name, pool):
    trajs = await run_jobs(
        redis, redis_url, run_name, pool, "tests.agents:CalculatorAgent", n=2, jobs=2, export="concat"
    )
    assert [t.status for t in trajs] == ["ok"] * 4, [t.error for t in trajs]
    tok = tiny_tokenizer()
    for t in trajs:
        [seq] = t.sequences  # one branch: tool call -> tool response -> answer
        ids, mask = list(seq.input_ids), list(seq.loss_mask)
        trained = tok.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special_tokens=True)
        assert trained == CALL_ADD + "The answer is 5."
        assert seq.reward == 1.0 and len(seq.logprobs) == len(ids) == len(seq.versions)
        assert all(lp < 0 for lp, m in zip(seq.logprobs, mask, strict=True) if m)
        assert "<tool_response>\n5\n</tool_response>" in tok.decode(ids)


async def test_individual_export_with_turn_discount(redis, redis_url, run_name, pool):
    [t] = await run_jobs(redis, redis_url, run_name, pool, "tests.agents:CalculatorAgent", turn_discount=0.5)
    assert t.status == "ok", t.error
    first, second = t.sequences
    assert (first.reward, second.reward) == (0.5, 1.0)
    assert list(second.input_ids[: len(first.input_ids)]) == list(first.input_ids)


async def test_dict_rewards_by_completion_id(redis, redis_url, run_name, pool):
    [t] = await run_jobs(redis, redis_url, run_name, pool, "tests.agents:DictRewardAgent")
    assert t.status == "ok", t.error
    # AReaL's return: the tool call's own 0.5 plus the answer's 1.0 (turn_discount 1.0)
    assert [s.reward for s in t.sequences] == [1.5, 1.0]


async def test_subproc_sync_agent_reads_the_proxy_from_the_environment(redis, redis_url, run_name, pool):
    trajs = await run_jobs(
        redis, redis_url, run_name, pool, "tests.agents:SyncEnvAgent", n=2, mode="subproc", export="concat"
    )
    assert [t.status for t in trajs] == ["ok", "ok"], [t.error for t in trajs]
    assert all(t.sequences[0].reward == 1.0 for t in trajs)


@pytest.mark.parametrize(
    "workflow, options, error_type, message",
    [
        ("tests.agents:RaisingAgent", {}, "RuntimeError", "the agent's environment crashed"),
        ("tests.agents:RaisingAgent", {"mode": "subproc"}, "AgentError", "the agent's environment crashed"),
        ("tests.agents:NotANumberAgent", {}, "AgentOutputError", "must be a finite number"),
        ("tests.agents:SilentAgent", {}, "AgentOutputError", "no completion through the proxy"),
        ("tests.agents:NoSuchAgent", {}, "WorkflowLoadError", "has no attribute 'NoSuchAgent'"),
        (
            "tests.agents:HangingSyncAgent",
            {"mode": "subproc", "timeout_seconds": 1.0},
            "AgentTimeout",
            "longer than 1s",
        ),
    ],
)
async def test_bad_agents_become_error_trajectories_that_say_why(
    redis, redis_url, run_name, pool, workflow, options, error_type, message
):
    [t] = await run_jobs(redis, redis_url, run_name, pool, workflow, **options)
    assert t.status == "error" and t.error.type == error_type and message in t.error.message, t.error
    dead = await redis.xrange(f"rollq:{{{run_name}}}:dead")
    assert len(dead) == 1
