"""KEDA's Redis Streams queries (tests/deploy/keda_probe.py: read from KEDA v2.20.2's scaler) against a real
redis-server and a real Redis Cluster holding rollq's keys, logged in as deploy/redis-acl.conf's `keda` user, while a
real worker leases, acks, retries and dead-letters jobs: the component's metric (its scalingModifiers formula over
the triggers) is the exact count of samples queued or running at every step, never nil, and 0 once drained."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import yaml
from redis.exceptions import NoPermissionError

from rollq.keda import KedaConfig, streams, trigger_name
from rollq.local import Processes, free_port, redis_binary, redis_pings, wait_until, wait_until_sync
from rollq.producer.classes import set_class
from rollq.producer.producer import JobRequest, Producer
from rollq.protocol.keys import WORKER_GROUP, RunKeys, partition_of
from rollq.protocol.messages import JobClass
from tests.deploy import keda_probe as probe
from tests.deploy.acl import KEDA_CLUSTER_RULES, acl_users, for_run
from tests.helpers import REPO_ROOT, running_worker
from tests.redis_cluster import local_cluster

COMPONENT = REPO_ROOT / "deploy" / "kubernetes" / "components" / "keda" / "keda.yaml"
WORKFLOW = "tests.deploy.keda_probe:Gated"
USERS = ("producer", "worker", "keda")


def component_formula() -> str:
    """The committed component's formula, with the names of its default triggers (run toy, partition 0, train)."""
    docs = list(yaml.safe_load_all(COMPONENT.read_text()))
    (so,) = [d for d in docs if d["kind"] == "ScaledObject"]
    return so["spec"]["advanced"]["scalingModifiers"]["formula"]


def formula_for(cfg: KedaConfig) -> str:
    """The component's formula as `rollq keda` writes it for `cfg` (the committed one is the defaults')."""
    from rollq.keda import render

    (so,) = [d for d in yaml.safe_load_all(render(cfg)) if d["kind"] == "ScaledObject"]
    return so["spec"]["advanced"]["scalingModifiers"]["formula"]


class Metrics:
    """One poll of every trigger of `cfg`'s component, as the scaler computes them, and the composite metric."""

    def __init__(self, client: aioredis.Redis, cfg: KedaConfig) -> None:
        self.client, self.cfg, self.formula = client, cfg, formula_for(cfg)

    async def poll(self) -> tuple[dict[str, int], float]:
        values: dict[str, int] = {}
        for p, c, stream in streams(self.cfg):
            values[trigger_name("inflight", p, c)] = await probe.length(self.client, stream)
            values[trigger_name("queued", p, c)] = await probe.lag(self.client, stream)
        return values, probe.formula(self.formula, values)


@pytest.fixture
def acl_redis(tmp_path: Path):
    """redis-server with deploy/redis-acl.conf's producer, worker and keda users for a fresh run."""
    run = f"keda{uuid.uuid4().hex[:6]}"
    passwords = {u: f"pw-{u}-{uuid.uuid4().hex[:8]}" for u in USERS}
    users = acl_users()
    lines = ["user default off"] + [" ".join(["user", u, *for_run(users[u], u, run, passwords[u])]) for u in USERS]
    (tmp_path / "users.acl").write_text("\n".join(lines) + "\n")
    port = free_port()
    conf = tmp_path / "redis.conf"
    conf.write_text(
        f'port {port}\nbind 127.0.0.1\ndir {tmp_path}\nsave ""\nappendonly no\naclfile {tmp_path / "users.acl"}\n'
    )
    with Processes(tmp_path) as procs:
        proc = procs.start("redis", [redis_binary(), str(conf)])
        login = f"keda {passwords['keda']}"  # AUTH user password: the default user is off
        wait_until_sync(lambda: proc.poll() is not None or redis_pings(port, login), 10, what="redis-server")
        procs.check(proc)
        yield port, run, passwords


def url(port: int, user: str, passwords: dict[str, str]) -> str:
    return f"redis://{user}:{passwords[user]}@127.0.0.1:{port}/0"


async def pending(client: aioredis.Redis, stream: str) -> int:
    if not await client.exists(stream):
        return 0
    return int((await client.xpending(stream, WORKER_GROUP))["pending"])


async def test_metrics_follow_queued_leased_retried_and_drained_work(acl_redis):
    port, run, passwords = acl_redis
    cfg = KedaConfig(run=run, partitions=2, job_class=["train", "eval"])
    admin = aioredis.Redis.from_url(url(port, "worker", passwords))  # the test's view: pending counts
    producer_redis = aioredis.Redis.from_url(url(port, "producer", passwords))
    keda = await probe.connect(port, passwords["keda"])
    metrics = Metrics(keda, cfg)
    record: list[tuple[str, dict[str, int], float]] = []
    keys = RunKeys(run)

    async def check(step: str, expected_total: int) -> dict[str, int]:
        """One poll: every XLEN exact, every lag exact (queued = length - pending) or nil (-1: Redis could not
        tell), the composite the exact total, active iff work is left."""
        values, composite = await metrics.poll()
        record.append((step, values, composite))
        for p, c, stream in streams(cfg):
            xlen, lag = values[trigger_name("inflight", p, c)], values[trigger_name("queued", p, c)]
            assert xlen is not None and xlen >= 0
            assert lag in (xlen - await pending(admin, stream), probe.NIL_LAG), (step, stream, xlen, lag)
        assert composite == expected_total, (step, values)
        assert probe.active(int(composite)) == (expected_total > 0), step
        return values

    # eight jobs over both classes and both partitions: r retries once, d fails until dead-lettered
    gates = {f"j{i}": 0 for i in range(6)} | {"r": 1, "d": 5}
    try:
        await check("empty (no stream yet)", 0)
        await set_class(producer_redis, run, JobClass(name="eval"))
        producer = Producer(producer_redis, run, partitions=2)
        jobs = [
            JobRequest(
                workflow=WORKFLOW,
                data={"gate": f"{run}-{name}", "fail": fail},
                job_id=f"{run}-{name}",
                job_class="eval" if i % 2 else "train",
            )
            for i, (name, fail) in enumerate(gates.items())
        ]
        assert {partition_of(j.job_id, 2) for j in jobs} == {0, 1}
        await producer.submit_many(jobs)
        # the producer made the `workers` group on every class's stream of every partition before any worker ran
        for _, _, stream in streams(cfg):
            groups = await keda.execute_command("XINFO", "GROUPS", stream)
            assert [probe._text(g["name"] if "name" in g else g[b"name"]) for g in groups] == [WORKER_GROUP]
        values = await check("queued (no worker)", 8)
        assert sum(v for k, v in values.items() if k.startswith("queued")) == 8  # lag = all of it, no nil

        async with running_worker(
            url(port, "worker", passwords), run, concurrency=7, max_attempts=2, classes_refresh_ms=200
        ) as worker:  # 7 slots: the 6 held jobs leave one for r and d, whenever they are read
            await wait_until(lambda: len(worker._running) == 7, 10, what="7 samples leased")
            await check("leased 7, 1 queued", 8)
            for name in ("r", "d"):  # open them whether they run yet or not; the worker retries and dead-letters
                probe.gate(f"{run}-{name}").set()
            dead = keys.at(partition_of(f"{run}-d", 2)).dead

            async def settled() -> bool:
                return await admin.xlen(dead) == 1 and probe.RUNS.get(f"{run}-r") == 2

            await wait_until(settled, 20, what="r retried and done, d dead-lettered")
            await wait_until(lambda: len(worker._running) == 6, 10, what="the 6 held samples leased")
            await check("r retried+done, d dead, 6 leased", 6)
            for name in list(gates)[:6]:
                probe.gate(f"{run}-{name}").set()

            async def drained() -> bool:
                return sum([await admin.xlen(s) for _, _, s in streams(cfg)]) == 0

            await wait_until(drained, 20, what="every job stream empty")
            await check("drained", 0)
        print("\nKEDA metrics through the cycle (trigger values, then the composite metric):")
        for step, values, composite in record:
            print(f"  {step:40} {values} -> {composite:g}")
    finally:
        for name in gates:
            probe.gate(f"{run}-{name}").set()  # a failed step: let the worker drain at once
        for client in (admin, producer_redis, keda):
            await client.aclose()


async def test_lag_reads_nil_while_a_draining_worker_leaves_work_queued_and_the_metric_stays_exact(acl_redis):
    """Redis cannot tell the lag once the entry the group delivered last is deleted while an older one is still in
    the stream: here a worker told to stop (a scale-down) finishes its newer sample while the older one runs and a
    third waits. XINFO GROUPS then says nil, go-redis -1, KEDA "no work"; the stream length still says 2, and so does
    the component's formula (a formula on the lag alone would read -1 and let the pool go)."""
    port, run, passwords = acl_redis
    cfg = KedaConfig(run=run)
    stream = RunKeys(run).jobs
    producer_redis = aioredis.Redis.from_url(url(port, "producer", passwords))
    keda = await probe.connect(port, passwords["keda"])
    names = [f"{run}-a", f"{run}-b", f"{run}-c"]
    try:
        producer = Producer(producer_redis, run)
        for name in names:  # one call each: a, b, c in this order on the stream
            await producer.submit(WORKFLOW, {"gate": name}, job_id=name)
        async with running_worker(url(port, "worker", passwords), run, concurrency=2) as worker:
            await wait_until(lambda: len(worker._running) == 2, 10, what="a and b leased")
            worker.request_stop()  # it reads nothing more: c stays queued
            probe.gate(names[1]).set()  # b, the newest delivered, finishes first
            await wait_until(lambda: len(worker._running) == 1, 10, what="b acked and deleted")
            values, composite = await Metrics(keda, cfg).poll()
            print(f"\nwhile draining (a running, c queued): {values} -> {composite:g}")
            assert values == {"inflight_p0_train": 2, "queued_p0_train": probe.NIL_LAG}
            assert composite == 2 and probe.active(int(composite))
            assert probe.formula(component_formula(), values) == 2  # the committed component reads the same
            probe.gate(names[0]).set()
            probe.gate(names[2]).set()
        assert await probe.length(keda, stream) == 1  # c: queued for the next worker, still counted
    finally:
        for name in names:
            probe.gate(name).set()  # a failed step: let the worker drain at once
        for client in (producer_redis, keda):
            await client.aclose()


async def test_the_keda_user_reads_the_job_streams_and_nothing_else(acl_redis):
    port, run, passwords = acl_redis
    keda = await probe.connect(port, passwords["keda"])
    keys = RunKeys(run)
    try:
        for stream in (keys.jobs, keys.job_stream("eval"), keys.at(3).jobs, keys.at(3).job_stream("eval")):
            assert await probe.length(keda, stream) == 0 and await probe.lag(keda, stream) == 0
        for denied in (
            lambda: keda.xlen(keys.results),  # not a job stream
            lambda: keda.xlen(RunKeys("other").jobs),  # another run's
            lambda: keda.xadd(keys.jobs, {"d": "x"}),  # a write
            lambda: keda.xrange(keys.jobs),  # the jobs' content
            lambda: keda.execute_command("XINFO", "STREAM", keys.jobs),  # entries, via XINFO
            lambda: keda.get(keys.ledger),
        ):
            with pytest.raises(NoPermissionError):
                await denied()
    finally:
        await keda.aclose()


def test_cluster_queries_as_go_redis_sends_them(tmp_path):
    """On a real Redis Cluster (three primaries), as the `keda` user with the cluster rules compose.yaml gives it:
    go-redis's cluster client asks CLUSTER SLOTS and COMMAND (osscluster.go:1500, :2266), sends INFO and PING to a
    primary picked round robin, XLEN to the stream's primary and XINFO GROUPS by the slot of its second word
    (command.go:273-301 has no key position for it: MOVED, then the stream's primary); every partition's streams
    are read while a producer queues and a worker leases and finishes."""
    run = f"kc{uuid.uuid4().hex[:6]}"
    password = "pw-keda-cluster"
    rules = for_run(acl_users()["keda"], "keda", run, password) + list(KEDA_CLUSTER_RULES)
    with local_cluster(replicas=0, directory=str(tmp_path / "cluster")) as cluster:
        primaries = cluster.nodes
        for node in primaries:
            with node.client() as c:
                c.execute_command("ACL", "SETUSER", "keda", *rules)
        asyncio.run(_cluster_cycle(cluster.url, run, password, [n.port for n in primaries]))


def two_ids_per_partition(run: str, partitions: int) -> list[str]:
    """Job ids `RUN-i`, the first two that land on each partition (all six of `RUN-0`..`RUN-5` share one for 1 run
    name in about 235)."""
    names: list[str] = []
    for i in range(10_000):
        name = f"{run}-{i}"
        if sum(partition_of(n, partitions) == partition_of(name, partitions) for n in names) < 2:
            names.append(name)
        if len(names) == 2 * partitions:
            return names
    raise AssertionError(f"no two ids per partition among {run}-0..9999")


async def _cluster_cycle(seed: str, run: str, password: str, ports: list[int]) -> None:
    from redis.cluster import key_slot

    cfg = KedaConfig(run=run, partitions=3, cluster=True)
    clients = {port: await probe.connect(port, password) for port in ports}
    slots = await clients[ports[0]].execute_command("CLUSTER", "SLOTS")  # slot -> primary, as go-redis reads it
    assert await clients[ports[0]].execute_command("COMMAND")  # go-redis's command table, allowed

    def port_of(key: str) -> int:
        slot = key_slot(key.encode())
        for row in slots:
            if row[0] <= slot <= row[1]:
                return int(row[2][1])
        raise AssertionError(f"no primary for slot {slot}")

    async def poll() -> tuple[dict[str, int], float]:
        values: dict[str, int] = {}
        for port in ports:  # INFO (lag mode's version check) answers on every primary
            assert "redis_version:" in probe._text(await clients[port].execute_command("INFO"))
        for p, c, stream in streams(cfg):
            first = clients[port_of("groups")]  # where go-redis sends XINFO GROUPS first
            try:
                await first.execute_command("XINFO", "GROUPS", stream)
                redirected = False
            except Exception as exc:
                assert "MOVED" in str(exc) or "no such key" in str(exc), exc
                redirected = "MOVED" in str(exc)
            assert redirected == (port_of("groups") != port_of(stream))
            client = clients[port_of(stream)]
            values[trigger_name("inflight", p, c)] = await probe.length(client, stream)
            values[trigger_name("queued", p, c)] = await probe.lag(client, stream)
        return values, probe.formula(formula_for(cfg), values)

    admin = aioredis.RedisCluster.from_url(seed)
    record = []
    try:
        record.append(("empty", *(await poll())))
        assert record[-1][2] == 0
        producer = Producer(admin, run, partitions=3)
        names = two_ids_per_partition(run, 3)  # six ids of the run's own: any six could share a partition
        await producer.submit_many([JobRequest(workflow=WORKFLOW, data={"gate": n}, job_id=n) for n in names])
        assert sorted(partition_of(n, 3) for n in names) == [0, 0, 1, 1, 2, 2]
        record.append(("queued", *(await poll())))
        assert record[-1][2] == 6
        async with running_worker(seed, run, concurrency=2, redis_cluster=True) as worker:
            await wait_until(lambda: len(worker._running) == 2, 15, what="2 samples leased")
            record.append(("leased 2, 4 queued", *(await poll())))
            assert record[-1][2] == 6
            for n in names:
                probe.gate(n).set()

            async def drained() -> bool:
                return sum([await admin.xlen(s) for _, _, s in streams(cfg)]) == 0

            await wait_until(drained, 20, what="every job stream empty")
        record.append(("drained", *(await poll())))
        assert record[-1][2] == 0 and all(v == 0 for v in record[-1][1].values())
        print("\nKEDA metrics on a Redis Cluster (3 partitions):")
        for step, values, composite in record:
            print(f"  {step:22} {values} -> {composite:g}")
    finally:
        await admin.aclose()
        for client in clients.values():
            await client.aclose()
