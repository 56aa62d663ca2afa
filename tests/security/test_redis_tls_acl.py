"""rediss:// with client certificates and the least-privilege users of deploy/redis-acl.conf, on a real redis-server
that only speaks TLS (tests/security/conftest.py)."""

from __future__ import annotations

import pytest
from redis.exceptions import AuthenticationError, ConnectionError, NoPermissionError

from rollq.config import RunSettings
from rollq.producer import Producer
from rollq.protocol.blobs import digest_of
from rollq.protocol.codec import Codec
from rollq.protocol.keys import RunKeys
from rollq.redis_client import arq_settings, redis_client
from tests.helpers import running_worker


def client_for(tls_redis, user: str, password: str | None = None):
    settings = RunSettings(redis_url=tls_redis.url(user, password), run=tls_redis.run, **tls_redis.tls())
    return redis_client(settings.redis_url, retries=0)


async def test_worker_and_producer_round_trip_over_tls_with_role_users(tls_redis):
    producer_redis = client_for(tls_redis, "producer")
    producer = Producer(producer_redis, tls_redis.run)
    consumer = producer.consumer()
    try:
        await consumer.setup()
        async with running_worker(tls_redis.url("worker"), tls_redis.run, concurrency=4, **tls_redis.tls()):
            await producer.submit("tests.workflows:Echo", {"i": 3}, job_id="tls-1", n=2)
            trajs = [t async for t in producer.wait_for({"tls-1": 2}, timeout_s=20, consumer=consumer)]
        assert sorted((t.status, t.sample_index) for t in trajs) == [("ok", 0), ("ok", 1)]
        # The producer user can't reach another run's keys, nor run commands outside its role.
        with pytest.raises(NoPermissionError, match="keys"):
            await producer_redis.xadd("rollq:{other-run}:jobs", {b"d": b"{}"})
        with pytest.raises(NoPermissionError, match="flushall"):
            await producer_redis.flushall()
    finally:
        await producer_redis.aclose()


async def test_a_user_without_a_needed_permission_gets_a_clear_error(tls_redis):
    """The engine role may only touch the engines registry: submitting a job is refused, naming the command."""
    engine_redis = client_for(tls_redis, "engine")
    try:
        await engine_redis.zadd(RunKeys(tls_redis.run).engines, {"http://e:1": 1.0})  # its own job: allowed
        with pytest.raises(NoPermissionError, match="no permissions to run the '[a-z|]+' command"):
            await Producer(engine_redis, tls_redis.run).submit("tests.workflows:Echo", {"i": 1}, job_id="nope")
        # A worker started with the engine's user fails at start-up with Redis's NOPERM message, not a hang.
        with pytest.raises(NoPermissionError, match="(?i)no permissions"):
            async with running_worker(tls_redis.url("engine"), tls_redis.run, **tls_redis.tls()):
                pass
    finally:
        await engine_redis.aclose()


async def test_wrong_password_and_missing_client_certificate_are_clear_errors(tls_redis):
    bad = client_for(tls_redis, "worker", "not-the-password")
    try:
        with pytest.raises(AuthenticationError, match="invalid username-password pair"):
            await bad.ping()
    finally:
        await bad.aclose()
    # TLS without the client certificate: the server (tls-auth-clients yes) drops the handshake.
    no_cert = redis_client(
        RunSettings(redis_url=tls_redis.url("worker"), redis_tls_ca=str(tls_redis.ca)).redis_url, retries=0
    )
    try:
        with pytest.raises(ConnectionError):
            await no_cert.ping()
    finally:
        await no_cert.aclose()


async def test_reward_worker_settings_carry_tls_and_the_user(tls_redis):
    from arq.connections import create_pool

    from rollq.workers.rewards import arq_codec

    settings = arq_settings(RunSettings(redis_url=tls_redis.url("rewards"), **tls_redis.tls()).redis_url)
    assert settings.ssl and settings.username == "rewards" and settings.ssl_certfile == str(tls_redis.cert)
    settings.conn_retries = 0
    pool = await create_pool(
        settings,
        default_queue_name=RunKeys(tls_redis.run).rewards,
        job_serializer=arq_codec.encode,  # never arq's pickle default (tests/security/test_arq_pickle.py)
        job_deserializer=arq_codec.decode,
    )
    try:
        job = await pool.enqueue_job("some_reward", _job_id="tls-arq-1")
        assert job is not None and await job.status() is not None
    finally:
        await pool.aclose()


def test_tls_files_need_a_rediss_url():
    with pytest.raises(ValueError, match="rediss://"):
        RunSettings(redis_url="redis://127.0.0.1:6379/0", redis_tls_ca="/ca.pem")
    with pytest.raises(ValueError, match="go together"):
        RunSettings(redis_url="rediss://127.0.0.1:6379/0", redis_tls_cert="/c.pem")


def test_passwords_in_redis_urls_stay_out_of_logs_and_errors():
    from rollq.redis_client import RedisUnavailable, safe_url

    url = "rediss://worker:s3cret@redis.example:6380/0?ssl_keyfile=/keys/client.key"
    assert safe_url(url) == "rediss://worker@redis.example:6380/0"
    message = str(RedisUnavailable(url, "reading jobs", 61.0, ConnectionError("refused")))
    assert "s3cret" not in message and "client.key" not in message and "redis.example:6380" in message


@pytest.mark.slow
async def test_a_training_run_and_the_ingress_work_as_their_role_users(tls_redis, make_train_config, engine_process):
    """Every role end to end over TLS as its own user: an engine registering itself (`engine`), a worker
    (`worker`), the trainer admitting, consuming and training two steps (`trainer`), and the HTTP ingress admitting
    a job, reporting and cancelling (`producer`)."""
    import io

    import httpx
    import msgspec

    from rollq.engine.pool import EnginePool, PoolConfig
    from rollq.engine.registry import EngineRegistry
    from rollq.trainer.loop import Trainer
    from tests.helpers import wait_until
    from tests.producer.ingress_helpers import running_ingress
    from tests.trainer.helpers import ENGINE_ARGS, WORKFLOW_KWARGS

    tls = tls_redis.tls()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in tls.items()]
    _, engine = await engine_process(
        *ENGINE_ARGS, "--register", "--redis", tls_redis.url("engine"), "--run", tls_redis.run, *flags
    )
    registry_redis = client_for(tls_redis, "trainer")
    try:
        registry = EngineRegistry(registry_redis, tls_redis.run)

        async def registered() -> bool:
            return engine in await registry.live()

        await wait_until(registered, 20, what="the engine registered as user engine")
    finally:
        await registry_redis.aclose()
    cfg = make_train_config(
        redis_url=tls_redis.url("trainer"),
        run=tls_redis.run,
        engine=[engine],
        steps=2,
        group_size=2,
        groups_per_step=2,
        workflow_kwargs=WORKFLOW_KWARGS,
        **tls,
    )
    trainer_redis = redis_client(cfg.redis_url, retries=0)
    pool = EnginePool(PoolConfig(urls=[engine]))
    try:
        async with (
            EnginePool(PoolConfig(urls=[engine])) as workers_pool,
            running_worker(tls_redis.url("worker"), tls_redis.run, concurrency=8, engine=workers_pool, **tls),
        ):
            records = msgspec.to_builtins(await Trainer(cfg, trainer_redis, pool, progress=io.StringIO()).run())
            assert [r["step"] for r in records] == [1, 2]
            async with (
                running_ingress(tls_redis.url("producer"), tls_redis.run, **tls) as (_, base),
                httpx.AsyncClient(timeout=10) as http,
            ):
                auth = {"Authorization": "Bearer tok-acme"}
                # data of 300 bytes: a blob, which the job's end frees (the byte quota's commands, as each role)
                job = {
                    "workflow": "tests.workflows:Echo",
                    "data": {"i": 1, "pad": "x" * 300},
                    "n": 2,
                    "job_id": "acl-1",
                }
                assert (await http.post(f"{base}/v1/jobs", json=job, headers=auth)).status_code == 202

                async def done() -> bool:
                    return (await http.get(f"{base}/v1/jobs/acl-1", headers=auth)).json()["done"]

                await wait_until(done, 20, what="the ingress job done")
                assert (await http.delete(f"{base}/v1/jobs/acl-1", headers=auth)).status_code == 200
                blob = RunKeys(tls_redis.run).blob(digest_of(Codec().encode(job["data"])))
                assert await trainer_redis.exists(blob) == 0  # freed with the job, by the worker's FINISH
    finally:
        await pool.close()
        await trainer_redis.aclose()
