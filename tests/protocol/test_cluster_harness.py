"""The local Redis Cluster harness: a real six-node cluster, a primary SIGKILLed, the async cluster client recovers."""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ClusterDownError, ConnectionError, MasterDownError, TimeoutError, TryAgainError

from tests.redis_cluster import LocalCluster, local_cluster

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("redis-cli") is None, reason="redis-server not installed"
)

TRANSIENT = (ConnectionError, TimeoutError, ClusterDownError, TryAgainError, MasterDownError)


@pytest.fixture
def cluster() -> LocalCluster:
    with local_cluster(node_timeout_ms=1000) as c:
        yield c


async def test_async_client_survives_primary_failover(cluster: LocalCluster) -> None:
    client = RedisCluster.from_url(cluster.url)
    try:
        await client.set("{a}:k", "1")
        await client.set("{b}:k", "1")
        assert await client.get("{a}:k") == b"1"

        victim = cluster.primary_for("{a}")
        cluster.kill(victim)
        promoted = await asyncio.to_thread(cluster.wait_failover, victim, 10.0)
        assert promoted is not victim
        assert cluster.primary_for("{a}") is promoted

        deadline = time.monotonic() + 10.0
        while True:
            try:
                await client.set("{a}:k", "2")
                assert await client.get("{a}:k") == b"2"
                break
            except TRANSIENT:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        assert await client.get("{b}:k") == b"1"

        await asyncio.to_thread(cluster.restart, victim)
        assert victim in cluster.replicas_of(promoted)
        assert await client.get("{a}:k") == b"2"
    finally:
        await client.aclose()
