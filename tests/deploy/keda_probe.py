"""What KEDA's Redis Streams scaler asks Redis, command for command, and how it turns the replies into a metric:
read from kedacore/keda v2.20.2 (pkg/scalers/redis_streams_scaler.go, redis_scaler.go) and go-redis v9.19.0 (the
version it pins), so the tests run these queries against a real Redis holding rollq's keys, logged in as the `keda`
user. Nothing here is KEDA's code; the line numbers say where each rule is.

Also the gated workflow the KEDA tests lease jobs with (`tests.deploy.keda_probe:Gated`): it waits for its gate."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from rollq.protocol.keys import WORKER_GROUP
from tests.workflows import trajectory

NIL_LAG = -1  # go-redis v9.19 command.go:2990-3000: a nil `lag` decodes as -1


async def connect(port: int, password: str, host: str = "127.0.0.1") -> aioredis.Redis:
    """As go-redis dials (redis.go:611): HELLO 3 with AUTH keda <password>; then the scaler's PING
    (redis_scaler.go:361, :312 for a cluster)."""
    client = aioredis.Redis(host=host, port=port, username="keda", password=password, protocol=3)
    client.set_response_callback("INFO", lambda reply, **_: reply)  # the text, as go-redis's Info returns it
    assert await client.ping()
    return client


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def lag(client: aioredis.Redis, stream: str, group: str = WORKER_GROUP) -> int:
    """Lag mode (consumerGroup + lagCount, redis_streams_scaler.go:200-269): INFO, the major version >= 7
    (:203-235), XINFO GROUPS (:236): a missing stream reads 0 (:240-242), the group's lag (nil: -1), a stream without
    the group its XLEN (:254-268)."""
    info = _text(await client.execute_command("INFO"))
    version = next(line.split(":", 1)[1] for line in info.splitlines() if line.startswith("redis_version:"))
    assert int(version.split(".")[0]) >= 7, version
    try:
        groups = await client.execute_command("XINFO", "GROUPS", stream)
    except ResponseError as exc:
        if str(exc) == "no such key":  # redis-py drops the "ERR " prefix the scaler compares with
            return 0
        raise
    for g in groups:
        fields = {_text(k): v for k, v in g.items()}
        if _text(fields["name"]) == group:
            return NIL_LAG if fields["lag"] is None else int(fields["lag"])
    return int(await client.xlen(stream))


async def length(client: aioredis.Redis, stream: str) -> int:
    """Length mode (no consumerGroup, redis_streams_scaler.go:192-199): XLEN."""
    return int(await client.xlen(stream))


def active(metric: int, activation: int = 0) -> bool:
    """Every mode's activity (redis_streams_scaler.go:330): the count above activationLagCount."""
    return metric > activation


def formula(text: str, values: dict[str, int]) -> float:
    """The component's scalingModifiers formula (expr-lang; here only names, `+` and `max`) over trigger values."""
    return float(eval(text, {"__builtins__": {}}, {"max": max, **values}))  # the repository's own file


# -- the workflow the tests lease jobs with -------------------------------------------------------------------

GATES: dict[str, asyncio.Event] = {}  # gate name -> opened by the test (same process and loop as the worker)
RUNS: dict[str, int] = {}  # gate name -> how many times a job with it ran


def gate(name: str) -> asyncio.Event:
    return GATES.setdefault(name, asyncio.Event())


class Gated:
    """Holds its sample (leased, running) until the test opens `data['gate']`; then fails its first
    `data['fail']` runs (a retry each, then a dead letter past max_attempts) and otherwise returns a trajectory."""

    async def arun_episode(self, engine, data):
        name = data["gate"]
        await asyncio.wait_for(gate(name).wait(), 60)
        RUNS[name] = RUNS.get(name, 0) + 1
        if RUNS[name] <= data.get("fail", 0):
            raise RuntimeError(f"gate {name}: failing run {RUNS[name]}")
        return trajectory(4)
