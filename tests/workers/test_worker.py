import asyncio

import pytest

from rollq.producer import JobRequest, Producer
from rollq.protocol import Codec
from rollq.protocol.keys import PAYLOAD_FIELD, WORKER_GROUP, RunKeys
from tests.helpers import running_worker


async def collect(producer: Producer, expected: dict[str, int], timeout_s: float = 20):
    return [t async for t in producer.wait_for(expected, timeout_s=timeout_s)]


async def test_jobs_are_delivered_once_and_acked(redis, redis_url, run_name):
    producer = Producer(redis, run_name)
    consumer = producer.consumer()
    await consumer.setup()
    reqs = [
        JobRequest(workflow="tests.workflows:Echo", data={"i": i, "len": 4 + i}, n=2, job_id=f"p{i}") for i in range(30)
    ]
    async with running_worker(redis_url, run_name, concurrency=16) as worker:
        await producer.submit_many(reqs)
        trajs = [t async for t in producer.wait_for({f"p{i}": 2 for i in range(30)}, timeout_s=20, consumer=consumer)]
    assert sorted((t.job_id, t.sample_index) for t in trajs) == sorted(
        (f"p{i}", s) for i in range(30) for s in range(2)
    )
    by_id = {t.job_id: t for t in trajs}
    seq = by_id["p7"].sequences[0]
    assert len(seq.input_ids) == 11 and seq.reward == 7.0 and seq.loss_mask.tolist() == [0] * 5 + [1] * 6
    assert all(t.status == "ok" and t.worker_id == worker.name and t.attempt == 1 for t in trajs)
    keys = RunKeys(run_name)
    assert await redis.xlen(keys.jobs) == 0  # finished jobs leave the stream
    assert (await redis.xpending(keys.jobs, WORKER_GROUP))["pending"] == 0
    assert worker.stats.completed == 60


async def test_bad_input_is_dead_lettered_while_good_jobs_complete(redis, redis_url, run_name):
    keys = RunKeys(run_name)
    producer = Producer(redis, run_name)
    codec = Codec()
    async with running_worker(
        redis_url, run_name, concurrency=4, max_attempts=2, allow=["tests", "no_such_module"]
    ) as worker:
        await redis.xadd(keys.jobs, {PAYLOAD_FIELD: b"\xc1 definitely not msgpack"})
        await redis.xadd(keys.jobs, {b"something": b"else"})
        await redis.xadd(keys.jobs, {PAYLOAD_FIELD: b'{"job_id": "typed-wrong", "workflow": 7}'})
        await producer.submit("tests.workflows:Boom", {"i": 1}, job_id="boom")
        await producer.submit("no_such_module:Workflow", job_id="missing")
        await producer.submit("tests.workflows:BadOutput", job_id="bad-output")
        await producer.submit("tests.workflows:Echo", {"i": 3}, job_id="good-before", n=2)
        trajs = await collect(producer, {"boom": 1, "missing": 1, "bad-output": 1, "good-before": 2, "typed-wrong": 1})
        # The worker keeps serving after all that.
        await producer.submit("tests.workflows:Echo", {"i": 4}, job_id="good-after")
        trajs += await collect(producer, {"good-after": 1})
    status = {t.job_id: t.status for t in trajs}
    assert status == {
        "boom": "error",
        "missing": "error",
        "bad-output": "error",
        "good-before": "ok",
        "typed-wrong": "error",
        "good-after": "ok",
    }
    errors = {t.job_id: t.error for t in trajs if t.error}
    assert errors["boom"].type == "RuntimeError" and "boom on 1" in errors["boom"].message
    assert errors["boom"].attempt == 2 and "Traceback" in errors["boom"].traceback
    assert "No module named 'no_such_module'" in errors["missing"].message
    assert "loss_mask: " not in errors["bad-output"].message and "loss_mask has 2" in errors["bad-output"].message
    assert "workflow" in errors["typed-wrong"].message
    letters = [codec.decode_dead_letter(f[PAYLOAD_FIELD]) for _, f in await redis.xrange(keys.dead)]
    assert len(letters) == 6
    assert {lt.job.job_id for lt in letters if lt.job} == {"boom", "missing", "bad-output"}
    raw = [lt for lt in letters if lt.job is None]
    assert sorted(lt.error.type for lt in raw) == ["MalformedJob"] * 3
    assert any(lt.raw == b"\xc1 definitely not msgpack" for lt in raw)
    assert any("no 'd' payload field" in lt.error.message for lt in raw)
    assert worker.stats.dead_lettered == 6 and worker.stats.requeued == 2  # boom and bad-output retried once
    assert await redis.xlen(keys.jobs) == 0


async def test_a_failing_workflow_is_retried(redis, redis_url, run_name, tmp_path):
    producer = Producer(redis, run_name)
    async with running_worker(redis_url, run_name, max_attempts=3) as worker:
        await producer.submit("tests.workflows:FailOnce", {"i": 0, "marker_dir": str(tmp_path)}, job_id="flaky")
        [traj] = await collect(producer, {"flaky": 1})
    assert traj.status == "ok" and traj.attempt == 2
    assert worker.stats.requeued == 1


async def test_rejected_samples_multi_sequence_kwargs_and_functions(redis, redis_url, run_name):
    producer = Producer(redis, run_name)
    async with running_worker(redis_url, run_name):
        await producer.submit("tests.workflows:Reject", job_id="rej")
        await producer.submit("tests.workflows:MultiSequence", job_id="multi")
        await producer.submit("tests.workflows.WithKwargs", job_id="kw", workflow_kwargs={"length": 9})
        await producer.submit("tests.workflows:function_workflow", job_id="fn")
        await producer.submit("tests.workflows:Echo", job_id="kw-bad", workflow_kwargs={"nope": 1})
        trajs = {t.job_id: t for t in await collect(producer, {"rej": 1, "multi": 1, "kw": 1, "fn": 1, "kw-bad": 1})}
    assert trajs["rej"].status == "rejected" and trajs["rej"].sequences == []
    assert [len(s.input_ids) for s in trajs["multi"].sequences] == [3, 5]
    assert [s.reward for s in trajs["multi"].sequences] == [0.5, 1.5]
    assert len(trajs["kw"].sequences[0].input_ids) == 9
    assert len(trajs["fn"].sequences[0].input_ids) == 2
    assert trajs["kw-bad"].status == "error" and "cannot construct workflow" in trajs["kw-bad"].error.message


async def test_a_long_job_is_not_stolen_while_its_worker_lives(redis, redis_url, run_name):
    """The job runs 6x the lease; a second worker scanning for dead workers' jobs must not take it."""
    producer = Producer(redis, run_name)
    lease = dict(lease_ms=300, lease_refresh_ms=50, reclaim_interval_ms=50)
    async with running_worker(redis_url, run_name, name="owner", **lease) as owner:
        await producer.submit("tests.workflows:Echo", {"sleep": 1.8}, job_id="long")
        await asyncio.wait_for(_until_running(owner), 10)
        async with running_worker(redis_url, run_name, name="thief", **lease) as thief:
            [traj] = await collect(producer, {"long": 1})
    assert traj.worker_id == "owner" and traj.attempt == 1
    assert thief.stats.reclaimed == 0 and thief.stats.completed == 0


async def _until_running(worker):
    while not worker._running:
        await asyncio.sleep(0.01)


async def test_unfinished_jobs_are_handed_back_when_the_drain_grace_expires(redis, redis_url, run_name):
    producer = Producer(redis, run_name)
    keys = RunKeys(run_name)
    async with running_worker(redis_url, run_name, name="leaver", drain_grace=0.2) as leaver:
        await producer.submit("tests.workflows:Echo", {"sleep": 30}, job_id="slow")
        await asyncio.wait_for(_until_running(leaver), 10)
    # The drain requeued it: back in the stream, pending for nobody, and not counted as a failed attempt.
    assert (await redis.xpending(keys.jobs, WORKER_GROUP))["pending"] == 0
    [(_, fields)] = await redis.xrange(keys.jobs)
    job = Codec().decode_job(fields[PAYLOAD_FIELD])
    assert job.job_id == "slow" and job.attempt == 0


async def test_agent_name_picks_a_builtin_loop_and_an_unknown_one_is_dead_lettered(redis, redis_url, run_name):
    from rollq.workers.loader import workflow_path

    assert (
        workflow_path("tests.workflows:Echo", {"agent_name": "tool_agent"})
        == "rollq.workers.builtin.tool_agent:ToolAgentWorkflow"
    )
    assert workflow_path("rlvr", {}) == "rollq.workers.builtin.rlvr:RLVRWorkflow"
    assert workflow_path("tests.workflows:Echo", {"q": 1}) == "tests.workflows:Echo"
    producer = Producer(redis, run_name)
    async with running_worker(redis_url, run_name):
        await producer.submit("tests.workflows:Echo", {"agent_name": "no_such_agent"}, job_id="agent")
        [traj] = await collect(producer, {"agent": 1})
    assert traj.status == "error" and traj.error.type == "WorkflowLoadError"
    assert "unknown agent name 'no_such_agent'; known: multi_turn, rlvr, tool_agent" in traj.error.message


async def test_a_job_over_max_job_bytes_is_dead_lettered_undecoded(redis, redis_url, run_name):
    keys = RunKeys(run_name)
    # lets it through, its data inline in each entry; the worker's limit is lower
    producer = Producer(redis, run_name, max_job_bytes=1 << 20, blob_min_bytes=1 << 30)
    codec = Codec()
    async with running_worker(redis_url, run_name, max_job_bytes=4000) as worker:
        await producer.submit("tests.workflows:Echo", {"i": 1, "blob": "x" * 5000}, job_id="big", n=2)
        await producer.submit("tests.workflows:Echo", {"i": 2, "blob": "x" * 1000}, job_id="small")
        trajs = {(t.job_id, t.sample_index): t for t in await collect(producer, {"big": 2, "small": 1})}
    assert trajs["small", 0].status == "ok"
    for i in range(2):  # its waiter gets an error per sample (the identifying fields are read, the data is not)
        err = trajs["big", i].error
        assert trajs["big", i].status == "error" and err.type == "JobTooLarge"
        assert "max_job_bytes=4000" in err.message and "bytes (" in err.message
    letters = [codec.decode_dead_letter(f[PAYLOAD_FIELD]) for _, f in await redis.xrange(keys.dead)]
    assert len(letters) == 2 and all(lt.error.type == "JobTooLarge" and lt.job is None for lt in letters)
    assert all(lt.raw is not None and len(lt.raw) == 4096 for lt in letters)  # a prefix, not the payload
    assert worker.stats.dead_lettered == 2 and worker.stats.completed == 1
    assert await redis.xlen(keys.jobs) == 0


async def test_a_job_whose_stored_data_is_over_max_job_bytes_is_dead_lettered_unread(redis, redis_url, run_name):
    keys = RunKeys(run_name)
    producer = Producer(redis, run_name, max_job_bytes=1 << 20)  # the data goes to the blob store, read by reference
    async with running_worker(redis_url, run_name, max_job_bytes=4000) as worker:
        await producer.submit("tests.workflows:Echo", {"i": 1, "blob": "x" * 5000}, job_id="big", n=2)
        await producer.submit("tests.workflows:Echo", {"i": 2, "blob": "x" * 1000}, job_id="small")
        trajs = {(t.job_id, t.sample_index): t for t in await collect(producer, {"big": 2, "small": 1})}
    assert trajs["small", 0].status == "ok"
    for i in range(2):
        err = trajs["big", i].error
        assert trajs["big", i].status == "error" and err.type == "JobTooLarge" and "max_job_bytes=4000" in err.message
    letters = [Codec().decode_dead_letter(f[PAYLOAD_FIELD]) for _, f in await redis.xrange(keys.dead)]
    assert len(letters) == 2 and all(lt.error.type == "JobTooLarge" and lt.job.data_ref for lt in letters)
    assert worker.stats.dead_lettered == 2 and worker.stats.completed == 1


async def test_a_trajectory_over_max_trajectory_bytes_is_an_error_result(redis, redis_url, run_name):
    keys = RunKeys(run_name)
    producer = Producer(redis, run_name)
    async with running_worker(redis_url, run_name, max_trajectory_bytes=2000) as worker:
        await producer.submit("tests.workflows:Echo", {"i": 1, "len": 1000}, job_id="long")
        await producer.submit("tests.workflows:Echo", {"i": 2, "len": 10}, job_id="short")
        trajs = {t.job_id: t for t in await collect(producer, {"long": 1, "short": 1})}
    assert trajs["short"].status == "ok"
    long = trajs["long"]
    assert long.status == "error" and long.sequences == [] and long.error.type == "TrajectoryTooLarge"
    assert "max_trajectory_bytes=2000" in long.error.message and "long#0" in long.error.message
    [(_, fields)] = await redis.xrange(keys.dead)
    letter = Codec().decode_dead_letter(fields[PAYLOAD_FIELD])
    assert letter.error.type == "TrajectoryTooLarge" and letter.job.job_id == "long"
    assert worker.stats.dead_lettered == 1 and worker.stats.completed == 1


async def test_the_producer_refuses_a_job_over_max_job_bytes(redis, run_name):
    producer = Producer(redis, run_name, max_job_bytes=2000)
    ok = JobRequest(workflow="tests.workflows:Echo", data={"blob": "x" * 100}, job_id="ok")
    big = JobRequest(workflow="tests.workflows:Echo", data={"blob": "x" * 3000}, job_id="big")
    with pytest.raises(ValueError, match=r"job big encodes to .* over max_job_bytes=2000"):
        await producer.submit_many([ok, big])
    assert await redis.xlen(RunKeys(run_name).jobs) == 0  # nothing of the call was queued
    assert Producer(redis, run_name).max_job_bytes == 16 << 20
