"""workflow_context(): one set of shared clients per worker, visible to every job task, closed when it stops."""

from __future__ import annotations

import pytest

from rollq.producer.producer import JobRequest, Producer
from rollq.workers.context import WorkflowContext, workflow_context
from tests.helpers import running_worker


async def test_context_is_shared_and_closed():
    async with WorkflowContext() as ctx:
        assert workflow_context() is ctx
        client, session = ctx.http_client(), ctx.aiohttp_session()
        assert ctx.http_client() is client and ctx.aiohttp_session() is session
    assert client.is_closed and session.closed
    with pytest.raises(RuntimeError, match="no workflow context"):
        workflow_context()


async def test_every_job_of_a_worker_sees_the_same_clients(redis, redis_url, run_name):
    async with running_worker(redis_url, run_name, concurrency=4) as worker:
        producer = Producer(redis, run_name)
        consumer = producer.consumer()
        await consumer.setup()
        await producer.submit_many(
            [JobRequest(workflow="tests.workflows:ContextProbe", job_id=f"c{i}") for i in range(6)]
        )
        trajs = [t async for t in producer.wait_for({f"c{i}": 1 for i in range(6)}, timeout_s=30, consumer=consumer)]
        client = worker.context.http_client()
        assert {t.sequences[0].reward for t in trajs} == {float(id(client) % 1_000_003)}
    assert client.is_closed


async def test_a_stopping_worker_closes_its_workflows(redis, redis_url, run_name, tmp_path):
    marker = tmp_path / "closed"
    async with running_worker(redis_url, run_name):
        producer = Producer(redis, run_name)
        consumer = producer.consumer()
        await consumer.setup()
        await producer.submit_many(
            [JobRequest(workflow="tests.workflows:Closable", job_id="x", workflow_kwargs={"marker": str(marker)})]
        )
        [t] = [t async for t in producer.wait_for({"x": 1}, timeout_s=30, consumer=consumer)]
        assert t.status == "ok" and not marker.exists()
    assert marker.read_text() == "1"
