from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.registry import EngineRegistry


async def test_engines_join_and_leave_the_pool_through_the_registry(redis, run_name):
    registry = EngineRegistry(redis, run_name, ttl_s=5)
    pool = EnginePool(PoolConfig(urls=["http://static:1"]))
    try:
        await registry.register("http://a:1/")
        await registry.register("http://b:1")
        await pool.sync_registry(registry)
        assert sorted(pool.members) == ["http://a:1", "http://b:1", "http://static:1"]
        await registry.deregister("http://a:1")
        await pool.sync_registry(registry)
        assert sorted(pool.members) == ["http://b:1", "http://static:1"]  # static members stay
    finally:
        await pool.close()


async def test_a_registration_that_is_not_renewed_expires(redis, run_name):
    registry = EngineRegistry(redis, run_name, ttl_s=0.05)
    await registry.register("http://gone:1")
    key = registry.key
    # Expiry is a score in the past once the TTL has run out; move it there instead of sleeping.
    await redis.zadd(key, {"http://gone:1": 1.0})
    assert await registry.live() == []
    assert await redis.zcard(key) == 0
