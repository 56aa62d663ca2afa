import time

import pytest

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


async def test_an_engine_registers_its_weight_agent_and_only_it_can(redis, run_name):
    """An SGLang engine's entry names its host agent (which gets the admin key with the prepare calls): signed with
    the rest, so a pool with keys takes the agent URL only from the engine's own entry; one added to, moved onto or
    changed in an entry by a Redis writer is refused with the entry. The trainer's static mapping (engine_agents)
    names agents of static engines and wins over an entry."""
    from rollq.engine.registry import control_key
    from rollq.protocol.keys import RunKeys

    key = control_key("api", "admin")
    engine = EngineRegistry(redis, run_name, key=key)
    await engine.register("http://sglang-0:30000", agent_url="http://sglang-0:30010/")
    await engine.register("http://sglang-1:30000")
    pool = EngineRegistry(redis, run_name, key=key)
    assert await pool.live_members() == {"http://sglang-0:30000": "http://sglang-0:30010", "http://sglang-1:30000": ""}
    assert await pool.live() == ["http://sglang-0:30000", "http://sglang-1:30000"]

    far = time.time() + 3600
    signed = engine.entry("http://sglang-1:30000", far)
    added = f"{signed} agent=http://evil:1"  # an agent added to an engine's entry
    agented = engine.entry("http://sglang-0:30000", far, "http://sglang-0:30010")
    changed = agented.replace("sglang-0:30010", "evil:1")  # its agent changed
    stripped = agented.rsplit(" ", 1)[0].replace("sglang-0", "sglang-2", 1)  # the signature moved, agent dropped
    await redis.zadd(RunKeys(run_name).engines, {added: far, changed: far, stripped: far})
    members = await EngineRegistry(redis, run_name, key=key).live_members()
    assert members == {"http://sglang-0:30000": "http://sglang-0:30010", "http://sglang-1:30000": ""}
    with pytest.raises(ValueError, match="agent URL"):
        engine.entry("http://sglang-3:30000", far, "http://two words:1")
    keyless = EngineRegistry(redis, run_name)  # no key to give away: every entry's agent, as its URL
    assert (await keyless.live_members())["http://sglang-2:30000"] == ""
    assert keyless.accepted_member(keyless.entry("http://e:1", far, "http://a:2"), time.time()) == (
        "http://e:1",
        "http://a:2",
    )

    static = EnginePool(
        PoolConfig(
            urls=["http://static:1"],
            agent_urls={"http://static:1/": "http://static:2", "http://sglang-1:30000": "http://mine:3"},
        )
    )
    try:
        await static.sync_registry(EngineRegistry(redis, run_name, key=key))
        agents = {url: m.agent_url for url, m in static.members.items()}
        assert agents == {
            "http://static:1": "http://static:2",
            "http://sglang-0:30000": "http://sglang-0:30010",
            "http://sglang-1:30000": "http://mine:3",
        }
    finally:
        await static.close()
